"""transformers' own cache classes, driven through tools/kvtrace.py by the README's recipes,
over every built-in fixture whose policy a class claims, each judged by `kvcheck verify`.
Prints one markdown row per (release, class, fixture): what `tools/kvcheck peers` tabulates
for docs/real-engines.md. Run in a release's venv (build/venvs/transformers-X.Y).

usage: python tools/peers/hf_caches.py [FIXTURE...]   (default: every fixture that fits)

The recipes are what a user writes (README, "A PyTorch cache"); tests/test_peer_transformers.py
drives the same ones."""

import glob
import json
import os
import shutil
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtrace  # noqa: E402
import peer_verdict  # noqa: E402

SCENARIOS = os.path.join(ROOT, "fixtures", "scenarios")


def release():
    import transformers
    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


def model_config(scenario):
    """Mistral's config at the scenario's dimensions, one layer type per policy (sliding or
    full): what DynamicCache(config=...) and StaticCache(config=...) build their layers from.
    With chunked layers (SPEC 10.2), Llama 4's text config: attention_chunk_size and
    layer_types "chunked_attention" / "full_attention"."""
    from transformers import MistralConfig
    dims, policy = scenario["dimensions"], scenario["policy"]
    policies = policy if isinstance(policy, list) else [policy] * dims["layers"]
    if any(p["type"] == "chunked" for p in policies):
        from transformers import Llama4TextConfig
        return Llama4TextConfig(hidden_size=dims["heads"] * dims["head_dim"], head_dim=dims["head_dim"],
                                num_attention_heads=dims["heads"],
                                num_key_value_heads=dims.get("kv_heads", dims["heads"]),
                                num_hidden_layers=dims["layers"],
                                attention_chunk_size=next(p["chunk"] for p in policies if p["type"] == "chunked"),
                                layer_types=["chunked_attention" if p["type"] == "chunked" else "full_attention"
                                             for p in policies])
    windows = {p["window"] for p in policies if p["type"] == "sliding"}
    config = MistralConfig(hidden_size=dims["heads"] * dims["head_dim"], num_attention_heads=dims["heads"],
                           num_key_value_heads=dims.get("kv_heads", dims["heads"]),
                           num_hidden_layers=dims["layers"], sliding_window=min(windows) if windows else None)
    if isinstance(policy, list):
        config.layer_types = ["sliding_attention" if p["type"] == "sliding" else "full_attention" for p in policies]
    return config


def dtype_of(scenario):
    import torch
    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[scenario.get("kv_dtype", "float32")]


def sink_cache(scenario):
    """SinkCache(window_length, num_sink_tokens), as generate() drives it: absolute positions,
    keys kept at cache-relative positions (4.42 to 4.52; 4.53 removed it)."""
    from transformers import SinkCache
    policy = scenario["policy"]
    return (lambda: SinkCache(policy["window"], policy["sinks"]),
            dict(positions="absolute", key_positions="cache-relative", as_tensor="torch"))


def sliding_window_cache(scenario, cls=None):
    """SlidingWindowCache(config, batch, max_cache_len, device, dtype) (4.42 to 4.57), made for
    each batch as generate() makes it, with the model's config (Mistral's), absolute positions
    and the cache's own cache_position mask. `cls`: a subclass to make instead (a test's
    recorder)."""
    from transformers.cache_utils import SlidingWindowCache  # 4.42 does not export it at the top level
    cls = cls or SlidingWindowCache
    config, dtype = model_config(scenario), dtype_of(scenario)
    # Positional: 4.42 names the batch max_batch_size, 4.46 batch_size.
    return (lambda batch: cls(config, batch, 64, "cpu", dtype), dict(positions="absolute", as_tensor="torch"))


def hybrid_cache(scenario):
    """HybridCache(config, batch, max_cache_len, device, dtype) (4.46 to 4.5x), made for each
    batch, with the config's sliding_window and, from 4.50 (Gemma 3), sliding_window_pattern
    (layer i slides unless (i + 1) % pattern == 0; 4.46 alternates, Gemma 2's), absolute
    positions and its cache_position mask."""
    from transformers.cache_utils import HybridCache
    config, dtype = model_config(scenario), dtype_of(scenario)
    policies = scenario["policy"]
    config.sliding_window_pattern = next(i for i, p in enumerate(policies) if p["type"] == "full") + 1
    config.head_dim = scenario["dimensions"]["head_dim"]
    return (lambda batch: HybridCache(config, batch, 64, "cpu", dtype), dict(positions="absolute", as_tensor="torch"))


def dynamic_cache(scenario):
    """DynamicCache(config=...) (5.x): a DynamicSlidingWindowLayer per sliding layer, a
    DynamicLayer per full one, as a model's generate() builds it. Only assisted generation
    crops, and it drives sliding and chunked layers (Llama 4's DynamicSlidingWindowLayer(C))
    in its own mode: generate() calls activate_past_recording() after the prefill, and each
    layer then keeps every token until a crop trims it back to W - 1. A scenario with crops is
    driven that way (the cache declared to never evict)."""
    from transformers import DynamicCache
    config = model_config(scenario)
    options = dict(positions="absolute", as_tensor="torch")
    policies = scenario["policy"] if isinstance(scenario["policy"], list) else [scenario["policy"]]
    if any(p.get("type") in ("sliding", "chunked") for p in policies) and \
            any(s["op"] == "crop" for s in scenario["steps"]):
        options.update(after_forward=lambda cache: cache.activate_past_recording(), eviction="never")
    return (lambda: DynamicCache(config=config), options)


def static_cache(scenario):
    """StaticCache(config=..., max_cache_len=N) (5.x, also SlidingWindowCache's replacement):
    a StaticSlidingWindowLayer per sliding layer, a StaticLayer per full one, made per batch."""
    from transformers import StaticCache
    config = model_config(scenario)
    return (lambda batch: StaticCache(config=config, max_cache_len=64), dict(positions="absolute", as_tensor="torch"))


def quantized_cache(scenario):
    """QuantizedCache(backend="quanto", config=..., nbits, q_group_size, residual_length) (5.x),
    as generate(cache_implementation="quantized", cache_config=...) builds it: one
    QuantoQuantizedLayer per layer, keys and values along axis 0 (SPEC 9.8's groups along
    head_dim). kvtrace reads its codes, scales and biases from the layers."""
    from transformers import QuantizedCache
    config = model_config(scenario)
    q = scenario["kv_quant"]
    k = q["k"]
    return (lambda: QuantizedCache(backend="quanto", config=config, nbits=k.get("bits", 4),
                                   q_group_size=k.get("scale", {}).get("group", 64), axis_key=0, axis_value=0,
                                   residual_length=q.get("residual", 0)),
            dict(positions="absolute", as_tensor="torch"))


def quantized_claims(scenario):
    """None when QuantizedCache (quanto) stores the scenario's kv_quant; else why not."""
    q = scenario.get("kv_quant")
    if not isinstance(q, dict) or "k" not in q or "v" not in q:
        return "not quantized keys and values in one format for every layer"
    if q["k"].get("format") != "quanto_affine" or q["k"] != q["v"]:
        return "not quanto_affine keys and values alike (one nbits and q_group_size)"
    if (q.get("flush"), q.get("prefill"), q.get("chunk_reads")) != ("requantize_all", "store", "raw"):
        return "not QuantizedLayer's residual rules (flush requantize_all, prefill store, chunk_reads raw)"
    policy = scenario["policy"]
    if any(p.get("type") != "full" for p in (policy if isinstance(policy, list) else [policy])):
        return "not full attention (QuantizedCache takes full_attention layers only)"
    if any(step["op"] in ("crop", "reorder") for step in scenario["steps"]):
        return "a crop or reorder (QuantizedLayer is not croppable; its reorder waits for the next update)"
    return None


def tokens(scenario):
    """The longest row's slots, padding included (what a preallocated buffer must hold)."""
    n = 0
    for step in scenario["steps"]:
        if step["op"] == "append":
            t = step["tokens"]
            n += max(t) if isinstance(t, list) else t
        elif step["op"] == "decode":
            n += step["steps"]
    return n


def claims(cls, scenario):
    """None when `cls` claims the scenario's policy; else why not (a reason starting "not
    judged" is printed as a row, the others are left out)."""
    policy = scenario.get("policy")
    if cls == "PagedAttentionCache":  # continuous batching: the paged fixtures (SPEC 8)
        if "paging" not in scenario:
            return "not paged"
        if "kv_quant" in scenario:
            return "quantized"
        if any(isinstance(p, dict) and p.get("type") not in ("full", "sliding")
               for p in (policy if isinstance(policy, list) else [policy])):
            return "not full or sliding layers"
        return None
    if cls == "QuantizedCache":
        return quantized_claims(scenario)
    if "kv_quant" in scenario or "paging" in scenario:
        return "quantized or paged"
    if any(step["op"] == "prune" for step in scenario["steps"]):
        return "a prune (SPEC 11): a press's, driven by kvpress_presses.py"
    if cls in ("DynamicCache", "StaticCache"):
        policies = policy if isinstance(policy, list) else [policy]
        if any(p.get("type") not in ("full", "sliding", "chunked") for p in policies):
            return "not a full, sliding or chunked policy"
        if len({p["window"] for p in policies if p["type"] == "sliding"}) > 1:
            return "sliding layers of different windows"
        chunked = any(p.get("type") == "chunked" for p in policies)
        if len({p["chunk"] for p in policies if p.get("type") == "chunked"}) > 1:
            return "chunked layers of different sizes (one attention_chunk_size)"
        if chunked and any(p.get("type") == "sliding" for p in policies):
            return "sliding and chunked layers in one stack"
        if chunked and cls == "StaticCache":
            return "chunked layers in a static buffer (not driven yet)"
        if cls == "StaticCache" and tokens(scenario) > 64:
            return "longer than the buffer"
        if cls == "StaticCache" and any(step["op"] == "crop" for step in scenario["steps"]):
            return ("not judged: a static layer's crop keeps the cropped slots, which the mask hides, and "
                    "kvtrace records the whole buffer")
        return None
    if cls == "HybridCache":
        if not isinstance(policy, list) or any(p.get("type") not in ("full", "sliding") for p in policy):
            return "not a stack of sliding and full layers"
        if len({p["window"] for p in policy if p["type"] == "sliding"}) != 1 or policy[0]["type"] != "sliding":
            return "not one window"
        pattern = next((i for i, p in enumerate(policy) if p["type"] == "full"), len(policy)) + 1
        if any((p["type"] == "sliding") != bool((i + 1) % pattern) for i, p in enumerate(policy)):
            return "not a periodic sliding_window_pattern"
        if release() < (4, 50) and pattern != 2:
            return "not Gemma 2's alternating layers (sliding_window_pattern is 4.50's)"
        if tokens(scenario) > 64:
            return "longer than the buffer"
        if any(step["op"] == "crop" and "expect_error" not in step for step in scenario["steps"]):
            return "not judged: HybridCache has no crop"
        return None
    if not isinstance(policy, dict):
        return "a policy per layer"
    if cls == "SinkCache":
        if policy.get("type") != "sink":
            return "not a sink policy"
        if policy.get("evict", 1) != 1 or policy.get("positions", "cache") != "cache" or \
                policy.get("prefill", "stream") == "dense":
            return "evicts in blocks, keeps original positions or prefills densely: not SinkCache's policy"
        return None
    return None if policy.get("type") == "sliding" else "not a sliding policy"


def recipes():
    """The classes this release ships, with their recipes."""
    found = {}
    if (4, 42) <= release() < (4, 53):
        found["SinkCache"] = sink_cache
    if (4, 42) <= release() < (5, 0):
        found["SlidingWindowCache"] = sliding_window_cache
    if (4, 46) <= release() < (5, 0):  # 4.46 alternates (Gemma 2); 4.50 reads sliding_window_pattern
        found["HybridCache"] = hybrid_cache
    if release() >= (5, 0):
        found["DynamicCache"] = dynamic_cache
        found["StaticCache"] = static_cache
        found["PagedAttentionCache"] = None  # continuous batching, through tools/kvtrace_hf_paged.py
        found["QuantizedCache"] = quantized_cache  # quanto's layers (SPEC 9.8)
    return found


def verdict(name, cls, recipe, work):
    path = os.path.join(SCENARIOS, name + ".json")
    if cls == "PagedAttentionCache":
        from kvtrace_hf_paged import ContinuousBatchingCache
        return peer_verdict.verdict(path, work, lambda exported, trace: kvtrace.drive_paged_cache(
            exported, lambda: ContinuousBatchingCache(exported), trace))
    make, options = recipe
    return peer_verdict.verdict(path, work,
                                lambda exported, trace: kvtrace.drive_hf_cache(exported, make, trace, **options))


def main(names):
    import transformers
    warnings.filterwarnings("ignore")
    fixtures = names or sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(SCENARIOS, "*.json")))
    for cls, make_recipe in recipes().items():
        for name in fixtures:
            with open(os.path.join(SCENARIOS, name + ".json")) as f:
                scenario = json.load(f)
            reason = claims(cls, scenario)
            if reason is not None:
                if reason.startswith("not judged"):
                    print("| transformers %s | `%s` | `%s` | %s |" % (transformers.__version__, cls, name, reason),
                          flush=True)
                continue
            work = tempfile.mkdtemp(prefix="kvcheck-peers-")
            try:
                text = verdict(name, cls, make_recipe(scenario) if make_recipe else None, work)
            finally:
                shutil.rmtree(work, True)
            print("| transformers %s | `%s` | `%s` | %s |" % (transformers.__version__, cls, name, text), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
