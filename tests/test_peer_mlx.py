"""MLX itself, as shipped (label peer.mlx): mlx-lm's own caches (mlx[cpu] 0.32.4, mlx-lm
0.32.2, the venv build/venvs/mlx that tools/test makes from tools/setup/requirements/mlx.txt)
driven through kvtrace.drive_mlx_cache as mlx-lm's models drive them: mx.arrays, rotated at
cache.offset, masked by create_attention_mask, attended by mlx's own
scaled_dot_product_attention. Keys stay at their absolute positions (mlx-lm never
re-rotates), so a sink cache is judged against a sink policy at original positions."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from test_kvtrace import DATA, ROOT, SCENARIOS, export, exported_value_groups, kvcheck, kvtrace
from kvtrace_mlx import unpacked_codes

import mlx.core as mx  # noqa: F401  (the venv's MLX must import: the CPU build)
from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache


class MlxCacheTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-mlx-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, make_cache, folder=SCENARIOS, **options):
        result = kvtrace.drive_mlx_cache(export(self.work, scenario, folder), make_cache, self.trace, **options)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)

    def test_kv_cache_passes_full_attention_and_a_trim(self):
        for scenario in ("full_baseline", "full_crop_accepted"):
            result, verify = self.drive(scenario, KVCache)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)

    def test_rotating_cache_without_sinks_passes_a_sliding_window(self):
        # RotatingKVCache(max_size=W), as mlx-lm's make_cache gives a sliding layer: decodes
        # through the ring (sliding_baseline), a prompt longer than the window.
        for scenario, window in (("sliding_baseline", 6), ("sliding_prompt_longer_than_window", 8)):
            result, verify = self.drive(scenario, lambda: RotatingKVCache(max_size=window))
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)

    def test_a_chunk_past_the_window_is_held_until_the_next_update(self):
        # W = 8, 5 tokens, then a chunk of 6 (11 > W): the cache keeps up to W - 1 tokens before
        # the chunk beside the whole chunk, and trims them at its next update (eviction
        # "deferred", which the driver declares). Declared lazy, those tokens are extra.
        _, verify = self.drive("sliding_chunk_crosses_window", lambda: RotatingKVCache(max_size=8))
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        shutil.rmtree(self.trace)
        _, verify = self.drive("sliding_chunk_crosses_window", lambda: RotatingKVCache(max_size=8), eviction="lazy")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("which the policy evicted", verify.stdout)

    def test_rotating_cache_with_sinks_passes_decodes_at_original_positions(self):
        # RotatingKVCache(max_size=6, keep=2): two sinks, a ring of 4, 30 decodes, keys never
        # re-rotated: StreamingLLM at original positions.
        result, verify = self.drive("sink_decode_original_positions", lambda: RotatingKVCache(max_size=6, keep=2),
                                    DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_the_queries_of_a_long_prompt_lose_the_sinks(self):
        # RotatingKVCache(12, keep=4), a 30-token prompt in one forward: make_mask gives a chunk
        # a plain causal window of 12 columns, keep ignored, so from token 12 on the queries
        # do not see the 4 sinks a decode would see (docs/findings/mlx/).
        _, verify = self.drive("sink_long_prompt_original_positions", lambda: RotatingKVCache(max_size=12, keep=4),
                               DATA)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0), row 0, layer 0, head 0, query token 12",
                      verify.stdout)
        self.assertIn("class: sinks masked out", verify.stdout)
        # A chunk after a prompt, crossing the window: the buffer holds the sinks, the recent
        # tokens and the chunk, and query i of the chunk sees its last 8 columns, so from the
        # chunk's token 8 on the sinks fall out one by one.
        shutil.rmtree(self.trace)
        _, verify = self.drive("sink_chunk_crosses_window_original_positions",
                               lambda: RotatingKVCache(max_size=8, keep=2), DATA)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (append, /steps/1), row 0, layer 0, head 0, query token 8",
                      verify.stdout)
        self.assertIn("class: sinks masked out", verify.stdout)
        # One token at a time the same cache passes: a decode's mask keeps the sinks.
        shutil.rmtree(self.trace)
        _, verify = self.drive("sink_decode_original_positions", lambda: RotatingKVCache(max_size=6, keep=2), DATA)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_chunked_cache_passes_chunked_attention(self):
        # ChunkedKVCache(C) under llama4.py's own mask: decodes and 3-token chunks across
        # chunk edges, a rollback within the last chunk; C = 300 past the 256-slot buffer
        # step (where mlx-lm 0.31.3 lost chunk 0's tokens); a rollback across the edge the last
        # forward crossed, which the policy refuses and the cache (trimming before its next
        # forward) still serves (SPEC 4).
        for scenario, make in (("chunked_trim_and_chunks", lambda: ChunkedKVCache(4)),
                               ("chunked_past_the_buffer_step", lambda: ChunkedKVCache(300)),
                               ("chunked_crop_back_across_the_last_edge", lambda: ChunkedKVCache(4))):
            result, verify = self.drive(scenario, make, DATA)
            self.assertIsNone(result.error, scenario)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)
            shutil.rmtree(self.trace)
        self.assertIn("but step 2 (crop, /steps/2) was served", verify.stdout)

    def test_chunked_cache_accepts_a_rollback_into_a_chunk_it_dropped(self):
        # C = 4: after 12 tokens it holds 7..11; trim(5) to 7 tokens is accepted, though token
        # 7's chunk 4..6 is gone (docs/findings/mlx/): SPEC 10.2 refuses that crop.
        result, verify = self.drive("chunked_crop_into_an_evicted_chunk", lambda: ChunkedKVCache(4), DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 3 (crop, /steps/2)", verify.stdout)
        self.assertIn("class: refusal mismatch", verify.stdout)
        # A Llama 4 stack (three ChunkedKVCache(8) layers, then a KVCache full layer) passes
        # its prompt, decodes across an edge and a 4-token chunk, then accepts the same kind
        # of crop: 30 tokens back to 20, whose chunk 16..19 lost 16 and 17.
        shutil.rmtree(self.trace)
        result, verify = self.drive("llama4_chunked_full_hybrid",
                                    lambda: [ChunkedKVCache(8), ChunkedKVCache(8), ChunkedKVCache(8), KVCache()])
        self.assertIsNone(result.error)
        self.assertIn("first divergence: step 9 (crop, /steps/3)", verify.stdout)
        self.assertIn("class: refusal mismatch", verify.stdout)

    def test_the_rollback_reproduction_differs_and_the_suggested_trim_fixes_it(self):
        # docs/findings/mlx/: MLX alone. Exit 1: token 7 after trim(5) attends itself alone;
        # with the suggested trim (--fixed) the rollback is refused and a prefill agrees.
        script = os.path.join(ROOT, "docs", "findings", "mlx", "chunked_cache_trims_past_its_chunk.py")
        found = subprocess.run([sys.executable, script], capture_output=True, text=True)
        self.assertEqual(found.returncode, 1, found.stdout + found.stderr)
        self.assertIn("token 7 attends [7]; the chunk rule says [4, 5, 6, 7]", found.stdout)
        fixed = subprocess.run([sys.executable, script, "--fixed"], capture_output=True, text=True)
        self.assertEqual(fixed.returncode, 0, fixed.stdout + fixed.stderr)
        self.assertIn("token 7 attends [4, 5, 6, 7]", fixed.stdout)

    def test_gemma3_and_llama4_caches_pass_their_position_schemes(self):
        # gemma3_text.py's make_cache: RotatingKVCache(W) per sliding layer (theta 10,000) and
        # a KVCache per global one (theta 1,000,000, linear 8), each rotated by its own rope;
        # llama4.py's: ChunkedKVCache(C) per chunked RoPE layer and a KVCache for the NoPE
        # layer, whose queries take the attention temperature (SPEC 10.1 to 10.3).
        gemma3 = lambda: [RotatingKVCache(max_size=8) for _ in range(5)] + [KVCache()]
        llama4 = lambda: [ChunkedKVCache(8), ChunkedKVCache(8), ChunkedKVCache(8), KVCache()]
        for scenario, make in (("gemma3_two_bases_one_row", gemma3), ("llama4_chunked_nope_decodes", llama4)):
            result, verify = self.drive(scenario, make, DATA)
            self.assertIsNone(result.error, scenario)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)
            shutil.rmtree(self.trace)

    def test_what_the_driver_cannot_judge_is_refused_by_name(self):
        # A QuantizedKVCache needs the scenario's mlx_affine at its bits and group size (SPEC
        # 9.7), and a quantized scenario needs one; a paged step has no mlx-lm counterpart.
        # Refused before anything is written.
        with self.assertRaisesRegex(kvtrace.UsageError, "the scenario's kv_quant must store K and V as mlx_affine"):
            self.drive("full_baseline", lambda: QuantizedKVCache(group_size=32, bits=8))
        with self.assertRaisesRegex(kvtrace.UsageError, r"layer 0: QuantizedKVCache\(group_size=64, bits=4\), but the "
                                                        "scenario's k is mlx_affine with groups of 32 at 4 bits"):
            self.drive("quant_mlx_affine_full", lambda: QuantizedKVCache(group_size=64, bits=4), DATA)
        with self.assertRaisesRegex(kvtrace.UsageError, "layer 0: the scenario quantizes it \\(kv_quant\\), but its "
                                                        "cache is a KVCache"):
            self.drive("quant_mlx_affine_full", KVCache, DATA)
        with self.assertRaisesRegex(kvtrace.UsageError, "mlx-lm's caches have no such operation"):
            self.drive("paged_evict_then_repeat", KVCache)
        self.assertFalse(os.path.exists(self.trace))

    def test_the_reproduction_differs_and_the_suggested_mask_fixes_it(self):
        # docs/findings/mlx/: MLX alone, no kvcheck. Exit 1: one forward and token by token
        # differ from token 12 on; with the suggested make_mask (--fixed) they agree.
        script = os.path.join(ROOT, "docs", "findings", "mlx", "rotating_cache_chunk_drops_sinks.py")
        found = subprocess.run([sys.executable, script], capture_output=True, text=True)
        self.assertEqual(found.returncode, 1, found.stdout + found.stderr)
        self.assertIn("tokens whose outputs differ: [12, 13,", found.stdout)
        fixed = subprocess.run([sys.executable, script, "--fixed"], capture_output=True, text=True)
        self.assertEqual(fixed.returncode, 0, fixed.stdout + fixed.stderr)
        self.assertIn("tokens whose outputs differ: none", fixed.stdout)

    def test_the_quantized_cache_width_reproduction_fails_and_the_suggested_size_fixes_it(self):
        # docs/findings/mlx/: QuantizedKVCache's code buffer of head_dim // (32 // bits) words.
        script = os.path.join(ROOT, "docs", "findings", "mlx", "quantized_cache_code_buffer_wrong_width.py")
        found = subprocess.run([sys.executable, script], capture_output=True, text=True)
        self.assertEqual(found.returncode, 1, found.stdout + found.stderr)
        self.assertIn("5 of 18 (head_dim, bits) pairs fail: 128/5, 128/6, 256/3, 256/5, 256/6", found.stdout)
        self.assertIn("Shapes (1,2,4,20) and (1,2,4,21)", found.stdout)
        fixed = subprocess.run([sys.executable, script, "--fixed"], capture_output=True, text=True)
        self.assertEqual(fixed.returncode, 0, fixed.stdout + fixed.stderr)
        self.assertIn("0 of 18 (head_dim, bits) pairs fail: none", fixed.stdout)

    def test_quantized_cache_passes_code_for_code(self):
        # SPEC 9.7 end to end: mlx-lm's QuantizedKVCache at 4 bits (groups of 32) and 8 bits
        # (64), driven as llama.py drives it (rope at cache.offset, then update_and_fetch, then
        # its quantized attention); kvcheck reads its packed codes, scales and biases and holds
        # every code to the rule, through a 3-token chunk and a trim.
        layers = lambda: [QuantizedKVCache(group_size=32, bits=4), QuantizedKVCache(group_size=64, bits=8)]
        result, verify = self.drive("quant_mlx_affine_full", layers, DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("codes: 50688 codes and their scales as the format's rules give", verify.stdout)
        shutil.rmtree(self.trace)
        # 400 tokens: MLX's float32 rope moves keys at positions in the hundreds by a few ulps,
        # and some codes take the other side of a tie, within SPEC 9.7's window.
        result, verify = self.drive("quant_mlx_affine_long", layers, DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("on a rounding boundary took the neighbouring code", verify.stdout)
        shutil.rmtree(self.trace)

        class HalfBiases(QuantizedKVCache):
            """Planted: biases kept in float16 (a float32 model's cache with a half buffer)."""

            def update_and_fetch(self, keys, values):
                fetched = super().update_and_fetch(keys, values)
                for packed, scales, biases in (self.keys, self.values):
                    biases[...] = biases.astype(mx.float16).astype(biases.dtype)
                return fetched

        result, verify = self.drive("quant_mlx_affine_full", lambda: [HalfBiases(group_size=32, bits=4),
                                                                      HalfBiases(group_size=64, bits=8)], DATA)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("key bias of group 0: expected 0.9764909744262695, stored 0.9765625", verify.stdout)
        self.assertIn("holds a key whose bias 0 is 0.9765625", verify.stdout)
        self.assertIn("class: quantization scale wrong", verify.stdout)

    def test_a_kept_code_that_changes_is_named(self):
        # A kept token must stay as it was stored: planted, the first decode flips the lowest bit
        # of token 0's first key code in layer 0 (a write into the wrong slot of the buffer).
        class FlipsAKeptCode(QuantizedKVCache):
            def update_and_fetch(self, keys, values):
                fetched = super().update_and_fetch(keys, values)
                if self.offset == 10:
                    packed = self.keys[0]
                    packed[0, 0, 0, 0] = packed[0, 0, 0, 0] ^ 1
                return fetched

        result, verify = self.drive("quant_mlx_affine_full", lambda: [FlipsAKeptCode(group_size=32, bits=4),
                                                                      QuantizedKVCache(group_size=64, bits=8)], DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (decode, /steps/1)", verify.stdout)
        self.assertIn("layer 0 row 0 uid 0 kv head 0: key element 0", verify.stdout)

    def test_quantized_cache_at_5_bits_on_head_dim_128_is_named_where_it_raises(self):
        # docs/findings/mlx/quantized-cache-code-buffer-wrong-width.md through kvcheck: the
        # first update_and_fetch raises, written into the trace and named at step 0.
        with open(os.path.join(DATA, "quant_mlx_affine_full.json")) as f:
            scenario = json.load(f)
        scenario["dimensions"]["head_dim"] = 128
        scenario["kv_quant"] = [{t: {"format": "mlx_affine", "bits": 5, "scale": {"group": 32}} for t in "kv"}] * 2
        path = os.path.join(self.work, "five_bits.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = os.path.join(self.work, "export")
        self.assertEqual(kvcheck("export", path, "--out", out).returncode, 0)
        result = kvtrace.drive_mlx_cache(kvtrace.Export(out), lambda: QuantizedKVCache(group_size=32, bits=5),
                                         self.trace)
        self.assertEqual(result.error_step, 0)
        verify = kvcheck("verify", path, "--trace", self.trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("class: the cache raised", verify.stdout)
        self.assertIn("(1,2,9,20) and (1,2,9,21)", verify.stdout)

    def test_the_reference_quantizes_values_as_mx_quantize_does(self):
        # SPEC 9.7 against MLX itself: the codes, scales and biases `kvcheck export` writes for
        # each value row (values are stored unrotated, so kvcheck's float32 inputs are exactly
        # what QuantizedKVCache would quantize) equal mx.quantize's, bit for bit, at every bit
        # width and group size mlx-lm takes. Keys go through the same quantizer after SPEC 9.5
        # rule 2's rotation, which other tests check.
        work = tempfile.mkdtemp(prefix="kvcheck-mlx-affine-")
        self.addCleanup(shutil.rmtree, work, True)
        compared = self.compare_values_with_mx_quantize(export(work, "quant_mlx_affine_layers", DATA))
        self.assertEqual(compared, 6 * 26 * 2 * 128)
        # Ties: values on a grid of 1/16, so that (x - B) / S often lands on a half-integer
        # (MLX rounds them to even), in a scenario that gives its own inputs.
        with open(os.path.join(DATA, "quant_mlx_affine_layers.json")) as f:
            scenario = json.load(f)
        rng = np.random.default_rng(5)
        L, U, D = 6, 12, 128
        grid = lambda *shape: (rng.integers(-16, 17, size=shape) / 16.0).tolist()
        scenario.update(name="mlx_affine_ties", steps=[{"op": "append", "tokens": U}],
                        inputs={"q": grid(L, U, 4, D), "k": grid(L, U, 2, D), "v": grid(L, U, 2, D)})
        del scenario["seed"]
        path = os.path.join(work, "mlx_affine_ties.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = os.path.join(work, "ties")
        done = kvcheck("export", path, "--out", out)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.ties = 0
        self.assertEqual(self.compare_values_with_mx_quantize(kvtrace.Export(out)), L * U * 2 * D)
        self.assertGreater(self.ties, 100)

    def compare_values_with_mx_quantize(self, exp):
        compared = 0
        for l, bits, group, codes, scales, biases, values in exported_value_groups(exp):
            packed, mx_scales, mx_biases = mx.quantize(mx.array(values), group_size=group, bits=bits)
            dim = values.shape[-1]
            np.testing.assert_array_equal(unpacked_codes(np.array(packed), bits, dim), codes,
                                          "layer %d: %d bits, groups of %d" % (l, bits, group))
            np.testing.assert_array_equal(np.array(mx_scales), scales.astype(np.float32))
            np.testing.assert_array_equal(np.array(mx_biases), biases.astype(np.float32))
            self.assertTrue(np.all(scales.astype(np.float32).astype(np.float64) == scales))  # float32, exactly
            quotient = (values.reshape(*values.shape[:-1], -1, group) - np.array(mx_biases)[..., None]) / \
                np.array(mx_scales)[..., None]  # in float32, as MLX divides
            self.ties = getattr(self, "ties", 0) + int(np.sum(np.abs(quotient - np.floor(quotient)) == 0.5))
            compared += codes.size
        return compared


if __name__ == "__main__":
    unittest.main()
