"""One (engine, class, fixture) verdict for the peers table (`tools/kvcheck peers`): the
fixture exported, driven through one of kvtrace's drivers, judged by `kvcheck verify`, and
said in a few words. Shared by hf_caches.py, mlx_caches.py and ort_gqa.py."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kvtrace  # noqa: E402

SCENARIOS = os.path.join(ROOT, "fixtures", "scenarios")
DATA = os.path.join(ROOT, "tests", "data")


def kvcheck(*args):
    binary = os.environ.get("KVCHECK_BIN", os.path.join(ROOT, "build", "kvcheck"))
    return subprocess.run([binary, *args], capture_output=True, text=True)


def fixtures(with_observed_prunes=False):
    """Every built-in fixture, by name and parsed JSON, in name order. With
    with_observed_prunes: (folder, name, JSON), the fixtures and then tests/data's scenarios
    of an observed prune (SPEC 11.1, which only a real engine serves)."""
    import json
    out = []
    folders = [SCENARIOS] + ([DATA] if with_observed_prunes else [])
    for folder in folders:
        names = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json"))
        for name in names:
            if folder == DATA and not name.startswith("prune_observed_"):
                continue
            with open(os.path.join(folder, name + ".json")) as f:
                scenario = json.load(f)
            out.append((folder, name, scenario) if with_observed_prunes else (name, scenario))
    return out


def uneven_rows(scenario):
    """A step that left-pads rows (per-row token counts that differ) or reorders them."""
    return any(step["op"] == "reorder" or
               (step["op"] == "append" and isinstance(step["tokens"], list) and len(set(step["tokens"])) > 1)
               for step in scenario["steps"])


def verdict(path, work, drive):
    """`drive(export, trace_path)` runs a kvtrace driver and returns its DriveResult."""
    exported, trace = os.path.join(work, "export"), os.path.join(work, "trace")
    done = kvcheck("export", path, "--out", exported)
    if done.returncode != 0:
        return "export failed: " + done.stderr.strip()[:120]
    try:
        result = drive(kvtrace.Export(exported), trace)
    except kvtrace.UsageError as e:
        return "not driven: " + str(e).split(", but")[0].split(": transformers")[0]
    report = kvcheck("verify", path, "--trace", trace)
    served = re.search(r"but (step \d+) \(crop, [^)]*\) was served", report.stdout)
    if report.returncode == 0 and served:
        return "pass; served the crop the policy refuses at %s (the later steps not judged)" % served.group(1)
    if report.returncode == 0 and result.skipped:
        step, why = result.skipped[0]
        steps = "step %d" % step if len(result.skipped) == 1 else "the steps from %d" % step
        return "pass; %s skipped (%s)" % (steps, why)
    if report.returncode == 0:
        return "pass"
    if report.returncode != 1:
        return "verify failed (exit %d): %s" % (report.returncode, report.stderr.strip()[:160])
    lines = report.stdout.splitlines()
    first = next((l for l in lines if l.startswith("first divergence: ")), "")
    named = next((l[len("class: "):] for l in lines if l.startswith("class: ")), "")
    step = re.match(r"first divergence: (step \d+) \((\w+)", first)
    text = "%s at %s" % (named or "fails", "%s (%s)" % step.groups() if step else "?")
    if result.error is not None and not named.startswith("the cache raised"):
        text += "; raised at step %d" % result.error_step
    return text
