"""Standalone reproduction (mlx[cpu] 0.32.4, mlx-lm 0.32.2; no kvcheck needed): ChunkedKVCache(4),
driven as mlx_lm/models/llama4.py drives a chunked layer (maybe_trim_front, then the model's
chunk mask), takes a 10-token prompt and two decodes, then trim(5) rolls it back to 7 tokens.
It accepts, though maybe_trim_front already dropped tokens 4..6, so token 7, fed again, attends
itself alone where its chunk is 4..7.

    python chunked_cache_trims_past_its_chunk.py          # token 7 after the rollback vs NumPy
    python chunked_cache_trims_past_its_chunk.py --fixed  # the same with the suggested trim

Exit status 1 when token 7's output differs from the chunk rule's (the bug), 0 when they agree."""

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import ChunkedKVCache

C, TOKENS, HEAD_DIM, ROLLBACK = 4, 12, 8, 5


class RefusesPastItsChunk(ChunkedKVCache):
    """The suggested fix: a rollback whose next token's chunk starts before the first position
    the cache still holds trims nothing (returns 0), so the caller must prefill again."""

    def trim(self, n):
        length = max(self.offset - n, 0)
        if length // self.chunk_size * self.chunk_size < self.start_position:
            return 0
        return super().trim(n)


def forward(cache, q, k, v):
    """One chunked layer's forward as llama4.py runs it (no RoPE: only the mask and the cache
    matter here). Returns the outputs and, per query, the positions it attends."""
    cache.maybe_trim_front()
    start, offset, n = cache.start_position, cache.offset, q.shape[2]
    cols = mx.arange(start, offset + n)[None]
    rows = mx.arange(offset, offset + n)[:, None]
    mask = (cols // C == rows // C) & (cols <= rows)
    keys, values = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=HEAD_DIM ** -0.5, mask=mask)
    seen = [[start + j for j, m in enumerate(row) if m] for row in mask.tolist()]
    return out[0, 0], seen


def chunk_rule(q, k, v, t):
    """Token t's output under the rule: its own chunk C*floor(t/C) .. t, in NumPy."""
    q, k, v = (np.array(a[0, 0]).astype(np.float64) for a in (q, k, v))
    first = t // C * C
    w = np.exp(k[first:t + 1] @ q[t] * HEAD_DIM ** -0.5)
    return (w / w.sum()) @ v[first:t + 1], list(range(first, t + 1))


def main():
    cls = RefusesPastItsChunk if "--fixed" in sys.argv else ChunkedKVCache
    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, 1, TOKENS, HEAD_DIM)) for _ in range(3))
    cache = cls(C)
    for a, b in ((0, 10), (10, 11), (11, 12)):  # a 10-token prompt, two decodes
        forward(cache, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
    held = "%d..%d" % (cache.start_position, cache.offset - 1)
    trimmed = cache.trim(ROLLBACK)
    print("%s: holds positions %s; trim(%d) returns %d, offset %d"
          % (cls.__name__, held, ROLLBACK, trimmed, cache.offset))
    t = TOKENS - ROLLBACK
    if trimmed != ROLLBACK:  # refused: a caller that reads the count prefills tokens 0..6 again
        print("%s: refused; tokens 0..%d prefilled again in a fresh cache" % (cls.__name__, t - 1))
        cache = cls(C)
        forward(cache, q[:, :, :t], k[:, :, :t], v[:, :, :t])
    got, seen = forward(cache, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    want, rule = chunk_rule(q, k, v, t)
    name = cls.__name__ + ":"
    print("%s token %d attends %s; the chunk rule says %s" % (name, t, seen[0], rule))
    print("%s token %d after the rollback %s" % (name, t, np.array(got[0, :3]).tolist()))
    print("%s token %d by the chunk rule  %s" % ("NumPy:".ljust(len(name)), t, want[:3].tolist()))
    diff = float(np.abs(np.array(got[0], dtype=np.float64) - want).max())
    print("max |difference|: %.3g" % diff)
    return 1 if diff > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
