#!/usr/bin/env python3
"""kvtrace: check a KV cache written in Python against kvcheck, through files.

NumPy only (PyTorch tensors are accepted where arrays are, and converted). Three pieces:

- Export: loads a `kvcheck export` folder: the scenario's raw q/k/v by uid and its schedule.
- TraceWriter: writes a trace folder (format kvcheck-trace-1) that `kvcheck verify` reads.
- drive_hf_cache: feeds an export's schedule to any cache object with Hugging Face's
  `update(key_states, value_states, layer_idx, cache_kwargs) -> (keys, values)`, applies
  RoPE at the positions the caller chooses, runs eager attention, and writes the trace.

    exp = kvtrace.Export("out/sliding_baseline")          # kvcheck export SCENARIO --out DIR
    kvtrace.drive_hf_cache(exp, lambda: MyCache(window=6), "trace/", positions="policy",
                           key_positions="absolute")
    # then: kvcheck verify SCENARIO --trace trace/
"""

import json
import os
import shutil
import tempfile

import numpy as np


def to_numpy(x):
    """A NumPy array from a NumPy array or a PyTorch tensor (without importing torch)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class Export:
    """A `kvcheck export` folder: q [L, U, H, D], k and v [L, U, Hkv, D], and the steps."""

    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.q = np.load(os.path.join(path, "q.npy"))
        self.k = np.load(os.path.join(path, "k.npy"))
        self.v = np.load(os.path.join(path, "v.npy"))
        self.dims = self.manifest["dimensions"]
        self.rope = self.manifest["rope"]
        self.policy = self.manifest["policy"]
        self.steps = self.manifest["steps"]
        self.name = self.manifest["name"]
        self.scale = self.manifest["softmax_scale"]

    def reference_output(self, step):
        """The reference's float64 output of an append step, [L, B, n, H, D] (NaN where padded)."""
        return np.load(os.path.join(self.path, self.steps[step]["out"]))


def rotate(x, positions, rope):
    """RoPE (SPEC 2): x [..., n, D] rotated at positions [n] (or broadcastable to [..., n])."""
    x = to_numpy(x).astype(np.float64)
    d = x.shape[-1]
    factor = rope.get("factor", 1.0) if rope.get("scaling", "none") == "linear" else 1.0
    inv_freq = rope["theta"] ** (-2.0 * np.arange(d // 2) / d)
    angle = (np.asarray(positions, dtype=np.float64)[..., None] / factor) * inv_freq  # [..., n, D/2]
    cos, sin = np.cos(angle), np.sin(angle)
    if rope["layout"] == "half":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _is_trace(path):
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("format") == "kvcheck-trace-1"
    except (OSError, ValueError, AttributeError):
        return False


class TraceWriter:
    """Writes a trace folder; nothing appears at `path` until close() succeeds, and a
    folder already there is replaced only if it is a trace. Use it as a context manager
    (or call abort()) so a failure leaves no temporary folder behind."""

    def __init__(self, path, scenario, producer, key_positions):
        if key_positions not in ("cache-relative", "absolute", "unrotated"):
            raise ValueError("key_positions must be cache-relative, absolute or unrotated")
        self.path = os.path.abspath(path)
        if os.path.exists(self.path) and not (os.path.isdir(self.path) and not os.listdir(self.path)) \
                and not _is_trace(self.path):
            raise FileExistsError("%s exists and is not a kvcheck trace; refusing to replace it" % self.path)
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".kvtrace-", dir=parent)
        self.manifest = {"format": "kvcheck-trace-1", "scenario": scenario, "producer": producer,
                         "key_positions": key_positions, "steps": []}

    def step(self, layers):
        """One step: per layer a dict with keys and values [B, Hkv, slots, D], optional
        out [B, H, n, D] and rotated q [B, H, n, D]."""
        index = len(self.manifest["steps"])
        entry = []
        for l, tensors in enumerate(layers):
            files = {}
            for name in ("keys", "values", "out", "q"):
                if tensors.get(name) is None:
                    continue
                file = "step%03d_l%d_%s.npy" % (index, l, name)
                np.save(os.path.join(self.tmp, file), np.ascontiguousarray(to_numpy(tensors[name]), dtype=np.float32))
                files[name] = file
            entry.append(files)
        self.manifest["steps"].append({"layers": entry})

    def skip_step(self):
        """A step whose state was not recorded (kvcheck checks nothing there)."""
        self.manifest["steps"].append({})

    def close(self):
        try:
            with open(os.path.join(self.tmp, "manifest.json"), "w") as f:
                json.dump(self.manifest, f, indent=1)
            old = None
            if os.path.exists(self.path):  # moved aside first, so a failed rename loses nothing
                old = tempfile.mkdtemp(prefix=".kvtrace-old-", dir=os.path.dirname(self.path))
                os.rename(self.path, os.path.join(old, "trace"))
            try:
                os.rename(self.tmp, self.path)
            except OSError:
                if old:
                    os.rename(os.path.join(old, "trace"), self.path)
                raise
            if old:
                shutil.rmtree(old)
        except BaseException:
            self.abort()
            raise

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.abort()
        return False


def _attention(q, keys, values, scale, heads):
    """Eager attention: q [B, H, n, D] over keys/values [B, Hkv, S, D], causal and
    right-aligned (query i of n sees the first S - n + i + 1 slots)."""
    b, hkv, s, d = keys.shape
    if s < q.shape[2]:
        raise ValueError("the cache returned %d slots for a chunk of %d tokens: a cache that trims before "
                         "attention cannot serve a chunk longer than itself; feed shorter chunks or use a "
                         "scenario whose chunks fit" % (s, q.shape[2]))
    group = heads // hkv
    keys = np.repeat(keys, group, axis=1)
    values = np.repeat(values, group, axis=1)
    scores = np.einsum("bhnd,bhsd->bhns", q, keys) * scale
    n = q.shape[2]
    visible = np.arange(s)[None, :] <= (s - n + np.arange(n))[:, None]
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhns,bhsd->bhnd", weights, values)


def hf_cos_sin(positions, rope, head_dim):
    """cos and sin as Hugging Face's rotary embedding hands them to cache_kwargs:
    [..., n, D], each frequency repeated for both halves (rotate_half layout)."""
    factor = rope.get("factor", 1.0) if rope.get("scaling", "none") == "linear" else 1.0
    inv_freq = rope["theta"] ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    freqs = (np.asarray(positions, dtype=np.float64)[..., None] / factor) * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def drive_hf_cache(export, make_cache, trace_path, positions="policy", key_positions="absolute",
                   producer="kvtrace.drive_hf_cache", as_tensor=None):
    """Runs the export's schedule through caches made by make_cache() and writes a trace.

    positions: where new keys and queries are rotated. "policy": the query position Pq the
    scenario's policy gives each token (for a correct cache-relative sink cache: t - E);
    "absolute": the token index; "cache": slots held before the step plus the place in
    the chunk; or a function (token_index, slots_held_before, place_in_chunk) -> position.
    Attention is eager over what update() returns, causal and right-aligned, with no
    window of its own: the cache must return exactly the keys a token sees (a cache that
    returns the whole prefill and leaves the window to the model's mask is not driven).
    Left padding is not supported (Hugging Face caches take it through masks); reorder
    calls cache.reorder_cache(rows) and records the state only when the cache exposes
    key_cache/value_cache; crop calls cache.crop(length) only for crops the policy
    accepts (a refused crop is not offered to the cache); reset makes a new cache.
    as_tensor: "torch" hands update() float32 torch tensors (a transformers cache), None
    NumPy arrays, or any function array -> tensor. cache_kwargs carries Hugging Face's
    "cos" and "sin" [B, n, D] plus "positions" [B, n] and a NumPy "rotate"(x, p).
    """
    as_index = np.asarray  # reorder_cache's beam indices
    if as_tensor == "torch":
        import torch  # only when asked for
        as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        as_index = lambda rows: torch.as_tensor(rows, dtype=torch.long)
    elif as_tensor is None:
        as_tensor = lambda x: x
    if positions == "policy":
        position_of = None  # read from the export, per token
    elif positions == "absolute":
        position_of = lambda t, held, i: t
    elif positions == "cache":
        position_of = lambda t, held, i: held + i
    else:
        position_of = positions
    with TraceWriter(trace_path, export.name, producer, key_positions) as writer:
        _drive(export, make_cache, writer, position_of, as_tensor, as_index)


def _drive(export, make_cache, writer, position_of, as_tensor, as_index):
    layers, heads = export.dims["layers"], export.dims["heads"]
    cache = make_cache()
    held = None        # per layer (keys, values) the cache last returned
    held_slots = 0     # how many slots it holds, for positions="cache"
    for step in export.steps:
        op = step["op"]
        if op == "reset":
            cache = make_cache()
            held, held_slots = None, 0
            writer.skip_step()
            continue
        if op == "reorder":
            cache.reorder_cache(as_index(step["rows_from"]))
            # What the cache holds now, if it says (transformers' key_cache/value_cache
            # lists); otherwise the step is not recorded: guessing would check nothing.
            if hasattr(cache, "key_cache") and hasattr(cache, "value_cache") and len(cache.key_cache) == layers:
                held = [(to_numpy(k).astype(np.float64), to_numpy(v).astype(np.float64))
                        for k, v in zip(cache.key_cache, cache.value_cache)]
                writer.step([{"keys": k, "values": v} for k, v in held])
            else:
                writer.skip_step()
            continue
        if op == "crop":
            if "refused" not in step:
                cache.crop(step["length"])
                held, held_slots = None, min(held_slots, step["length"])
            writer.skip_step()
            continue
        rows = step["rows"]
        counts = {len(r["uids"]) for r in rows}
        if len(counts) != 1:
            raise NotImplementedError("drive_hf_cache: left padding (rows with different counts) is not supported")
        uids = np.asarray([r["uids"] for r in rows])                     # [B, n]
        n = uids.shape[1]
        if hasattr(cache, "get_seq_length"):  # Hugging Face caches say it themselves
            held_slots = int(cache.get_seq_length())
        if position_of is None:
            pos = np.asarray([r["query_positions"] for r in rows])
        else:
            pos = np.asarray([[position_of(r["indices"][i], held_slots, i) for i in range(n)] for r in rows])
        recorded = []
        for l in range(layers):
            q = np.transpose(export.q[l][uids], (0, 2, 1, 3))              # [B, H, n, D]
            k = np.transpose(export.k[l][uids], (0, 2, 1, 3))              # [B, Hkv, n, D]
            v = np.transpose(export.v[l][uids], (0, 2, 1, 3))
            q_rot = rotate(q, pos[:, None, :], export.rope)
            k_rot = rotate(k, pos[:, None, :], export.rope)
            cos, sin = hf_cos_sin(pos, export.rope, k.shape[-1])
            kwargs = {"cos": as_tensor(cos), "sin": as_tensor(sin), "positions": pos, "rope": export.rope,
                      "rotate": lambda x, p: rotate(x, p, export.rope)}
            keys, values = cache.update(as_tensor(k_rot), as_tensor(v), l, kwargs)
            keys, values = to_numpy(keys).astype(np.float64), to_numpy(values).astype(np.float64)
            out = _attention(q_rot, keys, values, export.scale, heads)
            recorded.append({"keys": keys, "values": values, "out": out, "q": q_rot})
        held = [(r["keys"], r["values"]) for r in recorded]
        held_slots = held[0][0].shape[2]
        writer.step(recorded)
