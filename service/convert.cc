#include "service/convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

absl::Status Invalid(absl::string_view prefix, absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, field, " ", what));
}

std::string ContractPolicyNames() { return absl::StrJoin(KnownPolicyNames(), ", "); }

// The number of the PolicySpec.params field of the named policy (the field is named as the
// policy), or 0 for a policy without a params message.
int PolicyParamsFieldNumber(absl::string_view name) {
  const google::protobuf::FieldDescriptor* field =
      v1::PolicySpec::descriptor()->FindFieldByName(std::string(name));
  return field != nullptr && field->containing_oneof() != nullptr ? field->number() : 0;
}

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

// Unknown enum values (a newer client, or garbage) are refused naming the field.
absl::Status UnknownEnum(absl::string_view prefix, absl::string_view field, int value) {
  return Invalid(prefix, field, absl::StrCat("has unknown value ", value));
}

absl::StatusOr<Pooling> PoolingFromProto(v1::SnapKvParams::Pooling pooling,
                                         absl::string_view prefix, absl::string_view field) {
  switch (pooling) {
    case v1::SnapKvParams::POOLING_UNSPECIFIED:
    case v1::SnapKvParams::POOLING_AVG:
      return Pooling::kAvg;
    case v1::SnapKvParams::POOLING_MAX:
      return Pooling::kMax;
    default:
      break;
  }
  return UnknownEnum(prefix, field, static_cast<int>(pooling));
}

v1::SnapKvParams::Pooling PoolingToProto(Pooling pooling) {
  switch (pooling) {
    case Pooling::kAvg:
      return v1::SnapKvParams::POOLING_AVG;
    case Pooling::kMax:
      return v1::SnapKvParams::POOLING_MAX;
  }
  return v1::SnapKvParams::POOLING_UNSPECIFIED;
}

absl::StatusOr<SnapKvConfig> SnapKvFromProto(const v1::SnapKvParams& params,
                                             absl::string_view prefix, absl::string_view field) {
  SnapKvConfig out;
  out.window = params.window();
  out.kernel_size = params.kernel_size();
  KVS_ASSIGN_OR_RETURN(out.pooling,
                       PoolingFromProto(params.pooling(), prefix, absl::StrCat(field, ".pooling")));
  return out;
}

void SnapKvToProto(const SnapKvConfig& config, v1::SnapKvParams* out) {
  out->set_window(config.window);
  out->set_kernel_size(config.kernel_size);
  out->set_pooling(PoolingToProto(config.pooling));
}

CakeConfig CakeFromProto(const v1::CakeParams& params) {
  CakeConfig out;
  out.window = params.window();
  out.tau1 = params.tau1();
  out.tau2 = params.tau2();
  // Unset keeps the spec's default (200); an explicit 0 drops the variance term.
  if (params.has_gamma()) out.gamma = params.gamma();
  out.kernel_size = params.kernel_size();
  out.non_cascading = params.non_cascading();
  return out;
}

void CakeToProto(const CakeConfig& config, v1::CakeParams* out) {
  out->set_window(config.window);
  out->set_tau1(config.tau1);
  out->set_tau2(config.tau2);
  out->set_gamma(config.gamma);
  out->set_kernel_size(config.kernel_size);
  out->set_non_cascading(config.non_cascading);
}

absl::StatusOr<D2oConfig> D2oFromProto(const v1::D2oParams& params, absl::string_view prefix) {
  D2oConfig out;
  out.rho = params.rho();
  // Unset keeps the spec's defaults (recent_frac 0.25, n_sink 4); an explicit 0 is honoured.
  if (params.has_recent_frac()) out.recent_frac = params.recent_frac();
  if (params.has_n_sink()) out.n_sink = params.n_sink();
  out.beta = params.beta();
  switch (params.density_mode()) {
    case v1::D2oParams::DENSITY_MODE_UNSPECIFIED:
    case v1::D2oParams::DENSITY_MODE_HEADNORM:
      out.density_mode = D2oDensityMode::kHeadNorm;
      break;
    case v1::D2oParams::DENSITY_MODE_RAW:
      out.density_mode = D2oDensityMode::kRaw;
      break;
    default:
      return UnknownEnum(prefix, "d2o.density_mode", static_cast<int>(params.density_mode()));
  }
  out.min_ratio = params.min_ratio();
  out.max_ratio = params.max_ratio();
  out.full_cache_layers.assign(params.full_cache_layers().begin(),
                               params.full_cache_layers().end());
  switch (params.merge_weighting()) {
    case v1::D2oParams::MERGE_WEIGHTING_UNSPECIFIED:
    case v1::D2oParams::MERGE_WEIGHTING_PAPER:
      out.merge_weighting = D2oMergeWeighting::kPaper;
      break;
    case v1::D2oParams::MERGE_WEIGHTING_CODE:
      out.merge_weighting = D2oMergeWeighting::kCode;
      break;
    default:
      return UnknownEnum(prefix, "d2o.merge_weighting", static_cast<int>(params.merge_weighting()));
  }
  switch (params.threshold_scope()) {
    case v1::D2oParams::THRESHOLD_SCOPE_UNSPECIFIED:
    case v1::D2oParams::THRESHOLD_SCOPE_LAYER_HEAD:
      out.threshold_scope = D2oThresholdScope::kLayerHead;
      break;
    case v1::D2oParams::THRESHOLD_SCOPE_LAYER:
      out.threshold_scope = D2oThresholdScope::kLayer;
      break;
    default:
      return UnknownEnum(prefix, "d2o.threshold_scope", static_cast<int>(params.threshold_scope()));
  }
  return out;
}

void D2oToProto(const D2oConfig& config, v1::D2oParams* out) {
  out->set_rho(config.rho);
  out->set_recent_frac(config.recent_frac);
  out->set_n_sink(config.n_sink);
  out->set_beta(config.beta);
  out->set_density_mode(config.density_mode == D2oDensityMode::kRaw
                            ? v1::D2oParams::DENSITY_MODE_RAW
                            : v1::D2oParams::DENSITY_MODE_HEADNORM);
  out->set_min_ratio(config.min_ratio);
  out->set_max_ratio(config.max_ratio);
  out->mutable_full_cache_layers()->Add(config.full_cache_layers.begin(),
                                        config.full_cache_layers.end());
  out->set_merge_weighting(config.merge_weighting == D2oMergeWeighting::kCode
                               ? v1::D2oParams::MERGE_WEIGHTING_CODE
                               : v1::D2oParams::MERGE_WEIGHTING_PAPER);
  out->set_threshold_scope(config.threshold_scope == D2oThresholdScope::kLayer
                               ? v1::D2oParams::THRESHOLD_SCOPE_LAYER
                               : v1::D2oParams::THRESHOLD_SCOPE_LAYER_HEAD);
}

absl::StatusOr<CaoteConfig> CaoteFromProto(const v1::CaoteParams& params,
                                           absl::string_view prefix) {
  CaoteConfig out;
  switch (params.base()) {
    case v1::CaoteParams::BASE_UNSPECIFIED:
    case v1::CaoteParams::BASE_H2O:
      out.base = CaoteBase::kH2o;
      break;
    case v1::CaoteParams::BASE_TOVA:
      out.base = CaoteBase::kTova;
      break;
    case v1::CaoteParams::BASE_SNAPKV:
      out.base = CaoteBase::kSnapKv;
      break;
    case v1::CaoteParams::BASE_CAKE:
      out.base = CaoteBase::kCake;
      break;
    default:
      return UnknownEnum(prefix, "caote.base", static_cast<int>(params.base()));
  }
  switch (params.variant()) {
    case v1::CaoteParams::VARIANT_UNSPECIFIED:
    case v1::CaoteParams::VARIANT_EXACT:
      out.variant = CaoteVariant::kExact;
      break;
    case v1::CaoteParams::VARIANT_FAST:
      out.variant = CaoteVariant::kFast;
      break;
    case v1::CaoteParams::VARIANT_NONE:
      out.variant = CaoteVariant::kNone;
      break;
    default:
      return UnknownEnum(prefix, "caote.variant", static_cast<int>(params.variant()));
  }
  switch (params.gqa_reduce()) {
    case v1::CaoteParams::GQA_REDUCE_UNSPECIFIED:
    case v1::CaoteParams::GQA_REDUCE_MEAN:
      out.gqa_reduce = GqaReduce::kMean;
      break;
    case v1::CaoteParams::GQA_REDUCE_RSS:
      out.gqa_reduce = GqaReduce::kRss;
      break;
    default:
      return UnknownEnum(prefix, "caote.gqa_reduce", static_cast<int>(params.gqa_reduce()));
  }
  out.eps = params.eps();
  out.n_sink = params.n_sink();
  out.n_recent = params.n_recent();
  out.greedy = params.greedy();
  KVS_ASSIGN_OR_RETURN(out.snapkv, SnapKvFromProto(params.snapkv(), prefix, "caote.snapkv"));
  out.cake = CakeFromProto(params.cake());
  return out;
}

void CaoteToProto(const CaoteConfig& config, v1::CaoteParams* out) {
  switch (config.base) {
    case CaoteBase::kH2o:
      out->set_base(v1::CaoteParams::BASE_H2O);
      break;
    case CaoteBase::kTova:
      out->set_base(v1::CaoteParams::BASE_TOVA);
      break;
    case CaoteBase::kSnapKv:
      out->set_base(v1::CaoteParams::BASE_SNAPKV);
      break;
    case CaoteBase::kCake:
      out->set_base(v1::CaoteParams::BASE_CAKE);
      break;
  }
  switch (config.variant) {
    case CaoteVariant::kExact:
      out->set_variant(v1::CaoteParams::VARIANT_EXACT);
      break;
    case CaoteVariant::kFast:
      out->set_variant(v1::CaoteParams::VARIANT_FAST);
      break;
    case CaoteVariant::kNone:
      out->set_variant(v1::CaoteParams::VARIANT_NONE);
      break;
  }
  out->set_gqa_reduce(config.gqa_reduce == GqaReduce::kRss ? v1::CaoteParams::GQA_REDUCE_RSS
                                                           : v1::CaoteParams::GQA_REDUCE_MEAN);
  out->set_eps(config.eps);
  out->set_n_sink(config.n_sink);
  out->set_n_recent(config.n_recent);
  out->set_greedy(config.greedy);
  SnapKvToProto(config.snapkv, out->mutable_snapkv());
  CakeToProto(config.cake, out->mutable_cake());
}

absl::StatusOr<AllocatorConfig> AllocatorFromProto(const v1::LayerAllocator& allocator,
                                                   absl::string_view prefix) {
  AllocatorConfig out;
  switch (allocator.kind()) {
    case v1::LAYER_ALLOCATOR_UNSPECIFIED:
      out.kind = LayerAllocatorKind::kDefault;
      break;
    case v1::LAYER_ALLOCATOR_UNIFORM:
      out.kind = LayerAllocatorKind::kUniform;
      break;
    case v1::LAYER_ALLOCATOR_PYRAMIDKV:
      out.kind = LayerAllocatorKind::kPyramidKv;
      break;
    case v1::LAYER_ALLOCATOR_D2O:
      out.kind = LayerAllocatorKind::kD2o;
      break;
    case v1::LAYER_ALLOCATOR_CAKE:
      out.kind = LayerAllocatorKind::kCake;
      break;
    default:
      return UnknownEnum(prefix, "allocator.kind", static_cast<int>(allocator.kind()));
  }
  out.min_layer_tokens = allocator.min_layer_tokens();
  out.pyramid_beta = allocator.pyramid_beta();
  return out;
}

void AllocatorToProto(const AllocatorConfig& config, v1::LayerAllocator* out) {
  switch (config.kind) {
    case LayerAllocatorKind::kDefault:
      out->set_kind(v1::LAYER_ALLOCATOR_UNSPECIFIED);
      break;
    case LayerAllocatorKind::kUniform:
      out->set_kind(v1::LAYER_ALLOCATOR_UNIFORM);
      break;
    case LayerAllocatorKind::kPyramidKv:
      out->set_kind(v1::LAYER_ALLOCATOR_PYRAMIDKV);
      break;
    case LayerAllocatorKind::kD2o:
      out->set_kind(v1::LAYER_ALLOCATOR_D2O);
      break;
    case LayerAllocatorKind::kCake:
      out->set_kind(v1::LAYER_ALLOCATOR_CAKE);
      break;
  }
  out->set_min_layer_tokens(config.min_layer_tokens);
  out->set_pyramid_beta(config.pyramid_beta);
}

}  // namespace

bool IsImplementedPolicy(absl::string_view name) { return !name.empty(); }

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
                     " is set; name the policy (", ContractPolicyNames(), ")"));
  }
  const std::string& name = spec.name();
  if (!FindPolicyUnit(name).ok()) {
    return Invalid(
        prefix, "name",
        absl::StrCat("'", name, "' is not a known policy; known: ", ContractPolicyNames()));
  }
  // Parameters of another policy are a mistake (a spec edited from another one), not something to
  // ignore: they would silently fall back to the named policy's defaults.
  if (!params_field.empty() && params_field != name) {
    return Invalid(prefix, params_field,
                   absl::StrCat("is set but ", prefix, "name is '", name, "': set ", prefix, name,
                                " (or no parameters) for policy ", name));
  }
  if (!IsImplementedPolicy(name)) {
    return absl::UnimplementedError(absl::StrCat(
        prefix, "name \"", name,
        "\" is not implemented in this build: OmniKV needs Select and the host tier (issue 4)"));
  }

  // Values are copied as given: zero means the spec's default and the policy's Resolve fills it
  // in (and range-checks everything) when the pool builds the policy.
  PolicyConfig out;
  out.name = name;
  KVS_ASSIGN_OR_RETURN(out.allocator, AllocatorFromProto(spec.allocator(), prefix));
  // The named policy's params message (checked above to be the one set, if any; an unset one
  // reads as zeros) is the oneof field named as the policy (proto contract).
  switch (PolicyParamsFieldNumber(name)) {
    case v1::PolicySpec::kStreamingLlmFieldNumber: {
      // Unset keeps the paper's default; an explicit 0 is a pure sliding window.
      if (spec.streaming_llm().has_n_sink())
        out.streaming_llm.n_sink = spec.streaming_llm().n_sink();
      break;
    }
    case v1::PolicySpec::kKeydiffFieldNumber: {
      const v1::KeyDiffParams& params = spec.keydiff();
      KVS_ASSIGN_OR_RETURN(
          out.keydiff.anchor,
          AnchorFromProto(params.anchor(), absl::StrCat(prefix, "keydiff.anchor")));
      KVS_ASSIGN_OR_RETURN(
          out.keydiff.metric,
          MetricFromProto(params.metric(), absl::StrCat(prefix, "keydiff.metric")));
      out.keydiff.recent_fraction = params.recent_fraction();
      break;
    }
    case v1::PolicySpec::kH2OFieldNumber: {
      out.h2o.n_sink = spec.h2o().n_sink();
      out.h2o.n_recent = spec.h2o().n_recent();
      break;
    }
    case v1::PolicySpec::kTovaFieldNumber: {
      out.tova.all_heads = spec.tova().all_heads();
      break;
    }
    case v1::PolicySpec::kSnapkvFieldNumber: {
      KVS_ASSIGN_OR_RETURN(out.snapkv, SnapKvFromProto(spec.snapkv(), prefix, "snapkv"));
      break;
    }
    case v1::PolicySpec::kCakeFieldNumber: {
      out.cake = CakeFromProto(spec.cake());
      break;
    }
    case v1::PolicySpec::kD2OFieldNumber: {
      KVS_ASSIGN_OR_RETURN(out.d2o, D2oFromProto(spec.d2o(), prefix));
      break;
    }
    case v1::PolicySpec::kCaoteFieldNumber: {
      KVS_ASSIGN_OR_RETURN(out.caote, CaoteFromProto(spec.caote(), prefix));
      // The base's own parameters (CAOTE over TOVA), beside the wrapper's.
      if (spec.caote().has_tova() && out.caote.base != CaoteBase::kTova) {
        return Invalid(prefix, "caote.tova", "is set but caote.base is not BASE_TOVA");
      }
      out.tova.all_heads = spec.caote().tova().all_heads();
      break;
    }
    case v1::PolicySpec::kOmnikvFieldNumber: {
      const v1::OmniKvParams& params = spec.omnikv();
      out.omnikv.filter_layers.assign(params.filter_layers().begin(), params.filter_layers().end());
      out.omnikv.wait_layers = params.wait_layers();
      out.omnikv.selected_tokens = params.selected_tokens();
      out.omnikv.selected_fraction = params.selected_fraction();
      switch (params.selector()) {
        case v1::OmniKvParams::SELECTOR_UNSPECIFIED:
        case v1::OmniKvParams::SELECTOR_LAST:
          out.omnikv.selector = OmniKvSelector::kLast;
          break;
        case v1::OmniKvParams::SELECTOR_SOFTMAX_BEFORE_LAST:
          out.omnikv.selector = OmniKvSelector::kSoftmaxBeforeLast;
          break;
        case v1::OmniKvParams::SELECTOR_UNIFORM:
          out.omnikv.selector = OmniKvSelector::kUniform;
          break;
        case v1::OmniKvParams::SELECTOR_EXP:
          out.omnikv.selector = OmniKvSelector::kExp;
          break;
        default:
          return UnknownEnum(prefix, "omnikv.selector", static_cast<int>(params.selector()));
      }
      out.omnikv.window = params.window();
      out.omnikv.offload = params.offload();
      break;
    }
    default:  // a policy without parameters
      break;
  }
  return out;
}

absl::StatusOr<PolicyConfig> DefaultPolicyNamed(absl::string_view name, absl::string_view field) {
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must name a policy (", ContractPolicyNames(), ")"));
  }
  v1::PolicySpec spec;
  spec.set_name(std::string(name));
  absl::StatusOr<PolicyConfig> resolved = [&]() -> absl::StatusOr<PolicyConfig> {
    KVS_ASSIGN_OR_RETURN(std::optional<PolicyConfig> policy, PolicyFromProto(spec, ""));
    return ResolvePolicyConfig(*policy);  // a policy this build cannot run fails here
  }();
  if (!resolved.ok()) {
    return absl::Status(resolved.status().code(),
                        absl::StrCat(field, ": ", resolved.status().message()));
  }
  if (CapabilitiesOf(*resolved).never_evicts) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ": omnikv cannot be the default policy (it never evicts, so a default "
                     "budget cannot apply, and its filter layers depend on the model); "
                     "name it per sequence"));
  }
  return resolved;
}

void PolicyToProto(const PolicyConfig& policy, v1::PolicySpec* out) {
  out->set_name(policy.name);
  // The params field of the policy's oneof is the one named as the policy (proto contract).
  switch (PolicyParamsFieldNumber(policy.name)) {
    case v1::PolicySpec::kStreamingLlmFieldNumber: {
      out->mutable_streaming_llm()->set_n_sink(policy.streaming_llm.n_sink);
      break;
    }
    case v1::PolicySpec::kKeydiffFieldNumber: {
      v1::KeyDiffParams* params = out->mutable_keydiff();
      params->set_anchor(AnchorToProto(policy.keydiff.anchor));
      params->set_metric(MetricToProto(policy.keydiff.metric));
      params->set_recent_fraction(policy.keydiff.recent_fraction);
      break;
    }
    case v1::PolicySpec::kH2OFieldNumber: {
      out->mutable_h2o()->set_n_sink(policy.h2o.n_sink);
      out->mutable_h2o()->set_n_recent(policy.h2o.n_recent);
      break;
    }
    case v1::PolicySpec::kTovaFieldNumber: {
      out->mutable_tova()->set_all_heads(policy.tova.all_heads);
      break;
    }
    case v1::PolicySpec::kSnapkvFieldNumber: {
      SnapKvToProto(policy.snapkv, out->mutable_snapkv());
      break;
    }
    case v1::PolicySpec::kCakeFieldNumber: {
      CakeToProto(policy.cake, out->mutable_cake());
      break;
    }
    case v1::PolicySpec::kD2OFieldNumber: {
      D2oToProto(policy.d2o, out->mutable_d2o());
      break;
    }
    case v1::PolicySpec::kCaoteFieldNumber: {
      CaoteToProto(policy.caote, out->mutable_caote());
      // The TOVA base's parameters, when away from their defaults (an old client's spec reads
      // back unchanged).
      if (policy.caote.base == CaoteBase::kTova && policy.tova.all_heads) {
        out->mutable_caote()->mutable_tova()->set_all_heads(true);
      }
      break;
    }
    case v1::PolicySpec::kOmnikvFieldNumber: {
      v1::OmniKvParams* params = out->mutable_omnikv();
      for (int32_t layer : policy.omnikv.filter_layers) params->add_filter_layers(layer);
      params->set_wait_layers(policy.omnikv.wait_layers);
      params->set_selected_tokens(policy.omnikv.selected_tokens);
      params->set_selected_fraction(policy.omnikv.selected_fraction);
      switch (policy.omnikv.selector) {
        case OmniKvSelector::kLast:
          params->set_selector(v1::OmniKvParams::SELECTOR_LAST);
          break;
        case OmniKvSelector::kSoftmaxBeforeLast:
          params->set_selector(v1::OmniKvParams::SELECTOR_SOFTMAX_BEFORE_LAST);
          break;
        case OmniKvSelector::kUniform:
          params->set_selector(v1::OmniKvParams::SELECTOR_UNIFORM);
          break;
        case OmniKvSelector::kExp:
          params->set_selector(v1::OmniKvParams::SELECTOR_EXP);
          break;
      }
      params->set_window(policy.omnikv.window);
      params->set_offload(policy.omnikv.offload);
      break;
    }
    default:  // a policy without parameters
      break;
  }
  AllocatorToProto(policy.allocator, out->mutable_allocator());
}

absl::StatusOr<BudgetConfig> BudgetFromProto(const v1::Budget& budget, int32_t max_tokens_per_call,
                                             absl::string_view prefix, int32_t num_layers) {
  if (budget.tokens_per_layer() <= 0 || budget.tokens_per_layer() > kMaxBudgetTokens) {
    return Invalid(
        prefix, "tokens_per_layer",
        absl::StrCat("must be in [1, ", kMaxBudgetTokens, "], got ", budget.tokens_per_layer()));
  }
  const int n = budget.per_layer_tokens_size();
  if (n > 0 && num_layers >= 0 && n != num_layers) {
    return Invalid(
        prefix, "per_layer_tokens",
        absl::StrCat("has ", n, " entries; give one per layer (", num_layers, ") or none"));
  }
  for (int i = 0; i < n; ++i) {
    const int32_t tokens = budget.per_layer_tokens(i);
    if (tokens <= 0 || tokens > kMaxBudgetTokens) {
      return Invalid(prefix, absl::StrCat("per_layer_tokens[", i, "]"),
                     tokens <= 0
                         ? absl::StrCat("must be > 0, got ", tokens)
                         : absl::StrCat("must be at most ", kMaxBudgetTokens, ", got ", tokens));
    }
  }
  BudgetConfig out;
  out.per_layer_tokens.assign(budget.per_layer_tokens().begin(), budget.per_layer_tokens().end());
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
  out->mutable_per_layer_tokens()->Add(budget.per_layer_tokens.begin(),
                                       budget.per_layer_tokens.end());
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

// ---- Attention inputs ------------------------------------------------------------------------

absl::StatusOr<AttentionInput> AttentionFromProto(const v1::AttentionInputs& attention,
                                                  const ModelLayout& layout,
                                                  absl::string_view prefix) {
  AttentionInput out;
  KVS_RETURN_IF_ERROR(
      ValidateLayers(attention.layers(), layout.num_layers, absl::StrCat(prefix, "layers")));
  out.layers.assign(attention.layers().begin(), attention.layers().end());
  if (attention.num_queries() < 1) {
    return Invalid(
        prefix, "num_queries",
        absl::StrCat("must be >= 1 (the queries of this step), got ", attention.num_queries()));
  }
  out.num_queries = attention.num_queries();
  if (!attention.query_positions().empty() &&
      attention.query_positions_size() != attention.num_queries()) {
    return Invalid(
        prefix, "query_positions",
        absl::StrCat("has ", attention.query_positions_size(), " entries but num_queries is ",
                     attention.num_queries(), " (give one per query, or none)"));
  }
  out.query_positions.assign(attention.query_positions().begin(),
                             attention.query_positions().end());
  out.softmax_scale = attention.softmax_scale();

  DType dtype = layout.dtype;
  if (attention.queries_dtype() != v1::DTYPE_UNSPECIFIED) {
    KVS_ASSIGN_OR_RETURN(
        dtype, DTypeFromProto(attention.queries_dtype(), absl::StrCat(prefix, "queries_dtype")));
  }
  switch (attention.source_case()) {
    case v1::AttentionInputs::kStagingOffset:
      return absl::UnimplementedError(
          absl::StrCat(prefix,
                       "staging_offset: the staging area is reserved for the CUDA backend; send "
                       "inline_queries (or attention_scores)"));
    case v1::AttentionInputs::kInlineQueries: {
      const std::string& bytes = attention.inline_queries();
      const int64_t layers =
          out.layers.empty() ? layout.num_layers : static_cast<int64_t>(out.layers.size());
      const int64_t dtype_bytes = DTypeBytes(dtype);
      const std::optional<uint64_t> expected = CheckedProduct(
          {layers, layout.num_q_heads, out.num_queries, layout.head_dim, dtype_bytes});
      if (!expected || bytes.size() != static_cast<uint64_t>(*expected)) {
        return Invalid(
            prefix, "inline_queries",
            absl::StrCat("has ", bytes.size(), " bytes, expected ",
                         expected ? absl::StrCat(*expected) : std::string("more than 2^63"), " = ",
                         layers, " layers * ", layout.num_q_heads, " q heads * ", out.num_queries,
                         " queries * ", layout.head_dim, " head_dim * ", dtype_bytes, " bytes (",
                         std::string(DTypeName(dtype)), ")"));
      }
      out.queries.resize(static_cast<size_t>(*expected / dtype_bytes));
      if (dtype == DType::kFloat32) {
        std::memcpy(out.queries.data(), bytes.data(), bytes.size());  // little-endian host
      } else {
        for (size_t i = 0; i < out.queries.size(); ++i) {
          uint16_t bits;
          std::memcpy(&bits, bytes.data() + 2 * i, sizeof(bits));
          out.queries[i] = dtype == DType::kFloat16 ? Float16ToFloat(bits) : BFloat16ToFloat(bits);
        }
      }
      break;
    }
    default:
      break;
  }
  const std::string& scores = attention.attention_scores();
  if (scores.size() % sizeof(float) != 0) {
    return Invalid(prefix, "attention_scores",
                   absl::StrCat("has ", scores.size(),
                                " bytes, not a whole number of fp32 values (4 bytes each)"));
  }
  out.scores.resize(scores.size() / sizeof(float));
  if (!scores.empty()) std::memcpy(out.scores.data(), scores.data(), scores.size());
  return out;
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
        "staging_bytes: the query staging area is reserved for the CUDA backend (this build "
        "takes the queries inline); pass 0");
  }
  return out;
}

absl::StatusOr<SequenceParams> SequenceParamsFromProto(const v1::CreateSequenceRequest& request,
                                                       int32_t max_tokens_per_call,
                                                       int32_t num_layers) {
  KVS_RETURN_IF_ERROR(ValidateName(request.session_id(), "session_id", /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateName(request.sequence_id(), "sequence_id", /*required=*/false));
  SequenceParams out;
  out.sequence_id = request.sequence_id();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy, PolicyFromProto(request.policy(), "policy."));
  }
  if (request.has_budget()) {
    KVS_ASSIGN_OR_RETURN(
        out.budget, BudgetFromProto(request.budget(), max_tokens_per_call, "budget.", num_layers));
  }
  out.retain_evicted = request.retain_evicted();
  out.layer_windows.assign(request.layer_windows().begin(), request.layer_windows().end());
  out.from_prefix = request.from_prefix();
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
                                                       const ModelLayout& layout,
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
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(request.attention(), layout,
                                                           absl::StrCat(prefix, "attention.")));
  }
  return out;
}

absl::StatusOr<DecodeItem> DecodeItemFromProto(const v1::DecodeStepRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(item.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(item.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  DecodeItem out;
  out.session_id = item.session_id();
  out.sequence_id = item.sequence_id();
  if (item.has_attention()) {
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(item.attention(), layout,
                                                           absl::StrCat(prefix, "attention.")));
    if (out.attention.num_queries != 1) {
      return Invalid(prefix, "attention.num_queries",
                     absl::StrCat("must be 1 in a decode step (the new token's query), got ",
                                  out.attention.num_queries));
    }
  }
  if (item.reservation_id() != 0 && !item.inline_kv().empty()) {
    return Invalid(prefix, "inline_kv",
                   absl::StrCat("is set together with ", prefix,
                                "reservation_id; give the new token's K/V one way (or neither "
                                "if it is already committed)"));
  }
  out.reservation_id = item.reservation_id();
  if (!item.inline_kv().empty()) {
    const std::string field = absl::StrCat(prefix, "inline_kv");
    KVS_ASSIGN_OR_RETURN(uint64_t expected,
                         InlinePayloadBytes(layout, layout.num_layers, 1, field));
    if (item.inline_kv().size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has ", item.inline_kv().size(), " bytes, expected ", expected, " = ",
          layout.num_layers, " layers * 2 * ", layout.num_kv_heads, " kv heads * 1 token * ",
          layout.head_dim, " head_dim * ", layout.dtype_bytes(), " bytes"));
    }
    const auto* bytes = reinterpret_cast<const uint8_t*>(item.inline_kv().data());
    out.inline_kv.assign(bytes, bytes + item.inline_kv().size());
  }
  return out;
}

absl::StatusOr<ScoreParams> ScoreParamsFromProto(const v1::ScoreRequest& request,
                                                 const ModelLayout& layout) {
  KVS_RETURN_IF_ERROR(ValidateName(request.session_id(), "session_id", /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateName(request.sequence_id(), "sequence_id", /*required=*/true));
  if (request.budget_tokens() < 0 || request.budget_tokens() > kMaxBudgetTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_tokens must be in [0, ", kMaxBudgetTokens,
                     "] (0 = the sequence budget), got ", request.budget_tokens()));
  }
  KVS_RETURN_IF_ERROR(ValidateLayers(request.layers(), layout.num_layers, "layers"));
  ScoreParams out;
  out.budget_tokens = request.budget_tokens();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy, PolicyFromProto(request.policy(), "policy."));
  }
  if (request.has_attention()) {
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(request.attention(), layout));
  }
  out.layers.assign(request.layers().begin(), request.layers().end());
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
    case ArenaHandle::Kind::kMemfd:
      // fd_socket_path and fd_nonce are the Attach handler's: they belong to that one answer.
      out->set_kind(v1::ArenaHandle::KIND_MEMFD);
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
  out->set_floor_applied_layers(result.floor_applied_layers);
  out->set_bytes_copied(result.bytes_copied);
}

void DecodeResultToProto(const DecodeResult& result, v1::DecodeStepResponse::Item* out) {
  out->mutable_counts()->Add(result.counts.begin(), result.counts.end());
  out->mutable_evicted_positions()->Add(result.evicted_positions.begin(),
                                        result.evicted_positions.end());
  out->set_merged(result.merged);
  out->set_position(result.position);
}

void LayerScoresToProto(const LayerScores& scores, v1::ScoreResponse::LayerScores* out) {
  out->set_layer(scores.layer);
  out->mutable_scores()->Add(scores.scores.begin(), scores.scores.end());
  out->mutable_kept_slots()->Add(scores.kept_slots.begin(), scores.kept_slots.end());
  out->set_kept(scores.kept);
  out->mutable_positions()->Add(scores.positions.begin(), scores.positions.end());
}

absl::StatusOr<SelectItem> SelectItemFromProto(const v1::SelectRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(item.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(item.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  SelectItem out;
  out.session_id = item.session_id();
  out.sequence_id = item.sequence_id();
  out.step_id = item.step_id();
  if (!item.has_attention()) {
    return Invalid(prefix, "attention",
                   "is required: the filter layers' queries of this decode step");
  }
  KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(item.attention(), layout,
                                                         absl::StrCat(prefix, "attention.")));
  if (item.prompt_tokens() < 0) {
    return Invalid(prefix, "prompt_tokens",
                   absl::StrCat("must be >= 0, got ", item.prompt_tokens()));
  }
  out.prompt_tokens = item.prompt_tokens();
  return out;
}

void SelectResultToProto(const SelectResult& result, v1::SelectResponse::Item* out) {
  for (const LayerLayoutView& layer : result.sparse_layers) {
    LayerLayoutToProto(layer, out->add_sparse_layers());
  }
  if (!result.filters.empty()) {
    out->mutable_selected_positions()->Add(result.filters[0].positions.begin(),
                                           result.filters[0].positions.end());
  }
  for (const FilterSelection& filter : result.filters) {
    v1::FilterSelection* selection = out->add_filters();
    selection->set_filter_layer(filter.filter_layer);
    selection->mutable_positions()->Add(filter.positions.begin(), filter.positions.end());
    selection->mutable_sparse_layers()->Add(filter.sparse_layers.begin(),
                                            filter.sparse_layers.end());
  }
  out->set_prompt_tokens(result.prompt_tokens);
  out->set_budget_tokens(result.budget_tokens);
  out->set_host_bytes(result.host_bytes);
}

void LayerLayoutToProto(const LayerLayoutView& layer, v1::LayerLayout* out) {
  out->set_layer(layer.layer);
  out->set_count(layer.count);
  out->mutable_block_table()->Add(layer.block_table.begin(), layer.block_table.end());
  out->mutable_positions()->Add(layer.positions.begin(), layer.positions.end());
  out->set_budget(layer.budget);
  out->set_window(layer.window);
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
  out->set_sequences_spilled(info.sequences_spilled);
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
  out->set_host_bytes(info.host_bytes);
  out->set_disk_bytes(info.disk_bytes);
  out->set_tier(static_cast<v1::Tier>(info.tier));  // StorageTier values match v1::Tier
  out->set_created_unix_ms(UnixMillisOf(info.created));
  out->set_last_used_unix_ms(UnixMillisOf(info.last_used));
}

}  // namespace kvs
