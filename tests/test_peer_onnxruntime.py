"""ONNX Runtime as shipped (label peer.onnxruntime): the contrib op GroupQueryAttention on the
CPU, one node per layer, driven through kvtrace.drive_ort_gqa as an exported model runs it
(past and present buffers kept by the caller, rotary inside the op from cos/sin caches,
local_window_size, head_sink). The same tests run under two releases around the change of
local_window_size's meaning (PR 25927): onnxruntime 1.23.2 (the venv onnxruntime-1.23) and
1.31.1 (onnxruntime-1.31), each made by tools/test from tools/setup/requirements/."""

import os
import shutil
import tempfile
import unittest

from test_kvtrace import DATA, SCENARIOS, export, kvcheck, kvtrace

import onnxruntime  # noqa: F401  (the venv's onnxruntime must import)

import kvtrace_ort


class OnnxRuntimeGqaTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-ort-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, folder=SCENARIOS, **options):
        result = kvtrace_ort.drive_ort_gqa(export(self.work, scenario, folder), self.trace, **options)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)

    def test_full_attention_with_gqa_and_rows_of_different_lengths_passes(self):
        result, verify = self.drive("gqa_full_two_kv_heads")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_partial_interleaved_rotary_through_a_reorder_a_crop_and_a_reset_passes(self):
        result, verify = self.drive("ort_partial_interleaved_edits", DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("every stored key is its raw key rotated at its absolute position", verify.stdout)

    def test_the_other_pair_layout_is_named(self):
        # The same model exported with rotary_interleaved the other way round: the stored keys
        # are no rotation of their raw keys in the scenario's layout.
        exp = export(self.work, "ort_partial_interleaved_edits", DATA)
        exp.rope["layout"] = "half"
        kvtrace_ort.drive_ort_gqa(exp, self.trace)
        verify = kvcheck("verify", os.path.join(DATA, "ort_partial_interleaved_edits.json"), "--trace", self.trace)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("class: wrong rope layout", verify.stdout)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)

    def test_a_sliding_window_by_mask_over_a_growing_past_passes_when_declared(self):
        # W = 16 over a 40-token prompt, then decodes: the past keeps every token (eviction
        # "never", which the driver declares); declared lazy, the masked-out tokens are extra.
        result, verify = self.drive("llama31_sliding_gqa")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        shutil.rmtree(self.trace)
        _, verify = self.drive("llama31_sliding_gqa", eviction="lazy")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("which the policy evicted", verify.stdout)

    def test_local_window_size_as_the_other_release_means_it_is_a_window_off_by_one(self):
        # Up to 1.23 local_window_size counts the keys before the query (W - 1 for a window of
        # W); from 1.24 on every key the query sees (W). Given the other release's value, the
        # first query whose window it changes diverges: token W - 1 (one key short) from 1.24
        # on, token W (one key more) before.
        window = 16
        newer = kvtrace_ort.window_meaning_changed()
        other = window - 1 if newer else window
        result, verify = self.drive("llama31_sliding_gqa", local_window_size=other)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("class: window off by one", verify.stdout)
        self.assertIn("first divergence: step 0 (append, /steps/0), row 0, layer 0, head 0, query token %d"
                      % (window - 1 if newer else window), verify.stdout)

    def test_learned_sinks_through_head_sink_pass_in_sliding_and_hybrid_stacks(self):
        # gpt-oss-shaped: yarn, GQA 8/2, a learned sink logit per head (the op's head_sink).
        for scenario in ("gpt_oss_yarn_learned_sinks_sliding", "gpt_oss_hybrid_yarn_learned_sinks"):
            result, verify = self.drive(scenario)
            self.assertIsNone(result.error, scenario)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)
            shutil.rmtree(self.trace)

    def test_the_windowed_cache_is_driven_where_the_release_has_it(self):
        # sliding_window_cache=1 (a buffer of C rows the op evicts itself) is in 1.31.1, not in
        # 1.23.2: there asking for it is refused before anything runs.
        if kvtrace_ort.has_windowed_cache():
            result, verify = self.drive("llama31_sliding_gqa", window_cache=16)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        else:
            with self.assertRaises(kvtrace.UsageError) as caught:
                kvtrace_ort.drive_ort_gqa(export(self.work, "llama31_sliding_gqa"), self.trace, window_cache=16)
            self.assertIn("no sliding_window_cache", str(caught.exception))
            self.assertFalse(os.path.exists(self.trace))

    def test_what_the_op_cannot_take_is_refused_before_running(self):
        for scenario, words in (("sliding_baseline", "multiples of 16"), ("sink_decode_through_windows", "sink"),
                                ("quant_q8_0_full", "float32")):
            with self.assertRaises(kvtrace.UsageError) as caught:
                kvtrace_ort.drive_ort_gqa(export(self.work, scenario), self.trace)
            self.assertIn(words, str(caught.exception))
            self.assertFalse(os.path.exists(self.trace))


class OnnxRuntimeWindowedCacheTest(unittest.TestCase):
    """The op's windowed cache (sliding_window_cache=1, onnxruntime 1.31.1): buffers of C rows,
    rows [0, L(T)) holding the most recent positions, G = C - W + 1 evicted at once."""

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-ort-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, **options):
        result = kvtrace_ort.drive_ort_gqa(export(self.work, scenario), self.trace, **options)
        return result, kvcheck("verify", os.path.join(SCENARIOS, scenario + ".json"), "--trace", self.trace)

    def test_resident_counts_follow_the_ops_contract(self):
        # C = 6, W = 4, G = 3: 6 tokens fit; the 7th evicts 3 (L = 4); the 10th evicts 3 more.
        self.assertEqual([kvtrace_ort.resident(t, 6, 4) for t in range(1, 13)], [1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6])
        self.assertEqual([kvtrace_ort.resident(t, 4, 4) for t in range(1, 8)], [1, 2, 3, 4, 4, 4, 4])

    def test_a_capacity_of_the_window_holds_exactly_the_retained_set(self):
        # C = W = 16: L(T) = min(T, 16), SPEC 3's retained set under lazy eviction: the trace is
        # declared lazy and passes; declared eager, the token kept until the next one fails.
        result, verify = self.drive("llama31_sliding_gqa", window_cache=16)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("lazy: dead tokens kept until the next token", verify.stdout)
        shutil.rmtree(self.trace)
        _, verify = self.drive("llama31_sliding_gqa", window_cache=16, eviction="eager")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("though the cache is declared to evict eagerly", verify.stdout)

    def test_a_capacity_above_the_window_evicts_in_blocks_under_the_mask(self):
        # C = 19 and 24 over W = 16: up to C - W tokens beyond the window stay resident, masked;
        # declared "never" (the default here) it passes, declared lazy they are extra.
        for capacity in (19, 24):
            result, verify = self.drive("llama31_sliding_gqa", window_cache=capacity)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, "C=%d\n%s%s" % (capacity, verify.stdout, verify.stderr))
            shutil.rmtree(self.trace)
        _, verify = self.drive("llama31_sliding_gqa", window_cache=19, eviction="lazy")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("which the policy evicted", verify.stdout)

    def test_learned_sinks_over_the_windowed_cache_pass(self):
        result, verify = self.drive("gpt_oss_yarn_learned_sinks_sliding", window_cache=16)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)


if __name__ == "__main__":
    unittest.main()
