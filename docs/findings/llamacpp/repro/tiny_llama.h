/* What the standalone reproductions of docs/findings/llamacpp/ share: a tiny `llama` model
 * written with ggml's own gguf API, a context over it, embeddings decoded one forward at a
 * time, and one cell's K row read back through llama_state_seq_get_data. It uses only
 * llama.cpp's public headers and libraries (no kvcheck). C11.
 *
 * Build (the npm package's libraries and the headers of the same build, as tools/setup
 * unpacks them under build/llamacpp/):
 *   cc -std=c11 -O1 -I INC -I INC/../ggml/include repro.c -o repro \
 *      -L LIB -l:libllama.v0.5.0.so -l:libggml-base.so -l:libggml.v0.5.0.so -Wl,-rpath,LIB -lm
 * and run `repro LIB` (the folder whose CPU backends it loads). */
#ifndef KVCHECK_REPRO_TINY_LLAMA_H
#define KVCHECK_REPRO_TINY_LLAMA_H
#define _DEFAULT_SOURCE /* mkdtemp */

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

/* A reproduction may define TINY_HEAD_DIM before including this (a model's head size). */
#ifndef TINY_HEAD_DIM
#define TINY_HEAD_DIM 32
#endif
enum { TINY_HEADS = 2, TINY_EMBD = TINY_HEADS * TINY_HEAD_DIM, TINY_FF = 16, TINY_VOCAB = 8 };

/* A deterministic value in [-1, 1) for element i of tensor `tag`. */
static inline float tiny_value(uint32_t tag, uint32_t i) {
  uint64_t x = ((uint64_t)tag << 32 | i) + 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static inline void tiny_tensor(struct gguf_context *g, struct ggml_context *c, const char *name, int64_t ne0, int64_t ne1,
                        float scale, uint32_t tag) {
  struct ggml_tensor *t = ne1 ? ggml_new_tensor_2d(c, GGML_TYPE_F32, ne0, ne1) : ggml_new_tensor_1d(c, GGML_TYPE_F32, ne0);
  float *data = (float *)t->data;
  for (int64_t i = 0; i < ggml_nelements(t); ++i) data[i] = scale == 0.0f ? 1.0f : scale * tiny_value(tag, (uint32_t)i);
  ggml_set_name(t, name);
  gguf_add_tensor(g, t);
}

/* The keys every tiny model has, under its architecture's name `arch`: `layers` layers of 2
 * heads of TINY_HEAD_DIM dims, RoPE base `theta`. */
static inline void tiny_keys(struct gguf_context *g, const char *arch, uint32_t layers, float theta) {
  char key[96];
#define TINY_KEY(kind, name, value)                    \
  snprintf(key, sizeof key, "%s." name, arch); \
  gguf_set_val_##kind(g, key, value)
  gguf_set_val_str(g, "general.architecture", arch);
  gguf_set_val_str(g, "general.name", "tiny");
  TINY_KEY(u32, "vocab_size", TINY_VOCAB);
  TINY_KEY(u32, "context_length", 8192);
  TINY_KEY(u32, "embedding_length", TINY_EMBD);
  TINY_KEY(u32, "block_count", layers);
  TINY_KEY(u32, "feed_forward_length", TINY_FF);
  TINY_KEY(u32, "attention.head_count", TINY_HEADS);
  TINY_KEY(u32, "attention.head_count_kv", TINY_HEADS);
  TINY_KEY(u32, "attention.key_length", TINY_HEAD_DIM);
  TINY_KEY(u32, "attention.value_length", TINY_HEAD_DIM);
  TINY_KEY(f32, "attention.layer_norm_rms_epsilon", 1e-5f);
  TINY_KEY(u32, "rope.dimension_count", TINY_HEAD_DIM);
  TINY_KEY(f32, "rope.freq_base", theta);
#undef TINY_KEY
}

/* One layer, 2 heads of TINY_HEAD_DIM dims, RoPE theta 10000; yarn_factor > 0 adds YaRN scaling
 * (original context 32), as a GGUF converted from a YaRN checkpoint carries it. */
static inline int tiny_llama_write(const char *path, float yarn_factor) {
  struct ggml_init_params params = {64u << 20, NULL, false};
  struct ggml_context *c = ggml_init(params);
  struct gguf_context *g = gguf_init_empty();
  tiny_keys(g, "llama", 1, 10000.0f);
  if (yarn_factor > 0.0f) {
    gguf_set_val_str(g, "llama.rope.scaling.type", "yarn");
    gguf_set_val_f32(g, "llama.rope.scaling.factor", yarn_factor);
    gguf_set_val_u32(g, "llama.rope.scaling.original_context_length", 32);
  }
  gguf_set_val_str(g, "tokenizer.ggml.model", "none");
  const float s = 1.0f / sqrtf((float)TINY_EMBD);
  tiny_tensor(g, c, "token_embd.weight", TINY_EMBD, TINY_VOCAB, s, 1);
  tiny_tensor(g, c, "output_norm.weight", TINY_EMBD, 0, 0.0f, 2);
  tiny_tensor(g, c, "output.weight", TINY_EMBD, TINY_VOCAB, s, 3);
  tiny_tensor(g, c, "blk.0.attn_norm.weight", TINY_EMBD, 0, 0.0f, 4);
  tiny_tensor(g, c, "blk.0.attn_q.weight", TINY_EMBD, TINY_EMBD, 2 * s, 5);
  tiny_tensor(g, c, "blk.0.attn_k.weight", TINY_EMBD, TINY_EMBD, 2 * s, 6);
  tiny_tensor(g, c, "blk.0.attn_v.weight", TINY_EMBD, TINY_EMBD, 2 * s, 7);
  tiny_tensor(g, c, "blk.0.attn_output.weight", TINY_EMBD, TINY_EMBD, s, 8);
  tiny_tensor(g, c, "blk.0.ffn_norm.weight", TINY_EMBD, 0, 0.0f, 9);
  tiny_tensor(g, c, "blk.0.ffn_gate.weight", TINY_EMBD, TINY_FF, s, 10);
  tiny_tensor(g, c, "blk.0.ffn_up.weight", TINY_EMBD, TINY_FF, s, 11);
  tiny_tensor(g, c, "blk.0.ffn_down.weight", TINY_FF, TINY_EMBD, 0.1f * s, 12);
  const int ok = gguf_write_to_file(g, path, false);
  gguf_free(g);
  ggml_free(c);
  return ok ? 0 : -1;
}

/* A context of `cells` cells over the model, K stored as `type` (GGML_TYPE_F32, ...) and V
 * too unless `type` is quantized (V stays f32: a quantized V needs flash attention), without
 * flash attention. */
static inline struct llama_context *tiny_context(struct llama_model *model, uint32_t cells, enum ggml_type type) {
  struct llama_context_params p = llama_context_default_params();
  p.n_ctx = cells;
  p.n_batch = cells;
  p.n_ubatch = cells;
  p.n_seq_max = 1;
  p.type_k = type;
  p.type_v = ggml_is_quantized(type) ? GGML_TYPE_F32 : type;
  p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  return llama_init_from_model(model, p);
}

/* n tokens of sequence 0 at positions pos0.. as embeddings (token t's embedding is
 * deterministic in t), one forward. */
static inline int tiny_decode(struct llama_context *ctx, int n, int pos0, int first_token) {
  struct llama_batch b = llama_batch_init(n, TINY_EMBD, 1);
  b.n_tokens = n;
  for (int i = 0; i < n; ++i) {
    for (int d = 0; d < TINY_EMBD; ++d) b.embd[i * TINY_EMBD + d] = tiny_value(100 + (uint32_t)(first_token + i), (uint32_t)d);
    b.pos[i] = pos0 + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = i == n - 1;
  }
  const int rc = llama_decode(ctx, b);
  llama_batch_free(b);
  return rc;
}

/* IEEE half to float (f16 cells, q8_0's block scales). */
static inline float tiny_half(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
  float f;
  if (exponent == 0) {
    f = ldexpf((float)mantissa, -24);
  } else if (exponent == 31) {
    f = mantissa ? NAN : INFINITY;
  } else {
    uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}

/* One K row of TINY_EMBD elements stored as `type` (f32, f16, or q8_0: blocks of an f16
 * scale and 32 int8 codes), as floats. */
static inline int tiny_row(const uint8_t *row, int32_t type, uint64_t bytes, float *out) {
  if (type == GGML_TYPE_F32 && bytes == TINY_EMBD * 4) {
    memcpy(out, row, bytes);
  } else if (type == GGML_TYPE_F16 && bytes == TINY_EMBD * 2) {
    for (int i = 0; i < TINY_EMBD; ++i) {
      uint16_t h;
      memcpy(&h, row + 2 * i, 2);
      out[i] = tiny_half(h);
    }
  } else if (type == GGML_TYPE_Q8_0 && TINY_EMBD % 32 == 0 && bytes == TINY_EMBD / 32 * 34) {
    for (int i = 0; i < TINY_EMBD; ++i) {
      const uint8_t *block = row + (i / 32) * 34;
      uint16_t h;
      memcpy(&h, block, 2);
      out[i] = tiny_half(h) * (float)(int8_t)block[2 + i % 32];
    }
  } else {
    return -1;
  }
  return 0;
}

/* The K row (heads x dims floats) of the cell of sequence 0 at position `pos` in layer 0,
 * from the sequence's state (f32, f16 or q8_0 K): 0 when found, -1 when not (or the state
 * is not what this reader knows). */
static inline int tiny_key_at(struct llama_context *ctx, int pos, float *key) {
  const size_t size = llama_state_seq_get_size(ctx, 0);
  uint8_t *state = (uint8_t *)malloc(size);
  int ok = 0;
  size_t at = 0;
#define TINY_TAKE(dst, n) \
  do {                    \
    if (at + (n) > size) goto done; \
    memcpy((dst), state + at, (n)); \
    at += (n);            \
  } while (0)
  if (!state || llama_state_seq_get_data(ctx, state, size, 0) != size) goto done;
  uint32_t u32, streams, cells;
  TINY_TAKE(&u32, 4);
  if (u32 == 0xaf143cd8u) at = 8; /* v0.5.0's prefix: magic and seq id */
  else at = 0;
  TINY_TAKE(&streams, 4);
  TINY_TAKE(&cells, 4);
  int found = -1;
  for (uint32_t i = 0; i < cells; ++i) {
    int32_t p;
    uint32_t seqs;
    TINY_TAKE(&p, 4);
    TINY_TAKE(&seqs, 4);
    if (p == pos) found = (int)i;
    if (at + 4 * (size_t)seqs > size) goto done;
    at += 4 * (size_t)seqs;
  }
  uint32_t v_trans, layers;
  int32_t type;
  uint64_t row;
  TINY_TAKE(&v_trans, 4);
  TINY_TAKE(&layers, 4);
  TINY_TAKE(&type, 4);
  TINY_TAKE(&row, 8);
  if (streams != 1 || found < 0 || layers < 1 || at + (size_t)cells * row > size) goto done;
  ok = tiny_row(state + at + (size_t)found * row, type, row, key) == 0;
done:
#undef TINY_TAKE
  free(state);
  return ok ? 0 : -1;
}

static inline double tiny_norm(const float *x, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return sqrt(s);
}

static inline void tiny_quiet(enum ggml_log_level level, const char *text, void *user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* llama.cpp's CPU backends from `dir`, and the model `write(path, arg)` writes, written to a
 * fresh temporary folder (llama.cpp's log: errors only). */
static inline struct llama_model *tiny_load_model(const char *dir, int (*write)(const char *, float), float arg,
                                                  char *folder, char *path) {
  llama_log_set(tiny_quiet, NULL);
  ggml_backend_load_all_from_path(dir);
  llama_backend_init();
  strcpy(folder, "/tmp/llamacpp-repro-XXXXXX");
  if (!mkdtemp(folder)) return NULL;
  snprintf(path, 512, "%s/tiny.gguf", folder);
  if (write(path, arg) != 0) return NULL;
  struct llama_model_params mp = llama_model_default_params();
  return llama_model_load_from_file(path, mp);
}

/* The tiny llama model (tiny_llama_write), loaded as tiny_load_model says. */
static inline struct llama_model *tiny_load(const char *dir, float yarn_factor, char *folder, char *path) {
  return tiny_load_model(dir, tiny_llama_write, yarn_factor, folder, path);
}

/* After 8 tokens: a shift as llama-server makes it (keep 2, discard 2), then one token, in a
 * child process so that a crash in llama.cpp can be reported; prints what became of the
 * decode. Returns 1 when the child died of a signal, 0 when the decode was done, 2 else. */
static inline int tiny_shift_in_child(struct llama_context *ctx) {
  llama_memory_t mem = llama_get_memory(ctx);
  fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    perror("fork");
    return 2;
  }
  if (child == 0) {
    llama_memory_seq_rm(mem, 0, 2, 4);
    llama_memory_seq_add(mem, 0, 4, 8, -2);
    _exit(tiny_decode(ctx, 1, 6, 8) == 0 ? 0 : 4);
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child) return 2;
  if (WIFSIGNALED(status)) {
    printf("the decode after the shift: the process died of signal %d (%s)\n", WTERMSIG(status),
           strsignal(WTERMSIG(status)));
    return 1;
  }
  printf("the decode after the shift: %s\n", WEXITSTATUS(status) == 0 ? "done" : "llama_decode failed");
  return WEXITSTATUS(status) == 0 ? 0 : 2;
}

static inline void tiny_cleanup(const char *folder, const char *path) {
  remove(path);
  rmdir(folder);
}

#endif
