"""tools/kvtrace.py with `kvcheck verify`, end to end: NumPy caches written here are
driven through the Hugging Face update() protocol, traced, and verified by kvcheck."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kvtrace  # noqa: E402
from spec_cache import SpecCache, position  # noqa: E402

KVCHECK = os.environ.get("KVCHECK_BIN", os.path.join(ROOT, "build", "kvcheck"))
SCENARIOS = os.path.join(ROOT, "fixtures", "scenarios")
DATA = os.path.join(ROOT, "tests", "data")


def kvcheck(*args):
    return subprocess.run([KVCHECK, *args], capture_output=True, text=True)


def export(work, scenario, folder=SCENARIOS):
    out = os.path.join(work, "export")
    result = kvcheck("export", os.path.join(folder, scenario + ".json"), "--out", out)
    assert result.returncode == 0, result.stderr
    return kvtrace.Export(out)


def exported_value_groups(exp):
    """Per layer of a biased-group export (SPEC 9.7, 9.8), row 0's retained tokens after the
    last step: (layer, bits, group, codes [R, Hkv, D], scales and biases [R, Hkv, D / G], the
    float32 values [R, Hkv, D] they quantize), for a test to quantize the values again with
    the engine itself."""
    last = exp.steps[-1]
    with open(os.path.join(exp.path, last["cache"])) as f:
        uids = [key["uid"] for key in json.load(f)["rows"][0]["keys"]]
    for l, quant in enumerate(exp.manifest["kv_quant"]):
        fmt = quant["v"]
        yield (l, fmt["bits"], fmt["scale"]["group"], np.load(os.path.join(exp.path, last["v_codes"][l]))[0],
               np.load(os.path.join(exp.path, last["v_scales"][l]))[0],
               np.load(os.path.join(exp.path, last["v_bias"][l]))[0], exp.v[l][uids])


class SlidingWindowCache:
    """Keeps the last W keys and values per layer, as given (rotated at absolute positions)."""

    def __init__(self, window):
        self.window, self.keys, self.values = window, {}, {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx in self.keys:
            key_states = np.concatenate([self.keys[layer_idx], key_states], axis=2)
            value_states = np.concatenate([self.values[layer_idx], value_states], axis=2)
        self.keys[layer_idx] = key_states[:, :, -self.window:]
        self.values[layer_idx] = value_states[:, :, -self.window:]
        return self.keys[layer_idx], self.values[layer_idx]


class TrimmedAtNextUpdateCache:
    """A sliding window of W that trims at the start of each update, as mlx-lm's
    RotatingKVCache does for a chunk: the W - 1 held tokens before it, then the whole chunk,
    are returned and kept (W - 1 + n held until the next update trims them again)."""

    def __init__(self, window):
        self.window, self.keys, self.values = window, {}, {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx in self.keys:
            keep = self.window - 1
            key_states = np.concatenate([self.keys[layer_idx][:, :, -keep:], key_states], axis=2)
            value_states = np.concatenate([self.values[layer_idx][:, :, -keep:], value_states], axis=2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states


class ShiftingSinkCache:
    """A SinkCache (evict 1): when the window is full, the kept window keys are re-rotated
    back by one position; an incoming key is stored as it comes. Correct when new keys
    come at cache positions (positions="policy"); Hugging Face SinkCache's bug when they
    come at their absolute positions: old keys re-rotated, the new one not."""

    def __init__(self, sinks, window):
        self.sinks, self.window, self.keys, self.values = sinks, window, {}, {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        assert key_states.shape[2] == 1 or layer_idx not in self.keys, "decode one token at a time"
        if layer_idx not in self.keys:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
            return key_states, value_states
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.shape[2] == self.window:
            s = self.sinks
            rest = cache_kwargs["rotate"](keys[:, :, s + 1:], -1.0)  # re-rotate the kept window
            keys = np.concatenate([keys[:, :, :s], rest], axis=2)
            values = np.concatenate([values[:, :, :s], values[:, :, s + 1:]], axis=2)
        # The bug: key_states is appended as it came, not re-rotated to its cache position.
        self.keys[layer_idx] = np.concatenate([keys, key_states], axis=2)
        self.values[layer_idx] = np.concatenate([values, value_states], axis=2)
        return self.keys[layer_idx], self.values[layer_idx]


class UnrotatedCache:
    """Stores keys unrotated and rotates them at their place in the cache for attention, as
    StreamingLLM's patched attention does (enable_streaming_llm); StartRecent trims it."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[2] if layer_idx < len(self.key_cache) else 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        rotate = cache_kwargs["rotate"]
        raw = rotate(key_states, -cache_kwargs["positions"][:, None, :])
        if layer_idx == len(self.key_cache):
            self.key_cache.append(raw)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = np.concatenate([self.key_cache[layer_idx], raw], axis=2)
            self.value_cache[layer_idx] = np.concatenate([self.value_cache[layer_idx], value_states], axis=2)
        keys = self.key_cache[layer_idx]
        return rotate(keys, np.arange(keys.shape[2])), self.value_cache[layer_idx]


class StartRecent:
    """StreamingLLM's StartRecentKVCache: after each forward, the first `start` and the
    last `recent` tokens stay (W - 1 tokens between steps, W = start + recent + 1)."""

    def __init__(self, start, recent):
        self.start, self.recent = start, recent

    def __call__(self, cache):
        for store in (cache.key_cache, cache.value_cache):
            for l, x in enumerate(store):
                if x.shape[2] > self.start + self.recent:
                    store[l] = np.concatenate([x[:, :, :self.start], x[:, :, -self.recent:]], axis=2)


class BlockBuffer:
    """ONNX Runtime's windowed cache (SPEC 3.1), as an after_forward hook on a GrowingCache:
    a buffer of `capacity` slots that evicts G = capacity - window + 1 tokens at once when
    the next one does not fit, so it holds the last L(T) of a row's T tokens. The hook
    counts T itself and keeps L(T) slots, computed here from the op's rule, not kvcheck's."""

    def __init__(self, capacity, window):
        self.capacity, self.window, self.total, self.held = capacity, window, {}, {}

    def resident(self, total):
        evict = self.capacity - self.window + 1
        while total > self.capacity:  # one block at a time, as the buffer fills
            total -= evict
        return total

    def __call__(self, cache):
        for l, x in enumerate(cache.key_cache):
            self.total[l] = self.total.get(l, 0) + x.shape[2] - self.held.get(l, 0)
            keep = self.held[l] = self.resident(self.total[l])
            cache.key_cache[l], cache.value_cache[l] = x[:, :, -keep:], cache.value_cache[l][:, :, -keep:]


class GrowingCache:
    """Keeps every key and value as given (rotated where the driver rotated them) and
    exposes them like transformers' caches; an after_forward hook trims it."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[2] if layer_idx < len(self.key_cache) else 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx == len(self.key_cache):
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = np.concatenate([self.key_cache[layer_idx], key_states], axis=2)
            self.value_cache[layer_idx] = np.concatenate([self.value_cache[layer_idx], value_states], axis=2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class CroppableGrowingCache(GrowingCache):
    """A GrowingCache with crop(length): every layer keeps its first `length` slots."""

    def crop(self, length):
        self.key_cache = [k[:, :, :length] for k in self.key_cache]
        self.value_cache = [v[:, :, :length] for v in self.value_cache]


class CroppableRing(CroppableGrowingCache):
    """Keeps the last `window` slots, and crops by slots like its parent: a crop past what
    it evicted is accepted and leaves the wrong tokens."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        super().update(key_states, value_states, layer_idx)
        self.key_cache[layer_idx] = self.key_cache[layer_idx][:, :, -self.window:]
        self.value_cache[layer_idx] = self.value_cache[layer_idx][:, :, -self.window:]
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class Int8KeysGrowingCache(CroppableGrowingCache):
    """Keeps every token, its keys quantized as SPEC 9's int8 per token (one scale per row
    of head_dim: amax / 127, codes rounded half away from zero) and dequantized."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k = np.asarray(key_states, dtype=np.float32)
        scale = (np.abs(k).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        scale = np.where(scale == 0, np.float32(1), scale)
        q = k / scale
        codes = np.clip(np.sign(q) * np.floor(np.abs(q) + 0.5), -127, 127)
        return super().update((codes * scale).astype(np.float32), value_states, layer_idx, cache_kwargs)


class StartRecentShifted:
    """StartRecent for keys stored at cache positions: after the forward the dead tokens
    go and the kept window keys are re-rotated back by as many, ready for the next token
    (the other convention SPEC 3 allows). `recent` below W - S - 1 drops a live token."""

    def __init__(self, start, recent, rope):
        self.start, self.recent, self.rope = start, recent, rope

    def __call__(self, cache):
        for l, (k, v) in enumerate(zip(cache.key_cache, cache.value_cache)):
            drop = k.shape[2] - self.start - self.recent
            if drop <= 0:
                continue
            window = kvtrace.rotate(k[:, :, -self.recent:], [-float(drop)] * self.recent, self.rope)
            cache.key_cache[l] = np.concatenate([k[:, :, :self.start], window], axis=2)
            cache.value_cache[l] = np.concatenate([v[:, :, :self.start], v[:, :, -self.recent:]], axis=2)


class PolicyCache:
    """A sink cache (S sinks, W slots, evicting k at a time) that keeps raw keys and shows
    them rotated at the policy's cache positions. Eager: after each forward it drops the
    tokens the next query will not see, showing the kept keys re-encoded for that query
    (reencode) or still at the positions the last query used (not reencode)."""

    def __init__(self, sinks, window, evict, rope, eager, reencode=True):
        self.s, self.w, self.k, self.rope, self.eager, self.reencode = sinks, window, evict, rope, eager, reencode
        self.raw = self.values = None
        self.index = []  # token index of each slot
        self.key_cache, self.value_cache = [], []

    def evicted(self, t):  # E(t) of SPEC 3
        return self.k * -(-max(0, t + 1 - self.w) // self.k)

    def show(self, e):
        positions = [t if t < self.s else t - e for t in self.index]
        self.key_cache = [kvtrace.rotate(self.raw, positions, self.rope)]
        self.value_cache = [self.values]

    def keep(self, e):
        keep = [i for i, t in enumerate(self.index) if t < self.s or t >= self.s + e]
        self.raw, self.values = self.raw[:, :, keep], self.values[:, :, keep]
        self.index = [self.index[i] for i in keep]

    def get_seq_length(self, layer_idx=0):
        return len(self.index)

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        raw = cache_kwargs["rotate"](key_states, -cache_kwargs["positions"][:, None, :])
        first = self.raw is None
        self.raw = raw if first else np.concatenate([self.raw, raw], axis=2)
        self.values = value_states if first else np.concatenate([self.values, value_states], axis=2)
        self.index += [int(t) for t in cache_kwargs["cache_position"]]
        e = self.evicted(self.index[-1])
        self.keep(e)
        self.show(e)
        return self.key_cache[0], self.value_cache[0]

    def after_forward(self, cache):
        if not self.eager:
            return
        following = self.index[-1] + 1
        self.keep(self.evicted(following))
        self.show(self.evicted(following if self.reencode else following - 1))


class KvtraceTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvtrace-test-")
        self.addCleanup(shutil.rmtree, self.work, True)

    def test_prune_fixtures_match_an_independent_numpy_reference(self):
        # SPEC 11 written again from its text alone: a row's full layers keep [0, S) and
        # [n - R, n) of its n tokens at the prune; re-rotated, kept token j sits at its rank
        # and a later token t at k + (t - n); otherwise every token at its index. A sliding
        # layer keeps its window of the whole row at the indices. Each output is softmax
        # attention over what the layer keeps, in float64, against the export's outputs.
        queries = {"prune_streaming_llm_original_positions": 2 * 2 * 4 * 22, "prune_key_rerotation": 2 * 2 * 4 * 22,
                   "prune_gemma3_full_layer_beside_sliding": 1 * 2 * 4 * 22}
        for name, expected_count in queries.items():
            with tempfile.TemporaryDirectory() as work:
                exp = export(work, name)
                d = exp.dims
                group = d["heads"] // d["kv_heads"]
                rows = [[] for _ in range(d["batch"])]  # per row: (uid, index, position) a full layer keeps
                whole = [[] for _ in range(d["batch"])]  # per row: (uid, index) of every token
                pruned = 0  # the prune's n - k when it re-rotates (the positions later tokens lose)
                checked = 0
                for i, step in enumerate(exp.steps):
                    if step["op"] == "prune":
                        for b, row in enumerate(rows):
                            n = len(whole[b])
                            keep = [e for e in row if e[1] < step["sinks"] or e[1] >= n - step["recent"]]
                            if step["rerotate"]:
                                keep = [(u, j, r) for r, (u, j, _) in enumerate(keep)]
                                pruned = n - len(keep)
                            rows[b] = keep
                    elif step["op"] == "crop":
                        rows = [[e for e in row if e[1] < step["length"]] for row in rows]
                        whole = [[e for e in row if e[1] < step["length"]] for row in whole]
                    elif step["op"] in ("append", "decode"):
                        out = exp.reference_output(i)  # [L, B, n, H, D]
                        for b, r in enumerate(step["rows"]):
                            for place, (uid, t) in enumerate(zip(r["uids"], r["indices"])):
                                rows[b].append((uid, t, t - pruned))
                                whole[b].append((uid, t))
                                for l in range(d["layers"]):
                                    policy, rope = exp.layer_policy(l), exp.layer_rope(l)
                                    if policy["type"] == "full":
                                        seen = rows[b]
                                    else:
                                        seen = [(u, j, j) for u, j in whole[b] if t - j < policy["window"]]
                                    uids = [e[0] for e in seen]
                                    where = np.array([e[2] for e in seen], dtype=np.float64)
                                    for h in range(d["heads"]):
                                        q = kvtrace.rotate(exp.q[l][uid, h][None], where[-1:], rope)[0]
                                        keys = kvtrace.rotate(exp.k[l][uids, h // group], where, rope)
                                        scores = keys @ q * exp.scale
                                        w = np.exp(scores - scores.max())
                                        expected = (w / w.sum()) @ exp.v[l][uids, h // group].astype(np.float64)
                                        got = out[l, b, out.shape[2] - len(r["uids"]) + place, h]
                                        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
                                        checked += 1
                # rows x layers x heads x (14 + 3 + 3 + 2 queries)
                self.assertEqual(checked, expected_count, name)

    def test_correct_sliding_cache_passes_verify(self):
        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace,
                               positions="absolute", key_positions="absolute")
        result = kvcheck("verify", os.path.join(SCENARIOS, "sliding_baseline.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("no divergence", result.stdout)

    def test_correct_sink_cache_passes_verify(self):
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: ShiftingSinkCache(exp.policy["sinks"], exp.policy["window"]), trace,
                               positions="policy", key_positions="cache-relative")
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("steps recorded: 31 of 31 steps", result.stdout)

    def test_sink_cache_that_does_not_shift_new_keys_is_diagnosed(self):
        # sink_decode_through_windows: S = 2, W = 6, prompt 3, then one token per step;
        # token 6 (step 4) is the first to evict, and it lands in the last slot, 5.
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: ShiftingSinkCache(exp.policy["sinks"], exp.policy["window"]), trace,
                               positions="absolute", key_positions="cache-relative")
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("class: new key not shifted", result.stdout)
        self.assertIn("first divergence: step 4 (decode, /steps/1), row 0", result.stdout)
        self.assertIn("slot 5, uid 12 (token 6)", result.stdout)
        self.assertIn("position expected 5, claimed 5, recovered 6", result.stdout)

    def test_trace_with_wrong_shape_exits_2(self):
        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace,
                               positions="absolute", key_positions="absolute")
        bad = os.path.join(trace, "step001_l0_keys.npy")
        np.save(bad, np.zeros((2, 2, 5, 4), dtype=np.float32))  # head_dim 4 instead of 8
        result = kvcheck("verify", os.path.join(SCENARIOS, "sliding_baseline.json"), "--trace", trace)
        self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
        self.assertIn("step001_l0_keys.npy: expected keys [B, Hkv, slots, D] of shape [2, 2, slots, 8], got "
                      "[2, 2, 5, 4]", result.stderr)

    def test_missing_trace_file_exits_2(self):
        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace,
                               positions="absolute", key_positions="absolute")
        os.remove(os.path.join(trace, "step002_l0_values.npy"))
        result = kvcheck("verify", os.path.join(SCENARIOS, "sliding_baseline.json"), "--trace", trace)
        self.assertEqual(result.returncode, 2)
        self.assertIn("step002_l0_values.npy: cannot open the .npy file", result.stderr)

    def test_caches_get_the_tensor_type_asked_for(self):
        # Without torch here, a stand-in tensor type shows update() receives converted
        # tensors and that results come back through .detach().cpu().numpy(), as torch's do.
        class FakeTensor:
            def __init__(self, array):
                self.array = np.asarray(array, dtype=np.float32)

            def detach(self):
                return self

            def cpu(self):
                return self

            def numpy(self):
                return self.array

        class Checking(SlidingWindowCache):
            def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
                assert isinstance(key_states, FakeTensor) and isinstance(cache_kwargs["cos"], FakeTensor)
                k, v = super().update(key_states.array, value_states.array, layer_idx)
                return FakeTensor(k), FakeTensor(v)

        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: Checking(exp.policy["window"]), trace, as_tensor=FakeTensor)
        result = kvcheck("verify", os.path.join(SCENARIOS, "sliding_baseline.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_hf_cos_sin_rotate_like_rotate_half(self):
        rope = {"theta": 10000.0, "layout": "half"}
        x = np.arange(8.0).reshape(1, 8) / 10
        cos, sin = kvtrace.hf_cos_sin([5.0], rope, 8)
        rotate_half = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
        np.testing.assert_allclose(x * cos + rotate_half * sin, kvtrace.rotate(x, [5.0], rope), atol=1e-12)

    def test_each_kv_head_may_order_its_slots(self):
        # GQA with two kv heads: the trace stores kv head 1's slots in reverse order.
        exp = export(self.work, "gqa_sliding_uniform", DATA)
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace)
        for name in os.listdir(trace):
            if name.endswith("_keys.npy") or name.endswith("_values.npy"):
                a = np.load(os.path.join(trace, name))
                a[:, 1] = a[:, 1, ::-1].copy()
                np.save(os.path.join(trace, name), a)
        result = kvcheck("verify", os.path.join(DATA, "gqa_sliding_uniform.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_a_bug_in_one_layer_is_shown_in_that_layer(self):
        class SecondLayerOff(SlidingWindowCache):
            """Layer 1 rotates each incoming key one position further than it came."""
            def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
                if layer_idx == 1:
                    key_states = cache_kwargs["rotate"](key_states, 1.0)
                return super().update(key_states, value_states, layer_idx)

        exp = export(self.work, "gqa_sliding_uniform", DATA)
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: SecondLayerOff(exp.policy["window"]), trace)
        result = kvcheck("verify", os.path.join(DATA, "gqa_sliding_uniform.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0), row 0, layer 1", result.stdout)
        # Token 0 of the prompt: expected at 0, found at 1, and the table is layer 1's.
        self.assertIn("slot 0, uid 0 (token 0): visible expected yes, actual yes; position expected 0, claimed 0, "
                      "recovered 1", result.stdout)

    def test_a_reorder_is_recorded_from_the_cache_itself(self):
        class Beams(SlidingWindowCache):
            """Exposes its state like transformers' caches, and reorders rows wrongly
            (always keeps the original order)."""
            @property
            def key_cache(self):
                return [self.keys[l] for l in sorted(self.keys)]

            @property
            def value_cache(self):
                return [self.values[l] for l in sorted(self.values)]

            def reorder_cache(self, rows):
                pass  # the bug: the rows stay where they were

        exp = export(self.work, "beam_swap_full", DATA)
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: Beams(10 ** 6), trace)
        result = kvcheck("verify", os.path.join(DATA, "beam_swap_full.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        # Steps: the prompt (0), two decodes (1, 2), the reorder (3): caught there, not later.
        self.assertIn("first divergence: step 3 (reorder, /steps/2)", result.stdout)
        self.assertIn("class: reorder lost positions", result.stdout)

    def test_trace_writer_never_replaces_a_foreign_folder(self):
        precious = os.path.join(self.work, "precious")
        os.makedirs(precious)
        with open(os.path.join(precious, "notes.txt"), "w") as f:
            f.write("mine")
        with self.assertRaises(FileExistsError):
            kvtrace.TraceWriter(precious, "x", "test", "absolute")
        self.assertTrue(os.path.exists(os.path.join(precious, "notes.txt")))

    def test_trace_writer_replaces_only_what_the_earlier_trace_listed(self):
        # A trace folder holding the user's notes (or a subfolder) is not replaced whole;
        # one holding only an earlier trace's files is.
        folder = os.path.join(self.work, "trace")
        with kvtrace.TraceWriter(folder, "x", "test", "absolute"):
            pass
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("mine")
        with self.assertRaisesRegex(FileExistsError, "notes.txt is not one of the earlier trace's files"):
            kvtrace.TraceWriter(folder, "x", "test", "absolute")
        with open(os.path.join(folder, "notes.txt")) as f:
            self.assertEqual(f.read(), "mine")
        os.remove(os.path.join(folder, "notes.txt"))
        with kvtrace.TraceWriter(folder, "x", "test", "absolute"):
            pass
        self.assertEqual(os.listdir(folder), ["manifest.json"])

    def test_a_failing_cache_leaves_no_partial_trace(self):
        # An exception from the cache is a finding: the trace is complete, with the error at
        # its step and nothing after it. (A failing driver leaves nothing: the next test.)
        class Broken(SlidingWindowCache):
            def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
                if self.keys:
                    raise RuntimeError("cache bug")
                return super().update(key_states, value_states, layer_idx)

        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        result = kvtrace.drive_hf_cache(exp, lambda: Broken(6), trace)
        self.assertEqual((result.error_step, result.error), (1, "RuntimeError: cache bug"))
        with open(os.path.join(trace, "manifest.json")) as f:
            steps = json.load(f)["steps"]
        self.assertEqual(steps[1:], [{"error": "RuntimeError: cache bug"}] + [{}] * 9)
        self.assertEqual(sorted(os.listdir(self.work)), ["export", "trace"])  # no temporary folder
        result = kvcheck("verify", os.path.join(SCENARIOS, "sliding_baseline.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("RuntimeError: cache bug", result.stdout)

    def test_a_chunk_longer_than_the_cache_is_a_clear_error(self):
        # A cache that trims a long prompt before attention returns fewer slots than the
        # chunk: its first tokens could not see each other. A finding about the cache.
        exp = export(self.work, "sliding_prompt_longer_than_window")
        trace = os.path.join(self.work, "trace")
        result = kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace)
        self.assertEqual(result.error_step, 0)
        verify = kvcheck("verify", os.path.join(SCENARIOS, "sliding_prompt_longer_than_window.json"), "--trace", trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("the cache returned 8 slots for a chunk of 21 tokens", verify.stdout)

    def test_cache_evicting_after_the_forward_passes_verify(self):
        # StreamingLLM: start S = 2, recent R = 3, so W = 6 (sink_decode_through_windows);
        # the dead token goes right after each forward, so 5 tokens stay between steps.
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, UnrotatedCache, trace, positions="cache", key_positions="unrotated",
                               eviction="eager", after_forward=StartRecent(2, 3))
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("steps recorded: 31 of 31 steps", result.stdout)

    def test_cache_relative_keys_reencoded_after_the_forward_pass_verify(self):
        # The same eviction with keys at cache positions: kept keys re-rotated for the next
        # token right away (E(n) instead of E(n-1)), new ones at their place in the cache.
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, GrowingCache, trace, positions="cache", key_positions="cache-relative",
                               after_forward=StartRecentShifted(2, 3, exp.rope))
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("eager: dead tokens dropped right after the forward", result.stdout)

    def test_a_cache_dropping_a_live_token_fails_with_its_class(self):
        # recent = 2 instead of 3: after each forward a token the next query needs is gone.
        # S = 2, W = 6, prompt of 3 (step 0), one token per step: token 5 (step 3) is the
        # first forward after which 5 tokens are held, so token 2 (live for token 6) goes.
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, GrowingCache, trace, positions="cache", key_positions="cache-relative",
                               after_forward=StartRecentShifted(2, 2, exp.rope))
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/1)", result.stdout)
        self.assertIn("class: dropped a live token", result.stdout)
        self.assertIn("missing: the cache dropped it", result.stdout)

    def test_a_crop_the_policy_refuses_may_be_served_by_a_cache_that_kept_the_tokens(self):
        # sliding_crop_refused_after_eviction, W = 6: after 10 tokens the crop to 8 needs
        # tokens 2..7 and the policy has evicted 0..3, so it refuses. A cache that keeps every
        # token serves it (SPEC 4): judged from the cut rows, and the steps after it (which
        # assume the refusal) are not judged. A ring of 6 that accepts it holds 4..9, not the
        # cut row: that is a refusal mismatch.
        name = "sliding_crop_refused_after_eviction"
        exp = export(self.work, name)
        served = os.path.join(self.work, "served")
        kvtrace.drive_hf_cache(exp, CroppableGrowingCache, served, positions="absolute", key_positions="absolute",
                               eviction="never")
        junit = os.path.join(self.work, "junit.xml")
        result = kvcheck("verify", os.path.join(SCENARIOS, name + ".json"), "--trace", served, "--junit", junit)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("but step 9 (crop, /steps/3) was served", result.stdout)
        self.assertIn("so the 4 steps after it, which assume the refusal, are not judged", result.stdout)
        with open(junit) as f:  # a CI's passing test case says so too
            self.assertIn("<system-out>steps recorded: 10 of 14 steps; the steps after a served crop not judged", f.read())
        ring = os.path.join(self.work, "ring")
        kvtrace.drive_hf_cache(exp, lambda: CroppableRing(6), ring, positions="absolute", key_positions="absolute")
        result = kvcheck("verify", os.path.join(SCENARIOS, name + ".json"), "--trace", ring)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("first divergence: step 9 (crop, /steps/3)", result.stdout)
        self.assertIn("class: refusal mismatch", result.stdout)
        self.assertIn("and its rows are not the cut rows: cut to 8 tokens: layer 0 row 0 kv head 0 slot 4 holds "
                      "uid 18, not this row's token", result.stdout)

    def test_a_served_crop_of_quantized_keys_is_judged_with_each_tokens_own_codes(self):
        # The cut rows' retained keys are other tokens than the uncut rows' (sliding: 2..7
        # instead of 4..9; chunked: 0..2, more than 4..5): each must be held to its own
        # stored key. Compared with another token's, a correct cache was a refusal mismatch
        # (sliding) or crashed the checker (chunked, reading past the uncut list).
        for name in ("quant_int8_sliding_crop_served", "quant_int8_chunked_crop_served"):
            exp = export(self.work, name, DATA)
            trace = os.path.join(self.work, "trace-" + name)
            kvtrace.drive_hf_cache(exp, Int8KeysGrowingCache, trace, positions="absolute", key_positions="absolute",
                                   eviction="never")
            result = kvcheck("verify", os.path.join(DATA, name + ".json"), "--trace", trace)
            self.assertEqual(result.returncode, 0, name + "\n" + result.stdout + result.stderr)
            self.assertIn("(crop, /steps/2) was served", result.stdout)
            shutil.rmtree(os.path.join(self.work, "export"))

    def test_eager_eviction_with_or_without_reencoding_passes_verify(self):
        # S = 2, W = 10, k = 4 (tests/data/sink_evict_blocks.json): dead tokens go in blocks.
        scenario = os.path.join(DATA, "sink_evict_blocks.json")
        exp = export(self.work, "sink_evict_blocks", DATA)
        for eager, reencode, declared in [(False, True, None), (True, True, None), (True, True, "eager"),
                                          (True, False, None), (True, False, "eager"), (False, True, "lazy")]:
            cache = PolicyCache(2, 10, 4, exp.rope, eager, reencode)
            trace = os.path.join(self.work, "trace-%s-%s-%s" % (eager, reencode, declared))
            kvtrace.drive_hf_cache(exp, lambda: cache, trace, positions="policy", key_positions="cache-relative",
                                   eviction=declared, after_forward=cache.after_forward)
            result = kvcheck("verify", scenario, "--trace", trace)
            self.assertEqual(result.returncode, 0, "%s %s %s\n%s" % (eager, reencode, declared, result.stdout))
            self.assertIn("eager: dead tokens dropped" if eager else "lazy: dead tokens kept", result.stdout)

    def test_a_lazy_cache_declared_eager_is_caught(self):
        scenario = os.path.join(DATA, "sink_evict_blocks.json")
        exp = export(self.work, "sink_evict_blocks", DATA)
        cache = PolicyCache(2, 10, 4, exp.rope, eager=False)
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: cache, trace, positions="policy", key_positions="cache-relative",
                               eviction="eager")
        result = kvcheck("verify", scenario, "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("class: dead token held under eager eviction", result.stdout)

    def test_hand_edited_traces_cannot_pass_by_saying_less(self):
        # NaN values, a left-out append step, an unreadable query: each fails, with a class.
        scenario = os.path.join(SCENARIOS, "sliding_baseline.json")
        exp = export(self.work, "sliding_baseline")
        cases = {}
        for name in ("nan_values", "left_out", "bad_query"):
            trace = os.path.join(self.work, name)
            kvtrace.drive_hf_cache(exp, lambda: SlidingWindowCache(exp.policy["window"]), trace)
            cases[name] = trace
        values = os.path.join(cases["nan_values"], "step003_l0_values.npy")
        a = np.load(values)
        a[0, 0, 2, :] = np.nan
        np.save(values, a)
        manifest = os.path.join(cases["left_out"], "manifest.json")
        with open(manifest) as f:
            m = json.load(f)
        m["steps"][2] = {}
        with open(manifest, "w") as f:
            json.dump(m, f)
        q = os.path.join(cases["bad_query"], "step003_l0_q.npy")
        np.save(q, np.full_like(np.load(q), np.nan))
        expected = {"nan_values": "class: stale slot", "left_out": "class: trace incomplete",
                    "bad_query": "class: positions wrong"}
        for name, trace in cases.items():
            result = kvcheck("verify", scenario, "--trace", trace)
            self.assertEqual(result.returncode, 1, name + "\n" + result.stdout + result.stderr)
            self.assertIn(expected[name], result.stdout, name)

    def test_block_eviction_is_held_to_the_last_l_of_t_tokens(self):
        # sliding_baseline: W = 6, 14 tokens. Buffers of 6 (a plain window), 8 (G = 3) and 11
        # (G = 6) pass declared {"blocks": C}, holding up to C - W tokens beyond the window.
        # Planted: a buffer that evicts one token too few at once (its W taken as 7) holds one
        # that the real buffer has evicted; one whose capacity is 7 where 8 is declared drops
        # one the buffer still holds. Declared lazy, the correct buffer of 8 holds extras.
        name = "sliding_baseline"
        exp = export(self.work, name)
        scenario = os.path.join(SCENARIOS, name + ".json")

        def verify(hook, declared):
            trace = os.path.join(self.work, "trace")
            if os.path.exists(trace):
                shutil.rmtree(trace)
            kvtrace.drive_hf_cache(exp, GrowingCache, trace, positions="absolute", key_positions="absolute",
                                   eviction=declared, after_forward=hook)
            return kvcheck("verify", scenario, "--trace", trace)

        for capacity in (6, 8, 11):
            result = verify(BlockBuffer(capacity, 6), {"blocks": capacity})
            self.assertEqual(result.returncode, 0, "C=%d\n%s%s" % (capacity, result.stdout, result.stderr))
            self.assertIn("sliding layers: the last L(T) tokens of a buffer of %d, evicted in blocks" % capacity,
                          result.stdout)
        result = verify(BlockBuffer(8, 7), {"blocks": 8})
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        # T = 9: the real buffer evicted 3 (tokens 0..2), this one 2: token 2 is extra.
        self.assertIn("first divergence: step 5 (decode, /steps/1)", result.stdout)
        self.assertIn("still holds uid", result.stdout)
        self.assertIn("(token 2), which a buffer of 8 evicting 3 at once (its last 6 of 9 tokens) has evicted",
                      result.stdout)
        self.assertIn("class: block eviction count wrong", result.stdout)
        result = verify(BlockBuffer(7, 6), {"blocks": 8})
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        # T = 8: a buffer of 7 has evicted tokens 0 and 1, which one of 8 still holds.
        self.assertIn("first divergence: step 4 (decode, /steps/1)", result.stdout)
        self.assertIn("(token 0), which a buffer of 8 evicting 3 at once (its last 8 of 8 tokens) still holds",
                      result.stdout)
        self.assertIn("class: block eviction count wrong", result.stdout)
        result = verify(BlockBuffer(8, 6), "lazy")
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("which the policy evicted", result.stdout)

    def test_declared_lazy_eviction_is_held_to_it(self):
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, UnrotatedCache, trace, positions="cache", key_positions="unrotated",
                               eviction="lazy", after_forward=StartRecent(2, 3))
        result = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("which the cache is declared to keep until the next token (lazy)", result.stdout)

    def test_deferred_eviction_lets_a_cache_hold_what_its_chunk_saw_until_its_next_update(self):
        # W = 8: 5 tokens, then a chunk of 6. The cache holds the 4 it kept plus the chunk's 6
        # (10 > W) until its next update trims them: exact outputs and positions. Declared
        # "deferred" it passes; declared "lazy", the tokens no later query needs are extra.
        exp = export(self.work, "sliding_chunk_crosses_window")
        trace = os.path.join(self.work, "trace")
        scenario = os.path.join(SCENARIOS, "sliding_chunk_crosses_window.json")
        kvtrace.drive_hf_cache(exp, lambda: TrimmedAtNextUpdateCache(8), trace, positions="absolute",
                               eviction="deferred")
        result = kvcheck("verify", scenario, "--trace", trace)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        shutil.rmtree(trace)
        kvtrace.drive_hf_cache(exp, lambda: TrimmedAtNextUpdateCache(8), trace, positions="absolute",
                               eviction="lazy")
        result = kvcheck("verify", scenario, "--trace", trace)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("which the policy evicted", result.stdout)

    def test_float16_traces_are_judged_like_float32(self):
        # A correct cache passes in float16, and the buggy SinkCache is diagnosed as in
        # float32: same class, step and slot.
        scenario = os.path.join(SCENARIOS, "sink_decode_through_windows.json")
        exp = export(self.work, "sink_decode_through_windows")
        make = lambda: ShiftingSinkCache(exp.policy["sinks"], exp.policy["window"])
        good = os.path.join(self.work, "good16")
        kvtrace.drive_hf_cache(exp, make, good, positions="policy", key_positions="cache-relative", dtype="float16")
        result = kvcheck("verify", scenario, "--trace", good)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        verdicts = []
        for dtype in ("float32", "float16"):
            bad = os.path.join(self.work, "bad" + dtype)
            kvtrace.drive_hf_cache(exp, make, bad, positions="absolute", key_positions="cache-relative", dtype=dtype)
            result = kvcheck("verify", scenario, "--trace", bad)
            self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
            verdicts.append([line for line in result.stdout.splitlines()
                             if line.startswith(("first divergence", "class", "  slot"))])
        self.assertEqual(verdicts[0], verdicts[1])
        self.assertIn("class: new key not shifted", verdicts[1])

    def test_float16_traces_at_head_dim_128(self):
        # D = 128 as in Llama: float16 rounding of 128 values per slot must neither break
        # identification nor recovery, and the new-key bug is still found at its step.
        scenario = os.path.join(DATA, "llama_shape_sink_fp16.json")
        exp = export(self.work, "llama_shape_sink_fp16", DATA)
        make = lambda: ShiftingSinkCache(exp.policy["sinks"], exp.policy["window"])
        good = os.path.join(self.work, "good")
        kvtrace.drive_hf_cache(exp, make, good, positions="policy", key_positions="cache-relative", dtype="float16")
        result = kvcheck("verify", scenario, "--trace", good)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        bad = os.path.join(self.work, "bad")
        kvtrace.drive_hf_cache(exp, make, bad, positions="absolute", key_positions="cache-relative", dtype="float16")
        result = kvcheck("verify", scenario, "--trace", bad)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        # Prompt 10 (step 0), then token 10 + k at step 1 + k: token 16 (step 7) is the first to evict.
        self.assertIn("first divergence: step 7 (decode, /steps/1)", result.stdout)
        self.assertIn("class: new key not shifted", result.stdout)

    def test_verify_writes_reports_and_shows_a_step_asked_for(self):
        scenario = os.path.join(SCENARIOS, "sink_decode_through_windows.json")
        exp = export(self.work, "sink_decode_through_windows")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda: ShiftingSinkCache(exp.policy["sinks"], exp.policy["window"]), trace,
                               positions="absolute", key_positions="cache-relative")
        page, junit, report = (os.path.join(self.work, name) for name in ("page.html", "r.xml", "r.json"))
        result = kvcheck("verify", scenario, "--trace", trace, "--html", page, "--junit", junit, "--json", report,
                         "--step", "6")
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        # The step asked for gets its own table, with the distances the trace's queries used.
        self.assertIn("asked for: step 6 (decode, /steps/1), row 0", result.stdout)
        self.assertIn("after it: the error grows by about one per step", result.stdout)
        with open(page) as f:
            html = f.read()
        self.assertIn("<svg", html)
        self.assertIn("Class: new key not shifted", html)
        with open(junit) as f:
            self.assertIn('failures="1"', f.read())
        import json
        with open(report) as f:
            self.assertEqual(json.load(f)["failed"], 1)
        result = kvcheck("verify", scenario, "--trace", trace, "--step", "99")
        self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
        self.assertIn("--step: step 99 does not exist: this scenario has steps 0 to 30", result.stderr)

    def drive_every_fixture(self, policies, features=(), without=()):
        """Every built-in fixture of these policies, driven through kvtrace by SpecCache (a
        cache that claims exactly the policy), must pass verify; none may be refused.
        SpecCache stores floats: the quantized fixtures (SPEC 9) are not its to pass. A prune
        (SPEC 11) is a press's, not a cache's call: those fixtures are checked by
        test_prune_fixtures_match_an_independent_numpy_reference and by kvpress (peer.kvpress)."""
        found = kvtrace.fixtures(KVCHECK, policies=policies, features=features,
                                 without=("quantized", "paged", "prune", *without))
        self.assertGreater(len(found), 0)
        failures = []
        for fixture in found:
            work = tempfile.mkdtemp(prefix="kvtrace-fixture-", dir=self.work)
            out = os.path.join(work, "export")
            done = kvcheck("export", fixture["file"], "--out", out)
            self.assertEqual(done.returncode, 0, done.stderr)
            exp = kvtrace.Export(out)
            trace = os.path.join(work, "trace")
            result = kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch), trace, positions="policy",
                                            key_positions="cache-relative", chunks="eviction", eviction="lazy")
            verify = kvcheck("verify", fixture["file"], "--trace", trace)
            if result.error or result.skipped or verify.returncode != 0:
                failures.append("%s: %s %s\n%s" % (fixture["name"], result.error, result.skipped,
                                                    verify.stdout[-3000:] + verify.stderr))
        self.assertEqual(failures, [], "\n\n".join(failures))
        return found

    def test_every_full_fixture_passes_through_kvtrace(self):
        self.drive_every_fixture(["full"])

    def test_every_sliding_fixture_passes_through_kvtrace(self):
        self.drive_every_fixture(["sliding"])

    def test_every_sink_fixture_passes_through_kvtrace(self):
        found = self.drive_every_fixture(["sink"])
        features = set(f for fixture in found for f in fixture["features"])
        for feature in ("left_padding", "crop", "reorder", "reset", "dense_prefill", "original_positions",
                        "evict_block", "learned_sinks", "rope_scaling", "partial_rotary", "half_precision"):
            self.assertIn(feature, features)

    def test_every_per_layer_fixture_passes_through_kvtrace(self):
        found = self.drive_every_fixture(["full", "sliding", "sink", "chunked"], features=["per_layer_policy"])
        self.assertIn("gpt_oss_hybrid_yarn_learned_sinks", [f["name"] for f in found])
        self.assertIn("llama4_chunked_full_hybrid", [f["name"] for f in found])

    def test_every_per_layer_rope_fixture_passes_through_kvtrace(self):
        # SPEC 10.1 from NumPy: SpecCache rotates each layer's keys with export.layer_rope(l)
        # (None: a NoPE layer, left as it is), and the driver rotates queries the same way.
        found = self.drive_every_fixture(["full", "sliding", "sink", "chunked"], features=["per_layer_rope"])
        names = [f["name"] for f in found]
        self.assertIn("gemma3_sliding_full_two_bases", names)
        self.assertIn("llama4_chunked_nope", names)

    def test_a_sliding_layer_under_a_shift_passes_through_kvtrace(self):
        # SPEC 10.4 from NumPy: SpecCache keeps what the sink layer keeps (cache positions),
        # and the driver's mask shows a sliding layer's query the keys within its window of
        # places; the sinks leave and return with each shift.
        found = self.drive_every_fixture(["sink", "sliding"], features=["per_layer_policy"])
        self.assertIn("gemma3_sliding_under_context_shift", [f["name"] for f in found])

    def test_every_chunked_fixture_passes_through_kvtrace(self):
        # SPEC 10.2 from NumPy: SpecCache keeps exactly each row's last chunk, and the
        # driver's mask shows token t its last t % C + 1 written slots.
        found = self.drive_every_fixture(["chunked"])
        self.assertIn("llama4_chunked_decode_and_chunks", [f["name"] for f in found])

    def test_a_chunked_layer_masked_as_a_sliding_window_is_named_from_its_outputs(self):
        # A cache keeping each row's last C tokens (a ring, which SPEC 10.2 allows) passes
        # under the chunk mask; under a sliding-window mask of C its queries see the previous
        # chunk, and the trace (outputs, no visible pairs) is named by recomputing them.
        scenario = "chunked_past_the_buffer_step"
        exp = export(self.work, scenario, DATA)
        ring = [{"type": "sliding", "window": 300}]
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch, keeps=ring), trace, positions="policy")
        verify = kvcheck("verify", os.path.join(DATA, scenario + ".json"), "--trace", trace)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        shutil.rmtree(trace)

        def window_of_c(cache, cache_position, chunk):
            last = chunk.slots - chunk.n + np.arange(chunk.n)  # right-aligned: each query's own slot
            j = np.arange(chunk.slots)
            seen = (j[None, :] <= last[:, None]) & (last[:, None] - j[None, :] < 300)
            return np.broadcast_to(seen, (1, chunk.n, chunk.slots))

        kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch, keeps=ring), trace, positions="policy",
                               mask=window_of_c)
        verify = kvcheck("verify", os.path.join(DATA, scenario + ".json"), "--trace", trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("query token 300", verify.stdout)
        self.assertIn("class: chunk taken as a sliding window", verify.stdout)

    def test_a_sliding_window_under_a_shift_measured_in_token_indices_is_named_from_its_outputs(self):
        # SPEC 10.4, one row: SpecCache keeps what the sink layer keeps; the model's mask, written
        # here, shows a sliding layer's query t the sinks while Pq - j < W (right) or while
        # t - j < W (llama.cpp issue 12357's family: the sinks leave for good). The second, with
        # the rotated queries removed from the trace so that only outputs speak, is named by
        # recomputing the first wrong output under that mistake.
        scenario = "sliding_under_shift_one_row"
        exp = export(self.work, scenario, DATA)

        def mask(in_token_indices):
            def shifted_mask(cache, cache_position, chunk):
                policy = exp.layer_policy(chunk.layer)
                sinks, window = policy["sinks"], policy.get("swa")
                t = chunk.token_index[0]                         # [n]: one row, no padding
                evicted = np.array([kvtrace.evicted(policy, int(x)) for x in t])
                last = chunk.slots - chunk.n + np.arange(chunk.n)  # each query's own slot
                j = np.arange(chunk.slots)
                sink = j[None, :] < sinks
                seen = (j[None, :] <= last[:, None]) & (sink | (last[:, None] - j[None, :] < (t + 1 - sinks - evicted)[:, None]))
                if window:
                    pq = t - evicted
                    distance = np.where(sink, (t if in_token_indices else pq)[:, None] - j[None, :],
                                        last[:, None] - j[None, :])
                    seen &= distance < window
                return seen[None]
            return shifted_mask

        scenario_file = os.path.join(DATA, scenario + ".json")
        trace = os.path.join(self.work, "trace")
        for in_token_indices in (False, True):
            if os.path.exists(trace):
                shutil.rmtree(trace)
            kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch), trace, positions="policy",
                                   key_positions="cache-relative", chunks="eviction", eviction="lazy",
                                   mask=mask(in_token_indices))
            manifest_path = os.path.join(trace, "manifest.json")
            with open(manifest_path) as f:
                manifest = json.load(f)
            for step in manifest["steps"]:
                for layer in step.get("layers", []):
                    layer.pop("q", None)
            with open(manifest_path, "w") as f:
                json.dump(manifest, f)
            verify = kvcheck("verify", scenario_file, "--trace", trace)
            if not in_token_indices:
                self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
                continue
            self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
            # Token 8 is the first whose Pq (8 - 4 = 4) and index differ by a shift: sink 0 is at
            # distance 4 < 6 in positions but 8 in indices.
            self.assertIn("query token 8", verify.stdout)
            self.assertIn("class: sliding window measured before the shift", verify.stdout)

    def test_a_sliding_layer_shifted_with_the_global_rope_is_named_with_the_shift(self):
        # llama.cpp issue 12357's mechanism: a sliding layer's key written at p0 with its own
        # rope (theta 10,000), then moved by every shift with the global layer's (theta 1e6,
        # linear 8), as SpecCache holds it otherwise. Its key is then no rotation under either
        # rope alone; the checker finds the composition at the first shift.
        scenario = "sliding_under_shift_one_row"
        exp = export(self.work, scenario, DATA)
        shift_rope = exp.layer_rope(2)

        class ShiftsWithTheGlobalRope(SpecCache):
            def tensors(self, layer, row_tokens, e):
                keys, values = super().tensors(layer, row_tokens, e)
                policy = self.policies[layer]
                if not policy.get("swa"):
                    return keys, values
                for b, entries in enumerate(row_tokens):
                    first = keys.shape[2] - len(entries)
                    for i, entry in enumerate(entries):
                        if entry is None:
                            continue
                        t, raw, _ = entry
                        p0 = position(policy, t, kvtrace.evicted(policy, t))  # where it was written
                        written = kvtrace.rotate(raw[:, None, :], [p0], self.ropes[layer])
                        moved = position(policy, t, e[b]) - p0
                        keys[b, :, first + i] = kvtrace.rotate(written, [moved], shift_rope, scaled=False)[:, 0]
                return keys, values

        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda batch: ShiftsWithTheGlobalRope(exp, batch), trace, positions="policy",
                               key_positions="cache-relative", chunks="eviction", eviction="lazy")
        verify = kvcheck("verify", os.path.join(DATA, scenario + ".json"), "--trace", trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("fits a shift of -4 under another layer's rope (theta 1e+06, linear) after its write at 6",
                      verify.stdout)
        self.assertIn("class: layer rotated with another layer's rope", verify.stdout)

    def test_a_sliding_layer_under_a_shift_may_drop_what_no_later_query_sees(self):
        # SPEC 10.4, as llama.cpp's iSWA cache reuses masked cells: the one-row fixture with a
        # window of 4 under S 2, C 8, k 4. After n tokens the next query sits at n - E(n); a
        # shift moves it and the non-sinks alike, so a non-sink j with n - j >= 4 is hidden
        # for good; a sink j comes back when the query falls to C - k = 4: sink 0 never (4 - 0
        # >= 4), sink 1 always (4 - 1 < 4). The cache below zeroes tokens in its state only
        # (what update() returns is whole, so the outputs stay right).
        with open(os.path.join(DATA, "sliding_under_shift_one_row.json")) as f:
            scenario = json.load(f)
        for layer in scenario["policy"][:2]:
            layer["window"] = 4
        path = os.path.join(self.work, "window_4.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        exp = export(self.work, "window_4", self.work)

        def dead(policy, n, t):
            return t >= policy["sinks"] and t < policy["sinks"] + kvtrace.evicted(policy, n)

        def hidden_now(policy, n, t):
            query = n - kvtrace.evicted(policy, n)
            return dead(policy, n, t) or query - position(policy, t, kvtrace.evicted(policy, n)) >= 4

        def hidden_for_good(policy, n, t):
            query = n - kvtrace.evicted(policy, n)
            if t < policy["sinks"]:
                return min(query, policy["window"] - policy["evict"]) - t >= 4
            return dead(policy, n, t) or n - t >= 4

        class DropsHidden(SpecCache):
            def __init__(self, exp, batch, hidden):
                self.hidden = hidden
                super().__init__(exp, batch)

            def show(self, layer):
                super().show(layer)
                policy = self.policies[layer]
                if not policy.get("swa"):
                    return
                for b, row in enumerate(self.rows[layer]):
                    first = self.key_cache[layer].shape[2] - len(row)
                    for i, (t, _, _) in enumerate(row):
                        if self.hidden(policy, self.count[layer][b], t):
                            self.key_cache[layer][b, :, first + i] = 0
                            self.value_cache[layer][b, :, first + i] = 0

        verdicts = {}
        for name, hidden in (("for good", hidden_for_good), ("now", hidden_now)):
            trace = os.path.join(self.work, "trace " + name)
            kvtrace.drive_hf_cache(exp, lambda batch: DropsHidden(exp, batch, hidden), trace, positions="policy",
                                   key_positions="cache-relative", chunks="eviction", eviction="lazy")
            verdicts[name] = kvcheck("verify", path, "--trace", trace)
        good, now = verdicts["for good"], verdicts["now"]
        self.assertEqual(good.returncode, 0, good.stdout + good.stderr)
        self.assertEqual(now.returncode, 1, now.stdout + now.stderr)
        # After the 7-token prompt the next query sits at 7: sink 1 is 6 away, back at 4 - 1.
        self.assertIn("first divergence: step 0", now.stdout)
        self.assertIn("layer 0 row 0 kv head 0 lost uid", now.stdout)
        self.assertRegex(now.stdout, r"lost uid \d+ \(token 1\), which the next token still sees")
        self.assertNotRegex(now.stdout, r"lost uid \d+ \(token [023]\)")

    def test_fixture_filters_follow_policies_and_features(self):
        every = kvtrace.fixtures(KVCHECK)
        sliding = kvtrace.fixtures(KVCHECK, policies=["sliding"])
        self.assertTrue(sliding and all(f["policies"] == ["sliding"] * len(f["policies"]) for f in sliding))
        plain = kvtrace.fixtures(KVCHECK, without=["left_padding", "per_layer_policy"])
        self.assertTrue(plain and not any("left_padding" in f["features"] for f in plain))
        self.assertEqual(len(every), len(plain) + len([f for f in every if {"left_padding", "per_layer_policy"}
                                                       & set(f["features"])]))
        with self.assertRaisesRegex(ValueError, "--without: nope not in"):
            kvtrace.fixtures(KVCHECK, without=["nope"])

    def test_a_cache_counting_padding_as_tokens_fails(self):
        # The same cache, but it takes the padded places for tokens: its sinks are padding.
        exp = export(self.work, "sink_left_padding_mixed_lengths")
        trace = os.path.join(self.work, "trace")
        kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch, honours_padding=False), trace,
                               positions="policy", key_positions="cache-relative", chunks="eviction")
        verify = kvcheck("verify", os.path.join(SCENARIOS, "sink_left_padding_mixed_lengths.json"), "--trace", trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("class: padding counted as sink or position", verify.stdout)

    def test_a_model_mask_over_a_sink_cache_shows_a_chunk_its_future(self):
        # transformers 4.46's Llama mask: slot j is hidden from the query at cache_position p
        # only when j > p. Over a cache that shifts, slot indices stay below W while p grows,
        # so once the cache is full every query of a chunk sees every slot: the chunk's own
        # later tokens included. The driver's own mask is right, so only the model's shows it.
        def llama_mask(cache, cache_position, chunk):
            batch = chunk.positions.shape[0]
            slots = np.arange(chunk.slots)
            visible = slots[None, None, :] <= np.asarray(cache_position)[None, :, None]
            return np.broadcast_to(visible, (batch, chunk.n, chunk.slots))

        exp = export(self.work, "sink_chunk_into_full_cache", DATA)
        scenario = os.path.join(DATA, "sink_chunk_into_full_cache.json")
        for mask, expected in (("auto", 0), (llama_mask, 1)):
            trace = os.path.join(self.work, "trace")
            kvtrace.drive_hf_cache(exp, lambda batch: SpecCache(exp, batch), trace, positions="policy",
                                   key_positions="cache-relative", mask=mask)
            verify = kvcheck("verify", scenario, "--trace", trace)
            self.assertEqual(verify.returncode, expected, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 5 (append, /steps/2), row 0, layer 0, head 0, query token 12",
                      verify.stdout)
        self.assertIn("class: chunk sees future keys", verify.stdout)

    def test_a_mask_function_that_fails_is_a_usage_error(self):
        exp = export(self.work, "sliding_baseline")
        trace = os.path.join(self.work, "trace")
        with self.assertRaisesRegex(ValueError, "the mask function returned shape \\[2\\], expected \\[B, n, slots\\]"):
            kvtrace.drive_hf_cache(exp, lambda: GrowingCache(), trace, mask=lambda cache, p, chunk: np.ones(2))
        with self.assertRaisesRegex(ValueError, "the mask function raised ZeroDivisionError"):
            kvtrace.drive_hf_cache(exp, lambda: GrowingCache(), trace, mask=lambda cache, p, chunk: 1 / 0)
        self.assertFalse(os.path.exists(trace))

    def test_rotate_matches_the_reference_convention(self):
        # D = 2: one pair turning one radian per position.
        out = kvtrace.rotate(np.array([[1.0, 0.0]]), [1.0], {"theta": 10000.0, "layout": "half"})
        np.testing.assert_allclose(out, [[np.cos(1.0), np.sin(1.0)]], atol=1e-15)


if __name__ == "__main__":
    unittest.main()
