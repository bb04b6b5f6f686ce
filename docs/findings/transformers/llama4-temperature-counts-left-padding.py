"""Standalone reproduction (torch and transformers 5.25.0; no kvcheck needed): Llama 4's
attention temperature on its NoPE layers (attn_temperature_tuning) is computed from the
cache's slot count, `arange(n) + cache.get_seq_length(layer)`, the same for every row. A
left-padded row's padding counts, so its real tokens take the temperature of positions
`pad` further on, while its RoPE layers use position_ids that skip the padding. The same
prompt then gives other hidden states alone than in a left-padded batch.

    python llama4-temperature-counts-left-padding.py          # Llama4TextModel as shipped
    python llama4-temperature-counts-left-padding.py --fixed  # temperature from position_ids

A one-layer Llama4TextModel (a NoPE full-attention layer, dense MLP, random weights, eager
attention, floor_scale 2 and attn_scale 0.5 so that T moves every two tokens; Llama 4 Scout
has floor_scale 8192, where a padding of k moves T only for tokens within k of a multiple of
8192) runs the prompt [5, 9, 12, 7] alone, and as row 0 of a batch whose row 1 has six
tokens (row 0 left-padded by 2, its attention_mask and position_ids as generate() makes
them). Row 0's four hidden states must be the same both ways.

Exit status 1 when they differ (the bug), 0 when they agree."""

import sys
import warnings

import torch
import transformers
from transformers import Llama4TextConfig
from transformers.models.llama4 import modeling_llama4
from transformers.models.llama4.modeling_llama4 import Llama4TextModel

warnings.filterwarnings("ignore")

PROMPT, OTHER_ROW, PAD = [5, 9, 12, 7], [3, 8, 1, 14, 2, 6], 2


def temperature(positions, config):
    """Llama 4's T(p) = log1p(floor((p + 1) / floor_scale)) * attn_scale + 1."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / config.floor_scale)) * config.attn_scale + 1.0


def install_fix():
    """The suggested fix: the decoder layer hands its position_ids to the attention, and a NoPE
    layer takes T per row from them ([B, n] instead of one [1, n] row of slot indices). Done
    here by wrapping, not by editing transformers: on a NoPE layer nothing (no qk_norm, no
    rope) comes between q_proj and the temperature, so q_proj's output is multiplied by
    T(position) / T(slot) and the shipped code's T(slot) then leaves T(position)."""
    attention = modeling_llama4.Llama4TextAttention
    shipped_forward = attention.forward

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        position_ids = kwargs.pop("fix_position_ids", None)
        if not self.attn_temperature_tuning or self.use_rope or position_ids is None:
            return shipped_forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        if kwargs.get("cache_position") is not None:  # 4.52.4: the slots are cache_position
            slots = kwargs["cache_position"]
        else:  # 5.25.0: the cache's length plus the chunk's places
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            slots = torch.arange(hidden_states.shape[1]) + past
        ratio = temperature(position_ids, self.config) / temperature(slots, self.config)[None, :]  # [B, n]
        hook = self.q_proj.register_forward_hook(lambda module, args, out: out * ratio[..., None])
        try:
            return shipped_forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        finally:
            hook.remove()

    attention.forward = forward
    layer_forward = modeling_llama4.Llama4TextDecoderLayer.forward

    def layer(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        return layer_forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                             fix_position_ids=position_ids, **kwargs)
    modeling_llama4.Llama4TextDecoderLayer.forward = layer


def main():
    fixed = "--fixed" in sys.argv[1:]
    if fixed:
        install_fix()
    torch.manual_seed(0)
    config = Llama4TextConfig(vocab_size=32, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              no_rope_layers=[0], moe_layers=[], layer_types=["full_attention"],
                              attention_chunk_size=None, attn_temperature_tuning=True, floor_scale=2,
                              attn_scale=0.5, use_qk_norm=True)
    config._attn_implementation = "eager"
    model = Llama4TextModel(config).eval()
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                      position_ids=torch.arange(len(PROMPT))[None]).last_hidden_state[0]
        ids = torch.tensor([[0] * PAD + PROMPT, OTHER_ROW])
        mask = torch.tensor([[0] * PAD + [1] * len(PROMPT), [1] * len(OTHER_ROW)])
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() makes them
        batched = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state[0, PAD:]
    print("transformers %s, torch %s%s" % (transformers.__version__, torch.__version__,
                                           ", with the suggested fix" if fixed else ""))
    slots = torch.arange(PAD, PAD + len(PROMPT))
    print("row 0's tokens at positions %s take T = %s alone, T(slot) = %s in the padded batch"
          % (list(range(len(PROMPT))), [round(t, 4) for t in temperature(torch.arange(len(PROMPT)), config).tolist()],
             [round(t, 4) for t in temperature(slots, config).tolist()]))
    worst = 0.0
    for t in range(len(PROMPT)):
        diff = (alone[t] - batched[t]).abs().max().item()
        worst = max(worst, diff)
        print("token %d: max |alone - batched| = %.3g" % (t, diff))
    if worst > 1e-5:
        print("the padded batch differs from the prompt alone (max %.3g): the temperature counts the padding" % worst)
        return 1
    print("the padded batch agrees with the prompt alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
