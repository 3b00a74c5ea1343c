// The policy registry: every policy the sidecar knows is one self-describing PolicyUnit (its name,
// what it can do, the validation and defaults of its parameters, how it is built, and the
// versioned encoding of its parameters and per-layer state in a snapshot). Code outside
// cache/policy/ asks the registry about a policy's capabilities instead of comparing names, so a
// new policy is one unit plus one line in the registry's list (registry.cc).
//
// The snapshot encoding is a tagged field stream (FieldWriter / FieldReader): each value carries
// its tag and length, a reader skips tags it does not know and leaves absent ones at their
// defaults, so a field added to a unit is read back as its default from an older snapshot, and an
// older build reading a newer snapshot ignores it.
//
// Threading: the registry is immutable after static initialisation; everything here is
// thread-safe.
#ifndef KVSIDECAR_CACHE_POLICY_REGISTRY_H_
#define KVSIDECAR_CACHE_POLICY_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/policy/policy_config.h"

namespace kvs {

class Policy;
struct LayerPolicyState;

// Appends tagged fields: varint tag, varint length, then the value's bytes (little-endian
// fixed-width scalars, packed arrays, nested field streams).
class FieldWriter {
 public:
  void I32(uint32_t tag, int32_t v) { Raw(tag, &v, sizeof v); }
  void I64(uint32_t tag, int64_t v) { Raw(tag, &v, sizeof v); }
  void U64(uint32_t tag, uint64_t v) { Raw(tag, &v, sizeof v); }
  void F32(uint32_t tag, float v) { Raw(tag, &v, sizeof v); }
  void F64(uint32_t tag, double v) { Raw(tag, &v, sizeof v); }
  void Bool(uint32_t tag, bool v) { I32(tag, v ? 1 : 0); }
  template <typename E>
  void Enum(uint32_t tag, E v) {
    I32(tag, static_cast<int32_t>(v));
  }
  void Bytes(uint32_t tag, std::string_view v) { Raw(tag, v.data(), v.size()); }
  void I32s(uint32_t tag, const std::vector<int32_t>& v) {
    Raw(tag, v.data(), v.size() * sizeof(int32_t));
  }
  void F32s(uint32_t tag, const std::vector<float>& v) {
    Raw(tag, v.data(), v.size() * sizeof(float));
  }
  const std::string& bytes() const { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  void Varint(uint64_t v);
  void Raw(uint32_t tag, const void* data, size_t size);
  std::string out_;
};

// Reads a field stream written by FieldWriter. Parse() fails on a malformed stream; the getters
// leave the value alone when the tag is absent and return false when it is present with a size
// that does not fit the type (a corrupt or incompatible snapshot).
class FieldReader {
 public:
  // False when `bytes` is not a well-formed field stream. `bytes` must outlive the reader.
  bool Parse(std::string_view bytes);
  bool has(uint32_t tag) const;
  bool I32(uint32_t tag, int32_t* v) const { return Fixed(tag, v, sizeof *v); }
  bool I64(uint32_t tag, int64_t* v) const { return Fixed(tag, v, sizeof *v); }
  bool U64(uint32_t tag, uint64_t* v) const { return Fixed(tag, v, sizeof *v); }
  bool F32(uint32_t tag, float* v) const { return Fixed(tag, v, sizeof *v); }
  bool F64(uint32_t tag, double* v) const { return Fixed(tag, v, sizeof *v); }
  bool Bool(uint32_t tag, bool* v) const;
  template <typename E>
  bool Enum(uint32_t tag, E* v) const {
    int32_t raw = static_cast<int32_t>(*v);
    if (!I32(tag, &raw)) return false;
    *v = static_cast<E>(raw);
    return true;
  }
  bool Bytes(uint32_t tag, std::string* v) const;
  bool I32s(uint32_t tag, std::vector<int32_t>* v) const { return Array(tag, v); }
  bool F32s(uint32_t tag, std::vector<float>* v) const { return Array(tag, v); }
  // Every value of a repeated tag, in order.
  std::vector<std::string_view> All(uint32_t tag) const;

 private:
  const std::string_view* Find(uint32_t tag) const;
  bool Fixed(uint32_t tag, void* v, size_t size) const;
  template <typename T>
  bool Array(uint32_t tag, std::vector<T>* v) const;
  std::vector<std::pair<uint32_t, std::string_view>> fields_;
};

// What a policy is and does, for the code that composes it (pool, sequence, service).
struct PolicyCapabilities {
  // Reads queries or attention to evict (the worker sends them with Commit / DecodeStep).
  bool needs_attention = false;
  // Evicts at decode steps as well as at prefill.
  bool decode_time = true;
  // Folds evicted tokens into kept ones (D2O).
  bool merges = false;
  // Never evicts: it selects tokens per decode step instead (OmniKV). Such a policy has no
  // budget, cannot stand in for another in Compress/Score, and cannot be a server default.
  bool never_evicts = false;
  // Scores keys alone, so its selection for a prompt does not depend on later queries: a
  // compressed prefix may be published and shared.
  bool query_agnostic = false;
  // Accepts an explicit layer allocator (policy.allocator.kind); false = its own split only.
  bool composes_with_allocators = true;
};

// Where a policy's layer allocator comes from when policy.allocator.kind is the default.
struct AllocatorDefaults {
  LayerAllocatorKind kind = LayerAllocatorKind::kUniform;
  const CakeConfig* cake = nullptr;  // CAKE's knobs for the CAKE allocator (null: config.cake)
  int32_t window = 0;                // window tokens the CAKE allocator adds (0: cake.window)
  // PyramidKV budgets by kvpress 0.5.5's rule (PyramidKVPress.get_layer_budget, with `window`)
  // instead of the paper's pyramid (SnapKV with kvpress's defaults).
  bool kvpress_pyramid = false;
};

// One policy.
struct PolicyUnit {
  const char* name = nullptr;
  PolicyCapabilities capabilities;
  // Validates `config`'s parameters (errors name the field, "policy.<name>.<field>") and fills
  // in defaults. Null = nothing to validate.
  absl::Status (*resolve)(PolicyConfig& config) = nullptr;
  // Builds the policy from a resolved configuration.
  std::unique_ptr<Policy> (*make)(const PolicyConfig& config) = nullptr;
  // Capabilities that depend on the parameters (CAOTE's base). Null = `capabilities`.
  PolicyCapabilities (*capabilities_for)(const PolicyConfig& config) = nullptr;
  // The layer allocator it composes with by default. Null = uniform.
  AllocatorDefaults (*allocator_defaults)(const PolicyConfig& config) = nullptr;
  // Snapshot encoding of its parameters; bump `params_version` when a field changes meaning
  // (adding a field needs no bump: absent tags read back as the default).
  uint32_t params_version = 1;
  void (*encode_params)(const PolicyConfig& config, FieldWriter& out) = nullptr;
  bool (*decode_params)(const FieldReader& in, uint32_t version, PolicyConfig* config) = nullptr;
  // Snapshot encoding of one layer's state; null = the shared LayerPolicyState encoding.
  void (*encode_state)(const LayerPolicyState& state, FieldWriter& out) = nullptr;
  bool (*decode_state)(const FieldReader& in, LayerPolicyState* state) = nullptr;
};

// The unit named `name`: INVALID_ARGUMENT naming "policy.name" and listing the known names.
absl::StatusOr<const PolicyUnit*> FindPolicyUnit(absl::string_view name);
// Every registered unit, in the order of the contract.
const std::vector<const PolicyUnit*>& PolicyUnits();
// The capabilities of a configuration (its unit's, refined by its parameters); the defaults of
// an evicting policy for a name the registry does not know.
PolicyCapabilities CapabilitiesOf(const PolicyConfig& config);
// The allocator `config` composes with when its allocator kind is the default.
AllocatorDefaults AllocatorDefaultsOf(const PolicyConfig& config);

// The shared encoding of a LayerPolicyState's persistent fields (the step fields are transient).
void EncodeLayerState(const LayerPolicyState& state, FieldWriter& out);
bool DecodeLayerState(const FieldReader& in, LayerPolicyState* state);
// A configuration's parameters and allocator through its unit: the name, the unit's
// params_version and its field stream. INVALID_ARGUMENT for an unknown name.
absl::Status EncodePolicyConfig(const PolicyConfig& config, FieldWriter& out);
// DATA_LOSS naming what is wrong.
absl::Status DecodePolicyConfig(const FieldReader& in, PolicyConfig* config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_REGISTRY_H_
