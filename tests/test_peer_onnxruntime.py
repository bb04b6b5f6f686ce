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

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

import kvtrace_ort


class DriveTest(unittest.TestCase):
    """Drives a scenario through the op (kvtrace_ort) in a folder of its own and verifies it."""

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-ort-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, folder=SCENARIOS, **options):
        result = kvtrace_ort.drive_ort_gqa(export(self.work, scenario, folder), self.trace, **options)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)


class OnnxRuntimeGqaTest(DriveTest):
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

    def test_smooth_softmax_is_a_sink_of_logit_zero_in_every_head(self):
        # The attribute in place of head_sink, on a scenario whose sink logits are all 0.
        result, verify = self.drive("ort_smooth_softmax_sliding", DATA, smooth_softmax=True)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_smooth_softmax_on_a_model_without_sinks_is_named(self):
        result, verify = self.drive("gqa_full_two_kv_heads", smooth_softmax=True)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("class: softmax with an extra 1", verify.stdout)
        with self.assertRaisesRegex(kvtrace.UsageError, "sink_logits are not all 0"):
            self.drive("gpt_oss_yarn_learned_sinks_sliding", smooth_softmax=True)

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

    def test_quantized_kv_is_driven_where_the_release_has_it(self):
        # int8/int4 KV (k_quant_type, kv_cache_bit_width) is in 1.31.1, not in 1.23.2; and the
        # CPU kernel takes K and V in one format with one kind of scale.
        if not kvtrace_ort.has_quantized_kv():
            with self.assertRaises(kvtrace.UsageError) as caught:
                kvtrace_ort.drive_ort_gqa(export(self.work, "ort_int8_kv_sliding", DATA), self.trace)
            self.assertIn("no quantized KV", str(caught.exception))
        for scenario, words in (("quant_int8_int4_even_static_sliding", "for K and V alike"),
                                ("quant_q8_0_full", "int8_even or int4_even")):
            with self.assertRaises(kvtrace.UsageError) as caught:
                kvtrace_ort.drive_ort_gqa(export(self.work, scenario), self.trace)
            self.assertIn(words, str(caught.exception))
        self.assertFalse(os.path.exists(self.trace))

    def test_gemma3s_two_bases_pass_one_node_per_layer(self):
        # SPEC 10.1: each layer's node takes its own cos/sin caches (theta 10,000 for the sliding
        # layers, 1,000,000 with linear 8 for the global one), as a Gemma 3 export does. The
        # crop the sliding layers' policy refuses is served by the caller's buffers, which keep
        # every token (SPEC 4): the steps after it are not judged.
        result, verify = self.drive("gemma3_sliding_full_two_bases")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("but step 8 (crop, /steps/3) was served", verify.stdout)

    def test_every_node_given_the_global_rope_is_named(self):
        # llama.cpp issue 12357's mistake, made by the caller: every node gets the global
        # layer's cos/sin caches. The op returns the keys it rotated, so the trace shows the
        # sliding layers' keys under the other layer's rope; they hold the right tokens (the
        # caller's buffers never evict), which is not another layer's policy.
        real = kvtrace_ort._rotary_caches
        global_rope = export(self.work, "gemma3_sliding_full_two_bases").layer_rope(5)
        kvtrace_ort._rotary_caches = lambda exp, rope, positions: real(exp, global_rope, positions)
        try:
            _, verify = self.drive("gemma3_sliding_full_two_bases")
        finally:
            kvtrace_ort._rotary_caches = real
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0), row 0, layer 0", verify.stdout)
        self.assertIn("class: layer rotated with another layer's rope", verify.stdout)

    def test_what_the_op_cannot_take_is_refused_before_running(self):
        for scenario, words in (("sliding_baseline", "multiples of 16"), ("sink_decode_through_windows", "sink"),
                                ("sliding_prompt_longer_than_window_float16", "kv_dtype float16"),
                                ("llama4_chunked_nope", "no chunked attention (SPEC 10.2)")):
            with self.assertRaises(kvtrace.UsageError) as caught:
                kvtrace_ort.drive_ort_gqa(export(self.work, scenario), self.trace)
            self.assertIn(words, str(caught.exception))
            self.assertFalse(os.path.exists(self.trace))


def quantized_by_the_op(bits, quant_type, x, scale):
    """The codes GroupQueryAttention stores for one key row x [16] (no rotary) under a static
    scale: int8 as signed bytes; int4 unpacked from its nibbles (c + 8, element 2i low)."""
    f, d = TensorProto.FLOAT, 16
    cache = TensorProto.INT8 if bits == 8 else TensorProto.UINT8
    stored, buffer = (d, np.int8) if bits == 8 else (d // 2, np.uint8)
    info = helper.make_tensor_value_info
    inputs = [info("query", f, [1, 1, d]), info("key", f, [1, 1, d]), info("value", f, [1, 1, d]),
              info("past_key", cache, [1, 1, 0, stored]), info("past_value", cache, [1, 1, 0, stored]),
              info("seqlens_k", TensorProto.INT32, [1]), info("total_sequence_length", TensorProto.INT32, []),
              info("k_scale", f, None), info("v_scale", f, None)]
    names = [i.name for i in inputs[:7]] + [""] * 5 + ["k_scale", "v_scale"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=1, kv_num_heads=1, k_quant_type=quant_type,
                            v_quant_type=quant_type, kv_cache_bit_width=bits)
    outputs = [info("output", f, [1, 1, d]), info("present_key", cache, [1, 1, 1, stored]),
               info("present_value", cache, [1, 1, 1, stored])]
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    scales = np.full([1] if quant_type == "PER_TENSOR" else [1, 1, 1, d], scale, np.float32)
    row = np.asarray(x, np.float32).reshape(1, 1, d)
    _, key, _ = session.run(None, {"query": np.zeros_like(row), "key": row, "value": row,
                                   "past_key": np.zeros((1, 1, 0, stored), buffer),
                                   "past_value": np.zeros((1, 1, 0, stored), buffer),
                                   "seqlens_k": np.array([0], np.int32),
                                   "total_sequence_length": np.array(1, np.int32), "k_scale": scales,
                                   "v_scale": scales})
    if bits == 8:
        return key.reshape(-1).astype(int).tolist()
    codes = []
    for byte in key.reshape(-1).tolist():
        codes += [(byte & 15) - 8, (byte >> 4) - 8]
    return codes


class OnnxRuntimeWindowAndQuantizedCacheTest(DriveTest):
    """What 1.31.1 has and 1.23.2 lacks: the op's windowed cache (sliding_window_cache=1:
    buffers of C rows, rows [0, L(T)) holding the most recent positions, G = C - W + 1 evicted
    at once) and quantized KV."""

    def test_int8_kv_with_a_scale_per_kv_head_passes_code_for_code(self):
        # int8_even K and V (SPEC 9.6), PER_CHANNEL scales (one a kv head), a sliding window of
        # 12, over the growing past and over the windowed cache.
        for window_cache in (None, 12):
            result, verify = self.drive("ort_int8_kv_sliding", DATA, window_cache=window_cache)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
            self.assertIn("codes and their scales as the format's rules give (K int8_even, V int8_even)",
                          verify.stdout)
            shutil.rmtree(self.trace)

    def test_int4_kv_passes_code_for_code_and_nibbles_read_the_other_way_fail_at_once(self):
        result, verify = self.drive("ort_int4_kv_full", DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        shutil.rmtree(self.trace)
        # A driver that unpacks each byte high nibble first: no slot holds any token's values
        # (a trace names its tokens by their values), from the first step on: a layout.
        unpack = kvtrace_ort._Quantized.codes

        def swapped(self_, stored):
            return unpack(self_, ((stored & 15) << 4 | stored >> 4).astype(stored.dtype))
        kvtrace_ort._Quantized.codes = swapped
        try:
            _, verify = self.drive("ort_int4_kv_full", DATA)
        finally:
            kvtrace_ort._Quantized.codes = unpack
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("holds values of no token", verify.stdout)
        self.assertIn("class: dequantization layout", verify.stdout)

    def test_resident_counts_follow_the_ops_contract(self):
        # C = 6, W = 4, G = 3: 6 tokens fit; the 7th evicts 3 (L = 4); the 10th evicts 3 more.
        self.assertEqual([kvtrace_ort.resident(t, 6, 4) for t in range(1, 13)], [1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6])
        self.assertEqual([kvtrace_ort.resident(t, 4, 4) for t in range(1, 8)], [1, 2, 3, 4, 4, 4, 4])

    def test_a_capacity_of_the_window_holds_exactly_the_retained_set(self):
        # C = W = 16: L(T) = min(T, 16), SPEC 3's retained set under lazy eviction: the trace
        # declares {"blocks": 16} and passes, and so it does declared lazy; declared eager, the
        # token kept until the next one fails.
        for eviction in ("auto", "lazy"):
            result, verify = self.drive("llama31_sliding_gqa", window_cache=16, eviction=eviction)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, eviction + "\n" + verify.stdout + verify.stderr)
            shutil.rmtree(self.trace)
        _, verify = self.drive("llama31_sliding_gqa", window_cache=16, eviction="eager")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("though the cache is declared to evict eagerly", verify.stdout)

    def test_a_capacity_above_the_window_holds_the_last_l_of_t_tokens(self):
        # C = 19 and 24 over W = 16 (G = 4 and 9): SPEC 3.1's L(T) counted against what the op
        # left in its buffer, declared {"blocks": C} by default. Declared lazy, the tokens
        # beyond the window are extra; declared with another capacity than the op's, the count
        # is wrong at the first fill where the two buffers differ.
        for capacity in (19, 24):
            result, verify = self.drive("llama31_sliding_gqa", window_cache=capacity)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, "C=%d\n%s%s" % (capacity, verify.stdout, verify.stderr))
            self.assertIn("the last L(T) tokens of a buffer of %d, evicted in blocks" % capacity, verify.stdout)
            shutil.rmtree(self.trace)
        _, verify = self.drive("llama31_sliding_gqa", window_cache=19, eviction="lazy")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("which the policy evicted", verify.stdout)
        shutil.rmtree(self.trace)
        # After row 0's 40-token prompt the op's buffer of 19 holds 16 (40 - 4 * 6); one of 20
        # would hold 20 (40 - 5 * 4): 4 tokens short.
        _, verify = self.drive("llama31_sliding_gqa", window_cache=19, eviction={"blocks": 20})
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("class: block eviction count wrong", verify.stdout)
        self.assertIn("which a buffer of 20 evicting 5 at once", verify.stdout)

    def test_int8_and_int4_kv_round_ties_to_even_over_the_full_range(self):
        # docs/spec.md 9.6, at scale 0.25: ties, the ends of the range and beyond, no rotary.
        s = 0.25
        int8 = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.5, -128, 160, -160, 0, 1, -1, 4, -4, 20]
        int4 = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.5, -8.5, 20, -20, 0, 1, -1, 4, -4, 6.5]
        for quant_type in ("PER_TENSOR", "PER_CHANNEL"):
            self.assertEqual(quantized_by_the_op(8, quant_type, np.array(int8) * s, s),
                             [0, 2, 2, 0, -2, -2, 127, -128, 127, -128, 0, 1, -1, 4, -4, 20], quant_type)
            self.assertEqual(quantized_by_the_op(4, quant_type, np.array(int4) * s, s),
                             [0, 2, 2, 0, -2, -2, 7, -8, 7, -8, 0, 1, -1, 4, -4, 6], quant_type)

    def test_learned_sinks_over_the_windowed_cache_pass(self):
        result, verify = self.drive("gpt_oss_yarn_learned_sinks_sliding", window_cache=16)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)


if __name__ == "__main__":
    unittest.main()
