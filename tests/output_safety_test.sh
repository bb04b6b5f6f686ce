#!/usr/bin/env bash
# output_safety_test.sh KVCHECK SCENARIO [LLAMACPP_SCENARIO]: kvcheck never destroys or
# overwrites a file it did not write. Each hostile but plausible command below must exit 2
# naming what it refused, and every file of the user's must be byte-identical afterwards;
# the ordinary cases (an earlier export, an earlier report) still replace what kvcheck wrote.
set -u
kv=$1
scenario=$2
llamacpp_scenario=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# snapshot DIR: every path with its bytes' hash (dotfiles and folders included), sorted.
snapshot() { (cd "$1" && find . -print0 | sort -z | xargs -0 -I{} sh -c 'if [ -f "{}" ]; then sha256sum "{}"; else echo "dir {}"; fi'); }
# refused WHAT PATTERN CMD...: CMD exits 2 with PATTERN on stderr and $work/user unchanged.
refused() {
  local what=$1 pattern=$2; shift 2
  local before after status
  before=$(snapshot "$work/user")
  "$@" >"$work/out" 2>"$work/err"
  status=$?
  after=$(snapshot "$work/user")
  [ "$status" = 2 ] || fail "$what: exited $status, expected 2 ($(cat "$work/err"))"
  grep -qE -- "$pattern" "$work/err" || fail "$what: stderr lacks /$pattern/: $(cat "$work/err")"
  [ "$before" = "$after" ] || fail "$what: the user's files changed:"$'\n'"$(diff <(echo "$before") <(echo "$after"))"
  echo "ok: $what"
}

mkdir -p "$work/user"
cp "$scenario" "$work/user/scenario.json"
s="$work/user/scenario.json"

# 1. export --out over an earlier export: only what that export's manifest lists is its own.
"$kv" export "$s" --out "$work/user/exp" >/dev/null || fail "the first export failed"
echo "my notes" >"$work/user/exp/notes.txt"
refused "export over an export holding notes" "notes.txt is not one of an earlier export's files" \
  "$kv" export "$s" --out "$work/user/exp"
rm "$work/user/exp/notes.txt"
mkdir "$work/user/exp/plots" && echo x >"$work/user/exp/plots/a.txt"
refused "export over an export holding a subfolder" "plots is not one of" "$kv" export "$s" --out "$work/user/exp"
rm -r "$work/user/exp/plots"
echo secret >"$work/user/exp/.env"
refused "export over an export holding a dotfile" "\.env is not one of" "$kv" export "$s" --out "$work/user/exp"
rm "$work/user/exp/.env"
cp "$s" "$work/user/exp/replay.json"
refused "export of a scenario that lives inside the export folder" "which this command reads" \
  "$kv" export "$work/user/exp/replay.json" --out "$work/user/exp"
rm "$work/user/exp/replay.json"
"$kv" export "$s" --out "$work/user/exp" >/dev/null || fail "export over an earlier export alone was refused"
echo "not an export" >"$work/user/exp2.txt"; mkdir "$work/user/mine" && echo x >"$work/user/mine/a"
refused "export over a folder that is not an export" "not a kvcheck export folder" \
  "$kv" export "$s" --out "$work/user/mine"

# 2. golden generate --out: each golden is replaced whole, so it may hold only its export's files.
"$kv" golden generate "$s" --out "$work/user/golden" >/dev/null || fail "the first golden generate failed"
name=$(ls "$work/user/golden")
echo "why this golden" >"$work/user/golden/$name/README"
refused "golden generate over a golden holding a note" "README is not one of" \
  "$kv" golden generate "$s" --out "$work/user/golden" --force
rm "$work/user/golden/$name/README"
echo keep >"$work/user/golden/.notes"
"$kv" golden generate "$s" --out "$work/user/golden" >/dev/null || fail "golden generate beside a dotfile failed"
[ "$(cat "$work/user/golden/.notes")" = keep ] || fail "golden generate lost the dotfile beside the goldens"

# 3. Reports never overwrite an input: the scenario, through a link, through a hard link,
# a trace's manifest; on every command that writes reports.
refused "run --json SCENARIO" "refusing to write the report over .*scenario.json, which this command reads" \
  "$kv" run "$s" --json "$s"
ln -s scenario.json "$work/user/link.json"
refused "run --junit LINK-TO-SCENARIO" "which this command reads" "$kv" run "$s" --junit "$work/user/link.json"
ln "$s" "$work/user/hard.json"
refused "run --json HARD-LINK-OF-SCENARIO" "which this command reads" "$kv" run "$s" --json "$work/user/hard.json" --force
rm "$work/user/link.json" "$work/user/hard.json"
refused "diagnose --html SCENARIO" "which this command reads" "$kv" diagnose "$s" --cache dynamic --html "$s"
refused "diagnose --json and --html naming one file" "--json and --html name the same file" \
  "$kv" diagnose "$s" --cache dynamic --json "$work/user/one" --html "$work/user/one"
mkdir "$work/user/trace" && echo '{"format": "kvcheck-trace-1"}' >"$work/user/trace/manifest.json"
refused "verify --html TRACE/manifest.json" "manifest.json, which this command reads" \
  "$kv" verify "$s" --trace "$work/user/trace" --html "$work/user/trace/manifest.json" --force
refused "llamacpp --json SCENARIO" "which this command reads" "$kv" llamacpp "$s" --json "$s"

# 4. An existing file that is not a kvcheck report of that kind needs --force; an earlier
# report (or an empty file) is replaced as before.
echo "my results, by hand" >"$work/user/results.json"
refused "run --json over a file that is not a report" "not a kvcheck JSON report \(--force replaces it\)" \
  "$kv" run "$s" --json "$work/user/results.json"
echo "<html>mine</html>" >"$work/user/page.html"
refused "diagnose --html over a page that is not kvcheck's" "not a kvcheck HTML report" \
  "$kv" diagnose "$s" --cache dynamic --html "$work/user/page.html"
"$kv" run "$s" --json "$work/report.json" --junit "$work/report.xml" >/dev/null || fail "a first report failed"
"$kv" run "$s" --json "$work/report.json" --junit "$work/report.xml" >/dev/null || fail "an earlier report was not replaced"
: >"$work/empty.json"
"$kv" run "$s" --json "$work/empty.json" >/dev/null || fail "an empty file was not replaced"
refused "run --json naming a JUnit report" "not a kvcheck JSON report" "$kv" run "$s" --json "$work/report.xml"
cp "$work/user/results.json" "$work/forced.json"
"$kv" run "$s" --json "$work/forced.json" --force >/dev/null || fail "--force did not replace the file"
grep -q kvcheck-report-1 "$work/forced.json" || fail "--force left the old file"

# 5. llama.cpp --trace DIR: only what an earlier capture listed is replaced (before any work,
# so no llama.cpp library is needed to refuse).
if [ -n "$llamacpp_scenario" ]; then
  mkdir "$work/user/capture"
  echo "written by kvcheck llamacpp; replaced whole by the next run" >"$work/user/capture/kvcheck-llamacpp-capture"
  echo "mine" >"$work/user/capture/analysis.ipynb"
  refused "llamacpp --trace over a capture holding a notebook" "analysis.ipynb is not one of an earlier capture's files" \
    "$kv" llamacpp "$llamacpp_scenario" --trace "$work/user/capture"
fi
echo "all passed"
