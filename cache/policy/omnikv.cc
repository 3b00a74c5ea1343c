#include "cache/policy/omnikv.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/registry.h"

namespace kvs {
namespace {

float NanToLowest(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

}  // namespace

absl::StatusOr<OmniKvPlan> PlanOmniKvLayers(const OmniKvConfig& config, int32_t num_layers,
                                            absl::Span<const int32_t> windows) {
  const std::vector<int32_t>& filters = config.filter_layers;
  if (filters.empty()) {
    return absl::InvalidArgumentError(
        "policy.omnikv.filter_layers is empty; the model has no default filter layers");
  }
  const auto windowed = [&](int32_t l) { return !windows.empty() && windows[l] > 0; };
  for (size_t i = 0; i < filters.size(); ++i) {
    if (filters[i] < 0 || filters[i] >= num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("policy.omnikv.filter_layers[", i,
                                                     "] = ", filters[i], " is outside the model's ",
                                                     num_layers, " layers"));
    }
    if (i > 0 && filters[i] <= filters[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.omnikv.filter_layers must be strictly ascending; filter_layers[", i,
                       "] = ", filters[i], " follows ", filters[i - 1]));
    }
    if (windowed(filters[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.omnikv.filter_layers[", i, "] = ", filters[i],
          " is a sliding-window layer (layer_windows[", filters[i], "] = ", windows[filters[i]],
          "); a filter layer must attend to the whole prompt to select from it"));
    }
  }
  OmniKvPlan plan;
  plan.roles.assign(num_layers, OmniKvRole::kPrefix);
  plan.feeding_filter.assign(num_layers, -1);
  plan.sparse.resize(filters.size());
  const int64_t wait = config.wait_layers;
  for (size_t i = 0; i < filters.size(); ++i) {
    const int32_t f = filters[i];
    const int32_t next = i + 1 < filters.size() ? filters[i + 1] : num_layers;
    const int32_t dense_end = static_cast<int32_t>(std::min<int64_t>(next, f + wait + 1));
    plan.roles[f] = OmniKvRole::kFilter;
    for (int32_t l = f + 1; l < dense_end; ++l) plan.roles[l] = OmniKvRole::kWait;
    for (int32_t l = dense_end; l < next; ++l) {
      if (windowed(l)) continue;
      plan.roles[l] = OmniKvRole::kSparse;
      plan.feeding_filter[l] = f;
      plan.sparse[i].push_back(l);
    }
  }
  for (int32_t l = 0; l < num_layers; ++l) {
    if (windowed(l)) plan.roles[l] = OmniKvRole::kWindowed;
  }
  return plan;
}

std::vector<int32_t> DefaultOmniKvFilterLayers(int32_t num_layers) {
  switch (num_layers) {
    case 32:
      return {2, 8, 18};  // Llama-3-8B (paper §5)
    case 48:
      return {6, 11, 30};  // Yi-9B
    case 80:
      return {4, 19, 41};  // Llama-3.1-70B
    default:
      return {};
  }
}

int32_t ResolveOmniKvBudget(const OmniKvConfig& config, int64_t prompt_tokens) {
  const int64_t n = std::max<int64_t>(0, prompt_tokens);
  int64_t k = config.selected_tokens > 0
                  ? config.selected_tokens
                  : FloorFraction(config.selected_fraction, n);
  k = std::clamp<int64_t>(k, 0, n);
  return static_cast<int32_t>(std::min<int64_t>(k, std::numeric_limits<int32_t>::max()));
}

void OmniKvCandidateScores(OmniKvSelector selector, absl::Span<const float> rows,
                           int32_t num_q_heads, int32_t window, int32_t n,
                           absl::Span<float> scores) {
  const float lowest = -std::numeric_limits<float>::infinity();
  if (selector == OmniKvSelector::kLast || selector == OmniKvSelector::kSoftmaxBeforeLast) {
    std::fill(scores.begin(), scores.begin() + n, lowest);
    for (int32_t h = 0; h < num_q_heads; ++h) {
      const float* row = rows.data() + static_cast<size_t>(h) * n;
      for (int32_t t = 0; t < n; ++t) scores[t] = std::max(scores[t], NanToLowest(row[t]));
    }
    return;
  }
  std::fill(scores.begin(), scores.begin() + n, 0.0f);
  std::vector<float> head_max(n);
  for (int32_t j = 0; j < window; ++j) {
    const float alpha =
        selector == OmniKvSelector::kExp ? std::ldexp(1.0f, j - (window - 1)) : 1.0f;
    std::fill(head_max.begin(), head_max.end(), lowest);
    for (int32_t h = 0; h < num_q_heads; ++h) {
      const float* row = rows.data() + (static_cast<size_t>(h) * window + j) * n;
      for (int32_t t = 0; t < n; ++t) head_max[t] = std::max(head_max[t], NanToLowest(row[t]));
    }
    for (int32_t t = 0; t < n; ++t) scores[t] += alpha * head_max[t];
  }
}

std::vector<double> OmniKvFilterAbility(absl::Span<const std::vector<float>> layers, int32_t k,
                                        int32_t n) {
  std::vector<double> ability;
  const int64_t num_layers = static_cast<int64_t>(layers.size());
  for (int64_t l1 = 0; l1 + n < num_layers; ++l1) {
    const std::vector<float>& a = layers[l1];
    std::vector<int32_t> order(a.size());
    for (size_t t = 0; t < order.size(); ++t) order[t] = static_cast<int32_t>(t);
    const size_t top = std::min<size_t>(std::max(k, 0), order.size());
    std::partial_sort(order.begin(), order.begin() + top, order.end(), [&a](int32_t x, int32_t y) {
      return NanToLowest(a[x]) > NanToLowest(a[y]) || (a[x] == a[y] && x < y);
    });
    double total = 0;
    for (int64_t l2 = l1; l2 < l1 + n; ++l2) {
      for (size_t i = 0; i < top; ++i) total += layers[l2][order[i]];
    }
    ability.push_back(n > 0 ? total / n : 0.0);
  }
  return ability;
}

OmniKvPolicy::OmniKvPolicy(const PolicyConfig& config)
    : Policy(config, MakeLayerAllocator(config)) {}

absl::Status OmniKvPolicy::Select(Backend&, Phase, absl::Span<const LayerSelection>) const {
  return absl::InternalError("the omnikv policy never evicts; a selection was asked of it");
}

absl::Status ResolveOmniKvConfig(PolicyConfig& config) {
  OmniKvConfig& omni = config.omnikv;
  for (size_t i = 0; i < omni.filter_layers.size(); ++i) {
    if (omni.filter_layers[i] < 0 ||
        (i > 0 && omni.filter_layers[i] <= omni.filter_layers[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.omnikv.filter_layers must be strictly ascending layer indices >= 0; "
                       "filter_layers[",
                       i, "] = ", omni.filter_layers[i]));
    }
  }
  if (omni.wait_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.omnikv.wait_layers must be >= 0, got ", omni.wait_layers));
  }
  if (omni.wait_layers == 0) omni.wait_layers = 1;  // zero values mean the spec's default
  if (omni.selected_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.omnikv.selected_tokens must be >= 0, got ", omni.selected_tokens));
  }
  if (omni.selected_fraction == 0.0f) omni.selected_fraction = 0.067f;
  if (!(omni.selected_fraction > 0.0f && omni.selected_fraction <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.omnikv.selected_fraction must be in (0, 1], got ", omni.selected_fraction));
  }
  switch (omni.selector) {
    case OmniKvSelector::kLast:
    case OmniKvSelector::kSoftmaxBeforeLast:
    case OmniKvSelector::kUniform:
    case OmniKvSelector::kExp:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("policy.omnikv.selector has unknown value ",
                                                     static_cast<int>(omni.selector)));
  }
  if (omni.window < 0 || omni.window > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.omnikv.window must be in [0, 1024], got ", omni.window));
  }
  if (omni.window == 0) omni.window = 16;
  if (config.allocator.kind != LayerAllocatorKind::kDefault &&
      config.allocator.kind != LayerAllocatorKind::kUniform) {
    return absl::InvalidArgumentError(
        "policy.allocator does not apply to omnikv, which never evicts; leave it unset");
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeOmniKvPolicy(const PolicyConfig& config) {
  return std::make_unique<OmniKvPolicy>(config);
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeOmniKvParams(const PolicyConfig& config, FieldWriter& out) {
  const OmniKvConfig& o = config.omnikv;
  out.I32s(1, o.filter_layers);
  out.I32(2, o.wait_layers);
  out.I32(3, o.selected_tokens);
  out.F32(4, o.selected_fraction);
  out.Enum(5, o.selector);
  out.I32(6, o.window);
  out.Bool(7, o.offload);
}
bool DecodeOmniKvParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  OmniKvConfig& o = config->omnikv;
  return in.I32s(1, &o.filter_layers) && in.I32(2, &o.wait_layers) &&
         in.I32(3, &o.selected_tokens) && in.F32(4, &o.selected_fraction) &&
         in.Enum(5, &o.selector) && in.I32(6, &o.window) && in.Bool(7, &o.offload);
}
}  // namespace

extern const PolicyUnit kOmniKvUnit;
const PolicyUnit kOmniKvUnit = {
    .name = kPolicyOmniKv,
    .capabilities = {.needs_attention = true,
                     .decode_time = true,
                     .never_evicts = true,
                     .composes_with_allocators = false},
    .resolve = &ResolveOmniKvConfig,
    .make = &MakeOmniKvPolicy,
    .encode_params = &EncodeOmniKvParams,
    .decode_params = &DecodeOmniKvParams,
};

}  // namespace kvs
