#!/usr/bin/env bash
# docs/real-engines.md's table of real engines' caches on every fixture they claim is what
# tools/peers/{hf_caches,mlx_caches,ort_gqa,kvpress_presses}.py print now, engine by engine and release by
# release (what `tools/kvcheck peers` runs):
# a release whose verdicts changed, or a fixture added, fails here until the table is
# regenerated. Usage: check_peer_table.sh ROOT VENVS KVCHECK_BIN
set -u
root=$1 venvs=$2 bin=$3
want=$(sed -n '/<!-- kvcheck peers: begin -->/,/<!-- kvcheck peers: end -->/p' "$root/docs/real-engines.md" | sed '1d;$d')
got="| engine | class | fixture | verdict |
|---|---|---|---|"
for release in 4.42 4.46 4.52 5.25; do
  python="$venvs/transformers-$release/bin/python"
  if [ ! -x "$python" ]; then
    echo "FAIL: no venv $venvs/transformers-$release: tools/test makes it (tools/setup/python.sh)"; exit 1
  fi
  rows=$(KVCHECK_BIN="$bin" PYTHONDONTWRITEBYTECODE=1 "$python" "$root/tools/peers/hf_caches.py") ||
    { echo "FAIL: tools/peers/hf_caches.py failed under transformers $release"; exit 1; }
  got+=$'\n'"$rows"
done
run() {  # VENV SCRIPT: one engine's rows
  local python="$venvs/$1/bin/python"
  if [ ! -x "$python" ]; then
    echo "FAIL: no venv $venvs/$1: tools/test makes it (tools/setup/python.sh)"; exit 1
  fi
  rows=$(KVCHECK_BIN="$bin" PYTHONDONTWRITEBYTECODE=1 "$python" "$root/tools/peers/$2") ||
    { echo "FAIL: tools/peers/$2 failed in $1"; exit 1; }
  got+=$'\n'"$rows"
}
run mlx mlx_caches.py
run onnxruntime-1.23 ort_gqa.py
run onnxruntime-1.31 ort_gqa.py
run kvpress kvpress_presses.py
if [ "$got" != "$want" ]; then
  echo "FAIL: docs/real-engines.md's table is not what the releases say now; regenerate it with"
  echo "tools/kvcheck peers (between the 'kvcheck peers' markers). Difference (docs, then now):"
  diff <(echo "$want") <(echo "$got")
  exit 1
fi
echo "the table of $(echo "$got" | tail -n +3 | wc -l) rows matches"
