#!/usr/bin/env bash
# expect_exit.sh STATUS PATTERN [PATTERN...] -- COMMAND...: runs COMMAND, passes when it
# exits with STATUS and its stdout+stderr contains every PATTERN (grep -E patterns).
set -u
want=$1
shift
patterns=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  patterns+=("$1")
  shift
done
shift
out=$("$@" 2>&1)
got=$?
echo "$out"
if [ "$got" != "$want" ]; then echo "FAIL: exit status $got, expected $want"; exit 1; fi
for pattern in "${patterns[@]}"; do
  if ! grep -qE -- "$pattern" <<<"$out"; then echo "FAIL: output lacks /$pattern/"; exit 1; fi
done
