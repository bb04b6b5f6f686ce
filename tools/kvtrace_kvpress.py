"""kvpress's presses driven as its pipeline drives them, written as a kvcheck trace
(kvtrace.drive_kvpress calls this; it needs torch, transformers and kvpress, kvtrace itself
only NumPy).

kvpress compresses a cache through forward hooks on a model's attention modules, so the
driver runs a real model: a tiny transformers `LlamaForCausalLM` built from a config (no
download), whose attention computes with the scenario's own q, k and v. Per layer:

- hidden size (H + 2 Hkv) D, and q_proj, k_proj, v_proj the matrices that select a token's
  q, k and v from it (no bias); a forward pre-hook on `self_attn` hands it the step's
  [q; k; v] as `hidden_states` (the decoder layer passes them by keyword, and kvpress's hook
  reads the same keyword, so its scorers see the same states);
- the model's own rotary embedding (rope_theta, its rope_parameters) rotates q and k at
  the `position_ids` the driver passes, and the model's eager attention reads the cache;
- a forward pre-hook on `o_proj` reads the attention's output before the projection.

The schedule, as `KVPressTextGenerationPipeline._forward` (kvpress 0.5.5) runs it:

- the first append of a generation followed by a `prune` step runs
  `with press(model): model.model(inputs_embeds=..., past_key_values=cache, position_ids=...)`
  with `StreamingLLMPress(compression_ratio, n_sink=S)`, wrapped in `KeyRerotationPress` when
  the prune re-rotates. The press compresses after each layer's attention (a dense prefill):
  the append step is recorded from the cache before the press's hook runs, the prune step
  from the cache after the forward. compression_ratio is 1 - (S + R + 0.5) / n, so that
  kvpress's int(n (1 - ratio)) keeps exactly S + R tokens. An observed prune (SPEC 11.1,
  `"select": "observed"`) runs `KnormPress` keeping `keep` instead (or the `press` a caller
  gives: SnapKV, TOVA, ExpectedAttention, ...); which tokens each kv head kept is read from
  the cache by kvcheck;
- every later append runs outside the press with position_ids from the export (the original
  index, or the compressed one after a re-rotating prune, as the pipeline's
  `context_length` makes them); cache_position is left to the model (the slots held);
- a crop is `cache.crop`, in slots: the scenario's length minus the pruned tokens below it
  (the pipeline trims an answer off the same way).

A stack of sliding and full layers runs on a tiny `Gemma3ForConditionalGeneration` instead
(q_norm and k_norm set to identity, query_pre_attn_scalar = head_dim, a rope per layer type):
the class whose sliding layers kvpress leaves alone, as SPEC 11 prunes full layers only.

What kvpress cannot do is refused by name (UsageError): a prune anywhere but right after a
generation's first append (kvpress compresses only a forward that starts on an empty cache),
rows of different lengths (it prunes slots, so padding would count as sinks), reorders,
sink or chunked policies, per-layer ropes among full layers, a re-rotating prune beside
window layers (at its first later token: one position_ids cannot place both kinds of layer),
and rope layouts or scalings the configs do not express."""

import numpy as np

from kvtrace_base import DriveResult, Export, TraceWriter, UsageError

import torch
from transformers import (DynamicCache, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, SiglipVisionConfig)

import kvpress


def _rope_parameters(rope, head_dim):
    """The rope_parameters a transformers config takes for the scenario's rope of one layer."""
    if rope is None:
        raise UsageError("a NoPE layer: the Llama and Gemma 3 models rotate every layer")
    if rope["layout"] != "half":
        raise UsageError("the %s RoPE layout: transformers rotates halves (rotate_half)" % rope["layout"])
    if int(rope.get("rotary_dim") or head_dim) != head_dim:
        raise UsageError("partial rotary: Llama and Gemma 3 rotate the whole head")
    parameters = {"rope_type": "default", "rope_theta": float(rope["theta"])}
    scaling = rope.get("scaling", "none")
    if scaling == "linear":
        parameters.update(rope_type="linear", factor=float(rope["factor"]))
    elif scaling == "llama3":
        parameters.update(rope_type="llama3", **{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor")},
                          original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif scaling != "none":
        raise UsageError("rope scaling %r: not driven through kvpress" % scaling)
    return parameters


def _max_positions(rope):
    """The config's max_position_embeddings: room for the scenarios, and above llama3's
    original context as transformers requires."""
    return max(4096, int(rope.get("original_max_position_embeddings", 0)) + 1)


def _model_config(exp):
    """The tiny config whose attention is the scenario's: a LlamaConfig when every layer is
    full, else a Gemma3Config (sliding and full layers, a rope per layer type; the multimodal
    class, the one kvpress leaves the sliding layers of)."""
    d = exp.dims
    heads, kv_heads, head_dim, layers = d["heads"], d.get("kv_heads", d["heads"]), d["head_dim"], d["layers"]
    if abs(exp.scale - head_dim ** -0.5) > 1e-12:
        raise UsageError("a softmax scale other than 1/sqrt(head_dim): the model's attention scales by that")
    hidden = (heads + 2 * kv_heads) * head_dim
    policies = [exp.layer_policy(l) for l in range(layers)]
    if all(p["type"] == "full" for p in policies):
        rope = exp.layer_rope(0)
        if any(exp.layer_rope(l) != rope for l in range(layers)):
            raise UsageError("one rope per layer (SPEC 10.1) in a stack of full layers: a Llama model has one "
                             "rotary embedding")
        return LlamaConfig(vocab_size=8, hidden_size=hidden, intermediate_size=8, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           max_position_embeddings=_max_positions(rope), rope_parameters=_rope_parameters(rope, head_dim),
                           attention_bias=False, attn_implementation="eager", dtype=torch.float32)
    kinds = {"sliding": "sliding_attention", "full": "full_attention"}
    if any(p["type"] not in kinds or "shift_with" in p for p in policies):
        raise UsageError("layer policies %s: kvpress is driven on full layers, or Gemma 3's sliding and full ones"
                         % sorted({p["type"] for p in policies}))
    windows = {p["window"] for p in policies if p["type"] == "sliding"}
    if len(windows) != 1:
        raise UsageError("sliding layers of different windows: Gemma 3 has one sliding_window")
    ropes = {}
    for l, p in enumerate(policies):
        parameters = _rope_parameters(exp.layer_rope(l), head_dim)
        if ropes.setdefault(kinds[p["type"]], parameters) != parameters:
            raise UsageError("two %s layers with different ropes: Gemma 3 has one rope per layer type" % p["type"])
    text = Gemma3TextConfig(vocab_size=64, hidden_size=hidden, intermediate_size=8, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                            query_pre_attn_scalar=head_dim, sliding_window=windows.pop(),
                            layer_types=[kinds[p["type"]] for p in policies], rope_parameters=ropes,
                            max_position_embeddings=4096)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=60, boi_token_index=58, eoi_token_index=59)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    return config


class _Model:
    """The tiny model with its projections set to select q, k and v, and the hooks that feed
    each layer the step's inputs and read its output."""

    def __init__(self, exp):
        self.exp = exp
        config = _model_config(exp)
        torch.manual_seed(0)
        if isinstance(config, LlamaConfig):
            self.model = LlamaForCausalLM(config).eval()
            self.layers, self.hidden = self.model.model.layers, config.hidden_size
        else:
            self.model = Gemma3ForConditionalGeneration(config).eval()
            self.layers, self.hidden = self.model.model.language_model.layers, config.text_config.hidden_size
        d = exp.dims
        h, hkv, dim = d["heads"], d.get("kv_heads", d["heads"]), d["head_dim"]
        eye = torch.eye(self.hidden)
        self.inputs, self.outputs, self.before_press = {}, {}, {}
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):  # Gemma 3 normalizes q and k per head: the scenario's are final
                attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
            with torch.no_grad():
                attn.q_proj.weight.copy_(eye[: h * dim])
                attn.k_proj.weight.copy_(eye[h * dim: (h + hkv) * dim])
                attn.v_proj.weight.copy_(eye[(h + hkv) * dim:])
            attn.register_forward_pre_hook(self._feed(l), with_kwargs=True)
            # Registered before any press's: it sees the cache as the forward wrote it.
            attn.register_forward_hook(self._snapshot(l), with_kwargs=True)
            attn.o_proj.register_forward_pre_hook(self._read(l))

    def _feed(self, l):
        def hook(module, args, kwargs):
            kwargs["hidden_states"] = self.inputs[l]
            return args, kwargs
        return hook

    def _snapshot(self, l):
        def hook(module, args, kwargs, output):
            layer = kwargs["past_key_values"].layers[l]
            self.before_press[l] = (layer.keys.detach().clone(), layer.values.detach().clone())
        return hook

    def _read(self, l):
        def hook(module, args):
            self.outputs[l] = args[0].detach().clone()
        return hook

    def forward(self, uids, positions, cache):
        """One forward of every row's tokens uids [B, n] at positions [B, n]; returns the
        outputs per layer [B, H, n, D]."""
        exp = self.exp
        b, n = uids.shape
        h, dim = exp.dims["heads"], exp.dims["head_dim"]
        for l in range(exp.dims["layers"]):
            parts = [exp.q[l][uids], exp.k[l][uids], exp.v[l][uids]]  # [B, n, heads, D] each
            self.inputs[l] = torch.from_numpy(np.concatenate([p.reshape(b, n, -1) for p in parts], axis=-1)
                                              .astype(np.float32))
        embeds = torch.zeros(b, n, self.hidden)
        with torch.no_grad():
            self.model.model(inputs_embeds=embeds, past_key_values=cache,
                             position_ids=torch.as_tensor(positions, dtype=torch.long), use_cache=True)
        return [self.outputs[l].reshape(b, n, h, dim).permute(0, 2, 1, 3).double().numpy()
                for l in range(exp.dims["layers"])]


def _kept(prune, n):
    """How many of a prompt's n tokens the prune keeps: S + R, or an observed prune's `keep`
    (SPEC 11.1); all n when that is n or more."""
    return min(prune["keep"] if prune.get("select") == "observed" else prune["sinks"] + prune["recent"], n)


def compression_ratio(kept, n):
    """The ratio for which kvpress's int(n (1 - ratio)) keeps exactly `kept` of n tokens (0:
    none pruned, which kvpress returns unchanged)."""
    return 0.0 if kept >= n else 1.0 - (kept + 0.5) / n


def _press(prune, n):
    """kvpress's press for a prune of a prompt of n tokens: StreamingLLMPress keeping exactly
    S + R or, for an observed prune (SPEC 11.1), KnormPress keeping `keep` (the scorer whose
    choice depends on nothing but the keys); re-rotated by KeyRerotationPress if asked."""
    ratio = compression_ratio(_kept(prune, n), n)
    if prune.get("select") == "observed":
        press = kvpress.KnormPress(compression_ratio=ratio)
    else:
        press = kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=prune["sinks"])
    return kvpress.KeyRerotationPress(press=press) if prune.get("rerotate") else press


def _one_position_list(positions, step):
    """A row's query positions, which a model gives every layer in one position_ids: the
    export's list, or its per-layer lists (SPEC 7) when they agree."""
    if positions and isinstance(positions[0], list):
        if any(p != positions[0] for p in positions):
            raise UsageError("step %d places its tokens at other positions in different layers (a re-rotating prune "
                             "beside window layers): a model passes one position_ids to every layer" % step)
        return positions[0]
    return positions


def _state(cache, layers):
    return [{"keys": cache.layers[l].keys.double().numpy(), "values": cache.layers[l].values.double().numpy()}
            for l in range(layers)]


def drive_kvpress(export, trace_path, producer="kvtrace.drive_kvpress", press=None, positions="pipeline",
                  cache="pipeline"):
    """Drives kvpress over the export's schedule and writes a trace; returns a DriveResult.
    cache: "pipeline" (DynamicCache(), as kvpress's pipeline makes it: every layer keeps every
    token it is given, a sliding layer's window is the mask's, so the trace declares eviction
    "never") or "model" (DynamicCache(config=model.config), as a model called without a cache
    makes it: a Gemma 3 sliding layer keeps its window).
    press: press(prune_step, n) -> the press for a prune of an n-token prompt (default: the
    StreamingLLMPress, re-rotated or not, that the step asks for).
    positions: where later tokens sit: "pipeline" (the export's, as kvpress's pipeline places
    them), "generate" (the original index n + i even after a re-rotating prune, as
    model.generate() inside the press places them) or "seq_length" (the model's default
    without position_ids: cache.get_seq_length() + i, the compressed length)."""
    if positions not in ("pipeline", "generate", "seq_length"):
        raise UsageError("positions must be \"pipeline\", \"generate\" or \"seq_length\", got %r" % (positions,))
    make_press = press or _press
    if not isinstance(export, Export):
        raise TypeError("export must be a kvtrace.Export")
    exp = export
    layers = exp.dims["layers"]
    if cache not in ("pipeline", "model"):
        raise UsageError("cache must be \"pipeline\" or \"model\", got %r" % (cache,))
    if "kv_quant" in exp.manifest or exp.manifest.get("kv_dtype", "float32") != "float32":
        raise UsageError("kvpress is driven in float32 storage")
    steps = exp.steps
    for i, step in enumerate(steps):
        if step["op"] not in ("append", "decode", "prune", "crop", "reset"):
            raise UsageError("step %d (%s): not driven through kvpress" % (i, step["op"]))
        if step["op"] in ("append", "decode") and len({len(r["uids"]) for r in step["rows"]}) > 1:
            raise UsageError("rows of different lengths: kvpress prunes slots, so a row's padding would count as "
                             "its sinks")
        if step["op"] == "prune":
            starts = i > 0 and steps[i - 1]["op"] in ("append", "decode") and \
                all(r["indices"] and r["indices"][0] == 0 for r in steps[i - 1]["rows"])
            if not starts:
                raise UsageError("step %d prunes, but not right after a generation's first append: kvpress "
                                 "compresses only a forward that starts on an empty cache" % i)
    model = _Model(exp)
    result = DriveResult()
    fresh = (lambda: DynamicCache()) if cache == "pipeline" else (lambda: DynamicCache(config=model.model.config))
    windows = any(exp.layer_policy(l)["type"] != "full" for l in range(layers))
    eviction = "never" if windows and cache == "pipeline" else None
    with TraceWriter(trace_path, exp.name, producer, "cache-relative", "float32", eviction) as writer:
        kv, pruned = fresh(), None  # pruned: (first, end) of the pruned indices
        in_order, prompt = True, 0  # the kept prompt tokens in token order; the prompt's length
        prune_state = None
        for index, step in enumerate(steps):
            op = step["op"]
            if result.error is not None:
                writer.skip_step()
            elif op == "reset":
                kv, pruned = fresh(), None
                writer.skip_step()
            elif op == "prune":
                writer.step(prune_state)
            elif op == "crop":
                length = step["length"]
                if pruned is not None and length < prompt and not in_order:
                    raise UsageError("step %d crops to %d tokens, into the %d-token prompt the press pruned: "
                                     "DynamicCache.crop keeps a prefix of slots, and StreamingLLMPress leaves the kept "
                                     "tokens in score order (KeyRerotationPress sorts them), so no slot count is that "
                                     "crop" % (index, length, prompt))
                slots = length if pruned is None else length - min(max(length - pruned[0], 0), pruned[1] - pruned[0])
                try:
                    kv.crop(slots)
                except Exception as e:  # the cache failed: a finding, written into the trace
                    writer.error_step("%s: %s" % (type(e).__name__, e))
                    result.error, result.error_step = "%s: %s" % (type(e).__name__, e), index
                    continue
                if pruned is not None:  # the cut row's run of pruned tokens
                    pruned = None if length <= pruned[0] else (pruned[0], min(pruned[1], length))
                writer.step(_state(kv, layers))
            else:
                uids = np.array([r["uids"] for r in step["rows"]], dtype=np.int64)
                where = np.array([_one_position_list(r["query_positions"], index) for r in step["rows"]],
                                 dtype=np.int64)
                if positions == "generate":
                    where = np.array([r["indices"] for r in step["rows"]], dtype=np.int64)
                elif positions == "seq_length":
                    where = kv.get_seq_length() + np.zeros_like(where) + np.arange(uids.shape[1])
                following = steps[index + 1] if index + 1 < len(steps) else None
                try:
                    if following is not None and following["op"] == "prune":
                        n = uids.shape[1]
                        active = make_press(following, n)
                        with active(model.model):
                            outs = model.forward(uids, where, kv)
                        if following.get("select") == "observed":  # the press keeps its choice of m
                            pruned = (_kept(following, n), n)
                        else:
                            first = min(following["sinks"], n)
                            pruned = (first, min(max(n - following["recent"], first), n))
                        # ScorerPress keeps its tokens in topk order; KeyRerotationPress sorts them.
                        in_order, prompt = isinstance(active, kvpress.KeyRerotationPress), n
                        prune_state = _state(kv, layers)
                        recorded = [{"keys": model.before_press[l][0].double().numpy(),
                                     "values": model.before_press[l][1].double().numpy(), "out": outs[l]}
                                    for l in range(layers)]
                    else:
                        outs = model.forward(uids, where, kv)
                        recorded = [dict(s, out=o) for s, o in zip(_state(kv, layers), outs)]
                except UsageError:
                    raise
                except Exception as e:  # kvpress or the model failed: a finding, written into the trace
                    message = "%s: %s" % (type(e).__name__, e)
                    writer.error_step(message)
                    result.error, result.error_step = message, index
                    continue
                writer.step(recorded)
        result.recorded = sum(1 for s in writer.manifest["steps"] if "layers" in s)
    return result
