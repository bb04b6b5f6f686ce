"""Standalone reproduction (torch, transformers 5.2.0 and kvpress 0.5.5; no kvcheck needed):
kvpress compresses only the full-attention layers of a Gemma 3 model
(`Gemma3ForConditionalGeneration`), which then hold k of the prompt's n tokens while the
sliding layers hold n. transformers builds every layer's mask from one `cache_position`,
counted from layer 0, a sliding layer: n, n + 1, ... The full layers' causal mask then
compares slot indices 0 .. k + m - 1 with query positions from n, so every token of a chunk
of m > 1 tokens after the compression sees the chunk's later tokens. With the pipeline's
own cache, `DynamicCache()` (no config, every layer a DynamicLayer), the mask is sized from
layer 0 (n + m keys) and the next forward raises instead.

    python gemma3-chunk-after-compression-sees-later-tokens.py          # as shipped
    python gemma3-chunk-after-compression-sees-later-tokens.py --fixed  # the fixes below

A two-layer Gemma 3 (one sliding layer of window 8, one full layer; random weights, eager
attention) reads a 20-token prompt inside `StreamingLLMPress(n_sink=2)` keeping 10 tokens,
then the tokens [40, 41, 42] as one chunk, and again one at a time from the same compressed
cache. Expected: the chunk's logits equal the one-at-a-time ones (a causal chunk).
Also printed: `KeyRerotationPress` on the same model.

The fixes tried (--fixed), without editing either package: the cache the pipeline makes
knows the layer types (`DynamicCache(config=model.config)`), and the full-attention mask takes
its query positions from a full layer's own length (a wrapper around Gemma 3's
`create_causal_mask`).

Exit status 1 when the chunk differs or raises (the bug), 0 when it agrees."""

import sys
import warnings

import torch
from transformers import (DynamicCache, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          SiglipVisionConfig)
from transformers.models.gemma3 import modeling_gemma3

from kvpress import KeyRerotationPress, StreamingLLMPress

warnings.filterwarnings("ignore")

N, KEPT = 20, 10


def model():
    text = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=60, boi_token_index=58, eoi_token_index=59)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).eval()


def install_mask_fix():
    """Gemma 3's full-attention mask with query positions counted from a full layer's own
    length (wrapping the mask builders its two model classes call)."""
    from transformers import masking_utils

    def full_layer_positions(kwargs):
        cache, embeds = kwargs.get("past_key_values"), kwargs["inputs_embeds"]
        if cache is None or not hasattr(cache, "is_sliding") or False not in cache.is_sliding:
            return kwargs
        past = cache.get_seq_length(cache.is_sliding.index(False))
        return dict(kwargs, cache_position=torch.arange(past, past + embeds.shape[1], device=embeds.device))

    def create_causal_mask(**kwargs):
        return masking_utils.create_causal_mask(**full_layer_positions(kwargs))

    def create_masks_for_generate(**kwargs):
        masks = masking_utils.create_masks_for_generate(**kwargs)
        if isinstance(masks, dict) and "full_attention" in masks:
            fixed = {k: v for k, v in full_layer_positions(kwargs).items() if k in (
                "config", "inputs_embeds", "attention_mask", "cache_position", "past_key_values", "position_ids",
                "or_mask_function", "and_mask_function")}
            masks["full_attention"] = masking_utils.create_causal_mask(**fixed)
        return masks

    modeling_gemma3.create_causal_mask = create_causal_mask
    modeling_gemma3.create_masks_for_generate = create_masks_for_generate


def compressed(m, ids, make_cache, press):
    cache = make_cache()
    with torch.no_grad(), press(m):
        m.model(input_ids=ids, past_key_values=cache)  # as kvpress's pipeline reads the context
    return cache


def main(fixed):
    m = model()
    if fixed:
        install_mask_fix()
    torch.manual_seed(1)
    ids = torch.randperm(50)[:N][None] + 1
    chunk = torch.tensor([[40, 41, 42]])
    ratio = 1 - (KEPT + 0.5) / N  # kvpress keeps int(N * (1 - ratio)) = KEPT
    make = (lambda: DynamicCache(config=m.config)) if fixed else (lambda: DynamicCache())
    print("kvpress StreamingLLMPress(n_sink=2) keeping %d of %d on Gemma 3 (a sliding and a full layer)%s"
          % (KEPT, N, ", with the fixes" if fixed else ""))
    status = 0
    for name, make_cache in (("the pipeline's DynamicCache()", make),
                             ("DynamicCache(config=model.config)", lambda: DynamicCache(config=m.config))):
        def run(pieces):
            cache = compressed(m, ids, make_cache, lambda model: StreamingLLMPress(ratio, n_sink=2)(model))
            out, at = [], N
            for piece in pieces:
                with torch.no_grad():
                    out.append(m(input_ids=piece, past_key_values=cache,
                                 position_ids=torch.arange(at, at + piece.shape[1])[None]).logits[0])
                at += piece.shape[1]
            return torch.cat(out)
        try:
            whole = run([chunk])
        except Exception as e:  # noqa: BLE001 (the finding)
            print("%s: the chunk after the compression raises %s: %s" % (name, type(e).__name__, str(e)[:90]))
            status = 1
            continue
        one = run([chunk[:, i:i + 1] for i in range(3)])
        gaps = (whole - one).abs().amax(-1).tolist()
        print("%s: max |chunk - one at a time| per token: %s" % (name, ", ".join("%.3g" % g for g in gaps)))
        if max(gaps) > 1e-4:
            status = 1
    try:
        compressed(m, ids, lambda: DynamicCache(config=m.config),
                   lambda model: KeyRerotationPress(StreamingLLMPress(ratio, n_sink=2))(model))
        print("KeyRerotationPress: the prompt compresses")
    except Exception as e:  # noqa: BLE001
        print("KeyRerotationPress: the prompt raises %s: %s" % (type(e).__name__, e))
    return status


if __name__ == "__main__":
    sys.exit(main("--fixed" in sys.argv[1:]))
