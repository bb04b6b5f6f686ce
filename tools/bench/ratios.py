#!/usr/bin/env python3
"""Prints the ratios kvcheck's benchmarks are judged by, from one Google Benchmark JSON run
(medians of the repetitions, measured side by side in that run): ratios.py BENCH.json"""

import json
import sys

CACHES = ("dynamic", "static", "sliding", "sink_shift", "sink_ring")
WINDOWS = (1024, 4096, 32768)
THREADS = (1, 2)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load(path):
    with open(path) as f:
        run = json.load(f)
    median = {}
    for b in run["benchmarks"]:
        if b.get("aggregate_name") == "median":
            median[b["run_name"]] = b["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    if not median:  # one repetition: no aggregates
        for b in run["benchmarks"]:
            median[b["name"]] = b["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return run["context"], median


def find(median, prefix):
    """The median of the benchmark whose name starts with prefix (Google Benchmark appends
    /real_time and /iterations:N to the names we register)."""
    for name, t in median.items():
        if name == prefix or name.startswith(prefix + "/"):
            return t
    return None


def main(path):
    ctx, median = load(path)
    caches = ", ".join("L%d %d KiB" % (c["level"], c["size"] // 1024) for c in ctx.get("caches", [])
                       if c["type"] != "Instruction")
    reps = ctx.get("repetitions") or "?"
    print("machine: %s, %d CPUs at %.0f MHz; caches %s; load %s" % (
        cpu_model(), ctx["num_cpus"], ctx["mhz_per_cpu"], caches, ctx.get("load_avg", "?")))
    print("every figure is a median real time over the repetitions of one run")
    goals = []

    def goal(label, value, met, target):
        goals.append((label, value, met, target))

    floor = {(w, t): find(median, "ReadKV/W%d/t%d" % (w, t)) for w in WINDOWS for t in THREADS}
    if any(floor.values()):
        print("\ndecode step (update plus attention) / reading the same K and V once, D 128, 8 kv heads")
        header = "  %-11s %-4s" % ("cache", "H") + "".join("  W %-5d 1t   2t " % w for w in WINDOWS)
        print(header)
        for heads in (32, 8):
            for cache in CACHES:
                cells = []
                for w in WINDOWS:
                    for t in THREADS:
                        x = find(median, "Decode/%s/H%d/W%d/t%d" % (cache, heads, w, t))
                        cells.append("%6.2fx" % (x / floor[(w, t)]) if x and floor[(w, t)] else "     - ")
                print("  %-11s %-4d" % (cache, heads) + "".join(
                    "  %s%s " % (cells[2 * i], cells[2 * i + 1]) for i in range(len(WINDOWS))))
        print("  floor (ReadKV): " + ", ".join(
            "W %d %s" % (w, " / ".join("%.0f us" % (floor[(w, t)] * 1e6) for t in THREADS if floor[(w, t)]))
            for w in WINDOWS if floor[(w, 1)]))

        for w in (4096, 32768):
            for t in THREADS:
                limit = 1.5 if t == 1 else 2.0
                worst = None
                for cache in CACHES:
                    if cache == "sink_shift":
                        continue
                    x = find(median, "Decode/%s/H32/W%d/t%d" % (cache, w, t))
                    if x and floor[(w, t)]:
                        r = x / floor[(w, t)]
                        worst = max(worst or (0, ""), (r, cache))
                if worst:
                    goal("decode H 32, W %d, %d thread%s: slowest cache but sink_shift / floor (%s)" % (
                        w, t, "s" if t > 1 else "", worst[1]), "%.2fx" % worst[0], worst[0] <= limit, "<= %g" % limit)
        for w in (4096, 32768):
            for heads in (32, 8):
                for t in THREADS:
                    ring = find(median, "Decode/sink_ring/H%d/W%d/t%d" % (heads, w, t))
                    shift = find(median, "Decode/sink_shift/H%d/W%d/t%d" % (heads, w, t))
                    if ring and shift:
                        goal("sink_shift time / sink_ring time, H %d, W %d, %dt" % (heads, w, t), "%.2fx" % (shift / ring),
                             shift / ring >= 3.0, ">= 3")
        for w in WINDOWS:
            for heads in (32, 8):
                for t in THREADS:
                    sliding = find(median, "Decode/sliding/H%d/W%d/t%d" % (heads, w, t))
                    static = find(median, "Decode/static/H%d/W%d/t%d" % (heads, w, t))
                    if sliding and static:
                        goal("static time / sliding time, H %d, W %d, %dt" % (heads, w, t), "%.2fx" % (static / sliding),
                             static / sliding >= 1.0, ">= 1.0")
    quant = [(f, w, t) for f in ("q8_0", "fp8_e4m3") for w in (4096, 32768) for t in THREADS
             if find(median, "DecodeQuant/%s/H32/W%d/t%d" % (f, w, t))]
    if quant:
        print("\nquantized decode (SPEC 9), dynamic cache, H 32, D 128, 8 kv heads: time / float32's, time / its byte floor")
        for f, w, t in quant:
            x = find(median, "DecodeQuant/%s/H32/W%d/t%d" % (f, w, t))
            f32 = find(median, "Decode/dynamic/H32/W%d/t%d" % (w, t))
            own = find(median, "ReadKVQuant/%s/W%d/t%d" % (f, w, t))
            print("  %-9s W %-6d %dt  %8.0f us  %5.2fx float32  %5.2fx floor" % (
                f, w, t, x * 1e6, x / f32 if f32 else float("nan"), x / own if own else float("nan")))
        for f in ("q8_0", "fp8_e4m3"):
            x = find(median, "DecodeQuant/%s/H32/W32768/t2" % f)
            f32 = find(median, "Decode/dynamic/H32/W32768/t2")
            own = find(median, "ReadKVQuant/%s/W32768/t2" % f)
            if x and f32:
                goal("%s decode / float32 decode, H 32, W 32768, 2t" % f, "%.2fx" % (x / f32), x / f32 <= 0.6, "<= 0.6")
            if x and own:
                goal("%s decode / its byte floor, H 32, W 32768, 2t" % f, "%.2fx" % (x / own), x / own <= 2.0, "<= 2")
    contiguous = {"full": "dynamic", "sliding": "sliding", "sink": "sink_ring"}  # the same policy, unpaged
    paged = [(p, w, t) for p in contiguous for w in (4096, 32768) for t in THREADS
             if find(median, "DecodePaged/%s/H32/W%d/t%d" % (p, w, t))]
    if paged:
        print("\npaged decode (SPEC 8, blocks of 16), H 32, D 128, 8 kv heads: time / the contiguous cache of the policy")
        for p, w, t in paged:
            x = find(median, "DecodePaged/%s/H32/W%d/t%d" % (p, w, t))
            base = find(median, "Decode/%s/H32/W%d/t%d" % (contiguous[p], w, t))
            print("  %-8s W %-6d %dt  %8.0f us  %5.2fx %s" % (p, w, t, x * 1e6, x / base if base else float("nan"),
                                                           contiguous[p]))
        for p in contiguous:
            x = find(median, "DecodePaged/%s/H32/W32768/t2" % p)
            base = find(median, "Decode/%s/H32/W32768/t2" % contiguous[p])
            if x and base:
                goal("paged %s decode / %s decode, H 32, W 32768, B 16, 2t" % (p, contiguous[p]),
                     "%.2fx" % (x / base), x / base <= 1.15, "<= 1.15")
    for t in THREADS:
        ring = find(median, "Prefill/sink_ring/H32/t%d" % t)
        dense = find(median, "Prefill/dynamic/H32/t%d" % t)
        if ring and dense:
            print("\nprefill of 4096 tokens in chunks of 512, H 32, %d thread%s: dynamic %.2f s, sink_ring %.2f s" % (
                t, "s" if t > 1 else "", dense, ring))
            goal("prefill sink_ring / dynamic, %dt" % t, "%.2fx" % (ring / dense), ring / dense <= 1.5, "<= 1.5")

    ref1, ref2 = find(median, "ReferenceDecode/1024/1"), find(median, "ReferenceDecode/1024/2")
    dot = find(median, "PlainDot/1024")
    if ref1 and dot:
        goal("reference decode, 1 thread / plain double dot, same size", "%.2fx" % (ref1 / dot), ref1 / dot <= 2, "<= 2")
    if ref1 and ref2:
        goal("reference decode, 1 thread / 2 threads (speed-up)", "%.2fx" % (ref1 / ref2), ref1 / ref2 >= 1.7, ">= 1.7")

    if goals:
        print("\ngoals:")
        for label, value, met, target in goals:
            print("  %-74s %7s  (goal %s) %s" % (label, value, target, "met" if met else "MISSED"))
        missed = sum(1 for g in goals if not g[2])
        print("%d of %d goals met" % (len(goals) - missed, len(goals)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
