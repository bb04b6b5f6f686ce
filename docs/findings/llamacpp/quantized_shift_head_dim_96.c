/* Standalone reproduction (llama.cpp alone; see quantized-shift-crashes-without-k-rotation.md):
 * a quantized K cache whose head size is not a multiple of 64 (Phi-3-mini's 96) crashes at
 * the first context shift. Such a cache stores K without the Hadamard rotation (attn_rot_k
 * is off), but the K-shift's quantized path rotates back and forth with it regardless, and
 * dereferences the missing rotation matrix.
 *
 * A one-layer llama model with 2 heads of 96 dims, K in q8_0 (V f32), 8 tokens decoded, then
 * a shift as llama-server makes it (keep 2, discard 2) and one token, in a child process so
 * that its crash can be reported. Exit 1 when the child dies of a signal (the bug), 0 when
 * it decodes; --f16 stores K in f16 (a control, which exits 0). The same program at head
 * size 64 (quantized_shift_head_dim_64.c), where K is stored rotated, shifts and exits 0.
 *
 *   quantized_shift_head_dim_96 LIB_DIR [--f16]   (LIB_DIR: libllama and its CPU backends) */
#ifndef TINY_HEAD_DIM
#define TINY_HEAD_DIM 96 /* quantized_shift_head_dim_64.c, the head-size control, sets 64 */
#endif
#include "repro/tiny_llama.h"

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--f16") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--f16]\n", argv[0]);
    return 2;
  }
  const enum ggml_type type = argc == 3 ? GGML_TYPE_F16 : GGML_TYPE_Q8_0;
  char folder[64], path[512];
  struct llama_model *model = tiny_load(argv[1], 0.0f, folder, path);
  struct llama_context *ctx = model ? tiny_context(model, 64, type) : NULL;
  if (!ctx || tiny_decode(ctx, 8, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  llama_memory_t mem = llama_get_memory(ctx);
  printf("llama.cpp %s, head_dim %d, K cells in %s: 8 tokens decoded; llama_memory_can_shift: %s\n", llama_version(),
         TINY_HEAD_DIM, ggml_type_name(type), llama_memory_can_shift(mem) ? "true" : "false");
  const int verdict = tiny_shift_in_child(ctx);
  llama_free(ctx);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  return verdict;
}
