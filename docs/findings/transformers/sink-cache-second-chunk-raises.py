"""Standalone reproduction (torch + transformers 4.42.4, 4.46.3 or 4.52.4; no kvcheck needed):
a chunk of several tokens that makes SinkCache overflow its window either raises or leaves
the kept keys at the wrong positions.

The shifting branch of SinkCache.update() assumes the cache held exactly window_length
tokens: it keeps the last window_length - num_sink_tokens - n held tokens (n = the new
chunk's length) and re-rotates them back by n positions. A chunk arriving on a cache that
is not full breaks both assumptions. Two cases, each driven as a Llama-style model drives
the cache (keys rotated before update(), the chunk's cos/sin in cache_kwargs):

  A. SinkCache(8, 2), a 5-token prompt, then a chunk of 6 (5 + 6 = 11 > 8): the slice start
     -8 + 2 + 6 is 0, so "the last 0 held tokens" is all 5 of them, against a re-rotation
     table of cos[2 + 6:] of an 8-row table: 0 rows. torch raises.
  B. SinkCache(8, 2), a 6-token prompt, then a chunk of 3 (6 + 3 = 9 > 8): one token must go
     (E = 1); the right one goes, but the kept tokens 3..5 move back 3 positions instead of 1,
     and the chunk's own keys stay where the model rotated them (not moved back by 1).

The chunk's tokens are rotated at the positions every caller gives them here (nothing was
evicted before the chunk: cache position = absolute position); the decodes after it at
StreamingLLM's cache position t - E(t), E(t) = max(0, t + 1 - W). Judged: the cache's state
after the chunk and the decodes (the chunk's own forward attends over whatever update()
returns under the model's causal mask).

    python sink-cache-second-chunk-raises.py          # the stock class
    python sink-cache-second-chunk-raises.py --fixed  # with the suggested fix

Exit status 1 when a case raises or keeps a key at the wrong position (the bug), 0 when
both match StreamingLLM."""

import sys
import warnings

warnings.filterwarnings("ignore")  # SinkCache is deprecated (4.52 warns at every construction)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import SinkCache  # noqa: E402

HEADS, HEAD_DIM, BASE = 2, 8, 10000.0
CASES = (("A", 2, 8, 5, 6, 3), ("B", 2, 8, 6, 3, 3))  # name, sinks, window, prompt, chunk, decodes


class ChunkSinkCache(SinkCache):
    """The suggested fix, as a subclass: a chunk of several tokens that overflows the window
    (held + n > window_length, the first chunk included) is returned whole, after the held
    tokens, for its own forward (the model's causal mask applies), then stored as
    StreamingLLM keeps it: the sinks and the last window_length - num_sink_tokens tokens of
    held + chunk, re-rotated back by the number evicted, E = held + n - window_length.
    Single tokens keep the stock path."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        n = key_states.shape[-2]
        held = self.get_seq_length(layer_idx)
        if n == 1 or held + n <= self.window_length:
            return super().update(key_states, value_states, layer_idx, cache_kwargs)
        cache_kwargs = cache_kwargs or {}
        cos, sin = cache_kwargs.get("cos"), cache_kwargs.get("sin")
        rotary = cache_kwargs.get("partial_rotation_size")
        recent = self.window_length - self.num_sink_tokens
        keys = torch.cat([self.key_cache[layer_idx], key_states], dim=-2) if held else key_states
        values = torch.cat([self.value_cache[layer_idx], value_states], dim=-2) if held else value_states
        kept = keys[:, :, -recent:]
        if cos is not None and sin is not None:
            cos, sin = (cos if cos.dim() == 2 else cos[0]), (sin if sin.dim() == 2 else sin[0])
            # Row i of the table: the position of the i-th of held + chunk (held keys sit at
            # cache positions 0..held-1, the chunk's where the model rotated them). Rows
            # num_sink_tokens..window_length-1 are the cache positions the kept keys go to.
            if held:
                cos = torch.cat([self._cos_cache[:held], cos], dim=0)
                sin = torch.cat([self._sin_cache[:held], sin], dim=0)
            if layer_idx == 0 and (self._cos_cache is None or self._cos_cache.shape[0] < self.window_length):
                self._cos_cache, self._sin_cache = cos[: self.window_length], sin[: self.window_length]
            cos, sin = cos.float(), sin.float()
            old_cos, old_sin = cos[-recent:], sin[-recent:]
            targets = slice(self.num_sink_tokens, self.window_length)  # the cache positions they go to
            new_cos, new_sin = cos[targets], sin[targets]
            shift_cos = (old_cos * new_cos + old_sin * new_sin).to(kept.dtype)  # cos(new - old)
            shift_sin = (old_cos * new_sin - old_sin * new_cos).to(kept.dtype)  # sin(new - old)
            rotated, passed = (kept[..., :rotary], kept[..., rotary:]) if rotary else (kept, kept[..., :0])
            kept = torch.cat([self._apply_key_rotary_pos_emb(rotated, shift_cos, shift_sin), passed], dim=-1)
        if layer_idx == 0:
            self._seen_tokens += n
        stored_keys = torch.cat([keys[:, :, : self.num_sink_tokens], kept], dim=-2)
        stored_values = torch.cat([values[:, :, : self.num_sink_tokens], values[:, :, -recent:]], dim=-2)
        if held:
            self.key_cache[layer_idx], self.value_cache[layer_idx] = stored_keys, stored_values
        else:
            self.key_cache.append(stored_keys)
            self.value_cache.append(stored_values)
        return keys, values


def cos_sin(positions):
    """Llama's RoPE tables for the given positions: [1, n, HEAD_DIM] each (rotate_half)."""
    inv_freq = 1.0 / BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float()[None], emb.sin().float()[None]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x, positions):
    """x [..., n, HEAD_DIM] rotated at positions (one per row of n)."""
    cos, sin = cos_sin(positions)
    return x * cos + rotate_half(x) * sin


def recover(stored, raw):
    """The position p with stored == rotate(raw, p) over all heads, or None."""
    best, err = None, None
    for p in range(-64, 65):
        e = (stored - rotate(raw[:, None, :], [p])[:, 0, :]).abs().max().item()
        if err is None or e < err:
            best, err = p, e
    return best if err < 1e-4 else None


def attend(q, keys, values):
    """One query [H, D] over keys/values [H, n, D]: [H, D]."""
    scores = torch.einsum("hd,hnd->hn", q, keys) / HEAD_DIM ** 0.5
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), values)


def run(cls, name, sinks, window, prompt, chunk, decodes):
    """Drives one case; prints what it finds; True when everything matches StreamingLLM."""

    def kept(t):  # StreamingLLM after token t (the window counts t itself): {token: cache position}
        e = max(0, t + 1 - window)
        return {u: (u if u < sinks else u - e) for u in list(range(sinks)) + list(range(sinks + e, t + 1))}

    tokens = prompt + chunk + decodes
    torch.manual_seed(0)
    q_raw, k_raw, v_raw = (torch.randn(HEADS, tokens, HEAD_DIM) for _ in range(3))

    def held(cache):  # [(token, position)] of every slot of layer 0 (tokens matched by their values)
        keys, values = cache.key_cache[0][0], cache.value_cache[0][0]
        slots = []
        for j in range(keys.shape[-2]):
            u = min(range(tokens), key=lambda u: (values[:, j] - v_raw[:, u]).abs().max().item())
            slots.append((u, recover(keys[:, j], k_raw[:, u])))
        return slots

    def feed(cache, ts, positions):
        cos, sin = cos_sin(positions)
        return cache.update(rotate(k_raw[None, :, ts], positions), v_raw[None, :, ts].clone(), 0,
                            {"cos": cos, "sin": sin, "cache_position": torch.tensor(positions)})

    print("\ncase %s: %s(window_length=%d, num_sink_tokens=%d), a %d-token prompt (positions 0..%d), then a chunk of "
          "%d (positions %d..%d)" % (name, cls.__name__, window, sinks, prompt, prompt - 1, chunk, prompt,
                                     prompt + chunk - 1))
    cache = cls(window, sinks)
    feed(cache, list(range(prompt)), list(range(prompt)))
    ts = list(range(prompt, prompt + chunk))
    try:
        feed(cache, ts, ts)
    except Exception as e:  # noqa: BLE001  the finding: report it
        print("  the chunk's update() raised %s: %s" % (type(e).__name__, e))
        return False
    slots, want = held(cache), kept(ts[-1])
    ok = [u for u, _ in slots] == list(want) and all(p == want[u] for u, p in slots)
    print("  after the chunk the cache holds %d slots (StreamingLLM keeps %d, %d evicted)"
          % (len(slots), len(want), ts[-1] + 1 - len(want)))
    print("    held:     %s" % ", ".join("%d@%s" % (u, "?" if p is None else p) for u, p in slots))
    print("    expected: %s%s" % (", ".join("%d@%d" % (u, p) for u, p in want.items()), "" if ok else "   <- differs"))
    for t in range(prompt + chunk, tokens):
        want = kept(t)
        pq = want[t]
        keys, values = feed(cache, [t], [pq])
        q = rotate(q_raw[:, [t]], [pq])[:, 0]
        ref_keys = torch.stack([rotate(k_raw[:, [u]], [p])[:, 0] for u, p in want.items()], dim=1)
        ref_values = torch.stack([v_raw[:, u] for u in want], dim=1)
        diff = (attend(q, keys[0], values[0]) - attend(q, ref_keys, ref_values)).abs().max().item()
        slots = held(cache)
        good = [u for u, _ in slots] == list(want) and all(p == want[u] for u, p in slots) and diff < 1e-5
        print("  decode token %d (query at %d): %s, max output difference %.6f" % (t, pq, "ok" if good else "wrong",
                                                                                 diff))
        ok = ok and good
    return ok


def main():
    cls = ChunkSinkCache if "--fixed" in sys.argv else SinkCache
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    results = [run(cls, *case) for case in CASES]
    wrong = [case[0] for case, ok in zip(CASES, results) if not ok]
    print("\n%s" % ("cases that raise or differ from StreamingLLM: %s" % ", ".join(wrong) if wrong else
                    "both cases match StreamingLLM"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
