/* Standalone reproduction (llama.cpp alone; see yarn-context-shift.md): with YaRN scaling,
 * every context shift multiplies the kept keys by the attention factor m = 1 + 0.1 ln f
 * again. A shift is a rotation by delta, which keeps a key's length; llama.cpp's K-shift
 * re-rotates with the same rope op as the forward, attention factor included.
 *
 * A one-layer llama model with YaRN factor 4 (m = 1.1386), 8 tokens, then three shifts as
 * llama-server makes them (keep 2, discard 2: seq_rm then seq_add, applied at the next
 * decode), each followed by one token. After each, the K row of position 0 (a kept sink,
 * never moved) and of the token now at position 2 are compared with their lengths before
 * any shift. Exit 1 when a kept key's length changed (the bug), 0 when all kept it.
 * --no-yarn runs the same without YaRN (m = 1): the control, which exits 0.
 *
 *   yarn_context_shift LIB_DIR [--no-yarn]   (LIB_DIR: libllama and its CPU backends) */
#include "repro/tiny_llama.h"

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--no-yarn") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--no-yarn]\n", argv[0]);
    return 2;
  }
  char folder[64], path[512];
  const float factor = argc == 3 ? 0.0f : 4.0f;
  struct llama_model *model = tiny_load(argv[1], factor, folder, path);
  struct llama_context *ctx = model ? tiny_context(model, 64, GGML_TYPE_F32) : NULL;
  if (!ctx || tiny_decode(ctx, 8, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  if (factor > 0.0f)
    printf("llama.cpp %s, YaRN factor %.0f: attention factor m = %.4f\n", llama_version(), factor,
           1.0 + 0.1 * log(factor));
  else
    printf("llama.cpp %s, no YaRN (the control)\n", llama_version());
  float sink[TINY_EMBD], moved[TINY_EMBD], key[TINY_EMBD];
  if (tiny_key_at(ctx, 0, sink) != 0 || tiny_key_at(ctx, 4, moved) != 0) { /* token 4: at 2 after the first shift */
    fprintf(stderr, "could not read the keys back\n");
    return 2;
  }
  const double sink0 = tiny_norm(sink, TINY_EMBD), moved0 = tiny_norm(moved, TINY_EMBD);
  int next = 8, token = 8, wrong = 0;
  for (int shift = 1; shift <= 3; ++shift) {
    llama_memory_t mem = llama_get_memory(ctx);
    llama_memory_seq_rm(mem, 0, 2, 4);
    llama_memory_seq_add(mem, 0, 4, next, -2);
    next -= 2;
    if (tiny_decode(ctx, 1, next, token++) != 0) return 2;
    ++next;
    if (tiny_key_at(ctx, 0, key) != 0) return 2;
    const double sink_ratio = tiny_norm(key, TINY_EMBD) / sink0;
    double moved_ratio = NAN;
    if (shift == 1 && tiny_key_at(ctx, 2, key) == 0) moved_ratio = tiny_norm(key, TINY_EMBD) / moved0;
    printf("after shift %d: |k| of the sink at position 0 is %.4f times its length before any shift", shift,
           sink_ratio);
    if (!isnan(moved_ratio)) printf("; token 4, moved to position 2: %.4f times", moved_ratio);
    printf(" (expected 1: a rotation keeps lengths)\n");
    wrong |= fabs(sink_ratio - 1.0) > 1e-4 || (!isnan(moved_ratio) && fabs(moved_ratio - 1.0) > 1e-4);
  }
  llama_free(ctx);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  printf(wrong ? "kept keys grew at every shift: the shift applied the attention factor again\n"
               : "every kept key kept its length\n");
  return wrong ? 1 : 0;
}
