#!/usr/bin/env bash
# JUnit for CI: one <failure> per failing case, counts that add up, and a scenario that
# fails to load reported as a failing case (not a green report).
set -u
kvcheck=$1 scenarios=$2 data=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$kvcheck" run --cache zoo/layout_swapped "$scenarios/sliding_baseline.json" "$scenarios/interleaved_sink.json" \
  --junit "$work/zoo.xml" >/dev/null
[ $? -eq 1 ] || { echo "FAIL: a failing run should exit 1"; exit 1; }
cases=$(grep -c "<testcase" "$work/zoo.xml")
failures=$(grep -c "<failure" "$work/zoo.xml")
grep -q "tests=\"$cases\" failures=\"$failures\"" "$work/zoo.xml" || { cat "$work/zoo.xml"; echo "FAIL: counts"; exit 1; }
[ "$cases" -eq 2 ] && [ "$failures" -eq 2 ] || { cat "$work/zoo.xml"; echo "FAIL: expected 2 failing cases"; exit 1; }

"$kvcheck" run "$data/bad_typo.json" "$scenarios/full_baseline.json" --junit "$work/bad.xml" >/dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL: bad input should exit 2"; exit 1; }
grep -q 'classname="kvcheck.input" name="bad_typo"' "$work/bad.xml" || { cat "$work/bad.xml"; echo "FAIL: load error missing"; exit 1; }
grep -q 'failures="1"' "$work/bad.xml" || { cat "$work/bad.xml"; echo "FAIL: load error not counted"; exit 1; }
echo "JUnit: one failure per case, load errors counted"
