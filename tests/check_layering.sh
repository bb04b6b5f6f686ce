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
# The harness's rooms, lowest first: a room includes only its own and the rooms below it.
# io/ (files and errors) < scenario/ (the model) < run/ (the reference run) < check/ (the
# checker and its diagnosis) < sources/ (what feeds the checker: caches in process, traces)
# < outputs/ (exports, goldens, reports on disk).
rooms=(io scenario run check sources outputs)
for ((i = 0; i < ${#rooms[@]}; ++i)); do
  room=${rooms[$i]}
  [ -d "$root/tools/harness/$room" ] || { echo "FAIL: no room tools/harness/$room"; status=1; continue; }
  for ((j = i + 1; j < ${#rooms[@]}; ++j)); do
    bad=$(grep -rn "#include \"tools/harness/${rooms[$j]}/" "$root/tools/harness/$room")
    if [ -n "$bad" ]; then
      echo "FAIL: tools/harness/$room/ includes from the room above it, ${rooms[$j]}/:"; echo "$bad"; status=1
    fi
  done
done
# Every file of the harness lives in a room.
loose=$(find "$root/tools/harness" -maxdepth 1 -type f)
if [ -n "$loose" ]; then
  echo "FAIL: files of the harness outside its rooms:"; echo "$loose"; status=1
fi
[ $status -eq 0 ] && echo "reference/ and optimized/ include only themselves; the harness includes no zoo; its rooms include only themselves and the rooms below"
exit $status
