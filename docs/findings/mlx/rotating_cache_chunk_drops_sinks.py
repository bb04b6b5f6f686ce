"""Standalone reproduction (mlx[cpu] 0.32.4, mlx-lm 0.32.2; no kvcheck needed): a prompt fed
to RotatingKVCache(max_size=12, keep=4) in one forward gives its later tokens other
attention outputs than the same prompt fed one token at a time, because the chunk's mask
(RotatingKVCache.make_mask, N > 1) is a plain causal window of max_size columns and leaves
the `keep` sink tokens out, while a decode sees them.

    python rotating_cache_chunk_drops_sinks.py          # prints both outputs of token 12
    python rotating_cache_chunk_drops_sinks.py --fixed  # the same with the suggested make_mask

Exit status 1 when chunked and token-by-token outputs differ (the bug), 0 when they agree."""

import sys

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import RotatingKVCache

MAX_SIZE, KEEP, TOKENS, HEADS, HEAD_DIM = 12, 4, 30, 1, 8


class SinksKeptInChunks(RotatingKVCache):
    """The suggested fix: a chunk's mask keeps the sink columns visible (still causal), and the
    window over the other columns is max_size - keep, as a decode sees it."""

    def make_mask(self, N, window_size=None, return_array=False):
        if N == 1 or self.keep == 0:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        offset = min(self.max_size - 1, self.offset)
        window = (window_size or self.max_size) - self.keep
        rows = mx.arange(offset, offset + N)[:, None]
        cols = mx.arange(offset + N)[None]
        return (rows >= cols) & ((rows < cols + window) | (cols < self.keep))


def outputs(cache, q, k, v, chunk):
    """Attention outputs [TOKENS, HEAD_DIM] of head 0, the prompt fed `chunk` tokens at a time
    (keys and queries already rotated: only the mask and the cache matter here)."""
    rows = []
    for start in range(0, TOKENS, chunk):
        end = min(start + chunk, TOKENS)
        mask = create_attention_mask(mx.zeros((1, end - start, 1)), cache)
        keys, values = cache.update_and_fetch(k[:, :, start:end], v[:, :, start:end])
        out = scaled_dot_product_attention(q[:, :, start:end], keys, values, cache=cache,
                                           scale=HEAD_DIM ** -0.5, mask=mask)
        rows.append(out[0, 0])
    return mx.concatenate(rows, axis=0)


def main():
    cls = SinksKeptInChunks if "--fixed" in sys.argv else RotatingKVCache
    mx.random.seed(0)
    q, k, v = (mx.random.normal((1, HEADS, TOKENS, HEAD_DIM)) for _ in range(3))
    whole = outputs(cls(max_size=MAX_SIZE, keep=KEEP), q, k, v, TOKENS)
    one_by_one = outputs(cls(max_size=MAX_SIZE, keep=KEEP), q, k, v, 1)
    differ = mx.abs(whole - one_by_one).max(axis=1)
    print("%s: token 12 in one forward %s" % (cls.__name__, whole[12, :3].tolist()))
    print("%s: token 12 one at a time  %s" % (cls.__name__, one_by_one[12, :3].tolist()))
    first = [t for t in range(TOKENS) if differ[t].item() > 1e-5]
    print("tokens whose outputs differ: %s" % (first or "none"))
    return 1 if first else 0


if __name__ == "__main__":
    sys.exit(main())
