#include "service/convert_policy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"
#include "service/convert_fields.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

namespace {

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
    case KeyDiffMetric::kNegativeNorm:  // KNorm's, never a KeyDiff policy's (refused there)
      break;
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
  switch (params.defaults()) {
    case v1::SnapKvParams::DEFAULTS_UNSPECIFIED:
    case v1::SnapKvParams::DEFAULTS_PAPER:
      out.defaults = SnapKvDefaults::kPaper;
      break;
    case v1::SnapKvParams::DEFAULTS_KVPRESS:
      out.defaults = SnapKvDefaults::kKvpress;
      break;
    default:
      return UnknownEnum(prefix, absl::StrCat(field, ".defaults"),
                         static_cast<int>(params.defaults()));
  }
  return out;
}

void SnapKvToProto(const SnapKvConfig& config, v1::SnapKvParams* out) {
  out->set_window(config.window);
  out->set_kernel_size(config.kernel_size);
  out->set_pooling(PoolingToProto(config.pooling));
  if (config.defaults == SnapKvDefaults::kKvpress) {
    out->set_defaults(v1::SnapKvParams::DEFAULTS_KVPRESS);
  }
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
      out.h2o.normalize_by_queries = spec.h2o().normalize_by_queries();
      break;
    }
    case v1::PolicySpec::kTovaFieldNumber: {
      out.tova.all_heads = spec.tova().all_heads();
      out.tova.keep_last_token = spec.tova().keep_last_token();
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
      out.tova.keep_last_token = spec.caote().tova().keep_last_token();
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
      out->mutable_h2o()->set_normalize_by_queries(policy.h2o.normalize_by_queries);
      break;
    }
    case v1::PolicySpec::kTovaFieldNumber: {
      out->mutable_tova()->set_all_heads(policy.tova.all_heads);
      out->mutable_tova()->set_keep_last_token(policy.tova.keep_last_token);
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
      if (policy.caote.base == CaoteBase::kTova && policy.tova.keep_last_token) {
        out->mutable_caote()->mutable_tova()->set_keep_last_token(true);
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
        absl::StrCat("must be in [1, ", kMaxBudgetTokens, "], got ", budget.tokens_per_layer(),
                     budget.tokens_per_layer() == 0
                         ? " (a budget is the tokens each layer keeps; leave it unset for none)"
                         : ""));
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

}  // namespace kvs
