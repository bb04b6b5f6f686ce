/* Standalone reproduction (llama.cpp alone; see shared-cells-shift.md): sequences that share
 * cells (llama_memory_seq_cp, a beam fork) share their positions, so a context shift of one
 * moves the shared cells for the other too, and when each shifts in turn the second shift
 * removes live tokens and moves the rest twice.
 *
 * A one-layer llama model, one unified cache for 2 sequences: 16 tokens of sequence 0,
 * copied to sequence 1 with seq_cp (every cell shared), then each sequence shifted as
 * llama-server shifts a slot (n_keep 4, n_discard 4: seq_rm of positions 4..7, seq_add of
 * 8..15 by -4). Each sequence must then hold 12 cells, the last at position 11. Exit 1 when
 * not (the hazard), 0 when both do; --own-cells gives sequence 1 its own cells instead
 * (llama_state_seq_get_data of 0, set_data into 1: the control, which exits 0).
 *
 *   shared_cells_shift LIB_DIR [--own-cells]   (LIB_DIR: libllama and its CPU backends) */
#include "repro/tiny_llama.h"

/* The number of cells sequence `seq` holds, from its state. */
static int cells_of(struct llama_context *ctx, llama_seq_id seq) {
  const size_t size = llama_state_seq_get_size(ctx, seq);
  uint8_t *state = (uint8_t *)malloc(size);
  if (!state || llama_state_seq_get_data(ctx, state, size, seq) != size) return -1;
  uint32_t magic, count;
  memcpy(&magic, state, 4);
  const size_t at = magic == 0xaf143cd8u ? 8 : 0; /* v0.5.0's prefix: magic and seq id */
  memcpy(&count, state + at + 4, 4);                 /* after n_stream */
  free(state);
  return (int)count;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--own-cells") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--own-cells]\n", argv[0]);
    return 2;
  }
  const int own = argc == 3;
  char folder[64], path[512];
  struct llama_model *model = tiny_load(argv[1], 0.0f, folder, path);
  struct llama_context_params p = llama_context_default_params();
  p.n_ctx = p.n_batch = p.n_ubatch = 64;
  p.n_seq_max = 2;
  p.kv_unified = true;
  p.type_k = p.type_v = GGML_TYPE_F32;
  p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  struct llama_context *ctx = model ? llama_init_from_model(model, p) : NULL;
  if (!ctx || tiny_decode(ctx, 16, 0, 0) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  llama_memory_t mem = llama_get_memory(ctx);
  if (own) {
    const size_t size = llama_state_seq_get_size(ctx, 0);
    uint8_t *state = (uint8_t *)malloc(size);
    if (!state || llama_state_seq_get_data(ctx, state, size, 0) != size ||
        llama_state_seq_set_data(ctx, state, size, 1) != size)
      return 2;
    free(state);
  } else {
    llama_memory_seq_cp(mem, 0, 1, -1, -1);
  }
  for (llama_seq_id s = 0; s < 2; ++s) {
    llama_memory_seq_rm(mem, s, 4, 8);
    llama_memory_seq_add(mem, s, 8, 16, -4);
  }
  printf("llama.cpp %s: 16 tokens, sequence 1 %s, then each sequence shifted (n_keep 4, n_discard 4)\n",
         llama_version(), own ? "given its own cells (state copy)" : "forked with seq_cp (cells shared)");
  int wrong = 0;
  for (llama_seq_id s = 0; s < 2; ++s) {
    const int cells = cells_of(ctx, s);
    const llama_pos last = llama_memory_seq_pos_max(mem, s);
    printf("sequence %d: %d cells, last position %d (expected 12 cells, last position 11)\n", s, cells, last);
    wrong |= cells != 12 || last != 11;
  }
  llama_free(ctx);
  llama_model_free(model);
  tiny_cleanup(folder, path);
  printf(wrong ? "the shifts moved shared cells for both sequences, and the second removed live tokens\n"
               : "each sequence holds its 12 tokens at positions 0..11\n");
  return wrong ? 1 : 0;
}
