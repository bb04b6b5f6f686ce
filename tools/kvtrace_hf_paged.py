"""kvtrace for transformers 5's continuous batching: its PagedAttentionCache, driven as a
SPEC 8 paged cache by kvtrace.drive_paged_cache.

transformers' ContinuousBatchingManager runs a scheduler, an IO builder and the model in a
thread of its own. ContinuousBatchingCache makes the calls they make on the cache, in their
order, for the driver's ops (paths under transformers/generation/continuous_batching/ of
5.25.0):

    start      RequestState, then search_prefix_match                   scheduler.py:119-133
    allocate   can_store_request_tokens, count_new_complete_blocks      scheduler.py:242-263
               (no room: evict_cached_blocks, then once more)           offloading_manager.py:167
    write      the layer's allocator.update(k, v, layer, read, write):  cache.py:416-451
               the model's own write; its read index is checked
    finish     position_offset += q; a request whose last forward this   input_outputs.py:392,
               was is FINISHED (the row is freed next); then            continuous_api.py:564-574
               mark_complete_blocks (hashes full blocks, trades one for
               an equal block it holds: 8.4)
    fork       prepare_fork_request, perform_cache_copy, state.fork     continuous_api.py:579-604
    free       free_blocks; evict: evict_cached_blocks (every cached    scheduler.py:82,
               block: the cache has no partial eviction)                cache.py:382-392
    swap       the offloading path without pinned memory (CPU-only torch cannot pin)

Every decision (hits, blocks, hashes, forks, frees) and every write of keys and values is
transformers' code; this module translates. What the cache cannot be asked is refused
before anything runs (UsageError): token-granular reuse, adapters and salts (its block hash
is the token ids alone), prefix sharing beside a sliding layer (the cache turns it off),
sliding layers of different windows, and kv_quant. Its sliding layers are rings of W places
(token t at place t % W), which the trace declares (SPEC 8.9's `ring`).

    exp = kvtrace.Export("out/paged_chunked_prefill")
    kvtrace.drive_paged_cache(exp, lambda: ContinuousBatchingCache(exp), "trace/")
"""
import logging

import numpy as np
import torch
from transformers import LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from kvtrace_base import UsageError

# Without psutil the cache logs an error while it sizes CPU memory; the sizes are ours.
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ContinuousBatchingCache:
    """transformers 5's PagedAttentionCache behind kvtrace_paged's interface (NHD pools)."""

    layout = "NHD"

    def __init__(self, export, check_reads=True):
        d, p = export.dims, export.manifest["paging"]
        self.exp, self.check_reads = export, check_reads
        self.block_size = self.B = p["block_size"]
        self.L = d["layers"]
        if p.get("reuse", "full") != "full":
            raise UsageError("transformers' continuous batching reuses whole blocks only, not reuse \"token\"")
        if export.manifest.get("kv_quant"):
            raise UsageError("transformers' continuous batching stores keys and values in the model's dtype: "
                             "no kv_quant")
        for step in export.steps:
            for r in step.get("rows", []):
                if any((r.get("extra") or {}).get(k) for k in ("adapter", "salt")):
                    raise UsageError("transformers' continuous batching has no adapter or cache salt per request: "
                                     "its block hash is the token ids alone (cache_allocator.py:25-31)")
        policies = [export.layer_policy(l) for l in range(self.L)]
        windows = sorted({pol["window"] for pol in policies if pol["type"] == "sliding"})
        if len(windows) > 1:
            raise UsageError("transformers' config has one sliding_window for every sliding layer, the scenario "
                             "has %s" % windows)
        self.W = windows[0] if windows else None
        self.prefix = bool(p.get("prefix_cache", False))
        if self.W and self.prefix:
            raise UsageError("transformers turns prefix sharing off when a layer is sliding (cache.py:215-217)")
        config = LlamaConfig(vocab_size=256, hidden_size=d["heads"] * d["head_dim"], num_hidden_layers=self.L,
                             num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                             head_dim=d["head_dim"], max_position_embeddings=1 << 20)
        config.layer_types = ["sliding_attention" if pol["type"] == "sliding" else "full_attention"
                              for pol in policies] if self.W else None
        config.sliding_window = self.W
        config._attn_implementation = "paged|eager"
        self.dtype = DTYPES[export.manifest.get("kv_dtype", "float32")]
        # kvcheck's prefix_cache is transformers' allow_block_sharing, its one switch (forks then copy
        # full blocks too). max_memory_percent is what the manager's resolve_continuous_batching_config
        # fills in; left None, the cache's sizing raises.
        batching = ContinuousBatchingConfig(page_size=self.B, num_blocks=p["num_blocks"], max_batch_tokens=256,
                                            max_memory_percent=0.5, max_blocks_per_request=0,
                                            allow_block_sharing=self.prefix, use_cuda_graph=False,
                                            use_async_batching=False)
        self.cache = PagedAttentionCache(config, batching, torch.device("cpu"), DistributedHelper(None, None),
                                         dtype=self.dtype)
        self.rows, self.pending, self.swapped, self.restored = {}, {}, {}, {}
        self.requests = 0

    # -- what the driver reads ----------------------------------------------------------------------

    def allocator(self, layer):
        return self.cache.layer_to_allocator[layer]

    def pools(self, layer):
        """The layer's keys and values as [blocks, B, Hkv, D] views of the one cache tensor: block b's page
        of this layer starts at row b * block_physical_stride of the layer's view (full_attention.py:64-107)."""
        a = self.allocator(layer)
        views = []
        for view in a._kv_token_views[layer]:
            hkv, dim = view.shape[1], view.shape[2]
            blocks = (view.shape[0] - a.tokens_per_page) // a.block_physical_stride + 1
            views.append(view.as_strided((blocks, a.tokens_per_page, hkv, dim),
                                         (a.block_physical_stride * hkv * dim, hkv * dim, dim, 1),
                                         view.storage_offset()))
        return views

    def key_cache(self, layer):
        return self.pools(layer)[0]

    def value_cache(self, layer):
        return self.pools(layer)[1]

    def ring(self, layer):
        """A sliding layer's ring of W places (sliding_attention.py:81-92); None for a full layer."""
        return self.W if self.allocator(layer).layer_type == "sliding_attention" else None

    def block_table(self, layer, row):
        """The allocator's table: a full layer's logical blocks, a sliding layer's ring pages."""
        if row not in self.rows:
            return []
        return list(self.allocator(layer).block_table.get(self.rows[row].request_id, []))

    def refcount(self, layer):
        a = self.allocator(layer)
        counts = np.zeros(self.key_cache(layer).shape[0], np.int32)
        for table in a.block_table.values():
            for block in table:
                counts[block] = a.ledger.shared_ref_counts.get(block, 1)
        return counts

    # -- the block manager --------------------------------------------------------------------------

    def start(self, row, ids, extra):
        self.requests += 1
        state = RequestState(request_id="row%d.%d" % (row, self.requests), initial_tokens=list(ids),
                             max_new_tokens=None)
        hit = self.cache.search_prefix_match(state.request_id, list(ids)) if self.cache.use_prefix_sharing else 0
        state.position_offset = hit
        self.rows[row] = state
        return hit

    def allocate(self, row, ids):
        state = self.rows[row]
        # mark_complete_blocks hashes initial_tokens + generated_tokens: every id the row holds is there.
        known = state.initial_tokens + state.generated_tokens
        first = state.position_offset
        if first + len(ids) > len(known):
            state.initial_tokens = state.initial_tokens + list(ids)[len(known) - first:]
        state.tokens_to_process = list(ids)
        self.cache.pool.try_to_free_sectors()
        if not self.cache.can_store_request_tokens(state, len(ids)):
            self.cache.evict_cached_blocks()
            self.cache.pool.try_to_free_sectors()
            if not self.cache.can_store_request_tokens(state, len(ids)):
                raise RuntimeError("can_store_request_tokens: no room for %d more tokens" % len(ids))
        complete = self.cache.count_new_complete_blocks(state, len(ids))
        for name, count in self.restored.pop(row, {}).items():  # re-hashed after a swap (offloading_manager.py:270)
            complete[name] = complete.get(name, 0) + count
        self.pending[row] = (complete, len(ids))

    def slot_mapping(self, layer, row, first, count):
        a = self.allocator(layer)
        slots = []
        for physical in a.get_write_indices(self.rows[row].request_id, first, count):
            if physical == a.write_trash_index:  # a ring's token that a later one of the chunk overwrites
                slots.append(-1)
                continue
            block, offset = divmod(int(physical), a.block_physical_stride)
            if offset >= self.B:
                raise RuntimeError("write index %d is in no page of layer %d" % (physical, layer))
            slots.append(block * self.B + offset)
        return slots

    def write_tokens(self, layer, row, first, slots, k, v):
        """The model's cache.update for the row's tokens first .. first + n - 1: transformers writes
        its own cache. Its read index, which gathers what attention sees, must name the slots the
        table gives the tokens it reads (the driver's own attention reads the pools through the
        tables, so a read path that strays from them would go unseen)."""
        a = self.allocator(layer)
        rid, count = self.rows[row].request_id, len(slots)
        write = a.get_write_indices(rid, first, count)
        read = a.get_read_indices(rid, first, count) if first else []
        a.update(torch.as_tensor(np.asarray(k)).to(self.dtype), torch.as_tensor(np.asarray(v)).to(self.dtype),
                 layer, torch.tensor(read, dtype=torch.long), torch.tensor(write, dtype=torch.long))
        if not self.check_reads or not first:
            return
        table, stride = a.block_table[rid], a.block_physical_stride
        sliding = a.layer_type == "sliding_attention"

        def physical(t):  # a full layer's token t, or a sliding layer's ring slot t % W (sliding_attention.py:81-92)
            place = t % self.W if sliding else t
            return table[place // self.B] * stride + place % self.B

        # Full layers read the whole row after the write; sliding ones the min(first, W - 1) newest
        # cached tokens, oldest first, then one sentinel row per new token (sliding_attention.py:94-108).
        tokens = range(first - min(first, self.W - 1), first) if sliding else range(first + count)
        want = [physical(t) for t in tokens]
        if len(read) != len(want) + (count if sliding else 0):  # a sliding read ends in one sentinel per new token
            raise RuntimeError("layer %d row %d: the read index gathers %d keys for tokens %d..%d, expected %d"
                               % (layer, row, len(read), first, first + count - 1,
                                  len(want) + (count if sliding else 0)))
        if read[:len(want)] != want:
            wrong = next(i for i, (x, y) in enumerate(zip(read, want)) if x != y) if len(read) >= len(want) else 0
            raise RuntimeError("layer %d row %d: the read index of token %d is %s, where the table puts it at %d"
                               % (layer, row, tokens[wrong], read[wrong] if wrong < len(read) else "missing",
                                  want[wrong]))

    def finish(self, row, ends=False):
        """update_batch after a forward: a request whose last token this was is marked finished
        first (update_and_check_completion), then the blocks the forward completed are hashed
        (continuous_api.py:564-566, in that order)."""
        complete, count = self.pending.pop(row)
        state = self.rows[row]
        state.position_offset += count
        if ends:
            state.status = RequestStatus.FINISHED
        self.cache.mark_complete_blocks(state, complete)

    def fork(self, rows_from):
        self.cache.pool.try_to_free_sectors()
        old, new, moved = self.rows, {}, set()
        copies = {name: ([], []) for name in self.cache.cache_allocators}
        for i, r in enumerate(rows_from):
            if r not in old:
                continue
            if r not in moved:  # a row that moves keeps its request
                moved.add(r)
                new[i] = old[r]
            else:
                self.requests += 1
                child = "row%d.%d" % (i, self.requests)
                if self.cache.prepare_fork_request(old[r], [child], copies) != [child]:
                    raise RuntimeError("prepare_fork_request: no room to fork row %d" % r)
                new[i] = old[r].fork(child)
        self.cache.perform_cache_copy(copies)
        for r, state in old.items():
            if r not in moved:
                self.cache.free_blocks(state.request_id)
        self.rows = new

    def free(self, row):
        self.cache.free_blocks(self.rows.pop(row).request_id)

    def evict(self, count):
        self.cache.evict_cached_blocks()
        self.cache.pool.try_to_free_sectors()

    def swap_out(self, row):
        state = self.rows.pop(row)
        saved = {}
        for name, a in self.cache.cache_allocators.items():
            blocks = torch.tensor(a.block_table.get(state.request_id, []), dtype=torch.long)
            saved[name] = a._copy_view.index_select(0, blocks).clone()
        self.cache.free_blocks(state.request_id, no_cache=True)  # offloading_manager.py:198
        self.swapped[row] = (state, saved)

    def swap_in(self, row):
        state, saved = self.swapped.pop(row)
        state.tokens_to_process = []
        if not self.cache.can_store_request_tokens(state, 0):
            raise RuntimeError("can_store_request_tokens: no room to swap row %d back in" % row)
        for name, a in self.cache.cache_allocators.items():
            blocks = a.block_table.get(state.request_id, [])
            n = min(len(blocks), saved[name].shape[0])
            if n:
                a._copy_view.index_copy_(0, torch.tensor(blocks[:n], dtype=torch.long), saved[name][:n])
        if self.cache.use_prefix_sharing:
            self.restored[row] = {name: state.position_offset // a.tokens_per_page
                                  for name, a in self.cache.cache_allocators.items()}
        self.rows[row] = state
