#!/usr/bin/env python3
"""kvtrace: check a KV cache written in Python against kvcheck, through files.

NumPy only at import (PyTorch is imported only when a cache is driven with as_tensor="torch";
its tensors are accepted wherever arrays are). The pieces:

- Export: loads a `kvcheck export` folder: the scenario's raw q/k/v by uid and its schedule.
- TraceWriter: writes a trace folder (format kvcheck-trace-1) that `kvcheck verify` reads.
- drive_paged_cache: plays a serving engine's model runner over a paged cache (a block
  manager and its pools, SPEC 8; kvtrace_paged.py says what it must offer).
- drive_hf_cache: feeds an export's schedule to any cache object with Hugging Face's
  `update(key_states, value_states, layer_idx, cache_kwargs) -> (keys, values)` (plus
  `crop`, `reorder_cache`), applies RoPE at the positions the caller chooses, runs eager
  attention with the mask the model would build, and writes the trace. An exception the
  cache raises is a finding: it is written into the trace, not raised.

    exp = kvtrace.Export("out/sliding_baseline")          # kvcheck export SCENARIO --out DIR
    kvtrace.drive_hf_cache(exp, lambda: MyCache(window=6), "trace/", positions="policy",
                           key_positions="absolute")
    # then: kvcheck verify SCENARIO --trace trace/
"""

import inspect
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from kvtrace_base import (  # noqa: F401 (re-exported: users reach them as kvtrace.NAME)
    DriveResult, Export, TraceWriter, UsageError, _CODE_NAMES, _foreign_entries, _is_trace, evicted,
    hf_cos_sin, query_temperature, rope_frequencies, rotate, to_numpy, unrotate)


def fixtures(kvcheck="kvcheck", paths=(), policies=(), without=(), features=()):
    """The scenarios `kvcheck list --json` shows (default: the built-in suite), as dicts with
    name, file, policies (one per layer), features, caches (kvcheck's own that serve it) and
    description. policies: keep scenarios whose every layer has one of these ("full",
    "sliding", "sink", "chunked"); without: leave out scenarios with any of these features
    ("left_padding", "crop", "reorder", "per_layer_policy", "learned_sinks", ... as `kvcheck
    list --help` names them); features: keep only scenarios with all of these.

        for f in kvtrace.fixtures("build/kvcheck", policies=["sink"], without=["crop"]):
            ...   # kvcheck export f["file"] --out DIR, then drive_hf_cache
    """
    import subprocess
    args = [os.fspath(kvcheck), "list", "--json", *map(os.fspath, paths)]
    for p in policies:
        args += ["--policy", p]
    for f in without:
        args += ["--without", f]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError("%s failed (exit %d): %s" % (" ".join(args), done.returncode, done.stderr.strip()))
    found = json.loads(done.stdout)["scenarios"]
    return [f for f in found if all(feature in f["features"] for feature in features)]



def drive_paged_cache(export, make_cache, trace_path, producer="kvtrace.drive_paged_cache", dtype="float32",
                      dump="referenced"):
    """Drives a paged cache (a block manager with its pools, SPEC 8) as vLLM's model runner
    does and writes a trace with "paged" layers; see kvtrace_paged.py for what the cache must
    offer. Returns a DriveResult."""
    from kvtrace_paged import drive_paged_cache as drive
    return drive(export, make_cache, trace_path, producer=producer, dtype=dtype, dump=dump)


def drive_mlx_cache(export, make_cache, trace_path, **options):
    """Drives mlx-lm's caches (KVCache, RotatingKVCache, ...) as mlx-lm's models do, with
    mx.arrays, rotating at cache.offset and masking with create_attention_mask, and writes a
    trace; see kvtrace_mlx.py for the options (it needs mlx and mlx-lm). Returns a DriveResult."""
    from kvtrace_mlx import drive_mlx_cache as drive
    return drive(export, make_cache, trace_path, **options)


def drive_ort_gqa(export, trace_path, **options):
    """Drives ONNX Runtime's GroupQueryAttention (one node per layer, on the CPU) as an exported
    model runs it: the caller's past and present buffers, rotary inside the op, the window by
    local_window_size; see kvtrace_ort.py (it needs onnxruntime and onnx). Returns a DriveResult."""
    from kvtrace_ort import drive_ort_gqa as drive
    return drive(export, trace_path, **options)


def drive_kvpress(export, trace_path, **options):
    """Drives kvpress's presses (StreamingLLMPress, KeyRerotationPress) over a tiny transformers
    Llama whose attention computes with the export's q, k and v, as kvpress's pipeline runs them,
    for scenarios with a prune (SPEC 11); see kvtrace_kvpress.py (it needs torch, transformers
    and kvpress). Returns a DriveResult."""
    from kvtrace_kvpress import drive_kvpress as drive
    return drive(export, trace_path, **options)


def drive_hf_cache(export, make_cache, trace_path, positions="policy", key_positions="absolute",
                   producer="kvtrace.drive_hf_cache", as_tensor=None, mask="auto", dtype="float32",
                   eviction=None, after_forward=None, chunks="whole"):
    """Runs the export's schedule through caches made by make_cache and writes a trace;
    returns a DriveResult.

    make_cache: a function returning a new cache, called as make_cache(batch) when it has
    exactly one required positional parameter, else make_cache(); a reset makes a new one
    with the reset's batch size.
    positions: where new keys and queries are rotated. "policy": the query position Pq the
    scenario's policy gives each token (per layer for a per-layer policy; for a correct
    cache-relative sink cache: t - E); "absolute": the token index, as generate() computes
    position ids (padding skipped); "cache": slots held before the step plus the place in
    the chunk; or a function (token_index, slots_held_before, place_in_chunk) -> position.
    RoPE follows the scenario's rope (SPEC 2 and 7: layout, rotary_dim, linear, llama3 and
    yarn scaling, yarn's attention factor on q and k).
    cache_kwargs, per layer: Hugging Face's "cos" and "sin" [B, n, R] (rotate_half
    convention, times yarn's attention factor), "cache_position" (the new slots' indices
    as generate() computes them: slots seen, padding included, plus arange(n); a 1-D
    LongTensor with torch tensors, else NumPy int64), "sliding_window" (the layer's window
    when its policy is sliding, else None, as Gemma 2 passes it), "partial_rotation_size"
    (R, when R < head_dim, as Phi passes it: SinkCache re-rotates only those dims), plus "positions" [B, n],
    "padding" [B, n] (True at left padding), "rope", and NumPy functions in the scenario's
    layout: "rotate"(x, p) (what the model applies to a raw vector), "unrotate"(x, p) (its
    inverse) and "rerotate"(x, delta) (a pure rotation by delta, what a shift applies to a
    stored key: no attention factor). A scenario with the interleaved layout raises
    UsageError when the cache reads cos/sin: they follow rotate_half, so a cache
    re-rotating keys with them would be judged on the driver's convention, not its own.
    Left padding is driven as transformers models do: a padded row's chunk is filled on the
    left with zero q, k and v (position 0), which the mask hides; cache_position counts
    them; positions skip them.
    mask: how the driver's eager attention masks what update() returns, standing in for the
    model. "causal": a growing cache: right-aligned causal, and a sliding layer's window
    counted in written slots (key within the query's last W; a chunked layer's token t
    within its last t % C + 1). "cache_position": a
    preallocated buffer (StaticCache, SlidingWindowCache): slot j is visible to the query
    at cache position p iff j <= p, and for a sliding layer among the last W written slots
    up to p. "auto" (default): per cache object, "cache_position" once the cache has a
    `max_cache_len` attribute or returns more slots than it was given, else "causal". Or a
    function mask(cache, cache_position, chunk) -> [B, n, slots] booleans (True: visible),
    the model's own mask, so model and cache are checked together; chunk is a kvtrace.Chunk
    (layer, n, slots, positions, padding, token_index). In every mode a slot whose values
    are all zero is unwritten (or padding) and never attended (kvcheck verify skips such
    slots too).
    chunks: "whole" (default): one forward per append step, as generate() and a model do.
    "eviction": a chunk is fed as consecutive forwards within which no streaming sink
    layer evicts (E(t) constant in every row), as an engine that evicts between forwards;
    under a sink policy one key tensor cannot serve queries whose kept keys sit at
    different positions, so a cache-relative sink cache is driven this way. "tokens": one
    forward per token. The step's outputs and queries are those of all its forwards; its
    state is recorded after the last.
    Recorded per step and layer: the cache's own state when it exposes one (transformers'
    key_cache/value_cache or layers[l].keys/values), else what update() returned (so a
    preallocated buffer is recorded whole), with the outputs and the rotated queries (not
    with key_positions="unrotated": stored keys then carry no position to compare a query
    with). Reorder and crop go through cache.reorder_cache(beam_idx) and cache.crop(length)
    (5.x, whose crop takes tokens_to_remove: crop(-removed), as generate() calls it),
    their state recorded when exposed.
    Findings, written into the trace instead of raised: an exception from update(),
    crop(), reorder_cache() or after_forward, or a missing crop/reorder_cache, becomes the
    step's {"error": "Type: message"}; driving stops there (later steps {}), except on a
    crop the policy refuses, where refusing is right and driving goes on. A crop the policy
    refuses is still offered to the cache, which may refuse it or serve it (SPEC 4); one that
    crop(tokens_to_remove) cannot express (rows losing different counts) is not offered, and
    the step is recorded as skipped.
    as_tensor: "torch" hands update() torch tensors in the scenario's kv_dtype (float32,
    float16 or bfloat16; cache_position and beam indices as int64), None NumPy arrays
    (float16 for float16, float32 rounded to bfloat16 for bfloat16), or any function
    float32 array -> tensor (integer arrays then go to torch as int64 when it returns torch
    tensors, else stay NumPy int64).
    learned sink logits (SPEC 7) join the driver's softmax.
    dtype ("float32" or "float16" .npy files) and eviction ("eager", "lazy", or None to
    leave it undeclared): see TraceWriter.
    after_forward: a function called with the cache after every forward (all layers), as
    StreamingLLM's loop calls its kv_cache(past_key_values); what it returns, when not
    None, replaces the cache.
    Mistakes in the call raise TypeError or ValueError (UsageError) and leave no trace.
    """
    if not isinstance(export, Export):
        if isinstance(export, (str, os.PathLike)):
            what = os.fspath(export)
            hint = ("a scenario file: run `kvcheck export %s --out DIR` and pass kvtrace.Export(DIR)" % what
                    if what.endswith(".json") else "load it with kvtrace.Export(%r)" % what)
            raise TypeError("export must be a kvtrace.Export, got the path %r: %s" % (what, hint))
        raise TypeError("export must be a kvtrace.Export (a `kvcheck export` folder), got %s" % type(export).__name__)
    driver = _Driver(export, make_cache, positions, as_tensor, mask, after_forward, key_positions != "unrotated",
                     chunks)
    with TraceWriter(trace_path, export.name, producer, key_positions, dtype, eviction) as writer:
        return driver.run(writer)


@dataclass
class Chunk:
    """What a model's mask function (drive_hf_cache's mask) is told about one forward of one
    layer: n new tokens per row, `slots` key slots returned by the cache, the rotary
    positions [B, n], padding [B, n] (True: a left-padding slot) and token indices [B, n]
    (-1 at padding)."""
    layer: int
    n: int
    slots: int
    positions: np.ndarray
    padding: np.ndarray
    token_index: np.ndarray


def _cache_factory(make_cache):
    """make_cache as a function of the batch size (see drive_hf_cache)."""
    if not callable(make_cache) or (hasattr(make_cache, "update") and not inspect.isclass(make_cache)):
        raise TypeError("make_cache must be a function returning a new cache, such as lambda: MyCache(6) or "
                        "lambda batch: MyCache(batch, 6), got a %s object: a reset needs a fresh cache"
                        % type(make_cache).__name__)
    try:
        params = inspect.signature(make_cache).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: call them plainly
        return lambda batch: make_cache()
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(required) > 1:
        raise TypeError("make_cache must take no argument or one (the batch size), it requires %d" % len(required))
    return (lambda batch: make_cache(batch)) if required else (lambda batch: make_cache())


def _position_function(positions):
    if positions == "policy":
        return None  # read from the export, per token
    if positions == "absolute":
        return lambda t, held, i: t
    if positions == "cache":
        return lambda t, held, i: held + i
    if callable(positions) and not isinstance(positions, str):
        return positions
    raise UsageError("positions must be \"policy\", \"absolute\", \"cache\" or a function (token_index, "
                     "slots_held_before, place_in_chunk) -> position, got %r" % (positions,))


class _CacheKwargs(dict):
    """cache_kwargs whose cos/sin raise UsageError when read (see drive_hf_cache)."""

    def __init__(self, values, refusal):
        super().__init__(values)
        self.refusal = refusal

    def __getitem__(self, key):
        if key in ("cos", "sin"):
            raise UsageError(self.refusal)
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


class _CacheFailed(Exception):
    """The cache failed at this step (the finding is already in the trace)."""


class _Missing(Exception):
    """The cache lacks the method an op needs."""


class _StateUnreadable(Exception):
    """The cache holds its state in a form the trace format cannot say (the step fails)."""


def _cache_codes(cache, layers):
    """A quantized cache's codes and scales per layer (SPEC 9.3), when it exposes them as
    `kv_codes`: one dict per layer of k_codes, k_scales, k_zero, v_codes, v_scales, v_zero
    (any of them), and with a residual raw, keys and values (TraceWriter.step); transformers
    5's quanto layers are read as they hold their state; else None."""
    codes = getattr(cache, "kv_codes", None)
    if codes is None:
        codes = _quanto_layers_codes(cache)
    if codes is None or len(codes) != layers:
        return None
    return [{name: to_numpy(x) for name, x in layer.items() if x is not None} for layer in codes]


def _quanto_layers_codes(cache):
    """transformers 5's QuantoQuantizedLayer state (QuantizedCache(backend="quanto")) as SPEC 9.8
    codes: per layer, the quantized tokens' codes, scales and biases (quanto's shift, negated)
    followed by the residual's raw tokens (placeholder codes, raw 1), and keys and values as the
    layer holds them (the codes' c S + B in float32, then the residual). The packed codes are
    unpacked here, as optimum-quanto packs them (tensor/packed.py: along the grouped matrix's
    first axis), not through its C++ unpack, which compiles at first use. None: not such a cache,
    or nothing stored yet."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "_quantized_keys") for layer in layers):
        return None
    out = []
    for layer in layers:
        bits, group = layer.nbits, layer.q_group_size
        entry = {}
        for name, qt, residual in (("k", layer._quantized_keys, layer.keys), ("v", layer._quantized_values,
                                                                                 layer.values)):
            B, H, T, D = qt.shape
            packed = qt._data._data.cpu().numpy()
            groups = B * H * T * D // group
            if qt._scale.numel() != groups:
                raise _StateUnreadable(
                    "the layer holds its %s of %d tokens with %d scales where SPEC 9.8's groups of %d give %d "
                    "(optimum-quanto's one-group case: a scale per element, not quanto_affine's groups)"
                    % ("keys" if name == "k" else "values", T, qt._scale.numel(), group, groups))
            codes = np.concatenate([(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)],
                                   axis=0)[:groups].astype(np.int64).reshape(B, H, T, D)
            scales = qt._scale.float().cpu().numpy().reshape(B, H, T, D // group)
            biases = -qt._shift.float().cpu().numpy().reshape(B, H, T, D // group)
            held = (codes.reshape(B, H, T, D // group, group).astype(np.float32) * scales[..., None]).astype(np.float32)
            held = (held + biases[..., None]).astype(np.float32).reshape(B, H, T, D)
            raw = to_numpy(residual).astype(np.float32) if residual.dim() == 4 else np.zeros((B, H, 0, D), np.float32)
            r = raw.shape[-2]
            entry[name + "_codes"] = np.concatenate([codes, np.zeros((B, H, r, D), np.int64)], axis=2)
            entry[name + "_scales"] = np.concatenate([scales, np.ones((B, H, r, D // group), np.float32)], axis=2)
            entry[name + "_bias"] = np.concatenate([biases, np.zeros((B, H, r, D // group), np.float32)], axis=2)
            entry["keys" if name == "k" else "values"] = np.concatenate([held, raw], axis=2)
            entry["raw"] = np.concatenate([np.zeros((B, T)), np.ones((B, r))], axis=1)
        out.append(entry)
    return out


def _cache_state(cache, layers):
    """The cache's own (keys, values) per layer, float64, when it exposes them the way
    transformers' caches do (key_cache/value_cache lists up to 4.5x, layers[l] later)."""
    try:
        if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
            pairs = list(zip(cache.key_cache, cache.value_cache))
        elif hasattr(cache, "layers"):
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
        else:
            return None
    except (AttributeError, TypeError):
        return None
    if len(pairs) != layers or any(k is None or v is None for k, v in pairs):
        return None
    return [(to_numpy(k).astype(np.float64), to_numpy(v).astype(np.float64)) for k, v in pairs]


def _attention(q, keys, values, scale, visible, sink_logits=None):
    """Eager attention: q [B, H, n, D] over keys/values [B, Hkv, S, D] where visible
    [B, Hkv, n, S] allows; learned sink logits [H] (SPEC 7) join each softmax with no value.
    A query that sees nothing (and has no sink) gets NaN."""
    group = q.shape[1] // keys.shape[1]
    keys, values, visible = (np.repeat(x, group, axis=1) for x in (keys, values, visible))
    scores = np.where(visible, np.einsum("bhnd,bhsd->bhns", q, keys) * scale, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    sink = None
    if sink_logits is not None:
        sink = np.asarray(sink_logits, dtype=np.float64)[None, :, None, None]
        top = np.maximum(top, sink)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
        total = weights.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink - top)
        weights /= total
    return np.einsum("bhns,bhsd->bhnd", weights, values)


def _round_bfloat16(x):
    """float32 values rounded to the nearest bfloat16 (ties to even), kept in float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


class _Driver:
    """The state of one drive_hf_cache run (one cache object at a time)."""

    def __init__(self, export, make_cache, positions, as_tensor, mask, after_forward, record_q, chunks):
        self.exp = export
        export.refuse_prune("drive_hf_cache")
        self.make = _cache_factory(make_cache)
        self.position_of = _position_function(positions)
        self.model_mask = None
        if callable(mask) and not isinstance(mask, str):
            self.model_mask, mask = mask, "causal"
        elif mask not in ("auto", "causal", "cache_position"):
            raise UsageError("mask must be \"auto\", \"causal\", \"cache_position\" or a function (cache, "
                             "cache_position, chunk) -> [B, n, slots] booleans, got %r" % (mask,))
        if chunks not in ("whole", "eviction", "tokens"):
            raise UsageError("chunks must be \"whole\", \"eviction\" or \"tokens\", got %r" % (chunks,))
        if after_forward is not None and not callable(after_forward):
            raise TypeError("after_forward must be a function of the cache, got %s" % type(after_forward).__name__)
        ropes = [export.layer_rope(l) for l in range(export.dims["layers"])]
        for rope in ropes:
            rope_frequencies(rope, export.dims["head_dim"])  # an unknown scaling is a usage error now
        self.mask, self.after_forward, self.record_q, self.chunks = mask, after_forward, record_q, chunks
        layers = export.dims["layers"]
        logits = export.manifest.get("attention", {}).get("sink_logits")
        if logits and not isinstance(logits[0], list):
            logits = [logits] * layers
        self.sink_logits = logits or [None] * layers
        self.temperature = export.manifest.get("attention", {}).get("query_temperature")
        self.kv_dtype = export.manifest.get("kv_dtype", "float32")
        self.numpy_given = as_tensor is None
        self.as_index = np.asarray  # beam indices for reorder_cache
        self.as_position = lambda p: np.asarray(p, dtype=np.int64)
        if as_tensor == "torch":
            import torch  # only when asked for
            torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.kv_dtype]
            self.as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch_dtype)
            self.as_index = self.as_position = lambda p: torch.as_tensor(np.asarray(p), dtype=torch.long)
        elif as_tensor is None:
            if self.kv_dtype == "float16":
                self.as_tensor = lambda x: np.asarray(x, dtype=np.float16)
            elif self.kv_dtype == "bfloat16":
                self.as_tensor = _round_bfloat16
            else:
                self.as_tensor = lambda x: x
        elif callable(as_tensor) and not isinstance(as_tensor, str):
            def convert(x):
                tensor = as_tensor(np.ascontiguousarray(x, dtype=np.float32))
                if type(tensor).__module__.startswith("torch"):  # keep integer tensors integer
                    import torch
                    self.as_index = self.as_position = lambda p: torch.as_tensor(np.asarray(p), dtype=torch.long)
                return tensor
            self.as_tensor = convert
        else:
            raise UsageError("as_tensor must be None (NumPy), \"torch\" or a function array -> tensor, got %r"
                             % (as_tensor,))
        self.cos_sin_refusal = None
        layouts = [r["layout"] for r in ropes if r is not None]
        if any(layout != "half" for layout in layouts):
            self.cos_sin_refusal = (
                "the scenario uses the %s RoPE layout, but cache_kwargs cos/sin follow Hugging Face's rotate_half "
                "convention: a cache re-rotating keys with them would be judged on the driver's convention, not its "
                "own. Use a scenario with layout \"half\", or re-rotate with cache_kwargs[\"rerotate\"], which "
                "follows the scenario's layout" % next(layout for layout in layouts if layout != "half"))

    def run(self, writer):
        self.writer, self.result = writer, DriveResult()
        self.new_cache(self.exp.dims["batch"])
        for index, step in enumerate(self.exp.steps):
            op = step["op"]
            if self.result.error is not None:
                writer.skip_step()
            elif op == "reset":
                self.new_cache(step.get("batch", self.batch))
                writer.skip_step()
            else:
                try:
                    self.run_step(index, step)
                except _CacheFailed:
                    pass
        self.result.recorded = sum(1 for s in writer.manifest["steps"] if "layers" in s)
        return self.result

    def new_cache(self, batch):
        self.cache, self.batch = self.make(batch), batch
        self.held = [0] * batch  # slots held per row, for positions="cache" when the cache does not say
        self.lengths = [0] * batch  # tokens per row, padding left out
        self.seen = 0            # slots fed so far, padding included: the next cache_position
        self.preallocated = None if self.mask == "auto" else self.mask == "cache_position"  # None: not known yet

    def run_step(self, index, step):
        op = step["op"]
        if op == "reorder":
            self.call(index, "reorder_cache", "reorder", self.as_index(step["rows_from"]))
            self.batch = len(step["rows_from"])
            self.held = [self.held[r] if r < len(self.held) else 0 for r in step["rows_from"]]
            self.lengths = [self.lengths[r] if r < len(self.lengths) else 0 for r in step["rows_from"]]
            self.record_state()
        elif op == "crop":
            refused = "refused" in step
            removed = sorted({n - min(n, step["length"]) for n in self.lengths})
            if refused and self.crop_takes_tokens_to_remove() and len(removed) > 1:
                # The crop cannot be said to crop(tokens_to_remove), and any crop offered in its
                # place is not the scenario's: not offered. The cache is left as a refusal leaves
                # it, which is what the reference follows, so the run goes on.
                why = ("not offered: a crop to %d tokens removes %s tokens from the rows of %s, and transformers 5's "
                       "crop(tokens_to_remove) removes the same slots from every row; the policy refuses it, so the "
                       "cache is left as a refusal leaves it" % (step["length"], removed, self.lengths))
                self.writer.skipped_step(why)
                self.result.skipped.append((index, why))
                return
            try:
                self.call(index, "crop", "crop", self.crop_argument(step["length"], refused), refusal=refused)
            except _CacheFailed:
                if not refused:
                    raise
                return  # refusing is what the policy wants: the cache goes on intact
            if self.crop_takes_tokens_to_remove():  # the slots removed from every row
                self.seen -= max((n - min(n, step["length"]) for n in self.lengths), default=0)
            else:
                self.seen = min(self.seen, step["length"])  # transformers' crop keeps that many slots
            self.held = [min(h, step["length"]) for h in self.held]
            self.lengths = [min(n, step["length"]) for n in self.lengths]
            self.record_state()
        else:
            self.append(index, step)

    def fail(self, index, message):
        self.writer.error_step(message)
        self.result.error, self.result.error_step = message, index
        raise _CacheFailed()

    def call(self, index, method, op, *args, refusal=False):
        """cache.method(*args); a failure is written as the step's error."""
        function = getattr(self.cache, method, None)
        try:
            if not callable(function):
                raise _Missing("the cache does not support %s" % op)
            function(*args)
        except UsageError:
            raise
        except Exception as e:
            message = str(e) if isinstance(e, _Missing) else "%s: %s" % (type(e).__name__, e)
            if refusal:
                self.writer.error_step(message)
                self.result.refusals.append((index, message))
                raise _CacheFailed() from e
            self.fail(index, message)

    def crop_takes_tokens_to_remove(self):
        """transformers 5's crop(tokens_to_remove), which refuses a positive count (4.x and
        other caches: crop(length), the tokens kept)."""
        try:
            return list(inspect.signature(self.cache.crop).parameters)[:1] == ["tokens_to_remove"]
        except (AttributeError, TypeError, ValueError):  # no crop (call() records it), or no signature
            return False

    def crop_argument(self, length, refused=False):
        """What cache.crop takes to keep `length` tokens of every row: `length` (crop(length)),
        or, for transformers 5, minus the slots removed, as its generate() calls it. A 5 crop
        removes the same slots from every row, so one that must remove different counts from
        left-padded rows cannot be said to it: refused (run_step does not offer it when the
        policy refuses it anyway)."""
        if not self.crop_takes_tokens_to_remove():
            return length
        removed = {n - min(n, length) for n in self.lengths}
        if len(removed) > 1:
            raise UsageError("a crop to %d tokens removes %s tokens from the rows of %s: transformers 5's "
                             "crop(tokens_to_remove) removes the same slots from every row"
                             % (length, sorted(removed), self.lengths))
        return -(removed.pop() if removed else 0)

    def cache_codes(self, layers):
        """_cache_codes, a state it cannot say being the cache's failure at this step."""
        try:
            return _cache_codes(self.cache, layers)
        except _StateUnreadable as e:
            self.fail(len(self.writer.manifest["steps"]), str(e))

    def record_state(self):
        layers = self.exp.dims["layers"]
        state, codes = _cache_state(self.cache, layers), self.cache_codes(layers)
        if codes is not None:  # what a quantized cache holds is its codes (kvcheck dequantizes)
            self.writer.step(codes)
        elif state is None:
            self.writer.skip_step()  # guessing what the cache holds would check nothing
        else:
            self.writer.step([{"keys": k, "values": v} for k, v in state])

    def policy_positions(self, rows, layer, n):
        """Pq per row and chunk place for one layer, from the export (0 at padding)."""
        pos = np.zeros((len(rows), n))
        for b, r in enumerate(rows):
            qp = r["query_positions"]
            if qp and isinstance(qp[0], list):  # per-layer policies: one list per layer
                qp = qp[layer]
            if qp:
                pos[b, n - len(qp):] = qp
        return pos

    def forwards(self, token, padding):
        """The chunk's places split into forwards [(first, end)] as `chunks` asks."""
        n = token.shape[1]
        if self.chunks == "whole" or n == 1:
            return [(0, n)]
        if self.chunks == "tokens":
            return [(i, i + 1) for i in range(n)]
        sinks = [p for p in (self.exp.layer_policy(l) for l in range(self.exp.dims["layers"]))
                 if p.get("type") == "sink" and p.get("prefill", "streaming") == "streaming"]
        cuts, first = [], 0
        for i in range(1, n):
            if any(evicted(p, token[b, i]) != evicted(p, token[b, i - 1])
                   for p in sinks for b in range(token.shape[0]) if not padding[b, i - 1]):
                cuts.append((first, i))
                first = i
        return cuts + [(first, n)]

    def append(self, index, step):
        exp, layers = self.exp, self.exp.dims["layers"]
        rows = step["rows"]
        n = max(len(r["uids"]) for r in rows)
        batch = len(rows)
        uid = np.full((batch, n), -1, dtype=np.int64)
        token = np.full((batch, n), -1, dtype=np.int64)
        for b, r in enumerate(rows):
            uid[b, n - len(r["uids"]):] = r["uids"]
            token[b, n - len(r["indices"]):] = r["indices"]
        padding = uid < 0
        policy_pos = [self.policy_positions(rows, l, n) for l in range(layers)]
        outs = [np.full((batch, exp.dims["heads"], n, exp.dims["head_dim"]), np.nan) for _ in range(layers)]
        qs = [np.zeros_like(o) for o in outs]
        recorded = None
        for first, end in self.forwards(token, padding):
            recorded = self.forward(index, uid[:, first:end], token[:, first:end], padding[:, first:end],
                                    [p[:, first:end] for p in policy_pos])
            for l in range(layers):
                outs[l][:, :, first:end], qs[l][:, :, first:end] = recorded[l]["out"], recorded[l]["q"]
        for l in range(layers):
            recorded[l]["out"], recorded[l]["q"] = outs[l], (qs[l] if self.record_q else None)
        # What the cache holds between steps is what kvcheck checks; it may differ from what
        # update() returned (a SlidingWindowCache returns a long prompt whole, keeps W of it).
        state, codes = _cache_state(self.cache, layers), self.cache_codes(layers)
        for layer, (k, v) in zip(recorded, state or []):
            layer["keys"], layer["values"] = k, v
        for layer, quantized in zip(recorded, codes or []):
            # A quantized cache's state is its codes: the floats it hands back are left out.
            layer.pop("keys", None), layer.pop("values", None)
            layer.update(quantized)
        self.writer.step(recorded)

    def forward(self, index, uid, token, padding, policy_pos):
        """One forward of every layer over n places per row; returns per layer keys, values,
        out and q as the driver saw them."""
        exp, layers = self.exp, self.exp.dims["layers"]
        n = uid.shape[1]
        if hasattr(self.cache, "get_seq_length"):  # Hugging Face caches say it themselves
            try:
                self.held = [int(self.cache.get_seq_length())] * uid.shape[0]
            except Exception as e:
                self.fail(index, "%s: %s" % (type(e).__name__, e))
        cache_position = self.seen + np.arange(n, dtype=np.int64)
        real = ~padding
        safe = np.where(real, uid, 0)
        recorded = []
        for l in range(layers):
            if self.position_of is None:
                pos = policy_pos[l]
            else:
                pos = np.asarray([[self.position_of(int(t), self.held[b], i) if t >= 0 else 0
                                   for i, t in enumerate(row)] for b, row in enumerate(token)], dtype=np.float64)
            rope = exp.layer_rope(l)
            cos, sin = hf_cos_sin(pos, rope, exp.dims["head_dim"])
            mask4 = real[:, None, :, None]
            q = np.where(mask4, np.transpose(exp.q[l][safe], (0, 2, 1, 3)), 0.0)   # [B, H, n, D]
            k = np.where(mask4, np.transpose(exp.k[l][safe], (0, 2, 1, 3)), 0.0)   # [B, Hkv, n, D]
            v = np.where(mask4, np.transpose(exp.v[l][safe], (0, 2, 1, 3)), 0.0)
            q_rot = rotate(q, pos[:, None, :], rope)
            if rope is None and self.temperature is not None:  # SPEC 10.3: a NoPE layer's query
                q_rot = q_rot * query_temperature(self.temperature, pos)[:, None, :, None]
            k_rot = rotate(k, pos[:, None, :], rope)
            policy = exp.layer_policy(l)
            kwargs = {"cos": self.as_tensor(cos), "sin": self.as_tensor(sin),
                      "cache_position": self.as_position(cache_position),
                      "sliding_window": policy.get("window") if policy.get("type") == "sliding" else None,
                      "positions": pos, "padding": padding, "rope": rope,
                      "rotate": lambda x, p, rope=rope: rotate(x, p, rope),
                      "unrotate": lambda x, p, rope=rope: unrotate(x, p, rope),
                      "rerotate": lambda x, d, rope=rope: rotate(x, d, rope, scaled=False)}
            rotary_dim = int((rope or {}).get("rotary_dim") or exp.dims["head_dim"])
            if rotary_dim < exp.dims["head_dim"]:
                kwargs["partial_rotation_size"] = rotary_dim  # as Phi, Persimmon and StableLM pass it
            if self.cos_sin_refusal:
                kwargs = _CacheKwargs(kwargs, self.cos_sin_refusal)
            keys, values = self.update(index, l, self.as_tensor(k_rot), self.as_tensor(v), kwargs, k.shape)
            if self.preallocated is None and (hasattr(self.cache, "max_cache_len") or keys.shape[2] > self.seen + n):
                self.preallocated = True
            if not self.preallocated and keys.shape[2] < n:
                self.fail(index, "the cache returned %d slots for a chunk of %d tokens: it trims before attention, so "
                                 "the chunk's first tokens cannot see each other" % (keys.shape[2], n))
            chunk = Chunk(l, n, keys.shape[2], pos, padding, token)
            visible = self.visible(index, l, chunk, cache_position, values)
            out = _attention(q_rot, keys, values, exp.scale, visible, self.sink_logits[l])
            recorded.append({"keys": keys, "values": values, "out": out, "q": q_rot})
        if self.preallocated is None:
            self.preallocated = False  # decided by the first forward: later growth must not flip it
        self.seen += n
        self.lengths = [length + int(np.count_nonzero(r)) for length, r in zip(self.lengths, real)]
        if self.after_forward is not None:
            try:
                replacement = self.after_forward(self.cache)
            except UsageError:
                raise
            except Exception as e:
                self.fail(index, "%s: %s" % (type(e).__name__, e))
            if replacement is not None:
                self.cache = replacement
        # Slots held, for positions="cache": a preallocated buffer counts only written slots.
        state = _cache_state(self.cache, layers)
        values0 = state[0][1] if state else recorded[0]["values"]
        self.held = [int(np.count_nonzero(np.any(row[0] != 0, axis=-1))) for row in values0]
        return recorded

    def update(self, index, layer, key_states, value_states, kwargs, shape):
        """cache.update(); returns float64 (keys, values), or writes the failure."""
        try:
            returned = self.cache.update(key_states, value_states, layer, kwargs)
        except UsageError:
            raise
        except Exception as e:
            text = "%s: %s" % (type(e).__name__, e)
            torch_words = ("Tensor", "torch", "numpy", "ndarray")
            if self.numpy_given and "torch" in sys.modules and any(word in text for word in torch_words):
                raise TypeError("update() failed on NumPy input (%s): a PyTorch cache needs "
                                "drive_hf_cache(..., as_tensor=\"torch\")" % text) from e
            self.fail(index, text)
        if self.numpy_given and isinstance(returned, (tuple, list)) and any(hasattr(x, "detach") for x in returned):
            raise TypeError("update() returned PyTorch tensors for NumPy input: drive a PyTorch cache with "
                            "drive_hf_cache(..., as_tensor=\"torch\")")
        b, hkv, _, d = shape
        try:
            keys, values = (to_numpy(x).astype(np.float64) for x in returned)
            ok = keys.ndim == 4 and keys.shape[:2] == (b, hkv) and keys.shape[3] == d and values.shape == keys.shape
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self.fail(index, "update() returned %s, expected (keys, values) of shape [%d, %d, slots, %d]"
                      % (_describe(returned), b, hkv, d))
        return keys, values

    def visible(self, index, layer, chunk, cache_position, values):
        """The mask the model would build [B, Hkv, n, S] (see drive_hf_cache's `mask`)."""
        n, slots = chunk.n, chunk.slots
        written = np.any(values != 0, axis=-1)    # [B, Hkv, S]: unwritten and padding slots are zero
        if self.model_mask is not None:
            try:
                allowed = to_numpy(self.model_mask(self.cache, self.as_position(cache_position), chunk)).astype(bool)
            except UsageError:
                raise
            except Exception as e:
                raise UsageError("the mask function raised %s: %s" % (type(e).__name__, e)) from e
            if allowed.shape != (values.shape[0], n, slots):
                raise UsageError("the mask function returned shape %s, expected [B, n, slots] = [%d, %d, %d]"
                                 % (list(allowed.shape), values.shape[0], n, slots))
            return allowed[:, None] & written[:, :, None, :]
        policy = self.exp.layer_policy(layer)
        if policy.get("swa") and self.preallocated:
            raise UsageError("layer %d is a sliding layer under a shift (SPEC 10.4): the driver's mask applies its "
                             "window to a growing cache only; give a mask function for a preallocated one" % layer)
        window = policy.get("window") if policy.get("type") == "sliding" else None
        j = np.arange(slots)
        if self.preallocated:
            last = np.minimum(cache_position, slots - 1)     # the query's own slot (or the buffer's end)
            visible = j[None, :] <= cache_position[:, None]  # [n, S]
        else:
            last = slots - n + np.arange(n)                  # right-aligned: each query's own slot
            visible = j[None, :] <= last[:, None]
        visible = visible[None, None] & written[:, :, None, :]  # [B, Hkv, n, S]
        counts = np.cumsum(written, axis=-1)                                 # [B, Hkv, S]
        upto = counts[:, :, last]                                             # [B, Hkv, n]
        if window is not None:
            # Within the last W written slots up to the query's own: padding never counts.
            visible &= (upto[..., None] - counts[:, :, None, :]) < window
        elif policy.get("type") == "sink" and policy.get("prefill", "streaming") == "streaming" \
                and not self.preallocated:
            # A growing sink cache (sinks first, then the window, in order): token t sees the
            # first S written slots and its last t + 1 - S - E(t) (SPEC 3), so a chunk that
            # evicts inside itself is masked per token.
            t = np.maximum(chunk.token_index, 0)
            recent = t + 1 - policy["sinks"] - np.vectorize(lambda x: evicted(policy, int(x)))(t)   # [B, n]
            sink = (counts - 1) < policy["sinks"]                                                 # [B, Hkv, S]
            in_window = (upto[..., None] - counts[:, :, None, :]) < recent[:, None, :, None]
            visible &= sink[:, :, None, :] | in_window
            if policy.get("swa"):
                # SPEC 10.4: a sliding layer under the shift sees keys with Pq - Pk < swa; with
                # positions "cache" a slot's position is its place among the written slots.
                visible &= (upto[..., None] - counts[:, :, None, :]) < policy["swa"]
        elif policy.get("type") == "chunked":
            # SPEC 10.2: token t sees its own chunk up to itself, the last t % C + 1 written
            # slots up to its own (a cache may hold more of the previous chunk).
            own = np.maximum(chunk.token_index, 0) % policy["chunk"] + 1                   # [B, n]
            visible &= (upto[..., None] - counts[:, :, None, :]) < own[:, None, :, None]
        return visible


def _describe(returned):
    if isinstance(returned, (tuple, list)):
        return "(%s)" % ", ".join("shape %s" % (list(getattr(x, "shape", ())),) for x in returned)
    return "a %s" % type(returned).__name__
