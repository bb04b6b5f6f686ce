"""Standalone reproduction (torch + transformers 4.42.4, 4.46.3 or 4.52.4; no kvcheck needed):
SinkCache stores a first chunk longer than its window whole, and the next decode keeps
the wrong keys at the wrong positions.

SinkCache(window_length=12, num_sink_tokens=4) gets a 30-token prompt in one update(),
driven as a Llama-style model drives it (keys rotated at positions 0..29 before update(),
the chunk's cos/sin in cache_kwargs), then one token per step. An empty cache appends the
chunk as it comes, so after the prompt it holds 30 slots, not the 4 sinks plus the 8 most
recent tokens (12). The first decode then keeps tokens 23..29 but re-rotates them back by
one position only (it assumes the cache was full, not 18 tokens over), so they sit at
positions 22..28 where StreamingLLM puts them at 4..10.

The prompt's own forward is not judged: the cache returns all 30 keys and the model's
causal mask decides (StreamingLLM's reference code prefills densely too). Decode tokens
are rotated at StreamingLLM's cache position t - E(t), E(t) = max(0, t + 1 - W).

    python sink-cache-keeps-a-long-prompt-whole.py          # the stock class
    python sink-cache-keeps-a-long-prompt-whole.py --fixed  # with the suggested fix

Exit status 1 when the cache holds more than window_length slots after the prompt or a
decode sees a key at the wrong position (the bug), 0 when all matches StreamingLLM."""

import sys
import warnings

warnings.filterwarnings("ignore")  # SinkCache is deprecated (4.52 warns at every construction)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import SinkCache  # noqa: E402

SINKS, WINDOW, PROMPT, DECODES = 4, 12, 30, 6
HEADS, HEAD_DIM, BASE = 2, 8, 10000.0


class TrimmedPromptSinkCache(SinkCache):
    """The suggested fix, as a subclass: a first chunk longer than window_length is returned
    whole for its own forward (the model's causal mask applies), but stored as StreamingLLM
    keeps it: the sinks, then the last window_length - num_sink_tokens tokens re-rotated
    back by the number evicted (n - window_length). Only the empty-cache branch changes."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        n = key_states.shape[-2]
        if len(self.key_cache) > layer_idx or n <= self.window_length:
            return super().update(key_states, value_states, layer_idx, cache_kwargs)
        cache_kwargs = cache_kwargs or {}
        cos, sin = cache_kwargs.get("cos"), cache_kwargs.get("sin")
        rotary = cache_kwargs.get("partial_rotation_size")
        recent = self.window_length - self.num_sink_tokens
        keys = key_states[:, :, -recent:]
        if cos is not None and sin is not None:
            # Rows of the chunk's tables are its positions 0..n-1 (a first chunk).
            cos, sin = (cos if cos.dim() == 2 else cos[0]), (sin if sin.dim() == 2 else sin[0])
            if layer_idx == 0:
                self._cos_cache, self._sin_cache = cos[: self.window_length], sin[: self.window_length]
            cos, sin = cos.float(), sin.float()
            old_cos, old_sin = cos[n - recent : n], sin[n - recent : n]  # where the kept keys are
            targets = slice(self.num_sink_tokens, self.window_length)  # the cache positions they go to
            new_cos, new_sin = cos[targets], sin[targets]
            shift_cos = (old_cos * new_cos + old_sin * new_sin).to(keys.dtype)  # cos(new - old)
            shift_sin = (old_cos * new_sin - old_sin * new_cos).to(keys.dtype)  # sin(new - old)
            rotated, passed = (keys[..., :rotary], keys[..., rotary:]) if rotary else (keys, keys[..., :0])
            keys = torch.cat([self._apply_key_rotary_pos_emb(rotated, shift_cos, shift_sin), passed], dim=-1)
        if layer_idx == 0:
            self._seen_tokens += n
        self.key_cache.append(torch.cat([key_states[:, :, : self.num_sink_tokens], keys], dim=-2))
        self.value_cache.append(torch.cat([value_states[:, :, : self.num_sink_tokens], value_states[:, :, -recent:]],
                                          dim=-2))
        return key_states, value_states


def cos_sin(positions):
    """Llama's RoPE tables for the given positions: [1, n, HEAD_DIM] each (rotate_half)."""
    inv_freq = 1.0 / BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float()[None], emb.sin().float()[None]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x, positions):
    """x [..., n, HEAD_DIM] rotated at positions (one per row of n)."""
    cos, sin = cos_sin(positions)
    return x * cos + rotate_half(x) * sin


def kept(t):
    """StreamingLLM after token t (the window counts t itself): {token: cache position}."""
    e = max(0, t + 1 - WINDOW)
    return {u: (u if u < SINKS else u - e) for u in list(range(SINKS)) + list(range(SINKS + e, t + 1))}


def recover(stored, raw):
    """The position p with stored == rotate(raw, p) over all heads, or None."""
    best, err = None, None
    for p in range(-64, 65):
        e = (stored - rotate(raw[:, None, :], [p])[:, 0, :]).abs().max().item()
        if err is None or e < err:
            best, err = p, e
    return best if err < 1e-4 else None


def held(cache, tokens, v_raw, k_raw):
    """[(token, position)] of every slot layer 0 holds (tokens matched by their values)."""
    keys, values = cache.key_cache[0][0], cache.value_cache[0][0]
    slots = []
    for j in range(keys.shape[-2]):
        u = min(range(tokens), key=lambda u: (values[:, j] - v_raw[:, u]).abs().max().item())
        slots.append((u, recover(keys[:, j], k_raw[:, u])))
    return slots


def attend(q, keys, values):
    """One query [H, D] over keys/values [H, n, D]: [H, D]."""
    scores = torch.einsum("hd,hnd->hn", q, keys) / HEAD_DIM ** 0.5
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), values)


def table(slots, want, pq):
    print("  slot  token   position expected  actual   query-key distance expected  actual")
    for j, (u, p) in enumerate(slots):
        e = want.get(u)
        print("  %4d  %5d   %17s  %6s   %27s  %6s%s" % (
            j, u, "evicted" if e is None else e, "?" if p is None else p, "-" if e is None or pq is None else pq - e,
            "-" if p is None or pq is None else pq - p, "" if e is not None and p == e else "  <- wrong"))


def main():
    cls = TrimmedPromptSinkCache if "--fixed" in sys.argv else SinkCache
    torch.manual_seed(0)
    tokens = PROMPT + DECODES
    q_raw, k_raw, v_raw = (torch.randn(HEADS, tokens, HEAD_DIM) for _ in range(3))
    cache = cls(WINDOW, SINKS)
    print("transformers %s, torch %s: %s(window_length=%d, num_sink_tokens=%d), a %d-token prompt in one update(), "
          "then %d single-token decodes" % (transformers.__version__, torch.__version__, cls.__name__, WINDOW, SINKS,
                                             PROMPT, DECODES))

    prompt = list(range(PROMPT))
    cos, sin = cos_sin(prompt)
    returned, _ = cache.update(rotate(k_raw[None, :, :PROMPT], prompt), v_raw[None, :, :PROMPT].clone(), 0,
                               {"cos": cos, "sin": sin, "cache_position": torch.tensor(prompt)})
    slots, want = held(cache, tokens, v_raw, k_raw), kept(PROMPT - 1)
    print("\nstep 0, the prompt (tokens 0..%d): update() returned %d keys for the prompt's forward; "
          "the cache now holds %d slots, StreamingLLM keeps %d (%d sinks + %d recent)"
          % (PROMPT - 1, returned.shape[-2], len(slots), len(want), SINKS, WINDOW - SINKS))
    wrong = len(slots) != len(want) or any(want.get(u) != p for u, p in slots)
    if wrong:
        print("  held tokens: %s" % ", ".join("%d@%s" % (u, p) for u, p in slots))
        print("  expected:    %s" % ", ".join("%d@%d" % (u, p) for u, p in want.items()))

    for step, t in enumerate(range(PROMPT, tokens), start=1):
        want = kept(t)
        pq = want[t]
        cos, sin = cos_sin([pq])
        keys, values = cache.update(rotate(k_raw[None, :, [t]], [pq]), v_raw[None, :, [t]].clone(), 0,
                                    {"cos": cos, "sin": sin, "cache_position": torch.tensor([pq])})
        slots = held(cache, tokens, v_raw, k_raw)
        q = rotate(q_raw[:, [t]], [pq])[:, 0]
        ref_keys = torch.stack([rotate(k_raw[:, [u]], [p])[:, 0] for u, p in want.items()], dim=1)
        ref_values = torch.stack([v_raw[:, u] for u in want], dim=1)
        diff = (attend(q, keys[0], values[0]) - attend(q, ref_keys, ref_values)).abs().max().item()
        ok = [u for u, _ in slots] == list(want) and all(p == want[u] for u, p in slots) and diff < 1e-5
        if t == PROMPT:
            print("\nstep %d, token %d, the first decode: StreamingLLM has evicted %d tokens; "
                  "the query is at position %d" % (step, t, t + 1 - WINDOW, pq))
            table(slots, want, pq)
            print("  attention output of token %d: max |expected - actual| = %.6f" % (t, diff))
        else:
            print("step %d, token %d: %s (max output difference %.6f)" % (step, t, "ok" if ok else "wrong", diff))
        wrong = wrong or not ok

    if wrong:
        print("\nthe prompt was stored whole (%d slots for a window of %d), and the decodes see keys at the wrong "
              "positions" % (PROMPT, WINDOW) if cls is SinkCache else "\nsome step differs from StreamingLLM")
        return 1
    print("\nthe prompt is stored as sinks + window, and every decode matches StreamingLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
