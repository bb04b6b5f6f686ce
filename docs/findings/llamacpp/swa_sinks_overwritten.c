/* Standalone reproduction (llama.cpp alone; see swa-sinks-overwritten.md): with two
 * sequences in one unified cache, llama.cpp's SWA cache gives a sequence's sink cells, while
 * its window hides them, to the other sequence's tokens; a context shift then brings the
 * sinks back into the sliding layers' view, and they are gone.
 *
 * A gemma3 model (repro/tiny_gemma3.h: layer 0 sliding, window 6; layer 1 full), contexts
 * as llama-server makes them (swa_full off, kv_unified on, 2 sequences; n_batch = n_ubatch
 * = n_ctx, so the SWA cache is as large as the base one and llama.cpp allows the shift).
 * Each sequence is a slot of 8 cells shifted as llama-server shifts one (n_keep 2,
 * n_discard 4: seq_rm, then seq_add) before its 9th token: prompts of 7 (sequence 0) and 4
 * tokens (sequence 1), then one token per sequence per forward. After five forwards
 * sequence 1 has shifted once and its newest token sits at position 4: the window sees
 * positions 4 - 5 .. 4, sinks 0 and 1 included. Sequence 1 is run again alone, with the
 * same tokens at the same positions. Exits 1 when its sliding cells or its logits differ
 * between the two runs (the bug), 0 when they agree. --swa-full runs both with a full-size
 * SWA cache (the same reuse rule: it fails too); --apart gives each sequence a stream of its
 * own (kv_unified off; swa_full on, without which llama.cpp refuses to shift): the control,
 * which exits 0. --restore runs sequence 1 alone but saves it (llama_state_seq_get_data) and
 * restores it into a fresh context right before its shift, as llama-server's slot save and
 * restore do: the state leaves out the cells the window masks, sinks included.
 *
 *   swa_sinks_overwritten LIB_DIR [--swa-full | --apart | --restore]   (LIB_DIR: libllama and its CPU backends) */
#include "repro/tiny_gemma3.h"

enum { SLOT = 8, KEEP = 2, DISCARD = 4, FORWARDS = 5 };

struct outcome {
  int positions[64], n_positions; /* sequence 1's cells in the sliding layers' cache */
  float logits[TINY_VOCAB];       /* of sequence 1's newest token */
};

/* Token t of sequence s: a deterministic embedding. */
static void embedding(int s, int t, float *out) {
  for (int d = 0; d < TINY_EMBD; ++d) out[d] = tiny_value(200 + 100 * (uint32_t)s + (uint32_t)t, (uint32_t)d);
}

/* The positions of sequence 1's cells in the SWA cache, from its state (SWA section only). */
static int swa_positions(struct llama_context *ctx, struct outcome *o) {
  const size_t size = llama_state_seq_get_size_ext(ctx, 1, LLAMA_STATE_SEQ_FLAGS_SWA_ONLY);
  uint8_t *state = (uint8_t *)malloc(size);
  if (!state || llama_state_seq_get_data_ext(ctx, state, size, 1, LLAMA_STATE_SEQ_FLAGS_SWA_ONLY) != size) return -1;
  size_t at = 8; /* v0.5.0's prefix: magic and seq id */
  uint32_t streams, cells = 0, stream = 0;
  memcpy(&streams, state + at, 4);
  at += 4;
  /* one stream per sequence under --apart: the cell lists of the others' are empty */
  for (; stream < streams && at + 4 <= size; ++stream) {
    memcpy(&cells, state + at, 4);
    at += 4;
    if (cells > 0) break;
  }
  o->n_positions = 0;
  for (uint32_t i = 0; i < cells && i < 64 && at + 8 <= size; ++i) {
    int32_t pos;
    uint32_t seqs;
    memcpy(&pos, state + at, 4);
    memcpy(&seqs, state + at + 4, 4);
    at += 8 + 4 * (size_t)seqs;
    o->positions[o->n_positions++] = pos;
  }
  for (int i = 1; i < o->n_positions; ++i) /* in position order (the cells are in cell order) */
    for (int j = i; j > 0 && o->positions[j - 1] > o->positions[j]; --j) {
      const int t = o->positions[j];
      o->positions[j] = o->positions[j - 1];
      o->positions[j - 1] = t;
    }
  free(state);
  return stream < streams ? 0 : -1;
}

/* Runs the schedule; with_other: sequence 0 beside sequence 1. */
static int run(struct llama_model *model, int with_other, int swa_full, int apart, int restore, struct outcome *o) {
  struct llama_context_params p = llama_context_default_params();
  p.n_ctx = p.n_batch = p.n_ubatch = 2 * SLOT;
  p.n_seq_max = 2;
  p.kv_unified = !apart;
  p.swa_full = swa_full;
  p.type_k = p.type_v = GGML_TYPE_F32;
  p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  struct llama_context *ctx = llama_init_from_model(model, p);
  if (!ctx || !llama_memory_can_shift(llama_get_memory(ctx))) return -1;
  llama_memory_t mem = llama_get_memory(ctx);
  int fed[2] = {0, 0}, held[2] = {0, 0}, next[2] = {0, 0};
  const int prompt[2] = {7, 4};
  const int first = with_other ? 0 : 1;
  for (int forward = 0; forward <= FORWARDS; ++forward) {
    if (restore && held[1] == SLOT) { /* sequence 1 saved and restored before its shift */
      const size_t size = llama_state_seq_get_size(ctx, 1);
      uint8_t *state = (uint8_t *)malloc(size);
      if (!state || llama_state_seq_get_data(ctx, state, size, 1) != size) return -1;
      llama_free(ctx);
      ctx = llama_init_from_model(model, p);
      if (!ctx || llama_state_seq_set_data(ctx, state, size, 1) != size) return -1;
      free(state);
      mem = llama_get_memory(ctx);
      restore = 0;
    }
    struct llama_batch b = llama_batch_init(16, TINY_EMBD, 1);
    int n = 0, last = -1;
    for (int s = first; s < 2; ++s) {
      const int count = forward == 0 ? prompt[s] : 1;
      if (forward > 0 && held[s] == SLOT) { /* llama-server's context shift */
        llama_memory_seq_rm(mem, s, KEEP, KEEP + DISCARD);
        llama_memory_seq_add(mem, s, KEEP + DISCARD, next[s], -DISCARD);
        held[s] -= DISCARD;
        next[s] -= DISCARD;
      }
      for (int i = 0; i < count; ++i, ++n) {
        embedding(s, fed[s]++, b.embd + n * TINY_EMBD);
        b.pos[n] = next[s]++;
        b.n_seq_id[n] = 1;
        b.seq_id[n][0] = s;
        b.logits[n] = 1;
        ++held[s];
        if (s == 1) last = n;
      }
    }
    b.n_tokens = n;
    const int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    if (rc != 0) return -1;
    if (forward == FORWARDS) memcpy(o->logits, llama_get_logits_ith(ctx, last), sizeof o->logits);
  }
  const int ok = swa_positions(ctx, o);
  llama_free(ctx);
  return ok;
}

static void print_positions(const char *what, const struct outcome *o) {
  printf("  %s:", what);
  for (int i = 0; i < o->n_positions; ++i) printf(" %d", o->positions[i]);
  printf("\n");
}

int main(int argc, char **argv) {
  const int apart = argc == 3 && strcmp(argv[2], "--apart") == 0;
  const int restore = argc == 3 && strcmp(argv[2], "--restore") == 0;
  if (argc < 2 || argc > 3 || (argc == 3 && !apart && !restore && strcmp(argv[2], "--swa-full") != 0)) {
    fprintf(stderr, "usage: %s LIB_DIR [--swa-full | --apart | --restore]\n", argv[0]);
    return 2;
  }
  const int swa_full = argc == 3 && !restore;
  char folder[64], path[512];
  struct llama_model *model = tiny_gemma3_load(argv[1], folder, path);
  struct outcome beside, alone;
  if (!model || run(model, !restore, swa_full, apart, restore, &beside) != 0 || run(model, 0, swa_full, apart, 0, &alone) != 0) {
    fprintf(stderr, "could not load or run the tiny model\n");
    return 2;
  }
  printf("llama.cpp %s: gemma3, sliding window %d, swa_full %s, kv_unified %s; slots of %d cells shifted as "
         "llama-server does (n_keep %d, n_discard %d), %s, %d forwards\n",
         llama_version(), TINY_G3_WINDOW, swa_full ? "on" : "off", apart ? "off" : "on", SLOT, KEEP, DISCARD,
         restore ? "a prompt of 4 tokens (sequence 1 alone)" : "prompts of 7 and 4 tokens", FORWARDS);
  printf("sequence 1 after its shift, its newest token at position 4 (its window sees positions 0 to 4):\n");
  print_positions("its cells in the sliding layers' cache, alone              ", &alone);
  const char *other = restore ? "saved and restored" : "beside sequence 0";
  char label[96];
  snprintf(label, sizeof label, "its cells in the sliding layers' cache, %-19s", other);
  print_positions(label, &beside);
  double worst = 0.0;
  printf("  logits of that token, alone              :");
  for (int i = 0; i < TINY_VOCAB; ++i) printf(" %9.6f", alone.logits[i]);
  printf("\n  logits of that token, %-19s", other);
  printf(":");
  for (int i = 0; i < TINY_VOCAB; ++i) {
    printf(" %9.6f", beside.logits[i]);
    const double d = fabs((double)beside.logits[i] - alone.logits[i]);
    if (d > worst) worst = d;
  }
  printf("\n  max |difference| %.3g\n", worst);
  const int same_cells = beside.n_positions == alone.n_positions &&
                         memcmp(beside.positions, alone.positions, sizeof(int) * (size_t)alone.n_positions) == 0;
  tiny_cleanup(folder, path);
  if (same_cells && worst < 1e-4) {
    printf("sequence 1 is the same %s as alone\n", other);
    return 0;
  }
  printf("%s, sequence 1 lost cells its sliding window sees again after the shift\n", other);
  return 1;
}
