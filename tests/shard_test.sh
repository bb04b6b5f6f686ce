#!/usr/bin/env bash
# shard_test.sh KVCHECK: the shards 1/3, 2/3, 3/3 together run every scenario of the suite
# exactly once (compared by scenario and target with the unsharded run).
set -eu
kvcheck=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$kvcheck" run --json "$dir/all.json" >/dev/null
for i in 1 2 3; do "$kvcheck" run --shard "$i/3" --json "$dir/$i.json" >/dev/null; done
/usr/bin/python3 - "$dir" <<'PY'
import json, sys, collections
d = sys.argv[1]
rows = lambda f: [(r["scenario"], r["target"]) for r in json.load(open(f))["results"]]
whole = sorted(rows(d + "/all.json"))
parts = [rows("%s/%d.json" % (d, i)) for i in (1, 2, 3)]
joined = sorted(sum(parts, []))
assert all(parts), "a shard is empty: %s" % [len(p) for p in parts]
assert joined == whole, "shards differ from the whole run"
scenarios = [set(s for s, _ in p) for p in parts]
assert not (scenarios[0] & scenarios[1] or scenarios[0] & scenarios[2] or scenarios[1] & scenarios[2]), "overlap"
print("3 shards of %d results: %s" % (len(whole), [len(p) for p in parts]))
PY
