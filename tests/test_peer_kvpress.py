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
