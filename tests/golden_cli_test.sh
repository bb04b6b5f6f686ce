#!/usr/bin/env bash
# golden generate: byte-identical reruns, refusal to overwrite a changed golden without
# --force (leaving it as it was), and the report of what changed.
set -eu
kvcheck=$1 scenarios=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A temporary folder left by a killed run (its pid is gone) is cleared by the next run.
mkdir -p "$work/.a.tmp-999999999/junk"
"$kvcheck" golden generate "$scenarios" --out "$work/a" >/dev/null
"$kvcheck" golden generate "$scenarios" --out "$work/b" >/dev/null
diff -r "$work/a" "$work/b" || { echo "FAIL: two runs differ"; exit 1; }
[ ! -e "$work/.a.tmp-999999999" ] || { echo "FAIL: a killed run's temporary folder is still there"; exit 1; }

# Tamper with one output: a rerun must refuse, say which step changed, and write nothing.
golden="$work/a/sink_decode_through_windows"
cp "$work/a/full_baseline/step000_out.npy" "$golden/step005_out.npy"
cp "$golden/step005_out.npy" "$work/tampered.npy"
if out=$("$kvcheck" golden generate "$scenarios" --out "$work/a" 2>&1); then
  echo "$out"; echo "FAIL: a changed golden was overwritten without --force"; exit 1
fi
echo "$out"
grep -q "sink_decode_through_windows: changed (not overwritten)" <<<"$out" || { echo "FAIL: no change report"; exit 1; }
grep -q "step005_out.npy" <<<"$out" || { echo "FAIL: the changed step is not named"; exit 1; }
cmp -s "$golden/step005_out.npy" "$work/tampered.npy" || { echo "FAIL: the golden was modified"; exit 1; }

"$kvcheck" golden generate "$scenarios" --out "$work/a" --force >/dev/null
diff -r "$work/a" "$work/b" || { echo "FAIL: --force did not restore the golden"; exit 1; }
echo "golden generate: deterministic, refuses silent overwrites"
