// A sequence's KV cells as llama_state_seq_get_data() serializes them: an 8-byte prefix
// (u32 magic 0xaf143cd8, i32 seq id; builds since spring 2026 only), then u32 n_stream, u32 cell_count; per cell i32 pos, u32 n_seq and the
// seq ids; then u32 v_trans, u32 n_layer; per layer K as i32 type, u64 row size and the
// rows (f32, f16, bf16, q8_0 or q4_0 blocks); V likewise, or transposed (i32 type, u32 element size, u32 row width, then one
// column per dim). Every length is checked against the buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvcheck::llamacpp {

struct CellLayer {
  std::vector<float> k, v;  // [cell][width] as float
  // q8_0 and q4_0 rows as stored (SPEC 9.3): codes [cell][width] (q4_0: 0 to 15), scales
  // [cell][width / 32]; empty for other types.
  std::vector<std::int8_t> k_codes, v_codes;
  std::vector<float> k_scales, v_scales;
  // Where this layer's K rows sit in the state read (cell i's at k_at + i * k_row bytes), in
  // ggml type k_type: for a caller that writes keys back (read_sequence_sections only).
  std::size_t k_at = 0, k_row = 0;
  std::int32_t k_type = 0;
};

struct Cells {
  std::vector<std::int32_t> positions;          // per cell
  std::vector<std::vector<std::int32_t>> seqs;  // per cell: the sequences holding it
  std::vector<CellLayer> layers;               // the layers of this cache only, in model order
  // The cells sequence `seq` holds, in the same order (a context's state lists every cell).
  Cells of_sequence(std::int32_t seq) const;
};

// width: n_embd_k_gqa = n_embd_v_gqa (Hkv * D); fp16: the library's converter. Throws
// std::runtime_error naming the first thing that does not fit.
Cells read_cells(const std::vector<std::uint8_t>& state, std::size_t width,
                 const std::function<float(std::uint16_t)>& fp16);

// A sequence's state of a model with sliding layers (llama.cpp's iSWA cache): two sections
// after the prefix, the full layers' cells, then the sliding layers' (those its window
// masks left out); one section for other models. More is an error, as bytes left over.
std::vector<Cells> read_sequence_sections(const std::vector<std::uint8_t>& state, std::size_t width,
                                          const std::function<float(std::uint16_t)>& fp16);

// A whole context's state as llama_state_get_data() serializes it: the architecture's name
// (u32 length, its bytes), then one section per cache, each as a sequence's state without
// the prefix but with every used cell and all the sequences holding it. A model with
// sliding-window layers (llama.cpp's iSWA cache) writes two: its full layers' cells, then
// its sliding layers', each with its own n_layer. Unlike a sequence's state, a context's
// leaves out no cell its window masks.
struct ContextState {
  std::string arch;
  std::vector<Cells> sections;
};
ContextState read_context_state(const std::vector<std::uint8_t>& state, std::size_t width,
                                const std::function<float(std::uint16_t)>& fp16);

}  // namespace kvcheck::llamacpp
