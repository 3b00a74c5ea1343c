// OmniKvKind: the sequence kind of a policy that never evicts and selects per decode step
// (policies/omnikv.md §3-§4, §10), and OmniKvState, what it keeps for Select — N and k (fixed by
// the first Select), the layer plan, the sparse layers' prompt K/V when they are offloaded to
// the host tier, one staging block table per sparse layer (the gathered T_f plus the layer's
// generated tokens, which the worker attends to), and per filter layer its last selection (for
// idempotent retries) and, for the window selectors, its last W queries.
//
// Internal to cache/: a Sequence whose policy never evicts owns one (cache/sequence_kind.h).
// Threading: none; the session lock serialises access. Choose and Gather of different sequences
// may run at once (RunSelects): they touch only their own sequence.
#ifndef KVSIDECAR_CACHE_OMNIKV_H_
#define KVSIDECAR_CACHE_OMNIKV_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "cache/policy/omnikv.h"
#include "cache/sequence_kind.h"
#include "cache/tier.h"
#include "gpu/backend.h"

namespace kvs {

// A new OmniKV sequence's parameters, before the sequence exists (SequenceAdmission): fills in
// the filter layers (the policy's, else the paper's for this depth of model, omnikv.md §5),
// which must plan; refuses what bounds or keeps evictions (retain_evicted, a budget), since the
// policy never evicts, and offload without the host tier (`has_tiers`).
absl::Status ResolveOmniKvSequence(PolicyConfig& policy, const SequenceParams& params,
                                   int32_t num_layers, bool has_tiers);

struct OmniKvState {
  OmniKvPlan plan;
  int64_t prompt_end = 0;  // N: positions below it are the prompt
  int32_t k = 0;
  // Offloaded prompt K/V of the sparse layers ([2][H][n][D] per sparse layer, in prompt order;
  // empty for the others), held in the host tier under `host_key` and shared with it.
  std::shared_ptr<const SpilledSequence> host;
  std::vector<int32_t> host_tokens;  // per layer: prompt tokens in `host` (0 = none)
  SpillKey host_key;
  // Per layer: the staging blocks of a sparse layer (empty otherwise).
  std::vector<std::vector<int32_t>> staging;

  struct Filter {
    int64_t last_step = std::numeric_limits<int64_t>::min();
    std::vector<int32_t> selected;  // T_f of last_step, ascending positions
    // Window selectors: the last W queries ([Hq][D] each, oldest first) and their positions.
    std::deque<std::vector<float>> window_queries;
    std::deque<int64_t> window_positions;
  };
  std::vector<Filter> filters;  // per entry of the config's filter_layers

  int32_t staging_blocks() const {
    int64_t total = 0;
    for (const auto& blocks : staging) total += static_cast<int64_t>(blocks.size());
    return static_cast<int32_t>(total);
  }
  uint64_t host_bytes() const { return host ? host->bytes() : 0; }
};

// The working data of one Select between its steps.
struct SelectScratch {
  // Per listed filter layer: the prompt index of each token of T_f (ascending).
  std::vector<std::vector<int32_t>> selected_slots;
  // One per sparse layer of the listed filters, by layer: T_f's tokens, then the layer's
  // generated tokens (slots [tail_first, tail_first + tail)), into its staging blocks.
  struct Gather {
    int32_t layer = 0;
    int32_t selected = 0;
    int32_t tail_first = 0;
    int32_t tail = 0;
    const std::vector<int32_t>* slots = nullptr;
  };
  std::vector<Gather> gathers;
};

class OmniKvKind final : public SequenceKind {
 public:
  explicit OmniKvKind(const OmniKvConfig& config) : config_(config) {}

  bool evicts() const override { return false; }
  bool spillable() const override { return state_ == nullptr; }
  int32_t extra_blocks() const override { return state_ ? state_->staging_blocks() : 0; }
  void AppendPinnedKeys(std::vector<SpillKey>& keys) const override;
  uint64_t host_bytes() const override { return state_ ? state_->host_bytes() : 0; }
  void Release(std::vector<int32_t>& to_free) override;

  absl::Status CheckSelect(const Sequence& sequence, const SelectItem& item) const override;
  absl::Status Begin(Sequence& sequence, SelectTask& task) override;
  absl::Status Choose(const Sequence& sequence, SelectTask& task) override;
  int32_t BlocksToStage(const Sequence& sequence, const SelectTask& task) const override;
  void Stage(SelectTask& task, absl::Span<const int32_t> fresh) override;
  absl::Status Gather(const Sequence& sequence, SelectTask& task) override;

 private:
  // The first Select's checks: N within the sequence, no pending reservation to offload past,
  // each segment's sparse layers holding the prompt of its filter layer.
  absl::Status CheckFirstSelect(const Sequence& sequence, const SelectItem& item) const;
  // Copies the sparse layers' prompt rows to one host buffer and pins it (offload only).
  absl::Status OffloadPrompt(Sequence& sequence, const SequenceEnv& env, const HostPin& pin,
                             OmniKvState& state) const;
  // Slides each offloaded layer's generated tokens to the front; the emptied blocks go to
  // `released`.
  absl::Status DropOffloadedRows(Sequence& sequence, const SequenceEnv& env, const HostPin& pin,
                                 OmniKvState& state, std::vector<int32_t>& released) const;
  // T_f of one listed filter layer (attention.layers[listed]) at this step, as slots.
  absl::Status ChooseFilter(const Sequence& sequence, const SelectTask& task, size_t listed,
                            OmniKvState::Filter& filter) const;
  // The queries the selector scores with, [Hq][nq][D]; `prompt_queries` counts the window's
  // queries at prompt positions (their tokens are forced in).
  std::vector<float> SelectorQueries(const AttentionInput& attention, size_t listed,
                                     int32_t hq, int32_t dim, OmniKvState::Filter& filter,
                                     int32_t* num_queries, int32_t* prompt_queries) const;
  // The top `k` of the first `candidates` prompt slots of filter layer `f` under the selector.
  absl::StatusOr<std::vector<int32_t>> TopCandidates(const Sequence& sequence,
                                                     const SequenceEnv& env, int32_t f,
                                                     float scale, absl::Span<const float> queries,
                                                     int32_t num_queries, int32_t candidates,
                                                     int32_t k) const;

  // Slots of layer `layer` holding positions below `prompt_end` (they come first: no eviction).
  static int32_t PromptSlots(const Sequence& sequence, int32_t layer, int64_t prompt_end);
  // The gathers of the listed filters' sparse layers, by layer (after Choose).
  void PlanGathers(const Sequence& sequence, const AttentionInput& attention,
                   SelectScratch& scratch) const;
  // The copies of one gather into its staging blocks: host -> arena for an offloaded layer's
  // selected tokens, arena -> arena otherwise and for the generated tokens.
  void AppendGatherJobs(const Sequence& sequence, const SequenceEnv& env,
                        const SelectScratch::Gather& gather, std::vector<uint64_t>* offsets,
                        std::vector<HostRowCopyJob>& host_jobs,
                        std::vector<RowCopyJob>& arena_jobs) const;

  OmniKvConfig config_;
  std::unique_ptr<OmniKvState> state_;  // from the first Select
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_OMNIKV_H_
