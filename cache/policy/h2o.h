// H2O (Zhang et al., "Heavy-Hitter Oracle"; policies/caote.md §4): a token's score is the
// attention it has received from every query the sidecar observed while it was cached, summed per
// query head (LayerPolicyState::accumulated, [Hq][count], new tokens start at 0). The accumulation
// runs on every step that carries attention, evicting or not. Optional n_sink lowest and n_recent
// newest positions are always kept (0 / 0 by default, as in the paper). The selection score of a
// kv head is the GQA mean of its group (AttentionScoredPolicy).
// normalize_by_queries (kvpress's ObservedAttentionPress): each key's sum is divided by the
// number of observed queries that can see it (query position >= key position), from the runs of
// observed query positions kept in LayerPolicyState::observed_queries; a key no query has seen
// yet scores 0.
//
// Immutable; safe to share across threads (per-sequence state lives in LayerPolicyState).
#ifndef KVSIDECAR_CACHE_POLICY_H2O_H_
#define KVSIDECAR_CACHE_POLICY_H2O_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"

namespace kvs {

class H2oPolicy final : public AttentionScoredPolicy {
 public:
  // Parameters from config.h2o.
  explicit H2oPolicy(const PolicyConfig& config) : H2oPolicy(config, config.h2o) {}
  // Explicit parameters (CAOTE's base takes its n_sink / n_recent from config.caote).
  H2oPolicy(const PolicyConfig& config, const H2oConfig& params);

  absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                    std::vector<float>& storage) const override;

 protected:
  // Every query's attention, but only its column sums are read (AccumulateColumnSums): the
  // backend may sum the rows as it computes them.
  AttentionRequirement ScorerAttention(Phase) const override {
    return {.needed = true, .trailing_queries = 0, .column_sums = true};
  }
  bool ScorerNeedsAccumulated() const override { return true; }
  // Records the step's query positions when normalising.
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override;
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
  // The device step scores by the accumulated attention (not when normalising by observers).
  std::optional<DeviceDecodeRule> DeviceScores() const override;

 private:
  const H2oConfig params_;
};

// Validates config.h2o ("policy.h2o.n_sink must be >= 0, got -1"). Zero = the default (0).
absl::Status ResolveH2oConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeH2oPolicy(const PolicyConfig& config);

// For each of the `count` key `positions`, the number of observed queries that can see it: the
// query positions in `runs` (LayerPolicyState::observed_queries) at or after the key's.
std::vector<int32_t> ObserverCounts(absl::Span<const int32_t> runs,
                                    absl::Span<const int32_t> positions);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_H2O_H_
