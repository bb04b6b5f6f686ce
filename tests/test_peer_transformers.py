"""transformers itself, as shipped (label peer.transformers): the real cache classes of a
pinned release, installed by tools/test into their own venv (tools/setup/requirements/),
driven through tools/kvtrace.py exactly as the README tells a user to, and judged by
`kvcheck verify`. No hub model: the caches are driven with the scenario's own q, k, v.

transformers 4.52.4 is the last release whose SinkCache works (4.53 removed it). Its three
documented behaviours, each the class kvcheck must name at the step it names:
- it shifts one token early (when held + n == window_length nothing needs to go);
- a first chunk longer than the window is stored whole;
- a second chunk of several tokens that crosses the window raises in torch."""

import json
import os
import shutil
import tempfile
import unittest
import warnings

from test_kvtrace import SCENARIOS, export, kvcheck, kvtrace

import transformers
from transformers import SinkCache

# SinkCache warns that it is deprecated at every construction.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


class TransformersSinkCacheTest(unittest.TestCase):
    def setUp(self):
        self.assertEqual(transformers.__version__, "4.52.4", "the venv holds another release")
        self.work = tempfile.mkdtemp(prefix="kvcheck-peer-transformers-")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.trace = os.path.join(self.work, "trace")

    def drive(self, scenario, make_cache):
        """The README's recipe: export, drive with generate()'s absolute positions and the
        cache's own cache-relative keys, verify."""
        exp = export(self.work, scenario)
        result = kvtrace.drive_hf_cache(exp, make_cache, self.trace, positions="absolute",
                                        key_positions="cache-relative", as_tensor="torch")
        return result, kvcheck("verify", os.path.join(SCENARIOS, scenario + ".json"), "--trace", self.trace)

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


if __name__ == "__main__":
    unittest.main()
