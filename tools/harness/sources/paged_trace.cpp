#include "tools/harness/sources/paged_trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

#include "tools/harness/io/npy.h"
#include "tools/harness/scenario/scenario.h"

namespace kvcheck {

namespace {

NpyArray<float> pool_tensor(const std::string& path, const PagedTraceFiles& f, std::size_t kv_heads,
                            std::size_t head_dim, double& roundoff) {
  double r = 0.0;
  NpyArray<float> a = read_npy_floats(path, &r);
  roundoff = std::max(roundoff, r);
  const auto B = static_cast<std::size_t>(f.block_size);
  const bool ok = a.shape.size() == 4 && a.shape[3] == head_dim &&
                  (f.head_major ? a.shape[1] == kv_heads && a.shape[2] == B : a.shape[1] == B && a.shape[2] == kv_heads);
  if (!ok)
    throw InputError(path, "", fmt::format("expected a pool of shape [blocks, {}] ({}), got {}",
                                           f.head_major ? fmt::format("{}, {}, {}", kv_heads, B, head_dim)
                                                        : fmt::format("{}, {}, {}", B, kv_heads, head_dim),
                                           f.head_major ? "HND" : "NHD", shape_string(a.shape)));
  return a;
}

// int32 or int64 (torch's default): vLLM's tables are int32, its slot mappings int64.
NpyArray<std::int64_t> integers(const std::string& path, const std::vector<std::size_t>& shape, const char* what) {
  NpyArray<std::int64_t> a = read_npy_indices(path);
  bool ok = a.shape.size() == shape.size();
  for (std::size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] == 0 || a.shape[i] == shape[i];
  if (!ok) throw InputError(path, "", fmt::format("expected {}, got shape {}", what, shape_string(a.shape)));
  return a;
}

}  // namespace

void read_paged_layer(const PagedTraceFiles& f, const std::vector<std::size_t>& lengths, std::size_t kv_heads,
                      std::size_t head_dim, const KvQuant* quant, const IdentifyValue& identify, ViewLayer& layer,
                      PagedView& paged, std::size_t index, std::vector<std::vector<float>>& storage,
                      double& roundoff) {
  const std::size_t rows = lengths.size();
  const auto B = static_cast<std::size_t>(f.block_size);
  // SPEC 9.3: each tensor's codes in the pool's layout (rows of D), their scales per group.
  std::optional<StoredRows> codes[2];
  std::size_t dumped = 0;
  for (int t = 0; t < 2; ++t) {
    if (f.codes.codes[t].empty() || quant == nullptr) continue;
    const TensorQuant& format = t == 0 ? *quant->k : *quant->v;
    // Blocks: as many as an earlier tensor's codes, else any.
    const std::vector<std::size_t> rows_shape = f.head_major ? std::vector<std::size_t>{dumped, kv_heads, B}
                                                             : std::vector<std::size_t>{dumped, B, kv_heads};
    codes[t] = StoredRows::read(f.codes, t, format, rows_shape, head_dim);
    dumped = codes[t]->codes.shape[0];
  }
  const auto pool = [&](int t) {
    const std::string& path = t == 0 ? f.key_cache : f.value_cache;
    if (!path.empty()) return pool_tensor(path, f, kv_heads, head_dim, roundoff);
    NpyArray<float> a{codes[t]->codes.shape, codes[t]->dequantized(t == 0 ? *quant->k : *quant->v, quant->transform)};
    return a;
  };
  NpyArray<float> keys = pool(0);
  NpyArray<float> values = pool(1);
  if (dumped != 0 && keys.shape[0] != dumped)
    throw InputError(f.key_cache, "", fmt::format("expected {} blocks, as the codes, got {}", dumped, keys.shape[0]));
  dumped = keys.shape[0];
  if (values.shape != keys.shape)
    throw InputError(f.value_cache.empty() ? f.codes.codes[1] : f.value_cache, "",
                     fmt::format("expected the key pool's shape {}, got {}", shape_string(keys.shape),
                                 shape_string(values.shape)));
  // Which row of the pools holds a block: the block id itself (the whole pool), or its
  // place in block_ids (only the blocks the tables reference were dumped).
  std::map<std::int64_t, std::size_t> listed;
  if (!f.block_ids.empty()) {
    const NpyArray<std::int64_t> ids =
        integers(f.block_ids, {dumped}, fmt::format("block ids of shape [{}], one per row of the pools", dumped).c_str());
    for (std::size_t i = 0; i < dumped; ++i) {
      const std::int64_t id = ids.data[i];
      if (id < 0 || id > std::numeric_limits<std::int32_t>::max())
        throw InputError(f.block_ids, "", fmt::format("entry [{}] is {}: expected a block id of 0 or more", i, id));
      if (!listed.emplace(id, i).second)
        throw InputError(f.block_ids, "", fmt::format("block {} is listed twice (entries [{}] and [{}])", id,
                                                      listed[id], i));
    }
  }
  const auto known = [&](std::int64_t block) {
    return f.block_ids.empty() ? block >= 0 && block < static_cast<std::int64_t>(dumped) : listed.count(block) > 0;
  };
  const auto pool_row = [&](std::int64_t block) {
    return f.block_ids.empty() ? static_cast<std::size_t>(block) : listed.at(block);
  };
  const std::string known_blocks =
      f.block_ids.empty() ? fmt::format("a block id below {}", dumped) : "a block that block_ids lists";
  const NpyArray<std::int64_t> table =
      integers(f.block_table, {rows, 0}, fmt::format("a block table of shape [{}, max_blocks] (int32)", rows).c_str());
  const std::size_t width = table.shape[1];
  if (paged.block_size != 0 && paged.block_size != f.block_size)
    throw InputError(f.block_table, "",
                     fmt::format("layer {} gives block size {}, an earlier layer {}: kvcheck reads one block size "
                                 "per trace",
                                 index, f.block_size, paged.block_size));
  paged.block_size = f.block_size;
  if (paged.layers.size() <= index) paged.layers.resize(index + 1);
  PagedView::Layer& out = paged.layers[index];
  out.ring = f.ring;
  out.tables.assign(rows, {});
  for (std::size_t b = 0; b < rows; ++b) {
    for (std::size_t i = 0; i < width; ++i) {
      const std::int64_t block = table.data[b * width + i];
      if (block != -1 && !known(block))
        throw InputError(f.block_table, "",
                         fmt::format("entry [{}][{}] is {}: expected -1 (null) or {}", b, i, block, known_blocks));
      out.tables[b].push_back(block);
    }
    while (!out.tables[b].empty() && out.tables[b].back() < 0) out.tables[b].pop_back();  // padding
  }
  if (!f.refcount.empty()) {
    // The whole pool's refcounts, also when only some blocks were dumped.
    const std::size_t blocks = f.block_ids.empty() || listed.empty()
                                   ? dumped
                                   : static_cast<std::size_t>(listed.rbegin()->first) + 1;
    const NpyArray<std::int64_t> r = integers(
        f.refcount, {f.block_ids.empty() ? blocks : 0},
        fmt::format("refcounts of shape [{}] (int32){}", f.block_ids.empty() ? fmt::format("{}", blocks) : "blocks",
                    f.block_ids.empty() ? "" : ", one per block of the whole pool")
            .c_str());
    if (r.data.size() < blocks)
      throw InputError(f.refcount, "", fmt::format("has {} refcounts, but block_ids lists block {}", r.data.size(),
                                                   blocks - 1));
    for (std::size_t i = 0; i < r.data.size(); ++i)
      if (r.data[i] < 0 || r.data[i] > std::numeric_limits<std::int32_t>::max())
        throw InputError(f.refcount, "", fmt::format("block {} has refcount {}: expected 0 or more", i, r.data[i]));
    out.refcounts.assign(r.data.begin(), r.data.end());
  }
  if (!f.hit_tokens.empty() && index == 0) {
    const NpyArray<std::int64_t> h =
        integers(f.hit_tokens, {rows}, fmt::format("hit tokens of shape [{}] (int32)", rows).c_str());
    for (std::size_t b = 0; b < rows; ++b)
      if (h.data[b] < 0)
        throw InputError(f.hit_tokens, "", fmt::format("row {} has {} hit tokens: expected 0 or more", b, h.data[b]));
    paged.hit_tokens.assign(h.data.begin(), h.data.end());
  }
  if (!f.slot_mapping.empty()) {
    const NpyArray<std::int64_t> m = integers(
        f.slot_mapping, {rows, 0}, fmt::format("a slot mapping of shape [{}, tokens] (int64)", rows).c_str());
    const std::size_t n = m.shape[1];
    out.slot_mapping.assign(rows, {});
    for (std::size_t b = 0; b < rows; ++b) {
      for (std::size_t j = 0; j < n; ++j) {
        const std::int64_t slot = m.data[b * n + j];
        // With block_ids, a slot may be in a block not dumped (the step freed it behind a
        // window); the check compares it with the table.
        const bool ok = slot == -1 || (slot >= 0 && (!f.block_ids.empty() ||
                                                     slot < static_cast<std::int64_t>(dumped) * f.block_size));
        if (!ok)
          throw InputError(f.slot_mapping, "",
                           f.block_ids.empty()
                               ? fmt::format("entry [{}][{}] is {}: expected -1 (padding) or a slot below {} (blocks "
                                             "times block size)",
                                             b, j, slot, static_cast<std::int64_t>(dumped) * f.block_size)
                               : fmt::format("entry [{}][{}] is {}: expected -1 (padding) or a slot (0 or more)", b,
                                             j, slot));
        out.slot_mapping[b].push_back(slot);
      }
      while (!out.slot_mapping[b].empty() && out.slot_mapping[b].back() < 0) out.slot_mapping[b].pop_back();
    }
  }
  // Where slot (block, offset) of kv head g starts in a pool.
  const auto at = [&](std::size_t block, std::size_t offset, std::size_t g) {
    return f.head_major ? ((block * kv_heads + g) * B + offset) * head_dim : ((block * B + offset) * kv_heads + g) * head_dim;
  };
  storage.push_back(std::move(keys.data));
  const float* key_data = storage.back().data();
  layer.slots.assign(rows, std::vector<std::vector<ViewSlot>>(kv_heads));
  for (std::size_t b = 0; b < rows; ++b)
    for (std::size_t i = 0; i < out.tables[b].size(); ++i) {
      const std::int64_t block = out.tables[b][i];
      if (block < 0) continue;
      // The places written so far: the row's tokens, or a ring's places up to its length.
      const std::size_t written = f.ring > 0 ? std::min(lengths[b], static_cast<std::size_t>(f.ring)) : lengths[b];
      for (std::size_t o = 0; o < B && i * B + o < written; ++o)
        for (std::size_t g = 0; g < kv_heads; ++g) {
          const std::size_t p = at(pool_row(block), o, g);
          const float* v = values.data.data() + p;
          // All zeros: never written. NaN is not "unused": it is judged (and matches no token).
          if (std::all_of(v, v + head_dim, [](float x) { return x == 0.0f; })) continue;
          ViewSlot s;
          s.slot = block * f.block_size + static_cast<std::int64_t>(o);
          s.uid = identify(b, static_cast<int>(g), v);
          s.key = key_data + p;
          for (int t = 0; t < 2; ++t)
            if (codes[t]) (t == 0 ? s.key_codes : s.value_codes) = codes[t]->unpacked(p / head_dim);
          layer.slots[b][g].push_back(s);
        }
    }
}

}  // namespace kvcheck
