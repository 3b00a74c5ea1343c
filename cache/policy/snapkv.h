// SnapKV (Li et al.; policies/caote.md §4, keydiff.md §8): the attention of the step's last
// w' = min(window, step queries) queries, summed per query head; tokens below the window (all
// but the head's w' newest positions) are pooled along their POSITION order (stride 1, zero
// padding kernel/2, avg divides by the kernel; max optional), window tokens keep their unpooled
// sums and are always kept. The selection score of a kv head is the GQA mean of its group. In
// decode (one query) this is pooled TOVA with the newest token protected. Scores and the window
// are transient (LayerPolicyState::step_scores / step_protected_recent).
//
// Immutable; safe to share across threads.
#ifndef KVSIDECAR_CACHE_POLICY_SNAPKV_H_
#define KVSIDECAR_CACHE_POLICY_SNAPKV_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/policy/policy.h"

namespace kvs {

class FieldWriter;
class FieldReader;

inline constexpr int32_t kDefaultSnapKvWindow = 32;
inline constexpr int32_t kDefaultSnapKvKernel = 7;
// kvpress 0.5.5's SnapKVPress / PyramidKVPress defaults (SnapKvDefaults::kKvpress).
inline constexpr int32_t kKvpressSnapKvWindow = 64;
inline constexpr int32_t kKvpressSnapKvKernel = 5;

class SnapKvPolicy final : public AttentionScoredPolicy {
 public:
  explicit SnapKvPolicy(const PolicyConfig& config) : SnapKvPolicy(config, config.snapkv) {}
  // Explicit parameters (CAOTE's base reads config.caote.snapkv); resolved (window >= 1, odd
  // kernel >= 1).
  SnapKvPolicy(const PolicyConfig& config, const SnapKvConfig& params);

  absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                    std::vector<float>& storage) const override;

 protected:
  AttentionRequirement ScorerAttention(Phase) const override {
    return {.needed = true, .trailing_queries = params_.window, .column_sums = true};
  }
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override;
  Protection Protect(Phase phase, const LayerSelection& layer) const override;

 private:
  const SnapKvConfig params_;
};

// Validates `params` and fills its zero values with `default_window` / `default_kernel`, or with
// kvpress's 64 / 5 when params.defaults is kKvpress; `field` prefixes the messages
// ("policy.snapkv" -> "policy.snapkv.kernel_size must be odd and >= 1, got 4"). Shared with CAOTE
// (field "policy.caote.snapkv", kernel default 5).
absl::Status ResolveSnapKvParams(SnapKvConfig& params, const char* field, int32_t default_window,
                                 int32_t default_kernel);
// Validates config.snapkv (defaults: window 32, kernel 7, avg; kvpress's: window 64, kernel 5).
absl::Status ResolveSnapKvConfig(PolicyConfig& config);
std::unique_ptr<Policy> MakeSnapKvPolicy(const PolicyConfig& config);

// SnapKV's parameters as snapshot fields (SnapKV itself and CAOTE over SnapKV).
void EncodeSnapKvFields(const SnapKvConfig& params, FieldWriter& out);
bool DecodeSnapKvFields(const FieldReader& in, SnapKvConfig* params);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_SNAPKV_H_
