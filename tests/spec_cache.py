"""A correct KV cache for every policy of SPEC 3 and 7, written for the tests from the SPEC
alone (NumPy): per layer and row it keeps each token's raw key and value, evicts what the
policy evicts, and shows the keys it holds rotated at the positions the policy gives
(cache-relative, lazy eviction). Rows are independent, so left padding (the driver's
cache_kwargs["padding"]), reorders that fork rows, crops (refused when the policy has
evicted a token the cropped row needs) and per-layer policies all follow the SPEC. Driven
with chunks="eviction" so no forward evicts inside itself under a sink policy."""

import numpy as np

import kvtrace


def sees(policy, t, j):
    """Whether token t attends token j (j <= t) under the streaming rule of SPEC 3."""
    kind = policy["type"]
    if kind == "full":
        return j <= t
    if kind == "sliding":
        return t - policy["window"] < j <= t
    if kind == "chunked":  # SPEC 10.2: its own chunk
        return j // policy["chunk"] == t // policy["chunk"] and j <= t
    s = policy["sinks"]
    return j < min(s, t + 1) or s + kvtrace.evicted(policy, t) <= j <= t


def position(policy, t, e):
    """Where a kept key is rotated for a query whose row has evicted e tokens."""
    if policy["type"] == "sink" and policy.get("positions", "cache") == "cache" and t >= policy["sinks"]:
        return t - e
    return t


class SpecCache:
    def __init__(self, export, batch, honours_padding=True, keeps=None):
        """keeps: a policy per layer for what each layer keeps, where it differs from the
        scenario's (a ring of C for a chunked layer: a sliding window of C)."""
        layers = export.dims["layers"]
        self.policies = [export.layer_policy(l) for l in range(layers)]
        self.keeps = keeps or self.policies
        self.ropes, self.honours_padding = [export.layer_rope(l) for l in range(layers)], honours_padding
        self.shape = (export.dims["kv_heads"], export.dims["head_dim"])
        self.rows = [[[] for _ in range(batch)] for _ in range(layers)]  # (token, raw key, value)
        self.count = [[0] * batch for _ in range(layers)]                 # tokens seen per row
        self.key_cache, self.value_cache = [None] * layers, [None] * layers
        for l in range(layers):
            self.show(l)

    def evicted_before(self, layer, t):
        policy = self.policies[layer]
        return kvtrace.evicted(policy, t) if policy["type"] == "sink" else 0

    def tensors(self, layer, row_tokens, e):
        """[B, Hkv, S, D] keys (rotated for evicted count e[b]) and values, each row's
        entries (None: a zero slot) in order, right-aligned."""
        hkv, d = self.shape
        slots = max([len(r) for r in row_tokens] + [0])
        keys, values = np.zeros((len(row_tokens), hkv, slots, d)), np.zeros((len(row_tokens), hkv, slots, d))
        for b, entries in enumerate(row_tokens):
            first = slots - len(entries)
            for i, entry in enumerate(entries):
                if entry is None:
                    continue
                t, raw, v = entry
                p = position(self.policies[layer], t, e[b])
                keys[b, :, first + i] = kvtrace.rotate(raw[:, None, :], [p], self.ropes[layer])[:, 0]
                values[b, :, first + i] = v
        return keys, values

    def show(self, layer):
        """The state between steps: each row's kept tokens as its last token saw them."""
        e = [self.evicted_before(layer, c - 1) for c in self.count[layer]]
        self.key_cache[layer], self.value_cache[layer] = self.tensors(layer, self.rows[layer], e)

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        policy, l = self.keeps[layer_idx], layer_idx
        positions, padding = cache_kwargs["positions"], np.asarray(cache_kwargs["padding"])
        raw = cache_kwargs["unrotate"](key_states, positions[:, None, :])     # [B, Hkv, n, D]
        values = np.asarray(value_states, dtype=np.float64)
        n = raw.shape[2]
        shown, e = [], []
        for b, row in enumerate(self.rows[l]):
            new = [i for i in range(n) if not (self.honours_padding and padding[b, i])]
            t0 = self.count[l][b]
            if new:  # what the chunk's first token no longer sees goes before the forward
                row[:] = [entry for entry in row if sees(policy, t0, entry[0])]
            e.append(self.evicted_before(l, t0) if new else self.evicted_before(l, t0 - 1))
            region = [None] * n
            for k, i in enumerate(new):
                region[i] = (t0 + k, raw[b, :, i], values[b, :, i])
            shown.append(list(row) + region)
            row.extend(region[i] for i in new)
            self.count[l][b] += len(new)
            last = self.count[l][b] - 1  # after the forward it keeps what its last token saw
            row[:] = [entry for entry in row if sees(policy, last, entry[0])]
        keys, vals = self.tensors(l, shown, e)
        self.show(l)
        return keys, vals

    def crop(self, length):
        for l, policy in enumerate(self.policies):
            for b, row in enumerate(self.rows[l]):
                if self.count[l][b] <= length:
                    continue
                held = {entry[0] for entry in row}
                needed = [j for j in range(length) if sees(policy, length - 1, j)]
                if any(j not in held for j in needed):
                    raise ValueError("crop_evicted: row %d needs tokens this %s cache evicted" % (b, policy["type"]))
        for l in range(len(self.policies)):
            for b, row in enumerate(self.rows[l]):
                row[:] = [entry for entry in row if entry[0] < length]
                self.count[l][b] = min(self.count[l][b], length)
            self.show(l)

    def reorder_cache(self, beam_idx):
        rows = [int(r) for r in np.asarray(beam_idx)]
        for l in range(len(self.policies)):
            self.rows[l] = [list(self.rows[l][r]) for r in rows]
            self.count[l] = [self.count[l][r] for r in rows]
            self.show(l)
