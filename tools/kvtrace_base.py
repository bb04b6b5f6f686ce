"""What every kvtrace driver shares: the export it reads (Export), the trace it writes
(TraceWriter, format kvcheck-trace-1), RoPE as the SPEC defines it (rotate, unrotate), the
eviction count of a sink policy, and what a drive returns (DriveResult, UsageError).

kvtrace.py (the Hugging Face driver and the user's entry point), kvtrace_mlx.py and
kvtrace_paged.py import from here and never from each other's callers, so the modules form no
circle. Users keep importing kvtrace: it re-exports every name below. NumPy only."""

import json
import numbers
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

def to_numpy(x):
    """A NumPy array from a NumPy array or a PyTorch tensor (without importing torch)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(getattr(x, "dtype", "")) == "torch.bfloat16":  # NumPy has none; float32 holds it exactly
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


class Export:
    """A `kvcheck export` folder: q [L, U, H, D], k and v [L, U, Hkv, D], and the steps."""

    def __init__(self, path):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError("%s does not exist: write it with `kvcheck export SCENARIO --out %s`"
                                    % (path, path))
        if not os.path.isdir(path):
            hint = (" (a scenario: export it first with `kvcheck export %s --out DIR`)" % path
                    if path.endswith(".json") else "")
            raise ValueError("%s is a file%s; Export reads the folder `kvcheck export` writes" % (path, hint))
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError("%s is not a kvcheck export (%s); write one with `kvcheck export SCENARIO --out DIR`"
                             % (path, e)) from e
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != "kvcheck-export-1":
            raise ValueError("%s/manifest.json is not a kvcheck export (format kvcheck-export-1)" % path)
        self.path = path
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

    def layer_policy(self, layer):
        """The policy of one layer (SPEC 7: `policy` may be a list, one per layer)."""
        return self.policy[layer] if isinstance(self.policy, list) else self.policy

    def layer_rope(self, layer):
        """The rope of one layer (SPEC 10.1: `rope` may be a list, one per layer; None for a
        NoPE layer, which rotate() leaves as it is)."""
        return self.rope[layer] if isinstance(self.rope, list) else self.rope

    def refuse_prune(self, driver):
        """UsageError naming `driver` when a step prunes (SPEC 11): only a press prunes, and
        kvtrace.drive_kvpress drives kvpress's."""
        for i, step in enumerate(self.steps):
            if step["op"] == "prune":
                raise UsageError("%s: step %d prunes (SPEC 11), which a cache has no call for; a press does it: "
                                 "drive the scenario with kvtrace.drive_kvpress" % (driver, i))

    def one_rope(self, driver):
        """The rope every layer shares; UsageError naming `driver` when the layers' differ."""
        if isinstance(self.rope, list):
            raise UsageError("%s: the scenario gives its layers different ropes (SPEC 10.1), which this driver "
                             "does not drive yet" % driver)
        return self.rope


def rope_frequencies(rope, head_dim):
    """The inverse frequencies of the rotated pairs [R/2] and the attention factor m, as
    SPEC 2 and 7 define them: R = rope["rotary_dim"] (default head_dim), theta^(-2i/R),
    then the scaling's map (linear: / factor; llama3 and yarn: per frequency); m is yarn's
    attention factor (1 otherwise). Written from the SPEC, apart from kvcheck's C++.
    rope None (a NoPE layer, SPEC 10.1): every frequency 0, so nothing turns."""
    if rope is None:
        return np.zeros(head_dim // 2), 1.0
    r = int(rope.get("rotary_dim") or head_dim)
    theta = float(rope["theta"])
    inv = theta ** (-2.0 * np.arange(r // 2) / r)
    scaling, m = rope.get("scaling", "none"), 1.0
    if scaling == "linear":
        inv = inv / rope.get("factor", 1.0)
    elif scaling == "llama3":
        f, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        s = (old / wavelen - low) / (high - low)
        inv = np.where(wavelen < old / high, inv, np.where(wavelen > old / low, inv / f, inv * ((1 - s) / f + s)))
    elif scaling == "yarn":
        f, old = rope["factor"], rope["original_max_position_embeddings"]

        def correction(rotations):
            return r * np.log(old / (2 * np.pi * rotations)) / (2 * np.log(theta))

        lo = max(np.floor(correction(rope.get("beta_fast", 32.0))), 0.0)
        hi = min(np.ceil(correction(rope.get("beta_slow", 1.0))), r - 1.0)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(r // 2) - lo) / (hi - lo), 0.0, 1.0)
        inv = inv / f * ramp + inv * (1 - ramp)
        m = rope.get("attention_factor", 0.1 * np.log(f) + 1.0)
    elif scaling != "none":
        raise UsageError("unknown rope scaling %r (SPEC 7 defines none, linear, llama3, yarn)" % (scaling,))
    return inv, float(m)


def rotate(x, positions, rope, scaled=True):
    """RoPE (SPEC 2 and 7): x [..., n, D] rotated at positions [n] (or broadcastable to
    [..., n]): the first R dims in the scenario's layout, the rest unchanged; scaled by
    yarn's attention factor m unless scaled=False (a pure rotation, as a shift needs)."""
    x = to_numpy(x).astype(np.float64)
    d = x.shape[-1]
    inv, m = rope_frequencies(rope, d)
    r = 2 * len(inv)
    angle = np.asarray(positions, dtype=np.float64)[..., None] * inv  # [..., n, R/2]
    cos, sin = np.cos(angle), np.sin(angle)
    if scaled and m != 1.0:
        cos, sin = cos * m, sin * m
    out = x.copy()
    if rope is None or rope["layout"] == "half":
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        out[..., :r] = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = a * cos - b * sin
        out[..., 1:r:2] = a * sin + b * cos
    return out


def query_temperature(temperature, positions):
    """SPEC 10.3 (Llama 4's attn_temperature_tuning on its NoPE layers): what the query at
    each position p is multiplied by, log1p(floor((p + 1) / F)) * a + 1."""
    p = np.asarray(positions, dtype=np.float64)
    return np.log1p(np.floor((p + 1.0) / temperature["floor_scale"])) * temperature["attn_scale"] + 1.0


def unrotate(x, positions, rope):
    """The raw vector of one rotated at positions: rotate's inverse (m divided out)."""
    out = rotate(x, -np.asarray(positions, dtype=np.float64), rope, scaled=False)
    inv, m = rope_frequencies(rope, out.shape[-1])
    out[..., : 2 * len(inv)] /= m
    return out


def hf_cos_sin(positions, rope, head_dim):
    """cos and sin as Hugging Face's rotary embedding hands them to cache_kwargs:
    [..., n, R], each frequency repeated for both halves (rotate_half layout), multiplied
    by the attention factor (yarn's m, as transformers' attention_scaling)."""
    inv, m = rope_frequencies(rope, head_dim)
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb) * m, np.sin(emb) * m


def evicted(policy, t):
    """E(t) of SPEC 3: tokens a streaming sink policy has evicted when token t is the newest."""
    k = policy.get("evict", 1)
    return k * -(-max(0, t + 1 - policy["window"]) // k)


def _is_trace(path):
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("format") == "kvcheck-trace-1"
    except (OSError, ValueError, AttributeError):
        return False


def _foreign_entries(path):
    """What `path` holds besides what the earlier trace there listed as its own (its manifest
    and the .npy files the manifest names), sorted: a user's notes, subfolders, dotfiles.
    Only what a trace wrote may be replaced."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    owned = {"manifest.json"}

    def walk(x):
        if isinstance(x, str):
            if "/" not in x and x.endswith(".npy"):
                owned.add(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(manifest.get("steps", []))
    return sorted(name for name in os.listdir(path) if name not in owned)


_CODE_NAMES = ("k_codes", "k_scales", "k_zero", "k_bias", "v_codes", "v_scales", "v_zero", "v_bias")  # SPEC 9.3, 9.7


class TraceWriter:
    """Writes a trace folder; nothing appears at `path` until close() succeeds, and a
    folder already there is replaced only if it is a trace. Use it as a context manager
    (or call abort()) so a failure leaves no temporary folder behind.

    dtype: "float32" or "float16", the .npy type of every tensor written ("<f4" or "<f2").
    eviction: None (not declared), "eager" (the cache drops dead tokens right after the
    forward, as StreamingLLM's StartRecentKVCache does), "lazy" (it keeps them until the
    next token comes) or "deferred" (lazy, and after an append it may still hold what the
    append's queries saw, dropped at its next update, as mlx-lm's RotatingKVCache does after
    a chunk) or "never" (it keeps every token it was given and applies the window by its
    mask, as a model over ONNX Runtime's GroupQueryAttention does) or {"blocks": C} (a
    sliding layer keeps a buffer of C slots and evicts C - W + 1 tokens at once, as ONNX
    Runtime's windowed cache does: it holds exactly its row's last L(T) tokens, SPEC 3.1);
    written as the manifest's top-level "eviction"."""

    DTYPES = {"float32": np.float32, "float16": np.float16}

    def __init__(self, path, scenario, producer, key_positions, dtype="float32", eviction=None):
        if key_positions not in ("cache-relative", "absolute", "unrotated"):
            raise ValueError("key_positions must be cache-relative, absolute or unrotated, got %r" % (key_positions,))
        if dtype not in self.DTYPES:
            raise ValueError("dtype must be \"float32\" or \"float16\", got %r" % (dtype,))
        blocks = isinstance(eviction, dict) and list(eviction) == ["blocks"] and \
            isinstance(eviction["blocks"], numbers.Integral) and not isinstance(eviction["blocks"], bool) and \
            eviction["blocks"] > 0
        if blocks:
            eviction = {"blocks": int(eviction["blocks"])}
        if not blocks and eviction not in (None, "eager", "lazy", "deferred", "never"):
            raise ValueError("eviction must be None, \"eager\", \"lazy\", \"deferred\", \"never\" or "
                             "{\"blocks\": capacity}, got %r" % (eviction,))
        self.path = os.path.abspath(path)
        if os.path.exists(self.path) and not (os.path.isdir(self.path) and not os.listdir(self.path)) \
                and not _is_trace(self.path):
            raise FileExistsError("%s exists and is not a kvcheck trace; refusing to replace it" % self.path)
        if _is_trace(self.path):
            foreign = _foreign_entries(self.path)
            if foreign:
                raise FileExistsError("%s: refusing to replace this trace folder: %s is not one of the earlier "
                                      "trace's files (move it away, or choose a new or empty folder)"
                                      % (self.path, foreign[0]))
        self.dtype = self.DTYPES[dtype]
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".kvtrace-", dir=parent)
        self.manifest = {"format": "kvcheck-trace-1", "scenario": scenario, "producer": producer,
                         "key_positions": key_positions}
        if eviction is not None:
            self.manifest["eviction"] = eviction
        self.manifest["steps"] = []

    def step(self, layers):
        """One step: per layer a dict with keys and values [B, Hkv, slots, D], optional
        out [B, H, n, D] and rotated q [B, H, n, D]. A quantized cache (SPEC 9.3) may give
        k_codes / v_codes [B, Hkv, slots, D] (integers, written as int8 or uint8, one code a
        byte), k_scales / v_scales [B, Hkv, slots, groups] and k_zero / v_zero (k_bias / v_bias,
        shaped as the scales, for mlx_affine, SPEC 9.7), with or
        without keys and values: kvcheck dequantizes what is left out. A cache with a residual
        of unquantized tokens adds raw [B, slots] (1: the slot holds its token raw, in keys
        and values, which it must then give; its codes are ignored).

        A paged cache (SPEC 8.9) gives "paged" instead of keys and values: a dict with
        block_size, layout ("NHD": pool [blocks, B, Hkv, D] as vLLM; "HND": [blocks, Hkv, B, D]
        as FlashInfer), key_cache and value_cache (the pools), block_table [B, max_blocks]
        (-1 for null), and optionally refcount [blocks], hit_tokens [B] (written int32) and
        slot_mapping [B, n] (written int64): the slot of each token the step computed, the
        row's tokens after its hit, in order, -1 as padding. With block_ids [k], the pools hold
        only those k blocks (key_cache [k, B, Hkv, D] in NHD): dump the blocks the tables
        reference, not a pool of gigabytes. A quantized pool adds k_codes / v_codes in the
        pool's layout ([blocks, B, Hkv, D] in NHD), k_scales / v_scales [blocks, B, Hkv,
        groups] (and k_zero / v_zero), and may leave key_cache and value_cache out. A sliding
        layer kept as a ring of R places (token t at place t % R, in entry (t % R) // B of the
        table: transformers' continuous batching) adds ring R."""
        index = len(self.manifest["steps"])
        entry = []
        for l, tensors in enumerate(layers):
            files = {}
            paged = tensors.get("paged")
            if paged is not None:
                files["paged"] = {"block_size": int(paged["block_size"]), "layout": paged["layout"]}
                if paged.get("ring"):
                    files["paged"]["ring"] = int(paged["ring"])
                for name in ("key_cache", "value_cache", "block_table", "refcount", "hit_tokens", "slot_mapping",
                             "block_ids") + _CODE_NAMES:
                    if paged.get(name) is not None:
                        files["paged"][name] = self._save(index, l, name, paged[name])
            for name in ("keys", "values", "out", "q", "raw") + _CODE_NAMES:
                if tensors.get(name) is not None:
                    files[name] = self._save(index, l, name, tensors[name])
            entry.append(files)
        self.manifest["steps"].append({"layers": entry})

    def _save(self, index, l, name, tensor):
        """One array of a step, in the type its name takes in the trace; returns the file name."""
        x = to_numpy(tensor)
        if name.endswith("_codes"):  # one code a byte: signed formats as int8, the others uint8
            x = x.astype(np.int8 if x.min(initial=0) < 0 else np.uint8)
        elif name.endswith("_zero") or name in ("block_table", "refcount", "hit_tokens"):
            x = x.astype(np.int32)
        elif name in ("slot_mapping", "block_ids"):
            x = x.astype(np.int64)
        elif name == "raw":
            x = x.astype(np.uint8)
        elif name.endswith("_scales") or name.endswith("_bias"):
            x = x.astype(np.float32)
        else:  # keys, values, pools, out, q
            x = x.astype(self.dtype)
        file = "step%03d_l%d_%s.npy" % (index, l, name)
        np.save(os.path.join(self.tmp, file), np.ascontiguousarray(x))
        return file

    def skip_step(self):
        """A step whose state was not recorded (kvcheck checks nothing there)."""
        self.manifest["steps"].append({})

    def error_step(self, message):
        """A step at which the cache failed (raised, or lacks the method the op needs)."""
        self.manifest["steps"].append({"error": message})

    def skipped_step(self, reason):
        """A step the producer could not run, and why."""
        self.manifest["steps"].append({"skipped": reason})

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


class UsageError(ValueError):
    """A mistake in how the driver is called (never a finding about the cache)."""


@dataclass
class DriveResult:
    """What drive_hf_cache did. error: "ExceptionType: message" when the cache failed, at step
    error_step (driving stopped there unless the step was a crop the policy refuses);
    refusals: the refused crops the cache refused, as (step, message); skipped: the steps not
    driven, as (step, reason); recorded: how many steps have tensors in the trace."""
    error: Optional[str] = None
    error_step: Optional[int] = None
    refusals: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    recorded: int = 0
