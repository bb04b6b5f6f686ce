#!/usr/bin/env bash
# reference/ and optimized/ share no code: a bug in shared code would hide from every
# check. Each may include only itself (and system headers). The bug zoo stays out of the
# harness, so no real check can lean on a mutant.
set -u
root=$1 status=0
for dir in reference optimized; do
  bad=$(grep -rn '#include "' "$root/$dir" | grep -v "#include \"$dir/")
  if [ -n "$bad" ]; then
    echo "FAIL: $dir/ includes from elsewhere:"; echo "$bad"; status=1
  fi
done
# The harness knows neither the zoo nor the catalog; the zoo knows no catalog.
bad=$(grep -rn '#include "tools/\(zoo\|catalog\)/' "$root/tools/harness"; grep -rn '#include "tools/catalog/' "$root/tools/zoo")
if [ -n "$bad" ]; then
  echo "FAIL: the harness or the zoo includes what it must not:"; echo "$bad"; status=1
fi
[ $status -eq 0 ] && echo "reference/ and optimized/ include only themselves; the harness includes no zoo"
exit $status
