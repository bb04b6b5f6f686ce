"""kvpress's presses (StreamingLLMPress, and KeyRerotationPress around it) on a tiny
transformers Llama, driven through tools/kvtrace_kvpress.py as kvpress's pipeline runs them,
over every built-in fixture with a prune (SPEC 11), each judged by `kvcheck verify`. A second
row per re-rotating fixture places later tokens as `model.generate()` inside the press does
(kvpress's README offers it), which is what a user who generates that way gets; a fixture
with sliding layers runs on a tiny Gemma 3 with the pipeline's cache and with the one the
model makes from its config. The score-based press `KnormPress` (SPEC 11.1's observed prune)
runs the same way on the scenarios of tests/data that ask for one (`prune_observed_*`: no
kvcheck cache serves them, so they are not fixtures). Prints one markdown row each for
`tools/kvcheck peers`. Run in the venv build/venvs/kvpress.

usage: python tools/peers/kvpress_presses.py [FIXTURE...]   (default: every fixture with a prune)"""

import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_verdict  # noqa: E402


def main(names):
    import kvpress
    import transformers
    import kvtrace_kvpress
    warnings.filterwarnings("ignore")
    release = "kvpress %s (transformers %s)" % (kvpress.__version__ if hasattr(kvpress, "__version__")
                                                else _version("kvpress"), transformers.__version__)
    for folder, name, scenario in peer_verdict.fixtures(with_observed_prunes=True):
        prunes = [s for s in scenario["steps"] if s["op"] == "prune"]
        if (names and name not in names) or not prunes:
            continue
        rerotates = any(s.get("rerotate") for s in prunes)
        scorer = "KnormPress" if any(s.get("select") == "observed" for s in prunes) else "StreamingLLMPress"
        press = "`KeyRerotationPress(%s)`" % scorer if rerotates else "`%s`" % scorer
        runs = [(press + ", pipeline's positions", {})]
        if rerotates:
            runs.append((press + ", `generate()`'s positions", {"positions": "generate"}))
        policies = scenario["policy"] if isinstance(scenario["policy"], list) else [scenario["policy"]]
        if any(p["type"] != "full" for p in policies):  # Gemma 3: the pipeline's cache, then the model's
            runs = [(press + ", the pipeline's `DynamicCache()`", {}),
                    (press + ", `DynamicCache(config=model.config)`", {"cache": "model"})]
        for what, options in runs:
            work = tempfile.mkdtemp(prefix="kvcheck-peers-")
            try:
                text = peer_verdict.verdict(
                    os.path.join(folder, name + ".json"), work,
                    lambda exported, trace: kvtrace_kvpress.drive_kvpress(exported, trace, **options))
            finally:
                shutil.rmtree(work, True)
            print("| %s | %s | `%s` | %s |" % (release, what, name, text), flush=True)


def _version(package):
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    main(sys.argv[1:])
