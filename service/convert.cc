#include "service/convert.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

absl::Status Invalid(absl::string_view prefix, absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, field, " ", what));
}

std::string KnownPolicyNames() { return absl::StrJoin(kContractPolicyNames, ", "); }

// Name of the params field set in the oneof, or "" if none.
std::string SetParamsField(const v1::PolicySpec& spec) {
  const auto* oneof = spec.GetDescriptor()->FindOneofByName("params");
  if (oneof == nullptr) return "";
  const auto* field = spec.GetReflection()->GetOneofFieldDescriptor(spec, oneof);
  return field == nullptr ? "" : field->name();
}

absl::StatusOr<KeyDiffAnchor> AnchorFromProto(v1::KeyDiffParams::Anchor anchor,
                                              absl::string_view field) {
  switch (anchor) {
    case v1::KeyDiffParams::ANCHOR_UNSPECIFIED:
    case v1::KeyDiffParams::ANCHOR_MEAN_NORMALIZED:
      return KeyDiffAnchor::kMeanNormalized;
    case v1::KeyDiffParams::ANCHOR_MEAN_RAW:
      return KeyDiffAnchor::kMeanRaw;
    case v1::KeyDiffParams::ANCHOR_MEDIAN_NORMALIZED:
      return KeyDiffAnchor::kMedianNormalized;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", static_cast<int>(anchor)));
}

absl::StatusOr<KeyDiffMetric> MetricFromProto(v1::KeyDiffParams::Metric metric,
                                              absl::string_view field) {
  switch (metric) {
    case v1::KeyDiffParams::METRIC_UNSPECIFIED:
    case v1::KeyDiffParams::METRIC_COSINE:
      return KeyDiffMetric::kCosine;
    case v1::KeyDiffParams::METRIC_PAIRWISE:
      return KeyDiffMetric::kPairwise;
    case v1::KeyDiffParams::METRIC_DOT:
      return KeyDiffMetric::kDot;
    case v1::KeyDiffParams::METRIC_EUCLIDEAN:
      return KeyDiffMetric::kEuclidean;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", static_cast<int>(metric)));
}

v1::KeyDiffParams::Anchor AnchorToProto(KeyDiffAnchor anchor) {
  switch (anchor) {
    case KeyDiffAnchor::kMeanNormalized:
      return v1::KeyDiffParams::ANCHOR_MEAN_NORMALIZED;
    case KeyDiffAnchor::kMeanRaw:
      return v1::KeyDiffParams::ANCHOR_MEAN_RAW;
    case KeyDiffAnchor::kMedianNormalized:
      return v1::KeyDiffParams::ANCHOR_MEDIAN_NORMALIZED;
  }
  return v1::KeyDiffParams::ANCHOR_UNSPECIFIED;
}

v1::KeyDiffParams::Metric MetricToProto(KeyDiffMetric metric) {
  switch (metric) {
    case KeyDiffMetric::kCosine:
      return v1::KeyDiffParams::METRIC_COSINE;
    case KeyDiffMetric::kPairwise:
      return v1::KeyDiffParams::METRIC_PAIRWISE;
    case KeyDiffMetric::kDot:
      return v1::KeyDiffParams::METRIC_DOT;
    case KeyDiffMetric::kEuclidean:
      return v1::KeyDiffParams::METRIC_EUCLIDEAN;
  }
  return v1::KeyDiffParams::METRIC_UNSPECIFIED;
}

absl::Status ValidateAllocator(const v1::LayerAllocator& allocator, absl::string_view prefix) {
  switch (allocator.kind()) {
    case v1::LAYER_ALLOCATOR_UNSPECIFIED:
    case v1::LAYER_ALLOCATOR_UNIFORM:
      break;
    case v1::LAYER_ALLOCATOR_PYRAMIDKV:
    case v1::LAYER_ALLOCATOR_D2O:
    case v1::LAYER_ALLOCATOR_CAKE:
      return absl::UnimplementedError(
          absl::StrCat(prefix, "allocator.kind ", v1::LayerAllocatorKind_Name(allocator.kind()),
                       " is not implemented in this build (only the uniform allocator is)"));
    default:
      return Invalid(prefix, "allocator.kind",
                     absl::StrCat("has unknown value ", static_cast<int>(allocator.kind())));
  }
  if (allocator.min_layer_tokens() < 0) {
    return Invalid(prefix, "allocator.min_layer_tokens",
                   absl::StrCat("must be >= 0, got ", allocator.min_layer_tokens()));
  }
  // The uniform allocator gives every layer the same budget: a floor or a slope would be
  // silently ignored, so they are refused like the allocators that use them.
  if (allocator.min_layer_tokens() != 0) {
    return absl::UnimplementedError(absl::StrCat(
        prefix, "allocator.min_layer_tokens ", allocator.min_layer_tokens(),
        ": per-layer floors are not implemented in this build (only the uniform allocator is); "
        "pass 0"));
  }
  if (allocator.pyramid_beta() != 0.0f) {  // NaN too
    return absl::UnimplementedError(absl::StrCat(
        prefix, "allocator.pyramid_beta ", allocator.pyramid_beta(),
        ": the PyramidKV allocator is not implemented in this build (only the uniform allocator "
        "is); pass 0"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsImplementedPolicy(absl::string_view name) {
  return name == kPolicyStreamingLlm || name == kPolicyKeyDiff;
}

// ---- Layout ----------------------------------------------------------------------------------

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be set (DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT32)"));
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", static_cast<int>(dtype),
                   " (expected DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT32)"));
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& layout,
                                            absl::string_view prefix) {
  ModelLayout out;
  out.num_layers = layout.num_layers();
  out.num_kv_heads = layout.num_kv_heads();
  out.num_q_heads = layout.num_q_heads();
  out.head_dim = layout.head_dim();
  out.block_tokens = layout.block_tokens() == 0 ? kDefaultBlockTokens : layout.block_tokens();
  // Shape first, so the message names the first bad field in declaration order; the dtype is
  // checked before Validate() because Validate() needs a real dtype.
  const std::string prefix_str(prefix);
  ModelLayout shape_only = out;
  shape_only.dtype = DType::kFloat16;
  KVS_RETURN_IF_ERROR(shape_only.Validate(prefix_str.c_str()));
  KVS_ASSIGN_OR_RETURN(out.dtype, DTypeFromProto(layout.dtype(), absl::StrCat(prefix, "dtype")));
  KVS_RETURN_IF_ERROR(out.Validate(prefix_str.c_str()));
  return out;
}

void LayoutToProto(const ModelLayout& layout, v1::ModelLayout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_num_q_heads(layout.num_q_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(DTypeToProto(layout.dtype));
  out->set_block_tokens(layout.block_tokens);
}

// ---- Policies and budgets --------------------------------------------------------------------

absl::StatusOr<std::optional<PolicyConfig>> PolicyFromProto(const v1::PolicySpec& spec,
                                                            absl::string_view prefix) {
  const std::string params_field = SetParamsField(spec);
  if (spec.name().empty()) {
    if (params_field.empty() && !spec.has_allocator()) return std::nullopt;
    return Invalid(
        prefix, "name",
        absl::StrCat("is empty but ", prefix, params_field.empty() ? "allocator" : params_field,
                     " is set; name the policy (", KnownPolicyNames(), ")"));
  }
  const std::string& name = spec.name();
  bool known = false;
  for (absl::string_view candidate : kContractPolicyNames) known |= candidate == name;
  if (!known) {
    return Invalid(prefix, "name",
                   absl::StrCat("'", name, "' is not a known policy; known: ", KnownPolicyNames()));
  }
  if (!IsImplementedPolicy(name)) {
    return absl::UnimplementedError(absl::StrCat(
        "policy '", name, "' is not implemented in this build (implemented: ", kPolicyStreamingLlm,
        ", ", kPolicyKeyDiff, ")"));
  }
  KVS_RETURN_IF_ERROR(ValidateAllocator(spec.allocator(), prefix));

  PolicyConfig out;
  out.name = name;
  if (name == kPolicyStreamingLlm) {
    const int32_t n_sink = spec.streaming_llm().n_sink();
    if (n_sink < 0) {
      return Invalid(prefix, "streaming_llm.n_sink", absl::StrCat("must be >= 0, got ", n_sink));
    }
    if (n_sink > 0) out.streaming_llm.n_sink = n_sink;
  } else {  // keydiff
    const v1::KeyDiffParams& params = spec.keydiff();
    KVS_ASSIGN_OR_RETURN(out.keydiff.anchor,
                         AnchorFromProto(params.anchor(), absl::StrCat(prefix, "keydiff.anchor")));
    KVS_ASSIGN_OR_RETURN(out.keydiff.metric,
                         MetricFromProto(params.metric(), absl::StrCat(prefix, "keydiff.metric")));
    const float rho = params.recent_fraction();
    if (!(rho >= 0.0f && rho < 1.0f)) {  // also refuses NaN
      return Invalid(prefix, "keydiff.recent_fraction",
                     absl::StrCat("must be in [0, 1), got ", rho));
    }
    out.keydiff.recent_fraction = rho;
  }
  return out;
}

absl::StatusOr<PolicyConfig> DefaultPolicyNamed(absl::string_view name, absl::string_view field) {
  v1::PolicySpec spec;
  spec.set_name(std::string(name));
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must name a policy (", kPolicyStreamingLlm, " or ", kPolicyKeyDiff, ")"));
  }
  auto policy = PolicyFromProto(spec, "");
  if (!policy.ok()) {
    return absl::Status(policy.status().code(),
                        absl::StrCat(field, ": ", policy.status().message()));
  }
  return **policy;
}

void PolicyToProto(const PolicyConfig& policy, v1::PolicySpec* out) {
  out->set_name(policy.name);
  if (policy.name == kPolicyStreamingLlm) {
    out->mutable_streaming_llm()->set_n_sink(policy.streaming_llm.n_sink);
  } else if (policy.name == kPolicyKeyDiff) {
    v1::KeyDiffParams* params = out->mutable_keydiff();
    params->set_anchor(AnchorToProto(policy.keydiff.anchor));
    params->set_metric(MetricToProto(policy.keydiff.metric));
    params->set_recent_fraction(policy.keydiff.recent_fraction);
  }
  out->mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNIFORM);
}

absl::StatusOr<BudgetConfig> BudgetFromProto(const v1::Budget& budget, int32_t max_tokens_per_call,
                                             absl::string_view prefix) {
  if (budget.tokens_per_layer() <= 0 || budget.tokens_per_layer() > kMaxBudgetTokens) {
    return Invalid(
        prefix, "tokens_per_layer",
        absl::StrCat("must be in [1, ", kMaxBudgetTokens, "], got ", budget.tokens_per_layer()));
  }
  if (budget.per_layer_tokens_size() > 0) {
    return absl::UnimplementedError(absl::StrCat(
        prefix, "per_layer_tokens: per-layer budgets are not implemented in this build"));
  }
  BudgetConfig out;
  out.tokens_per_layer = budget.tokens_per_layer();
  out.strict = budget.strict();
  const int32_t block = budget.prefill_block_tokens();
  if (block < 0 || block > max_tokens_per_call) {
    return Invalid(prefix, "prefill_block_tokens",
                   absl::StrCat("must be in [0, ", max_tokens_per_call, "] (0 = default ",
                                kDefaultPrefillBlockTokens, "), got ", block));
  }
  out.prefill_block_tokens = block == 0 ? kDefaultPrefillBlockTokens : block;
  return out;
}

void BudgetToProto(const BudgetConfig& budget, v1::Budget* out) {
  out->set_tokens_per_layer(budget.tokens_per_layer);
  out->set_strict(budget.strict);
  out->set_prefill_block_tokens(budget.prefill_block_tokens);
}

// ---- Field checks ----------------------------------------------------------------------------

absl::Status ValidateName(absl::string_view value, absl::string_view field, bool required) {
  if (value.empty()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(field, " must not be empty"));
    return absl::OkStatus();
  }
  if (value.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value.size(), " bytes long; at most ", kMaxNameBytes));
  }
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " contains a control character (byte ", static_cast<int>(u), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateNumTokens(int32_t num_tokens, int32_t max_tokens, absl::string_view field) {
  if (num_tokens < 1 || num_tokens > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [1, ", max_tokens, "], got ", num_tokens));
  }
  return absl::OkStatus();
}

absl::Status ValidatePositions(absl::Span<const int32_t> positions, int32_t num_tokens,
                               absl::string_view field) {
  if (positions.empty()) return absl::OkStatus();
  if (positions.size() != static_cast<size_t>(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", positions.size(),
                                                   " entries but num_tokens is ", num_tokens,
                                                   " (give one per token, or none)"));
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] must be >= 0, got ", positions[i]));
    }
    if (i > 0 && positions[i] <= positions[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] (", positions[i],
                                                     ") must be greater than ", field, "[", i - 1,
                                                     "] (", positions[i - 1], ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayers(absl::Span<const int32_t> layers, int32_t num_layers,
                            absl::string_view field) {
  std::vector<int32_t> seen_at(static_cast<size_t>(std::max(num_layers, 0)), -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int32_t layer = layers[i];
    if (layer < 0 || layer >= num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] = ", layer, " is out of range [0, ", num_layers, ")"));
    }
    if (seen_at[layer] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] repeats layer ", layer,
                                                     " (already ", field, "[", seen_at[layer],
                                                     "])"));
    }
    seen_at[layer] = static_cast<int32_t>(i);
  }
  return absl::OkStatus();
}

std::vector<int32_t> LayersOrAll(absl::Span<const int32_t> layers, int32_t num_layers) {
  if (!layers.empty()) return std::vector<int32_t>(layers.begin(), layers.end());
  std::vector<int32_t> all(static_cast<size_t>(std::max(num_layers, 0)));
  for (int32_t i = 0; i < num_layers; ++i) all[i] = i;
  return all;
}

absl::StatusOr<uint64_t> InlinePayloadBytes(const ModelLayout& layout, int64_t num_layers,
                                            int64_t tokens, absl::string_view field) {
  auto bytes = CheckedProduct(
      {num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim, layout.dtype_bytes()});
  if (!bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": payload size overflows"));
  }
  return *bytes;
}

uint32_t ClampExportChunkBytes(uint32_t requested) {
  if (requested == 0) return kDefaultExportChunkBytes;
  return std::clamp(requested, kMinExportChunkBytes, kMaxExportChunkBytes);
}

// ---- Requests --------------------------------------------------------------------------------

absl::StatusOr<AttachParams> AttachFromProto(const v1::AttachRequest& request,
                                             const PoolOptions& options) {
  if (!request.has_layout()) return absl::InvalidArgumentError("layout is required");
  AttachParams out;
  KVS_ASSIGN_OR_RETURN(out.layout, LayoutFromProto(request.layout(), "layout."));
  KVS_RETURN_IF_ERROR(ValidateName(request.tenant(), "tenant", /*required=*/false));
  KVS_RETURN_IF_ERROR(ValidateName(request.worker_name(), "worker_name", /*required=*/false));
  if (!request.tenant().empty()) out.tenant = request.tenant();
  out.worker_name = request.worker_name();
  if (request.num_blocks() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be >= 0 (0 = server default), got ", request.num_blocks()));
  }
  out.num_blocks = request.num_blocks();
  if (request.lease_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must be >= 0 (0 = server default), got ", request.lease_ms()));
  }
  if (request.lease_ms() > 0) {
    const absl::Duration lease = absl::Milliseconds(request.lease_ms());
    if (lease < options.min_lease || lease > options.max_lease) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease_ms must be in [", absl::ToInt64Milliseconds(options.min_lease), ", ",
                       absl::ToInt64Milliseconds(options.max_lease),
                       "] (or 0 = server default), got ", request.lease_ms()));
    }
    out.lease = lease;
  }
  if (request.staging_bytes() != 0) {
    return absl::UnimplementedError(
        "staging_bytes: the query staging area serves attention-based policies, which this build "
        "does not implement; pass 0");
  }
  return out;
}

absl::StatusOr<SequenceParams> SequenceParamsFromProto(const v1::CreateSequenceRequest& request,
                                                       int32_t max_tokens_per_call) {
  KVS_RETURN_IF_ERROR(ValidateName(request.session_id(), "session_id", /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateName(request.sequence_id(), "sequence_id", /*required=*/false));
  SequenceParams out;
  out.sequence_id = request.sequence_id();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy, PolicyFromProto(request.policy(), "policy."));
  }
  if (request.has_budget()) {
    KVS_ASSIGN_OR_RETURN(out.budget,
                         BudgetFromProto(request.budget(), max_tokens_per_call, "budget."));
  }
  if (request.retain_evicted()) {
    return absl::UnimplementedError(
        "retain_evicted: keeping evicted tokens needs the host tier, which this build does not "
        "have yet");
  }
  out.retain_evicted = false;
  return out;
}

absl::Status ValidateReserveRequest(const v1::ReserveRequest& request, int32_t max_tokens_per_call,
                                    absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(request.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(request.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateNumTokens(request.num_tokens(), max_tokens_per_call,
                                        absl::StrCat(prefix, "num_tokens")));
  return ValidatePositions(request.positions(), request.num_tokens(),
                           absl::StrCat(prefix, "positions"));
}

namespace {

absl::Status ValidateReservationRef(absl::string_view session_id, absl::string_view sequence_id,
                                    uint64_t reservation_id, absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(session_id, absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(sequence_id, absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  if (reservation_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "reservation_id must be set (the id Reserve returned)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCommitRequest(const v1::CommitRequest& request, absl::string_view prefix) {
  return ValidateReservationRef(request.session_id(), request.sequence_id(),
                                request.reservation_id(), prefix);
}

absl::Status ValidateCancelReservationRequest(const v1::CancelReservationRequest& request) {
  return ValidateReservationRef(request.session_id(), request.sequence_id(),
                                request.reservation_id(), "");
}

absl::Status ValidateAppendHeader(const v1::AppendHeader& header, const ModelLayout& layout,
                                  int32_t max_tokens_per_call, absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(header.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(header.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateNumTokens(header.num_tokens(), max_tokens_per_call,
                                        absl::StrCat(prefix, "num_tokens")));
  KVS_RETURN_IF_ERROR(ValidatePositions(header.positions(), header.num_tokens(),
                                        absl::StrCat(prefix, "positions")));
  KVS_RETURN_IF_ERROR(
      ValidateLayers(header.layers(), layout.num_layers, absl::StrCat(prefix, "layers")));
  const int64_t num_layers = header.layers().empty() ? layout.num_layers : header.layers_size();
  const std::string field = absl::StrCat(prefix, "payload_bytes");
  KVS_ASSIGN_OR_RETURN(uint64_t expected,
                       InlinePayloadBytes(layout, num_layers, header.num_tokens(), field));
  if (header.payload_bytes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be ", expected, " (", num_layers, " layers * 2 * ", layout.num_kv_heads,
        " kv heads * ", header.num_tokens(), " tokens * ", layout.head_dim, " head_dim * ",
        layout.dtype_bytes(), " bytes), got ", header.payload_bytes()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CompressParams> CompressParamsFromProto(const v1::CompressRequest& request,
                                                       absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(request.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(request.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  if (request.budget_tokens() < 0 || request.budget_tokens() > kMaxBudgetTokens) {
    return Invalid(prefix, "budget_tokens",
                   absl::StrCat("must be in [0, ", kMaxBudgetTokens,
                                "] (0 = the sequence budget), got ", request.budget_tokens()));
  }
  CompressParams out;
  out.budget_tokens = request.budget_tokens();
  out.return_positions = request.return_positions();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy,
                         PolicyFromProto(request.policy(), absl::StrCat(prefix, "policy.")));
  }
  if (request.has_attention()) {
    return absl::UnimplementedError(
        absl::StrCat(prefix,
                     "attention: attention inputs feed attention-based policies, which this build "
                     "does not implement (streaming_llm and keydiff need none)"));
  }
  return out;
}

// ---- Responses -------------------------------------------------------------------------------

int64_t UnixMillisOf(absl::Time time) {
  if (time == absl::InfiniteFuture()) return std::numeric_limits<int64_t>::max();
  if (time == absl::InfinitePast()) return std::numeric_limits<int64_t>::min();
  return absl::ToUnixMillis(time);
}

void ArenaHandleToProto(const SessionView& session, v1::ArenaHandle* out) {
  const ArenaHandle& handle = session.arena;
  switch (handle.kind) {
    case ArenaHandle::Kind::kSharedMemoryFile:
      out->set_kind(v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
      out->set_shm_path(handle.shm_path);
      break;
    case ArenaHandle::Kind::kCudaIpc:
      out->set_kind(v1::ArenaHandle::KIND_CUDA_IPC);
      out->set_cuda_ipc_handle(handle.cuda_ipc_handle);
      out->set_cuda_device(handle.cuda_device);
      out->set_cuda_device_uuid(handle.cuda_device_uuid);
      break;
  }
  out->set_size_bytes(handle.size_bytes);
  out->set_generation(handle.generation);
  out->set_block_bytes(session.block_bytes);
  out->set_num_blocks(session.num_blocks);
  // No staging area in this build: it starts right after the last block and is empty.
  out->set_staging_offset(static_cast<uint64_t>(session.num_blocks) * session.block_bytes);
  out->set_staging_bytes(0);
}

void ReservationToProto(const Reservation& reservation, v1::ReserveResponse* out) {
  out->set_reservation_id(reservation.reservation_id);
  for (const LayerSlots& layer : reservation.layers) {
    v1::LayerSlots* slots = out->add_layers();
    slots->set_layer(layer.layer);
    slots->set_first_slot(layer.first_slot);
    slots->mutable_blocks()->Add(layer.blocks.begin(), layer.blocks.end());
  }
  out->mutable_positions()->Add(reservation.positions.begin(), reservation.positions.end());
  out->set_evicted_before(reservation.evicted_before);
}

void CommitResultToProto(const CommitResult& result, v1::CommitResponse* out) {
  out->mutable_counts()->Add(result.counts.begin(), result.counts.end());
  out->set_evicted(result.evicted);
}

void CompressResultToProto(const CompressResult& result, v1::CompressResponse* out) {
  for (const LayerCompressResult& layer : result.layers) {
    v1::CompressResponse::LayerResult* item = out->add_layers();
    item->set_layer(layer.layer);
    item->set_kept(layer.kept);
    item->set_evicted(layer.evicted);
    item->set_merged(layer.merged);
    item->mutable_positions()->Add(layer.positions.begin(), layer.positions.end());
  }
  out->set_blocks_freed(result.blocks_freed);
  out->set_floor_applied_layers(0);  // the uniform allocator never applies a floor
}

void LayerLayoutToProto(const LayerLayoutView& layer, v1::LayerLayout* out) {
  out->set_layer(layer.layer);
  out->set_count(layer.count);
  out->mutable_block_table()->Add(layer.block_table.begin(), layer.block_table.end());
  out->mutable_positions()->Add(layer.positions.begin(), layer.positions.end());
  out->set_budget(layer.budget);
}

void SequenceLayoutToProto(const SequenceLayout& layout, v1::GetLayoutResponse* out) {
  for (const LayerLayoutView& layer : layout.layers) LayerLayoutToProto(layer, out->add_layers());
  out->set_next_position(layout.next_position);
  out->set_tokens_appended(layout.tokens_appended);
  out->set_tier(v1::TIER_ARENA);
  PolicyToProto(layout.policy, out->mutable_policy());
  BudgetToProto(layout.budget, out->mutable_budget());
}

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out) {
  out->set_session_id(info.session_id);
  out->set_tenant(info.tenant);
  out->set_worker_name(info.worker_name);
  LayoutToProto(info.layout, out->mutable_layout());
  out->set_num_blocks(info.num_blocks);
  out->set_free_blocks(info.free_blocks);
  out->set_sequences(info.sequences);
  out->set_attached_unix_ms(UnixMillisOf(info.attached));
  out->set_last_heartbeat_unix_ms(UnixMillisOf(info.last_heartbeat));
  out->set_lease_expires_unix_ms(UnixMillisOf(info.lease_expires));
}

void SequenceInfoToProto(const SequenceInfo& info, v1::SequenceInfo* out) {
  out->set_session_id(info.session_id);
  out->set_sequence_id(info.sequence_id);
  out->set_tenant(info.tenant);
  PolicyToProto(info.policy, out->mutable_policy());
  BudgetToProto(info.budget, out->mutable_budget());
  out->mutable_tokens_per_layer()->Add(info.tokens_per_layer.begin(), info.tokens_per_layer.end());
  out->set_arena_bytes(info.arena_bytes);
  out->set_host_bytes(0);
  out->set_disk_bytes(0);
  out->set_tier(v1::TIER_ARENA);
  out->set_created_unix_ms(UnixMillisOf(info.created));
  out->set_last_used_unix_ms(UnixMillisOf(info.last_used));
}

}  // namespace kvs
