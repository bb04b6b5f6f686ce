/* Standalone reproduction (llama.cpp alone; see bf16-context-shift.md): a bf16 K cache
 * decodes, and llama_memory_can_shift() says it can shift, but the decode that applies the
 * first shift aborts the process (the K-shift's rope has no bf16 kernel on the CPU).
 *
 * A one-layer llama model, K and V in bf16, 8 tokens, then a shift as llama-server makes it
 * (keep 2, discard 2) and one more token, in a child process so that its abort can be
 * reported. Exit 1 when the child dies of a signal (the bug), 0 when it decodes; --f16 runs
 * the same with f16 cells (the control, which exits 0).
 *
 *   bf16_context_shift LIB_DIR [--f16]   (LIB_DIR: libllama and its CPU backends) */
#include "repro/tiny_llama.h"

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--f16") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--f16]\n", argv[0]);
    return 2;
  }
  const enum ggml_type type = argc == 3 ? GGML_TYPE_F16 : GGML_TYPE_BF16;
  char folder[64], path[512];
  struct llama_model *model = tiny_load(argv[1], 0.0f, folder, path);
  struct llama_context *ctx = model ? tiny_context(model, 64, type) : NULL;
  if (!ctx || tiny_decode(ctx, 8, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  llama_memory_t mem = llama_get_memory(ctx);
  printf("llama.cpp %s, K and V cells in %s: 8 tokens decoded; llama_memory_can_shift: %s\n", llama_version(),
         ggml_type_name(type), llama_memory_can_shift(mem) ? "true" : "false");
  const int verdict = tiny_shift_in_child(ctx);
  llama_free(ctx);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  return verdict;
}
