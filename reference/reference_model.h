// The naive reference: every row keeps its whole history, and every appended token's
// attention is recomputed from scratch with V(t), Pq and Pk from the policy table.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "reference/kv_quant.h"
#include "reference/model.h"
#include "reference/policy.h"
#include "reference/stored_kv.h"

namespace kvcheck::reference {

// A step that a cache of this policy must refuse (SPEC 4, crop). `code` is the name a
// scenario uses in `expect_error`.
struct StepRefused : std::runtime_error {
  std::string code;
  StepRefused(std::string code_, const std::string& message) : std::runtime_error(message), code(std::move(code_)) {}
};

struct AppendedToken {
  std::uint64_t uid;
  std::int64_t index;                  // token index t in its row
  QueryView view;                      // what it attended to (in layer 0)
  std::vector<QueryView> layer_views;  // per layer, when the layers' policies differ; else empty
  const QueryView& view_in(int layer) const {
    return layer_views.empty() ? view : layer_views[static_cast<std::size_t>(layer)];
  }
};

struct AppendResult {
  std::int64_t chunk = 0;                        // n, the longest chunk of the step
  std::vector<std::vector<AppendedToken>> rows;  // real tokens only, per row
  std::vector<double> out;                       // [L, B, n, H, D], NaN where padded
  std::vector<double> out_stored;                // R_stored (SPEC 9.1), same layout; empty: not quantized
  std::vector<double> query_slack;               // [L, B, n, H]: how far a quantized query may be (2-norm)
};

struct RetainedKey {
  std::uint64_t uid;
  std::int64_t index;
  std::int64_t position;  // Pk as seen by the row's last token
};

// SPEC 11: a pruned token stays in its row's history with its uid marked, so the others
// keep their indices and a history stays sorted by uid under kUidBits. At most one run of
// them per row (one prune per row).
inline constexpr std::uint64_t kPrunedBit = std::uint64_t{1} << 63;
inline constexpr std::uint64_t kRerotatedBit = std::uint64_t{1} << 62;  // the later keys moved down
// SPEC 11.1: the cache chose which m tokens of the prompt it kept; the reference marks the
// last n - m, so the later tokens' positions come out right, and knows none of the kept.
inline constexpr std::uint64_t kObservedBit = std::uint64_t{1} << 61;
inline constexpr std::uint64_t kUidBits = kObservedBit - 1;
inline bool is_pruned(std::uint64_t entry) { return (entry & kPrunedBit) != 0; }

// The run of pruned tokens [first, end) in a row (empty: never pruned) and how it moves
// positions: re-rotated, every token after it sits end - first positions lower. Observed
// (SPEC 11.1): the row kept `first` tokens of its `end`-token prompt, chosen by the cache.
struct PrunedRun {
  std::int64_t first = 0, end = 0;
  bool rerotated = false;
  bool observed = false;
  static PrunedRun of(std::span<const std::uint64_t> history);
  // How many positions lower than its index token i sits.
  std::int64_t shift(std::int64_t i) const {
    return rerotated ? std::clamp<std::int64_t>(i - first, 0, end - first) : 0;
  }
  // The view without the pruned keys, at the positions the prune left (full policy: the
  // positions are the indices). Observed: without any of the prompt's keys.
  void apply(QueryView& view, std::int64_t t) const;
};

struct RowRetained {
  std::vector<RetainedKey> keys;
  std::int64_t query_position = 0;  // Pq of the row's last token (0 for an empty row)
  // The live set (SPEC 3): the kept tokens the next token still sees, with Pk as that
  // token sees them (a cache that drops dead tokens early may re-encode keys for it).
  std::vector<RetainedKey> live;
  std::int64_t next_query_position = 0;
  // SPEC 10.4: uids of retained tokens a sliding layer under a shift may have dropped, since
  // no later query sees them again (empty for every other layer).
  std::vector<std::uint64_t> droppable;
};

// What a row with this history keeps under `policy`, and what its next token sees. A pure
// function of the history, so the state between two forwards of a chunked append (SPEC
// 8.7) is the retained set of the history up to there.
RowRetained retained_of(const Policy& policy, std::span<const std::uint64_t> history);

class ReferenceModel {
 public:
  // `scale` is the softmax scale; `inputs` must hold every uid the run will create.
  ReferenceModel(const Dims& dims, const Rope& rope, const Policy& policy, double scale, const InputTable& inputs,
                 const Attention& attention = {});
  // One rope and one policy per layer (SPEC 7 hybrid models, SPEC 10.1 per-layer RoPE).
  ReferenceModel(const Dims& dims, const std::vector<Rope>& layer_ropes, const std::vector<Policy>& layer_policies,
                 double scale, const InputTable& inputs, const Attention& attention = {});

  // counts[b] new tokens for row b (left-padded to the longest); size must equal batch().
  // With attend false the step only extends the histories and computes the views: the
  // outputs stay NaN (a caller that needs the state, not the numbers, saves the attention).
  AppendResult append(const std::vector<std::int64_t>& counts, bool attend = true);
  void reorder(const std::vector<int>& rows);
  void reset(int batch);
  // Those rows end (SPEC 8.7 `free`): they become empty and may start again.
  void free_rows(const std::vector<int>& rows);
  // Every row keeps its first `length` tokens. Throws StepRefused("crop_evicted") when
  // the retained set of the cropped row holds a token this policy has already evicted (in
  // any layer).
  void crop(std::int64_t length);
  // SPEC 11: every row keeps its first `sinks` and last `recent` tokens; the others are
  // pruned for good. `rerotate`: the kept keys and every later token take positions in the
  // cache (rank among the kept). Full-attention layers only (the scenario checks it).
  void prune(std::int64_t sinks, std::int64_t recent, bool rerotate);
  // SPEC 11.1: every row of n > keep tokens keeps `keep` of them, which the cache chooses;
  // later tokens sit n - keep positions lower if `rerotate`. The outputs of full layers
  // over such a row are not computed from then on (NaN): the reference cannot know them.
  void prune_observed(std::int64_t keep, bool rerotate);

  // Threads that share an append's attention (each output is computed by one thread
  // alone, so results do not depend on the count). Default: the machine's cores.
  void set_threads(int threads) { threads_ = threads < 1 ? 1 : threads; }

  // SPEC 9: the caches quantize keys and values; every append also computes R_stored, the
  // attention over the values they must hold.
  // `layers`: one per layer.
  void store_as(std::vector<KvQuant> layers, KvDtype kv_dtype);
  // The simulated store after the last step (null unless store_as was called).
  const StoredKv* stored() const { return stored_.get(); }
  // A prefix hit under frozen scales, before the append that takes it: token `index` of
  // `row` holds another row's stored codes and scale (StoredKv::adopt).
  void adopt_stored(int row, std::int64_t index, const std::vector<StoredLayer>& layers) {
    stored_->adopt(row, index, layers);
  }

  int batch() const { return static_cast<int>(histories_.size()); }
  std::uint64_t next_uid() const { return next_uid_; }
  const std::vector<std::uint64_t>& history(int row) const { return histories_.at(row); }
  RowRetained retained(int row, int layer = 0) const;
  // The layers follow different policies.
  bool hybrid() const { return hybrid_; }

 private:
  // One token's attention in one layer for the query heads of kv head `group`: writes
  // each head's output to out + head * D.
  struct Scratch;
  // Consecutive tokens see mostly the same keys at the same positions, so each key of one
  // (layer, kv head) is rotated (and its value widened) once and looked up by uid after,
  // while its position stays. Only a cache of what would be recomputed from the inputs;
  // every memo together stays under kMemoBytes, or a memo under twice its largest view.
  struct KeyMemo {
    std::unordered_map<std::uint64_t, std::size_t> slot_of_uid;
    std::vector<std::int64_t> position;  // per slot: the position its key is rotated at
    std::vector<double> keys, values;    // per slot: D doubles each
  };
  static constexpr std::size_t kMemoBytes = std::size_t{256} << 20;
  void attend_group(int layer, int group, const std::vector<std::uint64_t>& row, std::int64_t t, const QueryView& view,
                    Scratch& scratch, KeyMemo& memo, double* out) const;
  // One rope's m cos and m sin of every rotated pair per position (the table grows to the
  // largest position seen): R/2 cosines, then R/2 sines. Layers of equal ropes share one.
  struct AngleTable {
    Rope rope;
    int rotary;                   // R
    std::vector<double> cos_sin;  // [position][m cos of each pair, then m sin of each pair]
    const double* at(std::int64_t position) const {
      return cos_sin.data() + static_cast<std::size_t>(position) * static_cast<std::size_t>(rotary);
    }
  };
  const AngleTable& angles(int layer) const { return tables_[static_cast<std::size_t>(table_of_[static_cast<std::size_t>(layer)])]; }
  void ensure_positions(std::int64_t largest);
  void scale_query(int layer, std::int64_t position, double* query, int d) const;

  Dims dims_;
  Policy policy_;                       // layer 0's
  std::vector<Policy> layer_policies_;  // one per layer
  bool hybrid_ = false;
  Attention attention_;
  double scale_;
  const InputTable& inputs_;
  std::vector<std::vector<std::uint64_t>> histories_;  // per row, uid of token index t
  std::uint64_t next_uid_ = 0;
  int threads_;
  std::vector<AngleTable> tables_;  // one per distinct rope
  std::vector<int> table_of_;        // per layer, its rope's table
  std::int64_t positions_ = 0;
  std::unique_ptr<StoredKv> stored_;
  std::vector<KeyMemo> memos_;  // per (layer, kv head); a thread owns each while it works
  // R_stored of one token in one layer, every kv head, into out (H heads of D).
  void attend_stored(int row, int layer, std::int64_t t, const QueryView& view, bool attend, Scratch& scratch,
                     double* out, double* slack);
};

}  // namespace kvcheck::reference
