"""Standalone reproduction (torch and transformers 5.25.0; no kvcheck needed): transformers'
continuous batching does not apply a sliding window of 1 to a prefill chunk.
build_attention_mask adds the window only when sliding_window > 1, because the IOs pass 1
for full-attention layers to mean "no window"; a model whose sliding_window is 1 then
attends causally across the whole chunk, where transformers' own unpaged masks let each
token see itself alone (masking_utils.sliding_window_overlay: kv_idx > q_idx - 1).

    python continuous-batching-window-of-one-unmasked-in-prefill.py          # as shipped
    python continuous-batching-window-of-one-unmasked-in-prefill.py --fixed  # window 1 applied

A one-layer MistralForCausalLM (sliding_window 1, random weights, eager attention) runs a
6-token prompt unpaged (model(input_ids)) and through generate_batch (the paged path, one
prefill chunk); the prompt's last logits must agree within float32 rounding.

Exit status 1 when they differ (the bug), 0 when they agree."""

import logging
import sys
import warnings

import torch
import transformers
from transformers import GenerationConfig, MistralConfig, MistralForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import input_outputs

warnings.filterwarnings("ignore")
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # no psutil: it logs while sizing memory


def install_fix():
    """The suggested fix passes None for full layers (input_outputs.py:435-437) and windows every
    sliding_window that is not None (utils.py:189). This model's layers all slide, so here a
    wrapper may read 1 as a window of 1 and add what the fixed branch adds."""
    original = input_outputs.build_attention_mask

    def build_attention_mask(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window):
        original(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window)
        if sliding_window != 1:
            return
        lowest = torch.finfo(attention_mask.dtype).min
        for i in range(len(cumulative_seqlens_q) - 1):
            q = cumulative_seqlens_q[i + 1] - cumulative_seqlens_q[i]
            k = cumulative_seqlens_k[i + 1] - cumulative_seqlens_k[i]
            block = attention_mask[..., cumulative_seqlens_q[i]:cumulative_seqlens_q[i + 1],
                                   cumulative_seqlens_k[i]:cumulative_seqlens_k[i + 1]]
            block.add_(torch.tril(torch.full_like(block, lowest), diagonal=int(k - q - 1)))
    input_outputs.build_attention_mask = build_attention_mask


def main():
    if "--fixed" in sys.argv:
        install_fix()
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=1,
                           max_position_embeddings=64)
    config._attn_implementation = "eager"
    model = MistralForCausalLM(config).eval()
    prompt = [5, 9, 12, 7, 3, 11]
    with torch.no_grad():
        unpaged = model(torch.tensor([prompt])).logits[0, -1]
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    generation = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=None, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=64, use_cuda_graph=False,
                                        use_async_batching=False)
    model.generate_batch([prompt], generation_config=generation, continuous_batching_config=batching,
                         progress_bar=False)
    paged = seen[0].reshape(-1, seen[0].shape[-1])[-1]
    diff = (paged - unpaged).abs().max().item()
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    print("sliding_window 1, a 6-token prompt: max |paged - unpaged| of its last logits = %.3g" % diff)
    if diff > 1e-5:
        print("the paged prefill saw more than the window of 1")
        return 1
    print("the paged prefill agrees with the unpaged model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
