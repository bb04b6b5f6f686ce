"""SPEC 8.9: a paged cache written in NumPy the way vLLM's block manager behaves (slots from
the token index, full-block prefix hashes with the adapter and salt, blocks registered after
their forward, LRU eviction of cached blocks, null blocks behind a sliding window, copy on
write), driven over exported paged fixtures, its pools and block tables dumped with
kvtrace.TraceWriter in vLLM's NHD and FlashInfer's HND layouts, and judged by `kvcheck
verify`; the same cache without copy-on-write is caught and classified."""
import collections
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import kvtrace  # noqa: E402

KVCHECK = os.environ.get("KVCHECK_BIN", os.path.join(HERE, "..", "build", "kvcheck"))
SCENARIOS = os.path.join(HERE, "..", "fixtures", "scenarios")


class BlockManagerCache:
    """One pool per layer, a table per row (lists of block ids, None for null)."""

    def __init__(self, export, copy_on_write=True):
        d, p = export.dims, export.manifest["paging"]
        self.exp, self.B, self.N = export, p["block_size"], p["num_blocks"]
        self.prefix_cache, self.copy_on_write = p["prefix_cache"], copy_on_write
        self.L, self.Hkv, self.D = d["layers"], d["kv_heads"], d["head_dim"]
        self.k = np.zeros((self.L, self.N, self.B, self.Hkv, self.D), np.float32)
        self.v = np.zeros_like(self.k)
        self.ref = np.zeros((self.L, self.N), np.int32)
        self.index = [dict() for _ in range(self.L)]          # hash -> block
        self.key_of = [dict() for _ in range(self.L)]         # block -> hash
        self.cached = [collections.OrderedDict() for _ in range(self.L)]  # refcount 0, registered; oldest first
        self.free = [list(range(self.N - 1, -1, -1)) for _ in range(self.L)]  # lowest id on top
        self.rows = []

    def window(self, layer):
        policy = self.exp.layer_policy(layer)
        return policy["window"] if policy["type"] == "sliding" else 0

    def new_row(self):
        return {"tables": [[] for _ in range(self.L)], "ids": [], "extra": {}, "hashes": [], "hit": 0}

    def allocate(self, l):
        if self.free[l]:
            block = self.free[l].pop()
        else:
            block, _ = self.cached[l].popitem(last=False)
            del self.index[l][self.key_of[l].pop(block)]
        self.ref[l, block] = 1  # not zeroed, as vLLM does not: slots past a row's end hold old values
        return block

    def retain(self, l, block):
        self.cached[l].pop(block, None)
        self.ref[l, block] += 1

    def release(self, l, block):
        self.ref[l, block] -= 1
        if self.ref[l, block] == 0:
            if self.prefix_cache and block in self.key_of[l]:
                self.cached[l][block] = True
            else:
                if block in self.key_of[l]:
                    del self.index[l][self.key_of[l].pop(block)]
                self.free[l].append(block)

    def block_hash(self, row, i):
        while len(row["hashes"]) <= i:
            j = len(row["hashes"])
            parent = row["hashes"][-1] if j else ("adapter", row["extra"].get("adapter", ""),
                                                  "salt", row["extra"].get("salt", ""))
            row["hashes"].append(hash((parent, tuple(row["ids"][j * self.B:(j + 1) * self.B]))))
        return row["hashes"][i]

    def append(self, step):
        self.rows += [self.new_row() for _ in range(step["batch"] - len(self.rows))]
        for b, r in enumerate(step["rows"]):
            row = self.rows[b]
            row["hit"] = 0
            if not r["uids"]:
                continue
            start = len(row["ids"])
            row["ids"] += r["ids"]
            if start == 0:  # the row starts: take the leading full blocks the index holds
                row["extra"] = r.get("extra", {})
                n, hit = len(r["ids"]), 0
                while self.prefix_cache and hit + self.B <= (n - 1) // self.B * self.B and all(
                        self.block_hash(row, hit // self.B) in self.index[l] for l in range(self.L)):
                    for l in range(self.L):
                        block = self.index[l][self.block_hash(row, hit // self.B)]
                        self.retain(l, block)
                        row["tables"][l].append(block)
                    hit += self.B
                row["hit"] = hit
            first = start + row["hit"]
            for l in range(self.L):
                table = row["tables"][l]
                for t in range(first, len(row["ids"])):
                    i = t // self.B
                    while len(table) <= i:
                        table.append(None)
                    if table[i] is None:
                        table[i] = self.allocate(l)
                    elif self.ref[l, table[i]] > 1 and self.copy_on_write:
                        copy = self.allocate(l)
                        self.k[l, copy], self.v[l, copy] = self.k[l, table[i]], self.v[l, table[i]]
                        self.release(l, table[i])
                        table[i] = copy
                    uid = r["uids"][t - start]
                    key = kvtrace.rotate(self.exp.k[l, uid], np.array([t]), self.exp.rope)
                    self.k[l, table[i], t % self.B] = key
                    self.v[l, table[i], t % self.B] = self.exp.v[l, uid]
            # After the forward: full blocks enter the index; blocks behind the window go.
            n = len(row["ids"])
            for l in range(self.L):
                table = row["tables"][l]
                if self.prefix_cache:
                    for i in range(first // self.B, n // self.B):
                        if table[i] is not None and self.block_hash(row, i) not in self.index[l]:
                            self.index[l][self.block_hash(row, i)] = table[i]
                            self.key_of[l][table[i]] = self.block_hash(row, i)
                w = self.window(l)
                if w:
                    for i in range(min(len(table), max(0, n - w + 1) // self.B)):
                        if table[i] is not None:
                            self.release(l, table[i])
                            table[i] = None

    def op(self, step):
        if step["op"] == "append":
            self.append(step)
        elif step["op"] == "reorder":
            moved = [json.loads(json.dumps(self.rows[r])) for r in step["rows_from"]]
            for row in moved:
                for l, table in enumerate(row["tables"]):
                    for block in table:
                        if block is not None:
                            self.retain(l, block)
            for row in self.rows:
                self.drop(row)
            self.rows = moved
        elif step["op"] == "free":
            for r in step["rows_freed"]:
                self.drop(self.rows[r])
                self.rows[r] = self.new_row()
        elif step["op"] == "evict":
            for l in range(self.L):
                k = len(self.cached[l]) if step["blocks"] < 0 else step["blocks"]
                for _ in range(min(k, len(self.cached[l]))):
                    block, _ = self.cached[l].popitem(last=False)
                    del self.index[l][self.key_of[l].pop(block)]
                    self.free[l].append(block)
        else:
            raise ValueError("op %s is not driven here" % step["op"])

    def drop(self, row):
        for l, table in enumerate(row["tables"]):
            for block in table:
                if block is not None:
                    self.release(l, block)
            table.clear()

    def state(self, layout):
        width = max([1] + [len(t) for row in self.rows for t in row["tables"]])
        layers = []
        for l in range(self.L):
            table = np.full((len(self.rows), width), -1, np.int32)
            for b, row in enumerate(self.rows):
                for i, block in enumerate(row["tables"][l]):
                    table[b, i] = -1 if block is None else block
            k, v = self.k[l], self.v[l]
            if layout == "HND":
                k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            layers.append({"paged": {"block_size": self.B, "layout": layout, "key_cache": k, "value_cache": v,
                                     "block_table": table, "refcount": self.ref[l],
                                     "hit_tokens": np.array([row["hit"] for row in self.rows], np.int32)}})
        return layers


def trace_of(scenario, work, layout="NHD", copy_on_write=True):
    export = os.path.join(work, "export")
    subprocess.run([KVCHECK, "export", os.path.join(SCENARIOS, scenario + ".json"), "--out", export],
                   check=True, capture_output=True)
    exp = kvtrace.Export(export)
    cache = BlockManagerCache(exp, copy_on_write)
    path = os.path.join(work, "trace-" + layout)
    with kvtrace.TraceWriter(path, exp.name, "tests/test_paged_trace.py", "absolute") as writer:
        for step in exp.steps:
            cache.op(step)
            writer.step(cache.state(layout))
    return path


def verify(scenario, trace):
    return subprocess.run([KVCHECK, "verify", os.path.join(SCENARIOS, scenario + ".json"), "--trace", trace],
                          capture_output=True, text=True)


class PagedTraceTest(unittest.TestCase):
    def test_a_vllm_style_block_manager_passes_in_nhd_and_hnd(self):
        for scenario in ("paged_fork_then_prefix_hit", "paged_gemma_hybrid_prefix", "paged_evict_then_repeat"):
            for layout in ("NHD", "HND"):
                with self.subTest(scenario=scenario, layout=layout), tempfile.TemporaryDirectory() as work:
                    done = verify(scenario, trace_of(scenario, work, layout))
                    self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                    self.assertIn("paged bookkeeping", done.stdout)
                    self.assertIn("no divergence", done.stdout)

    def test_sharing_a_forked_block_without_copy_is_named(self):
        with tempfile.TemporaryDirectory() as work:
            done = verify("paged_fork_then_prefix_hit", trace_of("paged_fork_then_prefix_hit", work,
                                                                copy_on_write=False))
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("class: write to a shared block (copy-on-write missing)", done.stdout)
        self.assertRegex(done.stdout, r"first divergence: step 2 \(decode")

    def test_negative_hit_tokens_are_bad_input(self):
        with tempfile.TemporaryDirectory() as work:
            trace = trace_of("paged_chunked_prefill", work)
            path = os.path.join(trace, "step000_l0_hit_tokens.npy")
            np.save(path, np.array([-4], np.int32))
            done = verify("paged_chunked_prefill", trace)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertIn("step000_l0_hit_tokens.npy: row 0 has -4 hit tokens: expected 0 or more", done.stderr)

    def test_a_block_id_outside_the_pool_is_bad_input(self):
        with tempfile.TemporaryDirectory() as work:
            trace = trace_of("paged_chunked_prefill", work)
            table = os.path.join(trace, "step000_l0_block_table.npy")
            bad = np.load(table)
            bad[0, 0] = 99
            np.save(table, bad)
            done = verify("paged_chunked_prefill", trace)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertIn("step000_l0_block_table.npy: entry [0][0] is 99: expected -1 (null) or a block id below 8",
                      done.stderr)


if __name__ == "__main__":
    unittest.main()
