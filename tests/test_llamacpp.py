"""`kvcheck llamacpp` on sink scenarios it was never tuned on: sinks, window, n_discard,
rows (sequences), prompt and chunk lengths, heads and head sizes drawn from a fixed seed, each run through
llama.cpp's own cache (f32, f16, flash attention) and judged by the one checker."""

import json
import os
import random
import subprocess
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVCHECK = os.environ.get("KVCHECK_BIN", os.path.join(ROOT, "build", "kvcheck"))
# Under the sanitizers, llama.cpp's own allocations (never freed at exit) are not kvcheck's.
ENV = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")


def draw(rng, index):
    sinks = rng.randint(0, 6)
    window = rng.choice([12, 20, 33, 48, 64])
    heads, kv_heads = rng.choice([(4, 4), (8, 2), (6, 3), (4, 1), (2, 2)])
    batch = rng.randint(1, 3)  # several rows: llama.cpp sequences, each fed only its own tokens

    def counts(low, high):
        return [rng.randint(low, high) for _ in range(batch)]

    steps = [{"op": "append", "tokens": counts(1, 2 * window)}, {"op": "decode", "steps": rng.randint(1, window)},
             {"op": "append", "tokens": counts(2, window)}, {"op": "decode", "steps": rng.randint(window, 2 * window)}]
    return {"name": "llamacpp_drawn_%d" % index, "description": "drawn by tests/test_llamacpp.py",
            "dimensions": {"layers": rng.randint(1, 3), "batch": batch, "heads": heads, "kv_heads": kv_heads,
                           "head_dim": rng.choice([32, 64, 128])},
            "rope": {"theta": rng.choice([10000.0, 500000.0, 1000000.0])},
            "policy": {"type": "sink", "sinks": sinks, "window": window, "evict": rng.randint(1, window - sinks)},
            "seed": rng.randint(0, 2 ** 32), "steps": steps}


class LlamacppTest(unittest.TestCase):
    def test_drawn_sink_scenarios_pass_in_f32_f16_and_flash_attention(self):
        rng = random.Random(20261201)
        with tempfile.TemporaryDirectory(prefix="kvcheck-llamacpp-") as work:
            for index in range(6):
                scenario = draw(rng, index)
                path = os.path.join(work, scenario["name"] + ".json")
                with open(path, "w") as f:
                    json.dump(scenario, f)
                for options in ([], ["--type-k", "f16", "--type-v", "f16"], ["--flash-attn", "on"]):
                    with self.subTest(scenario=json.dumps(scenario), options=options):
                        done = subprocess.run([KVCHECK, "llamacpp", path, *options], capture_output=True, text=True,
                                              env=ENV)
                        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                        self.assertIn("no divergence", done.stdout)


if __name__ == "__main__":
    unittest.main()
