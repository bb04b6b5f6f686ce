// SPEC 8.8.5's poison switch: a paged cache's new and freed blocks hold NaNs that name the
// block, a correct cache never reads one, and a read of one is named from the outputs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "optimized/paged_cache.h"
#include "optimized/poison.h"
#include "optimized/row_codec.h"
#include "tools/catalog/catalog.h"
#include "tools/harness/sources/in_process_source.h"
#include "tools/harness/sources/cache_entry.h"
#include "tools/harness/scenario/inputs.h"

using namespace kvcheck;
using optimized::PoisonKind;

TEST(Poison, AMarkCarriesItsKindBlockAndEpoch) {
  // 0x7FC00000 | 2 << 20 | 2 << 14 | 5, by hand.
  EXPECT_EQ(optimized::poison_bits(PoisonKind::never_written, 5, 2), 0x7FE08005u);
  const auto mark = optimized::read_poison(std::bit_cast<float>(0x7FE08005u));
  ASSERT_TRUE(mark.has_value());
  EXPECT_EQ(mark->kind, PoisonKind::never_written);
  EXPECT_EQ(mark->block, 5);
  EXPECT_EQ(mark->epoch, 2);
  // Either sign; block and epoch wrap at 16384 and 64.
  const auto freed = optimized::read_poison(-std::bit_cast<float>(optimized::poison_bits(PoisonKind::freed, 16385, 65)));
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->kind, PoisonKind::freed);
  EXPECT_EQ(freed->block, 1);
  EXPECT_EQ(freed->epoch, 1);
  // The NaN arithmetic makes, and numbers, are no mark.
  EXPECT_FALSE(optimized::read_poison(std::numeric_limits<float>::quiet_NaN()).has_value());
  EXPECT_FALSE(optimized::read_poison(std::sqrt(-1.0f)).has_value());
  EXPECT_FALSE(optimized::read_poison(std::numeric_limits<float>::infinity()).has_value());
  EXPECT_FALSE(optimized::read_poison(1.5f).has_value());
}

TEST(Poison, EveryFormatWithRoomForANaNReadsBackNaN) {
  using optimized::Codec;
  const std::uint32_t bits = optimized::poison_bits(PoisonKind::freed, 9, 3);
  const int d = 32;
  for (Codec codec : {Codec::float32, Codec::float16, Codec::bfloat16, Codec::int8, Codec::fp8_e4m3, Codec::q8_0,
                      Codec::q4_0, Codec::int4, Codec::int2}) {
    optimized::RowFormat f;
    f.codec = codec;
    std::vector<std::byte> row(optimized::row_bytes(f, d), std::byte{0x11});
    ASSERT_TRUE(optimized::poison_row(f, d, row.data(), bits)) << static_cast<int>(codec);
    std::vector<float> x(d);
    optimized::decode_row(f, 0, row.data(), d, x.data());
    for (float v : x) EXPECT_TRUE(std::isnan(v)) << static_cast<int>(codec);
    if (codec == Codec::float32) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(x[0]), bits);  // the mark itself
    }
  }
  // Under a static scale the row holds codes only, none of them NaN: left as it was.
  optimized::RowFormat fixed;
  fixed.codec = Codec::int8;
  fixed.static_scales = {0.5f};
  std::vector<std::byte> row(optimized::row_bytes(fixed, d), std::byte{0x11});
  EXPECT_FALSE(optimized::poison_row(fixed, d, row.data(), bits));
  EXPECT_EQ(row, std::vector<std::byte>(optimized::row_bytes(fixed, d), std::byte{0x11}));
}

TEST(Poison, NewAndFreedBlocksHoldTheirMarks) {
  // One layer, one kv head, blocks of 4: five tokens take blocks 0 and 1 (the lowest free
  // ids), and leave slots 5, 6, 7 of block 1 unwritten.
  optimized::CacheConfig c;
  c.head_dim = 4;
  c.paging = optimized::PagedLayout{4, 4, false};
  c.poison_blocks = true;
  optimized::set_every_layer(c, {});  // full attention
  optimized::set_every_layer_rope(c, {});
  optimized::PagedCache cache(c);
  std::vector<float> q(5 * 4, 0.25f), k(5 * 4, 0.5f), v(5 * 4, 1.0f), out(5 * 4);
  optimized::Chunk chunk;
  chunk.length = 5;
  chunk.counts = {5};
  chunk.uids = {0, 1, 2, 3, 4};
  chunk.q = {q.data()};
  chunk.k = {k.data()};
  chunk.v = {v.data()};
  cache.append(chunk, {out.data()}, nullptr);
  for (float x : out) EXPECT_NEAR(x, 1.0f, 1e-6f);  // every value is 1: no poison read
  ASSERT_EQ(cache.paged()->layers[0].tables[0], (std::vector<std::int64_t>{0, 1}));
  const optimized::SlotStore& pool = cache.layer_slots(0);
  const auto first_float = [&](std::int64_t slot, bool value) {
    float x;
    std::memcpy(&x, value ? pool.value(0, 0, 0, slot) : pool.key(0, 0, 0, slot), sizeof x);
    return x;
  };
  for (std::int64_t slot : {5, 6, 7})
    for (bool value : {false, true}) {
      const auto mark = optimized::read_poison(first_float(slot, value));
      ASSERT_TRUE(mark.has_value()) << slot;
      EXPECT_EQ(mark->kind, PoisonKind::never_written);
      EXPECT_EQ(mark->block, 1);
      EXPECT_EQ(mark->epoch, 0);
      EXPECT_LT(pool.meta(0, slot).uid, 0);
    }
  EXPECT_FALSE(optimized::read_poison(first_float(4, false)).has_value());  // token 4, written
  cache.free_rows({0});
  for (std::int64_t slot : {0, 4}) {  // blocks 0 and 1, each poisoned a second time
    const auto mark = optimized::read_poison(first_float(slot, false));
    ASSERT_TRUE(mark.has_value()) << slot;
    EXPECT_EQ(mark->kind, PoisonKind::freed);
    EXPECT_EQ(mark->block, slot / 4);
    EXPECT_EQ(mark->epoch, 1);
  }
}

// nano-vllm PR 213 with poisoning on: 13 tokens in chunks of 4 take blocks 0 to 3 of each
// layer. The first chunk's queries are told the whole append's 13 keys: token 0 sees tokens
// 1 to 9, token 3 sees up to 12, and the kernel reads its tile of four queries over the
// slots any of them sees. Blocks 1 to 3 are mapped but not yet written, so token 0's output
// is a NaN of one of them (NaN arithmetic keeps one operand's, whichever).
TEST(Poison, AChunkThatReadsAheadReadsANeverWrittenBlock) {
  const Scenario s = load_scenario(std::string(KVCHECK_SOURCE_DIR) + "/fixtures/scenarios/paged_chunked_prefill.json");
  const InputTable inputs = load_inputs(s);
  const ReferenceRun run = run_reference(s, inputs);
  const CacheTrace t =
      trace_cache(s, inputs, run, with_poisoned_blocks(*find_cache("zoo/chunk_keys_to_append_end")), false);
  ASSERT_TRUE(t.first.has_value());
  EXPECT_EQ(t.first->evidence.step, 0u);
  EXPECT_EQ(t.first->bug, BugClass::chunk_sees_future_keys);
  ASSERT_TRUE(t.first->evidence.poisoned.has_value());
  const PoisonedRead& read = *t.first->evidence.poisoned;
  EXPECT_EQ(read.layer, 0);
  EXPECT_EQ(read.query_index, 0);
  EXPECT_FALSE(read.freed);
  EXPECT_TRUE(read.block >= 1 && read.block <= 3) << read.block;
  EXPECT_EQ(read.epoch, 0);
  // Without the switch the same mutant reads stale zeros, and the log still names it.
  const CacheTrace plain = trace_cache(s, inputs, run, *find_cache("zoo/chunk_keys_to_append_end"), false);
  ASSERT_TRUE(plain.first.has_value());
  EXPECT_EQ(plain.first->bug, BugClass::chunk_sees_future_keys);
  EXPECT_FALSE(plain.first->evidence.poisoned.has_value());
}
