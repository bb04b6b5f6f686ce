# Sourced by tools/kvcheck and tools/test: installs the Debian packages that are missing,
# then configures (once) and builds a build folder incrementally. Build output goes to
# stderr only when something fails, so the command's own stdout stays clean.

KVCHECK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KVCHECK_PACKAGES=(
  cmake ninja-build g++
  libxtensor-dev xtl-dev libxsimd-dev nlohmann-json3-dev libfmt-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy
)

kvcheck_install_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "kvcheck: missing Debian packages: ${missing[*]}" >&2
    echo "kvcheck: run as root: apt-get update && apt-get install -y ${missing[*]}" >&2
    exit 2
  fi
  echo "kvcheck: installing ${missing[*]}" >&2
  local log; log="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "kvcheck: apt-get failed (see above)" >&2
    exit 2
  fi
  rm -f "$log"
}

# Cache settings (-DNAME=VALUE) the next kvcheck_build applies, configuring again when the
# build folder holds others (tools/setup/llamacpp.sh sets llama.h's folders here).
KVCHECK_CONFIGURE_ARGS=()

# kvcheck_build_dir [PRESET]: the build folder of PRESET.
kvcheck_build_dir() {
  case "${1:-release}" in
    release) echo "$KVCHECK_ROOT/build" ;;
    *) echo "$KVCHECK_ROOT/build-$1" ;;
  esac
}

# kvcheck_build [PRESET]: release (build/, the default), sanitize (build-sanitize/) or
# fuzz (build-fuzz/). CI (CI=true) treats warnings as errors.
kvcheck_build() {
  local preset="${1:-release}" build
  build="$(kvcheck_build_dir "$preset")"
  local log="$build/build.log"
  if [ ! -f "$build/build.ninja" ]; then
    mkdir -p "$build"
    local werror=OFF
    [ "${CI:-}" = true ] && werror=ON
    if ! (cd "$KVCHECK_ROOT" && cmake --preset "$preset" -DKVCHECK_WERROR=$werror "${KVCHECK_CONFIGURE_ARGS[@]}") >"$log" 2>&1; then
      cat "$log" >&2
      echo "kvcheck: cmake configure failed (log: $log)" >&2
      exit 2
    fi
  else
    local arg name value stale=no
    for arg in "${KVCHECK_CONFIGURE_ARGS[@]}"; do
      name="${arg#-D}"; name="${name%%=*}"; value="${arg#*=}"
      [ "$(sed -n "s/^$name:[A-Z]*=//p" "$build/CMakeCache.txt")" = "$value" ] || stale=yes
    done
    if [ $stale = yes ] && ! cmake -S "$KVCHECK_ROOT" -B "$build" "${KVCHECK_CONFIGURE_ARGS[@]}" >"$log" 2>&1; then
      cat "$log" >&2
      echo "kvcheck: cmake configure failed (log: $log)" >&2
      exit 2
    fi
  fi
  # Say so when there is work, so a first build (about a minute on two cores) is not
  # mistaken for a hang; an up-to-date tree stays silent.
  if ninja -C "$build" -n 2>/dev/null | grep -q '^\['; then
    echo "kvcheck: building $build (log: $log)" >&2
  fi
  if ! cmake --build "$build" -j2 >"$log" 2>&1; then
    grep -E "error|Error|FAILED" -A3 "$log" | head -60 >&2
    echo "kvcheck: build failed (full log: $log)" >&2
    exit 2
  fi
  KVCHECK_BUILD="$build"
}

# kvcheck_build_llamacpp_driver: after kvcheck_build, the llama.cpp driver compiled against
# the llama.h the set-up found (not part of the default build: a header that does not
# compile stops only the llama.cpp commands).
kvcheck_build_llamacpp_driver() {
  local log="$KVCHECK_BUILD/build-llamacpp.log"
  # (configured only with headers; read from the cache, not from a pipe that pipefail and
  # an early-exiting grep would make flaky)
  [ -n "$(sed -n 's/^KVCHECK_LLAMA_INCLUDE:[A-Z]*=//p' "$KVCHECK_BUILD/CMakeCache.txt")" ] || return 0
  if ! cmake --build "$KVCHECK_BUILD" -j2 --target kvcheck_llamacpp_engine_h >"$log" 2>&1; then
    grep -E "error|Error|FAILED" -A3 "$log" | head -60 >&2
    echo "kvcheck: the llama.cpp driver does not compile against the llama.h of" \
      "$(sed -n 's/^KVCHECK_LLAMA_INCLUDE:[A-Z]*=//p' "$KVCHECK_BUILD/CMakeCache.txt") (full log: $log);" \
      "without LLAMACPP_DIR, tools/kvcheck llamacpp goes back to the shipped build's" >&2
    exit 2
  fi
}

kvcheck_install_packages "${KVCHECK_PACKAGES[@]}"
