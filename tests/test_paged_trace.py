"""SPEC 8.9: a paged cache written the way vLLM's block manager behaves (slots from the token
index, full-block prefix hashes with the adapter and salt, blocks registered after their
forward, LRU eviction of cached blocks, null blocks behind a sliding window, copy on write,
swap), with NumPy or PyTorch pools, driven over exported paged fixtures by
kvtrace.drive_paged_cache in vLLM's NHD and FlashInfer's HND layouts, and judged by `kvcheck
verify`; the same cache with planted faults is caught and classified."""
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
import spec_quant  # noqa: E402

KVCHECK = os.environ.get("KVCHECK_BIN", os.path.join(HERE, "..", "build", "kvcheck"))
SCENARIOS = os.path.join(HERE, "..", "fixtures", "scenarios")
DATA = os.path.join(HERE, "data")


class BlockManagerCache:
    """vLLM's block manager with its pools, for kvtrace.drive_paged_cache: one pool per
    layer, a table per row (block ids, None for null). tensor: "numpy" or "torch" pools."""

    def __init__(self, export, layout="NHD", tensor="numpy", copy_on_write=True):
        d, p = export.dims, export.manifest["paging"]
        self.exp, self.block_size, self.N = export, p["block_size"], p["num_blocks"]
        self.B, self.layout = self.block_size, layout
        self.prefix_cache, self.copy_on_write = p["prefix_cache"], copy_on_write
        self.L, self.Hkv, self.D = d["layers"], d["kv_heads"], d["head_dim"]
        shape = (self.L, self.N, self.B, self.Hkv, self.D) if layout == "NHD" else \
            (self.L, self.N, self.Hkv, self.B, self.D)
        if tensor == "torch":
            import torch
            self.k = torch.zeros(shape, dtype=torch.float32)
        else:
            self.k = np.zeros(shape, np.float32)
        self.v = self.k.clone() if tensor == "torch" else self.k.copy()
        self.ref = np.zeros((self.L, self.N), np.int32)
        self.index = [dict() for _ in range(self.L)]          # hash -> block
        self.key_of = [dict() for _ in range(self.L)]         # block -> hash
        self.cached = [collections.OrderedDict() for _ in range(self.L)]  # refcount 0, registered; oldest first
        self.free_blocks = [list(range(self.N - 1, -1, -1)) for _ in range(self.L)]  # lowest id on top
        self.rows = {}
        self.swapped = {}

    # What the driver reads.
    def key_cache(self, layer):
        return self.k[layer]

    def value_cache(self, layer):
        return self.v[layer]

    def block_table(self, layer, row):
        return self.row(row)["tables"][layer]

    def refcount(self, layer):
        return self.ref[layer]

    # The block manager.
    def row(self, b):
        return self.rows.setdefault(b, {"tables": [[] for _ in range(self.L)], "ids": [], "extra": {},
                                        "hashes": [], "registered": 0})

    def window(self, layer):
        policy = self.exp.layer_policy(layer)
        return policy["window"] if policy["type"] == "sliding" else 0

    def allocate_block(self, l):
        if self.free_blocks[l]:
            block = self.free_blocks[l].pop()
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
                self.free_blocks[l].append(block)

    def block_hash(self, row, i):
        while len(row["hashes"]) <= i:
            j = len(row["hashes"])
            parent = row["hashes"][-1] if j else ("adapter", row["extra"].get("adapter", ""),
                                                  "salt", row["extra"].get("salt", ""))
            row["hashes"].append(hash((parent, tuple(row["ids"][j * self.B:(j + 1) * self.B]))))
        return row["hashes"][i]

    def start(self, b, ids, extra):
        """The leading full blocks the index holds, below the prompt's last token."""
        row = self.row(b)
        row["extra"], row["ids"] = extra, list(ids)
        n, hit = len(ids), 0
        while self.prefix_cache and hit + self.B <= (n - 1) // self.B * self.B and all(
                self.block_hash(row, hit // self.B) in self.index[l] for l in range(self.L)):
            for l in range(self.L):
                block = self.index[l][self.block_hash(row, hit // self.B)]
                self.retain(l, block)
                row["tables"][l].append(block)
            hit += self.B
        row["ids"], row["registered"] = row["ids"][:hit], hit // self.B
        return hit

    def allocate(self, b, ids):
        row = self.row(b)
        first = len(row["ids"])
        row["ids"] += list(ids)
        for l in range(self.L):
            table = row["tables"][l]
            for i in range(first // self.B, (len(row["ids"]) - 1) // self.B + 1):
                while len(table) <= i:
                    table.append(None)
                if table[i] is None:
                    table[i] = self.allocate_block(l)
                elif self.ref[l, table[i]] > 1 and self.copy_on_write:
                    copy = self.allocate_block(l)
                    self.k[l, copy], self.v[l, copy] = self.k[l, table[i]], self.v[l, table[i]]
                    self.release(l, table[i])
                    table[i] = copy

    def finish(self, b):
        """After the forward: full blocks enter the index; blocks behind the window go."""
        row = self.row(b)
        n = len(row["ids"])
        for l in range(self.L):
            table = row["tables"][l]
            if self.prefix_cache:
                for i in range(row["registered"], n // self.B):
                    if table[i] is not None and self.block_hash(row, i) not in self.index[l]:
                        self.index[l][self.block_hash(row, i)] = table[i]
                        self.key_of[l][table[i]] = self.block_hash(row, i)
            w = self.window(l)
            if w:
                for i in range(min(len(table), max(0, n - w + 1) // self.B)):
                    if table[i] is not None:
                        self.release(l, table[i])
                        table[i] = None
        row["registered"] = n // self.B

    def fork(self, rows_from):
        moved = [json.loads(json.dumps(self.row(r))) for r in rows_from]
        for row in moved:
            for l, table in enumerate(row["tables"]):
                for block in table:
                    if block is not None:
                        self.retain(l, block)
        for b in list(self.rows):
            self.free(b)
        self.rows = dict(enumerate(moved))

    def free(self, b):
        for l, table in enumerate(self.row(b)["tables"]):
            for block in table:
                if block is not None:
                    self.release(l, block)
        del self.rows[b]

    def evict(self, count):
        for l in range(self.L):
            k = len(self.cached[l]) if count is None else count
            for _ in range(min(k, len(self.cached[l]))):
                block, _ = self.cached[l].popitem(last=False)
                del self.index[l][self.key_of[l].pop(block)]
                self.free_blocks[l].append(block)

    def swap_out(self, b):
        row = self.row(b)
        clone = lambda x: x.clone() if hasattr(x, "clone") else x.copy()  # noqa: E731 (torch or NumPy)
        saved = [[None if blk is None else (clone(self.k[l, blk]), clone(self.v[l, blk])) for blk in table]
                 for l, table in enumerate(row["tables"])]
        self.swapped[b] = (json.loads(json.dumps(row)), saved)
        self.free(b)

    def swap_in(self, b):
        row, saved = self.swapped.pop(b)
        for l, table in enumerate(row["tables"]):
            for i, blk in enumerate(table):
                if blk is not None:
                    table[i] = self.allocate_block(l)
                    self.k[l, table[i]], self.v[l, table[i]] = saved[l][i]
        self.rows[b] = row


class RingCache(BlockManagerCache):
    """BlockManagerCache whose sliding layers are rings (SPEC 8.9), as transformers' continuous
    batching keeps them: R = W + extra places, token t at place t % R, pages allocated as the
    row grows (or, prealloc, all ceil(R / B) of them when it starts), copied on a fork, held
    until the row ends; a token a later one of the same forward overwrites is not stored.
    place_shift plants a fault: every token written `place_shift` places on."""

    extra, prealloc, place_shift = 0, False, 0

    def ring(self, layer):
        w = BlockManagerCache.window(self, layer)
        return w + self.extra if w else None

    def window(self, layer):  # a ring releases nothing behind its window
        return 0 if self.ring(layer) else BlockManagerCache.window(self, layer)

    def allocate(self, b, ids):
        row = self.row(b)
        first = len(row["ids"])
        row["ids"] += list(ids)
        n = len(row["ids"])
        for l in range(self.L):
            table, R = row["tables"][l], self.ring(l)
            if R:  # pages, not logical blocks
                pages = -(-R // self.B) if self.prealloc else -(-min(n, R) // self.B)
                while len(table) < pages:
                    table.append(self.allocate_block(l))
                continue
            for i in range(first // self.B, (n - 1) // self.B + 1):
                while len(table) <= i:
                    table.append(None)
                if table[i] is None:
                    table[i] = self.allocate_block(l)
                elif self.ref[l, table[i]] > 1:
                    copy = self.allocate_block(l)
                    self.k[l, copy], self.v[l, copy] = self.k[l, table[i]], self.v[l, table[i]]
                    self.release(l, table[i])
                    table[i] = copy

    def slot_mapping(self, layer, row, first, count):
        table, R = self.row(row)["tables"][layer], self.ring(layer)
        slots = []
        for t in range(first, first + count):
            if R and t + R < first + count:
                slots.append(-1)  # a later token of this forward takes its place
                continue
            p = (t + self.place_shift) % R if R else t
            slots.append(table[p // self.B] * self.B + p % self.B)
        return slots

    def fork(self, rows_from):
        BlockManagerCache.fork(self, rows_from)
        for row in self.rows.values():  # a ring's pages are copied, never shared
            for l in range(self.L):
                if self.ring(l):
                    table = row["tables"][l]
                    for i, block in enumerate(table):
                        if self.ref[l, block] > 1:
                            copy = self.allocate_block(l)
                            self.k[l, copy], self.v[l, copy] = self.k[l, block], self.v[l, block]
                            self.release(l, block)
                            table[i] = copy


class Fp8BlockManagerCache(BlockManagerCache):
    """The same block manager with vLLM's kv_cache_dtype fp8 pools: OCP E4M3 codes (uint8) of
    x / k_scale with the checkpoint's static per-tensor scales, written by write_kv (vLLM's
    reshape_and_cache) and read by read_kv as code * scale (its attention kernel). Forks,
    copies-on-write and swaps copy codes. bug: "scale_dropped_on_read" (written as x / s,
    read as code * 1: tokenspeed PR 759), "scale_never_loaded" (the scales left at vLLM's
    default 1.0: SGLang issue 18818, ModelOpt issue 20)."""

    def __init__(self, export, layout="NHD", bug=None):
        super().__init__(export, layout)
        q = export.manifest["kv_quant"]
        self.scales = (1.0, 1.0) if bug == "scale_never_loaded" else \
            (q["k"]["scale"]["value"][0], q["v"]["scale"]["value"][0])
        self.bug = bug
        self.k = np.zeros(self.k.shape, np.uint8)
        self.v = np.zeros(self.v.shape, np.uint8)

    def at(self, layer, slots):
        """Index of each slot's [Hkv, D] row in a layer's pool."""
        block, offset = np.asarray(slots) // self.B, np.asarray(slots) % self.B
        return (layer, block, offset) if self.layout == "NHD" else (layer, block, slice(None), offset)

    def write_kv(self, layer, slots, k, v):
        for pool, x, scale in ((self.k, k, self.scales[0]), (self.v, v, self.scales[1])):
            codes = spec_quant.fp8_encode("fp8_e4m3", np.asarray(x, np.float64) / scale)[0].astype(np.uint8)
            if self.layout == "NHD":
                pool[self.at(layer, slots)] = codes
            else:
                for j, slot in enumerate(slots):
                    pool[self.at(layer, [slot])] = codes[j:j + 1]

    def dequantize(self, codes, scale):
        values = spec_quant.fp8_values("fp8_e4m3")
        x = np.where(codes & 0x80, -1.0, 1.0) * values[codes & 0x7F]
        return x * (1.0 if self.bug == "scale_dropped_on_read" else scale)

    def read_kv(self, layer):
        return self.dequantize(self.k[layer], self.scales[0]), self.dequantize(self.v[layer], self.scales[1])

    def kv_codes(self, layer):
        shape = self.k[layer].shape[:-1] + (1,)  # one per-tensor scale, given per row as SPEC 9.3 reads it
        return {"k_codes": self.k[layer], "k_scales": np.full(shape, self.scales[0], np.float32),
                "v_codes": self.v[layer], "v_scales": np.full(shape, self.scales[1], np.float32)}


def trace_of(scenario, work, layout="NHD", tensor="numpy", dump="referenced", **faults):
    export = os.path.join(work, "export")
    subprocess.run([KVCHECK, "export", os.path.join(SCENARIOS, scenario + ".json"), "--out", export],
                   check=True, capture_output=True)
    exp = kvtrace.Export(export)
    path = os.path.join(work, "trace-" + layout)
    result = kvtrace.drive_paged_cache(exp, lambda: BlockManagerCache(exp, layout, tensor, **faults), path,
                                       producer="tests/test_paged_trace.py", dump=dump)
    assert result.error is None, result
    return path


def verify(scenario, trace):
    return subprocess.run([KVCHECK, "verify", os.path.join(SCENARIOS, scenario + ".json"), "--trace", trace],
                          capture_output=True, text=True)


def check_poison_is_named(test, tensor):
    """The pools are poisoned as kvcheck's --poison-blocks does (optimized/poison.h: kind 2,
    allocated and never written, epoch 0), and the hit hands out new blocks instead of the
    indexed ones: the row reads NaNs that name the block, through NumPy's float64 attention
    and the trace's float32 outputs, from NumPy pools or from torch ones (tensor "torch": the
    mark set through its bits, as an engine would with a uint32 view of its pool)."""
    class HitIntoNewBlocks(BlockManagerCache):
        def allocate_block(self, l):
            block = super().allocate_block(l)
            bits = 0x7FC00000 | 2 << 20 | block
            for pool in (self.k, self.v):
                if isinstance(pool, np.ndarray):
                    pool[l, block].view(np.uint32)[...] = bits
                else:  # a torch tensor
                    import torch
                    pool[l, block].view(torch.int32).fill_(bits)
            return block

        def start(self, b, ids, extra):
            hit = super().start(b, ids, extra)
            for l in range(self.L):
                table = self.row(b)["tables"][l]
                for i in range(hit // self.B):
                    self.release(l, table[i])
                    table[i] = self.allocate_block(l)
            return hit

    with tempfile.TemporaryDirectory() as work:
        result, done = drive("paged_fork_then_prefix_hit", work,
                             lambda exp: HitIntoNewBlocks(exp, "NHD", tensor))
    test.assertIsNone(result.error, result)
    test.assertEqual(done.returncode, 1, done.stdout + done.stderr)
    test.assertRegex(done.stdout, r"a poison NaN: block \d+ \(epoch 0\), never written")


def drive(scenario, work, make, folder=None):
    """drive_paged_cache over scenario (in `folder`, else the fixtures) with make(export) as
    the cache; (result, verify)."""
    path = os.path.join(folder or SCENARIOS, scenario + ".json")
    export = os.path.join(work, "export")
    subprocess.run([KVCHECK, "export", path, "--out", export], check=True, capture_output=True)
    exp = kvtrace.Export(export)
    trace = os.path.join(work, "trace")
    result = kvtrace.drive_paged_cache(exp, lambda: make(exp), trace)
    return result, subprocess.run([KVCHECK, "verify", path, "--trace", trace], capture_output=True, text=True)


class PagedTraceTest(unittest.TestCase):
    def test_a_vllm_style_block_manager_passes_in_nhd_and_hnd(self):
        for scenario in ("paged_fork_then_prefix_hit", "paged_gemma_hybrid_prefix", "paged_evict_then_repeat",
                         "paged_preempt_swap_and_recompute", "paged_chunked_prefill"):
            for layout in ("NHD", "HND"):
                # The whole pools once per scenario; the referenced blocks (block_ids) otherwise.
                dump = "pool" if layout == "NHD" and scenario == "paged_evict_then_repeat" else "referenced"
                with self.subTest(scenario=scenario, layout=layout), tempfile.TemporaryDirectory() as work:
                    done = verify(scenario, trace_of(scenario, work, layout, dump=dump))
                    self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                    self.assertIn("paged bookkeeping", done.stdout)
                    self.assertIn("no divergence", done.stdout)

    def test_a_block_traded_after_the_forward_for_an_equal_one_passes(self):
        # SPEC 8.4: transformers' continuous batching, once a forward fills a block, points the
        # row's table at an equal block it already holds and releases the one it wrote; the
        # step's slot mapping then names the released block. Traded for a block of other
        # tokens, the row reads the wrong keys.
        class Deduplicating(BlockManagerCache):
            wrong = False

            def finish(self, b):
                row = self.row(b)
                registered = row["registered"]
                for l in range(self.L):
                    table = row["tables"][l]
                    for i in range(registered, len(row["ids"]) // self.B):
                        h = self.block_hash(row, i)
                        held = self.index[l].get(h)
                        if self.wrong and i == 1:
                            held = next((blk for blk in self.index[l].values() if blk != table[i]), held)
                        if held is not None and held != table[i]:
                            self.retain(l, held)
                            self.release(l, table[i])
                            table[i] = held
                super().finish(b)

        class DeduplicatingWrongly(Deduplicating):
            wrong = True

        # In forwards of 4, the block traded after the first forward is handed out again in the
        # second and written over (a false alarm of kvcheck's until the rule allowed for it).
        for folder, scenario in ((SCENARIOS, "paged_same_prompt_in_one_step"), (DATA, "paged_same_prompt_in_chunks")):
            with self.subTest(scenario=scenario), tempfile.TemporaryDirectory() as work:
                result, done = drive(scenario, work, lambda exp: Deduplicating(exp), folder)
                self.assertIsNone(result.error, result)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        with tempfile.TemporaryDirectory() as work:
            result, done = drive("paged_same_prompt_in_one_step", work, lambda exp: DeduplicatingWrongly(exp))
            self.assertIsNone(result.error, result)
            self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
            self.assertRegex(done.stdout, r"row 1 table entry 1 \(block \d+\): token 4 was written to slot \d+, but its "
                                          r"table entry says slot \d+ = \d+ \* 4 \+ 0")
            self.assertIn("class: slot mapping wrong", done.stdout)

    def test_a_ring_passes_and_a_ring_written_one_place_on_is_named(self):
        # SPEC 8.9: rings of W and of W + 2 places, pages as the row grows or all at its start
        # (never-zeroed pages of a freed row among them), forks, chunks longer than the window.
        cases = [(SCENARIOS, "paged_window_2b"), (SCENARIOS, "paged_window_2b_plus_1"),
                 (SCENARIOS, "paged_sliding_chunked_prefill"), (DATA, "paged_ring_pages_reused_after_a_free")]
        for extra, prealloc in ((0, False), (2, True)):
            for folder, scenario in cases:
                ring = type("Ring", (RingCache,), {"extra": extra, "prealloc": prealloc})
                with self.subTest(scenario=scenario, extra=extra, prealloc=prealloc), \
                        tempfile.TemporaryDirectory() as work:
                    result, done = drive(scenario, work, ring, folder)
                    self.assertIsNone(result.error, result)
                    self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                    trace = json.load(open(os.path.join(work, "trace", "manifest.json")))
                    self.assertEqual(trace["steps"][0]["layers"][0]["paged"]["ring"],
                                     kvtrace.Export(os.path.join(work, "export")).layer_policy(0)["window"] + extra)
        shifted = type("Shifted", (RingCache,), {"place_shift": 1, "prealloc": True})
        with tempfile.TemporaryDirectory() as work:
            result, done = drive("paged_window_2b", work, shifted)
            self.assertIsNone(result.error, result)
            self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
            self.assertRegex(done.stdout, r"token 0 was written to slot \d+, but its table entry says slot \d+")
            self.assertIn("class: slot mapping wrong", done.stdout)

    def test_a_slot_mapping_from_the_append_not_the_row_is_named(self):
        # The runner's bug: slots from the token's place in this append, not its index in the
        # row; the first decode writes token 13 over token 0's slot.
        class FromAppend(BlockManagerCache):
            def slot_mapping(self, layer, row, first, count):
                table = self.block_table(layer, row)
                return [table[j // self.B] * self.B + j % self.B for j in range(count)]

        with tempfile.TemporaryDirectory() as work:
            export = os.path.join(work, "export")
            subprocess.run([KVCHECK, "export", os.path.join(SCENARIOS, "paged_fork_then_prefix_hit.json"), "--out",
                            export], check=True, capture_output=True)
            exp = kvtrace.Export(export)
            trace = os.path.join(work, "trace")
            kvtrace.drive_paged_cache(exp, lambda: FromAppend(exp), trace)
            done = verify("paged_fork_then_prefix_hit", trace)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("class: slot mapping wrong", done.stdout)
        self.assertIn("token 13 was written to slot", done.stdout)

    def test_a_poisoned_pool_names_the_block_a_hit_never_wrote(self):
        check_poison_is_named(self, "numpy")  # torch pools: test_kvtrace_torch.py

    def test_a_picture_of_block_ids_near_the_pool_end_stays_small(self):
        # A valid trace from a pool of 2^17 blocks whose manager hands out its highest ids
        # first: slot ids pass a million. verify --html must draw the slots held, not a
        # column as tall as the largest id (that took gigabytes), and label them by id.
        class HighIdsFirst(BlockManagerCache):
            def __init__(self, exp):
                super().__init__(exp)
                self.free_blocks = [list(range(self.N)) for _ in range(self.L)]  # highest id on top

        with open(os.path.join(SCENARIOS, "paged_fork_then_prefix_hit.json")) as f:
            scenario = json.load(f)
        scenario["paging"]["num_blocks"] = 1 << 17  # ids to 2^20: a column that tall took about a GB
        with tempfile.TemporaryDirectory() as work:
            path = os.path.join(work, "big_pool.json")
            with open(path, "w") as f:
                json.dump(scenario, f)
            export = os.path.join(work, "export")
            subprocess.run([KVCHECK, "export", path, "--out", export], check=True, capture_output=True)
            exp = kvtrace.Export(export)
            trace = os.path.join(work, "trace")
            result = kvtrace.drive_paged_cache(exp, lambda: HighIdsFirst(exp), trace)
            self.assertIsNone(result.error, result)
            page = os.path.join(work, "page.html")
            # Measured from a small Python of its own: a child forked from this one, which holds
            # the pools, would count their pages.
            measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
                       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
                       "sys.exit(done.returncode)")
            done = subprocess.run([sys.executable, "-c", measure, KVCHECK, "verify", path, "--trace", trace,
                                   "--html", page], capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            rss_kb = int(done.stderr.split()[-1])
            # The dense column took 4.5 GB; the sparse one 27 MB (about 250 under ASan's shadow).
            self.assertLess(rss_kb, 1_000_000, "verify --html took %d MB" % (rss_kb // 1000))
            with open(page) as f:
                html = f.read()
            self.assertLess(len(html), 200_000)
            self.assertRegex(html, r"slot 10485[0-9]{2}: uid")  # in the top blocks: up to 2^17 * 8 - 1

    def test_sharing_a_forked_block_without_copy_is_named(self):
        with tempfile.TemporaryDirectory() as work:
            done = verify("paged_fork_then_prefix_hit", trace_of("paged_fork_then_prefix_hit", work,
                                                                copy_on_write=False))
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("class: write to a shared block (copy-on-write missing)", done.stdout)
        self.assertRegex(done.stdout, r"first divergence: step 2 \(decode")

    def test_a_slot_mapping_that_disagrees_with_the_table_is_named(self):
        # Step 0 of paged_chunked_prefill writes 13 tokens of its one row into blocks of 4.
        for name, change, words in (
                ("another block", lambda m: m.__setitem__((0, 5), (m[0, 5] + 4) % 32),
                 "token 5 was written to slot"),
                ("one slot short", lambda m: m.__setitem__((0, 12), -1),
                 "the slot mapping gives 12 slots for the 13 tokens the row computed in this step")):
            with self.subTest(name), tempfile.TemporaryDirectory() as work:
                trace = trace_of("paged_chunked_prefill", work, dump="pool")
                path = os.path.join(trace, "step000_l1_slot_mapping.npy")
                mapping = np.load(path)
                self.assertEqual(mapping.dtype, np.int64)
                change(mapping)
                np.save(path, mapping)
                done = verify("paged_chunked_prefill", trace)
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn("layer 1 row 0", done.stdout)
                self.assertIn(words, done.stdout)
                self.assertIn("class: slot mapping wrong", done.stdout)

    def test_a_vllm_fp8_pool_passes_code_for_code_and_its_bugs_are_named(self):
        # quant_paged_fp8_prefix: the pools hold uint8 E4M3 codes; the trace carries them with
        # their scales and no float pools, and kvcheck dequantizes.
        for layout in ("NHD", "HND"):
            with self.subTest(layout=layout), tempfile.TemporaryDirectory() as work:
                result, done = self.drive("quant_paged_fp8_prefix", work, lambda exp: Fp8BlockManagerCache(exp, layout))
                self.assertIsNone(result.error)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                self.assertRegex(done.stdout, r"codes: [0-9]+ codes and their scales as the format's rules give")
                self.assertIn("paged bookkeeping", done.stdout)
                with open(os.path.join(work, "trace", "manifest.json")) as f:
                    step = json.load(f)["steps"][0]["layers"][0]["paged"]
                self.assertNotIn("key_cache", step)
                self.assertEqual(np.load(os.path.join(work, "trace", step["k_codes"])).dtype, np.uint8)
        for bug, words in (("scale_dropped_on_read", "class: scale not applied"),
                           ("scale_never_loaded", "class: quantization scale wrong")):
            with self.subTest(bug=bug), tempfile.TemporaryDirectory() as work:
                _, done = self.drive("quant_paged_fp8_prefix", work, lambda exp: Fp8BlockManagerCache(exp, bug=bug))
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn(words, done.stdout)

    def drive(self, scenario, work, make):
        return drive(scenario, work, make)

    def test_a_cache_that_raises_or_lacks_an_op_fails_at_that_step(self):
        class ThreeBlocks(BlockManagerCache):  # the scenario's first step needs five
            def __init__(self, exp):
                super().__init__(exp)
                self.free_blocks = [f[-3:] for f in self.free_blocks]

            def allocate_block(self, l):
                if not self.free_blocks[l] and not self.cached[l]:
                    raise RuntimeError("no free block in layer %d" % l)
                return super().allocate_block(l)

        class NoSwap(BlockManagerCache):
            swap_out = None

        for scenario, make, step, words in (
                ("paged_evict_then_repeat", ThreeBlocks, 0, "RuntimeError: no free block in layer 0"),
                ("paged_preempt_swap_and_recompute", NoSwap, 6, "the cache has no swap_out()")):
            with self.subTest(scenario), tempfile.TemporaryDirectory() as work:
                result, done = self.drive(scenario, work, make)
                self.assertIn(words, result.error)
                self.assertEqual(result.error_step, step)
                self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
                self.assertIn("step %d" % result.error_step, done.stdout)
                self.assertIn(words, done.stdout)

    def test_an_unpaged_export_is_a_usage_error_and_writes_nothing(self):
        with tempfile.TemporaryDirectory() as work:
            export = os.path.join(work, "export")
            subprocess.run([KVCHECK, "export", os.path.join(SCENARIOS, "sliding_baseline.json"), "--out", export],
                           check=True, capture_output=True)
            exp = kvtrace.Export(export)
            with self.assertRaisesRegex(kvtrace.UsageError, "not a paged scenario"):
                kvtrace.drive_paged_cache(exp, lambda: None, os.path.join(work, "trace"))
            self.assertEqual(sorted(os.listdir(work)), ["export"])

    def verify_edited(self, name, edit, dump="pool"):
        """verify of paged_chunked_prefill's trace after edit(array) changed one of its files."""
        with tempfile.TemporaryDirectory() as work:
            trace = trace_of("paged_chunked_prefill", work, dump=dump)
            path = os.path.join(trace, name)
            array = np.load(path)
            np.save(path, edit(array))
            return verify("paged_chunked_prefill", trace)

    def test_bad_tables_slots_and_hits_are_bad_input(self):
        def set_at(index, value):
            def edit(a):
                a[index] = value
                return a
            return edit
        for name, edit, words in (
                ("step000_l0_slot_mapping.npy", set_at((0, 2), 32),
                 "step000_l0_slot_mapping.npy: entry [0][2] is 32: expected -1 (padding) or a slot below 32"),
                ("step000_l0_hit_tokens.npy", lambda a: np.array([-4], np.int32),
                 "step000_l0_hit_tokens.npy: row 0 has -4 hit tokens: expected 0 or more"),
                ("step000_l0_block_table.npy", set_at((0, 0), 99),
                 "step000_l0_block_table.npy: entry [0][0] is 99: expected -1 (null) or a block id below 8"),
                ("step000_l0_block_table.npy", lambda a: a.astype(np.float32),
                 "step000_l0_block_table.npy: expected dtype |i1, |u1, <i4 or <i8 (integers), got <f4")):
            with self.subTest(name=name, words=words):
                done = self.verify_edited(name, edit)
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(words, done.stderr)
        # Only the referenced blocks dumped: the table must stay among them, each listed once.
        for name, edit, words in (
                ("step000_l1_block_table.npy", set_at((0, 3), 7),
                 "step000_l1_block_table.npy: entry [0][3] is 7: expected -1 (null) or a block that block_ids lists"),
                ("step000_l1_block_ids.npy", set_at(1, 0), "step000_l1_block_ids.npy: block 0 is listed twice"),
                ("step000_l1_block_ids.npy", lambda a: a[:-1],
                 "step000_l1_block_ids.npy: expected block ids of shape [4], one per row of the pools")):
            with self.subTest(name=name, words=words):
                done = self.verify_edited(name, edit, dump="referenced")
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(words, done.stderr)

    def test_a_ring_where_none_can_be_is_bad_input(self):
        # SPEC 8.9: "ring" holds a sliding layer's window, at least W places, never shared, in
        # every step of the layer. Each case sets it at (step, layer) of a trace without rings.
        for scenario, step, layer, ring, words in (
                ("paged_chunked_prefill", 0, 0, 8, "/steps/0/layers/0/paged/ring: a ring holds a sliding layer's "
                                                   "window, and this layer's policy is not sliding"),
                ("paged_window_2b", 0, 0, 7, "/steps/0/layers/0/paged/ring: expected the ring's places, an integer "
                                             "from the window 8 to 2^30, got 7"),
                ("paged_window_2b", 0, 0, "8", "/steps/0/layers/0/paged/ring: expected the ring's places"),
                ("paged_gemma_hybrid_prefix", 0, 0, 8, "/steps/0/layers/0/paged/ring: a ring's pages are overwritten "
                                                       "in place and cannot be shared: not with prefix_cache"),
                ("paged_window_2b", 1, 0, 8, "/steps/1/layers/0/paged/ring: expected no ring (logical blocks), as "
                                             "/steps/0/layers/0 gives: a layer keeps one layout")):
            with self.subTest(scenario=scenario, step=step, ring=ring), tempfile.TemporaryDirectory() as work:
                trace = trace_of(scenario, work, "NHD")
                path = os.path.join(trace, "manifest.json")
                manifest = json.load(open(path))
                manifest["steps"][step]["layers"][layer]["paged"]["ring"] = ring
                json.dump(manifest, open(path, "w"))
                done = verify(scenario, trace)
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(words, done.stderr)

    def test_bad_codes_in_a_pool_are_bad_input(self):
        def edited(change_manifest=None, name=None, edit=None, scenario="quant_paged_fp8_prefix"):
            with tempfile.TemporaryDirectory() as work:
                self.drive("quant_paged_fp8_prefix", work, lambda exp: Fp8BlockManagerCache(exp))
                trace = os.path.join(work, "trace")
                if name:
                    path = os.path.join(trace, name)
                    np.save(path, edit(np.load(path)))
                path = os.path.join(trace, "manifest.json")
                with open(path) as f:
                    m = json.load(f)
                m["scenario"] = scenario
                if change_manifest:
                    change_manifest(m["steps"][0]["layers"][0]["paged"])
                with open(path, "w") as f:
                    json.dump(m, f)
                return verify(scenario, trace)
        for what, done, words in (
                ("scales left out", edited(lambda p: p.pop("k_scales")),
                 "/steps/0/layers/0/paged/k_scales: expected a file name: codes and scales come together"),
                ("neither codes nor a pool", edited(lambda p: (p.pop("v_codes"), p.pop("v_scales"))),
                 "/steps/0/layers/0/paged/value_cache: missing required field (a file name)"),
                ("codes of another head_dim", edited(name="step000_l0_k_codes.npy", edit=lambda a: a[..., :8]),
                 "step000_l0_k_codes.npy: expected codes of shape"),
                ("a scale per element", edited(name="step000_l0_k_scales.npy",
                                               edit=lambda a: np.repeat(a, 16, axis=-1)),
                 "step000_l0_k_scales.npy: expected scales of shape"),
                ("codes for an unquantized scenario", edited(scenario="paged_fork_then_prefix_hit"),
                 "/steps/0/layers/0/paged/k_codes: the scenario quantizes no K: codes need its kv_quant")):
            with self.subTest(what):
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn(words, done.stderr)

    def test_int64_tables_from_torch_are_read(self):
        done = self.verify_edited("step000_l0_block_table.npy", lambda a: a.astype(np.int64))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

if __name__ == "__main__":
    unittest.main()
