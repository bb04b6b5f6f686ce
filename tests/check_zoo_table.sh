#!/usr/bin/env bash
# docs/caches.md's table of the bug zoo is what `kvcheck zoo --table` prints from the zoo's
# own list: a mutant added, renamed or re-described fails here until the table is regenerated.
# Usage: check_zoo_table.sh ROOT KVCHECK_BIN
set -u
root=$1 bin=$2
want=$(sed -n '/<!-- kvcheck zoo --table: begin -->/,/<!-- kvcheck zoo --table: end -->/p' "$root/docs/caches.md" | sed '1d;$d')
got=$("$bin" zoo --table) || { echo "FAIL: $bin zoo --table failed"; exit 1; }
if [ -z "$want" ]; then
  echo "FAIL: docs/caches.md has no table between the 'kvcheck zoo --table' markers"; exit 1
fi
if [ "$got" != "$want" ]; then
  echo "FAIL: docs/caches.md's zoo table is not the zoo's list; regenerate it with"
  echo "tools/kvcheck zoo --table (between the 'kvcheck zoo --table' markers). Difference (docs, then now):"
  diff <(echo "$want") <(echo "$got")
  exit 1
fi
echo "the table of $(echo "$got" | tail -n +3 | wc -l) mutants matches"
