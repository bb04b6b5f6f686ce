#!/usr/bin/env bash
# run_c_repro.sh SOURCE LIB_DIR INCLUDE_DIRS [ARGS...]: compiles a standalone C reproduction
# of docs/findings/llamacpp/ against llama.cpp's headers (INCLUDE_DIRS, ':'-separated) and
# libraries (LIB_DIR), as its comment tells a reader to, then runs it with LIB_DIR and ARGS;
# exits with its status (3: it could not be built).
set -u
source=$1 lib=$2 includes=$3
shift 3
if [ ! -f "$lib/libllama.v0.5.0.so" ]; then
  echo "no llama.cpp libraries in $lib: tools/test fetches them (tools/setup/llamacpp.sh)"; exit 3
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=()
IFS=':' read -ra dirs <<<"$includes"
for dir in "${dirs[@]}"; do flags+=(-I "$dir"); done
if ! cc -std=c11 -O1 -Wall -Wextra -Werror "${flags[@]}" "$source" -o "$work/repro" -L "$lib" -l:libllama.v0.5.0.so \
    -l:libggml-base.so -l:libggml.v0.5.0.so -Wl,-rpath,"$lib" -lm; then
  echo "could not compile $source"; exit 3
fi
"$work/repro" "$lib" "$@"
