#!/usr/bin/env bash
# reference/ and optimized/ share no code: a bug in shared code would hide from every
# check. Each may include only itself (and system headers).
set -u
root=$1 status=0
for dir in reference optimized; do
  bad=$(grep -rn '#include "' "$root/$dir" | grep -v "#include \"$dir/")
  if [ -n "$bad" ]; then
    echo "FAIL: $dir/ includes from elsewhere:"; echo "$bad"; status=1
  fi
done
[ $status -eq 0 ] && echo "reference/ and optimized/ include only themselves"
exit $status
