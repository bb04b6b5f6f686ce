"""transformers itself, as shipped (label peer.transformers): the real cache classes of
pinned releases, each installed by tools/test into a venv of its own
(tools/setup/requirements/transformers-*.txt), driven through tools/kvtrace.py exactly as
the README tells a user to, and judged by `kvcheck verify`. The same module runs in every
release's venv; where releases differ, each test says which does what. No hub model: the
caches are driven with the scenario's own q, k, v.

SinkCache (4.42.4, 4.46.3 and 4.52.4, the last release whose SinkCache works: 4.53 removed
it) has the same update in all three, and three documented behaviours, each the class
kvcheck must name at the step it names:
- it shifts one token early (when held + n == window_length nothing needs to go);
- a first chunk longer than the window is stored whole;
- a second chunk of several tokens that crosses the window raises in torch.

SlidingWindowCache (since 4.42, from the PR "SlidingWindowCache: reduce differences to other
Cache classes"): before 4.52 it rolls one token early (token 0 is gone before token W - 1
attends to it); in every release a chunk of several tokens past the window rolls once and
writes every token at the last slot."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from typing import Any, Dict, Optional, Tuple

from test_kvtrace import DATA, ROOT, SCENARIOS, export, kvcheck, kvtrace

sys.path.insert(0, os.path.join(ROOT, "tools", "peers"))
import hf_caches  # noqa: E402  the recipes, as the README and `tools/kvcheck peers` use them

import torch
import transformers

from transformers import MistralConfig

RELEASE = tuple(int(part) for part in transformers.__version__.split(".")[:2])

if RELEASE < (5, 0):  # removed in 5 (SlidingWindowCache is StaticCache's alias there)
    from transformers import SinkCache
    from transformers.cache_utils import SlidingWindowCache  # 4.42 does not export it at the top level

# SinkCache warns that it is deprecated at every construction.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

RELEASES = ("4.42.4", "4.46.3", "4.52.4", "5.25.0")  # tools/setup/requirements/transformers-*.txt
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PeerTest(unittest.TestCase):
    def setUp(self):
        self.assertIn(transformers.__version__, RELEASES, "the venv holds a release this module does not know")
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-transformers-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def verify(self, scenario, folder=SCENARIOS):
        return kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)


class TransformersSinkCacheTest(PeerTest):
    def drive(self, scenario, make_cache, folder=SCENARIOS):
        """The README's recipe (tools/peers/hf_caches.py): export, drive with generate()'s
        absolute positions and the cache's own cache-relative keys, verify."""
        with open(os.path.join(folder, scenario + ".json")) as f:
            _, options = hf_caches.sink_cache(json.load(f))
        exp = export(self.work, scenario, folder)
        result = kvtrace.drive_hf_cache(exp, make_cache, self.trace, **options)
        return result, self.verify(scenario, folder)

    def test_sink_cache_shifts_one_token_early(self):
        # S = 2, W = 6, a 3-token prompt, then one token per step: at step 3 the cache holds 5
        # and 5 + 1 == W, so SinkCache shifts tokens 2..4 back by one though E(5) = 0.
        _, verify = self.drive("sink_decode_through_windows", lambda: SinkCache(6, 2))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 3 (decode, /steps/1)", verify.stdout)
        self.assertIn("class: shift one token early", verify.stdout)

    def test_sink_cache_keeps_a_long_prompt_whole(self):
        # S = 4, W = 12, a 30-token prompt: the first chunk is stored as it comes.
        _, verify = self.drive("sink_prompt_longer_than_window", lambda: SinkCache(12, 4))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 0 (append, /steps/0)", verify.stdout)
        self.assertIn("class: prompt longer than the window kept whole", verify.stdout)

    def test_sink_cache_raising_on_a_second_chunk_is_recorded(self):
        # S = 2, W = 8, 5 tokens, then a chunk of 6: 5 + 6 >= 8 shifts, keeping the 5 held
        # keys against a re-rotation table of 8 - 2 - 6 = 0 entries.
        error = ("RuntimeError: The size of tensor a (5) must match the size of tensor b (0) at non-singleton "
                 "dimension 2")
        result, verify = self.drive("sink_chunk_crosses_window", lambda: SinkCache(8, 2))
        self.assertEqual((result.error_step, result.error), (1, error))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn(error, verify.stdout)

    def test_partial_rotary_keys_are_re_rotated_on_their_rotary_dims_only(self):
        # RoPE on 4 of 8 dims (Phi's partial_rotation_size, which kvtrace passes as Phi does):
        # the same early shift as with full rotary, at the same step, and nothing raised. Without
        # partial_rotation_size SinkCache applies 4-dim cos/sin to 8-dim keys and raises.
        result, verify = self.drive("partial_rotary_sink_decode", lambda: SinkCache(6, 2), DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 3 (decode, /steps/1)", verify.stdout)
        self.assertIn("class: shift one token early", verify.stdout)

    def test_verify_json_carries_the_first_divergence_as_fields(self):
        # The first run above: step 3 (the first decode after the window fills), query
        # token 5, slot 2 holding token 2 (uid 2), re-rotated back by one too early.
        self.drive("sink_decode_through_windows", lambda: SinkCache(6, 2))
        report = os.path.join(self.work, "report.json")
        verify = kvcheck("verify", os.path.join(SCENARIOS, "sink_decode_through_windows.json"), "--trace", self.trace,
                         "--json", report)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        with open(report) as f:
            first = json.load(f)["results"][0]["first_divergence"]
        self.assertEqual({k: first[k] for k in ("step", "op", "source", "row", "layer", "query_token", "slot", "uid",
                                                 "token", "class")},
                         {"step": 3, "op": "decode", "source": "/steps/1", "row": 0, "layer": 0, "query_token": 5,
                          "slot": 2, "uid": 2, "token": 2, "class": "shift_one_token_early"})
        self.assertEqual((first["expected_distance"], first["actual_distance"]), (3, 4))
        self.assertIn(first["where"], verify.stdout)

    def test_an_interleaved_scenario_is_refused_when_the_cache_reads_cos_sin(self):
        # SinkCache re-rotates kept keys with cache_kwargs' cos/sin, which follow rotate_half:
        # on an interleaved scenario it would be judged on the driver's convention.
        exp = export(self.work, "interleaved_sink")
        with self.assertRaisesRegex(ValueError, "interleaved RoPE layout, but cache_kwargs cos/sin follow"):
            kvtrace.drive_hf_cache(exp, lambda: SinkCache(8, 2), self.trace, as_tensor="torch")
        self.assertFalse(os.path.exists(self.trace))
        self.assertEqual(sorted(os.listdir(self.work)), ["export"])  # no temporary folder left



if RELEASE < (5, 0):  # SinkCache is gone in 5
    class PatchedSinkCache(SinkCache):
        """SinkCache with transformers PR #33692 ("Sink cache: fix implementation to shift key
        states", closed unmerged; for issue 33691) applied as written: update() and
        _get_rerotation_cos_sin() from the PR's branch (why-in-Shanghaitech:dev-sink-cache at
        0cdc06e1), written against 4.45.0.dev0, whose SinkCache.update is the same code as 4.42.4's
        and 4.46.3's. Only change: `cache_kwargs or {}`. The PR grows the cache by the new keys,
        attends over all of them, then evicts and re-rotates the kept ones (new keys included) to
        cache positions 0..W-1. Its model-side half (positions from the cache's length) is the
        driver's positions="cache"."""
        # PR changes the signature: keyed by `offset` (how many positions to shift back), not by key_states
        def _get_rerotation_cos_sin(
            self, offset: int, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor
        ) -> Tuple[torch.Tensor, torch.Tensor]:
            if offset not in self.cos_sin_rerotation_cache:
                cos = cos.to(torch.float32)
                sin = sin.to(torch.float32)
                original_cos = cos[self.num_sink_tokens + offset :]
                shifted_cos = cos[self.num_sink_tokens : -offset]
                original_sin = sin[self.num_sink_tokens + offset :]
                shifted_sin = sin[self.num_sink_tokens : -offset]
                rerotation_cos = original_cos * shifted_cos + original_sin * shifted_sin
                rerotation_sin = -original_sin * shifted_cos + original_cos * shifted_sin
                self.cos_sin_rerotation_cache[offset] = (
                    rerotation_cos.to(dtype).unsqueeze(0),
                    rerotation_sin.to(dtype).unsqueeze(0),
                )
            return self.cos_sin_rerotation_cache[offset]

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            cache_kwargs: Optional[Dict[str, Any]] = None,
        ) -> Tuple[torch.Tensor, torch.Tensor]:
            cache_kwargs = cache_kwargs or {}
            sin = cache_kwargs.get("sin")
            cos = cache_kwargs.get("cos")
            partial_rotation_size = cache_kwargs.get("partial_rotation_size")
            using_rope = cos is not None and sin is not None

            if layer_idx == 0:
                self._seen_tokens += key_states.shape[-2]

            if using_rope and layer_idx == 0:
                if cos.dim() == 2:
                    self._cos_cache = cos
                    self._sin_cache = sin
                else:
                    if self._cos_cache is None:
                        self._cos_cache = cos[0, ...]
                        self._sin_cache = sin[0, ...]
                    elif self._cos_cache.shape[0] < self.window_length + key_states.shape[-2]:  # PR
                        self._cos_cache = torch.cat([self._cos_cache[: self.window_length], cos[0, ...]], dim=0)  # PR
                        self._sin_cache = torch.cat([self._sin_cache[: self.window_length], sin[0, ...]], dim=0)  # PR

            if len(self.key_cache) <= layer_idx:
                self.key_cache.append(key_states)
                self.value_cache.append(value_states)
            else:  # PR: always grow first (old code only grew when it fit in the window)
                self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
                self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)

            # PR: this step attends over the full, un-evicted concatenation
            key_cache_to_return = self.key_cache[layer_idx]
            value_cache_to_return = self.value_cache[layer_idx]

            # PR: evict + re-rotate after the fact, new keys included in keys_to_keep
            if (seq_length := self.get_seq_length(layer_idx)) > self.window_length:
                keys_to_keep = self.key_cache[layer_idx][:, :, -self.window_length + self.num_sink_tokens :]
                if using_rope:
                    rerotation_cos, rerotation_sin = self._get_rerotation_cos_sin(
                        seq_length - self.window_length,
                        key_states.dtype,
                        self._cos_cache[:seq_length],
                        self._sin_cache[:seq_length],
                    )
                    if partial_rotation_size is not None:
                        keys_to_keep, keys_pass = (
                            keys_to_keep[..., :partial_rotation_size],
                            keys_to_keep[..., partial_rotation_size:],
                        )
                    keys_to_keep = self._apply_key_rotary_pos_emb(keys_to_keep, rerotation_cos, rerotation_sin)
                    if partial_rotation_size is not None:
                        keys_to_keep = torch.cat((keys_to_keep, keys_pass), dim=-1)
                sink_keys = self.key_cache[layer_idx][:, :, : self.num_sink_tokens]
                self.key_cache[layer_idx] = torch.cat([sink_keys, keys_to_keep], dim=-2)
                sink_values = self.value_cache[layer_idx][:, :, : self.num_sink_tokens]
                values_to_keep = self.value_cache[layer_idx][:, :, -self.window_length + self.num_sink_tokens :]
                self.value_cache[layer_idx] = torch.cat([sink_values, values_to_keep], dim=-2)

            return key_cache_to_return, value_cache_to_return


class SinkCachePR33692Test(PeerTest):
    """The PR's claims, on the real SinkCache of 4.46.3 (a release that lacks the PR). The PR
    attends over the held keys and the new ones before it evicts: with window_length W - 1
    a decode step sees W tokens, kvcheck's window W (the query's own token counted)."""

    def drive(self, scenario, cls, positions, folder=SCENARIOS):
        with open(os.path.join(folder, scenario + ".json")) as f:
            policy = json.load(f)["policy"]
        exp = export(self.work, scenario, folder)
        result = kvtrace.drive_hf_cache(exp, lambda: cls(policy["window"] - 1, policy["sinks"]), self.trace,
                                        positions=positions, key_positions="cache-relative", as_tensor="torch")
        return result, self.verify(scenario, folder)

    def test_the_patch_passes_what_it_claims_to_fix_where_the_stock_class_fails(self):
        # New keys shifted with the cached ones (issue 33691), a prompt shorter than the sinks
        # and one exactly the window (31537, 32315), and a long prompt taken as one dense chunk
        # (the PR crops it after attending to all of it: SPEC's prefill "dense"), driven with
        # the positions the PR's model-side change gives (the cache's length, "cache").
        for scenario, stock in (("sink_decode_through_windows", "shift one token early"),
                                ("sink_prompt_shorter_than_sinks", "shift one token early"),
                                ("sink_prompt_exactly_window", "new key not shifted"),
                                ("sink_dense_prefill_long_prompt", "prompt longer than the window kept whole")):
            result, verify = self.drive(scenario, PatchedSinkCache, "cache")
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)
            _, verify = self.drive(scenario, SinkCache, "cache")
            self.assertEqual(verify.returncode, 1, scenario + "\n" + verify.stdout + verify.stderr)
            self.assertIn("class: " + stock, verify.stdout)

    def test_what_the_patch_says_it_does_not_solve_is_named(self):
        # "new key states have large positional encodings ... it still does not work with
        # model.generate": generate()'s absolute positions put the first new key after the
        # window fills at position 6 where the cache holds 0..5 (kvcheck: 5).
        _, verify = self.drive("sink_decode_through_windows", PatchedSinkCache, "absolute")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 4 (decode, /steps/1)", verify.stdout)
        self.assertIn("class: key at wrong position", verify.stdout)

    def test_in_float16_the_patch_drifts_as_it_re_rotates_every_step(self):
        # Past the window the PR re-rotates every kept key at every step, in the keys' dtype:
        # in float16 the error grows until kvcheck names the drift at step 50 (in float32 the
        # 30 shifts of sink_decode_through_windows pass, above).
        _, verify = self.drive("sink_long_window_float16", PatchedSinkCache, "cache")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 50 (decode, /steps/1)", verify.stdout)
        self.assertIn("class: re-rotation drift", verify.stdout)


class TransformersSlidingWindowCacheTest(PeerTest):
    def drive(self, scenario, folder=SCENARIOS):
        """The README's recipe (tools/peers/hf_caches.py): the model's config (Mistral's, the
        family SlidingWindowCache was written for), the cache made for each batch as
        generate() makes it, absolute positions; the cache's own cache_position mask."""
        with open(os.path.join(folder, scenario + ".json")) as f:
            spec = json.load(f)
        seen = []

        class Recording(SlidingWindowCache):
            def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
                seen.append((key_states.dtype, value_states.dtype))
                return super().update(key_states, value_states, layer_idx, cache_kwargs)

        make_cache, options = hf_caches.sliding_window_cache(spec, Recording)
        exp = export(self.work, scenario, folder)
        result = kvtrace.drive_hf_cache(exp, make_cache, self.trace, **options)
        dtype = DTYPES[spec.get("kv_dtype", "float32")]
        self.assertEqual(set(seen), {(dtype, dtype)}, "kvtrace hands the cache the scenario's kv_dtype")
        return result, self.verify(scenario, folder)

    def test_two_layers_with_gqa_pass_from_4_52(self):
        # W = 6 over two layers with GQA: the buffer is returned whole and masked by cache
        # position. Before 4.52 the early roll (below) fails it at the same step in both layers.
        result, verify = self.drive("gqa_sliding_uniform", DATA)
        self.assertIsNone(result.error)
        if RELEASE >= (4, 52):
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
            self.assertIn("steps recorded: 9 of 9 steps", verify.stdout)
        else:
            self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
            self.assertIn("class: token dropped before its last use", verify.stdout)

    def test_a_prompt_longer_than_the_window_passes_in_every_kv_dtype(self):
        # 21 tokens, W = 8: attended whole, the buffer keeps the last 8 (float32, float16, bfloat16).
        for scenario in ("sliding_prompt_longer_than_window", "sliding_prompt_longer_than_window_float16",
                         "sliding_prompt_longer_than_window_bfloat16"):
            result, verify = self.drive(scenario)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)

    def test_before_4_52_it_rolls_one_token_early(self):
        # W = 6, a 4-token prompt: writing position 5, 4.42 and 4.46 roll already
        # (cache_position >= max_cache_len - 1): token 0 is gone before token 5 attends to it.
        # 4.52 rolls only once the buffer is passed.
        _, verify = self.drive("sliding_baseline")
        if RELEASE >= (4, 52):
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
            return
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/1), row 0, layer 0, head 0, query token 5",
                      verify.stdout)
        self.assertIn("token 0 (uid 0) should be visible to token 5 and is not", verify.stdout)
        self.assertIn("class: token dropped before its last use", verify.stdout)

    def test_a_custom_tensor_function_keeps_integer_tensors_integer(self):
        # kvtrace's as_tensor given by the user (float16 tensors): cache_position stays int64.
        seen = []

        class Recording(SlidingWindowCache):
            def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
                seen.append((key_states.dtype, cache_kwargs["cache_position"].dtype))
                return super().update(key_states, value_states, layer_idx, cache_kwargs)

        config = MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                               sliding_window=8)
        exp = export(self.work, "sliding_prompt_longer_than_window_float16")
        kvtrace.drive_hf_cache(exp, lambda batch: Recording(config, batch, 64, "cpu", torch.float16), self.trace,
                               positions="absolute", as_tensor=lambda x: torch.from_numpy(x).to(torch.float16))
        self.assertEqual(set(seen), {(torch.float16, torch.int64)})
        self.assertEqual(self.verify("sliding_prompt_longer_than_window_float16").returncode, 0)

    def test_a_chunk_crossing_the_window_writes_every_token_at_the_last_slot(self):
        # W = 8, 5 tokens, then a chunk of 6 (positions 5..10): one roll, and tokens 7..10 all
        # clamped to slot 7, so the chunk's later tokens see the wrong keys. Every release.
        result, verify = self.drive("sliding_chunk_crosses_window")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (append, /steps/1), row 0, layer 0, head 0, query token 10",
                      verify.stdout)
        self.assertIn("class: evicted the wrong token", verify.stdout)


class TransformersHybridCacheTest(PeerTest):
    """HybridCache (Gemma 2 and 3, gpt-oss), by the recipe of tools/peers/hf_caches.py: made for
    each batch, absolute positions, its own mask. 4.46 alternates sliding and global layers;
    4.52 follows sliding_window_pattern (Gemma 3's 6). Replaces tests/test_kvtrace_torch.py's
    stand-in."""

    def drive(self, scenario, folder=SCENARIOS):
        with open(os.path.join(folder, scenario + ".json")) as f:
            make_cache, options = hf_caches.hybrid_cache(json.load(f))
        result = kvtrace.drive_hf_cache(export(self.work, scenario, folder), make_cache, self.trace, **options)
        return result, self.verify(scenario, folder)

    def test_gemma3s_two_bases_pass_until_a_chunk_crosses_the_full_window(self):
        # Five sliding layers (theta 10,000) and a global one (theta 1,000,000, linear 8). In
        # 4.52 the prompt past the window and the decodes pass in every layer; the 3-token
        # chunk after them goes through the sliding layers' _sliding_cache_update, which
        # clamps it to the last slot (docs/findings/transformers/sliding-window-cache-chunk-
        # clamped-to-last-slot.md). 4.46's alternating layers give layer 1 a full buffer.
        result, verify = self.drive("gemma3_sliding_full_two_bases")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        if RELEASE >= (4, 50):
            self.assertIn("first divergence: step 7 (append, /steps/2), row 0, layer 0", verify.stdout)
            self.assertIn("class: evicted the wrong token", verify.stdout)
        else:
            self.assertIn("first divergence: step 0 (append, /steps/0), row 0, layer 1", verify.stdout)
            self.assertIn("class: layer given another layer's policy", verify.stdout)

    def test_its_sliding_buffer_rolls_one_early_before_4_52(self):
        # W 6, a 4-token prompt: at token 5 the 4.46 buffer rolls token 0 out before token 5
        # attends to it; 4.52 waits until the buffer is passed.
        _, verify = self.drive("hybrid_short_prompt", DATA)
        if RELEASE < (4, 52):
            self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
            self.assertIn("first divergence: step 2 (decode, /steps/1), row 0, layer 0", verify.stdout)
            self.assertIn("class: token dropped before its last use", verify.stdout)
        else:
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_it_has_no_crop(self):
        # gemma_hybrid_sliding_full crops at step 1 (a crop the policy accepts).
        result, verify = self.drive("gemma_hybrid_sliding_full")
        self.assertEqual((result.error_step, result.error), (1, "the cache does not support crop"))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("class: the cache raised", verify.stdout)


class Transformers5CacheLayersTest(PeerTest):
    """transformers 5: a cache is a list of layers built from the model's config
    (DynamicCache(config=...): DynamicSlidingWindowLayer / DynamicLayer; StaticCache(config=...,
    max_cache_len=...): StaticSlidingWindowLayer / StaticLayer), driven as generate() drives
    them (tools/peers/hf_caches.py)."""

    def drive(self, scenario, recipe, folder=SCENARIOS):
        with open(os.path.join(folder, scenario + ".json")) as f:
            make_cache, options = recipe(json.load(f))
        result = kvtrace.drive_hf_cache(export(self.work, scenario, folder), make_cache, self.trace, **options)
        return result, self.verify(scenario, folder)

    def test_sliding_layers_pass_where_4_x_sliding_window_cache_failed(self):
        # The early roll of 4.42/4.46 and the chunk clamped to the last slot of every 4.x are
        # gone: both layer kinds keep W - 1 (or W) tokens and return the held ones with the chunk.
        for recipe in (hf_caches.dynamic_cache, hf_caches.static_cache):
            for scenario in ("sliding_baseline", "sliding_chunk_crosses_window"):
                result, verify = self.drive(scenario, recipe)
                self.assertIsNone(result.error)
                self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)

    def test_layer_types_from_the_config_pass_a_hybrid_stack(self):
        # Sliding W 8 and full layers alternating (config.layer_types), yarn, learned sinks, a
        # padded 14-token prompt: what 4.x's HybridCache did, now per layer.
        for recipe in (hf_caches.dynamic_cache, hf_caches.static_cache):
            result, verify = self.drive("gpt_oss_hybrid_yarn_learned_sinks", recipe)
            self.assertIsNone(result.error)
            self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
            self.assertIn("steps recorded: 11 of 11 steps", verify.stdout)

    def test_chunked_layers_from_a_llama4_config_pass(self):
        # Llama4TextConfig(attention_chunk_size=C, layer_types=...): a DynamicSlidingWindowLayer
        # of C per chunked layer (it keeps C - 1 tokens), a DynamicLayer for the NoPE full
        # layer; kvtrace's mask shows token t its own chunk (SPEC 10.2). C = 300 crosses a
        # chunk edge inside a 50-token chunk.
        for scenario in ("llama4_chunked_nope_decodes", "chunked_past_the_buffer_step"):
            result, verify = self.drive(scenario, hf_caches.dynamic_cache, DATA)
            self.assertIsNone(result.error, scenario)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)

    def test_crop_takes_the_tokens_to_remove(self):
        # 5's crop(tokens_to_remove) refuses a positive count: kvtrace calls crop(-removed), as
        # generate() does, and crop(0) for a crop past the end (step 13 of full_crop_accepted).
        result, verify = self.drive("full_crop_accepted", hf_caches.dynamic_cache)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_assisted_generation_mode_serves_crops_the_policy_refuses(self):
        # Only assisted generation crops, and generate() then calls activate_past_recording()
        # after the prefill: a sliding or chunked layer keeps every token until the crop,
        # which cuts it and trims it back to W - 1. A crop the policy refuses is then served
        # (SPEC 4): Llama 4's stack back from 30 to 20 tokens (chunk 16..19), a sliding W 6
        # back from 10 to 8 tokens (window 2..7).
        for scenario, step in (("llama4_chunked_full_hybrid", 9), ("sliding_crop_refused_after_eviction", 9)):
            result, verify = self.drive(scenario, hf_caches.dynamic_cache)
            self.assertIsNone(result.error, scenario)
            self.assertEqual(verify.returncode, 0, scenario + "\n" + verify.stdout + verify.stderr)
            self.assertIn("but step %d (crop, /steps/3) was served" % step, verify.stdout)
            shutil.rmtree(self.trace)

    def test_a_crop_that_keeps_tokens_past_the_cut_is_a_refusal_mismatch(self):
        # Planted (transformers' own crop is right): past the window, the crop keeps the last
        # W - 1 slots of the uncut row, so the tokens after the cut stay. Accepting the crop
        # the policy refuses is then not serving it.
        from transformers.cache_utils import DynamicSlidingWindowLayer

        class CropKeepsTheLatestSlots(DynamicSlidingWindowLayer):
            def crop(self, tokens_to_remove):
                if self.get_seq_length() < self.sliding_window or tokens_to_remove >= 0:
                    return super().crop(tokens_to_remove)
                self.keys = self.keys[:, :, -self.sliding_window + 1:, :]
                self.values = self.values[:, :, -self.sliding_window + 1:, :]
                self.cumulative_length += tokens_to_remove

        def planted(scenario):
            make, options = hf_caches.dynamic_cache(scenario)

            def make_planted():
                cache = make()
                for layer in cache.layers:
                    if isinstance(layer, DynamicSlidingWindowLayer):
                        layer.__class__ = CropKeepsTheLatestSlots
                return cache
            return make_planted, options

        result, verify = self.drive("sliding_crop_refused_after_eviction", planted)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 9 (crop, /steps/3)", verify.stdout)
        self.assertIn("class: refusal mismatch", verify.stdout)
        self.assertIn("its rows are not the cut rows", verify.stdout)

    def test_a_crop_removing_different_counts_per_row_is_refused_by_the_driver(self):
        # Rows of 3, 8 and 5 tokens left-padded to 8 slots, cropped to 4 tokens: 0, 4 and 1
        # to remove, but crop(tokens_to_remove) removes the same slots from every row. Said as
        # one slot crop it would drop live tokens of the driver's making: refused, no trace.
        with self.assertRaisesRegex(kvtrace.UsageError, r"removes \[0, 1, 4\] tokens from the rows of \[3, 8, 5\]"):
            self.drive("full_crop_mixed_lengths", hf_caches.dynamic_cache)
        self.assertFalse(os.path.exists(self.trace))
        # A crop the policy refuses that removes different counts (rows of 22 and 18 tokens cut
        # to 12) is not offered: any single count is another crop. The cache stays as a refusal
        # leaves it, so the steps after it are driven and judged.
        result, verify = self.drive("gemma3_sliding_full_two_bases", hf_caches.dynamic_cache)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("step 8 (crop, /steps/3) skipped: not offered: a crop to 12 tokens removes [6, 10] tokens from "
                      "the rows of [22, 18]", verify.stdout)
        self.assertIn("steps recorded: 10 of 11 steps", verify.stdout)


def run_finding(name, *options):
    """A standalone reproduction of docs/findings/transformers/ (torch and transformers alone),
    in this release's venv."""
    script = os.path.join(ROOT, "docs", "findings", "transformers", name + ".py")
    return subprocess.run([sys.executable, script, *options], capture_output=True, text=True)


class TransformersSinkCacheFindingsTest(unittest.TestCase):
    """docs/findings/transformers/sink-cache-*: each reproduction exits 1 while the bug is in
    the pinned release, and its suggested fix (--fixed) exits 0. One release is enough: the
    update code is the same in 4.42.4, 4.46.3 and 4.52.4."""

    def check(self, name, found, fixed):
        run = run_finding(name)
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertRegex(run.stdout, found)
        run = run_finding(name, "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn(fixed, run.stdout)

    def test_the_early_shift_reproduces_and_less_or_equal_fixes_it(self):
        self.check("sink-cache-shifts-one-token-early", "first wrong step: token 5", "every step matches StreamingLLM")

    def test_the_whole_long_prompt_reproduces_and_trimming_it_fixes_it(self):
        self.check("sink-cache-keeps-a-long-prompt-whole", "the cache now holds 30 slots",
                   "the prompt is stored as sinks + window")

    def test_the_second_chunk_reproduces_and_the_chunk_aware_update_fixes_it(self):
        self.check("sink-cache-second-chunk-raises", r"size of tensor b \(0\)", "both cases match StreamingLLM")


class TransformersSlidingWindowFindingsTest(unittest.TestCase):
    """docs/findings/transformers/sliding-window-cache-*: the early roll is in 4.42.4 and 4.46.3
    and fixed in 4.52.4; a chunk past the window is clamped to the last slot in every 4.x."""

    def test_the_early_roll_reproduces_before_4_52_and_the_suggested_update_fixes_it(self):
        run = run_finding("sliding-window-cache-rolls-one-early")
        if RELEASE < (4, 52):
            self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
            self.assertIn("queries whose attention is not the window of W: [5, 6, 7, 8, 9]", run.stdout)
        else:
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        run = run_finding("sliding-window-cache-rolls-one-early", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

    def test_the_clamped_chunk_reproduces_and_the_suggested_update_fixes_it(self):
        run = run_finding("sliding-window-cache-chunk-clamped-to-last-slot")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("queries whose attention is not the window of W: [5, 6, 7, 8, 9, 10, 11, 12, 13]", run.stdout)
        run = run_finding("sliding-window-cache-chunk-clamped-to-last-slot", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)


class Llama4TemperatureFindingTest(unittest.TestCase):
    """docs/findings/transformers/llama4-temperature-counts-left-padding: Llama 4's NoPE layers
    take the attention temperature from slot indices (4.52.4: cache_position; 5.25.0:
    arange + get_seq_length), so a left-padded row's padding moves it."""

    def test_a_padded_row_takes_another_temperature_and_position_ids_fix_it(self):
        run = run_finding("llama4-temperature-counts-left-padding")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("T(slot) = [1.3466, 1.5493, 1.5493, 1.6931] in the padded batch", run.stdout)
        self.assertIn("token 0: max |alone - batched| = 0\n", run.stdout)  # it sees itself alone
        run = run_finding("llama4-temperature-counts-left-padding", "--fixed")
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("the padded batch agrees with the prompt alone", run.stdout)

if __name__ == "__main__":
    unittest.main()
