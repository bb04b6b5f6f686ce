#!/usr/bin/env python3
"""Prints the ratios kvcheck's benchmarks are judged by, from one Google Benchmark JSON run
(medians of the repetitions, measured side by side): ratios.py BENCH.json"""

import json
import sys


def main(path):
    with open(path) as f:
        run = json.load(f)
    ctx = run["context"]
    caches = ", ".join("L%d %d KiB" % (c["level"], c["size"] // 1024) for c in ctx.get("caches", []) if c["type"] != "Instruction")
    print("machine: %d CPUs at %.0f MHz; caches %s; load %s" % (ctx["num_cpus"], ctx["mhz_per_cpu"], caches,
                                                                  ctx.get("load_avg", "?")))
    median = {}
    for b in run["benchmarks"]:
        if b.get("aggregate_name") == "median":
            median[b["run_name"]] = b["real_time"]
    if not median:  # one repetition: no aggregates
        median = {b["name"]: b["real_time"] for b in run["benchmarks"]}

    def ratio(label, numerator, denominator, goal):
        if numerator in median and denominator in median:
            r = median[numerator] / median[denominator]
            print("  %-58s %6.2fx   (goal %s)" % (label, r, goal))

    print("ratios (median real time):")
    ratio("reference decode, 1 thread / plain double dot, same size", "ReferenceDecode/1024/1/real_time",
          "PlainDot/1024", "<= 2")
    if "ReferenceDecode/1024/1/real_time" in median and "ReferenceDecode/1024/2/real_time" in median:
        r = median["ReferenceDecode/1024/1/real_time"] / median["ReferenceDecode/1024/2/real_time"]
        print("  %-58s %6.2fx   (goal >= 1.7)" % ("reference decode, 1 thread / 2 threads (speed-up)", r))
    for window in (1024, 4096):
        for cache in ("Sliding", "SinkShift", "SinkRing"):
            ratio("decode %s, W %d / reading K and V once" % (cache, window), "Decode%s/%d" % (cache, window),
                  "ReadKV/%d" % window, "near 1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
