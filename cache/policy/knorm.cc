// KNorm (docs/policies/knorm.md; kvpress's KnormPress): score = -||k||_2 per kv head and slot,
// the lowest-norm keys kept. Keys only, no parameters, no protected positions. The whole policy
// is this one registry unit.
#include <cmath>
#include <cstdint>
#include <limits>
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

  // The keys reach the host through Backend::AttentionLogits with the identity as queries (one
  // query per dimension, one query head per kv head, scale 1, no causal mask): logit[h][d][s] is
  // exactly k_s[d] in fp32, on every backend, with no kernel of its own.
  absl::Status Score(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override {
    if (layers.empty()) return absl::OkStatus();
    const int32_t heads = layers[0].keys.num_kv_heads;
    const int32_t dim = layers[0].keys.head_dim;
    std::vector<float> identity(static_cast<size_t>(heads) * dim * dim, 0.0f);
    for (int32_t h = 0; h < heads; ++h) {
      for (int32_t d = 0; d < dim; ++d) identity[(int64_t{h} * dim + d) * dim + d] = 1.0f;
    }
    const std::vector<int32_t> query_positions(dim, std::numeric_limits<int32_t>::max());
    std::vector<std::vector<float>> logits(layers.size());
    std::vector<AttentionJob> jobs(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const PagedLayerView& keys = layers[i].keys;
      if (keys.num_kv_heads != heads || keys.head_dim != dim) {
        return absl::InternalError("knorm: layers of one call differ in shape");
      }
      logits[i].resize(static_cast<size_t>(heads) * dim * keys.count);
      AttentionJob& job = jobs[i];
      job.keys = keys;
      job.key_positions = layers[i].positions.data();
      job.queries = identity.data();
      job.query_positions = query_positions.data();
      job.num_q_heads = heads;
      job.num_queries = dim;
      job.scale = 1.0f;
      job.probs = logits[i].data();
    }
    KVS_RETURN_IF_ERROR(backend.AttentionLogits(jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    for (size_t i = 0; i < layers.size(); ++i) {
      const int32_t count = layers[i].keys.count;
      for (int32_t h = 0; h < heads; ++h) {
        const float* rows = logits[i].data() + int64_t{h} * dim * count;
        float* out = scores[i] + int64_t{h} * count;
        for (int32_t s = 0; s < count; ++s) {
          float sum = 0.0f;
          for (int32_t d = 0; d < dim; ++d)
            sum += rows[int64_t{d} * count + s] * rows[int64_t{d} * count + s];
          out[s] = -std::sqrt(sum);
        }
      }
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
