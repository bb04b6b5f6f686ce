# Sourced after build.sh by tools/kvcheck (for `kvcheck llamacpp`) and tools/test: fetches
# llama.cpp's prebuilt CPU libraries, the npm package @node-llama-cpp/linux-x64 (MIT), into
# BUILD/llamacpp, checked against its published sha512, unless LLAMACPP_DIR names a build
# of one's own. Nothing is committed or vendored; npm comes from Debian when missing.
KVCHECK_LLAMACPP_PACKAGE="@node-llama-cpp/linux-x64@3.22.1"
KVCHECK_LLAMACPP_SHA512="5uCCDNqWCNfaAm8aR/Uzxbo4HBpKgNF91kCHPepKhgMgV2OAmatoefbOlMihsqCiH2Od35E/eUHQCFbfRBJuOg=="

# kvcheck_fetch_llamacpp BUILD_DIR
kvcheck_fetch_llamacpp() {
  [ -n "${LLAMACPP_DIR:-}" ] && return 0
  local dir="$1/llamacpp"
  [ -f "$dir/package/bins/linux-x64/libllama.v0.5.0.so" ] && return 0
  command -v npm >/dev/null 2>&1 || kvcheck_install_packages npm
  echo "kvcheck: fetching llama.cpp ($KVCHECK_LLAMACPP_PACKAGE, about 11 MB) into $dir" >&2
  mkdir -p "$dir"
  local tmp; tmp="$(mktemp -d "$dir/.fetch-XXXXXX")"
  if ! (cd "$tmp" && npm pack --silent "$KVCHECK_LLAMACPP_PACKAGE" >npm.log 2>&1); then
    cat "$tmp/npm.log" >&2
    rm -rf "$tmp"
    echo "kvcheck: npm pack $KVCHECK_LLAMACPP_PACKAGE failed (see above); or set LLAMACPP_DIR to your own build" >&2
    exit 2
  fi
  local tgz sum
  tgz="$(ls "$tmp"/*.tgz)"
  sum="$(python3 -c 'import base64, hashlib, sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tgz")"
  if [ "$sum" != "$KVCHECK_LLAMACPP_SHA512" ]; then
    rm -rf "$tmp"
    echo "kvcheck: $KVCHECK_LLAMACPP_PACKAGE does not have the published sha512 (got $sum); refusing it" >&2
    exit 2
  fi
  tar xzf "$tgz" -C "$tmp" package/bins/linux-x64
  rm -rf "$dir/package"
  mv "$tmp/package" "$dir/package"
  rm -rf "$tmp"
}
