"""Standalone reproduction (torch + transformers 4.42.4, 4.46.3 or 4.52.4; no kvcheck needed):
SinkCache re-rotates its kept keys one token before anything has to be evicted.

SinkCache(window_length=6, num_sink_tokens=2) gets a 3-token prompt, then one token per
step, driven as a Llama-style model drives it: keys rotated (RoPE, rotate_half) before
update(), with the chunk's cos/sin passed in cache_kwargs. When token 5 arrives the cache
holds 5 tokens; 5 + 1 == window_length, so all 6 fit and StreamingLLM evicts nothing. The
stock update() tests `held + new < window_length` to decide whether the cache may grow, so
here it takes the shifting branch instead: it keeps every held token but rotates tokens
2..4 back by one position. Token 5's query then sees them one position farther away than
they are (and token 2 at the same position as the sink token 1).

The query and the new key of token t are rotated at StreamingLLM's cache position
t - E(t), E(t) = max(0, t + 1 - W) tokens evicted. Up to token 5 (the step that goes
wrong) that is t, the position both generate() and a plain forward loop give.

    python sink-cache-shifts-one-token-early.py          # the stock class
    python sink-cache-shifts-one-token-early.py --fixed  # with the suggested fix (`<=`)

Exit status 1 when a kept key sits at the wrong position (the bug), 0 when every step of
tokens 3..11 matches StreamingLLM's rule."""

import sys
import warnings

warnings.filterwarnings("ignore")  # SinkCache is deprecated (4.52 warns at every construction)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import SinkCache  # noqa: E402

SINKS, WINDOW, PROMPT, LAST = 2, 6, 3, 11  # decode tokens PROMPT..LAST one at a time
HEADS, HEAD_DIM, BASE = 2, 8, 10000.0


class FixedSinkCache(SinkCache):
    """The suggested fix, as a subclass: when the held tokens and the new ones exactly fill
    the window (held + n == window_length) nothing is evicted, so grow the cache as the
    stock "growing" branch does. That is the stock update() with `<` changed to `<=` in
    `elif key_states.shape[-2] + self.get_seq_length(layer_idx) < self.window_length:`."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        held = self.get_seq_length(layer_idx)
        if held == 0 or held + key_states.shape[-2] != self.window_length:
            return super().update(key_states, value_states, layer_idx, cache_kwargs)
        cache_kwargs = cache_kwargs or {}
        cos, sin = cache_kwargs.get("cos"), cache_kwargs.get("sin")
        if layer_idx == 0:
            self._seen_tokens += key_states.shape[-2]
            # Keep the cos/sin table growing as the stock growing branch does (it is read
            # for the re-rotation once the cache does shift).
            if cos is not None and sin is not None and cos.dim() == 3 and self._cos_cache is not None:
                self._cos_cache = torch.cat([self._cos_cache, cos[0, ...]], dim=0)
                self._sin_cache = torch.cat([self._sin_cache, sin[0, ...]], dim=0)
        self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
        self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


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


def evicted(t):
    """StreamingLLM: tokens evicted when token t attends (the window counts t itself)."""
    return max(0, t + 1 - WINDOW)


def expected(t):
    """{token: cache position} that token t's query must see, and the query's position."""
    e = evicted(t)
    kept = list(range(SINKS)) + list(range(SINKS + e, t + 1))
    return {u: (u if u < SINKS else u - e) for u in kept}, t - e


def recover(stored, raw):
    """The position p with stored == rotate(raw, p) over all heads, or None."""
    best, err = None, None
    for p in range(-64, 65):
        e = (stored - rotate(raw[:, None, :], [p])[:, 0, :]).abs().max().item()
        if err is None or e < err:
            best, err = p, e
    return best if err < 1e-4 else None


def attend(q, keys, values):
    """One query [H, D] over keys/values [H, n, D]: [H, D]."""
    scores = torch.einsum("hd,hnd->hn", q, keys) / HEAD_DIM ** 0.5
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), values)


def main():
    cls = FixedSinkCache if "--fixed" in sys.argv else SinkCache
    torch.manual_seed(0)
    tokens = LAST + 1
    q_raw, k_raw, v_raw = (torch.randn(HEADS, tokens, HEAD_DIM) for _ in range(3))
    cache = cls(WINDOW, SINKS)
    print("transformers %s, torch %s: %s(window_length=%d, num_sink_tokens=%d), a %d-token prompt, "
          "then one token per step" % (transformers.__version__, torch.__version__, cls.__name__, WINDOW, SINKS,
                                       PROMPT))

    chunks = [list(range(PROMPT))] + [[t] for t in range(PROMPT, tokens)]
    first_wrong = None
    for step, chunk in enumerate(chunks):
        held = cache.get_seq_length(0)
        positions = [t - evicted(t) for t in chunk]
        cos, sin = cos_sin(positions)
        keys, values = cache.update(rotate(k_raw[None, :, chunk], positions), v_raw[None, :, chunk].clone(), 0,
                                    {"cos": cos, "sin": sin, "cache_position": torch.tensor(positions)})
        if len(chunk) > 1:
            continue  # the prompt: nothing is evicted within it (3 < W)
        t = chunk[0]
        want, pq = expected(t)
        # Which token each slot holds (values are not rotated: match them), at which position.
        slots = []
        for j in range(keys.shape[-2]):
            u = min(range(tokens), key=lambda u: (values[0, :, j] - v_raw[:, u]).abs().max().item())
            slots.append((u, recover(keys[0, :, j], k_raw[:, u])))
        q = rotate(q_raw[:, [t]], [pq])[:, 0]
        ref_keys = torch.stack([rotate(k_raw[:, [u]], [p])[:, 0] for u, p in want.items()], dim=1)
        ref_values = torch.stack([v_raw[:, u] for u in want], dim=1)
        diff = (attend(q, keys[0], values[0]) - attend(q, ref_keys, ref_values)).abs().max().item()
        ok = [u for u, _ in slots] == list(want) and all(p == want[u] for u, p in slots) and diff < 1e-5
        if not ok and first_wrong is None:
            first_wrong = t
        if (not ok and t == first_wrong) or t == WINDOW - 1:
            print("\nstep %d, token %d: the cache held %d tokens, %d + 1 %s window_length %d, so StreamingLLM evicts "
                  "%d; the query is at position %d" % (step, t, held, held, "==" if held + 1 == WINDOW else
                                                       ("<" if held + 1 < WINDOW else ">"), WINDOW, evicted(t), pq))
            print("  slot  token   position expected  actual   query-key distance expected  actual")
            for j, (u, p) in enumerate(slots):
                e = want.get(u)
                print("  %4d  %5d   %17s  %6s   %27s  %6s%s" % (
                    j, u, "evicted" if e is None else e, "?" if p is None else p, "-" if e is None else pq - e,
                    "?" if p is None else pq - p, "" if e is not None and p == e else "  <- wrong"))
            print("  attention output of token %d: max |expected - actual| = %.6f" % (t, diff))
        else:
            print("step %d, token %d: %s (max output difference %.6f)" % (step, t, "ok" if ok else "wrong", diff))

    if first_wrong is None:
        print("\nevery step matches StreamingLLM (tokens %d..%d, %d evictions)" % (PROMPT, LAST, evicted(LAST)))
        return 0
    print("\nfirst wrong step: token %d, the first decode that exactly fills the window; nothing was evicted, "
          "yet the kept keys were re-rotated back by one" % first_wrong if first_wrong == WINDOW - 1 else
          "\nfirst wrong step: token %d" % first_wrong)
    return 1


if __name__ == "__main__":
    sys.exit(main())
