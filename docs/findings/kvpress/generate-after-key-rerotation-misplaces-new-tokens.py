"""Standalone reproduction (torch, transformers 5.2.0 and kvpress 0.5.5; no kvcheck needed):
`model.generate()` inside a `KeyRerotationPress` feeds the generated tokens at their
original positions n, n + 1, ..., while the press has moved the k kept keys to positions
0 .. k - 1. Every new token then sits n - k positions too far from the context it attends to.

    python generate-after-key-rerotation-misplaces-new-tokens.py          # as shipped
    python generate-after-key-rerotation-misplaces-new-tokens.py --fixed  # positions moved down

A one-layer LlamaForCausalLM (random weights, eager attention) reads a 24-token prompt inside
`KeyRerotationPress(StreamingLLMPress(n_sink=4))` keeping 12 tokens, and generates 4 tokens
greedily. Expected: what the same model computes from the 12 kept tokens alone, read afresh
at positions 0..11 and followed by the same generated tokens at 12, 13, ... (with one layer a
kept token's key and value depend on its own embedding only, so this is exactly the cache
the press leaves, re-rotated). Compared: the logits of the generated tokens after the first
(the first is computed before compression, from the whole prompt).

Exit status 1 when generate's logits differ from the expected ones (the bug), 0 when they
agree."""

import sys
import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvpress import KeyRerotationPress, StreamingLLMPress

warnings.filterwarnings("ignore")

N, SINKS, KEPT, NEW = 24, 4, 12, 4


class FixedPositions(KeyRerotationPress):
    """The suggested fix, as a subclass: while the press is active, a forward that follows the
    compression has its position_ids moved down by the tokens the press removed (n - k), so
    generate() continues at k as kvpress's pipeline does. kvpress would do it in
    KeyRerotationPress.__call__ (or BasePress.__call__ for every re-rotating press)."""

    def __call__(self, model):
        removed = {}

        def record(module, args, kwargs, output):  # after a compressing forward
            cache = kwargs.get("past_key_values")
            if cache is not None and "n" not in removed:
                removed["n"] = kwargs["position_ids"].shape[-1] - cache.get_seq_length()

        def shift(module, args, kwargs):
            if removed.get("n") and kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = kwargs["position_ids"] - removed["n"]
            return args, kwargs

        hooks = [model.model.register_forward_hook(record, with_kwargs=True),
                 model.model.register_forward_pre_hook(shift, with_kwargs=True)]
        context = super().__call__(model)

        class Both:
            def __enter__(self):
                return context.__enter__()

            def __exit__(self, *exc):
                for h in hooks:
                    h.remove()
                return context.__exit__(*exc)
        return Both()


def main(fixed):
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.arange(1, N + 1)[None] % 63 + 1  # no pad token (0)
    ratio = 1 - (KEPT + 0.5) / N  # kvpress keeps int(N * (1 - ratio)) = KEPT
    press = (FixedPositions if fixed else KeyRerotationPress)(press=StreamingLLMPress(ratio, n_sink=SINKS))
    with torch.no_grad(), press(model):
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, past_key_values=DynamicCache(),
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    generated = out.sequences[0, N:]
    actual = torch.stack(out.logits[1:])[:, 0]  # [NEW - 1, vocab]

    kept = torch.cat([prompt[:, :SINKS], prompt[:, N - (KEPT - SINKS):]], dim=1)
    with torch.no_grad():
        fresh = model(torch.cat([kept, generated[None, :-1]], dim=1)).logits[0]  # positions 0 .. KEPT + NEW - 2
    expected = fresh[KEPT:]  # the generated tokens 0 .. NEW - 2 fed at KEPT, KEPT + 1, ...
    gap = (actual - expected).abs().max().item()
    print("kvpress KeyRerotationPress(StreamingLLMPress(n_sink=%d)) keeping %d of %d, then generate()%s"
          % (SINKS, KEPT, N, " with the fix" if fixed else ""))
    print("max |logit - expected| over the %d tokens generated after the compression: %.3g" % (NEW - 1, gap))
    return 1 if gap > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main("--fixed" in sys.argv[1:]))
