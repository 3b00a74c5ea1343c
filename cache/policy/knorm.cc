// KNorm (docs/policies/knorm.md; kvpress's KnormPress): score = -||k||_2 per kv head and slot,
// the lowest-norm keys kept. Keys only, no parameters, no protected positions. The whole policy
// is this one registry unit; the norms it ranks by are kept with the keys from their commit
// (Policy::keeps_key_norms).
#include <algorithm>
#include <functional>
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

  // The norms come with the keys: the finiteness check of every commit takes them as it reads
  // the rows (LayerPolicyState::key_norms), so a layer whose norms are all known is scored
  // without reading its keys.
  bool keeps_key_norms() const override { return true; }

 protected:
  Protection Protect(Phase, const LayerSelection&) const override { return {}; }
  // On the device the norms come from a pass over the keys (the KeyDiff job's anchorless
  // metric), the values the kept norms hold: the device keeps no norms of its own.
  std::optional<DeviceDecodeRule> DeviceScores() const override {
    return DeviceDecodeRule{.scores = DecodeScores::kRows,
                            .rows = DeviceDecodeRule::Rows::kKeyDiff,
                            .metric = KeyDiffMetric::kNegativeNorm};
  }

  // -||k||_2 per kv head and slot in fp32: from the norms kept with the keys where they are known,
  // else from the backend's KeyDiff job with the anchorless metric (one pass over the keys where
  // they live, every such layer of the call in one job list), whose norms are then kept.
  absl::Status Score(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override {
    std::vector<KeyDiffScoreJob> jobs;
    std::vector<size_t> read;  // the layers whose keys are read
    for (size_t i = 0; i < layers.size(); ++i) {
      const LayerSelection& layer = layers[i];
      const size_t slots = static_cast<size_t>(layer.keys.num_kv_heads) * layer.keys.count;
      const std::vector<float>& norms = layer.state->key_norms;
      if (norms.size() == slots) {
        // + 0.0f as the backend's pass: the -0 of a zero key is +0.
        for (size_t j = 0; j < slots; ++j) scores[i][j] = -norms[j] + 0.0f;
        continue;
      }
      KeyDiffScoreJob& job = jobs.emplace_back();
      job.keys = layer.keys;
      job.metric = KeyDiffMetric::kNegativeNorm;
      job.scores = scores[i];
      read.push_back(i);
    }
    if (jobs.empty()) return absl::OkStatus();
    KVS_RETURN_IF_ERROR(backend.KeyDiffScores(jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    for (size_t i : read) {
      const LayerSelection& layer = layers[i];
      const size_t slots = static_cast<size_t>(layer.keys.num_kv_heads) * layer.keys.count;
      std::vector<float>& norms = layer.state->key_norms;
      norms.resize(slots);
      std::transform(scores[i], scores[i] + slots, norms.begin(), std::negate<float>());
    }
    return absl::OkStatus();
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
