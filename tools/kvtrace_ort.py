"""ONNX Runtime's GroupQueryAttention (com.microsoft, CPU) driven as an exported model runs
it, written as a kvcheck trace (kvtrace.drive_ort_gqa calls this; it needs onnxruntime and
onnx, kvtrace itself only NumPy).

One node per layer, as a model exported by onnxruntime-genai's builder holds it:

    output, present_key, present_value = GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
        cos_cache, sin_cache)                     # do_rotary=1: the op rotates q and k

The caller keeps the cache: present_key and present_value of one forward are the next
forward's past_key and past_value ([B, Hkv, T, D], keys rotated at their absolute
positions). seqlens_k is the row's total length minus one; the op derives each new token's
position from it. cos_cache and sin_cache [P, R/2] come from the scenario's rope as the
builder computes them from a model's config (yarn's attention factor folded in). The op
returns no rotated query, so queries are judged by their outputs.

By default the past grows: a sliding window is the op's mask over it (local_window_size),
the cache never drops a token, and the trace says so (eviction "never"); window_cache runs
the op's own window-sized cache instead (declared {"blocks": C}, SPEC 3.1), and a scenario's int8_even / int4_even kv_quant its
quantized KV (drive_ort_gqa says how). local_window_size changed its
meaning in onnxruntime 1.24 (PR 25927): up to 1.23 it counted the keys before the query,
from 1.24 on every key the query sees, itself included; "policy" gives each release the
value that means the scenario's window W (W - 1 before 1.24, W from 1.24 on).

The CPU kernel takes a chunk of several tokens after a past only for one row at a time, so
each row is its own batch of one (a server's loop over its requests), and rows of one step
may take different numbers of tokens. A crop slices the past, a reorder permutes the rows,
a reset starts new ones: the buffers are the caller's."""

import numpy as np

import onnxruntime as ort
from onnx import TensorProto, helper

from kvtrace_base import DriveResult, Export, TraceWriter, UsageError, query_temperature, rope_frequencies


def ort_version():
    return tuple(int(x) for x in ort.__version__.split(".")[:2])


def has_windowed_cache():
    """Whether this onnxruntime's GroupQueryAttention has sliding_window_cache (1.31 has; 1.23 not)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as schemas
    return any(s.name == "GroupQueryAttention" and "sliding_window_cache" in s.attributes
               for s in schemas.get_all_operator_schema())


def has_quantized_kv():
    """Whether this onnxruntime's GroupQueryAttention takes int8/int4 KV (1.31 does; 1.23 not)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as schemas
    return any(s.name == "GroupQueryAttention" and "k_quant_type" in s.attributes
               for s in schemas.get_all_operator_schema())


def window_meaning_changed():
    """Whether this onnxruntime counts the query itself in local_window_size (1.24 and later)."""
    return ort_version() >= (1, 24)


def resident(total, capacity, window):
    """L(T) of the op's windowed cache (sliding_window_cache=1): how many of the most recent
    positions rows [0, L) hold after T tokens, with capacity C and window W; it evicts
    G = C - W + 1 positions at once."""
    if total <= capacity:
        return total
    g = capacity - window + 1
    return total - g * -(-(total - capacity) // g)


class _Quantized:
    """The scenario's kv_quant as the op takes it (SPEC 9.6): int8_even or int4_even for both K
    and V (the op has one cache type and one kv_cache_bit_width), static scales per tensor
    (PER_TENSOR) or per kv head (PER_CHANNEL, the head's scale along head_dim)."""

    FORMATS = {"int8_even": 8, "int4_even": 4}

    def __init__(self, kv_quant, kv_heads, d):
        rules = {"residual": 0, "flush": "append", "chunk_reads": "stored", "transform": "none", "query": "none"}
        for key, plain in rules.items():
            if kv_quant.get(key, plain) != plain:
                raise UsageError("kv_quant %s %r: the op quantizes every token as it is written (no %s)"
                                 % (key, kv_quant[key], key))
        if "k" not in kv_quant or "v" not in kv_quant:
            raise UsageError("the op quantizes K and V together (one cache type): kv_quant needs both")
        names = {kv_quant["k"]["format"], kv_quant["v"]["format"]}
        if len(names) != 1 or not names <= set(self.FORMATS):
            raise UsageError("the op's quantized KV is int8_even or int4_even for K and V alike (SPEC 9.6), got %s"
                             % sorted(names))
        self.bits = self.FORMATS[names.pop()]
        self.stored = d if self.bits == 8 else d // 2
        self.dtype = np.int8 if self.bits == 8 else np.uint8
        self.types, self.scales = {}, {}
        for name in ("k", "v"):
            scale = kv_quant[name]["scale"]
            values = scale["value"] if isinstance(scale["value"], list) else [scale["value"]]
            if scale["granularity"] == "tensor":
                self.types[name] = "PER_TENSOR"
                self.scales[name] = np.array([values[0]], np.float32)
            elif scale["granularity"] == "head":
                self.types[name] = "PER_CHANNEL"
                self.scales[name] = np.repeat(np.asarray(values, np.float32)[:, None], d, axis=1).reshape(1, kv_heads, 1, d)
            else:
                raise UsageError("the op's scales are static, per tensor or per channel: %s scale %r"
                                 % (name, scale["granularity"]))
        if self.types["k"] != self.types["v"]:  # the CPU kernel refuses it
            raise UsageError("the op's CPU kernel takes K and V scales of one kind (%s for K, %s for V)"
                             % (self.types["k"], self.types["v"]))

    def codes(self, stored):
        """The signed codes [B, Hkv, slots, D] of the op's buffer (int4: two nibbles a byte, c + 8,
        element 2i low)."""
        if self.bits == 8:
            return stored.astype(np.int8)
        low, high = (stored & 15).astype(np.int16) - 8, (stored >> 4).astype(np.int16) - 8
        return np.stack([low, high], axis=-1).reshape(*stored.shape[:-1], -1).astype(np.int8)


def _session(exp, window, interleaved, rotary_dim, sinks, window_cache, quantized=None, smooth=False):
    """One GroupQueryAttention node; rotary_dim 0: a NoPE layer (do_rotary=0, no cos/sin)."""
    heads, kv_heads, d = exp.dims["heads"], exp.dims.get("kv_heads", exp.dims["heads"]), exp.dims["head_dim"]
    f = TensorProto.FLOAT
    cache = f if quantized is None else (TensorProto.INT8 if quantized.bits == 8 else TensorProto.UINT8)
    stored = d if quantized is None else quantized.stored
    inputs = [helper.make_tensor_value_info("query", f, [1, None, heads * d]),
              helper.make_tensor_value_info("key", f, [1, None, kv_heads * d]),
              helper.make_tensor_value_info("value", f, [1, None, kv_heads * d]),
              helper.make_tensor_value_info("past_key", cache, [1, kv_heads, None, stored]),
              helper.make_tensor_value_info("past_value", cache, [1, kv_heads, None, stored]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    if rotary_dim:
        inputs += [helper.make_tensor_value_info("cos_cache", f, [None, rotary_dim // 2]),
                   helper.make_tensor_value_info("sin_cache", f, [None, rotary_dim // 2])]
    names = [i.name for i in inputs] + ([] if rotary_dim else ["", ""])
    # Inputs 9 and 10 (position_ids, attention_bias) left out; 11 is head_sink, 12 and 13 the
    # K and V scales.
    optional = []
    if sinks:
        optional.append(("head_sink", 11))
        inputs.append(helper.make_tensor_value_info("head_sink", f, [heads]))
    attributes = {}
    if quantized is not None:
        optional += [("k_scale", 12), ("v_scale", 13)]
        inputs += [helper.make_tensor_value_info(name, f, None) for name in ("k_scale", "v_scale")]
        attributes = {"k_quant_type": quantized.types["k"], "v_quant_type": quantized.types["v"],
                      "kv_cache_bit_width": quantized.bits}
    for name, at in optional:
        names += [""] * (at - len(names)) + [name]
    if window_cache and window > 0:
        attributes["sliding_window_cache"] = 1
    if smooth:
        attributes["smooth_softmax"] = 1
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=float(exp.scale),
                            do_rotary=int(rotary_dim > 0), rotary_interleaved=int(interleaved),
                            local_window_size=int(window),
                            **attributes)
    outputs = [helper.make_tensor_value_info("output", f, [1, None, heads * d]),
               helper.make_tensor_value_info("present_key", cache, [1, kv_heads, None, stored]),
               helper.make_tensor_value_info("present_value", cache, [1, kv_heads, None, stored])]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)  # onnx 1.23 writes IR 14 by default, newer than onnxruntime 1.23 reads
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # results must not depend on the machine's cores
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _rotary_caches(exp, rope, positions):
    """cos and sin [P, R/2] of a layer's rope at positions 0..P-1, yarn's m folded in."""
    inv, m = rope_frequencies(rope, exp.dims["head_dim"])
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return (np.cos(angles) * m).astype(np.float32), (np.sin(angles) * m).astype(np.float32)


def drive_ort_gqa(export, trace_path, local_window_size="policy", producer="kvtrace.drive_ort_gqa",
                  eviction="auto", window_cache=None, smooth_softmax=False):
    """Drives one GroupQueryAttention node per layer through an export's steps and writes a
    trace; returns a DriveResult. local_window_size: "policy" (the scenario's window as this
    release means it; -1 for full layers), an int for every sliding layer, or a list per layer.
    eviction: what the trace declares; "auto": {"blocks": C} under window_cache=C (SPEC 3.1:
    each sliding layer holds exactly its row's last L(T) tokens), else "never" (a growing past
    holds every token; the window is the mask's).
    window_cache: None (the past grows), or a capacity C >= W: sliding layers run the op's
    windowed cache (sliding_window_cache=1), whose buffers hold C rows; what it holds is rows
    [0, L(T)) (resident()). A crop there is driven as the op says (a shorter seqlens_k over the
    same buffer) when L(T - k) = L(T) - k, else skipped (the window would need rebuilding).
    smooth_softmax: the op's attribute smooth_softmax=1 (a 1 added to every softmax's
    denominator: SPEC 7's learned sink of logit 0 in every head), in place of head_sink, for a
    scenario whose sink_logits are all 0; True on another scenario drives it as asked, which
    kvcheck judges (a sink the model does not have)."""
    if not isinstance(export, Export):
        raise TypeError("export must be a kvtrace.Export")
    exp = export
    layers, heads, d = exp.dims["layers"], exp.dims["heads"], exp.dims["head_dim"]
    kv_heads = exp.dims.get("kv_heads", heads)
    if exp.manifest.get("kv_dtype", "float32") != "float32":
        raise UsageError("drive_ort_gqa drives float32 or quantized caches (kv_dtype %s: not driven)"
                         % exp.manifest["kv_dtype"])
    if isinstance(exp.manifest.get("kv_quant"), list):
        raise UsageError("per-layer kv_quant: not driven (one quantization for every layer)")
    quantized = _Quantized(exp.manifest["kv_quant"], kv_heads, d) if "kv_quant" in exp.manifest else None
    if quantized is not None and not has_quantized_kv():
        raise UsageError("onnxruntime %s's GroupQueryAttention has no quantized KV (1.31 has)" % ort.__version__)
    windows = []
    for l in range(layers):
        p = exp.layer_policy(l)
        if p["type"] == "sink":
            raise UsageError("GroupQueryAttention has no sink cache (StreamingLLM's): layer %d's policy is sink" % l)
        if p["type"] == "chunked":
            raise UsageError("GroupQueryAttention has no chunked attention (SPEC 10.2): layer %d's policy is chunked"
                             % l)
        if isinstance(local_window_size, (list, tuple)):
            windows.append(int(local_window_size[l]))
        elif p["type"] == "full":
            windows.append(-1)
        elif local_window_size == "policy":
            windows.append(p["window"] if window_meaning_changed() else p["window"] - 1)
        else:
            windows.append(int(local_window_size))
    # One node per layer with its own rope (SPEC 10.1: each node takes its cos/sin caches);
    # a NoPE layer's node does no rotary, and its queries take the temperature (SPEC 10.3)
    # before the node, as a model scales them.
    ropes = [exp.layer_rope(l) for l in range(layers)]
    for rope in ropes:
        if rope is not None and rope.get("layout", "half") not in ("half", "interleaved"):
            raise UsageError("unknown rope layout %r" % rope.get("layout"))
    rotary_dims = [0 if rope is None else int(rope.get("rotary_dim") or d) for rope in ropes]
    if d % 16 or any(r % 16 for r in rotary_dims):
        raise UsageError("GroupQueryAttention on the CPU needs head_dim and the rotary dims multiples of 16 "
                         "(head_dim %d, rotary dims %s)" % (d, sorted(set(r for r in rotary_dims if r))))
    temperature = exp.manifest.get("attention", {}).get("query_temperature")
    logits = exp.manifest.get("attention", {}).get("sink_logits")
    if logits and not isinstance(logits[0], list):
        logits = [logits] * layers
    if smooth_softmax and logits and any(any(x != 0 for x in layer) for layer in logits):
        raise UsageError("smooth_softmax is a sink of logit 0 in every head; this scenario's sink_logits are not "
                         "all 0: drive them through head_sink (smooth_softmax=False)")
    if smooth_softmax:
        logits = None  # the attribute stands for them
    exp.refuse_prune("drive_ort_gqa")
    for step in exp.steps:
        if step["op"] in ("free", "preempt", "resume", "evict"):
            raise UsageError("step %r is a paged cache's (SPEC 8): GroupQueryAttention has no such operation"
                             % step["op"])
    windowed = [window_cache is not None and windows[l] > 0 for l in range(layers)]
    if any(windowed) and not has_windowed_cache():
        raise UsageError("onnxruntime %s's GroupQueryAttention has no sliding_window_cache (1.31 has)" % ort.__version__)
    if eviction == "auto":
        sliding = [l for l in range(layers) if windows[l] > 0]
        eviction = {"blocks": window_cache} if sliding and window_cache is not None else \
            "never" if sliding else "lazy"
    for l in range(layers):
        if windowed[l] and window_cache < windows[l]:
            raise UsageError("window_cache %d is smaller than layer %d's local_window_size %d (the op refuses C < W)"
                             % (window_cache, l, windows[l]))
    sessions = [_session(exp, windows[l], ropes[l] is not None and ropes[l].get("layout") == "interleaved",
                         rotary_dims[l], bool(logits), windowed[l], quantized, smooth_softmax)
                for l in range(layers)]
    longest = 1 + sum(max((len(r["uids"]) for r in s.get("rows", [])), default=0) for s in exp.steps)
    caches = [None if rope is None else _rotary_caches(exp, rope, max(longest, 16)) for rope in ropes]
    buffer_type = np.float32 if quantized is None else quantized.dtype
    buffer_width = d if quantized is None else quantized.stored

    def fresh_row():  # per layer: the buffers the caller keeps and T, the tokens the row has had
        return [{"k": np.zeros((1, kv_heads, window_cache if windowed[l] else 0, buffer_width), buffer_type),
                 "v": np.zeros((1, kv_heads, window_cache if windowed[l] else 0, buffer_width), buffer_type), "total": 0}
                for l in range(layers)]

    def held_rows(state, l):  # what the layer holds by its own account: a windowed cache's rows [0, L(T))
        count = resident(state["total"], window_cache, windows[l]) if windowed[l] else state["total"]
        return state["k"][:, :, :count], state["v"][:, :, :count]

    def held(rows):
        # Rows of different lengths: the shorter ones end in all-zero slots (unused, SPEC 6).
        per_layer = [[held_rows(r[l], l) for r in rows] for l in range(layers)]
        out = []
        for layer in per_layer:
            slots = max((k.shape[2] for k, _ in layer), default=0)
            pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, slots - x.shape[2]), (0, 0)))  # noqa: E731
            keys = np.concatenate([pad(k) for k, _ in layer], axis=0)
            values = np.concatenate([pad(v) for _, v in layer], axis=0)
            if quantized is None:
                out.append({"keys": keys, "values": values})
                continue
            # Codes and the static scales, one a slot (kvcheck dequantizes them, SPEC 9.3); an
            # unused slot (a shorter row's) keeps all-zero codes and a zero scale.
            used = np.concatenate([pad(np.ones(k.shape[:3] + (1,), np.float32)) for k, _ in layer], axis=0)
            tensors = {}
            for name, stored in (("k", keys), ("v", values)):
                scale = quantized.scales[name]
                # PER_CHANNEL [1, Hkv, 1, D] holds a head's scale along D: one a head.
                per_slot = np.broadcast_to(scale[..., :1] if scale.ndim == 4 else scale.reshape(1, 1, 1, 1),
                                           used.shape)
                tensors[name + "_codes"] = quantized.codes(stored)
                tensors[name + "_scales"] = (per_slot * used).astype(np.float64)
            out.append(tensors)
        return out

    result = DriveResult()
    stopped = None  # why the rest of the steps cannot be driven
    with TraceWriter(trace_path, exp.name, producer, "absolute", "float32", eviction) as writer:
        rows = [fresh_row() for _ in range(exp.dims["batch"])]
        for index, step in enumerate(exp.steps):
            if result.error is not None:
                writer.skip_step()
                continue
            if stopped:
                writer.skipped_step(stopped)
                result.skipped.append((index, stopped))
                continue
            op = step["op"]
            try:
                if op == "reset":
                    rows = [fresh_row() for _ in range(step.get("batch", len(rows)))]
                    writer.skip_step()
                elif op == "reorder":
                    rows = [rows[b] for b in step["rows_from"]]
                    writer.step(held(rows))
                elif op == "crop":
                    if "refused" in step:  # the buffers are the caller's: nothing refuses
                        result.refusals.append((index, "no refusal: the caller's buffers can be cut anywhere"))
                    for r in rows:
                        for l, state in enumerate(r):
                            length = min(step["length"], state["total"])
                            if not windowed[l]:
                                state["k"], state["v"] = state["k"][:, :, :length], state["v"][:, :, :length]
                            elif resident(length, window_cache, windows[l]) != \
                                    resident(state["total"], window_cache, windows[l]) - (state["total"] - length):
                                stopped = ("a crop to %d of a windowed cache holding %d tokens needs positions it "
                                           "evicted (L(T - k) != L(T) - k): the window would have to be rebuilt"
                                           % (length, state["total"]))
                            state["total"] = length
                    if stopped:
                        writer.skipped_step(stopped)
                        result.skipped.append((index, stopped))
                    else:
                        writer.step(held(rows))
                elif op in ("append", "decode"):
                    outs = [[] for _ in range(layers)]
                    longest = max(len(r["uids"]) for r in step["rows"])
                    for b, row in enumerate(step["rows"]):
                        uids = np.asarray(row["uids"], np.int64)
                        for l in range(layers):
                            state = rows[b][l]
                            n, total = len(uids), state["total"] + len(uids)
                            query = exp.q[l][uids].astype(np.float64)  # [n, H, D]
                            if ropes[l] is None and temperature is not None:
                                query = query * query_temperature(temperature, np.arange(state["total"], total))[:, None, None]
                            feed = {"query": query.reshape(1, n, heads * d).astype(np.float32),
                                    "key": exp.k[l][uids].reshape(1, n, kv_heads * d).astype(np.float32),
                                    "value": exp.v[l][uids].reshape(1, n, kv_heads * d).astype(np.float32),
                                    "past_key": state["k"], "past_value": state["v"],
                                    "seqlens_k": np.array([total - 1], np.int32),
                                    "total_sequence_length": np.array(total, np.int32)}
                            if caches[l] is not None:
                                feed["cos_cache"], feed["sin_cache"] = caches[l]
                            if logits:
                                feed["head_sink"] = np.asarray(logits[l], np.float32)
                            if quantized is not None:
                                feed["k_scale"], feed["v_scale"] = quantized.scales["k"], quantized.scales["v"]
                            out, state["k"], state["v"] = sessions[l].run(None, feed)
                            state["total"] = total
                            out = out.reshape(1, n, heads, d).transpose(0, 2, 1, 3)
                            # A shorter row's outputs end the step's, as its tokens do (left padding).
                            outs[l].append(np.pad(out, ((0, 0), (0, 0), (longest - n, 0), (0, 0)),
                                                  constant_values=np.nan))
                    tensors = held(rows)
                    for l in range(layers):
                        tensors[l]["out"] = np.concatenate(outs[l], axis=0)
                    writer.step(tensors)
                else:
                    raise UsageError("step %r: not an operation drive_ort_gqa knows" % op)
            except UsageError:
                raise
            except Exception as e:  # onnxruntime failed: a finding, written into the trace
                message = "%s: %s" % (type(e).__name__, e)
                writer.error_step(message)
                result.error, result.error_step = message, index
        result.recorded = sum(1 for s in writer.manifest["steps"] if "layers" in s)
    return result
