// Policy: decides, for each kv head of a layer, which `keep` of the layer's `count` tokens stay.
// A policy is a composition (ARCHITECTURE.md §4): a layer allocator (how many tokens each layer
// keeps), a scorer (a float per slot), and the shared selector (protected positions + per-head
// top-k through Backend::TopK, ties to the lower position). Merging evicted tokens into kept ones
// is a later step of the same pipeline. New policies derive from ScoredPolicy and supply only
// what differs: their scores and the positions they always keep.
//
// Policies are immutable after construction and hold no per-sequence state (state that later
// policies need lives with the sequence), so one instance may serve many calls concurrently.
// Every kernel runs through the Backend, so the CUDA backend slots in unchanged.
#ifndef KVSIDECAR_CACHE_POLICY_POLICY_H_
#define KVSIDECAR_CACHE_POLICY_POLICY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/policy_config.h"
#include "gpu/backend.h"

namespace kvs {

// One layer of one sequence as a policy reads it, and where its choice goes.
struct LayerSelection {
  int32_t layer = 0;
  PagedLayerView keys;                  // keys.count tokens in every kv head
  absl::Span<const int32_t> positions;  // [H][count] original positions, slot order
  int32_t keep = 0;                     // tokens each head keeps, 0 <= keep <= count
  absl::Span<int32_t> kept;             // out: [H][keep] kept slots, ascending per head
};

class Policy {
 public:
  virtual ~Policy() = default;
  Policy(const Policy&) = delete;
  Policy& operator=(const Policy&) = delete;

  // The resolved configuration (defaults filled in).
  const PolicyConfig& config() const { return config_; }

  // Layer allocator: tokens each layer keeps, given the sequence budget per layer (> 0) and the
  // current counts. Never more than a layer holds. The default gives every layer `budget`.
  virtual void AllocateLayers(int32_t budget, absl::Span<const int32_t> counts,
                              absl::Span<int32_t> keep) const;

  // Fills layers[i].kept for every layer, one batch of backend calls for all of them. INTERNAL
  // when a selection is malformed, or the backend's error.
  virtual absl::Status Select(Backend& backend, absl::Span<const LayerSelection> layers) const = 0;

 protected:
  explicit Policy(PolicyConfig config) : config_(std::move(config)) {}

 private:
  const PolicyConfig config_;
};

// The shared selector: scores [H][count] per layer, protected positions marked as forced, then
// Backend::TopK. Subclasses provide Score and Protect.
class ScoredPolicy : public Policy {
 public:
  absl::Status Select(Backend& backend, absl::Span<const LayerSelection> layers) const final;

 protected:
  using Policy::Policy;

  // Positions every head keeps whatever the scores: its `sinks` lowest and `recent` highest.
  struct Protection {
    int32_t sinks = 0;
    int32_t recent = 0;
  };
  // For a layer keeping `keep` tokens; sinks + recent must not exceed keep.
  virtual Protection Protect(int32_t keep) const = 0;

  // Writes scores[i][h * count + s] for every layer i that needs a choice (0 < keep < count);
  // higher is kept first. The buffers are zeroed on entry, so a position-only policy may leave
  // them alone.
  virtual absl::Status Score(Backend& backend, absl::Span<const LayerSelection> layers,
                             absl::Span<float* const> scores) const = 0;
};

// Validates `config` and fills in defaults (zero values mean the spec's default).
// INVALID_ARGUMENT naming the field ("policy.keydiff.recent_fraction ...", "policy.name ..."
// listing the known names) when it is malformed; UNIMPLEMENTED for policies of later builds.
absl::StatusOr<PolicyConfig> ResolvePolicyConfig(const PolicyConfig& config);

// A policy for `config` (validated as by ResolvePolicyConfig).
absl::StatusOr<std::unique_ptr<Policy>> MakePolicy(const PolicyConfig& config);

// Every policy name of the contract, implemented or not, in the order the proto lists them.
const std::vector<std::string>& KnownPolicyNames();

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_POLICY_H_
