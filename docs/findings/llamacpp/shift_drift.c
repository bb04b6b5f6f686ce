/* Standalone reproduction (llama.cpp alone; see f16-shift-drift.md and
 * quantized-shift-drift.md): a K cache stored in f16 or q8_0 is re-rotated in place at every
 * context shift, rounded to its format again each time, so a kept key walks away from any
 * exact rotation of what was first stored.
 *
 * A one-layer llama model, a 40-token prompt, then 36 decodes, each after a shift as
 * llama-server makes it with n_keep 2 and n_discard 1 (seq_rm of position 2, seq_add of the
 * rest by -1). Token 39 moves down one position per shift. After k shifts its stored key is
 * compared with its first stored key rotated exactly (in double, llama's pairwise rope) by
 * -k (a quantized key first taken back out of llama.cpp's Hadamard basis): the drift, as a
 * fraction of the key's length. Exit 1 when the drift after the last
 * shift is more than 4 times that after the first and above 1e-5 (f32 cells accumulate their
 * own rounding too, to about 1e-6), 0 otherwise.
 *
 *   shift_drift LIB_DIR [f16|q8_0|f32]   (default f16; f32 is the control, which exits 0) */
#define TINY_HEAD_DIM 64 /* q8_0 K needs a multiple of 64 to shift at all (see quantized-shift-crashes-without-k-rotation.md) */
#include "repro/tiny_llama.h"

/* llama.cpp stores a quantized K multiplied by the normalized 64 x 64 Sylvester Hadamard
 * matrix H (its own inverse), block by block: undone here so that keys compare in the
 * rope's basis. */
static void unrotate(float *x) {
  for (int at = 0; at < TINY_EMBD; at += 64) {
    double row[64];
    for (int i = 0; i < 64; ++i) {
      double sum = 0.0;
      for (int j = 0; j < 64; ++j) sum += (__builtin_popcount((unsigned)(i & j)) % 2 ? -1.0 : 1.0) * x[at + j];
      row[i] = sum / 8.0;
    }
    for (int i = 0; i < 64; ++i) x[at + i] = (float)row[i];
  }
}

/* x rotated by `delta` positions: pairs (2i, 2i + 1) of each head by delta * 10000^(-2i/D). */
static void rotate(const float *x, int delta, double *out) {
  for (int h = 0; h < TINY_HEADS; ++h)
    for (int i = 0; i < TINY_HEAD_DIM / 2; ++i) {
      const double angle = delta * pow(10000.0, -2.0 * i / TINY_HEAD_DIM);
      const double a = x[h * TINY_HEAD_DIM + 2 * i], b = x[h * TINY_HEAD_DIM + 2 * i + 1];
      out[h * TINY_HEAD_DIM + 2 * i] = a * cos(angle) - b * sin(angle);
      out[h * TINY_HEAD_DIM + 2 * i + 1] = a * sin(angle) + b * cos(angle);
    }
}

int main(int argc, char **argv) {
  const char *name = argc == 3 ? argv[2] : "f16";
  const enum ggml_type type = strcmp(name, "f32") == 0    ? GGML_TYPE_F32
                              : strcmp(name, "q8_0") == 0 ? GGML_TYPE_Q8_0
                              : strcmp(name, "f16") == 0  ? GGML_TYPE_F16
                                                          : GGML_TYPE_COUNT;
  if (argc < 2 || argc > 3 || type == GGML_TYPE_COUNT) {
    fprintf(stderr, "usage: %s LIB_DIR [f16|q8_0|f32]\n", argv[0]);
    return 2;
  }
  char folder[64], path[512];
  struct llama_model *model = tiny_load(argv[1], 0.0f, folder, path);
  struct llama_context *ctx = model ? tiny_context(model, 64, type) : NULL;
  if (!ctx || tiny_decode(ctx, 40, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  printf("llama.cpp %s, K cells in %s: token 39's key after k shifts of one position\n", llama_version(), name);
  float first[TINY_EMBD], key[TINY_EMBD];
  double exact[TINY_EMBD];
  if (tiny_key_at(ctx, 39, first) != 0) return 2;
  if (ggml_is_quantized(type)) unrotate(first);
  const double length = tiny_norm(first, TINY_EMBD);
  llama_memory_t mem = llama_get_memory(ctx);
  int next = 40;
  double drift_first = 0.0, drift = 0.0;
  for (int k = 1; k <= 36; ++k) {
    llama_memory_seq_rm(mem, 0, 2, 3);
    llama_memory_seq_add(mem, 0, 3, next, -1);
    if (tiny_decode(ctx, 1, next - 1, 40 + k) != 0) return 2;
    if (tiny_key_at(ctx, 39 - k, key) != 0) return 2;
    if (ggml_is_quantized(type)) unrotate(key);
    rotate(first, -k, exact);
    double sq = 0.0;
    for (int i = 0; i < TINY_EMBD; ++i) sq += (key[i] - exact[i]) * (key[i] - exact[i]);
    drift = sqrt(sq) / length;
    if (k == 1) drift_first = drift;
    if (k == 1 || k == 4 || k == 16 || k == 36) printf("after %2d shifts: drift %.3g of its length\n", k, drift);
  }
  llama_free(ctx);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  if (drift > 4 * drift_first && drift > 1e-5) {
    printf("the drift grew %.1f-fold over 36 shifts: each shift rounds the kept keys to %s again\n",
           drift / drift_first, name);
    return 1;
  }
  printf("no accumulated drift (%.3g after 36 shifts, %.3g after the first)\n", drift, drift_first);
  return 0;
}
