#!/usr/bin/env bash
# run.sh BUILD SECONDS: each fuzz target for SECONDS, from its seeds (the fixtures, the
# goldens' .npy files, tests/fuzz/seeds/) and what earlier runs found. A crash stops with
# the input that caused it: add it to tests/bad_inputs/files/ and a case to the corpus.
set -u
build=$1 seconds=$2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
status=0
for target in scenario npy trace; do
  corpus="$build/corpus-$target"
  mkdir -p "$corpus"
  case $target in
    scenario) cp -n "$root"/fixtures/scenarios/*.json "$root"/tests/data/*.json "$corpus"/ ;;
    npy) for g in "$root"/fixtures/golden/*/; do cp -n "$g/k.npy" "$corpus/$(basename "$g").npy"; done ;;
    trace) cp -n "$root"/tests/fuzz/seeds/trace/* "$corpus"/ ;;
  esac
  echo "fuzz_$target: $seconds s"
  ( cd "$build" && "tests/fuzz/fuzz_$target" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="$build/crash-$target-" 2>&1 ) >"$build/fuzz-$target.log"
  rc=$?
  grep -E "^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)" "$build/fuzz-$target.log"
  if [ $rc -ne 0 ]; then
    status=1
    echo "fuzz_$target FOUND A CRASH (log: $build/fuzz-$target.log):"
    grep -E "ERROR|SUMMARY|Test unit written" "$build/fuzz-$target.log" | head -5
  fi
done
exit $status
