"""Standalone reproduction (torch, transformers 5.25.0 and optimum-quanto 0.2.7; no kvcheck
needed): when the tensor QuantoQuantizedLayer quantizes holds exactly one group, it is not
quantized. optimum-quanto's AffineOptimizer turns axis 0 into None when the grouped tensor has
one row (affine_optimizer.py:52-53), and MaxOptimizer then takes the min and max over that
size-1 row dimension (max_optimizer.py:30): one scale per ELEMENT, all 0, and shift = -x. The
codes are all 0 and dequantize to x exactly; the "quantized" key takes more bytes than the raw one.

    python quantized-cache-one-group-stored-unquantized.py          # as shipped
    python quantized-cache-one-group-stored-unquantized.py --fixed  # axis 0 kept for one group

A tiny LlamaForCausalLM (random weights) with one KV head of 64 dims generates one token from a
1-token prompt with cache_implementation="quantized" (quanto, 4 bits, q_group_size 64: the
defaults), so each layer's prefill keys [1, 1, 1, 64] are one group. Expected: one scale,
(max - min) / 15, and the key within S / 2 of its codes. A 2-token prompt is shown beside it.

Exit status 1 when the one-group keys are stored with a scale per element (the bug), 0 when
they get one scale per group. optimum-quanto builds its C++ unpack at its first use (about
36 s, once per venv; tools/test builds it when it makes the venv)."""

import sys
import warnings

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import QuantoQuantizedLayer
import optimum.quanto
from optimum.quanto.tensor.grouped import group
from optimum.quanto.tensor.optimizers import affine_optimizer

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()




def install_fix():
    """AffineOptimizer.__call__ (affine_optimizer.py:28-60) with the one-group special case
    limited to axis -1, where reducing over dims 0 .. n-2 is per-tensor; for axis 0 the axis is
    kept, so MaxOptimizer reduces over the group (dim 1) and returns one scale of shape (1, 1)."""
    def call(self, base, qtype, axis, group_size=None, zeropoint=False):
        if axis not in [0, -1]:
            raise ValueError("axis parameter must be 0 (first axis) or -1 (last axis)")
        if group_size is not None:
            base = group(base, axis, group_size)
        if axis == -1 and base.shape[axis] == 1:  # was: axis is not None
            axis = None
        scale, shift = self.optimize(base, qtype, axis)
        if zeropoint:
            shift = torch.clamp(torch.round(shift / scale), 0, 2**qtype.bits - 1).to(torch.uint8)
        return scale, shift
    affine_optimizer.AffineOptimizer.__call__ = call


def prefill_keys(model, prompt_length):
    """generate() one token with the quantized cache; returns layer 0 and the keys it was given."""
    seen = {}
    update = QuantoQuantizedLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):  # records the prefill keys, changes nothing
        seen.setdefault(id(self), key_states.clone())
        return update(self, key_states, value_states, *args, **kwargs)
    QuantoQuantizedLayer.update = spy
    try:
        out = model.generate(torch.arange(1, prompt_length + 1)[None], attention_mask=torch.ones(1, prompt_length),
                             max_new_tokens=1, cache_implementation="quantized",
                             cache_config={"backend": "quanto", "nbits": 4}, return_dict_in_generate=True,
                             generation_config=GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0))
    finally:
        QuantoQuantizedLayer.update = update
    layer = out.past_key_values.layers[0]
    return layer, seen[id(layer)]


def describe(layer, keys):
    qt = layer._quantized_keys
    groups = qt.numel() // layer.q_group_size
    scale = qt._scale
    stored = qt._data._data.numel() + (scale.numel() + qt._shift.numel()) * scale.element_size()
    error = (qt.dequantize() - keys).abs().max().item()
    return groups, scale, stored, error


def main():
    fixed = "--fixed" in sys.argv
    if fixed:
        install_fix()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)).eval()
    print("transformers %s, optimum-quanto %s, torch %s%s" % (transformers.__version__, optimum.quanto.__version__,
                                                              torch.__version__, " (--fixed)" if fixed else ""))
    print("generate(cache_implementation='quantized', cache_config={'backend': 'quanto', 'nbits': 4}),"
          " 1 KV head of 64 dims, q_group_size 64:")
    bug = False
    for prompt_length in (1, 2):
        layer, keys = prefill_keys(model, prompt_length)
        groups, scale, stored, error = describe(layer, keys)
        zeros = int((scale == 0).sum())
        print("  %d-token prompt: layer 0's keys are %d group%s, stored with %d scale%s of shape %s (%d of them 0);"
              " max |dequantized - key| %.3g; %d bytes stored for %d raw" % (
                  prompt_length, groups, "s" if groups > 1 else "", scale.numel(), "s" if scale.numel() > 1 else "",
                  tuple(scale.shape), zeros, error, stored, keys.numel() * keys.element_size()))
        if scale.numel() != groups:
            bug = True
            shift_is_minus_x = torch.equal(layer._quantized_keys._shift.reshape(-1), -keys.reshape(-1))
            print("    one scale per element, all 0, and shift == -key: %s; the key is kept exactly, not quantized"
                  % shift_is_minus_x)
    if bug:
        return 1
    print("every group has one scale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
