"""SPEC 8.1 from an independent path: the README's Python formulas for token ids and
context keys reproduce, bit for bit, the keys and queries kvcheck exported for a paged
fixture, and rows with equal ids and extras get equal vectors while another adapter does not."""
import json
import os
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "fixtures", "golden", "paged_fork_then_prefix_hit")
SCENARIO = os.path.join(HERE, "..", "fixtures", "scenarios", "paged_fork_then_prefix_hit.json")
M = (1 << 64) - 1


def splitmix(z):
    z = (z + 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def value(seed, layer, key, tensor, head, dim):
    h = splitmix(seed)
    for c in (layer, key, tensor, head, dim):
        h = splitmix(h ^ c)
    return (h >> 40) / 2 ** 23 - 1


def mix(a, b):
    return splitmix(a ^ splitmix(b))


def fnv(text):
    h = 0xcbf29ce484222325
    for c in text.encode():
        h = ((h ^ c) * 0x100000001b3) & M
    return h


def row_context(seed, adapter="", salt=""):
    return mix(mix(splitmix(seed), fnv("adapter:" + adapter)), fnv("salt:" + salt))


def token_id(seed, uid):
    return splitmix(splitmix(seed) ^ uid) >> 33


def context_keys(scenario):
    """Per uid, walking the steps as the README says (ops used by the fixture)."""
    seed, batch = scenario["seed"], scenario["dimensions"]["batch"]
    rows = [{"extras": {}, "contexts": []} for _ in range(batch)]
    keys, uid = [], 0
    for step in scenario["steps"]:
        if step["op"] in ("append", "decode"):
            for _ in range(step.get("steps", 1)):
                for b in range(len(rows)):
                    if "extra" in step and step["extra"][b] is not None:
                        rows[b]["extras"] = step["extra"][b]
                    ids = step["ids"][b] if "ids" in step else [None] * (1 if step["op"] == "decode" else step["tokens"])
                    for i in ids:
                        before = rows[b]["contexts"][-1] if rows[b]["contexts"] else row_context(seed, **rows[b]["extras"])
                        rows[b]["contexts"].append(mix(before, token_id(seed, uid) if i is None else i))
                        keys.append(rows[b]["contexts"][-1])
                        uid += 1
        elif step["op"] == "reorder":
            rows = [json.loads(json.dumps(rows[r])) for r in step["rows"]]
        elif step["op"] == "free":
            for r in step["rows"]:
                rows[r] = {"extras": {}, "contexts": []}
    return keys


class PagedContentTest(unittest.TestCase):
    def test_readme_formulas_reproduce_the_exported_keys_and_queries(self):
        with open(SCENARIO) as f:
            scenario = json.load(f)
        keys = context_keys(scenario)
        k = np.load(os.path.join(GOLDEN, "k.npy"))
        q = np.load(os.path.join(GOLDEN, "q.npy"))
        layers, uids, kv_heads, dim = k.shape
        self.assertEqual(uids, len(keys))
        seed = scenario["seed"]
        for layer in range(layers):
            for u in range(uids):
                for h in range(kv_heads):
                    want = [value(seed, layer, keys[u], 1, h, d) for d in range(dim)]
                    np.testing.assert_array_equal(k[layer, u, h], np.array(want, dtype=np.float32))
                want_q = [value(seed, layer, keys[u], 0, 0, d) for d in range(dim)]
                np.testing.assert_array_equal(q[layer, u, 0], np.array(want_q, dtype=np.float32))

    def test_equal_ids_share_vectors_only_under_equal_extras(self):
        with open(SCENARIO) as f:
            scenario = json.load(f)
        k = np.load(os.path.join(GOLDEN, "k.npy"))
        # Step 0: uids 0-12 (row 0, adapter A) and 13-25 (row 1, adapter B), equal ids.
        self.assertFalse(np.array_equal(k[:, 0], k[:, 13]))
        # The last append: row 1 restarts under adapter A with the same first 13 ids as row 0.
        last = k.shape[1] - 17
        np.testing.assert_array_equal(k[:, last:last + 13], k[:, 0:13])


if __name__ == "__main__":
    unittest.main()
