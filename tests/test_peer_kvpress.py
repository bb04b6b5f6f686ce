"""kvpress as shipped (label peer.kvpress): StreamingLLMPress and KeyRerotationPress applied by
kvpress's own hooks to a tiny transformers Llama, driven through kvtrace.drive_kvpress as
kvpress's pipeline runs them (SPEC 11's prune). The venv build/venvs/kvpress (kvpress 0.5.5,
transformers 5.2.0, torch 2.13.0 CPU) is made by tools/test from tools/setup/requirements/."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings

from test_kvtrace import DATA, SCENARIOS, export, kvcheck, kvtrace

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvpress
import kvtrace_kvpress

warnings.filterwarnings("ignore")
FINDINGS = os.path.join(os.path.dirname(SCENARIOS), "..", "docs", "findings", "kvpress")


class KvpressTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-kvpress-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, folder=SCENARIOS, **options):
        result = kvtrace_kvpress.drive_kvpress(export(self.work, scenario, folder), self.trace, **options)
        return result, kvcheck("verify", os.path.join(folder, scenario + ".json"), "--trace", self.trace)

    def held_after(self, step):
        """Slots per layer the trace's step holds [B, Hkv, slots, D] (its keys' shape)."""
        with open(os.path.join(self.trace, "manifest.json")) as f:
            layers = json.load(f)["steps"][step]["layers"]
        return [np.load(os.path.join(self.trace, layer["keys"])).shape for layer in layers]

    def test_streaming_llm_press_keeps_its_sinks_and_recent_tokens_at_their_positions(self):
        result, verify = self.drive("prune_streaming_llm_original_positions")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        # 14 tokens before the press (step 0), 2 sinks + 5 recent after it (step 1), per layer.
        self.assertEqual(self.held_after(0), [(2, 2, 14, 16)] * 2)
        self.assertEqual(self.held_after(1), [(2, 2, 7, 16)] * 2)
        # Crops into the pruned run and past it, with appends between (KeyRerotationPress, whose
        # kept tokens stay in token order): the driver's slot count follows the cut row's run.
        result, verify = self.drive("prune_crops_into_the_pruned_run", DATA)
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_key_rerotation_press_moves_the_kept_keys_to_their_ranks(self):
        result, verify = self.drive("prune_key_rerotation")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("every stored key is its raw key rotated at its cache-relative position", verify.stdout)

    def test_the_press_without_rerotation_is_named_at_the_prune(self):
        # StreamingLLMPress alone where the scenario asks for re-rotation: the kept recent keys
        # stay at their original positions 9..13 instead of 2..6.
        plain = lambda prune, n: kvtrace_kvpress._press(dict(prune, rerotate=False), n)
        _, verify = self.drive("prune_key_rerotation", press=plain)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("class: kept keys not re-rotated", verify.stdout)

    def test_a_rerotation_the_scenario_does_not_ask_for_is_named_at_the_prune(self):
        rerotated = lambda prune, n: kvtrace_kvpress._press(dict(prune, rerotate=True), n)
        _, verify = self.drive("prune_streaming_llm_original_positions", press=rerotated)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("expected position 9 (recovered: 2)", verify.stdout)
        self.assertIn("class: key at wrong position", verify.stdout)

    def test_generate_positions_after_a_rerotating_press_are_named_at_the_first_new_token(self):
        _, verify = self.drive("prune_key_rerotation", positions="generate")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/2)", verify.stdout)
        self.assertIn("class: new key not shifted", verify.stdout)
        self.assertIn("expected position 7 (recovered: 14)", verify.stdout)

    def test_the_compressed_length_as_position_without_rerotation_is_named(self):
        # A bare model call without position_ids after StreamingLLMPress: the new token at
        # get_seq_length() = 7, its true position 14.
        _, verify = self.drive("prune_streaming_llm_original_positions", positions="seq_length")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/2)", verify.stdout)
        self.assertIn("expected position 14 (recovered: 7)", verify.stdout)
        self.assertIn("class: key at wrong position", verify.stdout)

    def test_generate_inside_a_rerotating_press_places_new_tokens_at_the_original_index(self):
        # What the driver's positions="generate" stands for, measured on the real generate():
        # after KeyRerotationPress keeps 7 of 12 prompt tokens at positions 0..6, the first
        # generated token is fed at position_ids 12, not 7.
        config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        seen = []
        model.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((kwargs["position_ids"].tolist(),
                                                      kwargs["past_key_values"].get_seq_length())),
            with_kwargs=True)
        press = kvpress.KeyRerotationPress(press=kvpress.StreamingLLMPress(compression_ratio=1 - 7.5 / 12, n_sink=2))
        ids = torch.arange(1, 13)[None]  # no pad token (0): generate would take it for padding
        with torch.no_grad(), press(model):
            model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=DynamicCache(),
                           pad_token_id=0)
        self.assertEqual(seen[0], ([list(range(12))], 0))
        self.assertEqual(seen[1], ([[12]], 7))  # 7 slots held, the new token at 12

    def test_the_finding_reproduces_and_the_suggested_fix_fixes_it(self):
        script = os.path.join(FINDINGS, "generate-after-key-rerotation-misplaces-new-tokens.py")
        shipped = subprocess.run([sys.executable, script], capture_output=True, text=True)
        self.assertEqual(shipped.returncode, 1, shipped.stdout + shipped.stderr)
        self.assertIn("after the compression: 0.00404", shipped.stdout)
        fixed = subprocess.run([sys.executable, script, "--fixed"], capture_output=True, text=True)
        self.assertEqual(fixed.returncode, 0, fixed.stdout + fixed.stderr)

    def test_gemma3_with_the_pipelines_cache_raises_at_the_first_token_after_the_prune(self):
        # DynamicCache() as kvpress's pipeline makes it: the full layer holds 8 slots, the mask
        # is sized from the sliding layer 0's 15.
        result, verify = self.drive("prune_gemma3_full_layer_beside_sliding")
        self.assertEqual(result.error_step, 2, result)
        self.assertIn("RuntimeError: The size of tensor a (8) must match the size of tensor b (15)", result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/2)", verify.stdout)
        self.assertIn("class: the cache raised", verify.stdout)

    def test_gemma3_with_the_models_cache_lets_a_chunk_see_its_later_tokens(self):
        # DynamicCache(config): the full layer's causal mask compares its slots 10..12 with query
        # positions 17..19 counted from the sliding layer: the chunk's first tokens see the rest.
        result, verify = self.drive("prune_gemma3_full_layer_beside_sliding", cache="model")
        self.assertIsNone(result.error)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 5 (append, /steps/3), row 0, layer 1", verify.stdout)
        self.assertIn("class: chunk sees future keys", verify.stdout)

    def test_the_gemma3_finding_reproduces_and_the_suggested_fixes_fix_it(self):
        script = os.path.join(FINDINGS, "gemma3-chunk-after-compression-sees-later-tokens.py")
        shipped = subprocess.run([sys.executable, script], capture_output=True, text=True)
        self.assertEqual(shipped.returncode, 1, shipped.stdout + shipped.stderr)
        self.assertIn("the pipeline's DynamicCache(): the chunk after the compression raises RuntimeError",
                      shipped.stdout)
        self.assertIn("DynamicCache(config=model.config): max |chunk - one at a time| per token: 0.0597, 0.0295",
                      shipped.stdout)
        self.assertIn("KeyRerotationPress: the prompt raises AttributeError: 'Gemma3RotaryEmbedding' object has no "
                      "attribute 'inv_freq'", shipped.stdout)
        fixed = subprocess.run([sys.executable, script, "--fixed"], capture_output=True, text=True)
        self.assertEqual(fixed.returncode, 0, fixed.stdout + fixed.stderr)

    def observed(self, scenario, **options):
        """Drives an observed-prune scenario (SPEC 11.1) of tests/data; returns the export and verify."""
        exp = export(self.work, scenario, DATA)
        result = kvtrace_kvpress.drive_kvpress(exp, self.trace, **options)
        self.assertIsNone(result.error)
        return exp, kvcheck("verify", os.path.join(DATA, scenario + ".json"), "--trace", self.trace)

    def test_knorm_press_is_judged_on_the_tokens_each_kv_head_kept(self):
        exp, verify = self.observed("prune_observed_knorm")
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        self.assertIn("kept by the press: 8 kv heads of full layers each kept the prune's count", verify.stdout)
        self.assertIn("every stored key is its raw key rotated at its cache-relative position", verify.stdout)
        # 2 layers x 2 rows x 8 later tokens x 4 heads, expected over the sets read from the cache.
        self.assertIn("and 128 outputs (token, head) after it were expected over those sets", verify.stdout)
        # An independent look at what the cache held after the press: each head's 7 values are
        # its prompt tokens' with the smallest key norms (KnormPress), a set of its own.
        with open(os.path.join(self.trace, "manifest.json")) as f:
            layers = json.load(f)["steps"][1]["layers"]
        sets = {}
        for l, layer in enumerate(layers):
            values = np.load(os.path.join(self.trace, layer["values"]))  # [B, Hkv, 7, D]
            for b, row in enumerate(exp.steps[0]["rows"]):
                uids = np.array(row["uids"])
                for g in range(values.shape[1]):
                    candidates = exp.v[l][uids][:, g].astype(np.float32)
                    kept = sorted(int(np.flatnonzero((candidates == v.astype(np.float32)).all(axis=1))[0])
                                  for v in values[b, g])
                    norms = np.linalg.norm(exp.k[l][uids][:, g].astype(np.float64), axis=-1)
                    order = np.sort(norms)
                    self.assertGreater(order[7] - order[6], 1e-4 * order[7])  # no near tie at the cut
                    self.assertEqual(kept, sorted(np.argsort(norms)[:7].tolist()), (l, b, g))
                    sets[l, b, g] = kept
        self.assertGreater(len(set(map(tuple, sets.values()))), 1)

    def test_knorm_press_at_original_positions_passes(self):
        _, verify = self.observed("prune_observed_knorm_original_positions")
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_a_press_that_skips_a_layer_or_rounds_its_ratio_the_other_way_is_named(self):
        def knorm(ratio):
            return lambda prune, n: kvpress.KeyRerotationPress(press=kvpress.KnormPress(compression_ratio=ratio(n)))
        # kvpress keeps int(n (1 - ratio)): 1 - 6.5/14 keeps 6, not 7.
        _, verify = self.observed("prune_observed_knorm", press=knorm(lambda n: 1 - 6.5 / n))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("layer 0 row 0 kv head 0 holds 6 of its 14 prompt tokens, the prune keeps 7", verify.stdout)
        self.assertIn("class: kept count wrong", verify.stdout)
        # A ratio of 0: kvpress returns the cache unchanged, every prompt token held.
        _, verify = self.observed("prune_observed_knorm", press=knorm(lambda n: 0.0))
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("holds 14 of its 14 prompt tokens, the prune keeps 7", verify.stdout)
        self.assertIn("class: kept count wrong", verify.stdout)

    def test_positions_after_a_score_based_press_are_named(self):
        # KnormPress alone where the scenario re-rotates: kept keys left at their indices.
        plain = lambda prune, n: kvpress.KnormPress(compression_ratio=kvtrace_kvpress.compression_ratio(7, n))
        _, verify = self.observed("prune_observed_knorm", press=plain)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("class: kept keys not re-rotated", verify.stdout)
        # generate() inside the press: the first new token at its original index 14, not 7.
        _, verify = self.observed("prune_observed_knorm", positions="generate")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 2 (decode, /steps/2)", verify.stdout)
        self.assertIn("expected position 7 (recovered: 14)", verify.stdout)
        self.assertIn("class: new key not shifted", verify.stdout)
        # Without re-rotation, a bare model call places the new token at the compressed length.
        _, verify = self.observed("prune_observed_knorm_original_positions", positions="seq_length")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("expected position 14 (recovered: 7)", verify.stdout)
        self.assertIn("class: key at wrong position", verify.stdout)

    def test_a_rerotation_ranked_by_another_heads_set_is_named(self):
        # A port of KeyRerotationPress that computes one rotation per layer from kv head 0's kept
        # indices: head 1 gathers its own keys but turns them by head 0's distances.
        from transformers.models.llama.modeling_llama import rotate_half

        class OneRotationPerLayer(kvpress.KeyRerotationPress):
            @staticmethod
            def rerotate_keys(module, indices, keys):
                cos, sin = kvpress.KeyRerotationPress._rerotate_cos_sin(
                    keys, module.rotary_emb.inv_freq, indices[:, :1].expand_as(indices))
                keys = keys.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)).contiguous()
                return keys * cos + rotate_half(keys) * sin

        press = lambda prune, n: OneRotationPerLayer(
            press=kvpress.KnormPress(compression_ratio=kvtrace_kvpress.compression_ratio(7, n)))
        _, verify = self.observed("prune_observed_knorm", press=press)
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("kv head 1 slot", verify.stdout)
        self.assertNotIn("kv head 0 slot", verify.stdout)
        self.assertIn("class: key at wrong position", verify.stdout)

    def test_gemma3_under_a_score_based_press_is_judged_on_its_outputs(self):
        # The Gemma 3 finding under KnormPress: every slot checks out, and the chunk after the
        # press sees its later tokens, which only the outputs over the kept sets can show.
        exp, verify = self.observed("prune_observed_gemma3", cache="model")
        self.assertEqual(verify.returncode, 1, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 5 (append, /steps/3), row 0, layer 1", verify.stdout)
        self.assertIn("every slot checks out", verify.stdout)
        self.assertIn("class: chunk sees future keys", verify.stdout)

    def test_a_press_that_drops_a_required_recent_token_is_named(self):
        # The scenario asks every kv head to keep its last 4 prompt tokens (SnapKV's window):
        # SnapKVPress with window_size 4 does, KnormPress does not.
        with open(os.path.join(DATA, "prune_observed_knorm.json")) as f:
            scenario = json.load(f)
        scenario["name"] = "prune_observed_recent"
        scenario["steps"][1]["recent"] = 4
        with open(os.path.join(self.work, "prune_observed_recent.json"), "w") as f:
            json.dump(scenario, f)
        exp = export(self.work, "prune_observed_recent", self.work)
        snapkv = lambda prune, n: kvpress.KeyRerotationPress(press=kvpress.SnapKVPress(
            compression_ratio=kvtrace_kvpress.compression_ratio(7, n), window_size=4, kernel_size=3))
        for press, code in ((snapkv, 0), (None, 1)):
            self.assertIsNone(kvtrace_kvpress.drive_kvpress(exp, self.trace, press=press).error)
            verify = kvcheck("verify", os.path.join(self.work, "prune_observed_recent.json"), "--trace", self.trace)
            self.assertEqual(verify.returncode, code, verify.stdout + verify.stderr)
        self.assertIn("first divergence: step 1 (prune, /steps/1)", verify.stdout)
        self.assertIn("which the next token still sees", verify.stdout)
        self.assertIn("class: dropped a live token", verify.stdout)

    def test_other_score_based_presses_pass(self):
        def wrapped(make):
            return lambda prune, n: kvpress.KeyRerotationPress(press=make(kvtrace_kvpress.compression_ratio(7, n)))
        presses = {
            "SnapKVPress": wrapped(lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=4, kernel_size=3)),
            "TOVAPress": wrapped(lambda r: kvpress.TOVAPress(compression_ratio=r)),
            "ExpectedAttentionPress": wrapped(lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r, n_sink=2)),
            "RandomPress": wrapped(lambda r: kvpress.RandomPress(compression_ratio=r, seed=0)),
        }
        for name, press in presses.items():
            with self.subTest(press=name):
                _, verify = self.observed("prune_observed_knorm", press=press)
                self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)

    def test_what_kvpress_cannot_do_is_refused_by_name(self):
        scenario = {"name": "prune_late", "dimensions": {"layers": 1, "batch": 1, "heads": 2, "head_dim": 8},
                    "policy": {"type": "full"}, "seed": 5,
                    "steps": [{"op": "append", "tokens": 6}, {"op": "decode", "steps": 1},
                              {"op": "prune", "sinks": 1, "recent": 2}]}
        with open(os.path.join(self.work, "prune_late.json"), "w") as f:
            json.dump(scenario, f)
        with self.assertRaisesRegex(kvtrace.UsageError, "compresses only a forward that starts on an empty cache"):
            self.drive("prune_late", self.work)
        # StreamingLLMPress keeps its tokens in score order: a crop into the prompt is no slot count.
        plain = lambda prune, n: kvtrace_kvpress._press(dict(prune, rerotate=False), n)
        with self.assertRaisesRegex(kvtrace.UsageError, "crops to 5 tokens, into the 12-token prompt the press pruned"):
            self.drive("prune_crops_into_the_pruned_run", DATA, press=plain)
        # The other drivers name the driver that can.
        with self.assertRaisesRegex(kvtrace.UsageError, "drive the scenario with kvtrace.drive_kvpress"):
            kvtrace.drive_hf_cache(export(self.work, "prune_streaming_llm_original_positions"), lambda: None,
                                   self.trace)


if __name__ == "__main__":
    unittest.main()
