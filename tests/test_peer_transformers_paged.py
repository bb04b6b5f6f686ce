"""transformers 5.25.0's continuous-batching paged cache (label peer.transformers_5_25):
its own PagedAttentionCache, allocators and block ledger, driven through
tools/kvtrace_hf_paged.py (the calls its manager makes, in its order) by
kvtrace.drive_paged_cache, and judged by `kvcheck verify` as a SPEC 8 paged cache."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from test_kvtrace import DATA, ROOT, SCENARIOS, export, kvcheck, kvtrace

import transformers
from transformers.generation.continuous_batching.cache_allocators import full_attention, sliding_attention

from kvtrace_base import UsageError
from kvtrace_hf_paged import ContinuousBatchingCache

# The paged fixtures the cache can take, and the verdicts: every one passes.
PASSING = [(SCENARIOS, "paged_chunked_prefill"), (SCENARIOS, "paged_evict_then_repeat"),
           (SCENARIOS, "paged_move_short_row"), (SCENARIOS, "paged_preempt_swap_and_recompute"),
           # two rows with the same prompt in one forward: the second row's full blocks are traded for the
           # first's after the forward (SPEC 8.4)
           (SCENARIOS, "paged_same_prompt_in_one_step"), (DATA, "paged_same_prompt_in_chunks"),
           (DATA, "hf_paged_fork_then_prefix_hit"), (DATA, "hf_paged_fork_at_a_block_edge"),
           # sliding layers: rings of W places (SPEC 8.9), before and after they wrap
           (DATA, "hf_paged_sliding_fork_before_the_ring_wraps"), (SCENARIOS, "paged_window_2b"),
           (SCENARIOS, "paged_window_2b_plus_1"), (SCENARIOS, "paged_sliding_chunked_prefill"),
           (DATA, "hf_paged_sliding_ring_under_a_long_chunk"), (DATA, "paged_ring_pages_reused_after_a_free")]


class ContinuousBatchingCacheTest(unittest.TestCase):
    def setUp(self):
        self.assertEqual(transformers.__version__, "5.25.0")
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-cb-")
        self.addCleanup(shutil.rmtree, self.work, True)

    def drive(self, folder, scenario):
        """(the driver's result, kvcheck verify's) for the scenario through the real cache."""
        exp = export(self.work, scenario, folder)
        trace = os.path.join(self.work, "trace")
        shutil.rmtree(trace, True)
        result = kvtrace.drive_paged_cache(exp, lambda: ContinuousBatchingCache(exp), trace)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", trace)

    def test_the_paged_fixtures_it_can_take_pass(self):
        for folder, scenario in PASSING:
            with self.subTest(scenario=scenario):
                shutil.rmtree(os.path.join(self.work, "export"), True)
                result, done = self.drive(folder, scenario)
                self.assertIsNone(result.error, result)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                self.assertIn("paged bookkeeping", done.stdout)
                self.assertIn("no divergence", done.stdout)

    def test_what_the_cache_cannot_be_asked_is_refused_by_name(self):
        for scenario, why in [
                ("paged_token_reuse", "reuses whole blocks only"),
                ("paged_adapters_and_salts", "no adapter or cache salt per request"),
                ("paged_gemma_hybrid_prefix", "turns prefix sharing off when a layer is sliding"),
                ("quant_paged_fp8_prefix", "no kv_quant")]:
            with self.subTest(scenario=scenario):
                shutil.rmtree(os.path.join(self.work, "export"), True)
                exp = export(self.work, scenario)
                with self.assertRaisesRegex(UsageError, why):
                    ContinuousBatchingCache(exp)

    def test_a_write_index_from_the_chunk_not_the_row_is_named(self):
        # A fault transformers lacks, planted in its own allocator: the write index computed as if
        # each forward started the row, so a later chunk writes over the row's first slots.
        write = full_attention.FullAttentionCacheAllocator.get_write_indices
        full_attention.FullAttentionCacheAllocator.get_write_indices = \
            lambda allocator, rid, past, count: write(allocator, rid, 0, count)
        self.addCleanup(setattr, full_attention.FullAttentionCacheAllocator, "get_write_indices", write)
        result, done = self.drive(SCENARIOS, "paged_chunked_prefill")
        self.assertIsNone(result.error, result)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("token 4 was written to slot 36, but its table entry says slot 32", done.stdout)
        self.assertIn("class: slot mapping wrong", done.stdout)

    def test_a_ring_written_one_place_on_is_named(self):
        # Planted in its sliding allocator: every token written at the ring place of the next one.
        write = sliding_attention.SlidingAttentionCacheAllocator.get_write_indices
        sliding_attention.SlidingAttentionCacheAllocator.get_write_indices = \
            lambda allocator, rid, past, count: write(allocator, rid, past + 1, count)
        self.addCleanup(setattr, sliding_attention.SlidingAttentionCacheAllocator, "get_write_indices", write)
        result, done = self.drive(DATA, "hf_paged_sliding_ring_under_a_long_chunk")
        self.assertIsNone(result.error, result)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertRegex(done.stdout, r"step 0 \(append, /steps/0\): layer 0 row 0 table entry 0 \(block \d+\): token 9 "
                                      r"was written to slot \d+, but its table entry says slot \d+ = \d+ \* 4 \+ 3")
        self.assertIn("class: slot mapping wrong", done.stdout)

    def test_a_read_index_that_strays_from_the_table_is_named(self):
        # The read path gathers what attention sees; planted: token 0 read from token 1's slot.
        read = full_attention.FullAttentionCacheAllocator.get_read_indices
        full_attention.FullAttentionCacheAllocator.get_read_indices = \
            lambda allocator, rid, past, count: (lambda got: got[1:2] + got[1:])(read(allocator, rid, past, count))
        self.addCleanup(setattr, full_attention.FullAttentionCacheAllocator, "get_read_indices", read)
        result, done = self.drive(SCENARIOS, "paged_chunked_prefill")
        self.assertRegex(result.error, r"layer 0 row 0: the read index of token 0 is \d+, where the table puts it")
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("class: the cache raised", done.stdout)

    def run_finding(self, name, *options):
        script = os.path.join(ROOT, "docs", "findings", "transformers", name + ".py")
        return subprocess.run([sys.executable, script, *options], capture_output=True, text=True)

    def test_a_finished_requests_last_block_is_not_hit(self):
        # docs/findings/transformers/continuous-batching-forgets-the-blocks-of-a-last-forward.md:
        # the manager marks a request finished before hashing its last forward's blocks.
        result, done = self.drive(DATA, "hf_paged_a_finished_requests_last_block_is_hit")
        self.assertIsNone(result.error, result)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("step 3 (append, /steps/3): layer 0 row 0: a prefix hit of 4 tokens; the scenario expects 8",
                      done.stdout)
        self.assertIn("class: prefix hit not the expected one", done.stdout)
        run = self.run_finding("continuous-batching-forgets-the-blocks-of-a-last-forward")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("it hits 4", run.stdout)
        run = self.run_finding("continuous-batching-forgets-the-blocks-of-a-last-forward", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("it hits 8", run.stdout)

    def test_a_window_of_one_is_unmasked_in_a_prefill_chunk(self):
        # docs/findings/transformers/continuous-batching-window-of-one-unmasked-in-prefill.md
        run = self.run_finding("continuous-batching-window-of-one-unmasked-in-prefill")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("the paged prefill saw more than the window of 1", run.stdout)
        run = self.run_finding("continuous-batching-window-of-one-unmasked-in-prefill", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("the paged prefill agrees with the unpaged model", run.stdout)


if __name__ == "__main__":
    unittest.main()
