"""kvtrace for paged caches (SPEC 8): drive_paged_cache plays vLLM's model runner over a
`kvcheck export` and writes a kvcheck-trace-1 whose layers carry "paged" (SPEC 8.9).

The cache under test is the block manager with its pools, as a serving engine splits them;
the driver is the runner: it asks the cache for a prefix hit when a row starts, for room
before each forward, rotates keys at their token index, writes them (and values) into the
pools at the slot mapping, runs attention by reading the pools through the block tables,
and dumps pools, tables, refcounts, hits and slot mappings after every step. What a cache
must offer (rows are batch indices; a method it lacks is a finding when a step needs it):

    block_size                       int (attribute)
    layout                           "NHD" ([blocks, B, Hkv, D], vLLM) or "HND" ([blocks, Hkv, B, D],
                                     FlashInfer) (attribute, default "NHD")
    key_cache(layer), value_cache(layer)   the pools: torch tensors or NumPy arrays, written in place
    block_table(layer, row)          block ids of the row's logical blocks, -1 (or None) for null
    start(row, ids, extra) -> int    a row begins (empty before): tokens taken from the prefix index,
                                     whole blocks; the table then holds those blocks
    allocate(row, ids)               room for the row's next len(ids) tokens, copying shared blocks
                                     they would write into
    finish(row)                      after each forward: register full blocks, free what left a window;
                                     finish(row, ends) when it takes `ends`: True after the row's last
                                     forward before a free (its request finished there)
    fork(rows_from)                  `reorder`: new row i continues old row rows_from[i], sharing blocks
    free(row); evict(count)          `free`; `evict` (count None: every cached block)
    swap_out(row); swap_in(row)      `preempt` / `resume` with mode "swap"
    refcount(layer)                  optional: [blocks]
    slot_mapping(layer, row, first, count)  optional: the slots for tokens first .. first + count - 1
                                     (default: from the table, as vLLM's runner computes it)
    ring(layer) -> int or None       optional: a sliding layer kept as a ring of R places: token t
                                     at place t % R, in slot table[p // B] * B + p % B; a token a later
                                     one of the same forward overwrites may get slot -1 (not stored),
                                     and attention reads the forward's own tokens from its inputs

A quantized cache (SPEC 9, vLLM's kv_cache_dtype fp8) owns how its pools are written and
read, as vLLM's reshape_and_cache and attention kernels do; it then offers:

    write_kv(layer, slots, k, v)     store rotated keys and values ([n, Hkv, D] float64) at the slots
    read_kv(layer) -> (keys, values)   the pools as its attention reads them: floats in the pool layout
    kv_codes(layer) -> dict          k_codes, k_scales (k_zero), v_codes, v_scales (v_zero) in the pool
                                     layout ([blocks, B, Hkv, D] and [blocks, B, Hkv, groups] in NHD):
                                     dumped instead of key_cache and value_cache

A cache whose own update() writes its pools (transformers' continuous batching) offers

    write_tokens(layer, row, first, slots, k, v)   store the row's tokens first .. first + n - 1
                                     (rotated keys and values [n, Hkv, D] float64) at the slots

`preempt` with mode "recompute" frees the row; `resume` starts it again with its whole
history (prompt and generated ids) and recomputes what was not hit, without outputs.

    exp = kvtrace.Export("out/paged_fork_then_prefix_hit")
    kvtrace.drive_paged_cache(exp, lambda: MyBlockManager(exp), "trace/")
    # then: kvcheck verify fixtures/scenarios/paged_fork_then_prefix_hit.json --trace trace/
"""

import inspect

import numpy as np

from kvtrace_base import DriveResult, TraceWriter, UsageError, rotate, to_numpy


class _Failed(Exception):
    """The cache failed at a step (written into the trace); driving stops."""


class _PagedDriver:
    def __init__(self, export, make_cache, writer, dump):
        if "paging" not in export.manifest:
            raise UsageError("%s is not a paged scenario (no \"paging\" in its export): drive it with "
                                     "drive_hf_cache" % export.name)
        if any(export.layer_policy(l)["type"] == "sink" for l in range(export.dims["layers"])):
            raise UsageError("drive_paged_cache drives full and sliding layers (kvcheck refuses paging with "
                                     "a sink policy)")
        if any(export.layer_policy(l)["type"] == "chunked" for l in range(export.dims["layers"])):
            raise UsageError("drive_paged_cache does not drive chunked attention (SPEC 10.2) yet")
        if export.manifest.get("attention", {}).get("query_temperature"):
            raise UsageError("drive_paged_cache does not apply a query temperature (SPEC 10.3) yet")
        if dump not in ("referenced", "pool"):
            raise UsageError("dump must be \"referenced\" or \"pool\", got %r" % (dump,))
        self.exp, self.make, self.writer, self.dump = export, make_cache, writer, dump
        self.result = DriveResult()
        self.L, self.H = export.dims["layers"], export.dims["heads"]
        self.Hkv, self.D = export.dims["kv_heads"], export.dims["head_dim"]

    # -- the cache's methods, failures written as the step's error ---------------------------

    def call(self, index, method, *args):
        function = getattr(self.cache, method, None)
        if not callable(function):
            self.fail(index, "the cache has no %s()" % method)
        try:
            return function(*args)
        except UsageError:
            raise
        except Exception as e:
            self.fail(index, "%s: %s" % (type(e).__name__, e))

    def fail(self, index, message):
        self.writer.error_step(message)
        self.result.error, self.result.error_step = message, index
        raise _Failed()

    def table(self, index, layer, row):
        entries = self.call(index, "block_table", layer, row)
        return [-1 if e is None else int(e) for e in to_numpy(entries).reshape(-1).tolist()] \
            if entries is not None and len(entries) else []

    # -- running -------------------------------------------------------------------------------

    def run(self):
        self.new_cache(self.exp.dims["batch"])
        for index, step in enumerate(self.exp.steps):
            if self.result.error is not None:
                self.writer.skip_step()
                continue
            try:
                self.step(index, step)
            except _Failed:
                pass
        self.result.recorded = sum(1 for s in self.writer.manifest["steps"] if "layers" in s)
        return self.result

    def new_cache(self, batch):
        self.cache = self.make()
        self.B = int(getattr(self.cache, "block_size"))
        self.rings = {}  # layer -> the cache's ring(layer), asked once
        finish = getattr(self.cache, "finish", None)
        self.takes_ends = callable(finish) and "ends" in inspect.signature(finish).parameters
        self.layout = getattr(self.cache, "layout", "NHD")
        if self.layout not in ("NHD", "HND"):
            raise UsageError("the cache's layout is %r: expected \"NHD\" or \"HND\"" % (self.layout,))
        # Per row: the uids and ids it holds (a recompute rebuilds from them), its extras.
        self.rows = [{"uids": [], "ids": [], "extra": {}} for _ in range(batch)]
        self.preempted = {}

    def step(self, index, step):
        op = step["op"]
        self.hits, self.slots = None, None
        if op == "append":
            return self.append(index, step)
        if op == "reset":
            self.new_cache(step.get("batch", len(self.rows)))
            return self.writer.skip_step()
        if op == "reorder":
            self.call(index, "fork", list(step["rows_from"]))
            self.rows = [dict(self.rows[r], uids=list(self.rows[r]["uids"]), ids=list(self.rows[r]["ids"]))
                         for r in step["rows_from"]]
        elif op == "free":
            for r in step["rows_freed"]:
                self.call(index, "free", r)
                self.rows[r] = {"uids": [], "ids": [], "extra": {}}
        elif op == "evict":
            self.call(index, "evict", None if step["blocks"] < 0 else step["blocks"])
        elif op == "preempt":
            for r in step["rows_preempted"]:
                self.preempted[r] = step["mode"]
                self.call(index, "swap_out" if step["mode"] == "swap" else "free", r)
        elif op == "resume":
            for r in step["rows_preempted"]:
                if self.preempted.pop(r) == "swap":
                    self.call(index, "swap_in", r)
                else:
                    self.recompute(index, r)
        else:
            self.writer.skipped_step("drive_paged_cache does not drive %s" % op)
            self.result.skipped.append((index, "drive_paged_cache does not drive %s" % op))
            self.result.error, self.result.error_step = "stopped at %s" % op, index
            return
        self.record(index, None)

    def append(self, index, step):
        rows, n = step["rows"], step["chunk"]
        forward = step.get("forward") or n
        self.hits = [0] * len(rows)
        self.slots = [[[] for _ in rows] for _ in range(self.L)]
        # Tokens each row computes: those after its hit; a row that starts asks for one first.
        todo = []
        for b, r in enumerate(rows):
            row = self.rows[b]
            if r["uids"] and not row["uids"]:
                row["extra"] = r.get("extra") or {}
                self.hits[b] = self.start(index, b, r["ids"], row["extra"])
            todo.append((len(row["uids"]) + self.hits[b], r))
            row["uids"] += r["uids"]
            row["ids"] += r["ids"]
        out = np.full((self.L, len(rows), self.H, n, self.D), np.nan)
        q_rot = np.zeros_like(out)
        for begin in range(0, max([len(r["uids"]) for r in rows] + [0]), forward):
            work = []
            for b, (first, r) in enumerate(todo):
                start = len(self.rows[b]["uids"]) - len(r["uids"])  # the append's first token index
                lo, hi = max(first, start + begin), min(start + begin + forward, len(self.rows[b]["uids"]))
                if lo < hi:
                    self.call(index, "allocate", b, self.rows[b]["ids"][lo:hi])
                    work.append((b, lo, hi, n - len(r["uids"]) - start))  # place of token t: t + offset
            for l in range(self.L):
                # A ring's attention reads what was cached before the forward's writes (which may
                # overwrite the places of keys its earlier queries see) and the forward's own keys.
                before = self.pools_now(index, l) if self.ring(index, l) else None
                for b, lo, hi, _ in work:
                    self.write(index, l, b, lo, hi)
                for b, lo, hi, offset in work:
                    o, q = self.attend(index, l, b, lo, hi, before)
                    out[l, b, :, lo + offset:hi + offset], q_rot[l, b, :, lo + offset:hi + offset] = o, q
            for b, _, hi, _ in work:
                # The forward holding the row's last token of the step: its request may end there.
                if self.takes_ends and hi == len(self.rows[b]["uids"]):
                    self.call(index, "finish", b, self.ends_after(index, b))
                else:
                    self.call(index, "finish", b)
        self.record(index, (out, q_rot))

    def ends_after(self, index, b):
        """Whether row b's next op after step `index` frees it (or resets the batch): then its
        request finished in this step's last forward, as a serving engine sees it."""
        for step in self.exp.steps[index + 1:]:
            op = step["op"]
            if op == "reset" or op == "free" and b in step["rows_freed"]:
                return True
            if op == "reorder":  # a row it does not keep ends; one it keeps (or forks) goes on
                return b not in step["rows_from"]
            if op == "preempt" and b in step["rows_preempted"] or \
                    op == "append" and b < len(step["rows"]) and step["rows"][b]["uids"]:
                return False
        return False

    def start(self, index, row, ids, extra):
        hit = self.call(index, "start", row, list(ids), dict(extra))
        try:
            return int(hit or 0)
        except (TypeError, ValueError):
            self.fail(index, "start() returned %r, expected the number of tokens hit" % (hit,))

    def recompute(self, index, b):
        """resume after a recompute preemption: the row starts again with its whole history."""
        row = self.rows[b]
        hit = self.start(index, b, row["ids"], row["extra"])
        if row["uids"][hit:]:
            self.call(index, "allocate", b, row["ids"][hit:])
            for l in range(self.L):
                self.write(index, l, b, hit, len(row["uids"]))
            self.call(index, "finish", b)

    def ring(self, index, l):
        """The places of layer l's ring (SPEC 8.9), or None: its table holds logical blocks."""
        if not hasattr(self.cache, "ring"):
            return None
        if l not in self.rings:
            places = self.call(index, "ring", l)
            self.rings[l] = int(places) if places else None
        return self.rings[l]

    def place(self, index, l, t):
        ring = self.ring(index, l)
        return t % ring if ring else t

    def pools_now(self, index, l):
        """Copies of layer l's pools as floats (as its attention reads them), in NHD."""
        if hasattr(self.cache, "read_kv"):
            keys, values = (to_numpy(x).astype(np.float64) for x in self.call(index, "read_kv", l))
        else:
            keys = to_numpy(self.call(index, "key_cache", l)).astype(np.float64)
            values = to_numpy(self.call(index, "value_cache", l)).astype(np.float64)
        if self.layout == "HND":
            keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        return keys, values

    def write(self, index, l, b, lo, hi):
        """reshape_and_cache: rotated keys and values of tokens lo .. hi - 1 into their slots."""
        uids = self.rows[b]["uids"][lo:hi]
        ring = self.ring(index, l)
        if hasattr(self.cache, "slot_mapping"):
            slots = [int(s) for s in to_numpy(self.call(index, "slot_mapping", l, b, lo, hi - lo)).reshape(-1)]
        else:
            table = self.table(index, l, b)
            places = [self.place(index, l, t) for t in range(lo, hi)]
            # A ring stores only the newest token of each place among the forward's.
            slots = [table[p // self.B] * self.B + p % self.B
                     if p // self.B < len(table) and table[p // self.B] >= 0 and not (ring and t + ring < hi)
                     else -1 for t, p in zip(range(lo, hi), places)]
        if self.slots is not None:
            self.slots[l][b] += slots
        k = rotate(self.exp.k[l][uids], np.arange(lo, hi)[:, None], self.exp.layer_rope(l))  # [n, Hkv, D]
        v = self.exp.v[l][uids]
        keys, values = self.call(index, "key_cache", l), self.call(index, "value_cache", l)
        blocks = int(keys.shape[0])
        for j, slot in enumerate(slots):
            overwritten = ring and slot == -1 and lo + j + ring < hi  # a later token of the forward takes its place
            if not 0 <= slot < blocks * self.B and not overwritten:
                self.fail(index, "layer %d row %d: token %d has no slot (%d) to be written to" % (l, b, lo + j, slot))
        if hasattr(self.cache, "write_tokens"):  # the cache's own update() writes (and needs the row)
            self.call(index, "write_tokens", l, b, lo, slots, k, v)
            return
        stored = [j for j, slot in enumerate(slots) if slot >= 0]  # a ring's overwritten tokens are not
        slots, k, v = [slots[j] for j in stored], k[stored], v[stored]
        if hasattr(self.cache, "write_kv"):  # the cache quantizes as it stores
            self.call(index, "write_kv", l, slots, k, v)
            return
        for pool, x in ((keys, k), (values, v)):
            block, offset = np.array(slots, np.int64) // self.B, np.array(slots, np.int64) % self.B
            if hasattr(pool, "detach"):  # torch: index with tensors, values in the pool's dtype
                import torch
                block, offset = torch.as_tensor(block), torch.as_tensor(offset)
                x = torch.as_tensor(x).to(pool.dtype)
            if self.layout == "NHD":
                pool[block, offset] = x
            else:
                pool[block, :, offset] = x

    def attend(self, index, l, b, lo, hi, before=None):
        """Paged attention of tokens lo .. hi - 1: keys read through the row's table; a key
        whose entry is null (or past the table) is not read. A ring (`before`: its pools as
        the forward found them) reads the tokens before lo there and the forward's own keys
        and values from its inputs, as transformers' ring does (read before write)."""
        policy = self.exp.layer_policy(l)
        window = policy["window"] if policy["type"] == "sliding" else None
        table = self.table(index, l, b)
        keys, values = before if before is not None else self.pools_now(index, l)
        uids = self.rows[b]["uids"]
        group = self.H // self.Hkv
        q = rotate(self.exp.q[l][uids[lo:hi]], np.arange(lo, hi)[:, None], self.exp.layer_rope(l))  # [n, H, D]
        if before is not None:
            own_k = rotate(self.exp.k[l][uids[lo:hi]], np.arange(lo, hi)[:, None], self.exp.layer_rope(l))
            own_v = self.exp.v[l][uids[lo:hi]]
        out = np.full((hi - lo, self.H, self.D), np.nan)
        for j, t in enumerate(range(lo, hi)):
            i = np.arange(0 if window is None else max(0, t - window + 1), t + 1)
            if before is not None:
                cached = i[i < lo]
                places = np.array([self.place(index, l, int(x)) for x in cached], np.int64)
                entry = np.array([table[p // self.B] if p // self.B < len(table) else -1 for p in places], np.int64)
                read = entry >= 0
                k = np.concatenate([keys[entry[read], places[read] % self.B], own_k[i[i >= lo] - lo]])
                v = np.concatenate([values[entry[read], places[read] % self.B], own_v[i[i >= lo] - lo]])
                k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            else:
                logical = i // self.B
                entry = np.array([table[x] if x < len(table) else -1 for x in range(int(logical.max()) + 1)])[logical]
                read = entry >= 0
                if not read.any():
                    continue
                k = np.repeat(keys[entry[read], i[read] % self.B], group, axis=1)  # [S, H, D]
                v = np.repeat(values[entry[read], i[read] % self.B], group, axis=1)
            scores = np.einsum("shd,hd->hs", k, q[j]) * self.exp.scale
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[j] = np.einsum("hs,shd->hd", w / w.sum(axis=1, keepdims=True), v)
        return out.transpose(1, 0, 2), q.transpose(1, 0, 2)

    def record(self, index, outputs):
        batch = len(self.rows)
        layers = []
        for l in range(self.L):
            tables = [self.table(index, l, b) for b in range(batch)]
            width = max([1] + [len(t) for t in tables])
            table = np.full((batch, width), -1, np.int32)
            for b, t in enumerate(tables):
                table[b, :len(t)] = t
            paged = {"block_size": self.B, "layout": self.layout, "block_table": table, "ring": self.ring(index, l)}
            # A quantized pool is dumped as its codes and scales (kvcheck dequantizes them).
            if hasattr(self.cache, "kv_codes"):
                pools = dict(self.call(index, "kv_codes", l))
            else:
                pools = {"key_cache": self.call(index, "key_cache", l), "value_cache": self.call(index, "value_cache", l)}
            if self.dump == "referenced":  # only the blocks the tables reach (SPEC 8.9's block_ids)
                ids = np.unique(table[table >= 0]).astype(np.int64)
                paged["block_ids"] = ids
                pools = {name: to_numpy(x)[ids] for name, x in pools.items()}
            paged.update(pools)
            if hasattr(self.cache, "refcount"):
                paged["refcount"] = np.asarray(to_numpy(self.call(index, "refcount", l)), np.int32)
            if self.hits is not None:
                paged["hit_tokens"] = np.array(self.hits, np.int32)
            if self.slots is not None:
                mapping = np.full((batch, max([1] + [len(s) for s in self.slots[l]])), -1, np.int64)
                for b, s in enumerate(self.slots[l]):
                    mapping[b, :len(s)] = s
                paged["slot_mapping"] = mapping
            layer = {"paged": paged}
            if outputs is not None:
                layer["out"], layer["q"] = outputs[0][l], outputs[1][l]
            layers.append(layer)
        self.writer.step(layers)


def drive_paged_cache(export, make_cache, trace_path, producer="kvtrace.drive_paged_cache", dtype="float32",
                      dump="referenced"):
    """Drives a paged cache (see the module's docstring for what it must offer) over an
    export's schedule and writes the trace; returns a DriveResult. make_cache() gives
    a fresh cache (called again at a `reset`). A failure of the cache is written into the
    trace at its step, and driving stops there. dump: "referenced" writes the blocks the
    tables reference (with block_ids), "pool" the whole pools after every step."""
    export.refuse_prune("drive_paged_cache")
    with TraceWriter(trace_path, export.name, producer, "absolute", dtype=dtype) as writer:
        return _PagedDriver(export, make_cache, writer, dump).run()
