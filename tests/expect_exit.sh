#!/usr/bin/env bash
# expect_exit.sh STATUS PATTERN -- COMMAND...: runs COMMAND, passes when it exits with
# STATUS and its stdout+stderr contains PATTERN (a grep -E pattern).
set -u
want=$1 pattern=$2
shift 3
out=$("$@" 2>&1)
got=$?
echo "$out"
if [ "$got" != "$want" ]; then echo "FAIL: exit status $got, expected $want"; exit 1; fi
if ! grep -qE -- "$pattern" <<<"$out"; then echo "FAIL: output lacks /$pattern/"; exit 1; fi
