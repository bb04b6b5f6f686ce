"""SPEC 9 from outside: `kvcheck export` of a quantized scenario writes the codes and scales a
cache must hold and R_stored, the outputs over them. A NumPy implementation of the SPEC
(tests/spec_quant.py, written apart from the C++) recomputes both; a small case is checked
against values worked out by hand."""

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
import spec_quant  # noqa: E402

KVCHECK = os.environ.get("KVCHECK_BIN", os.path.join(ROOT, "build", "kvcheck"))


def kvcheck(*args):
    return subprocess.run([KVCHECK, *args], capture_output=True, text=True)


def layer_quants(manifest):
    """One kv_quant per layer: a per-layer list as it is ({} for a null layer, kept in
    kv_dtype), else the one repeated."""
    q, L = manifest["kv_quant"], manifest["dimensions"]["layers"]
    return [x or {} for x in q] if isinstance(q, list) else [q] * L


def shared_rules(manifest):
    """The residual, flush, read and transform rules: every quantized layer's."""
    return next(q for q in layer_quants(manifest) if q)


def load_codes(out, step, names):
    """Per name (k_codes, k_scales, ...) a function of the layer giving its [B, R, Hkv, ...]
    array: a slice of the stacked file, or (a per-layer kv_quant list) the layer's own file,
    None where the layer does not quantize that tensor."""
    arrays = {}
    for n in names:
        if n not in step:
            continue
        if isinstance(step[n], list):
            files = [np.load(os.path.join(out, f)) if f is not None else None for f in step[n]]
            arrays[n] = lambda l, files=files: files[l]
        else:
            stacked = np.load(os.path.join(out, step[n]))
            arrays[n] = lambda l, stacked=stacked: stacked[l]
    return arrays


class QuantExportTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-quant-")
        self.addCleanup(shutil.rmtree, self.work, True)

    def export(self, scenario_path):
        out = os.path.join(self.work, "export-" + os.path.basename(scenario_path))
        done = kvcheck("export", scenario_path, "--out", out)
        self.assertEqual(done.returncode, 0, done.stderr)
        return out

    def test_a_q8_0_case_worked_out_by_hand(self):
        # Two tokens, head_dim 32, one head. Token 0's key has amax 127, so d = 1 and its codes
        # are round(x) half away from zero; its value has amax 1, so d = 1/127 stored in
        # float16: 1032 * 2^-17. At position 0 the key is not rotated.
        k0 = [127.0, 2.5, -2.5, 0.49] + [0.0] * 28
        v0 = [-1.0] + [0.0] * 31
        scenario = {
            "name": "hand_q8_0", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 32},
            "kv_quant": {"k": {"format": "q8_0"}, "v": {"format": "q8_0"}}, "policy": {"type": "full"},
            "inputs": {"q": [[[[0.0] * 32], [[0.0] * 32]]], "k": [[[k0], [[0.0] * 32]]],
                       "v": [[[v0], [[0.0] * 32]]]},
            "steps": [{"op": "append", "tokens": 1}, {"op": "decode", "steps": 1}]}
        path = os.path.join(self.work, "hand.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = self.export(path)
        k_codes = np.load(os.path.join(out, "step000_k_codes.npy"))
        self.assertEqual(k_codes.dtype, np.int8)
        self.assertEqual(list(k_codes[0, 0, 0, 0, :5]), [127, 3, -3, 0, 0])
        self.assertEqual(np.load(os.path.join(out, "step000_k_scales.npy"))[0, 0, 0, 0, 0], 1.0)
        self.assertEqual(np.load(os.path.join(out, "step000_v_codes.npy"))[0, 0, 0, 0, 0], -127)
        d = 1032.0 / 131072.0
        self.assertEqual(np.load(os.path.join(out, "step000_v_scales.npy"))[0, 0, 0, 0, 0], d)
        # One key: its weight is 1, so R_stored is the dequantized value and R_ideal the raw one.
        self.assertEqual(np.load(os.path.join(out, "step000_out_stored.npy"))[0, 0, 0, 0, 0], -127 * d)
        self.assertEqual(np.load(os.path.join(out, "step000_out.npy"))[0, 0, 0, 0, 0], -1.0)
        # Token 1 is all zeros: a zero block stores scale 0 and codes 0.
        self.assertEqual(np.load(os.path.join(out, "step001_v_scales.npy"))[0, 0, 1, 0, 0], 0.0)
        # q is zero, so both keys weigh 1/2: the output is the mean of the two stored values.
        self.assertEqual(np.load(os.path.join(out, "step001_out_stored.npy"))[0, 0, 0, 0, 0], -127 * d / 2)

    def test_a_scale_frozen_at_the_first_append_worked_out_by_hand(self):
        # V int8 with one scale per tensor frozen at the row's first append: the prompt's
        # values have amax 127, so the scale is 1 and codes are round(x), half away from zero.
        # A later value of 300 saturates at 127 under that scale, as an engine that calibrated
        # on the prompt stores it.
        v = [[2.5, 0.0], [-127.0, 0.5], [300.0, -1.5]]
        scenario = {
            "name": "hand_first_append", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "head_dim": 2},
            "kv_quant": {"v": {"format": "int8", "scale": {"granularity": "tensor", "value": "first_append"}}},
            "policy": {"type": "full"},
            "inputs": {"q": [[[[0.0, 0.0]] for _ in v]], "k": [[[[0.0, 0.0]] for _ in v]], "v": [[[x] for x in v]]},
            "steps": [{"op": "append", "tokens": 2}, {"op": "decode", "steps": 1}]}
        path = os.path.join(self.work, "hand_first_append.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        out = self.export(path)
        codes = np.load(os.path.join(out, "step001_v_codes.npy"))[0, 0, :, 0]
        self.assertEqual(codes.tolist(), [[3, 0], [-127, 1], [127, -2]])
        self.assertEqual(np.load(os.path.join(out, "step001_v_scales.npy"))[0, 0, :, 0, 0].tolist(), [1.0, 1.0, 1.0])
        # q is zero: the decode token weighs the three values alike.
        stored = np.load(os.path.join(out, "step001_out_stored.npy"))[0, 0, 0, 0]
        ideal = np.load(os.path.join(out, "step001_out.npy"))[0, 0, 0, 0]
        np.testing.assert_allclose(stored, [(3 - 127 + 127) / 3, (0 + 1 - 2) / 3], rtol=1e-15)
        np.testing.assert_allclose(ideal, [(2.5 - 127 + 300) / 3, (0 + 0.5 - 1.5) / 3], rtol=1e-15)

    def check_export(self, out):
        """Every step's codes and scales against NumPy's SPEC 9 (a code may differ by one on a
        rounding boundary), shifts re-quantized as a chain; every decode step's R_stored
        against NumPy's attention over the exported codes."""
        with open(os.path.join(out, "manifest.json")) as f:
            m = json.load(f)
        quants, rope = layer_quants(m), m["rope"]
        L, Hkv, H, D = (m["dimensions"][k] for k in ("layers", "kv_heads", "heads", "head_dim"))
        k_in, v_in, q_in = (np.load(os.path.join(out, n + ".npy")) for n in ("k", "v", "q"))
        def transform(fmt):
            """The tensor's Hadamard matrix: block-diagonal when it declares transform_block."""
            if shared_rules(m)["transform"] != "hadamard":
                return None
            width = fmt.get("transform_block", D)
            return np.kron(np.eye(D // width), spec_quant.hadamard(width))

        state = [dict() for _ in range(m["dimensions"]["batch"])]  # row -> uid -> (position, [L][Hkv] key)
        # SPEC 9's "first_append": each row's scale per (tensor, layer, kv head), from every
        # token of its first append as stored; a hit's tokens keep their writer's, found by
        # their content (content "prefix": equal prefixes, equal vectors) and position.
        frozen = [dict() for _ in state]
        hits = [0 for _ in state]
        writers = {}

        def first_append_scales(step_row):
            scales = {}
            for name, raw in (("k", k_in), ("v", v_in)):
                for l in range(L):
                    fmt = quants[l].get(name)
                    if fmt is None or fmt["scale"]["value"] != "first_append":
                        continue
                    amax = np.zeros(Hkv)
                    for i, uid in enumerate(step_row["uids"]):
                        for g in range(Hkv):
                            x = raw[l, uid, g]
                            if name == "k":
                                x = kvtrace.rotate(x[None], [i], rope)[0]
                            x = np.asarray(x, dtype=np.float32)
                            hmat = transform(fmt)
                            if hmat is not None:
                                x = (hmat @ x.astype(np.float64)).astype(np.float32)
                            amax[g] = max(amax[g], float(np.max(np.abs(x))))
                    if fmt["scale"]["granularity"] == "tensor":
                        amax[:] = amax.max()
                    for g in range(Hkv):
                        scales[name, l, g] = float(spec_quant.scale_dtype(fmt)(np.float32(amax[g] / spec_quant.RANGE[fmt["format"]])))
            return scales

        def frozen_fmt(name, fmt, b, l, g, uid, p):
            if fmt["scale"]["value"] != "first_append":
                return fmt
            content = (name, l, g, p, (k_in if name == "k" else v_in)[l, uid, g].tobytes())
            if p < hits[b]:
                s = writers[content]
            else:
                s = frozen[b][name, l, g]
                writers.setdefault(content, s)
            return dict(fmt, scale=dict(fmt["scale"], value=[s]))

        def store(fmt, x, g):
            x = np.asarray(x, dtype=np.float32)
            hmat = transform(fmt)
            if hmat is not None:
                x = (hmat @ x.astype(np.float64)).astype(np.float32)
            codes, scales, zeros, near = spec_quant.quantize(fmt, x, g)
            back = spec_quant.dequantize(fmt, codes, scales, zeros)
            return (hmat @ back if hmat is not None else back), (codes, scales, zeros, near)

        compared = 0
        for step in m["steps"]:
            if step["op"] == "reorder":
                state = [dict(state[r]) for r in step["rows_from"]]
                frozen = [frozen[r] for r in step["rows_from"]]
                hits = [hits[r] for r in step["rows_from"]]
            elif step["op"] == "reset":
                state = [dict() for _ in range(step["batch"])]
            with open(os.path.join(out, step["cache"])) as f:
                rows = json.load(f)["rows"]
            if len(state) < len(rows):
                state += [dict() for _ in range(len(rows) - len(state))]
            frozen += [dict() for _ in range(len(state) - len(frozen))]
            hits += [0 for _ in range(len(state) - len(hits))]
            if step["op"] == "append":
                for b, step_row in enumerate(step["rows"]):
                    if step_row["uids"] and step_row["indices"][0] == 0:  # the row's first append
                        frozen[b] = first_append_scales(step_row)
                        hits[b] = step_row.get("expect_hit", {}).get("min", 0)
            arrays = load_codes(out, step, ("k_codes", "k_scales", "v_codes", "v_scales", "k_zero", "v_zero"))
            for b, row in enumerate(rows):
                for i, key in enumerate(row["keys"]):
                    uid, p = key["uid"], key["position"]
                    before = state[b].get(uid)
                    keys = []
                    for l in range(L):
                        for g in range(Hkv):
                            if before is None:
                                x = kvtrace.rotate(k_in[l, uid, g][None], [p], rope)[0]
                            elif before[0] != p:  # a shift: what is stored, turned, stored again
                                x = kvtrace.rotate(before[1][l * Hkv + g][None], [p - before[0]], rope, scaled=False)[0]
                            else:
                                x = None
                            if "k" in quants[l] and x is not None:
                                held, (codes, scales, zeros, near) = store(
                                    frozen_fmt("k", quants[l]["k"], b, l, g, uid, p), x, g)
                                got = arrays["k_codes"](l)[b, i, g].astype(np.int64)
                                bad = (got != codes) & ~(near & (np.abs(got - codes) == 1))
                                self.assertFalse(bad.any(), "%s step %d row %d uid %d: key codes %s, NumPy %s" % (
                                    m["name"], step["index"], b, uid, got[bad], codes[bad]))
                                np.testing.assert_allclose(arrays["k_scales"](l)[b, i, g], scales, rtol=2 ** -10)
                                compared += len(codes)
                                keys.append(held)
                            else:
                                keys.append(before[1][l * Hkv + g] if x is None else x)
                            if "v" in quants[l] and before is None:
                                _, (codes, scales, zeros, near) = store(
                                    frozen_fmt("v", quants[l]["v"], b, l, g, uid, p), v_in[l, uid, g], g)
                                got = arrays["v_codes"](l)[b, i, g].astype(np.int64)
                                bad = (got != codes) & ~(near & (np.abs(got - codes) == 1))
                                self.assertFalse(bad.any(), "%s: value codes differ" % m["name"])
                                compared += len(codes)
                    state[b][uid] = (p, keys)
                if step["op"] != "append" or step["chunk"] != 1 or not step["rows"][b]["uids"]:
                    continue
                # R_stored of a decode token: over the row's kept keys, from the exported codes.
                stored = np.load(os.path.join(out, step["out_stored"]))
                qp = row["query_position"]
                for l in range(L):
                    for h in range(H):
                        g = h // (H // Hkv)
                        ks, vs = [], []
                        for i, key in enumerate(row["keys"]):
                            def deq(name, raw):
                                if name not in quants[l]:
                                    return raw
                                zero = arrays.get(name + "_zero")
                                x = spec_quant.dequantize(quants[l][name],
                                                          arrays[name + "_codes"](l)[b, i, g].astype(np.int64),
                                                          arrays[name + "_scales"](l)[b, i, g],
                                                          zero(l)[b, i, g] if zero is not None else None)
                                hmat = transform(quants[l][name])
                                return hmat @ x if hmat is not None else x
                            ks.append(deq("k", state[b][key["uid"]][1][l * Hkv + g]))
                            vs.append(deq("v", v_in[l, key["uid"], g].astype(np.float64)))
                        uid = step["rows"][b]["uids"][0]
                        q = kvtrace.rotate(q_in[l, uid, h][None], [qp], rope)[0]
                        x = np.array(ks) @ q * m["softmax_scale"]
                        w = np.exp(x - x.max())
                        want = (w / w.sum()) @ np.array(vs)
                        np.testing.assert_allclose(stored[l, b, 0, h], want, rtol=1e-9, atol=1e-12,
                                                   err_msg="%s step %d" % (m["name"], step["index"]))
        return compared

    def check_residual_export(self, out):
        """A residual's export (full attention, no shift) against NumPy's own simulation of
        SPEC 9's rules: which tokens are raw after each step (the `raw` mask), their codes and
        scales once quantized (a flush "requantize_all" quantizes what the codes stand for
        again), and every decode step's R_stored, over the state its query reads: after the
        flush under chunk_reads "stored", before it, its own token raw, under "raw"."""
        with open(os.path.join(out, "manifest.json")) as f:
            m = json.load(f)
        quants, rope = layer_quants(m), m["rope"]
        quant = shared_rules(m)
        R, requantize_all = quant["residual"], quant["flush"] == "requantize_all"
        prefill_store, raw_reads = quant["prefill"] == "store", quant["chunk_reads"] == "raw"
        dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": None}[m.get("kv_dtype", "float32")]
        self.assertIsNotNone(dtype, "bfloat16 residuals are not simulated here")
        L, Hkv, H, D = (m["dimensions"][k] for k in ("layers", "kv_heads", "heads", "head_dim"))
        k_in, v_in, q_in = (np.load(os.path.join(out, n + ".npy")) for n in ("k", "v", "q"))
        rows = [[] for _ in range(m["dimensions"]["batch"])]  # per row, oldest first: token dicts

        def quantize(tokens):
            """Quantized together (scales along the token axis span them), oldest first."""
            for name in ("k", "v"):
                for at in range(L * Hkv):
                    fmt = quants[at // Hkv].get(name)
                    if fmt is None or not tokens:
                        continue
                    held = np.float32([t[name][at] for t in tokens])
                    for t, (codes, scales, zeros, near) in zip(tokens, spec_quant.quantize_together(fmt, held, at % Hkv)):
                        t[name][at] = spec_quant.dequantize(fmt, codes, scales, zeros)
                        t[name + "_codes"][at] = (codes, scales, near)
            for t in tokens:
                t["raw"] = False

        def flush(row, first):
            raw = [t for t in row if t["raw"]]
            if first and prefill_store:
                quantize(raw)
            elif quant["flush"] == "block":  # KIVI: the oldest whole multiple of R, together
                quantize(raw[:len(raw) // R * R])
            elif not requantize_all:
                quantize(raw[:max(0, len(raw) - R)])
            elif len(raw) >= R:
                quantize(row)

        def attend(row, l, h, q):
            g = h // (H // Hkv)
            ks = np.array([t["k"][l * Hkv + g] for t in row], dtype=np.float64)
            vs = np.array([t["v"][l * Hkv + g] for t in row], dtype=np.float64)
            x = ks @ q * m["softmax_scale"]
            w = np.exp(x - x.max())
            return (w / w.sum()) @ vs

        compared = 0
        for step in m["steps"]:
            op = step["op"]
            if op == "reorder":
                rows = [[dict(t, k=list(t["k"]), v=list(t["v"]), k_codes=dict(t["k_codes"]), v_codes=dict(t["v_codes"]))
                         for t in rows[r]] for r in step["rows_from"]]
            elif op == "reset":
                rows = [[] for _ in range(step["batch"])]
            elif op == "crop":
                rows = [row[:step["length"]] for row in rows]
            elif op == "append":
                stored = np.load(os.path.join(out, step["out_stored"]))
                for b, entry in enumerate(step["rows"]):
                    if not entry["uids"]:
                        continue
                    first = not rows[b]
                    before = list(rows[b])
                    for uid, p in zip(entry["uids"], entry["indices"]):
                        k = [kvtrace.rotate(k_in[l, uid, g][None], [p], rope)[0].astype(dtype).astype(np.float64)
                             for l in range(L) for g in range(Hkv)]
                        v = [v_in[l, uid, g].astype(dtype).astype(np.float64) for l in range(L) for g in range(Hkv)]
                        rows[b].append({"uid": uid, "raw": True, "k": k, "v": v, "k_codes": {}, "v_codes": {}})
                    if not raw_reads:
                        flush(rows[b], first)
                    if step["chunk"] == 1:  # a decode token: R_stored over what its query reads
                        read = before + rows[b][-1:] if raw_reads else rows[b]
                        uid, qp = entry["uids"][0], entry["query_positions"][0]
                        for l in range(L):
                            for h in range(H):
                                q = kvtrace.rotate(q_in[l, uid, h][None], [qp], rope)[0]
                                np.testing.assert_allclose(stored[l, b, 0, h], attend(read, l, h, q), rtol=1e-9,
                                                           atol=1e-12, err_msg="%s step %d" % (m["name"], step["index"]))
                                compared += 1
                    if raw_reads:
                        flush(rows[b], first)
            raw_mask = np.load(os.path.join(out, step["raw"]))
            arrays = load_codes(out, step, ("k_codes", "k_scales", "v_codes", "v_scales"))
            with open(os.path.join(out, step["cache"])) as f:
                cache_rows = json.load(f)["rows"]
            for b, row in enumerate(cache_rows):
                self.assertEqual([k["uid"] for k in row["keys"]], [t["uid"] for t in rows[b]])
                for i, token in enumerate(rows[b]):
                    self.assertEqual(bool(raw_mask[0, b, i]), token["raw"],
                                     "%s step %d row %d uid %d" % (m["name"], step["index"], b, token["uid"]))
                    if token["raw"]:
                        continue
                    for name in ("k", "v"):
                        for l in range(L):
                            if name not in quants[l]:
                                continue
                            for g in range(Hkv):
                                codes, scales, near = token[name + "_codes"][l * Hkv + g]
                                got = arrays[name + "_codes"](l)[b, i, g].astype(np.int64)
                                bad = (got != codes) & ~(near & (np.abs(got - codes) == 1))
                                self.assertFalse(bad.any(), "%s step %d row %d uid %d: %s codes %s, NumPy %s" % (
                                    m["name"], step["index"], b, token["uid"], name, got[bad], codes[bad]))
                                np.testing.assert_allclose(arrays[name + "_scales"](l)[b, i, g], scales, rtol=2 ** -10)
                                compared += len(codes)
        return compared

    def test_a_residual_worked_out_by_hand(self):
        """Residual 2, flush append, prefill residual: a prompt of 3 keeps its newest 2 raw, and
        each decode quantizes one more; the raw masks follow by hand."""
        scenario = os.path.join(self.work, "residual.json")
        with open(scenario, "w") as f:
            json.dump({"name": "residual_by_hand", "dimensions": {"layers": 1, "batch": 1, "heads": 1, "kv_heads": 1,
                                                                   "head_dim": 32},
                       "kv_quant": {"k": {"format": "q8_0"}, "v": {"format": "q8_0"}, "residual": 2,
                                    "prefill": "residual"},
                       "policy": {"type": "full"}, "seed": 7,
                       "steps": [{"op": "append", "tokens": 3}, {"op": "decode", "steps": 2}]}, f)
        out = self.export(scenario)
        masks = [np.load(os.path.join(out, "step%03d_raw.npy" % i))[0, 0].tolist() for i in range(3)]
        self.assertEqual(masks, [[0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1, 1]])  # R: the most keys a row keeps that step
        # A raw token's codes are not exported: code 0, scale NaN; a quantized one's are.
        scales = np.load(os.path.join(out, "step000_k_scales.npy"))[0, 0]
        self.assertTrue(np.isnan(scales[1]).all() and np.isnan(scales[2]).all())
        self.assertFalse(np.isnan(scales[0]).any())
        self.assertGreater(self.check_residual_export(out), 0)

    def test_every_quantized_fixture_agrees_with_numpy_spec9(self):
        found = kvtrace.fixtures(KVCHECK, features=["quantized"])
        formats, residuals, per_layer = set(), 0, 0
        for fixture in found:
            if "per_layer_policy" in fixture["features"]:
                continue
            with self.subTest(fixture=fixture["name"]):
                out = self.export(fixture["file"])
                with open(os.path.join(out, "manifest.json")) as f:
                    manifest = json.load(f)
                if any("raw" in step for step in manifest["steps"]):
                    residuals += 1
                    self.assertGreater(self.check_residual_export(out), 0)
                else:
                    self.assertGreater(self.check_export(out), 0)
                per_layer += isinstance(manifest["kv_quant"], list)
                formats |= {q[t]["format"] for q in layer_quants(manifest) for t in ("k", "v") if t in q}
        self.assertEqual(formats, {"fp8_e4m3", "fp8_e5m2", "int8", "q8_0", "q4_0", "int4", "int2", "int8_even",
                                   "int4_even"})
        self.assertGreaterEqual(residuals, 5)  # Hugging Face's convention, KIVI's, each along the token axis, mixed layers
        self.assertGreaterEqual(per_layer, 2)  # vLLM's per-layer scales, layers of different formats


if __name__ == "__main__":
    unittest.main()
