# Sourced after build.sh by tools/kvcheck (for `kvcheck llamacpp`) and tools/test, before
# the build: finds llama.cpp's libraries and the llama.h they were built from, and sets
# KVCHECK_CONFIGURE_ARGS so that kvcheck_build compiles an engine against that header.
# - By default: the prebuilt CPU libraries of the npm package @node-llama-cpp/linux-x64
#   (MIT) and, for their headers, the llama.cpp source that the package node-llama-cpp
#   ships of the same build (a git bundle; only include/llama.h and ggml/include are kept),
#   both into BUILD/llamacpp and checked against their published sha512.
# - With LLAMACPP_DIR (a folder holding libllama.so and libggml*.so of one's own build): its
#   headers from LLAMACPP_INCLUDE (folders, colon-separated), else found beside it (an
#   install prefix's include/, or the source a build tree was configured from); without them
#   kvcheck uses its own declarations, which know one llama.cpp version only.
# Nothing is committed or vendored; npm and git come from Debian when missing.
KVCHECK_LLAMACPP_PACKAGE="@node-llama-cpp/linux-x64@3.22.1"
KVCHECK_LLAMACPP_SHA512="5uCCDNqWCNfaAm8aR/Uzxbo4HBpKgNF91kCHPepKhgMgV2OAmatoefbOlMihsqCiH2Od35E/eUHQCFbfRBJuOg=="
KVCHECK_LLAMACPP_SOURCE_PACKAGE="node-llama-cpp@3.22.1"
KVCHECK_LLAMACPP_SOURCE_SHA512="bltIipuWmc123H7tMIgDGKSsSrhmhlQYeVUC48XTjVW7XGJJiJJyCdlTMzQ/LiWoPkGDpcL4FviDpgw7qfTiDw=="

# kvcheck_npm_unpack PACKAGE SHA512 DEST MEMBER: `npm pack`s PACKAGE, checks its sha512 and
# extracts MEMBER (a path under package/) into the new folder DEST; exits 2 on failure.
kvcheck_npm_unpack() {
  local package="$1" sha512="$2" dest="$3" member="$4"
  command -v npm >/dev/null 2>&1 || kvcheck_install_packages npm
  local tmp; tmp="$(mktemp -d "$(dirname "$dest")/.fetch-XXXXXX")"
  if ! (cd "$tmp" && npm pack --silent "$package" >npm.log 2>&1); then
    cat "$tmp/npm.log" >&2
    rm -rf "$tmp"
    echo "kvcheck: npm pack $package failed (see above); or set LLAMACPP_DIR to your own build" >&2
    exit 2
  fi
  local tgz sum
  tgz="$(ls "$tmp"/*.tgz)"
  sum="$(python3 -c 'import base64, hashlib, sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tgz")"
  if [ "$sum" != "$sha512" ]; then
    rm -rf "$tmp"
    echo "kvcheck: $package does not have the published sha512 (got $sum); refusing it" >&2
    exit 2
  fi
  if ! tar xzf "$tgz" -C "$tmp" "package/$member" 2>"$tmp/tar.log"; then
    cat "$tmp/tar.log" >&2
    rm -rf "$tmp"
    echo "kvcheck: $package has no package/$member (see above); refusing it" >&2
    exit 2
  fi
  rm -f "$tgz"
  rm -rf "$dest"
  mv "$tmp" "$dest"
}

# kvcheck_headers_beside LIBDIR: the header folders (;-separated) of the llama.cpp whose
# libraries are in LIBDIR, or nothing.
kvcheck_headers_beside() {
  local lib="$1"
  if [ -n "${LLAMACPP_INCLUDE:-}" ]; then
    local d out="" dirs=() llama_h=no ggml_h=no
    IFS=: read -ra dirs <<<"$LLAMACPP_INCLUDE"
    for d in "${dirs[@]}"; do
      if [ -z "$d" ] || [ ! -d "$d" ]; then
        echo "kvcheck: LLAMACPP_INCLUDE: '$d' is not a folder (expected the folders holding llama.h and ggml.h, colon-separated)" >&2
        exit 2
      fi
      out="${out:+$out;}$(cd "$d" && pwd)"
      [ -f "$d/llama.h" ] && llama_h=yes
      [ -f "$d/ggml.h" ] && ggml_h=yes
    done
    if [ $llama_h = no ] || [ $ggml_h = no ]; then
      echo "kvcheck: LLAMACPP_INCLUDE: $LLAMACPP_INCLUDE holds no $([ $llama_h = no ] && echo llama.h || echo ggml.h)" \
        "(expected the folders holding llama.h and ggml.h, colon-separated)" >&2
      exit 2
    fi
    echo "$out"
  elif [ -f "$lib/../include/llama.h" ] && [ -f "$lib/../include/ggml.h" ]; then  # an install prefix
    (cd "$lib/../include" && pwd)
  else  # a build tree's bin/: the source it was configured from, as its CMakeCache.txt says
    local src
    src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$lib/../CMakeCache.txt" 2>/dev/null || true)"
    if [ -n "$src" ] && [ -f "$src/include/llama.h" ] && [ -f "$src/ggml/include/ggml.h" ]; then
      echo "$src/include;$src/ggml/include"
    fi
  fi
}

# kvcheck_libllama_file LIBDIR: the libllama kvcheck loads from LIBDIR (libllama.so, else
# the last libllama.v*.so by name, as tools/llamacpp/llama_api.cpp picks it), resolved.
kvcheck_libllama_file() {
  local f found=""
  if [ -e "$1/libllama.so" ]; then found="$1/libllama.so"; else
    for f in "$1"/libllama.v*.so; do [ -e "$f" ] && found="$f"; done
  fi
  [ -n "$found" ] && readlink -f "$found"
}

# kvcheck_fetch_llamacpp BUILD_DIR
kvcheck_fetch_llamacpp() {
  local lib include stamp="" shipped=no
  if [ -n "${LLAMACPP_DIR:-}" ]; then
    # A folder that is not there: kvcheck says so with its own exit status; the build
    # folder's pairing is left as it is.
    [ -d "$LLAMACPP_DIR" ] || return 0
    lib="$(cd "$LLAMACPP_DIR" && pwd)"
    include="$(kvcheck_headers_beside "$lib")" || exit 2
    if [ -z "$include" ]; then
      echo "kvcheck: no llama.h found beside $lib: using kvcheck's own declarations (they know one llama.cpp" \
        "version; set LLAMACPP_INCLUDE to the folders holding llama.h and ggml.h to check another)" >&2
    fi
  else
    shipped=yes
    if [ -n "${LLAMACPP_INCLUDE:-}" ]; then
      echo "kvcheck: LLAMACPP_INCLUDE is read only with LLAMACPP_DIR (the shipped build brings its own llama.h)" >&2
    fi
    local dir="$1/llamacpp"
    mkdir -p "$dir"
    lib="$dir/package/bins/linux-x64"
    if [ ! -f "$lib/libllama.v0.5.0.so" ]; then
      echo "kvcheck: fetching llama.cpp ($KVCHECK_LLAMACPP_PACKAGE, about 11 MB) into $dir" >&2
      kvcheck_npm_unpack "$KVCHECK_LLAMACPP_PACKAGE" "$KVCHECK_LLAMACPP_SHA512" "$dir/.package" bins/linux-x64
      rm -rf "$dir/package"
      mv "$dir/.package/package" "$dir/package"
      rm -rf "$dir/.package"
    fi
    if [ ! -f "$dir/source/include/llama.h" ]; then
      echo "kvcheck: fetching its llama.h ($KVCHECK_LLAMACPP_SOURCE_PACKAGE, about 36 MB) into $dir/source" >&2
      command -v git >/dev/null 2>&1 || kvcheck_install_packages git
      kvcheck_npm_unpack "$KVCHECK_LLAMACPP_SOURCE_PACKAGE" "$KVCHECK_LLAMACPP_SOURCE_SHA512" "$dir/.source" \
        llama/gitRelease.bundle
      local src="$dir/.source"
      if ! { git clone -q --bare "$src/package/llama/gitRelease.bundle" "$src/git" &&
        mkdir "$src/tree" && git --git-dir="$src/git" archive HEAD include/llama.h ggml/include | tar x -C "$src/tree"; } \
        >"$src/git.log" 2>&1; then
        cat "$src/git.log" >&2
        rm -rf "$src"
        echo "kvcheck: could not unpack llama.cpp's source from $KVCHECK_LLAMACPP_SOURCE_PACKAGE (see above)" >&2
        exit 2
      fi
      rm -rf "$dir/source"
      mv "$src/tree" "$dir/source"
      rm -rf "$src"
    fi
    include="$dir/source/include;$dir/source/ggml/include"
  fi
  if [ -n "$include" ]; then
    local libllama; libllama="$(kvcheck_libllama_file "$lib")"
    if [ -n "$libllama" ]; then
      stamp="$(stat -c '%s:%Y' "$libllama")"
      # A source tree updated after its library was built: the header may describe
      # structures the library does not have.
      local header="${include%%;*}/llama.h"
      if [ $shipped = no ] && [ "$header" -nt "$libllama" ]; then
        echo "kvcheck: $header is newer than $libllama: the headers changed after the library was built;" \
          "rebuild llama.cpp (or name the library's own headers in LLAMACPP_INCLUDE)" >&2
        exit 2
      fi
    fi
  fi
  KVCHECK_CONFIGURE_ARGS=("-DKVCHECK_LLAMA_INCLUDE=$include" "-DKVCHECK_LLAMA_LIBRARY=${include:+$lib}"
    "-DKVCHECK_LLAMA_LIBRARY_STAMP=$stamp")
}
