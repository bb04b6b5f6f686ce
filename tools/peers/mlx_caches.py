"""mlx-lm's own caches, driven through tools/kvtrace_mlx.py as mlx-lm's models drive them,
over every built-in fixture whose policies a cache fits, each judged by `kvcheck verify`.
Prints one markdown row per fixture: what `tools/kvcheck peers` tabulates for
docs/real-engines.md. Run in the venv build/venvs/mlx.

usage: python tools/peers/mlx_caches.py [FIXTURE...]   (default: every fixture that fits)

A layer's cache is the one mlx-lm's models make for its policy: KVCache for full attention,
RotatingKVCache(max_size=W) for a sliding window (llama.py, gemma3_text.py),
RotatingKVCache(max_size=W, keep=S) for StreamingLLM's sinks at original positions (mlx-lm
never re-rotates a key), ChunkedKVCache(C) for chunked attention (llama4.py)."""

import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_verdict  # noqa: E402
from peer_verdict import kvtrace  # noqa: E402


def layer_cache(policy):
    """(class name, factory) for one layer's policy; None when mlx-lm has no cache for it."""
    from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache
    kind = policy.get("type")
    if kind == "full":
        return "KVCache", KVCache
    if kind == "sliding" and "shift_with" not in policy:
        return "RotatingKVCache(%d)" % policy["window"], lambda: RotatingKVCache(max_size=policy["window"])
    if kind == "chunked":
        return "ChunkedKVCache(%d)" % policy["chunk"], lambda: ChunkedKVCache(policy["chunk"])
    if kind == "sink" and policy.get("positions") == "original" and policy.get("evict", 1) == 1 and \
            policy.get("prefill", "streaming") == "streaming":
        keep, size = policy["sinks"], policy["window"]
        return "RotatingKVCache(%d, keep=%d)" % (size, keep), lambda: RotatingKVCache(max_size=size, keep=keep)
    return None


def recipe(scenario):
    """(the classes in words, make_cache) when every layer has an mlx-lm cache; else None."""
    layers = scenario["dimensions"]["layers"]
    policy = scenario["policy"]
    policies = policy if isinstance(policy, list) else [policy] * layers
    made = [layer_cache(p) for p in policies]
    # Left out: mlx-lm pads and reorders rows with BatchKVCache (not driven), and its
    # QuantizedKVCache has no SPEC 9 format row yet.
    if any(m is None for m in made) or "kv_quant" in scenario or "paging" in scenario or \
            any(step["op"] == "prune" for step in scenario["steps"]) or \
            peer_verdict.uneven_rows(scenario):
        return None
    names = []
    for name, _ in made:
        if name not in names:
            names.append(name)
    return " + ".join(names), lambda: [make() for _, make in made]


def main(names):
    import mlx_lm
    warnings.filterwarnings("ignore")
    release = "mlx-lm %s" % mlx_lm.__version__
    for name, scenario in peer_verdict.fixtures():
        if names and name not in names:
            continue
        found = recipe(scenario)
        if found is None:
            continue
        classes, make = found
        work = tempfile.mkdtemp(prefix="kvcheck-peers-")
        try:
            text = peer_verdict.verdict(os.path.join(peer_verdict.SCENARIOS, name + ".json"), work,
                                        lambda exported, trace: kvtrace.drive_mlx_cache(exported, make, trace))
        finally:
            shutil.rmtree(work, True)
        print("| %s | `%s` | `%s` | %s |" % (release, classes, name, text), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
