/* Standalone reproduction (llama.cpp alone; see state-before-shift.md): llama_memory_seq_add
 * moves the cells' positions at once but re-rotates their keys only inside the next
 * llama_decode. A sequence saved in between holds the new positions with the unshifted
 * keys, and restored into another context the pending shift is gone.
 *
 * A one-layer llama model (f32 cells), 8 tokens, a shift as llama-server makes it (keep 2,
 * discard 2: tokens 4..7 move to positions 2..5). The sequence is saved right after
 * seq_add and restored into a second context; both contexts then decode one token at
 * position 6. The key of position 2 (token 4) must be the same in both. Exit 1 when the
 * restored one differs (the bug), 0 when they agree; --after-decode saves the sequence only
 * after the first context's decode of that token has applied the shift (the control, which
 * exits 0).
 *
 *   state_before_shift LIB_DIR [--after-decode]   (LIB_DIR: libllama and its CPU backends) */
#include "repro/tiny_llama.h"

static double max_diff(const float *a, const float *b) {
  double d = 0.0;
  for (int i = 0; i < TINY_EMBD; ++i) d = fmax(d, fabs((double)a[i] - b[i]));
  return d;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--after-decode") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--after-decode]\n", argv[0]);
    return 2;
  }
  const int after_decode = argc == 3;
  char folder[64], path[512];
  struct llama_model *model = tiny_load(argv[1], 0.0f, folder, path);
  struct llama_context *a = model ? tiny_context(model, 64, GGML_TYPE_F32) : NULL;
  struct llama_context *b = model ? tiny_context(model, 64, GGML_TYPE_F32) : NULL;
  if (!a || !b || tiny_decode(a, 8, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  float unshifted[TINY_EMBD], key_a[TINY_EMBD], key_b[TINY_EMBD];
  if (tiny_key_at(a, 4, unshifted) != 0) return 2; /* token 4 rotated at position 4 */
  llama_memory_t mem = llama_get_memory(a);
  llama_memory_seq_rm(mem, 0, 2, 4);
  llama_memory_seq_add(mem, 0, 4, 8, -2);
  if (after_decode && tiny_decode(a, 1, 6, 8) != 0) return 2;
  const size_t size = llama_state_seq_get_size(a, 0);
  uint8_t *state = (uint8_t *)malloc(size);
  if (!state || llama_state_seq_get_data(a, state, size, 0) != size ||
      llama_state_seq_set_data(b, state, size, 0) != size) {
    fprintf(stderr, "could not save or restore the sequence\n");
    return 2;
  }
  free(state);
  if (!after_decode && tiny_decode(a, 1, 6, 8) != 0) return 2;
  if ((!after_decode && tiny_decode(b, 1, 6, 8) != 0) || tiny_key_at(a, 2, key_a) != 0 || tiny_key_at(b, 2, key_b) != 0)
    return 2;
  const double apart = max_diff(key_a, key_b), as_before = max_diff(key_b, unshifted);
  printf("llama.cpp %s: sequence saved %s and restored into a second context\n", llama_version(),
         after_decode ? "after the decode that applied the shift" : "between seq_add and the next decode");
  printf("key of position 2 (token 4): max |first context - restored| = %.3g; restored vs token 4 as rotated at "
         "position 4 before the shift: %.3g\n", apart, as_before);
  llama_free(b);
  llama_free(a);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  if (apart > 1e-6) {
    printf("the restored sequence lost the pending shift: its key still sits at position 4\n");
    return 1;
  }
  printf("the restored sequence holds the shifted keys\n");
  return 0;
}
