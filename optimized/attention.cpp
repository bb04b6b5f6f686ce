#include "optimized/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <xsimd/xsimd.hpp>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "optimized/worker_pool.h"

namespace kvcheck::optimized {

namespace {

using Batch = xsimd::batch<float>;
constexpr int kLanes = static_cast<int>(Batch::size);
// Consecutive queries of a prefill chunk that share one read of K and V.
constexpr std::size_t kQueryBlock = 8;
// Query heads served together from one key or value row held in registers.
constexpr int kHeadsAtOnce = 4;
// Query heads whose accumulators stay in registers while whole value rows stream past.
constexpr int kValueHeadsAtOnce = 2;
constexpr int kValueChunksAtOnce = 8;
// Vectors of value codes read in place per pass, for kHeadsAtOnce heads.
constexpr int kDirectValueChunks = 2;
// Value rows per pass of the register-held accumulators (they stay in L1 for the next pass).
constexpr std::size_t kValueTile = 32;

// out[r] = <q + r * d, k> for N query vectors laid out one after the other.
template <int N>
void dots(const float* q, const float* k, int d, float* out) {
  Batch acc[N];
  for (int r = 0; r < N; ++r) acc[r] = Batch(0.0f);
  int i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const Batch kb = Batch::load_unaligned(k + i);
    for (int r = 0; r < N; ++r) acc[r] = xsimd::fma(Batch::load_unaligned(q + r * d + i), kb, acc[r]);
  }
  for (int r = 0; r < N; ++r) {
    float sum = xsimd::hadd(acc[r]);
    for (int j = i; j < d; ++j) sum += q[r * d + j] * k[j];
    out[r] = sum;
  }
}

// For keys i < count: acc[r] (dims [0, C * kLanes)) += weights[r * stride + i] * v[i], for N
// query heads, with the N x C accumulators held in registers across the keys.
template <int N, int C>
void accumulate(float* acc, int d, const float* weights, std::size_t stride, const float* const* v,
                std::size_t count, int offset) {
  Batch a[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Batch::load_unaligned(acc + r * d + offset + c * kLanes);
  for (std::size_t i = 0; i < count; ++i) {
    Batch vb[C];
    for (int c = 0; c < C; ++c) vb[c] = Batch::load_unaligned(v[i] + offset + c * kLanes);
    for (int r = 0; r < N; ++r) {
      const Batch wb(weights[r * stride + i]);
      for (int c = 0; c < C; ++c) a[r][c] = xsimd::fma(wb, vb[c], a[r][c]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c].store_unaligned(acc + r * d + offset + c * kLanes);
}

// Quantized codes read in place (row_codec.h's direct formats): q8_0 and int8 codes are
// signed bytes; fp8 codes are bit patterns whose exponent and mantissa, shifted into a
// float's, give the value times 2^(bias - 127) (normal and subnormal alike).
enum class Codes { signed8, e4m3, e5m2 };

// kLanes codes as floats, unscaled: widened and converted in registers (AVX-512, AVX2),
// or through a small array elsewhere.
template <Codes K>
Batch code_batch(const std::uint8_t* c) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    if constexpr (K == Codes::signed8) {
      return Batch(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    } else {
      constexpr int shift = K == Codes::e4m3 ? 20 : 21;
      const __m512i u = _mm512_cvtepu8_epi32(bytes);
      const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F)), shift),
                                           _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24));
      return Batch(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(K == Codes::e4m3 ? 0x1p120f : 0x1p112f)));
    }
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)  // AVX-512 took the branch above
  if constexpr (kLanes == 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
    if constexpr (K == Codes::signed8) {
      return Batch(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    } else {
      constexpr int shift = K == Codes::e4m3 ? 20 : 21;
      const __m256i u = _mm256_cvtepu8_epi32(bytes);
      const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), shift),
                                           _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24));
      return Batch(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(K == Codes::e4m3 ? 0x1p120f : 0x1p112f)));
    }
  }
#endif
  alignas(64) float tmp[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    if constexpr (K == Codes::signed8) {
      tmp[j] = static_cast<float>(static_cast<std::int8_t>(c[j]));
    } else {
      constexpr int shift = K == Codes::e4m3 ? 20 : 21;
      constexpr float rebias = K == Codes::e4m3 ? 0x1p120f : 0x1p112f;
      const float m = std::bit_cast<float>(static_cast<std::uint32_t>(c[j] & 0x7F) << shift) * rebias;
      tmp[j] = (c[j] & 0x80) ? -m : m;
    }
  }
  return Batch::load_aligned(tmp);
}

// Where a row read in place keeps its scales and codes: ggml's q8_0 blocks (a float16
// scale, then 32 codes), one static scale for the whole row, or any other direct layout
// through the scales and code pointers row_codec's direct_row lists.
enum class Layout { q8_0, fixed, listed };

struct DirectRow {
  const std::byte* row = nullptr;              // q8_0, fixed
  float fixed = 1.0f;                          // fixed
  const float* scales = nullptr;               // listed: one per group
  const std::uint8_t* const* codes = nullptr;  // listed: one per group
};

inline float half_at(const std::byte* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return from_float16(h);
#endif
}

template <Layout L>
float scale_of(const DirectRow& r, int group_index) {
  if constexpr (L == Layout::q8_0) return half_at(r.row + group_index * 34);
  if constexpr (L == Layout::fixed) return r.fixed;
  return r.scales[group_index];
}
template <Layout L>
const std::uint8_t* codes_of(const DirectRow& r, int group_index, int group) {
  if constexpr (L == Layout::q8_0) return reinterpret_cast<const std::uint8_t*>(r.row + group_index * 34 + 2);
  if constexpr (L == Layout::fixed) return reinterpret_cast<const std::uint8_t*>(r.row) + group_index * group;
  return r.codes[group_index];
}

// out[r] = the horizontal sum of acc[r], r < N: for four heads, one transposing tree of
// horizontal adds (five instructions) instead of four separate reductions.
template <int N>
void sums(const Batch* acc, float* out) {
#if defined(__AVX2__) && !defined(__AVX512F__)  // AVX-512's batches are not __m256
  if constexpr (N == 4 && kLanes == 8) {
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit half: the partial sums of heads 0..3
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    return;
  }
#endif
  for (int r = 0; r < N; ++r) out[r] = xsimd::hadd(acc[r]);
}

// Vectors of codes times their group's scale; under one fixed scale for the whole row the
// codes alone, the scale applied once to the sums.
template <Codes K, Layout L>
Batch scaled_codes(const std::uint8_t* codes, const Batch& scale) {
  if constexpr (L == Layout::fixed)
    return code_batch<K>(codes);
  else
    return code_batch<K>(codes) * scale;
}

// dots<N> over a key row read in place: each group's codes against the queries, times its
// scale. Two accumulators per head, for alternate vectors of codes: N = 4 heads then keep
// eight independent multiply-add chains in flight, enough to hide the FMA latency.
template <int N, Codes K, Layout L>
void dots_direct(const float* q, int d, int group, const DirectRow& row, float* out) {
  Batch even[N], odd[N];
  for (int r = 0; r < N; ++r) even[r] = odd[r] = Batch(0.0f);
  for (int b = 0; b * group < d; ++b) {
    const std::uint8_t* codes = codes_of<L>(row, b, group);
    const Batch sb(L == Layout::fixed ? 1.0f : scale_of<L>(row, b));
    const float* qb = q + b * group;
    int e = 0;
    for (; e + 2 * kLanes <= group; e += 2 * kLanes) {
      const Batch c0 = scaled_codes<K, L>(codes + e, sb), c1 = scaled_codes<K, L>(codes + e + kLanes, sb);
      for (int r = 0; r < N; ++r) {
        even[r] = xsimd::fma(Batch::load_unaligned(qb + r * d + e), c0, even[r]);
        odd[r] = xsimd::fma(Batch::load_unaligned(qb + r * d + e + kLanes), c1, odd[r]);
      }
    }
    if (e < group) {
      const Batch c0 = scaled_codes<K, L>(codes + e, sb);
      for (int r = 0; r < N; ++r) even[r] = xsimd::fma(Batch::load_unaligned(qb + r * d + e), c0, even[r]);
    }
  }
  for (int r = 0; r < N; ++r) even[r] += odd[r];
  sums<N>(even, out);
  if constexpr (L == Layout::fixed)
    for (int r = 0; r < N; ++r) out[r] *= row.fixed;
}

// accumulate<N, C> over value rows read in place (rows[i] for key i of the tile, scales[i *
// groups + b] its group scales): each vector of codes is converted and scaled once for the
// N heads. Under one fixed scale the caller applies it to the finished sums.
template <int N, int C, Codes K, Layout L>
void accumulate_direct(float* acc, int d, int group, const float* weights, std::size_t stride, const float* scales,
                       int groups, std::size_t count, const DirectRow* rows, int offset) {
  Batch a[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Batch::load_unaligned(acc + r * d + offset + c * kLanes);
  for (std::size_t i = 0; i < count; ++i)
    for (int c = 0; c < C; ++c) {
      const int e = offset + c * kLanes, b = e / group;
      const Batch vb = scaled_codes<K, L>(codes_of<L>(rows[i], b, group) + e % group, Batch(scales[i * groups + b]));
      for (int r = 0; r < N; ++r) a[r][c] = xsimd::fma(Batch(weights[r * stride + i]), vb, a[r][c]);
    }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c].store_unaligned(acc + r * d + offset + c * kLanes);
}

// Runs f.template operator()<L>() for a direct format's layout.
template <class F>
void by_layout(const RowFormat& format, F&& f) {
  if (format.codec == Codec::q8_0)
    f.template operator()<Layout::q8_0>();
  else if (!format.static_scales.empty() && format.static_scales.size() == 1)
    f.template operator()<Layout::fixed>();
  else
    f.template operator()<Layout::listed>();
}

// Fills `row` for a direct format: the pointer, the static scale, or the listed groups.
void direct_ref(const RowFormat& format, int kv_head, const std::byte* bytes, int d, float* scales,
                const std::uint8_t** codes, DirectRow& row) {
  row.row = bytes;
  if (format.codec == Codec::q8_0) return;
  if (format.static_scales.size() == 1) {
    row.fixed = format.static_scales[0];
    return;
  }
  direct_row(format, kv_head, bytes, d, scales, codes);
  row.scales = scales;
  row.codes = codes;
}

// Runs f.template operator()<K>() for the codes of a direct format.
template <class F>
void by_codes(Codec codec, F&& f) {
  switch (codec) {
    case Codec::fp8_e4m3: f.template operator()<Codes::e4m3>(); break;
    case Codec::fp8_e5m2: f.template operator()<Codes::e5m2>(); break;
    default: f.template operator()<Codes::signed8>(); break;
  }
}

// The group size a kernel reads a format in place with (whole vectors per group), or 0.
int direct_lanes_group(const RowFormat& format, int d) {
  const int g = direct_group(format, d);
  return g > 0 && g % kLanes == 0 && d % kLanes == 0 ? g : 0;
}

// Runs f.template operator()<N>() for N = min(count, kHeadsAtOnce) chunks of `count`.
template <class F>
void by_head_groups(int count, F&& f) {
  for (int r = 0; r < count; r += kHeadsAtOnce) {
    switch (std::min(kHeadsAtOnce, count - r)) {
      case 1: f.template operator()<1>(r); break;
      case 2: f.template operator()<2>(r); break;
      case 3: f.template operator()<3>(r); break;
      default: f.template operator()<4>(r); break;
    }
  }
}

// Runs f.template operator()<C>() for C = count (1 .. kValueChunksAtOnce).
template <class F>
void by_chunk_count(int count, F&& f) {
  switch (count) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

bool sees(const QueryPlan& p, std::int64_t index) {
  return index <= p.index + p.sees_ahead && ((index >= p.sink_begin && index < p.sink_end) || index >= p.window_begin);
}

// x[i] = exp(x[i] - top) for n floats; returns their sum.
float exp_and_sum(float* x, std::size_t n, float top) {
  Batch total(0.0f);
  const Batch tb(top);
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch e = xsimd::exp(Batch::load_unaligned(x + i) - tb);
    e.store_unaligned(x + i);
    total += e;
  }
  float sum = xsimd::hadd(total);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - top));
  return sum;
}

}  // namespace

struct VisibleSlot {
  const SlotStore* store;
  int row;
  std::int64_t slot;
  std::int64_t index;
};

// Up to kQueryBlock consecutive queries and every slot at least one of them sees.
struct AttentionKernel::Block {
  std::size_t first = 0, count = 0;
  std::vector<VisibleSlot> slots;
};

struct AttentionKernel::Scratch {
  std::vector<float> q_window, q_sink;  // [query, head of the group, D], rotated
  std::vector<float> scores;            // [query, head of the group, slot]
  std::vector<float> acc;               // [query, head of the group, D]
  std::vector<float> totals;            // [query, head of the group]: softmax denominators
  std::vector<const float*> k, v;       // per slot, this layer and kv head
  std::vector<float> k_rows, v_rows;    // one key row, one tile of value rows, decoded to float32
  // Rows read in place: one key row's group scales and code pointers; a value tile's.
  std::vector<float> k_scales, v_scales;
  std::vector<const std::uint8_t*> k_codes, v_codes;
  DirectRow k_direct;
  std::vector<DirectRow> v_direct;  // one per row of the value tile

  // Room for M query vectors against n slots. Capacities are powers of two and every
  // participant is fitted before a run, whichever tasks it then takes: between two powers
  // of two of the cached tokens no step allocates.
  void fit(std::size_t M, std::size_t n, std::size_t D) {
    for (auto* x : {&q_window, &q_sink, &acc}) x->reserve(std::bit_ceil(M * D));
    scores.reserve(std::bit_ceil(M * n));
    totals.reserve(std::bit_ceil(M));
    k.reserve(std::bit_ceil(n));
    v.reserve(std::bit_ceil(n));
  }
  void fit_converted(std::size_t D) {
    k_rows.reserve(D);
    v_rows.reserve(kValueTile * D);
  }
};

AttentionKernel::AttentionKernel(int threads) : pool_(std::make_unique<WorkerPool>(std::max(1, threads))) {
  scratch_.resize(static_cast<std::size_t>(pool_->size()));
}
AttentionKernel::~AttentionKernel() = default;
AttentionKernel::AttentionKernel(AttentionKernel&&) noexcept = default;
AttentionKernel& AttentionKernel::operator=(AttentionKernel&&) noexcept = default;

void AttentionKernel::attend(const KernelShape& shape, const RopeTable& rope, const std::vector<const float*>& q,
                             const std::vector<float*>& out, std::size_t row_offset,
                             std::span<const PlannedQuery> queries, std::span<const SlotSource> sources,
                             AttentionLog* log, int row) {
  const int H = shape.heads, D = shape.head_dim, G = shape.heads / shape.kv_heads;

  // Blocks and what they see: the same for every layer and kv head.
  const std::size_t block_count = (queries.size() + kQueryBlock - 1) / kQueryBlock;
  if (blocks_.size() < block_count) blocks_.resize(block_count);
  for (std::size_t b = 0; b < block_count; ++b) {
    Block& block = blocks_[b];
    block.first = b * kQueryBlock;
    block.count = std::min(kQueryBlock, queries.size() - block.first);
    block.slots.clear();
    for (const SlotSource& src : sources) {
      const SlotMeta* meta = src.store->row_meta(src.row);
      const std::int64_t end = src.count < 0 ? src.store->capacity() : src.first + src.count;
      for (std::int64_t s = src.first; s < end; ++s) {
        if (meta[s].uid < 0) continue;
        for (std::size_t j = 0; j < block.count; ++j)
          if (sees(queries[block.first + j].plan, meta[s].index)) {
            block.slots.push_back({src.store, src.row, s, meta[s].index});
            break;
          }
      }
    }
  }
  if (log != nullptr)
    for (std::size_t b = 0; b < block_count; ++b)
      for (std::size_t j = 0; j < blocks_[b].count; ++j) {
        const QueryPlan& p = queries[blocks_[b].first + j].plan;
        for (const VisibleSlot& x : blocks_[b].slots) {
          if (!sees(p, x.index)) continue;
          const SlotMeta& m = x.store->meta(x.row, x.slot);
          log->push_back(
              {row, p.index, x.index < p.sink_end ? p.sink_query_position : p.query_position, m.uid, m.index, m.position});
        }
      }

  std::size_t most_slots = 0, most_queries = 0;
  for (std::size_t b = 0; b < block_count; ++b) {
    most_slots = std::max(most_slots, blocks_[b].slots.size());
    most_queries = std::max(most_queries, blocks_[b].count);
  }
  const bool half = !sources.empty() && !sources[0].store->plain_float32();
  for (Scratch& w : scratch_) {
    w.fit(most_queries * G, most_slots, static_cast<std::size_t>(D));
    if (half) w.fit_converted(static_cast<std::size_t>(D));
  }

  for (int layer = 0; layer < shape.layers; ++layer) {
    // One task: one block of queries against the keys and values of one kv head.
    auto task = [&](int t, int participant) {
      const Block& block = blocks_[static_cast<std::size_t>(t) / shape.kv_heads];
      const int g = t % shape.kv_heads;
      Scratch& w = scratch_[static_cast<std::size_t>(participant)];
      const std::size_t n = block.slots.size(), M = block.count * G;
      // Every query sees at least its own token; none means the cache planned wrongly.
      if (n == 0) throw std::logic_error("attention: a query block sees no slot at all");
      w.q_window.resize(M * D);
      w.q_sink.resize(M * D);
      w.scores.resize(M * n);
      w.acc.assign(M * D, 0.0f);
      w.k.resize(n);
      w.v.resize(n);

      const bool tempered = shape.temperature_floor > 0 && shape.temperature_layers[layer];
      for (std::size_t j = 0; j < block.count; ++j) {
        const PlannedQuery& pq = queries[block.first + j];
        // Written from SPEC 10.3 apart from reference/: floor of (Pq + 1) / F by integer division
        // (Pq is the token's index unless a prune re-rotated the row, SPEC 11).
        const float temperature =
            tempered ? static_cast<float>(std::log1p(static_cast<double>((pq.plan.query_position + 1) / shape.temperature_floor)) *
                                              shape.temperature_scale +
                                          1.0)
                     : 1.0f;
        for (int hh = 0; hh < G; ++hh) {
          const float* raw = q[layer] + row_offset + (pq.chunk_pos * H + g * G + hh) * D;
          float* qw = w.q_window.data() + (j * G + hh) * D;
          float* qs = w.q_sink.data() + (j * G + hh) * D;
          std::copy_n(raw, D, qw);
          rope.rotate(qw, pq.plan.query_position);
          if (pq.plan.sink_query_position != pq.plan.query_position && pq.plan.sink_end > 0) {
            std::copy_n(raw, D, qs);
            rope.rotate(qs, pq.plan.sink_query_position);
          } else {
            std::copy_n(qw, D, qs);
          }
          if (tempered)
            for (int i = 0; i < D; ++i) {
              qw[i] *= temperature;
              qs[i] *= temperature;
            }
        }
      }
      // Half-precision and quantized rows are decoded as they are read: a key row just
      // before its dot products, a tile of value rows just before it is accumulated, so the
      // decoded floats stay in L1 and K and V are read from memory in their stored size.
      const bool converted = !block.slots.empty() && !block.slots[0].store->plain_float32();
      // Formats whose codes the dot products read in place, never decoded to floats.
      // A store holding some tokens raw (a residual) decodes each row by what its slot holds.
      const bool direct = converted && !block.slots[0].store->holds_raw();
      const int k_group = direct ? direct_lanes_group(block.slots[0].store->key_format(layer), D) : 0;
      const int v_group = direct ? direct_lanes_group(block.slots[0].store->value_format(layer), D) : 0;
      if (converted) {
        w.k_rows.resize(static_cast<std::size_t>(D));
        w.v_rows.resize(kValueTile * D);
        if (k_group) w.k_scales.resize(static_cast<std::size_t>(D / k_group)), w.k_codes.resize(w.k_scales.size());
        if (v_group) {
          w.v_scales.resize(kValueTile * (D / v_group)), w.v_codes.resize(w.v_scales.size());
          w.v_direct.resize(kValueTile);
        }
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          const VisibleSlot& x = block.slots[i];
          w.k[i] = static_cast<const float*>(x.store->key(layer, x.row, g, x.slot));
          w.v[i] = static_cast<const float*>(x.store->value(layer, x.row, g, x.slot));
        }
      }

      // Scores: each key row is read once from memory, whole and in order (the pattern memory
      // streams fastest; reading several rows interleaved was twice as slow here), for every
      // query and head of the block. Keys a query does not see get -inf.
      float group_scores[kHeadsAtOnce];
      const RowFormat& key_format = block.slots[0].store->key_format(layer);  // n > 0: checked above
      for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t index = block.slots[i].index;
        const float* key = w.k[i];
        if (k_group) {
          const VisibleSlot& x = block.slots[i];
          direct_ref(x.store->key_format(layer), g,
                     static_cast<const std::byte*>(x.store->key(layer, x.row, g, x.slot)), D, w.k_scales.data(),
                     w.k_codes.data(), w.k_direct);
        } else if (converted) {
          const VisibleSlot& x = block.slots[i];
          x.store->read_key(layer, x.row, g, x.slot, w.k_rows.data());
          key = w.k_rows.data();
        }
        for (std::size_t j = 0; j < block.count; ++j) {
          const QueryPlan& p = queries[block.first + j].plan;
          float* column = w.scores.data() + j * G * n + i;
          if (!sees(p, index)) {
            for (int hh = 0; hh < G; ++hh) column[hh * n] = -INFINITY;
            continue;
          }
          const float* qj = (index < p.sink_end ? w.q_sink : w.q_window).data() + j * G * D;
          by_head_groups(G, [&]<int N>(int h0) {
            if (k_group)
              by_codes(key_format.codec, [&]<Codes K>() {
                by_layout(key_format, [&]<Layout L>() {
                  dots_direct<N, K, L>(qj + h0 * D, D, k_group, w.k_direct, group_scores);
                });
              });
            else
              dots<N>(qj + h0 * D, key, D, group_scores);
            for (int r = 0; r < N; ++r) column[(h0 + r) * n] = group_scores[r] * shape.scale;
          });
        }
      }

      // Softmax over each query head's row of scores (an invisible key weighs exp(-inf) = 0).
      // A learned sink logit takes its share of the denominator and adds no value.
      w.totals.resize(M);
      float* total = w.totals.data();
      const float* sinks = shape.sink_logits ? (*shape.sink_logits)[static_cast<std::size_t>(layer)].data() : nullptr;
      for (std::size_t m = 0; m < M; ++m) {
        float* x = w.scores.data() + m * n;
        float top = *std::max_element(x, x + n);
        const float sink = sinks ? sinks[g * G + static_cast<int>(m % G)] : 0.0f;
        if (sinks) top = std::max(top, sink);
        total[m] = exp_and_sum(x, n, top);
        if (sinks) total[m] += std::exp(sink - top);
      }

      // Values: each tile of value rows is read once from memory for every query and head of
      // the block (a key a query does not see has weight exp(-inf) = 0).
      const int chunks = D / kLanes;
      for (std::size_t i0 = 0; i0 < n; i0 += kValueTile) {
        const std::size_t len = std::min(kValueTile, n - i0);
        const std::size_t v_groups = v_group ? static_cast<std::size_t>(D / v_group) : 0;
        if (v_group)
          for (std::size_t r = 0; r < len; ++r) {
            const VisibleSlot& x = block.slots[i0 + r];
            direct_ref(x.store->value_format(layer), g,
                       static_cast<const std::byte*>(x.store->value(layer, x.row, g, x.slot)), D,
                       w.v_scales.data() + r * v_groups, w.v_codes.data() + r * v_groups, w.v_direct[r]);
            // Every layout's scales listed, read once per row and group, not per head.
            by_layout(x.store->value_format(layer), [&]<Layout L>() {
              for (std::size_t b = 0; b < v_groups; ++b)
                w.v_scales[r * v_groups + b] = scale_of<L>(w.v_direct[r], static_cast<int>(b));
            });
          }
        else if (converted)
          for (std::size_t r = 0; r < len; ++r) {
            const VisibleSlot& x = block.slots[i0 + r];
            x.store->read_value(layer, x.row, g, x.slot, w.v_rows.data() + r * D);
            w.v[i0 + r] = w.v_rows.data() + r * D;
          }
        const float* const* v = w.v.data() + i0;
        const RowFormat& value_format = block.slots[0].store->value_format(layer);
        // Codes read in place are converted once per row and chunk for up to four heads,
        // two chunks at a time (8 accumulators, the rest of the registers for the weights);
        // float rows for two heads, eight chunks.
        const int heads_at_once = v_group ? kHeadsAtOnce : kValueHeadsAtOnce;
        const int chunks_at_once = v_group ? kDirectValueChunks : kValueChunksAtOnce;
        for (std::size_t j = 0; j < block.count; ++j)
          for (int h0 = 0; h0 < G; h0 += heads_at_once) {
            float* acc = w.acc.data() + (j * G + h0) * D;
            const float* weights = w.scores.data() + (j * G + h0) * n + i0;
            const auto heads = [&]<int N>() {
              for (int c0 = 0; c0 < chunks; c0 += chunks_at_once)
                by_chunk_count(std::min(chunks_at_once, chunks - c0), [&]<int C>() {
                  if (v_group)
                    by_codes(value_format.codec, [&]<Codes K>() {
                      by_layout(value_format, [&]<Layout L>() {
                        accumulate_direct<N, C, K, L>(acc, D, v_group, weights, n, w.v_scales.data(),
                                                      static_cast<int>(v_groups), len, w.v_direct.data(), c0 * kLanes);
                      });
                    });
                  else
                    accumulate<N, C>(acc, D, weights, n, v, len, c0 * kLanes);
                });
              for (int r = 0; r < N; ++r)  // dims past the last whole vector
                for (std::size_t i = 0; i < len; ++i)
                  for (int e = chunks * kLanes; e < D; ++e) acc[r * D + e] += weights[r * n + i] * v[i][e];
            };
            switch (std::min(heads_at_once, G - h0)) {
              case 1: heads.template operator()<1>(); break;
              case 2: heads.template operator()<2>(); break;
              case 3: heads.template operator()<3>(); break;
              default: heads.template operator()<4>(); break;
            }
          }
      }

      // Value rows under one fixed scale were accumulated unscaled (accumulate_direct).
      float v_fixed = 1.0f;
      if (v_group)
        by_layout(block.slots[0].store->value_format(layer), [&]<Layout L>() {
          if constexpr (L == Layout::fixed) v_fixed = block.slots[0].store->value_format(layer).static_scales[0];
        });
      for (std::size_t j = 0; j < block.count; ++j)
        for (int hh = 0; hh < G; ++hh) {
          const std::size_t m = j * G + hh;
          float* o = out[layer] + row_offset + (queries[block.first + j].chunk_pos * H + g * G + hh) * D;
          for (int d = 0; d < D; ++d) o[d] = w.acc[m * D + d] * v_fixed / total[m];
        }
    };
    pool_->run(static_cast<int>(block_count) * shape.kv_heads, task);
  }
}

}  // namespace kvcheck::optimized
