"""tools/kvtrace.py driving PyTorch caches the way Hugging Face transformers does, checked by
`kvcheck verify`. transformers itself is not installed in this venv: the caches below are
written here to behave as transformers' caches do (4.46 unless said otherwise), so each
test pins down what kvcheck says about one cache design. Where the real class now runs
(SinkCache, SlidingWindowCache, HybridCache, 5.x's DynamicCache and hybrid StaticCache:
tests/test_peer_transformers.py, in each release's venv), the stand-in's tests are retired;
the rest wait for their real classes (issue "Real engines from PyPI"), and DynamicCache's
stand-in stays as the plain cache the driver's own argument tests need. Runs in the venv build/venvs/torch (PyTorch 2.13.0, CPU), which tools/test makes."""

import json
import os
import shutil
import tempfile
import unittest

import numpy as np
import torch

import spec_quant
from test_kvtrace import DATA, SCENARIOS, export, kvcheck, kvtrace


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DynamicCache:
    """transformers' DynamicCache: grows by concatenation, returns everything it holds;
    crop keeps the first n tokens, reorder_cache selects rows."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[-2] if layer_idx < len(self.key_cache) else 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx == len(self.key_cache):
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def crop(self, max_length):
        self.key_cache = [k[..., :max_length, :] for k in self.key_cache]
        self.value_cache = [v[..., :max_length, :] for v in self.value_cache]

    def reorder_cache(self, beam_idx):
        self.key_cache = [k.index_select(0, beam_idx) for k in self.key_cache]
        self.value_cache = [v.index_select(0, beam_idx) for v in self.value_cache]


class WindowedDynamicCache(DynamicCache):
    """A DynamicCache that keeps the last `window` tokens and refuses a crop once it has
    dropped one (it could not give the cropped rows back their tokens)."""

    def __init__(self, window):
        super().__init__()
        self.window, self.seen = window, 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx == 0:
            self.seen += key_states.shape[-2]
        keys, values = super().update(key_states, value_states, layer_idx)
        self.key_cache[layer_idx] = keys[..., -self.window:, :]
        self.value_cache[layer_idx] = values[..., -self.window:, :]
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def crop(self, max_length):
        if self.seen > self.window and max_length < self.seen:
            raise ValueError("cannot crop to %d tokens: tokens before %d were dropped"
                             % (max_length, self.seen - self.window))
        super().crop(max_length)
        self.seen = min(self.seen, max_length)


class StaticCache:
    """transformers' StaticCache: max_cache_len zeroed slots per row, allocated for the batch
    it is made for, written at cache_kwargs["cache_position"] and returned whole (the model
    masks slot j for the query at cache position p unless j <= p). No crop, as in 4.46."""

    def __init__(self, batch, max_cache_len):
        self.batch, self.max_cache_len = batch, max_cache_len
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        # transformers counts the written slots of row 0, head 0
        return int(self.key_cache[layer_idx][0, 0].any(dim=-1).sum()) if layer_idx < len(self.key_cache) else 0

    def buffers(self, key_states, layer_idx):
        if layer_idx == len(self.key_cache):
            _, heads, _, dim = key_states.shape
            for store in (self.key_cache, self.value_cache):
                store.append(torch.zeros(self.batch, heads, self.max_cache_len, dim, dtype=key_states.dtype))
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        keys, values = self.buffers(key_states, layer_idx)
        keys.index_copy_(2, cache_kwargs["cache_position"], key_states)
        values.index_copy_(2, cache_kwargs["cache_position"], value_states)
        return keys, values

    def reorder_cache(self, beam_idx):
        self.key_cache = [k.index_select(0, beam_idx) for k in self.key_cache]
        self.value_cache = [v.index_select(0, beam_idx) for v in self.value_cache]


def manifest(trace):
    with open(os.path.join(trace, "manifest.json")) as f:
        return json.load(f)


class StaticFp8Cache:
    """vLLM's fp8 KV cache behind the update() protocol: keys and values stored as OCP E4M3
    codes of x / k_scale (round to nearest even, saturating), with the static per-tensor
    scales a checkpoint gives (k_scale, v_scale), read back as code * scale. Exposes its
    codes and scales as kv_codes, so the trace carries them (SPEC 9.3). bug:
    "scale_never_loaded" (scales left at vLLM's default 1.0: SGLang issue 18818, ModelOpt
    issue 20), "scale_dropped_on_read" (written as x / s, read as code * 1: tokenspeed PR 759),
    "first_layer_scales" (layer 0's scales in every layer: SGLang issue 39942). k_scale and
    v_scale may be lists with one entry per layer (a checkpoint's per-layer scales), each a
    number or one per kv head."""

    def __init__(self, k_scale, v_scale, bug=None, expose_codes=True, rope=None):
        self.bug, self.expose_codes, self.rope = bug, expose_codes, rope
        self.scales = (1.0, 1.0) if bug == "scale_never_loaded" else (k_scale, v_scale)
        self.codes = []  # per layer: [k codes, v codes], uint8 [B, Hkv, S, D]

    def layer_scales(self, layer_idx):
        """(k, v) scales of the layer, shaped to broadcast over [B, Hkv, S, D]."""
        out = []
        for s in self.scales:
            if isinstance(s, list):
                s = s[0 if self.bug == "first_layer_scales" else layer_idx]
            out.append(np.asarray(s, dtype=np.float64).reshape(1, -1, 1, 1))
        return out

    def get_seq_length(self, layer_idx=0):
        return self.codes[layer_idx][0].shape[-2] if layer_idx < len(self.codes) else 0

    def dequantized(self, codes, scale):
        values = spec_quant.fp8_values("fp8_e4m3")
        x = np.where(codes & 0x80, -1.0, 1.0) * values[codes & 0x7F]
        return torch.tensor(x * (1.0 if self.bug == "scale_dropped_on_read" else scale), dtype=torch.float32)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if self.bug == "key_one_position_on":  # stored rotated once more: at position p + 1
            key_states = torch.tensor(kvtrace.rotate(key_states.double().numpy(), [1], self.rope, scaled=False))
        scales = self.layer_scales(layer_idx)
        new = [spec_quant.fp8_encode("fp8_e4m3", x.double().numpy() / s)[0].astype(np.uint8)
               for x, s in zip((key_states, value_states), scales)]
        if layer_idx == len(self.codes):
            self.codes.append(new)
        else:
            self.codes[layer_idx] = [np.concatenate([old, n], axis=-2) for old, n in zip(self.codes[layer_idx], new)]
        k, v = self.codes[layer_idx]
        return self.dequantized(k, scales[0]), self.dequantized(v, scales[1])

    def reorder_cache(self, beam_idx):
        rows = beam_idx.numpy()
        self.codes = [[x[rows] for x in layer] for layer in self.codes]

    @property
    def kv_codes(self):
        if not self.expose_codes:
            return None  # the trace then holds what update() returned, dequantized
        out = []
        for layer_idx, (k, v) in enumerate(self.codes):
            shape = k.shape[:-1] + (1,)
            ks, vs = self.layer_scales(layer_idx)
            out.append({"k_codes": k, "k_scales": np.broadcast_to(ks, shape).copy(),
                        "v_codes": v, "v_scales": np.broadcast_to(vs, shape).copy()})
        return out


class QuantizedCache:
    """transformers' QuantizedCache (QuantizedLayer.update, as in PR 30483 and since) over
    affine codes per group along head_dim, with a residual of `residual` float tokens. The
    first update quantizes the whole prompt and returns it raw; later ones return
    cat(dequantize(codes), residual, new), and once the residual is full, quantize that whole
    concatenation again and empty the residual. Codes are SPEC 9's (spec_quant), each row's
    groups along head_dim, or, for a format along the token axis (quanto's axis -1, KIVI's
    keys: one scale and zero point per channel per run of tokens), per channel over each
    (row, kv head)'s tokens. (quanto groups the flattened [B, Hkv, S] tokens, so a run can
    straddle two kv heads when S is not a multiple of the group; SPEC 9 runs within one.)
    fmt: one format for keys and values, or a (keys, values) pair.

    full_when: "after" (the residual with the new tokens holds `residual` or more: kvcheck's
    rule, SPEC 9) or "one_token" (transformers' own test, residual_len + 1 >= residual, which
    assumes a one-token update). bug "reorder_residual_only": reorder_cache and crop touch the
    residual only, as QuantizedLayer inherits them (transformers PRs 45510 and 48700); bug
    "flat_token_groups": runs along the token axis over the flattened [B, Hkv, S] tokens."""

    def __init__(self, fmt, residual, full_when="after", bug=None):
        self.fmts = tuple(fmt) if isinstance(fmt, (tuple, list)) else (fmt, fmt)
        self.residual, self.full_when, self.bug = residual, full_when, bug
        self.stored = []  # per layer: [k, v] float64 arrays [B, Hkv, S, D], what the codes stand for
        self.codes = []  # per layer: [k, v] (codes, scales, zeros) arrays
        self.raw = []  # per layer: [k, v] float32 tensors [B, Hkv, r, D]

    def get_seq_length(self, layer_idx=0):
        if layer_idx >= len(self.stored):
            return 0
        return self.stored[layer_idx][0].shape[-2] + self.raw[layer_idx][0].shape[-2]

    def quantize(self, x, fmt):
        """[B, Hkv, S, D] floats: (codes, scales, zeros), dequantized."""
        x = np.asarray(x, dtype=np.float32)
        # bug "flat_token_groups": runs over the flattened [B, Hkv, S] tokens, as quanto groups them.
        runs = x.reshape(1, -1, x.shape[-1]) if self.bug == "flat_token_groups" else x.reshape((-1,) + x.shape[-2:])
        rows = [r[:3] for tokens in runs for r in spec_quant.quantize_together(fmt, tokens)]
        shape = x.shape[:-1]
        codes = np.array([r[0] for r in rows]).reshape(x.shape)
        scales = np.array([r[1] for r in rows]).reshape(shape + (-1,))
        zeros = np.array([r[2] for r in rows]).reshape(shape + (-1,))
        back = np.array([spec_quant.dequantize(fmt, *r) for r in rows]).reshape(x.shape)
        return (codes, scales, zeros), back

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        new = [key_states, value_states]
        if layer_idx == len(self.stored):  # the prefill: quantized at once, returned raw
            quantized = [self.quantize(x.numpy(), fmt) for x, fmt in zip(new, self.fmts)]
            self.codes.append([q[0] for q in quantized])
            self.stored.append([q[1] for q in quantized])
            self.raw.append([x[..., :0, :] for x in new])
            return key_states, value_states
        before = len(self.raw[layer_idx][0][0, 0])
        out = [torch.cat([torch.tensor(st, dtype=torch.float32), r, x], dim=-2)
               for st, r, x in zip(self.stored[layer_idx], self.raw[layer_idx], new)]
        held = before + key_states.shape[-2] if self.full_when == "after" else before + 1
        if held >= self.residual:  # everything stored, quantized again with the residual
            quantized = [self.quantize(x.numpy(), fmt) for x, fmt in zip(out, self.fmts)]
            self.codes[layer_idx] = [q[0] for q in quantized]
            self.stored[layer_idx] = [q[1] for q in quantized]
            self.raw[layer_idx] = [x[..., :0, :] for x in new]
        else:
            self.raw[layer_idx] = [torch.cat([r, x], dim=-2) for r, x in zip(self.raw[layer_idx], new)]
        return out[0], out[1]

    def reorder_cache(self, beam_idx):
        rows = beam_idx.numpy()
        self.raw = [[x.index_select(0, beam_idx) for x in layer] for layer in self.raw]
        if self.bug == "reorder_residual_only":
            return
        self.stored = [[x[rows] for x in layer] for layer in self.stored]
        self.codes = [[tuple(a[rows] for a in q) for q in layer] for layer in self.codes]

    def crop(self, max_length):
        for layer in range(len(self.stored)):
            quantized = self.stored[layer][0].shape[-2]
            keep_raw = max(0, max_length - quantized)
            self.raw[layer] = [x[..., :keep_raw, :] for x in self.raw[layer]]
            if self.bug != "reorder_residual_only":
                self.stored[layer] = [x[..., :max_length, :] for x in self.stored[layer]]
                self.codes[layer] = [tuple(a[..., :max_length, :] for a in q) for q in self.codes[layer]]

    @property
    def kv_codes(self):
        """Codes, scales and zero points of every slot (quantized first, then the residual,
        whose codes are placeholders), the raw mask, and keys and values as held."""
        out = []
        for stored, codes, raw in zip(self.stored, self.codes, self.raw):
            B, Hkv, S, D = stored[0].shape
            r = raw[0].shape[-2]
            layer = {"raw": np.concatenate([np.zeros((B, S)), np.ones((B, r))], axis=1)}
            for name, st, (c, sc, z), x in zip(("k", "v"), stored, codes, raw):
                groups = sc.shape[-1]
                layer[name + "_codes"] = np.concatenate([c, np.zeros((B, Hkv, r, D), np.int64)], axis=2)
                layer[name + "_scales"] = np.concatenate([sc, np.ones((B, Hkv, r, groups))], axis=2)
                layer[name + "_zero"] = np.concatenate([z, np.zeros((B, Hkv, r, groups), np.int64)], axis=2)
                layer["keys" if name == "k" else "values"] = np.concatenate([st, x.numpy()], axis=2)
            out.append(layer)
        return out


class KiviCache(QuantizedCache):
    """KIVI's cache as its reference implementation flushes (kvcheck's flush "block"): tokens,
    the prompt's too, wait raw in a residual of R; once R or more are raw, the oldest whole
    multiple of R are quantized together (keys per channel: a run along the token axis) and
    appended to the stored codes, never quantized again. update() returns the stored tokens
    dequantized, then the residual and the new tokens raw (chunk_reads "raw")."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        new = [key_states, value_states]
        if layer_idx == len(self.stored):
            B, Hkv, _, D = key_states.shape
            self.stored.append([np.zeros((B, Hkv, 0, D)) for _ in new])
            self.codes.append([(np.zeros((B, Hkv, 0, D), np.int64), np.zeros((B, Hkv, 0, D // f["scale"]["elements"])),
                                np.zeros((B, Hkv, 0, D // f["scale"]["elements"]), np.int64)) for f in self.fmts])
            self.raw.append([x[..., :0, :] for x in new])
        out = [torch.cat([torch.tensor(st, dtype=torch.float32), r, x], dim=-2)
               for st, r, x in zip(self.stored[layer_idx], self.raw[layer_idx], new)]
        raw = [torch.cat([r, x], dim=-2) for r, x in zip(self.raw[layer_idx], new)]
        n = raw[0].shape[-2] // self.residual * self.residual
        for t, (x, fmt) in enumerate(zip(raw, self.fmts)):
            if n:
                codes, back = self.quantize(x[..., :n, :].numpy(), fmt)
                self.stored[layer_idx][t] = np.concatenate([self.stored[layer_idx][t], back], axis=2)
                self.codes[layer_idx][t] = tuple(np.concatenate([a, b], axis=2)
                                                 for a, b in zip(self.codes[layer_idx][t], codes))
        self.raw[layer_idx] = [x[..., n:, :] for x in raw]
        return out[0], out[1]


INT4_GROUP_16 = {"format": "int4", "scale": {"granularity": "group", "group": 16, "dtype": "float16", "elements": 16}}
# quant_kivi_blocks: 2-bit keys per channel per run of 8 tokens, values per group of 16.
INT2_CHANNEL_8 = {"format": "int2", "scale": {"granularity": "channel", "axis": "token", "group": 8, "dtype": "float16",
                                              "elements": 1}}
INT2_GROUP_16 = {"format": "int2", "scale": {"granularity": "group", "group": 16, "dtype": "float16", "elements": 16}}
# quant_channel_hf's keys: one scale and zero point per channel per run of 8 tokens.
INT4_CHANNEL_8 = {"format": "int4", "scale": {"granularity": "channel", "axis": "token", "group": 8, "dtype": "float16",
                                              "elements": 1}}


class KvtraceTorchTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvtrace-torch-test-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, make_cache, folder=SCENARIOS, **options):
        """Exports the scenario, drives torch caches made by make_cache, verifies the trace."""
        exp = export(self.work, scenario, folder)
        options.setdefault("as_tensor", "torch")
        result = kvtrace.drive_hf_cache(exp, make_cache, self.trace, **options)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)

    def test_the_paged_block_manager_with_torch_pools_passes(self):
        # test_paged_trace.py's vLLM-style block manager, its pools torch tensors.
        import test_paged_trace
        work = os.path.join(self.work, "paged")
        os.mkdir(work)
        trace = test_paged_trace.trace_of("paged_fork_then_prefix_hit", work, "HND", "torch")
        done = test_paged_trace.verify("paged_fork_then_prefix_hit", trace)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("no divergence", done.stdout)

    def test_a_poisoned_torch_pool_names_the_block_a_hit_never_wrote(self):
        import test_paged_trace
        test_paged_trace.check_poison_is_named(self, "torch")

    def test_a_static_fp8_cache_passes_code_for_code(self):
        # quant_fp8_e4m3_static_scale: k_scale 0.05, v_scale 0.02. The trace carries codes and
        # scales only; kvcheck dequantizes them and checks every code.
        result, verify = self.drive("quant_fp8_e4m3_static_scale", lambda: StaticFp8Cache(0.05, 0.02),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        report = os.path.join(self.work, "report.json")
        kvcheck("verify", os.path.join(SCENARIOS, "quant_fp8_e4m3_static_scale.json"), "--trace", self.trace,
                "--json", report)
        with open(report) as f:
            checks = {c["name"]: c for c in json.load(f)["results"][0]["checks"]}
        self.assertRegex(checks["codes"]["detail"], r"^[1-9][0-9]* codes and their scales")

    def test_a_static_fp8_cache_without_its_codes_passes(self):
        # The trace holds the dequantized keys and values update() returned: each key is held
        # to the reference's simulated one at its position, within one code step.
        result, verify = self.drive("quant_fp8_e4m3_static_scale",
                                    lambda: StaticFp8Cache(0.05, 0.02, expose_codes=False), positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_a_fp8_key_one_position_on_is_caught_without_its_codes(self):
        # One position off moves the fastest pair by a radian: within e4m3's loose rotation
        # tolerance for some keys, never within one code step of the simulated key.
        rope = {"theta": 10000.0, "layout": "half", "scaling": "none"}  # the fixture's (the defaults)
        _, verify = self.drive("quant_fp8_e4m3_static_scale",
                               lambda: StaticFp8Cache(0.05, 0.02, bug="key_one_position_on", expose_codes=False,
                                                      rope=rope), positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("rotation: step 0 (append, /steps/0)", verify.stdout)

    def test_a_fp8_cache_whose_scales_were_never_loaded_is_named(self):
        _, verify = self.drive("quant_fp8_e4m3_static_scale",
                               lambda: StaticFp8Cache(0.05, 0.02, bug="scale_never_loaded"), positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("key scale of group 0: expected 0.05000000074505806, stored 1", verify.stdout)
        self.assertIn("class: quantization scale wrong", verify.stdout)

    def test_a_fp8_cache_that_drops_the_scale_on_read_is_named(self):
        _, verify = self.drive("quant_fp8_e4m3_static_scale",
                               lambda: StaticFp8Cache(0.05, 0.02, bug="scale_dropped_on_read"), positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("checks failed: outputs, quantization bound (0 position", verify.stdout)  # codes right
        self.assertIn("class: scale not applied", verify.stdout)

    def test_a_fp8_cache_with_per_layer_scales_passes_code_for_code(self):
        # quant_fp8_per_layer_scales: a checkpoint's k_scale and v_scale per layer, layer 2's
        # keys one per kv head.
        k_scales, v_scales = [0.05, 0.03, [0.02, 0.06]], [0.02, 0.04, 0.025]
        result, verify = self.drive("quant_fp8_per_layer_scales", lambda: StaticFp8Cache(k_scales, v_scales),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        # Layer 0's scales in every layer: layer 1's first key holds 0.05 where its own is 0.03.
        _, verify = self.drive("quant_fp8_per_layer_scales",
                               lambda: StaticFp8Cache(k_scales, v_scales, bug="first_layer_scales"),
                               positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("layer 1 row 0 uid 0 kv head 0: key scale of group 0: expected 0.029999999329447746, stored "
                      "0.05000000074505806", verify.stdout)
        self.assertIn("class: quantization scale wrong", verify.stdout)

    def test_a_quantized_cache_with_a_residual_passes_code_for_code(self):
        # quant_residual_hf: int4 groups of 16, residual 4, the prompt quantized at once, a
        # flush re-quantizing everything, beams reordered and a crop.
        result, verify = self.drive("quant_residual_hf", lambda: QuantizedCache(INT4_GROUP_16, 4),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        report = os.path.join(self.work, "report.json")
        kvcheck("verify", os.path.join(SCENARIOS, "quant_residual_hf.json"), "--trace", self.trace, "--json", report)
        with open(report) as f:
            checks = {c["name"]: c for c in json.load(f)["results"][0]["checks"]}
        self.assertRegex(checks["codes"]["detail"], r"^[1-9][0-9]* codes and their scales")
        self.assertRegex(checks["precision map"]["detail"], r"\(([1-9][0-9]*) of them raw\)")

    def test_a_quantized_cache_with_keys_per_channel_passes_code_for_code(self):
        # quant_channel_hf: keys per channel along runs of 8 tokens (KIVI, quanto's axis -1),
        # values per group of 16 along head_dim; each flush quantizes every token together.
        result, verify = self.drive("quant_channel_hf", lambda: QuantizedCache((INT4_CHANNEL_8, INT4_GROUP_16), 4),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("codes and their scales as the format's rules give", verify.stdout)

    def test_keys_quantized_per_token_where_the_scenario_says_per_channel_are_refused_by_shape(self):
        # The cache's keys on the wrong axis (groups of 16 along head_dim, quanto's axis 0):
        # their scales are not the scenario's shape, named as bad input.
        _, verify = self.drive("quant_channel_hf", lambda: QuantizedCache(INT4_GROUP_16, 4), positions="absolute")
        self.assertEqual(verify.returncode, 2, verify.stdout + verify.stderr)
        self.assertIn("step000_l0_k_scales.npy: expected scales of shape [2, 2, 6, 32] (along the token axis: each "
                      "token's run's scale for each element), got [2, 2, 6, 2]", verify.stderr)

    def test_runs_across_the_flattened_batch_and_heads_fail_the_codes(self):
        # quanto groups the flattened [B, Hkv, S] tokens: with a 6-token prompt a run of 8 spans
        # two kv heads, so a channel's scale mixes heads and the codes differ from step 0.
        _, verify = self.drive("quant_channel_hf",
                               lambda: QuantizedCache((INT4_CHANNEL_8, INT4_GROUP_16), 4, bug="flat_token_groups"),
                               positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("layer 0 row 0 uid 0 kv head 0: key scale of channel 0:", verify.stdout)
        self.assertIn("class: quantization scale wrong", verify.stdout)

    def test_a_kivi_cache_passes_code_for_code(self):
        # quant_kivi_blocks: the residual of 8 quantized 8 at a time, keys per channel.
        result, verify = self.drive("quant_kivi_blocks", lambda: KiviCache((INT2_CHANNEL_8, INT2_GROUP_16), 8),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("codes and their scales as the format's rules give", verify.stdout)

    def test_hugging_face_flushes_where_kivi_quantizes_blocks_are_named(self):
        # Hugging Face's QuantizedCache on KIVI's scenario: its prompt is quantized at once
        # where KIVI keeps the last 5 raw.
        _, verify = self.drive("quant_kivi_blocks", lambda: QuantizedCache((INT2_CHANNEL_8, INT2_GROUP_16), 8),
                               positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("token 8 (uid 8, slot 8) is held quantized, the residual's rules say raw (the first of 20",
                      verify.stdout)
        self.assertRegex(verify.stdout, r"\n +8 +8 +8 .* raw/q  held quantized, the rules say raw\n")
        self.assertIn("class: precision map mismatch", verify.stdout)

    def test_transformers_flush_test_assumes_one_token_updates(self):
        # transformers flushes when residual_len + 1 >= residual_length: a 3-token append after
        # the prefill leaves more raw tokens than the residual holds, where SPEC 9 flushes.
        _, verify = self.drive("quant_residual_hf", lambda: QuantizedCache(INT4_GROUP_16, 4, full_when="one_token"),
                               positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 15 (append, /steps/6)", verify.stdout)
        self.assertIn("is held raw, the rules say quantized", verify.stdout)
        self.assertIn("is held raw, the residual's rules say quantized (the first of", verify.stdout)
        self.assertIn("class: precision map mismatch", verify.stdout)
        # The slot table shows each slot's precision, expected/actual: some token the rules
        # quantize is still raw, and its verdict says so.
        self.assertIn("held e/a", verify.stdout)
        self.assertRegex(verify.stdout, r"\n +13 +34 +13 .* q/raw  held raw, the rules say quantized\n")
        self.assertRegex(verify.stdout, r"\n +12 +32 +12 .* q/q  ok\n")

    def test_a_quantized_cache_reordering_its_residual_only_is_named(self):
        _, verify = self.drive("quant_residual_hf",
                               lambda: QuantizedCache(INT4_GROUP_16, 4, bug="reorder_residual_only"),
                               positions="absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 6 (reorder, /steps/2)", verify.stdout)
        self.assertIn("class: quantized store not reordered or cropped", verify.stdout)

    def test_static_cache_passes_verify(self):
        result, verify = self.drive("full_baseline", lambda batch: StaticCache(batch, 32), positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("steps recorded: 7 of 7 steps", verify.stdout)

    def test_static_cache_is_made_for_each_batch(self):
        # Resets to batch 3, then 1, then 1 again: make_cache(batch) allocates for each.
        batches = []

        def make(batch):
            batches.append(batch)
            return StaticCache(batch, 16)

        _, verify = self.drive("full_batch_resize_reset", make, positions="absolute")
        self.assertEqual(batches, [2, 3, 1, 1])
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_static_cache_reorder_passes_verify(self):
        # Steps: the prompt (0), two decodes (1, 2), the reorder (3, recorded from the
        # cache's own buffers), two decodes (4, 5).
        _, verify = self.drive("beam_swap_full", lambda batch: StaticCache(batch, 16), DATA, positions="absolute")
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("steps recorded: 6 of 6 steps", verify.stdout)

    def test_cache_without_crop_is_an_error_entry(self):
        # full_crop_accepted: 10 tokens (step 0), 3 decodes (1..3), then the crop (step 4).
        result, _ = self.drive("full_crop_accepted", lambda batch: StaticCache(batch, 32), positions="absolute")
        steps = manifest(self.trace)["steps"]
        self.assertEqual(steps[4], {"error": "the cache does not support crop"})
        self.assertEqual(steps[5:], [{}] * (len(steps) - 5))
        self.assertEqual(result.error_step, 4)

    def test_refused_crop_refused_by_the_cache_is_recorded(self):
        # sliding_crop_refused_after_eviction: the crops at steps 9 and 10 need evicted
        # tokens; the cache refuses both, stays intact, and driving goes on.
        result, verify = self.drive("sliding_crop_refused_after_eviction", lambda: WindowedDynamicCache(6),
                                    positions="absolute")
        steps = manifest(self.trace)["steps"]
        self.assertEqual(steps[9], {"error": "ValueError: cannot crop to 8 tokens: tokens before 4 were dropped"})
        self.assertEqual(steps[10], {"error": "ValueError: cannot crop to 5 tokens: tokens before 4 were dropped"})
        self.assertIsNone(result.error)
        self.assertEqual([step for step, _ in result.refusals], [9, 10])
        self.assertTrue(all("layers" in step for step in steps[11:]))
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_left_padded_static_cache_passes_verify(self):
        # gqa_full_two_kv_heads pads rows on the left: the driver feeds zero q, k, v there,
        # cache_position counts the padded slots, positions skip them, and the mask hides them.
        result, verify = self.drive("gqa_full_two_kv_heads", lambda batch: StaticCache(batch, 32),
                                    positions="absolute")
        self.assertIsNone(result.error)
        self.assertEqual(result.skipped, [])
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        steps = manifest(self.trace)["steps"]
        self.assertTrue(all("layers" in step for step in steps))

    def test_static_cache_positioned_by_cache_position_fails_where_padding_starts(self):
        # The same cache with keys and queries rotated at the padded slot index (cache_position,
        # as a model that takes position ids from arange instead of the mask): row 0 of the
        # first step is padded, so its distances are right but its token indices shift.
        def slot_position(token, held, place):
            return held + place

        _, verify = self.drive("gqa_full_two_kv_heads", lambda batch: StaticCache(batch, 32),
                               positions=slot_position)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("class: padding counted as sink or position", verify.stdout)

    def test_argument_errors_are_clear(self):
        exp = export(self.work, "sliding_baseline")
        scenario = os.path.join(SCENARIOS, "sliding_baseline.json")
        drive = kvtrace.drive_hf_cache
        with self.assertRaisesRegex(ValueError, "positions must be \"policy\", \"absolute\", \"cache\""):
            drive(exp, lambda: DynamicCache(), self.trace, positions="absolut")
        with self.assertRaisesRegex(TypeError, "make_cache must be a function returning a new cache"):
            drive(exp, DynamicCache(), self.trace)
        with self.assertRaisesRegex(TypeError, "a scenario file: run `kvcheck export"):
            drive(scenario, lambda: DynamicCache(), self.trace)
        with self.assertRaisesRegex(ValueError, "is a file \\(a scenario: export it first"):
            kvtrace.Export(scenario)
        with self.assertRaisesRegex(ValueError, "mask must be"):
            drive(exp, lambda: DynamicCache(), self.trace, mask="static")
        # A torch cache given NumPy arrays: caught when it returns tensors, or fails on arrays.
        with self.assertRaisesRegex(TypeError, "as_tensor=\"torch\""):
            drive(exp, lambda: DynamicCache(), self.trace)
        with self.assertRaisesRegex(TypeError, "as_tensor=\"torch\""):
            drive(exp, lambda batch: StaticCache(batch, 32), self.trace)
        self.assertFalse(os.path.exists(self.trace))
        self.assertEqual(sorted(os.listdir(self.work)), ["export"])  # no temporary folder left

    def test_float16_trace_files(self):
        _, verify = self.drive("full_baseline", lambda batch: StaticCache(batch, 32), positions="absolute",
                               dtype="float16")
        names = [name for name in os.listdir(self.trace) if name.endswith(".npy")]
        self.assertEqual(len(names), 7 * 4)  # keys, values, out, q per step
        for name in names:
            with open(os.path.join(self.trace, name), "rb") as f:
                self.assertIn(b"'descr': '<f2'", f.read(128))
            self.assertEqual(np.load(os.path.join(self.trace, name)).dtype, np.float16)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)


if __name__ == "__main__":
    unittest.main()
