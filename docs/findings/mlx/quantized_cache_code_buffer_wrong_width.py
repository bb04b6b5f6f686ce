"""Standalone reproduction (mlx[cpu] 0.32.4 and mlx-lm 0.32.2; no kvcheck needed): mlx-lm's
QuantizedKVCache sizes its packed code buffer as `head_dim // (32 // bits)` uint32 words,
while mx.quantize packs `head_dim * bits / 32`. The two agree for 2, 4 and 8 bits (32 // bits
divides 32), and for 3, 5 and 6 bits only at some head sizes. Where they differ, the first
update_and_fetch raises a broadcast error: 5 and 6 bits at head_dim 128 (Llama, Mistral,
Qwen), 3, 5 and 6 bits at 256 (Gemma).

    python quantized_cache_code_buffer_wrong_width.py          # as shipped
    python quantized_cache_code_buffer_wrong_width.py --fixed  # the buffer sized by bits

For each width mx.quantize accepts (2, 3, 4, 5, 6, 8 bits; group size 64) and head_dim 64, 128
and 256, one QuantizedKVCache takes a 4-token chunk of keys and values (B 1, 2 kv heads).
Expected: every update succeeds and the cache holds exactly mx.quantize's codes.

Exit status 1 when an update fails or holds other codes (the bug), 0 when all agree."""

import sys

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache


class FixedWidth(QuantizedKVCache):
    """The suggested fix, as a subclass: the first buffers sized `dim * bits // 32` words (what
    mx.quantize packs), so QuantizedKVCache.update_and_fetch finds room and writes into them.
    In mlx-lm it is one line of init_quant: `dim * self.bits // 32` for `dim // el_per_int`."""

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            B, heads, n, _ = keys.shape
            steps = (self.step + n - 1) // self.step * self.step

            def buffers(dim):
                shape = (B, heads, steps)
                return (mx.zeros((*shape, dim * self.bits // 32), dtype=mx.uint32),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype))
            self.keys, self.values = buffers(keys.shape[-1]), buffers(values.shape[-1])
        return super().update_and_fetch(keys, values)


def main(fixed):
    make = FixedWidth if fixed else QuantizedKVCache
    failures = []
    for head_dim in (64, 128, 256):
        for bits in (2, 3, 4, 5, 6, 8):
            mx.random.seed(head_dim * 10 + bits)
            k = mx.random.normal((1, 2, 4, head_dim))
            v = mx.random.normal((1, 2, 4, head_dim))
            cache = make(group_size=64, bits=bits)
            try:
                (kq, _, _), _ = cache.update_and_fetch(k, v)
                mx.eval(kq)
                same = bool(mx.array_equal(kq, mx.quantize(k, group_size=64, bits=bits)[0]))
                result = "ok" if same else "holds other codes"
            except Exception as e:  # noqa: BLE001 (the finding)
                result = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:80])
            if result != "ok":
                failures.append((head_dim, bits))
                print("head_dim %d, %d bits: %s" % (head_dim, bits, result))
    print("mlx-lm QuantizedKVCache%s: %d of 18 (head_dim, bits) pairs fail: %s"
          % (" with the buffer sized by bits" if fixed else "", len(failures),
             ", ".join("%d/%d" % f for f in failures) or "none"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main("--fixed" in sys.argv[1:]))
