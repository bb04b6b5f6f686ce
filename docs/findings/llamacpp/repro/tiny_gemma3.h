/* A tiny `gemma3` model for the standalone reproductions of docs/findings/llamacpp/, written
 * with ggml's own gguf API (no kvcheck): TINY_G3_LAYERS layers, layer l sliding (window
 * TINY_G3_WINDOW, RoPE theta 10000) unless it is the last, which attends to everything (theta
 * 1e6, linear scaling 8, as Gemma 3 4B/12B/27B), 2 heads of TINY_HEAD_DIM dims, q and k
 * normalized per head, every norm weight 1 (the identity: the converter folds Gemma's 1 + w
 * into the stored weight). llama.cpp keeps the sliding layers in its iSWA cache. Built and
 * run as tiny_llama.h says. C11. */
#ifndef KVCHECK_REPRO_TINY_GEMMA3_H
#define KVCHECK_REPRO_TINY_GEMMA3_H

#include "tiny_llama.h"

#ifndef TINY_G3_LAYERS
#define TINY_G3_LAYERS 2
#endif
#ifndef TINY_G3_WINDOW
#define TINY_G3_WINDOW 6
#endif

static inline int tiny_gemma3_write(const char *path, float unused) {
  (void)unused;
  struct ggml_init_params params = {64u << 20, NULL, false};
  struct ggml_context *c = ggml_init(params);
  struct gguf_context *g = gguf_init_empty();
  tiny_keys(g, "gemma3", TINY_G3_LAYERS, 1000000.0f);
  gguf_set_val_str(g, "gemma3.rope.scaling.type", "linear");
  gguf_set_val_f32(g, "gemma3.rope.scaling.factor", 8.0f);
  gguf_set_val_f32(g, "gemma3.rope.freq_base_swa", 10000.0f);
  gguf_set_val_u32(g, "gemma3.attention.sliding_window", TINY_G3_WINDOW);
  bool pattern[TINY_G3_LAYERS];
  for (int l = 0; l < TINY_G3_LAYERS; ++l) pattern[l] = l + 1 < TINY_G3_LAYERS;
  gguf_set_arr_data(g, "gemma3.attention.sliding_window_pattern", GGUF_TYPE_BOOL, pattern, TINY_G3_LAYERS);
  gguf_set_val_str(g, "tokenizer.ggml.model", "none");
  const float s = 1.0f / sqrtf((float)TINY_EMBD);
  tiny_tensor(g, c, "token_embd.weight", TINY_EMBD, TINY_VOCAB, s, 1);
  tiny_tensor(g, c, "output_norm.weight", TINY_EMBD, 0, 0.0f, 2);
  char name[64];
  for (int l = 0; l < TINY_G3_LAYERS; ++l) {
    const uint32_t tag = 10 + 20 * (uint32_t)l;
#define TINY_G3_TENSOR(suffix, ne0, ne1, scale, k)              \
  snprintf(name, sizeof name, "blk.%d." suffix ".weight", l); \
  tiny_tensor(g, c, name, ne0, ne1, scale, tag + k)
    TINY_G3_TENSOR("attn_norm", TINY_EMBD, 0, 0.0f, 0);
    TINY_G3_TENSOR("attn_q", TINY_EMBD, TINY_EMBD, 2 * s, 1);
    TINY_G3_TENSOR("attn_k", TINY_EMBD, TINY_EMBD, 2 * s, 2);
    TINY_G3_TENSOR("attn_v", TINY_EMBD, TINY_EMBD, 2 * s, 3);
    TINY_G3_TENSOR("attn_output", TINY_EMBD, TINY_EMBD, s, 4);
    TINY_G3_TENSOR("attn_q_norm", TINY_HEAD_DIM, 0, 0.0f, 5);
    TINY_G3_TENSOR("attn_k_norm", TINY_HEAD_DIM, 0, 0.0f, 6);
    TINY_G3_TENSOR("post_attention_norm", TINY_EMBD, 0, 0.0f, 7);
    TINY_G3_TENSOR("ffn_norm", TINY_EMBD, 0, 0.0f, 8);
    TINY_G3_TENSOR("ffn_gate", TINY_EMBD, TINY_FF, s, 9);
    TINY_G3_TENSOR("ffn_up", TINY_EMBD, TINY_FF, s, 10);
    TINY_G3_TENSOR("ffn_down", TINY_FF, TINY_EMBD, 0.1f * s, 11);
    TINY_G3_TENSOR("post_ffw_norm", TINY_EMBD, 0, 0.0f, 12);
#undef TINY_G3_TENSOR
  }
  const int ok = gguf_write_to_file(g, path, false);
  gguf_free(g);
  ggml_free(c);
  return ok ? 0 : -1;
}

/* The tiny gemma3 model, loaded as tiny_load_model says. */
static inline struct llama_model *tiny_gemma3_load(const char *dir, char *folder, char *path) {
  return tiny_load_model(dir, tiny_gemma3_write, 0.0f, folder, path);
}

#endif
