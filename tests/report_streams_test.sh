#!/usr/bin/env bash
# report_streams_test.sh KVCHECK SCENARIO: where a report goes when it is not a plain file.
# "-" is standard output's alone (it parses as JSON; the table goes to standard error); a
# link into /proc (as /dev/stdout is) with standard output redirected to a file gets the
# report after the table, the link left a link; a link to a regular file puts the report in
# the file it names, the link kept; two reports to "-" are refused (exit 2).
set -u
kv=$1
scenario=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$kv" run "$scenario" --json - 2>/dev/null | python3 -c 'import json, sys; json.load(sys.stdin)' ||
  fail "--json - did not give JSON alone on standard output"

ln -s /proc/self/fd/1 "$work/stdout"
"$kv" run "$scenario" --json "$work/stdout" >"$work/redirected" || fail "run --json LINK-TO-STDOUT exited $?"
[ -L "$work/stdout" ] || fail "the link to standard output was replaced by a file"
head -1 "$work/redirected" | grep -q '^scenario' || fail "the table is not first in the redirected file"
grep -q '"format": "kvcheck-report-1"' "$work/redirected" || fail "the report is not in the redirected file"

ln -s real.json "$work/link.json"
"$kv" run "$scenario" --json "$work/link.json" >/dev/null || fail "run --json LINK exited $?"
[ -L "$work/link.json" ] || fail "the link was replaced by a file"
grep -q '"format": "kvcheck-report-1"' "$work/real.json" || fail "the report is not in the file the link names"

"$kv" run "$scenario" --json - --junit - >/dev/null 2>"$work/err"
status=$?
[ "$status" = 2 ] || fail "two reports to - exited $status, expected 2"
grep -q 'only one report can go to standard output' "$work/err" || fail "two reports to -: $(cat "$work/err")"
echo "ok: reports to -, a link to standard output and a link to a file"
