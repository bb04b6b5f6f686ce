#!/usr/bin/env bash
# llamacpp_touched_library.sh ENGINE LIBDIR SCENARIO: runs the header-built engine on a copy
# of LIBDIR whose libllama has another mtime (as a rebuild in place gives it); its exit
# status and output are the engine's.
set -u
engine=$1 lib=$2 scenario=$3
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cp -a "$lib"/. "$d"/
for f in "$d"/libllama*.so; do touch -d 2001-01-01 "$f"; done
"$engine" --lib "$d" --scenario "$scenario" --out "$d/out"
