// KNorm (docs/policies/knorm.md; kvpress's KnormPress): score = -||k||_2 per kv head and slot,
// the lowest-norm keys kept. Keys only, no parameters, no protected positions. The whole policy
// is this one registry unit.
#include <memory>
#include <vector>

#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

class KnormPolicy final : public ScoredPolicy {
 public:
  explicit KnormPolicy(const PolicyConfig& config)
      : ScoredPolicy(config, MakeLayerAllocator(config)) {}

 protected:
  Protection Protect(Phase, const LayerSelection&) const override { return {}; }

  // The backend's KeyDiff job with the anchorless metric: -||k||_2 per kv head and slot in fp32,
  // one pass over the keys where they live (every layer of the call in one job list).
  absl::Status Score(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override {
    std::vector<KeyDiffScoreJob> jobs(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      jobs[i].keys = layers[i].keys;
      jobs[i].metric = KeyDiffMetric::kNegativeNorm;
      jobs[i].scores = scores[i];
    }
    KVS_RETURN_IF_ERROR(backend.KeyDiffScores(jobs, nullptr));
    return backend.Synchronize(nullptr);
  }
};

std::unique_ptr<Policy> MakeKnormPolicy(const PolicyConfig& config) {
  return std::make_unique<KnormPolicy>(config);
}

}  // namespace

extern const PolicyUnit kKnormUnit;
const PolicyUnit kKnormUnit = {
    .name = "knorm",
    .capabilities = {.needs_attention = false, .query_agnostic = true},
    .make = &MakeKnormPolicy,
};

}  // namespace kvs
