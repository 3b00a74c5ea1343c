#include "cache/policy/registry.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/policy/policy.h"

namespace kvs {

// The units, each defined beside its policy.
extern const PolicyUnit kStreamingLlmUnit;
extern const PolicyUnit kKeyDiffUnit;
extern const PolicyUnit kH2oUnit;
extern const PolicyUnit kTovaUnit;
extern const PolicyUnit kSnapKvUnit;
extern const PolicyUnit kCakeUnit;
extern const PolicyUnit kD2oUnit;
extern const PolicyUnit kCaoteUnit;
extern const PolicyUnit kOmniKvUnit;
extern const PolicyUnit kKnormUnit;

namespace {

// Tags of the policy section of a snapshot (EncodePolicyConfig).
enum PolicyTag : uint32_t {
  kTagName = 1,
  kTagParamsVersion = 2,
  kTagParams = 3,
  kTagAllocatorKind = 4,
  kTagAllocatorMinLayerTokens = 5,
  kTagAllocatorPyramidBeta = 6,
};

// Tags of the shared layer state encoding.
enum StateTag : uint32_t {
  kTagAccumulated = 1,
  kTagIndicator = 2,
  kTagThreshold = 3,
  kTagPreference = 4,
  kTagMeasured = 5,
  kTagFrozenBudget = 6,
  kTagFrozenFor = 7,
};

bool ReadVarint(std::string_view bytes, size_t& pos, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (pos >= bytes.size()) return false;
    const uint8_t byte = static_cast<uint8_t>(bytes[pos++]);
    *v |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80u) == 0) return true;
  }
  return false;
}

}  // namespace

void FieldWriter::Varint(uint64_t v) {
  while (v >= 0x80) {
    out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out_.push_back(static_cast<char>(v));
}

void FieldWriter::Raw(uint32_t tag, const void* data, size_t size) {
  Varint(tag);
  Varint(size);
  if (size > 0) out_.append(static_cast<const char*>(data), size);
}

bool FieldReader::Parse(std::string_view bytes) {
  fields_.clear();
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint64_t tag = 0, size = 0;
    if (!ReadVarint(bytes, pos, &tag) || tag > UINT32_MAX || !ReadVarint(bytes, pos, &size) ||
        size > bytes.size() - pos) {
      return false;
    }
    fields_.emplace_back(static_cast<uint32_t>(tag), bytes.substr(pos, size));
    pos += size;
  }
  return true;
}

const std::string_view* FieldReader::Find(uint32_t tag) const {
  // The last value of a tag wins, as in protobuf.
  for (auto it = fields_.rbegin(); it != fields_.rend(); ++it) {
    if (it->first == tag) return &it->second;
  }
  return nullptr;
}

bool FieldReader::has(uint32_t tag) const { return Find(tag) != nullptr; }

bool FieldReader::Fixed(uint32_t tag, void* v, size_t size) const {
  const std::string_view* field = Find(tag);
  if (field == nullptr) return true;
  if (field->size() != size) return false;
  std::memcpy(v, field->data(), size);
  return true;
}

bool FieldReader::Bool(uint32_t tag, bool* v) const {
  int32_t raw = *v ? 1 : 0;
  if (!I32(tag, &raw) || (raw != 0 && raw != 1)) return false;
  *v = raw != 0;
  return true;
}

bool FieldReader::Bytes(uint32_t tag, std::string* v) const {
  if (const std::string_view* field = Find(tag)) v->assign(field->data(), field->size());
  return true;
}

template <typename T>
bool FieldReader::Array(uint32_t tag, std::vector<T>* v) const {
  const std::string_view* field = Find(tag);
  if (field == nullptr) return true;
  if (field->size() % sizeof(T) != 0) return false;
  v->resize(field->size() / sizeof(T));
  if (!v->empty()) std::memcpy(v->data(), field->data(), field->size());
  return true;
}

template bool FieldReader::Array<int32_t>(uint32_t, std::vector<int32_t>*) const;
template bool FieldReader::Array<float>(uint32_t, std::vector<float>*) const;

std::vector<std::string_view> FieldReader::All(uint32_t tag) const {
  std::vector<std::string_view> out;
  for (const auto& [t, value] : fields_) {
    if (t == tag) out.push_back(value);
  }
  return out;
}

const std::vector<const PolicyUnit*>& PolicyUnits() {
  static const auto* const units = new std::vector<const PolicyUnit*>{
      &kStreamingLlmUnit, &kKeyDiffUnit, &kH2oUnit,   &kTovaUnit,   &kSnapKvUnit,
      &kCakeUnit,         &kD2oUnit,     &kCaoteUnit, &kOmniKvUnit, &kKnormUnit,
  };
  return *units;
}

const std::vector<std::string>& KnownPolicyNames() {
  static const auto* const names = [] {
    auto* list = new std::vector<std::string>;
    for (const PolicyUnit* unit : PolicyUnits()) list->push_back(unit->name);
    return list;
  }();
  return *names;
}

absl::StatusOr<const PolicyUnit*> FindPolicyUnit(absl::string_view name) {
  for (const PolicyUnit* unit : PolicyUnits()) {
    if (name == unit->name) return unit;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("policy.name \"", name,
                   "\" is unknown; known policies: ", absl::StrJoin(KnownPolicyNames(), ", ")));
}

PolicyCapabilities CapabilitiesOf(const PolicyConfig& config) {
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit(config.name);
  if (!unit.ok()) return PolicyCapabilities{};
  if ((*unit)->capabilities_for != nullptr) return (*unit)->capabilities_for(config);
  return (*unit)->capabilities;
}

AllocatorDefaults AllocatorDefaultsOf(const PolicyConfig& config) {
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit(config.name);
  AllocatorDefaults defaults;
  if (unit.ok() && (*unit)->allocator_defaults != nullptr) {
    defaults = (*unit)->allocator_defaults(config);
  }
  if (defaults.cake == nullptr) defaults.cake = &config.cake;
  if (defaults.window == 0) defaults.window = defaults.cake->window;
  return defaults;
}

void EncodeLayerState(const LayerPolicyState& state, FieldWriter& out) {
  if (!state.accumulated.empty()) out.F32s(kTagAccumulated, state.accumulated);
  if (!state.indicator.empty()) out.F32s(kTagIndicator, state.indicator);
  if (!state.threshold.empty()) out.F32s(kTagThreshold, state.threshold);
  out.F64(kTagPreference, state.preference);
  out.Bool(kTagMeasured, state.measured);
  out.I32(kTagFrozenBudget, state.frozen_budget);
  out.I32(kTagFrozenFor, state.frozen_for);
}

bool DecodeLayerState(const FieldReader& in, LayerPolicyState* state) {
  return in.F32s(kTagAccumulated, &state->accumulated) &&
         in.F32s(kTagIndicator, &state->indicator) && in.F32s(kTagThreshold, &state->threshold) &&
         in.F64(kTagPreference, &state->preference) && in.Bool(kTagMeasured, &state->measured) &&
         in.I32(kTagFrozenBudget, &state->frozen_budget) &&
         in.I32(kTagFrozenFor, &state->frozen_for);
}

absl::Status EncodePolicyConfig(const PolicyConfig& config, FieldWriter& out) {
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit(config.name);
  if (!unit.ok()) return unit.status();
  out.Bytes(kTagName, config.name);
  out.I32(kTagParamsVersion, static_cast<int32_t>((*unit)->params_version));
  if ((*unit)->encode_params != nullptr) {
    FieldWriter params;
    (*unit)->encode_params(config, params);
    out.Bytes(kTagParams, params.bytes());
  }
  out.Enum(kTagAllocatorKind, config.allocator.kind);
  out.I32(kTagAllocatorMinLayerTokens, config.allocator.min_layer_tokens);
  out.F32(kTagAllocatorPyramidBeta, config.allocator.pyramid_beta);
  return absl::OkStatus();
}

absl::Status DecodePolicyConfig(const FieldReader& in, PolicyConfig* config) {
  std::string name;
  int32_t version = 0;
  if (!in.Bytes(kTagName, &name) || !in.I32(kTagParamsVersion, &version)) {
    return absl::DataLossError("policy section is malformed");
  }
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit(name);
  if (!unit.ok()) {
    return absl::DataLossError(absl::StrCat("policy \"", name, "\" is unknown to this build"));
  }
  if (version < 1 || static_cast<uint32_t>(version) > (*unit)->params_version) {
    return absl::DataLossError(absl::StrCat("policy ", name, " parameters of version ", version,
                                            "; this build reads up to ", (*unit)->params_version));
  }
  *config = PolicyConfig{};
  config->name = name;
  std::string params;
  FieldReader params_in;
  if (!in.Bytes(kTagParams, &params) || !params_in.Parse(params) ||
      ((*unit)->decode_params != nullptr &&
       !(*unit)->decode_params(params_in, static_cast<uint32_t>(version), config))) {
    return absl::DataLossError(absl::StrCat("policy ", name, " parameters are malformed"));
  }
  if (!in.Enum(kTagAllocatorKind, &config->allocator.kind) ||
      !in.I32(kTagAllocatorMinLayerTokens, &config->allocator.min_layer_tokens) ||
      !in.F32(kTagAllocatorPyramidBeta, &config->allocator.pyramid_beta)) {
    return absl::DataLossError(absl::StrCat("policy ", name, " allocator is malformed"));
  }
  return absl::OkStatus();
}

}  // namespace kvs
