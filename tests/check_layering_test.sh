#!/usr/bin/env bash
# check_layering.sh has teeth: on a copy of the code with one back-edge planted (a reader
# in io/ including the checker's report, two rooms up) and one file left outside the
# rooms, it must fail and name both; on the copy before planting, pass.
set -u
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tools"
cp -r "$root/reference" "$root/optimized" "$work/"
cp -r "$root/tools/harness" "$root/tools/zoo" "$root/tools/catalog" "$work/tools/"
if ! out=$("$root/tests/check_layering.sh" "$work"); then
  echo "FAIL: the unplanted copy already fails:"; echo "$out"; exit 1
fi
sed -i '1i #include "tools/harness/check/report.h"' "$work/tools/harness/io/npy.cpp"
touch "$work/tools/harness/loose.cpp"
out=$("$root/tests/check_layering.sh" "$work") && { echo "FAIL: a planted back-edge passed:"; echo "$out"; exit 1; }
for want in "tools/harness/io/ includes from the room above it, check/" "io/npy.cpp:1:" "tools/harness/loose.cpp"; do
  case $out in
    *"$want"*) ;;
    *) echo "FAIL: the report lacks \"$want\":"; echo "$out"; exit 1 ;;
  esac
done
echo "a planted back-edge (io/ -> check/) and a loose file are both refused"
