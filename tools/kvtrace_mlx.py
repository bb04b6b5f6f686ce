"""mlx-lm's KV caches driven as mlx-lm's models drive them, written as a kvcheck trace
(kvtrace.drive_mlx_cache calls this; it needs mlx and mlx-lm, kvtrace itself only NumPy).

One forward of one layer, as mlx_lm/models/llama.py does it (mlx-lm 0.32.2: Attention,
LlamaModel):

    mask = create_attention_mask(h, cache, window_size)   # before any layer runs
    q = rope(q, offset=cache.offset); k = rope(k, offset=cache.offset)
    keys, values = cache.update_and_fetch(k, v)           # [B, Hkv, L, D]
    out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=..., mask=mask)

Keys stay at the absolute position they were rotated at (key_positions "absolute"). What
the cache holds after a step is cache.keys_and_values(), the slots it counts as held
(KVCache: keys[..., :offset]; RotatingKVCache: the ring, sinks in [:keep]), in storage
order: kvcheck allows any slot order. A QuantizedKVCache's state is its codes (unpacked from
mx.quantize's words), scales and biases (SPEC 9.7's mlx_affine), which the scenario must
declare at the cache's bits and group size. After a chunk a RotatingKVCache keeps the W - 1 tokens
before it beside the whole chunk and trims them at its next update: the trace declares
eviction "deferred" unless told otherwise.

A ChunkedKVCache (Llama 4's chunked layers, SPEC 10.2) is driven as mlx_lm/models/llama4.py
drives it: maybe_trim_front() before the forward (it keeps at most C old keys), then the
model's own chunk mask over the slots start_position .. offset + L - 1 (the cache makes
none). It trims only at the next forward, so it may hold any earlier token at its true
position: the trace declares eviction "never" for it, and its retained set is still
checked."""

import numpy as np

from kvtrace_base import DriveResult, Export, TraceWriter, UsageError

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.models.rope_utils import initialize_rope


class _Failed(Exception):
    pass


def mlx_rope(rope, head_dim):
    """The rotary module an mlx-lm model builds for the scenario's rope (initialize_rope):
    traditional=True is the interleaved layout, False the half (rotate_half) one; nn.RoPE(dims)
    rotates the first dims only."""
    if rope["layout"] not in ("half", "interleaved"):
        raise UsageError("unknown rope layout %r" % rope["layout"])
    dims = int(rope.get("rotary_dim") or head_dim)
    scaling, config = rope.get("scaling", "none"), None
    if scaling == "linear":
        config = {"type": "linear", "factor": rope["factor"]}
    elif scaling == "llama3":
        config = {"rope_type": "llama3", **{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                                  "original_max_position_embeddings")}}
    elif scaling == "yarn":
        config = {"rope_type": "yarn", **{k: rope[k] for k in ("factor", "original_max_position_embeddings",
                                                                "beta_fast", "beta_slow") if k in rope}}
    elif scaling != "none":
        raise UsageError("rope scaling %r has no mlx-lm counterpart" % scaling)
    return initialize_rope(dims, float(rope["theta"]), rope["layout"] == "interleaved", config,
                           rope.get("original_max_position_embeddings"))


def _as_mx(x, kv_dtype):
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[kv_dtype]
    return mx.array(np.ascontiguousarray(x, dtype=np.float32)).astype(dtype)


def _as_numpy(x):
    return np.array(x.astype(mx.float32)).astype(np.float64)  # NumPy has no bfloat16


def held_state(cache, kv_heads, head_dim):
    """What the cache holds by its own account, keys_and_values(); nothing yet: empty."""
    if cache.keys is None:
        empty = np.zeros((1, kv_heads, 0, head_dim))
        return empty, empty
    keys, values = cache.keys_and_values()
    return _as_numpy(keys), _as_numpy(values)


def unpacked_codes(words, bits, dim):
    """mx.quantize's packed codes [..., dim * bits / 32] uint32 as one code an element: each
    row's codes are one little-endian bit stream, code i in bits [i * bits, (i + 1) * bits)."""
    words = np.ascontiguousarray(np.asarray(words, dtype=np.uint32))
    stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    weights = (1 << np.arange(bits)).astype(np.int64)
    return (stream.reshape(*stream.shape[:-1], dim, bits).astype(np.int64) * weights).sum(axis=-1)


def held_codes(cache, kv_heads, head_dim):
    """A QuantizedKVCache's state as SPEC 9.7's trace gives it: for K and V the codes
    [B, Hkv, slots, D], scales and biases [B, Hkv, slots, D / group] of its first `offset`
    slots (its buffers grow in steps of 256)."""
    if cache.keys is None:
        empty = np.zeros((1, kv_heads, 0, head_dim))
        groups = np.zeros((1, kv_heads, 0, head_dim // cache.group_size))
        return {"k_codes": empty, "k_scales": groups, "k_bias": groups,
                "v_codes": empty, "v_scales": groups, "v_bias": groups}
    state = {}
    for name, (packed, scales, biases) in (("k", cache.keys), ("v", cache.values)):
        n = cache.offset
        state[name + "_codes"] = unpacked_codes(np.array(packed[..., :n, :]), cache.bits, head_dim)
        state[name + "_scales"] = _as_numpy(scales[..., :n, :])
        state[name + "_bias"] = _as_numpy(biases[..., :n, :])
    return state


def _quantized(cache):
    return hasattr(cache, "bits") and hasattr(cache, "group_size")


def _check_quantized(exp, caches):
    """A QuantizedKVCache stores K and V as mlx_affine (SPEC 9.7) at its bits and group size:
    the scenario must say the same for that layer, and a layer the scenario quantizes must
    have one."""
    quants = exp.manifest.get("kv_quant")
    per_layer = quants if isinstance(quants, list) else [quants] * len(caches)
    for l, cache in enumerate(caches):
        q = per_layer[l] or {}
        mlx = [q.get(t, {}).get("format") == "mlx_affine" for t in ("k", "v")]
        if not _quantized(cache):
            if any(mlx) or q:
                raise UsageError("layer %d: the scenario quantizes it (kv_quant), but its cache is a %s"
                                 % (l, type(cache).__name__))
            continue
        if not all(mlx):
            raise UsageError("layer %d is a QuantizedKVCache: the scenario's kv_quant must store K and V as "
                             "mlx_affine (SPEC 9.7), got %s" % (l, {t: q.get(t, {}).get("format") for t in ("k", "v")}))
        for t in ("k", "v"):
            bits, group = q[t].get("bits"), q[t]["scale"]["group"]
            if (bits, group) != (cache.bits, cache.group_size):
                raise UsageError("layer %d: QuantizedKVCache(group_size=%d, bits=%d), but the scenario's %s is "
                                 "mlx_affine with groups of %d at %d bits" % (l, cache.group_size, cache.bits, t,
                                                                              group, bits))
        if any(q.get(rule, plain) != plain for rule, plain in
               (("residual", 0), ("flush", "append"), ("prefill", "store"), ("chunk_reads", "stored"),
                ("transform", "none"))):
            raise UsageError("layer %d: QuantizedKVCache quantizes every token as it is written and reads it back "
                             "(residual 0, flush append, prefill store, chunk_reads stored, no transform)" % l)


def _held(cache, kv_heads, head_dim):
    """A layer's state for the trace: keys and values, or a QuantizedKVCache's codes."""
    if _quantized(cache):
        return held_codes(cache, kv_heads, head_dim)
    return dict(zip(("keys", "values"), held_state(cache, kv_heads, head_dim)))


def chunk_mask(cache, n):
    """llama4.py's mask for a chunked layer's forward of n tokens [n, slots]: key slot j holds
    position start_position + j, and a query sees the keys of its own chunk up to itself."""
    start, offset, c = cache.start_position, cache.offset, cache.chunk_size
    keys = mx.arange(start, offset + n)
    queries = mx.arange(offset, offset + n)[:, None]
    return (keys // c == queries // c) & (keys <= queries)


def _chunked(cache):
    return hasattr(cache, "maybe_trim_front") and hasattr(cache, "chunk_size")


def drive_mlx_cache(export, make_cache, trace_path, window_size="policy", chunks="whole", prefill_step_size=2048,
                    producer="kvtrace.drive_mlx_cache", dtype="float32", eviction=None):
    """Drives mlx-lm caches through an export and writes a trace; returns a DriveResult.

    make_cache(): a list of per-layer caches (as make_prompt_cache returns) or one cache
    (then called once per layer); called again at a reset.
    window_size: what the model hands create_attention_mask per layer: "policy" (the layer's
    window when its policy is sliding, else None, as llama.py does), None, an int or a list.
    chunks: "whole" (one forward per append) or "generate" (as generate_step: the first
    append but its last token in forwards of prefill_step_size, then the last token alone).
    Crops go through trim_prompt_cache: refused when a layer is not trimmable, or when it
    trims fewer tokens than asked (its return value says so; the layers it did trim stay
    trimmed, as they would for mlx-lm's caller, and later steps are judged from there). Rows of different lengths and
    reorders are refused (mlx-lm pads and reorders with BatchKVCache).
    eviction: the trace's declaration; default "never" when a layer is a ChunkedKVCache,
    else "deferred"."""
    if not isinstance(export, Export):
        raise TypeError("export must be a kvtrace.Export")
    if chunks not in ("whole", "generate"):
        raise UsageError("chunks must be \"whole\" or \"generate\", got %r" % (chunks,))
    exp = export
    layers, head_dim = exp.dims["layers"], exp.dims["head_dim"]
    # One rope per layer (SPEC 10.1: Gemma 3's two bases); None: a NoPE layer, not rotated.
    rope = [None if exp.layer_rope(l) is None else mlx_rope(exp.layer_rope(l), head_dim) for l in range(layers)]
    temperature = exp.manifest.get("attention", {}).get("query_temperature")
    if window_size == "policy":
        windows = [p.get("window") if p.get("type") == "sliding" else None
                   for p in map(exp.layer_policy, range(layers))]
    elif isinstance(window_size, (list, tuple)):
        windows = list(window_size)
    else:
        windows = [window_size] * layers
    logits = exp.manifest.get("attention", {}).get("sink_logits")
    if logits and not isinstance(logits[0], list):
        logits = [logits] * layers
    sinks = [None if not logits else mx.array(np.asarray(logits[l], np.float32)) for l in range(layers)]
    exp.refuse_prune("drive_mlx_cache")
    paged = [step["op"] for step in exp.steps if step["op"] in ("free", "preempt", "resume", "evict")]
    if paged:
        raise UsageError("step %r is a paged cache's (SPEC 8): mlx-lm's caches have no such operation" % paged[0])
    if any(exp.layer_policy(l).get("swa") for l in range(layers)):
        raise UsageError("a sliding layer under a sink layer's shift (SPEC 10.4): mlx-lm has no such cache")
    for step in exp.steps:
        if step["op"] == "reorder":
            raise UsageError("mlx-lm's single-sequence caches have no reorder (BatchKVCache has)")
        if step["op"] in ("append", "decode") and len({len(r["uids"]) for r in step["rows"]}) > 1:
            raise UsageError("rows of different lengths: mlx-lm pads them with BatchKVCache, not driven here")

    def fresh():
        made = make_cache()
        caches = list(made) if isinstance(made, (list, tuple)) else [made] + [make_cache() for _ in range(layers - 1)]
        if len(caches) != layers:
            raise UsageError("make_cache returned %d caches for %d layers" % (len(caches), layers))
        _check_quantized(exp, caches)
        return caches

    result = DriveResult()
    if eviction is None:
        eviction = "never" if any(_chunked(c) for c in fresh()) else "deferred"
    with TraceWriter(trace_path, exp.name, producer, "absolute", dtype, eviction) as writer:
        caches, first_append = fresh(), True
        for index, step in enumerate(exp.steps):
            if result.error is not None:
                writer.skip_step()
                continue
            try:
                if step["op"] == "reset":
                    caches, first_append = fresh(), True
                    writer.skip_step()
                elif step["op"] == "crop":
                    refusal = _trim(caches, step["length"])
                    if refusal is not None:
                        writer.error_step(refusal)
                        if "refused" in step:
                            result.refusals.append((index, refusal))
                        else:
                            result.error, result.error_step = refusal, index
                        continue
                    writer.step([_held(c, exp.dims.get("kv_heads", exp.dims["heads"]), head_dim) for c in caches])
                else:
                    _forward(exp, step, caches, rope, windows, sinks, writer,
                             prefill_step_size if first_append and chunks == "generate" else None, temperature)
                    first_append = False
            except _Failed as e:
                writer.error_step(str(e))
                result.error, result.error_step = str(e), index
        result.recorded = sum(1 for s in writer.manifest["steps"] if "layers" in s)
    return result


def _trim(caches, length):
    """A crop through trim_prompt_cache, as mlx-lm rolls back; the refusal's words, or None.
    A cache refuses when it is not trimmable or trims fewer tokens than asked."""
    if not all(c.is_trimmable() for c in caches):
        return "cache not trimmable (is_trimmable() is False): trim_prompt_cache trims nothing"
    removed = max(0, caches[0].offset - length)  # a crop past the end removes nothing
    trimmed = trim_prompt_cache(caches, removed) if removed else 0
    if trimmed != removed:
        return "trim_prompt_cache trimmed %d of the %d tokens asked" % (trimmed, removed)
    return None


def nope_temperature(queries, offset, temperature):
    """SPEC 10.3 as mlx_lm/models/llama4.py scales a NoPE layer's queries [B, H, L, D]:
    log(floor((offset + 1 .. offset + L) / floor_scale) + 1) * attn_scale + 1 per position."""
    n = queries.shape[2]
    scales = mx.log(mx.floor(mx.arange(offset + 1, offset + n + 1) / temperature["floor_scale"]) + 1.0) \
        * temperature["attn_scale"] + 1.0
    return (queries * scales[:, None]).astype(queries.dtype)


def _forward(exp, step, caches, rope, windows, sinks, writer, prefill, temperature=None):
    """One append (or decode) step: its forwards, then what each layer holds. rope: one per
    layer (None: NoPE, with the query temperature when the scenario gives one)."""
    layers, kv_dtype = exp.dims["layers"], exp.manifest.get("kv_dtype", "float32")
    uids = np.array([r["uids"] for r in step["rows"]], dtype=np.int64)  # [B, n]
    batch, n = uids.shape
    cuts = [(0, n)]
    if prefill is not None and n > 1:
        cuts = [(a, min(a + prefill, n - 1)) for a in range(0, n - 1, prefill)] + [(n - 1, n)]
    outs, queries = [[] for _ in range(layers)], [[] for _ in range(layers)]
    for a, b in cuts:
        chunk = uids[:, a:b]
        h = mx.zeros((batch, b - a, 1))  # create_attention_mask reads only its length
        for l in range(layers):
            cache = caches[l]
            q = _as_mx(np.transpose(exp.q[l][chunk], (0, 2, 1, 3)), kv_dtype)  # [B, H, N, D]
            k = _as_mx(np.transpose(exp.k[l][chunk], (0, 2, 1, 3)), kv_dtype)
            v = _as_mx(np.transpose(exp.v[l][chunk], (0, 2, 1, 3)), kv_dtype)
            try:
                if _chunked(cache):  # as llama4.py: trim to C old keys, then its chunk mask
                    cache.maybe_trim_front()
                    mask = chunk_mask(cache, b - a)
                else:
                    mask = mlx_base.create_attention_mask(h, cache, window_size=windows[l])
                if rope[l] is None:  # NoPE (SPEC 10.1), the temperature as llama4.py applies it
                    q_rotated, k_rotated = q, k
                    if temperature is not None:
                        q_rotated = nope_temperature(q, cache.offset, temperature)
                else:
                    q_rotated, k_rotated = rope[l](q, offset=cache.offset), rope[l](k, offset=cache.offset)
                keys, values = cache.update_and_fetch(k_rotated, v)
                # Read before the attention: with a QuantizedKVCache it multiplies the queries by
                # the softmax scale in place (`queries *= scale` on the caller's mx.array).
                query = _as_numpy(q_rotated)
                out = mlx_base.scaled_dot_product_attention(q_rotated, keys, values, cache=cache, scale=exp.scale,
                                                            mask=mask, sinks=sinks[l])
                mx.eval(out)
            except UsageError:
                raise
            except Exception as e:  # the cache (or mlx) failed: a finding, written into the trace
                raise _Failed("%s: %s" % (type(e).__name__, e)) from e
            outs[l].append(_as_numpy(out))
            queries[l].append(query)
    recorded = []
    for l in range(layers):
        held = _held(caches[l], exp.dims.get("kv_heads", exp.dims["heads"]), exp.dims["head_dim"])
        recorded.append(dict(held, out=np.concatenate(outs[l], axis=2), q=np.concatenate(queries[l], axis=2)))
    writer.step(recorded)
