// A store whose layers keep keys and values in different formats (SPEC 9's per-layer
// kv_quant): each layer writes, reads, grows and gathers rows in its own format and row size.
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "optimized/row_codec.h"
#include "optimized/slot_store.h"

using namespace kvcheck::optimized;

namespace {

constexpr int kD = 32;

// Rows each layer's format holds exactly: layer 0 float32 anything; layer 1 q8_0 with 127 as
// the block's largest magnitude (d = 127 / 127 = 1, codes the integers themselves); layer 2
// fp8_e4m3 with the static scale 0.5 (x / 0.5 are integers within 16, which e4m3 holds exactly).
std::vector<float> row_for(int layer, float sign) {
  std::vector<float> x(kD);
  for (int j = 0; j < kD; ++j) {
    if (layer == 0) x[j] = sign * (0.1f * static_cast<float>(j) - 1.3f);
    if (layer == 1) x[j] = sign * static_cast<float>(j == 0 ? 127 : j - 16);
    if (layer == 2) x[j] = sign * static_cast<float>(j - 16) / 2.0f;
  }
  return x;
}

std::vector<LayerFormats> three_formats() {
  RowFormat q8;
  q8.codec = Codec::q8_0;
  q8.group = 32;
  q8.scale_half = true;
  RowFormat fp8;
  fp8.codec = Codec::fp8_e4m3;
  fp8.static_scales = {0.5f};
  return {{float_format(Storage::float32), float_format(Storage::float32)}, {q8, q8}, {fp8, fp8}};
}

}  // namespace

TEST(SlotStorePerLayer, EachLayerKeepsItsFormatThroughGrowAndGather) {
  SlotStore store(/*kv_heads=*/1, kD, three_formats());
  ASSERT_EQ(store.layers(), 3);
  EXPECT_FALSE(store.plain_float32());
  store.reset(/*batch=*/2, /*capacity=*/2);
  for (int l = 0; l < 3; ++l) {
    // Slots of a layer lie one row of its format apart.
    const auto* first = static_cast<const std::byte*>(store.key(l, 0, 0, 0));
    const auto* second = static_cast<const std::byte*>(store.key(l, 0, 0, 1));
    EXPECT_EQ(static_cast<std::size_t>(second - first), row_bytes(store.key_format(l), kD)) << "layer " << l;
    store.write_key(l, 0, 0, 1, row_for(l, 1.0f).data());
    store.write_value(l, 0, 0, 1, row_for(l, -1.0f).data());
    store.write_key(l, 1, 0, 0, row_for(l, -1.0f).data());
    store.write_value(l, 1, 0, 0, row_for(l, 1.0f).data());
  }
  EXPECT_EQ(row_bytes(store.key_format(0), kD), 4u * kD);
  EXPECT_LT(row_bytes(store.key_format(1), kD), row_bytes(store.key_format(0), kD));
  // q8_0: d = 1, so the codes are the integers written.
  const UnpackedRow codes =
      unpack_row(store.key_format(1), 0, static_cast<const std::byte*>(store.key(1, 0, 0, 1)), kD);
  ASSERT_EQ(codes.scales.size(), 1u);
  EXPECT_EQ(codes.scales[0], 1.0f);
  for (int j = 0; j < kD; ++j) EXPECT_EQ(codes.codes[static_cast<std::size_t>(j)], j == 0 ? 127 : j - 16);

  store.grow(5);
  store.gather_rows({1, 0, 0});  // new row 0: old row 1; rows 1 and 2: old row 0
  std::vector<float> got(kD);
  for (int l = 0; l < 3; ++l) {
    store.read_key(l, 0, 0, 0, got.data());
    EXPECT_EQ(got, row_for(l, -1.0f)) << "layer " << l;
    store.read_value(l, 0, 0, 0, got.data());
    EXPECT_EQ(got, row_for(l, 1.0f)) << "layer " << l;
    for (int row : {1, 2}) {
      store.read_key(l, row, 0, 1, got.data());
      EXPECT_EQ(got, row_for(l, 1.0f)) << "layer " << l << " row " << row;
      store.read_value(l, row, 0, 1, got.data());
      EXPECT_EQ(got, row_for(l, -1.0f)) << "layer " << l << " row " << row;
    }
  }
  // A copy between stores of the same formats keeps each layer's bytes.
  SlotStore other(1, kD, three_formats());
  other.reset(1, 1);
  other.copy_slot(store, 0, 0, 0, 0);
  for (int l = 0; l < 3; ++l) {
    other.read_key(l, 0, 0, 0, got.data());
    EXPECT_EQ(got, row_for(l, -1.0f)) << "layer " << l;
  }
}

TEST(SlotStorePerLayer, CopyBetweenStoresOfOtherFormatsIsRefused) {
  SlotStore store(1, kD, three_formats());
  store.reset(1, 1);
  std::vector<LayerFormats> swapped = three_formats();
  std::swap(swapped[1], swapped[2]);
  SlotStore other(1, kD, swapped);
  other.reset(1, 1);
  EXPECT_THROW(other.copy_slot(store, 0, 0, 0, 0), std::logic_error);
}
