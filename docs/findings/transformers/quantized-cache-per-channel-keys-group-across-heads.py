"""Standalone reproduction (torch, transformers 5.25.0 and optimum-quanto 0.2.7; no kvcheck
needed): QuantoQuantizedLayer with axis_key=-1 (per-channel keys, KIVI's choice) hands the
whole [B, H, T, D] keys to optimum-quanto, whose axis -1 groups are runs of q_group_size
consecutive rows of the flattened B*H*T axis, one per channel (tensor/grouped.py:21-36). So
(a) update() raises ValueError unless B*H*T is a multiple of q_group_size, at the prefill and
at any later flush; (b) when it runs and T is not a multiple of q_group_size, a group takes the
end of one head and the start of the next (or of the next batch row), and a head of small keys
shares a scale with a head of large ones.

    python quantized-cache-per-channel-keys-group-across-heads.py          # as shipped
    python quantized-cache-per-channel-keys-group-across-heads.py --fixed  # groups within a head

(a) A tiny LlamaForCausalLM (random weights, 2 KV heads of 32 dims) generates with
cache_implementation="quantized", cache_config={"backend": "quanto", "axis_key": -1,
"axis_value": 0, "q_group_size": 32, "residual_length": 4}: from a 10-token prompt, and from a
16-token prompt (which passes the prefill, then flushes 20 tokens at its 4th decode step).
(b) QuantizedCache.update with keys of 2 heads x 48 tokens: head 0 ~ 0.1, head 1 ~ 10;
48 * 2 = 96 rows make 3 groups of 32, the middle one head 0's tokens 32..47 with head 1's 0..15.
The comparison is head 0's error when its tokens are grouped within head 0 (runs of 32 tokens
per channel, the last run padded by repeating its last token), the --fixed grouping.

Exit status 1 when either generate raises or head 0's error is more than 4 times its error
grouped within the head (the bug), 0 otherwise. optimum-quanto builds its C++ unpack at its first use (about 36 s, once per venv;
tools/test builds it when it makes the venv)."""

import sys
import warnings

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, QuantizedCache
from transformers.cache_utils import QuantoQuantizedLayer
import optimum.quanto

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()



QUANTIZE = QuantoQuantizedLayer._quantize  # as shipped


class PaddedPerHead:
    """Keys quantized by quanto along axis -1 after padding every (batch, head) row to a multiple
    of the group size: the groups (runs of group-size rows of the flattened B*H*T axis) are then
    runs of tokens of one head. Dequantizes to the unpadded [B, H, T, D]."""

    def __init__(self, layer, tensor):
        self.length = tensor.shape[-2]
        pad = -self.length % layer.q_group_size
        if pad:  # the run's own last token repeated: its min and max do not change
            tensor = torch.cat([tensor, tensor[..., -1:, :].expand(*tensor.shape[:-2], pad, tensor.shape[-1])], -2)
        self.qtensor = QUANTIZE(layer, tensor.contiguous(), -1)

    def dequantize(self):
        return self.qtensor.dequantize()[..., : self.length, :]


def install_fix():
    """QuantoQuantizedLayer._quantize along axis -1 groups tokens within each (batch, head) row;
    _dequantize (qtensor.dequantize()) works unchanged on the wrapper."""
    def _quantize(self, tensor, axis):
        return PaddedPerHead(self, tensor) if axis == -1 else QUANTIZE(self, tensor, axis)
    QuantoQuantizedLayer._quantize = _quantize


CACHE = {"backend": "quanto", "nbits": 4, "axis_key": -1, "axis_value": 0, "q_group_size": 32, "residual_length": 4}


def generate(model, prompt_length):
    lengths = []
    quantize = QuantoQuantizedLayer._quantize

    def spy(self, tensor, axis):  # records how many tokens each quantization takes, changes nothing
        lengths.append(tensor.shape[-2])
        return quantize(self, tensor, axis)
    QuantoQuantizedLayer._quantize = spy
    try:
        out = model.generate(torch.arange(1, prompt_length + 1)[None], attention_mask=torch.ones(1, prompt_length),
                             max_new_tokens=6, cache_implementation="quantized", cache_config=CACHE,
                             generation_config=GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0))
        return "generated %d tokens" % (out.shape[1] - prompt_length), False
    except ValueError as error:
        return "ValueError when quantizing %d tokens (%s): %s" % (
            lengths[-1], "the prefill" if len(lengths) == 1 else "a flush", error), True
    finally:
        QuantoQuantizedLayer._quantize = quantize


def mixed_heads(config):
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randn(1, 1, 48, 32, generator=g) * 0.1, torch.randn(1, 1, 48, 32, generator=g) * 10], 1)
    values = torch.randn(1, 2, 48, 32, generator=g)
    cache = QuantizedCache(backend="quanto", config=config, nbits=4, axis_key=-1, axis_value=0, q_group_size=32,
                           residual_length=128)
    cache.update(keys, values, 0)
    error = (cache.layers[0]._quantized_keys.dequantize() - keys).abs()[0, 0].amax(-1)  # head 0, per token
    alone = (PaddedPerHead(cache.layers[0], keys).dequantize() - keys).abs()[0, 0].amax(-1)
    return error, alone


def main():
    fixed = "--fixed" in sys.argv
    if fixed:
        install_fix()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = LlamaForCausalLM(config).eval()
    print("transformers %s, optimum-quanto %s, torch %s%s" % (transformers.__version__, optimum.quanto.__version__,
                                                              torch.__version__, " (--fixed)" if fixed else ""))
    print("(a) generate(cache_implementation='quantized', cache_config=%s), 2 KV heads:" % CACHE)
    bug = False
    for prompt_length in (10, 16):
        said, raised = generate(model, prompt_length)
        print("  %d-token prompt: %s" % (prompt_length, said))
        bug |= raised
    error, alone = mixed_heads(config)
    print("(b) QuantizedCache.update, keys of 2 heads x 48 tokens (head 0 ~ 0.1, head 1 ~ 10), q_group_size 32:")
    print("  head 0's max error: tokens 0..31 %.3g, tokens 32..47 %.3g; grouped within head 0: %.3g and %.3g" % (
        error[:32].max(), error[32:].max(), alone[:32].max(), alone[32:].max()))
    if error.max() > 4 * alone.max():
        print("  head 0's tokens 32..47 share their groups (one per channel) with head 1's tokens 0..15")
        bug = True
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
