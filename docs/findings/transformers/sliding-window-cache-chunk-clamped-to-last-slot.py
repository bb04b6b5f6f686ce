"""Standalone reproduction (torch and transformers 4.42 to 4.52; no kvcheck needed): a chunk
of several tokens that crosses the end of SlidingWindowCache's buffer is written wrongly in
every 4.x release that has the class (4.42.4, 4.46.3, 4.52.4). With a window of W = 8, a
5-token prompt, then a chunk of 6 tokens (positions 5..10, for example a second turn
prefilled in one forward), the buffer rolls by one slot only and the chunk's positions are
clamped to W - 1. Tokens 7, 8, 9 and 10 are all written to slot 7, and only one of them
stays there. The chunk's queries see tokens outside their window (1 and 2), miss tokens
inside it (0 for tokens 5..7; 7, 8 and 9 for tokens 8..10), and tokens 7..9 see token 10,
a later token. The buffer stays wrong through the decode steps that follow.

    python sliding-window-cache-chunk-clamped-to-last-slot.py          # SlidingWindowCache as shipped
    python sliding-window-cache-chunk-clamped-to-last-slot.py --fixed  # the same with the suggested update()

Two checks, both printed: (1) the cache alone, driven as MistralAttention drives it (keys
rotated at absolute positions, cache_kwargs with cache_position), with Mistral's mask for a
SlidingWindowCache, against attention over a window of W; (2) a one-layer
MistralForCausalLM with random weights, fed the same schedule with the cache, against the
same model with use_cache=False.

Exit status 1 when any query's attention differs from a window of W (the bug), 0 when all
agree."""

import sys
import warnings

import torch
import transformers
from transformers import MistralConfig, MistralForCausalLM
from transformers.cache_utils import SlidingWindowCache  # 4.42 does not export it at the top level

warnings.filterwarnings("ignore")

W, HEADS, HEAD_DIM, TOKENS = 8, 2, 8, 14
STEPS = [(0, 5), (5, 11)] + [(p, p + 1) for p in range(11, TOKENS)]  # a prompt of 5, a chunk of 6, 3 decodes


class ChunkKeepsItsWindow(SlidingWindowCache):
    """The suggested fix. The buffer holds the last W tokens in temporal order. A write that
    passes the buffer's end returns the tokens held before it followed by the new ones, so
    every query of a chunk has its whole window, then keeps the last W of them. A single
    token still gets the buffer back, as today. The roll is decided on the unclamped
    position, which also fixes the early roll of 4.42/4.46. The model's mask must then cover
    the columns returned (returned_columns below): column c holds position end - columns + c."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        cache_position = cache_kwargs.get("cache_position")
        k_cache, v_cache = self.key_cache[layer_idx], self.value_cache[layer_idx]
        key_states, value_states = key_states.to(k_cache.dtype), value_states.to(v_cache.dtype)
        seen, end = int(cache_position[0]), int(cache_position[-1]) + 1
        if end <= self.max_cache_len:  # nothing leaves the window: write in place, slot = position
            k_cache.index_copy_(2, cache_position, key_states)
            v_cache.index_copy_(2, cache_position, value_states)
            return k_cache, v_cache
        held = min(seen, self.max_cache_len)  # slots 0..held-1 hold positions seen-held..seen-1
        k_all = torch.cat([k_cache[:, :, :held], key_states], dim=2)
        v_all = torch.cat([v_cache[:, :, :held], value_states], dim=2)
        k_cache.copy_(k_all[:, :, -self.max_cache_len:])
        v_cache.copy_(v_all[:, :, -self.max_cache_len:])
        if cache_position.shape[0] == 1:  # a decode: its window is exactly the buffer
            return k_cache, v_cache
        return k_all, v_all


def returned_columns(cls, start, end):
    """How many key columns update() returns for positions start..end-1."""
    if cls is ChunkKeepsItsWindow and end > W and end - start > 1:
        return min(start, W) + end - start
    return max(W, end - start)


def config():
    cfg = MistralConfig(vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=HEADS, num_key_value_heads=HEADS, sliding_window=W,
                        max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return cfg


def rope(x, positions, theta=10000.0):
    """Rotary embedding in transformers' rotate_half layout, at the given absolute positions.
    Returns the rotated x [B, H, n, D] and (cos, sin) [B, n, D] as Mistral passes them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin, (cos[None], sin[None])


def model_mask(cache_position, columns):
    """Boolean [n, columns], True: visible. Up to W columns: the mask Mistral (4.42 to 4.52)
    builds for a SlidingWindowCache and a chunk of at most W tokens, column j visible to the
    query at cache position p iff j <= p (no window term: the buffer is trusted to hold only
    the window). More columns (only the fix returns them here): column c holds position
    end - columns + c, visible iff p - W < position <= p."""
    p = cache_position[:, None]
    if columns <= W:
        return torch.arange(columns)[None, :] <= p
    column_positions = torch.arange(columns)[None, :] + int(cache_position[-1]) + 1 - columns
    return (column_positions <= p) & (column_positions > p - W)


def held_tokens(keys, all_keys):
    """Which token each returned column holds, found by exact equality with the rotated keys
    (None: an all-zero slot, never written or zeroed by a roll)."""
    names = []
    for j in range(keys.shape[2]):
        column = keys[0, :, j]
        if not column.any():
            names.append(None)
            continue
        match = [t for t in range(all_keys.shape[2]) if torch.equal(column, all_keys[0, :, t])]
        names.append(match[0] if match else "?")
    return names


def show(names):
    return ", ".join("zero slot" if t is None else str(t) for t in names)


def attend(q, keys, values, visible):
    scores = (q @ keys.transpose(-1, -2)) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ values


def cache_check(cls):
    torch.manual_seed(0)
    q_raw, k_raw, v = (torch.randn(1, HEADS, TOKENS, HEAD_DIM) for _ in range(3))
    positions = torch.arange(TOKENS)
    q, _ = rope(q_raw, positions)
    k, _ = rope(k_raw, positions)
    cache = cls(config(), 1, 64, "cpu", torch.float32)  # positional: 4.42 and 4.52 say max_batch_size, 4.46 batch_size
    print("%s (transformers %s), W = %d, a 5-token prompt, a chunk of 6 (positions 5..10), 3 decodes:"
          % (cls.__name__, transformers.__version__, W))
    print("  query  must attend to (window of W)  actually attends to (the model's mask over what update() returns)"
          "  max |out - ref|")
    wrong = []
    for start, end in STEPS:
        cache_position = torch.arange(start, end)
        _, (cos, sin) = rope(k_raw[:, :, start:end], cache_position)
        keys, values = cache.update(k[:, :, start:end], v[:, :, start:end], 0,
                                    {"sin": sin, "cos": cos, "cache_position": cache_position})
        visible = model_mask(cache_position, keys.shape[2])
        out = attend(q[:, :, start:end], keys, values, visible)
        names = held_tokens(keys, k)
        for i, p in enumerate(range(start, end)):
            window = list(range(max(0, p - W + 1), p + 1))
            ref = attend(q[:, :, p:p + 1], k[:, :, window], v[:, :, window], torch.ones(1, len(window), dtype=bool))
            diff = (out[:, :, i] - ref[:, :, 0]).abs().max().item()
            seen = [names[j] for j in range(keys.shape[2]) if visible[i, j]]
            if start > 0:
                print("  %5d  %-28s  %-66s  %.3g" % (p, "%d..%d" % (window[0], window[-1]), show(seen), diff))
            if seen != window or diff > 1e-5:
                wrong.append(p)
        if start == 5:
            print("  (buffer after the chunk, slots 0..%d: %s)" % (W - 1, show(held_tokens(cache.key_cache[0], k))))
    print("  queries whose attention is not the window of W: %s" % (wrong or "none"))
    return wrong


def model_check(cls):
    """A one-layer MistralForCausalLM (random weights, eager attention) fed the same schedule
    with the cache, against the same model on the whole sequence with use_cache=False. The
    fix returns more than W columns for the chunk; the script then hands the model the 4-D
    mask of model_mask (0 visible, dtype min hidden), which a patched model would build."""
    torch.manual_seed(0)
    model = MistralForCausalLM(config()).eval()
    ids = torch.randint(0, 64, (1, TOKENS))
    diffs = []
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits[0]
        cache = cls(config(), 1, 64, "cpu", torch.float32)
        for start, end in STEPS:
            cache_position = torch.arange(start, end)
            columns = returned_columns(cls, start, end)
            mask = None
            if columns > W:
                visible = model_mask(cache_position, columns)
                mask = torch.zeros(1, 1, end - start, columns).masked_fill(~visible, torch.finfo(torch.float32).min)
            logits = model(ids[:, start:end], attention_mask=mask, past_key_values=cache,
                           cache_position=cache_position, use_cache=True).logits[0]
            diffs += (logits - reference[start:end]).abs().amax(-1).tolist()
    print("MistralForCausalLM, 1 layer, W = %d, with %s vs use_cache=False: max |logit diff| per position"
          % (W, cls.__name__))
    print("  " + "  ".join("%d: %.3g" % (p, d) for p, d in enumerate(diffs)))
    wrong = [p for p, d in enumerate(diffs) if d > 1e-4]
    print("  positions whose logits differ: %s" % (wrong or "none"))
    return wrong


def main():
    cls = ChunkKeepsItsWindow if "--fixed" in sys.argv else SlidingWindowCache
    wrong = cache_check(cls)
    print()
    wrong_in_model = model_check(cls)
    return 1 if wrong or wrong_in_model else 0


if __name__ == "__main__":
    sys.exit(main())
