"""optimum-quanto 0.2.7, the backend of transformers 5.25's QuantizedLayer (label
peer.transformers_5_25): SPEC 9.8's quanto_affine against quanto's own quantizer, as
QuantoQuantizedLayer calls it (MaxOptimizer, then quantize_weight along axis 0), and the real
QuantizedCache(backend="quanto") driven through kvtrace by tools/peers/hf_caches.py's recipe,
its codes, scales and biases judged code for code."""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np
import torch
from transformers.cache_utils import QuantoQuantizedLayer

from test_kvtrace import DATA, ROOT, export, exported_value_groups, kvcheck, kvtrace

import sys  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "tools", "peers"))
import hf_caches  # noqa: E402  the recipe, as tools/kvcheck peers uses it


def unpacked(packed, bits, groups):
    """quanto's packed codes (tensor/packed.py): byte [r, j] holds code [i * rows + r, j] of the
    grouped [groups, group] matrix in bits i * b .. i * b + b - 1, rows = ceil(groups / (8 / b))."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    return np.concatenate([(packed >> (bits * i)) & mask for i in range(per_byte)], axis=0)[:groups]


class QuantoReferenceTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-quanto-")
        self.addCleanup(shutil.rmtree, self.work, True)

    def compare_values(self, exp):
        """The last step's stored value rows: kvcheck's codes, scales and biases against
        QuantoQuantizedLayer._quantize of the same float32 values (values are stored
        unrotated, so the export's v is exactly what the cache would quantize); returns the
        codes compared and how many of them sat on a tie (x - min) / S = k + 1/2."""
        compared = ties = 0
        for l, bits, group, codes, scales, biases, values in exported_value_groups(exp):
            layer = QuantoQuantizedLayer(nbits=bits, q_group_size=group, residual_length=1)
            qt = layer._quantize(torch.from_numpy(values.transpose(1, 0, 2)[None].copy()), axis=0)  # [1, Hkv, R, D]
            groups = values.size // group
            theirs = unpacked(qt._data._data.numpy(), bits, groups).reshape(values.shape[1], values.shape[0], -1)
            where = "layer %d: %d bits, groups of %d" % (l, bits, group)
            np.testing.assert_array_equal(theirs.transpose(1, 0, 2), codes, where)
            their_scales = qt._scale.numpy().reshape(values.shape[1], values.shape[0], -1).transpose(1, 0, 2)
            their_shifts = qt._shift.numpy().reshape(values.shape[1], values.shape[0], -1).transpose(1, 0, 2)
            np.testing.assert_array_equal(their_scales, scales.astype(np.float32), where)
            np.testing.assert_array_equal(-their_shifts, biases.astype(np.float32), where)
            self.assertTrue(np.all(scales.astype(np.float32).astype(np.float64) == scales))  # float32, exactly
            grouped = values.reshape(*values.shape[:-1], -1, group)
            with np.errstate(invalid="ignore", divide="ignore"):
                quotient = (grouped - biases.astype(np.float32)[..., None]) / scales.astype(np.float32)[..., None]
            ties += int(np.sum(np.abs(quotient - np.floor(quotient) - 0.5) == 0))
            compared += codes.size
        return compared, ties

    def test_the_reference_quantizes_values_as_quanto_does(self):
        # SPEC 9.8 against quanto itself, at 2 and 4 bits with groups of 32, 64 and 128.
        compared, _ = self.compare_values(export(self.work, "quant_quanto_affine_layers", DATA))
        self.assertEqual(compared, 6 * 26 * 2 * 128)
        # Ties: values on a grid of 1/16 make (x - min) / S land on half-integers, which quanto
        # rounds to even (torch.round), in a scenario that gives its own inputs.
        with open(os.path.join(DATA, "quant_quanto_affine_layers.json")) as f:
            scenario = json.load(f)
        rng = np.random.default_rng(5)
        L, U, D = 6, 12, 128
        grid = lambda *shape: (rng.integers(-16, 17, size=shape) / 16.0).tolist()  # noqa: E731
        scenario.update(name="quanto_affine_ties", steps=[{"op": "append", "tokens": U}],
                        inputs={"q": grid(L, U, 4, D), "k": grid(L, U, 2, D), "v": grid(L, U, 2, D)})
        del scenario["seed"]
        path = os.path.join(self.work, "quanto_affine_ties.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = os.path.join(self.work, "ties")
        done = kvcheck("export", path, "--out", out)
        self.assertEqual(done.returncode, 0, done.stderr)
        compared, ties = self.compare_values(kvtrace.Export(out))
        self.assertEqual(compared, L * U * 2 * D)
        self.assertGreater(ties, 100)

    def drive(self, scenario, residual=None, expect_error=False):
        """QuantizedCache(backend="quanto") through kvtrace over `scenario` (a dict), by the
        recipe; residual: build the cache with another residual_length than the scenario's."""
        path = os.path.join(self.work, scenario["name"] + ".json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = os.path.join(self.work, "export-" + scenario["name"])
        self.assertEqual(kvcheck("export", path, "--out", out).returncode, 0)
        self.assertIsNone(hf_caches.quantized_claims(scenario))
        make, options = hf_caches.quantized_cache(dict(scenario, kv_quant=dict(
            scenario["kv_quant"], residual=residual if residual is not None else scenario["kv_quant"]["residual"])))
        trace = os.path.join(self.work, "trace-" + scenario["name"])
        result = kvtrace.drive_hf_cache(kvtrace.Export(out), make, trace, **options)
        if not expect_error:
            self.assertIsNone(result.error, result)
        return kvcheck("verify", path, "--trace", trace)

    def test_quantized_cache_passes_code_for_code(self):
        # The real layers at 4 bits in groups of 32 and at 2 bits in groups of 64, a residual of
        # 4: the prompt quantized at once, flushes that quantize everything again, a 3-token chunk.
        with open(os.path.join(DATA, "quant_quanto_affine_cache.json")) as f:
            scenario = json.load(f)
        two = {"format": "quanto_affine", "bits": 2, "scale": {"group": 64}}
        # A float16 model: keys and values in float16, every step of quanto's rule in float16.
        half = {"format": "quanto_affine", "bits": 4, "scale": {"group": 32, "dtype": "float16"}}
        for case in (scenario, dict(scenario, name="quant_quanto_affine_cache_2_bits",
                                    kv_quant=dict(scenario["kv_quant"], k=two, v=two)),
                     dict(scenario, name="quant_quanto_affine_cache_float16", kv_dtype="float16",
                          kv_quant=dict(scenario["kv_quant"], k=half, v=half))):
            with self.subTest(case["name"]):
                done = self.drive(case)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                self.assertRegex(done.stdout, r"codes: [1-9][0-9]* codes and their scales as the format's rules give")

    def test_groups_quantized_from_half_precision_values_are_named(self):
        # Planted: every group quantized from its values rounded to float16 first (a model run
        # in half precision under a float32 scenario): the biases move past the window.
        with open(os.path.join(DATA, "quant_quanto_affine_cache.json")) as f:
            scenario = json.load(f)
        quantize = QuantoQuantizedLayer._quantize
        QuantoQuantizedLayer._quantize = lambda layer, tensor, axis: quantize(layer, tensor.half().float(), axis)
        self.addCleanup(setattr, QuantoQuantizedLayer, "_quantize", quantize)
        done = self.drive(scenario)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", done.stdout)
        self.assertIn("key bias of group 0: expected -0.9482102394104004, stored -0.9482421875", done.stdout)
        self.assertIn("class: quantization scale wrong", done.stdout)

    def test_a_residual_other_than_the_scenarios_is_named(self):
        # The cache built with residual_length 5 where the scenario says 4: it keeps a token raw
        # that SPEC 9's rule has quantized.
        with open(os.path.join(DATA, "quant_quanto_affine_cache.json")) as f:
            scenario = json.load(f)
        done = self.drive(scenario, residual=5)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("first divergence: step 4 (decode, /steps/1)", done.stdout)
        self.assertIn("token 6 (uid 6, slot 6) is held raw, the residual's rules say quantized", done.stdout)
        self.assertIn("class: precision map mismatch", done.stdout)

    def run_finding(self, name, *options):
        script = os.path.join(ROOT, "docs", "findings", "transformers", name + ".py")
        return subprocess.run([sys.executable, script, *options], capture_output=True, text=True)

    def test_per_channel_keys_group_across_heads_and_per_head_groups_fix_it(self):
        # docs/findings/transformers/quantized-cache-per-channel-keys-group-across-heads.md
        run = self.run_finding("quantized-cache-per-channel-keys-group-across-heads")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("Group size (32) must be a divisor of (20)", run.stdout)
        self.assertIn("head 0's tokens 32..47 share their groups (one per channel) with head 1's tokens 0..15",
                      run.stdout)
        run = self.run_finding("quantized-cache-per-channel-keys-group-across-heads", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

    def test_a_single_group_is_stored_with_a_scale_per_element_and_is_named(self):
        # docs/findings/transformers/quantized-cache-one-group-stored-unquantized.md: a 1-token
        # prompt with 1 kv head and head_dim == q_group_size is one group.
        run = self.run_finding("quantized-cache-one-group-stored-unquantized")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("stored with 64 scales of shape (1, 64) (64 of them 0)", run.stdout)
        run = self.run_finding("quantized-cache-one-group-stored-unquantized", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        with open(os.path.join(DATA, "quant_quanto_affine_cache.json")) as f:
            scenario = json.load(f)
        scenario.update(name="quanto_one_group", dimensions={"layers": 1, "batch": 1, "heads": 1, "kv_heads": 1,
                                                             "head_dim": 32},
                        steps=[{"op": "append", "tokens": 1}, {"op": "decode", "steps": 5}])
        done = self.drive(scenario, expect_error=True)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("the cache raised: the layer holds its keys of 1 tokens with 32 scales where SPEC 9.8's groups "
                      "of 32 give 1", done.stdout)
        self.assertIn("first divergence: step 0 (append, /steps/0)", done.stdout)


if __name__ == "__main__":
    unittest.main()
