# Sourced after build.sh by tools/test: the Python virtual environments the tests of real
# Python caches run in. kvcheck itself needs no Python; the NumPy-only tests and scripts
# use Debian's /usr/bin/python3 with python3-numpy (build.sh installs it), which is what a
# user who only runs kvtrace.py has. Anything from PyPI lives in a venv of its own:
#   build/venvs/NAME   made with /usr/bin/python3 -m venv from
#                      tools/setup/requirements/NAME.txt, every line pinned with its hash
#                      (pip --require-hashes), so two machines hold the same files.
# PyTorch is always torch.txt, installed first and alone: pinned to the 2.13.0 CPU build,
# a later package can then never bring a CUDA build (about 3 GB) in its place.
# PyTorch is installed once, in build/venvs/torch (about 1 GB). A venv whose files start
# with torch.txt reads it from there through a .pth file behind its own site-packages, so
# its own packages (numpy 1.26 for transformers 4.42, say) come first and pip, seeing torch
# installed outside the venv, neither reinstalls nor touches it. Six copies of torch did
# not fit the disk of a CI machine (pip: "No space left on device" at the seventh venv).
KVCHECK_VENVS="$KVCHECK_ROOT/build/venvs"

# kvcheck_venv NAME [REQUIREMENTS...]: makes build/venvs/NAME (once, and again when a
# requirements file changed) and installs the files in order (default: NAME.txt).
kvcheck_venv() {
  local name="$1"; shift
  local files=("$@") f
  [ ${#files[@]} -gt 0 ] || files=("$name.txt")
  local venv="$KVCHECK_VENVS/$name" stamp wanted=""
  for f in "${files[@]}"; do
    wanted+="$f $(sha256sum <"$KVCHECK_ROOT/tools/setup/requirements/$f" | cut -c1-64); "
  done
  stamp="$venv/kvcheck-requirements"
  [ "$name" != torch ] && [ "${files[0]}" = torch.txt ] && kvcheck_venv torch
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && return 0
  command -v /usr/bin/python3 >/dev/null && /usr/bin/python3 -c 'import ensurepip' 2>/dev/null ||
    kvcheck_install_packages python3-venv
  local start=$SECONDS log
  echo "kvcheck: installing the Python venv $venv (${files[*]})" >&2
  rm -rf "$venv"
  mkdir -p "$KVCHECK_VENVS"
  log="$KVCHECK_VENVS/$name.log"
  if ! /usr/bin/python3 -m venv "$venv" >"$log" 2>&1; then
    cat "$log" >&2
    echo "kvcheck: could not make the venv $venv (see above)" >&2
    exit 2
  fi
  if [ "$name" != torch ] && [ "${files[0]}" = torch.txt ]; then
    local site torch_site
    site=("$venv"/lib/python3*/site-packages)
    torch_site=("$KVCHECK_VENVS"/torch/lib/python3*/site-packages)
    # The venv's own setuptools (66) would hide the 84.2.1 that torch requires: removed
    # before the .pth exists, so that pip cannot take torch's copy for the venv's.
    "$venv/bin/pip" uninstall --yes --disable-pip-version-check setuptools >>"$log" 2>&1
    echo "${torch_site[0]}" >"${site[0]}/kvcheck-torch.pth"
    files=("${files[@]:1}")
  fi
  for f in "${files[@]}"; do
    if ! "$venv/bin/pip" install --no-input --disable-pip-version-check --require-hashes \
        -r "$KVCHECK_ROOT/tools/setup/requirements/$f" >>"$log" 2>&1; then
      grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 30 >&2
      grep -q "No space left on device" "$log" &&
        echo "kvcheck: the disk holding $KVCHECK_VENVS has $(df -h --output=avail "$KVCHECK_VENVS" | tail -n 1 | tr -d ' ') free; tools/test's venvs take about 3.5 GB in all" >&2
      echo "kvcheck: pip could not install tools/setup/requirements/$f into $venv (log: $log)" >&2
      exit 2
    fi
  done
  # Every requirement met by what the venv sees, torch's venv included: a pin of the venv's
  # own must not shadow one torch needs.
  if ! "$venv/bin/pip" check --disable-pip-version-check >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "kvcheck: pip check found broken requirements in $venv (log: $log)" >&2
    exit 2
  fi
  printf '%s' "$wanted" >"$stamp"
  echo "kvcheck: venv $name ready in $((SECONDS - start)) s" >&2
}

# kvcheck_transformers_venv RELEASE: build/venvs/transformers-RELEASE, the same files for
# tools/test and tools/kvcheck peers (5.25 also holds quanto, QuantizedLayer's backend).
kvcheck_transformers_venv() {
  local extra=()
  [ "$1" = 5.25 ] && extra=(quanto.txt)
  kvcheck_venv "transformers-$1" torch.txt "transformers-$1.txt" "${extra[@]}"
  [ "$1" = 5.25 ] || return 0
  # optimum-quanto compiles its C++ unpack (about 36 s) into its site-packages at its first
  # dequantize: here, once, rather than inside whichever test dequantizes first.
  local venv="$KVCHECK_VENVS/transformers-$1" built
  built=("$venv"/lib/python3*/site-packages/optimum/quanto/library/extensions/cpp/build/quanto_cpp.so)
  [ -f "${built[0]}" ] && return 0
  local start=$SECONDS
  if ! "$venv/bin/python" -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib" \
      >>"$KVCHECK_VENVS/transformers-$1.log" 2>&1; then
    tail -n 30 "$KVCHECK_VENVS/transformers-$1.log" >&2
    echo "kvcheck: optimum-quanto's C++ extension did not build in $venv (log: $KVCHECK_VENVS/transformers-$1.log)" >&2
    exit 2
  fi
  echo "kvcheck: optimum-quanto's C++ extension built in $((SECONDS - start)) s" >&2
}
