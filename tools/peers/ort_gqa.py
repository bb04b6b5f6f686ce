"""ONNX Runtime's GroupQueryAttention (com.microsoft, CPU), one node per layer, driven
through tools/kvtrace_ort.py as an exported model runs it (the caller keeps a growing past;
a sliding window is the op's local_window_size), over every built-in fixture whose policies
it has (full and sliding layers) at shapes and storage its CPU kernel takes (claims()), each
judged by `kvcheck verify`. Prints one markdown row per fixture for `tools/kvcheck peers`. Run in a release's venv (build/venvs/onnxruntime-X.Y).

usage: python tools/peers/ort_gqa.py [FIXTURE...]   (default: every fixture that fits)"""

import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_verdict  # noqa: E402
from peer_verdict import kvtrace  # noqa: E402


def claims(scenario, quantized_kv):
    """Whether the op has every layer's policy (full, or sliding without a shift) and the
    scenario's shapes and storage: the CPU kernel wants head_dim and rotary dims in multiples
    of 16, float32 or (1.31) int8_even or int4_even KV, one format for K and V, quantized as written."""
    policy = scenario["policy"]
    policies = policy if isinstance(policy, list) else [policy]
    ropes = scenario.get("rope") if isinstance(scenario.get("rope"), list) else [scenario.get("rope") or {}]
    d = scenario["dimensions"]["head_dim"]
    quant = scenario.get("kv_quant")
    formats = {quant.get(t, {}).get("format") for t in ("k", "v")} if isinstance(quant, dict) else set()
    even = isinstance(quant, dict) and quant.get("residual", 0) == 0 and len(formats) == 1 and \
        formats <= {"int8_even", "int4_even"}  # one format for K and V alike
    return ("paging" not in scenario and all(step["op"] != "prune" for step in scenario["steps"]) and scenario.get("kv_dtype", "float32") == "float32" and d % 16 == 0 and
            all(r is None or r.get("rotary_dim", d) % 16 == 0 for r in ropes) and
            (quant is None or (quantized_kv and even)) and
            all(p.get("type") == "full" or (p.get("type") == "sliding" and "shift_with" not in p) for p in policies))


def main(names):
    import onnxruntime
    import kvtrace_ort
    warnings.filterwarnings("ignore")
    release = "onnxruntime %s" % onnxruntime.__version__
    for name, scenario in peer_verdict.fixtures():
        if (names and name not in names) or not claims(scenario, kvtrace_ort.has_quantized_kv()):
            continue
        work = tempfile.mkdtemp(prefix="kvcheck-peers-")
        try:
            text = peer_verdict.verdict(os.path.join(peer_verdict.SCENARIOS, name + ".json"), work,
                                        lambda exported, trace: kvtrace_ort.drive_ort_gqa(exported, trace))
        finally:
            shutil.rmtree(work, True)
        print("| %s | `GroupQueryAttention` | `%s` | %s |" % (release, name, text), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
