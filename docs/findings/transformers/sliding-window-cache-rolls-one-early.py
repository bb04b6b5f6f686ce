"""Standalone reproduction (torch and transformers 4.42 to 4.52; no kvcheck needed):
SlidingWindowCache in transformers 4.42.4 and 4.46.3 rolls its buffer when a write
reaches the last slot, not when it goes past it. With a window of W = 6, a 4-token prompt
and one token per step, the cache drops token 0 while it writes token 5, but token 5 must
still attend to token 0 (a window of W includes the query's own token). The roll also
leaves one zeroed slot in the buffer. Mistral's mask lets the queries attend to that slot,
and it stays in the buffer until token 2W - 2. So tokens W - 1 .. 2W - 3 each miss the
oldest token of their window and attend to a zero key instead. 4.52.4 rolls only once the
buffer is passed (fixed).

    python sliding-window-cache-rolls-one-early.py          # SlidingWindowCache as shipped
    python sliding-window-cache-rolls-one-early.py --fixed  # the same with the suggested update()

Two checks, both printed: (1) the cache alone, driven as MistralAttention drives it (keys
rotated at absolute positions, cache_kwargs with cache_position), with Mistral's mask for a
SlidingWindowCache, against attention over a window of W; (2) a one-layer
MistralForCausalLM with random weights, decoding with the cache, against the same model
with use_cache=False.

Exit status 1 when any query's attention differs from a window of W (the bug), 0 when all
agree."""

import sys
import warnings

import torch
import transformers
from transformers import MistralConfig, MistralForCausalLM
from transformers.cache_utils import SlidingWindowCache  # 4.42 does not export it at the top level

warnings.filterwarnings("ignore")

W, HEADS, HEAD_DIM, PROMPT, TOKENS = 6, 2, 8, 4, 12


class RollWhenPassed(SlidingWindowCache):
    """The suggested fix: 4.46.3's update with the roll decided on the unclamped position,
    before the clamp (`cache_position >= max_cache_len` instead of `clamped >= max_cache_len
    - 1`): the buffer rolls when a write goes past its last slot, not when it reaches it."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        cache_position = cache_kwargs.get("cache_position")
        if cache_position.shape[0] > self.max_cache_len:  # a prompt longer than the window: unchanged
            return super().update(key_states, value_states, layer_idx, cache_kwargs)
        k_cache, v_cache = self.key_cache[layer_idx], self.value_cache[layer_idx]
        slicing = torch.ones(self.max_cache_len, dtype=torch.long, device=value_states.device).cumsum(0)
        to_shift = cache_position >= self.max_cache_len  # was: clamped position >= max_cache_len - 1
        cache_position = cache_position.clamp(0, self.max_cache_len - 1)
        indices = (slicing + to_shift[-1].int() - 1) % self.max_cache_len
        k_out = k_cache[:, :, indices].index_copy(2, cache_position, key_states.to(k_cache.dtype))
        v_out = v_cache[:, :, indices].index_copy(2, cache_position, value_states.to(v_cache.dtype))
        k_cache.copy_(k_out)
        v_cache.copy_(v_out)
        return k_out, v_out


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


def mistral_mask(cache_position, columns):
    """The mask Mistral (4.42 to 4.52) builds when the cache is a SlidingWindowCache and the
    chunk is at most W tokens: column j is visible to the query at cache position p iff
    j <= p (no window term: the buffer is trusted to hold only the window)."""
    return torch.arange(columns)[None, :] <= cache_position[:, None]


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
    steps = [(0, PROMPT)] + [(p, p + 1) for p in range(PROMPT, TOKENS)]
    print("%s (transformers %s), W = %d, a %d-token prompt then one token per step:"
          % (cls.__name__, transformers.__version__, W, PROMPT))
    print("  query  must attend to (window of W)  actually attends to (Mistral's mask over the buffer)  max |out - ref|")
    wrong = []
    for start, end in steps:
        cache_position = torch.arange(start, end)
        _, (cos, sin) = rope(k_raw[:, :, start:end], cache_position)
        keys, values = cache.update(k[:, :, start:end], v[:, :, start:end], 0,
                                    {"sin": sin, "cos": cos, "cache_position": cache_position})
        visible = mistral_mask(cache_position, keys.shape[2])
        out = attend(q[:, :, start:end], keys, values, visible)
        names = held_tokens(keys, k)
        for i, p in enumerate(range(start, end)):
            window = list(range(max(0, p - W + 1), p + 1))
            ref = attend(q[:, :, p:p + 1], k[:, :, window], v[:, :, window], torch.ones(1, len(window), dtype=bool))
            diff = (out[:, :, i] - ref[:, :, 0]).abs().max().item()
            seen = [names[j] for j in range(keys.shape[2]) if visible[i, j]]
            shown = ", ".join("zero slot" if t is None else str(t) for t in seen)
            if start >= PROMPT or p == end - 1:
                print("  %5d  %-28s  %-53s  %.3g" % (p, "%d..%d" % (window[0], window[-1]), shown, diff))
            if seen != window or diff > 1e-5:
                wrong.append(p)
    print("  queries whose attention is not the window of W: %s" % (wrong or "none"))
    return wrong


def model_check(cls):
    """A one-layer MistralForCausalLM (random weights, eager attention): logits decoding with
    the cache against the same model on the whole sequence with use_cache=False."""
    torch.manual_seed(0)
    model = MistralForCausalLM(config()).eval()
    ids = torch.randint(0, 64, (1, TOKENS))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits[0]
        cache = cls(config(), 1, 64, "cpu", torch.float32)
        diffs = [(model(ids[:, :PROMPT], past_key_values=cache, cache_position=torch.arange(PROMPT),
                        use_cache=True).logits[0] - reference[:PROMPT]).abs().max().item()]
        for p in range(PROMPT, TOKENS):
            logits = model(ids[:, p:p + 1], past_key_values=cache, cache_position=torch.tensor([p]),
                           use_cache=True).logits[0, -1]
            diffs.append((logits - reference[p]).abs().max().item())
    print("MistralForCausalLM, 1 layer, W = %d, with %s vs use_cache=False: max |logit diff| per position"
          % (W, cls.__name__))
    print("  prompt 0..%d: %.3g" % (PROMPT - 1, diffs[0]))
    print("  " + "  ".join("%d: %.3g" % (p, d) for p, d in zip(range(PROMPT, TOKENS), diffs[1:])))
    wrong = [p for p, d in zip(range(PROMPT, TOKENS), diffs[1:]) if d > 1e-4]
    print("  positions whose logits differ: %s" % (wrong or "none"))
    return wrong


def main():
    cls = RollWhenPassed if "--fixed" in sys.argv else SlidingWindowCache
    wrong = cache_check(cls)
    print()
    wrong_in_model = model_check(cls)
    return 1 if wrong or wrong_in_model else 0


if __name__ == "__main__":
    sys.exit(main())
