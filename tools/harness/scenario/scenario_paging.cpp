// The scenario parser's `paging` section (SPEC 8) and the pool's size, refused before any
// allocation.
#include <fmt/format.h>

#include "tools/harness/scenario/parse_sections.h"

namespace kvcheck::scenario_parse {

// `paging` (SPEC 8). Parsed after the policy and kv_quant, which it must fit.
Paging parse_paging(const Reader& r, const json& j, const Scenario& s) {
  const std::string p = "/paging";
  r.object(j, p, {"block_size", "num_blocks", "prefix_cache", "reuse"});
  Paging paging;
  paging.block_size = r.integer(r.field(j, p, "block_size"), p + "/block_size", 1, 65536);
  paging.num_blocks = r.integer(r.field(j, p, "num_blocks"), p + "/num_blocks", 1, std::int64_t{1} << 20);
  if (j.contains("prefix_cache")) {
    if (!j["prefix_cache"].is_boolean()) r.fail(p + "/prefix_cache", "expected true or false, got " + describe(j["prefix_cache"]));
    paging.prefix_cache = j["prefix_cache"].get<bool>();
  }
  if (j.contains("reuse")) paging.token_reuse = r.choice(j["reuse"], p + "/reuse", {"full", "token"}) == "token";
  // Quantized blocks (vLLM's fp8 pools) are served; a residual of raw tokens beside them is not yet.
  if (s.quantized() && s.quant_rules().holds_raw())
    r.fail(p, "a paged cache with a residual (kv_quant \"residual\", \"requantize_all\", raw chunk reads or "
              "scales along the token axis) is in SPEC 8 and 9, but kvcheck's paged cache quantizes each token alone "
              "as it is written");
  return paging;
}

// The pool must hold every row's blocks at every step, counted without sharing (so any
// correct cache fits): SPEC 8.6 makes room by preemption, which kvcheck does not run yet.
void require_pool_fits(const Reader& r, const Scenario& s) {
  // The paged cache allocates its whole pool up front: keys and values of every block in
  // every layer (float32 at most), and each slot's bookkeeping, about 192 bytes (measured:
  // 4.9 GB peak for 2 layers of 2^20 blocks of 8 with 2 kv heads of 8, 128 bytes of KV a slot).
  const double slots = static_cast<double>(s.paging->num_blocks) * static_cast<double>(s.paging->block_size);
  const double pool = static_cast<double>(s.dims.layers) * slots *
                      (2.0 * s.dims.kv_heads * s.dims.head_dim * 4 + 192);
  if (pool > kMemoryBudget)
    r.fail("/paging/num_blocks",
           fmt::format("the paged cache's pool would take about {} ({} layers x {} blocks x {} tokens x {} kv heads x "
                       "head_dim {}, keys and values); kvcheck accepts up to {}",
                       bytes_text(pool), s.dims.layers, s.paging->num_blocks, s.paging->block_size, s.dims.kv_heads,
                       s.dims.head_dim, bytes_text(kMemoryBudget)));
  const PoolNeed need = largest_pool_need(s, s.paging->block_size);
  if (need.blocks > s.paging->num_blocks)
    r.fail("/paging/num_blocks", fmt::format("the pool holds {} blocks, but /steps/{} needs up to {} (every row's "
                                             "blocks, counted without sharing); a pool too small needs preemption "
                                             "(SPEC 8.6), which kvcheck does not run yet",
                                             s.paging->num_blocks, need.source_index, need.blocks));
}

}  // namespace kvcheck::scenario_parse
