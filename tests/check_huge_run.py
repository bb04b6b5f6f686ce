#!/usr/bin/env python3
"""check_huge_run.py KVCHECK SCENARIO [PATTERN...]: a whole-model scenario
(fixtures/scenarios/huge) passes `kvcheck run` within kvcheck's memory budget: exit 0,
"passed, 0 failed", every PATTERN (a regular expression) in the report, and a peak resident
size under 8 GB (the child's, from getrusage). The time is printed and stated in
docs/performance.md, not asserted: timings belong to benchmarks."""
import re
import resource
import subprocess
import sys
import time

BUDGET_BYTES = 8e9  # kvcheck's memory budget (kMemoryBudget)


def main() -> int:
    kvcheck, scenario, patterns = sys.argv[1], sys.argv[2], sys.argv[3:]
    start = time.monotonic()
    run = subprocess.run([kvcheck, "run", scenario], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(run.stdout)
    print(f"peak resident size {peak / 1e9:.2f} GB, {seconds:.0f} s")
    failures = []
    if run.returncode != 0:
        failures.append(f"kvcheck run exited {run.returncode}")
    if "passed, 0 failed" not in run.stdout:
        failures.append("no 'passed, 0 failed'")
    failures += [f"output lacks /{p}/" for p in patterns if not re.search(p, run.stdout)]
    if peak >= BUDGET_BYTES:
        failures.append(f"peak resident size {peak / 1e9:.2f} GB, over 8 GB")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
