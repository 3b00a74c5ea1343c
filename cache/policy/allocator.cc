// Layer allocators (uniform, PyramidKV, D2O, CAKE) and the pure allocation math they share
// (cake.md §3 steps 2, 4, 5, 7; d2o.md §4.1 steps 2-3). Allocator objects are immutable; every
// per-sequence value (measured preferences, frozen budgets) lives in LayerPolicyState.
#include "cache/policy/allocator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"
#include "cache/policy/policy_config.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/window_stats_cpu.h"

namespace kvs {
namespace {

// Both roundings of CAKE (and D2O's floor) forgive this much floating error, so that a real
// budget of 2.9999999999 rounds like 3 (cake.md step 4).
constexpr double kRoundTolerance = 1e-9;

int32_t ClampToInt32(int64_t value) {
  return static_cast<int32_t>(std::clamp<int64_t>(value, std::numeric_limits<int32_t>::min(),
                                                  std::numeric_limits<int32_t>::max()));
}

// Equal shares of `total` capped per entry at caps[i] (water-filling with equal weights):
// x_i = min(caps[i], mu), sum x = min(total, sum caps).
std::vector<double> EqualFill(double total, absl::Span<const double> caps) {
  std::vector<double> x(caps.size(), 0.0);
  std::vector<bool> pinned(caps.size(), false);
  double remaining = total;
  size_t active = caps.size();
  while (active > 0 && remaining > 0.0) {
    const double mu = remaining / static_cast<double>(active);
    bool pinned_any = false;
    for (size_t i = 0; i < caps.size(); ++i) {
      if (!pinned[i] && caps[i] <= mu) {
        pinned[i] = true;
        x[i] = caps[i];
        remaining -= caps[i];
        --active;
        pinned_any = true;
      }
    }
    if (!pinned_any) {
      for (size_t i = 0; i < caps.size(); ++i) {
        if (!pinned[i]) x[i] = mu;
      }
      break;
    }
  }
  return x;
}

// Per-layer floor raise shared by every allocator: a layer never silently rounds below the
// floor unless it holds fewer tokens.
void ApplyFloor(const AllocatorConfig& config, const AllocationRequest& request,
                Allocation& allocation) {
  const int32_t floor = config.min_layer_tokens > 0
                            ? config.min_layer_tokens
                            : std::min(std::max(request.block_tokens, 0), request.budget);
  for (size_t l = 0; l < allocation.keep.size(); ++l) {
    const int32_t count = request.counts[l];
    const int32_t minimum = std::min(floor, count);
    if (allocation.keep[l] < minimum) {
      allocation.keep[l] = minimum;
      ++allocation.floor_applied_layers;
    }
    allocation.keep[l] = std::clamp(allocation.keep[l], 0, std::max(count, 0));
  }
}

absl::Status CheckRequest(const AllocationRequest& request, bool needs_states, const char* policy) {
  if (request.budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", policy, " allocation needs a positive budget, got ", request.budget));
  }
  if (needs_states && request.states.size() != request.counts.size()) {
    return absl::InternalError(absl::StrCat("policy ", policy, " allocation got ",
                                            request.states.size(), " layer states for ",
                                            request.counts.size(), " layers"));
  }
  for (size_t l = 0; l < request.counts.size(); ++l) {
    if (request.counts[l] < 0) {
      return absl::InternalError(absl::StrCat("policy ", policy, " allocation: layer ", l,
                                              " holds a negative count ", request.counts[l]));
    }
  }
  return absl::OkStatus();
}

// True when every layer carries a budget frozen for this sequence budget.
bool AllFrozenFor(const AllocationRequest& request) {
  if (request.states.empty() || request.states.size() != request.counts.size()) return false;
  for (const LayerPolicyState& state : request.states) {
    if (state.frozen_budget <= 0 || state.frozen_for != request.budget) return false;
  }
  return true;
}

Allocation KeepFrozen(const AllocationRequest& request) {
  Allocation allocation;
  allocation.keep.reserve(request.counts.size());
  for (size_t l = 0; l < request.counts.size(); ++l) {
    allocation.keep.push_back(std::min(request.states[l].frozen_budget, request.counts[l]));
  }
  return allocation;
}

// Records the decode budget of every layer; frozen_budget 0 means "not frozen", so a layer that
// keeps nothing freezes at 1 (it can only hold the token it is given next).
void Freeze(const AllocationRequest& request, absl::Span<const int32_t> budgets) {
  for (size_t l = 0; l < budgets.size(); ++l) {
    request.states[l].frozen_budget = std::max(budgets[l], 1);
    request.states[l].frozen_for = request.budget;
  }
}

class UniformAllocator final : public LayerAllocator {
 public:
  explicit UniformAllocator(AllocatorConfig config) : config_(config) {}
  AttentionRequirement attention(Phase) const override { return {}; }
  absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const override {
    if (absl::Status status = CheckRequest(request, false, "uniform"); !status.ok()) {
      return status;
    }
    Allocation allocation;
    for (int32_t count : request.counts) {
      allocation.keep.push_back(std::min(request.budget, count));
    }
    ApplyFloor(config_, request, allocation);
    return allocation;
  }

 private:
  const AllocatorConfig config_;
};

class PyramidAllocator final : public LayerAllocator {
 public:
  // kvpress_window > 0: kvpress's budget rule with that observation window.
  PyramidAllocator(AllocatorConfig config, int32_t kvpress_window)
      : config_(config), kvpress_window_(kvpress_window) {}
  AttentionRequirement attention(Phase) const override { return {}; }
  absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const override {
    if (absl::Status status = CheckRequest(request, false, "pyramidkv"); !status.ok()) {
      return status;
    }
    const int32_t num_layers = static_cast<int32_t>(request.counts.size());
    std::vector<int32_t> budgets;
    if (kvpress_window_ > 0) {
      // kvpress decides from the tokens the layer holds, so each layer gets its own count.
      for (int32_t l = 0; l < num_layers; ++l) {
        budgets.push_back(KvpressPyramidBudget(request.budget, request.counts[l], num_layers, l,
                                               config_.pyramid_beta, kvpress_window_));
      }
    } else {
      budgets = PyramidBudgets(request.budget, num_layers, config_.pyramid_beta);
    }
    Allocation allocation;
    for (size_t l = 0; l < request.counts.size(); ++l) {
      allocation.keep.push_back(std::min(budgets[l], request.counts[l]));
    }
    ApplyFloor(config_, request, allocation);
    return allocation;
  }

 private:
  const AllocatorConfig config_;
  const int32_t kvpress_window_;
};

// D2O (d2o.md §4.1): once a layer exceeds the budget, every layer's density from its
// accumulated column sums sets its ratio alpha_l; B_l = floor(alpha_l * P_l) with the layer's
// own rho = budget / P_l, frozen for decode.
class D2oAllocator final : public LayerAllocator {
 public:
  D2oAllocator(AllocatorConfig config, D2oConfig d2o) : config_(config), d2o_(std::move(d2o)) {}

  // The density reads the accumulated column sums only.
  AttentionRequirement attention(Phase phase) const override {
    if (phase == Phase::kPrefill) {
      return {.needed = true, .trailing_queries = 0, .column_sums = true};
    }
    return {};
  }
  bool needs_accumulated() const override { return true; }

  absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const override {
    if (absl::Status status = CheckRequest(request, true, "d2o"); !status.ok()) return status;
    if (AllFrozenFor(request)) {
      Allocation allocation = KeepFrozen(request);
      ApplyFloor(config_, request, allocation);
      return allocation;
    }
    const size_t num_layers = request.counts.size();
    // Nothing over the budget: nothing to compress yet, so no density is needed and nothing is
    // frozen (a chunked prompt may still be arriving, layer by layer).
    const bool over_budget = std::any_of(request.counts.begin(), request.counts.end(),
                                         [&](int32_t count) { return count > request.budget; });
    Allocation allocation;
    if (!over_budget) {
      allocation.keep.assign(request.counts.begin(), request.counts.end());
      ApplyFloor(config_, request, allocation);
      return allocation;
    }
    std::vector<double> density(num_layers, 0.0);
    for (size_t l = 0; l < num_layers; ++l) {
      const std::vector<float>& accumulated = request.states[l].accumulated;
      const int32_t count = request.counts[l];
      if (accumulated.empty() && count > 0) {
        return absl::FailedPreconditionError(
            "policy d2o allocation needs attention for every layer before the first "
            "compression: send attention (all prompt queries) with the commits of every layer");
      }
      if (count == 0) continue;
      if (accumulated.size() % static_cast<size_t>(count) != 0) {
        return absl::InternalError(absl::StrCat("policy d2o: layer ", l, " accumulates ",
                                                accumulated.size(), " values for ", count,
                                                " tokens"));
      }
      const int32_t rows = static_cast<int32_t>(accumulated.size() / count);
      density[l] = D2oLayerDensity(accumulated, rows, count, d2o_.density_mode);
      if (!std::isfinite(density[l])) {
        return absl::InvalidArgumentError(
            absl::StrCat("policy d2o: the accumulated attention of layer ", l, " is not finite"));
      }
    }
    // rho = 1 gives L * softmax(-F); each layer then scales by its own rho = budget / P_l
    // before the clamp (equal to d2o.md's single rho when every layer holds the prompt).
    const std::vector<double> weights =
        D2oLayerRatios(density, 1.0, 0.0, std::numeric_limits<double>::infinity());
    std::vector<bool> full(num_layers, false);
    for (int32_t layer : d2o_.full_cache_layers) {
      if (layer >= 0 && static_cast<size_t>(layer) < num_layers) full[layer] = true;
    }
    for (size_t l = 0; l < num_layers; ++l) {
      const int32_t count = request.counts[l];
      if (full[l] || count == 0) {
        allocation.keep.push_back(count);
        continue;
      }
      const double rho = static_cast<double>(request.budget) / count;
      const double alpha = std::clamp(weights[l] * rho, static_cast<double>(d2o_.min_ratio),
                                      static_cast<double>(d2o_.max_ratio));
      const double budget = std::floor(alpha * count + kRoundTolerance);
      allocation.keep.push_back(
          static_cast<int32_t>(std::clamp(budget, 0.0, static_cast<double>(count))));
    }
    ApplyFloor(config_, request, allocation);
    // full_cache_layers keep growing: they freeze at "unbounded" so that decode never trims them.
    std::vector<int32_t> frozen = allocation.keep;
    for (size_t l = 0; l < num_layers; ++l) {
      if (full[l]) frozen[l] = std::numeric_limits<int32_t>::max();
    }
    Freeze(request, frozen);
    return allocation;
  }

 private:
  const AllocatorConfig config_;
  const D2oConfig d2o_;
};

// CAKE (cake.md §3): preferences measured at prefill from the trailing W queries; a cascade of
// provisional (ceiling) splits over the measured layers, the final split (largest remainder)
// when every layer is measured, frozen for decode.
class CakeAllocator final : public LayerAllocator {
 public:
  CakeAllocator(AllocatorConfig config, CakeConfig cake, int32_t window)
      : config_(config), cake_(cake), window_(std::max(window, 0)) {}

  AttentionRequirement attention(Phase phase) const override {
    if (phase == Phase::kPrefill) return {.needed = true, .trailing_queries = window_};
    return {};
  }

  absl::Status Observe(Backend& backend, Phase phase, const LayerStep& layer) const override {
    return ObserveLayers(backend, phase, {&layer, 1});
  }

  // Every measured layer in one WindowEntropyShift call.
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override {
    if (phase != Phase::kPrefill) return absl::OkStatus();
    std::vector<WindowEntropyJob> jobs;
    std::vector<const LayerStep*> measured;
    std::vector<CakeMeasure> measures(layers.size());
    for (const LayerStep& layer : layers) {
      if (layer.state == nullptr || layer.num_queries <= 0 || layer.keys.count <= 0) continue;
      KVS_RETURN_IF_ERROR(CheckMeasured(layer));
      // The observation window: the trailing min(W, queries) rows of every head.
      const int32_t rows = std::min(std::max(window_, 1), layer.num_queries);
      const int32_t first = layer.num_queries - rows;
      CakeMeasure& measure = measures[measured.size()];
      measured.push_back(&layer);
      jobs.push_back(WindowEntropyJob{.probs = layer.probs.data(),
                                      .key_positions = layer.positions.data(),
                                      .num_q_heads = layer.num_q_heads,
                                      .num_kv_heads = layer.keys.num_kv_heads,
                                      .num_queries = layer.num_queries,
                                      .window = rows,
                                      .count = layer.keys.count,
                                      .first_query_position = layer.query_positions[first],
                                      .entropy = &measure.entropy,
                                      .shift = &measure.shift});
    }
    if (jobs.empty()) return absl::OkStatus();
    KVS_RETURN_IF_ERROR(backend.WindowEntropyShift(jobs, nullptr));
    for (size_t i = 0; i < measured.size(); ++i) {
      if (!std::isfinite(measures[i].entropy) || !std::isfinite(measures[i].shift)) {
        return absl::InvalidArgumentError(absl::StrCat("attention: the probabilities of layer ",
                                                       measured[i]->layer, " are not finite"));
      }
    }
    for (size_t i = 0; i < measured.size(); ++i) {
      measured[i]->state->preference = CakeLogPreference(measures[i], cake_.tau1, cake_.tau2);
      measured[i]->state->measured = true;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const override {
    if (absl::Status status = CheckRequest(request, true, "cake"); !status.ok()) return status;
    if (AllFrozenFor(request)) {
      Allocation allocation = KeepFrozen(request);
      ApplyFloor(config_, request, allocation);
      return allocation;
    }
    const size_t num_layers = request.counts.size();
    if (request.phase == Phase::kDecode) {
      // Decode before any prefill allocation (the prompt never went over the budget, or came
      // without window queries): the uniform C, frozen, as for a prompt that fit (cake.md step 7).
      Allocation allocation;
      for (size_t l = 0; l < num_layers; ++l) {
        allocation.keep.push_back(std::min(request.budget, request.counts[l]));
      }
      ApplyFloor(config_, request, allocation);
      Freeze(request, std::vector<int32_t>(num_layers, request.budget));
      return allocation;
    }
    std::vector<size_t> measured;
    for (size_t l = 0; l < num_layers; ++l) {
      if (request.states[l].measured) measured.push_back(l);
    }
    const bool final = !measured.empty() && measured.size() == num_layers;
    Allocation allocation;
    // Unmeasured layers keep everything: nothing is evicted before its preference is known.
    allocation.keep.assign(request.counts.begin(), request.counts.end());
    if (measured.empty() || (cake_.non_cascading && !final)) {
      ApplyFloor(config_, request, allocation);
      return allocation;
    }
    const int64_t total =
        std::max<int64_t>(0, int64_t{request.budget} - window_) * static_cast<int64_t>(num_layers);
    std::vector<double> log_preferences;
    std::vector<int32_t> caps;
    int64_t sum_caps = 0;
    for (size_t l : measured) {
      log_preferences.push_back(request.states[l].preference);
      caps.push_back(std::max(0, request.counts[l] - window_));
      sum_caps += caps.back();
    }
    const bool prompt_fit = final && total >= sum_caps;
    if (prompt_fit) {
      // cake.md step 7: no prefill eviction; the uniform C (= budget) is frozen so the cache
      // grows to it before decode eviction starts.
      for (size_t l = 0; l < num_layers; ++l) {
        allocation.keep[l] = std::min(request.budget, request.counts[l]);
      }
      ApplyFloor(config_, request, allocation);
      Freeze(request, std::vector<int32_t>(num_layers, request.budget));
      return allocation;
    }
    const std::vector<int32_t> budgets = CakeAllocate(log_preferences, total, caps, 0, final);
    for (size_t i = 0; i < measured.size(); ++i) {
      const size_t l = measured[i];
      allocation.keep[l] =
          ClampToInt32(std::min<int64_t>(int64_t{budgets[i]} + window_, request.counts[l]));
    }
    ApplyFloor(config_, request, allocation);
    if (final) Freeze(request, allocation.keep);
    return allocation;
  }

 private:
  // The shape of one layer's attention, as the measure reads it.
  static absl::Status CheckMeasured(const LayerStep& layer) {
    const int32_t count = layer.keys.count;
    const int32_t num_kv_heads = layer.keys.num_kv_heads;
    const int32_t num_q_heads = layer.num_q_heads;
    if (num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention: layer ", layer.layer, " has ", num_q_heads,
                       " query heads, not a positive multiple of its ", num_kv_heads, " kv heads"));
    }
    const int64_t expected = int64_t{num_q_heads} * layer.num_queries * count;
    if (static_cast<int64_t>(layer.probs.size()) != expected ||
        static_cast<int64_t>(layer.query_positions.size()) != layer.num_queries ||
        static_cast<int64_t>(layer.positions.size()) != int64_t{num_kv_heads} * count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention: layer ", layer.layer, " carries ", layer.probs.size(), " probabilities for ",
          num_q_heads, " query heads x ", layer.num_queries, " queries x ", count, " tokens"));
    }
    return absl::OkStatus();
  }

  const AllocatorConfig config_;
  const CakeConfig cake_;
  const int32_t window_;
};

}  // namespace

std::unique_ptr<LayerAllocator> MakeLayerAllocator(const PolicyConfig& config) {
  // The policy's unit says which allocator it composes with by default and which CAKE knobs and
  // window the CAKE allocator uses with it (CAOTE over CAKE carries them in caote.cake).
  const AllocatorDefaults defaults = AllocatorDefaultsOf(config);
  LayerAllocatorKind kind = config.allocator.kind;
  if (kind == LayerAllocatorKind::kDefault) kind = defaults.kind;
  switch (kind) {
    case LayerAllocatorKind::kPyramidKv:
      return std::make_unique<PyramidAllocator>(
          config.allocator, defaults.kvpress_pyramid ? std::max(defaults.window, 1) : 0);
    case LayerAllocatorKind::kD2o:
      return std::make_unique<D2oAllocator>(config.allocator, config.d2o);
    case LayerAllocatorKind::kCake:
      return std::make_unique<CakeAllocator>(config.allocator, *defaults.cake, defaults.window);
    case LayerAllocatorKind::kDefault:
    case LayerAllocatorKind::kUniform:
      break;
  }
  return std::make_unique<UniformAllocator>(config.allocator);
}

int32_t CakeWindowFor(const PolicyConfig& config) { return AllocatorDefaultsOf(config).window; }

std::vector<int32_t> PyramidBudgets(int32_t budget, int32_t num_layers, float beta) {
  if (num_layers <= 0) return {};
  if (num_layers == 1) return {budget};
  // beta < 1 would put the top layer above the budget; PyramidKV's beta is >= 1.
  const double safe_beta = std::isfinite(beta) && beta >= 1.0f ? beta : 1.0;
  const int64_t min_budget =
      std::clamp<int64_t>(static_cast<int64_t>(std::floor(budget / safe_beta)), 0, budget);
  const int64_t max_budget = 2 * int64_t{budget} - min_budget;
  const int64_t step = (max_budget - min_budget) / (num_layers - 1);
  std::vector<int32_t> budgets(num_layers);
  for (int32_t l = 0; l < num_layers; ++l) {
    budgets[l] = ClampToInt32(max_budget - int64_t{l} * step);
  }
  return budgets;
}

int32_t KvpressPyramidBudget(int32_t budget, int32_t count, int32_t num_layers, int32_t layer,
                             float beta, int32_t window) {
  const double b = budget;
  const double w = window;
  const double t = count;
  double min_num = b / std::max<double>(beta, 1.0);
  double max_num = 2.0 * b - min_num;
  if (max_num >= t - w) {
    max_num = t - w;
    min_num = 2.0 * b - max_num;
  }
  // std::nearbyint in the default rounding mode halves to even, as Python's round().
  if (!(t >= max_num && max_num >= min_num && min_num >= w)) {
    return ClampToInt32(std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(b))));
  }
  const double steps = num_layers > 1 ? (max_num - min_num) / (num_layers - 1) : 0.0;
  return ClampToInt32(static_cast<int64_t>(std::nearbyint(max_num - layer * steps)));
}

double D2oLayerDensity(absl::Span<const float> column_sums, int32_t num_q_heads, int32_t count,
                       D2oDensityMode mode) {
  if (num_q_heads <= 0 || count <= 0 ||
      column_sums.size() < static_cast<size_t>(num_q_heads) * count) {
    return 0.0;
  }
  std::vector<double> variance(num_q_heads, 0.0);
  for (int32_t h = 0; h < num_q_heads; ++h) {
    if (count < 2) continue;  // the unbiased variance of one value: 0 (no spread)
    const float* row = column_sums.data() + static_cast<int64_t>(h) * count;
    double mean = 0.0;
    for (int32_t j = 0; j < count; ++j) mean += row[j];
    mean /= count;
    double squares = 0.0;
    for (int32_t j = 0; j < count; ++j) {
      const double d = row[j] - mean;
      squares += d * d;
    }
    variance[h] = squares / (count - 1);
  }
  double density = 0.0;
  if (mode == D2oDensityMode::kRaw) {
    for (double v : variance) density += v;
    return density / num_q_heads;
  }
  const auto [lo, hi] = std::minmax_element(variance.begin(), variance.end());
  const double low = *lo;
  const double range = *hi - low + 1e-6;
  for (double v : variance) density += (v - low) / range;
  return density / num_q_heads;
}

std::vector<double> D2oLayerRatios(absl::Span<const double> density, double rho, double min_ratio,
                                   double max_ratio) {
  const size_t num_layers = density.size();
  std::vector<double> ratios(num_layers, 0.0);
  if (num_layers == 0) return ratios;
  // softmax(-F) with the smallest F subtracted first: exp never overflows, and a huge F (raw
  // mode) underflows to 0 instead of turning the sum into inf/inf. NaN counts as +inf.
  double smallest = std::numeric_limits<double>::infinity();
  for (double f : density) {
    if (!std::isnan(f)) smallest = std::min(smallest, f);
  }
  std::vector<double> weights(num_layers, 1.0);
  if (std::isfinite(smallest)) {
    for (size_t l = 0; l < num_layers; ++l) {
      weights[l] = std::isnan(density[l]) ? 0.0 : std::exp(-(density[l] - smallest));
    }
  } else if (smallest == -std::numeric_limits<double>::infinity()) {
    for (size_t l = 0; l < num_layers; ++l) weights[l] = density[l] == smallest ? 1.0 : 0.0;
  }
  double sum = 0.0;
  for (double w : weights) sum += w;
  for (size_t l = 0; l < num_layers; ++l) {
    const double alpha = static_cast<double>(num_layers) * rho * weights[l] / sum;
    ratios[l] = std::min(std::max(alpha, min_ratio), max_ratio);
  }
  return ratios;
}

CakeMeasure CakeLayerMeasure(absl::Span<const float> probs, int32_t num_q_heads,
                             int32_t num_queries, int32_t count, int32_t num_kv_heads,
                             absl::Span<const int32_t> key_positions,
                             int32_t first_query_position) {
  CakeMeasure measure;
  if (num_q_heads <= 0 || num_queries <= 0 || count <= 0 || num_kv_heads <= 0 ||
      num_q_heads % num_kv_heads != 0 ||
      probs.size() < static_cast<size_t>(num_q_heads) * num_queries * count ||
      key_positions.size() < static_cast<size_t>(num_kv_heads) * count) {
    return measure;
  }
  const WindowEntropyJob job{.probs = probs.data(),
                             .key_positions = key_positions.data(),
                             .num_q_heads = num_q_heads,
                             .num_kv_heads = num_kv_heads,
                             .num_queries = num_queries,
                             .window = num_queries,
                             .count = count,
                             .first_query_position = first_query_position,
                             .entropy = &measure.entropy,
                             .shift = &measure.shift};
  if (!RunWindowEntropyShift({&job, 1}, nullptr).ok()) return CakeMeasure();
  return measure;
}

double CakeLogPreference(const CakeMeasure& measure, double tau1, double tau2) {
  if (!(measure.entropy > 0.0) || !(measure.shift > 0.0)) {
    return -std::numeric_limits<double>::infinity();
  }
  return std::log(measure.entropy) / tau1 + std::log(measure.shift) / tau2;
}

namespace {

// CakeAllocate's preference weights: relative to the largest log preference, so exp never
// overflows and tiny ones underflow to 0. NaN counts as -inf (no preference, weight 0).
std::vector<double> CakeWeights(absl::Span<const double> log_preferences, size_t n) {
  double top = -std::numeric_limits<double>::infinity();
  for (size_t l = 0; l < n; ++l) {
    if (!std::isnan(log_preferences[l])) top = std::max(top, log_preferences[l]);
  }
  std::vector<double> weight(n, 0.0);
  if (top > -std::numeric_limits<double>::infinity()) {
    for (size_t l = 0; l < n; ++l) {
      const double lp = log_preferences[l];
      if (std::isnan(lp)) continue;
      weight[l] = lp == top ? 1.0 : std::exp(lp - top);
    }
  }
  return weight;
}

// Shares above the floors `low`: water-filling of `remaining` over the layers with a weight
// (lambda over the uncapped ones, pin the layers whose share reaches their headroom, repeat);
// when every layer with a weight is capped, the layers without one share the rest equally.
std::vector<double> CakeWaterFill(const std::vector<double>& weight, const std::vector<double>& low,
                                  const std::vector<double>& cap, double remaining) {
  const size_t n = weight.size();
  std::vector<double> x = low;
  std::vector<bool> pinned(n, false);
  while (remaining > 0.0) {
    double weights = 0.0;
    for (size_t l = 0; l < n; ++l) {
      if (!pinned[l] && weight[l] > 0.0) weights += weight[l];
    }
    if (weights <= 0.0) break;
    const double lambda = remaining / weights;
    bool pinned_any = false;
    for (size_t l = 0; l < n; ++l) {
      if (!pinned[l] && weight[l] > 0.0 && lambda * weight[l] >= cap[l] - low[l]) {
        pinned[l] = true;
        x[l] = cap[l];
        remaining -= cap[l] - low[l];
        pinned_any = true;
      }
    }
    if (!pinned_any) {
      for (size_t l = 0; l < n; ++l) {
        if (!pinned[l] && weight[l] > 0.0) x[l] = low[l] + lambda * weight[l];
      }
      remaining = 0.0;
    }
  }
  if (remaining > 0.0) {
    std::vector<size_t> rest;
    std::vector<double> headroom;
    for (size_t l = 0; l < n; ++l) {
      if (!pinned[l]) {
        rest.push_back(l);
        headroom.push_back(cap[l] - low[l]);
      }
    }
    const std::vector<double> extra = EqualFill(remaining, headroom);
    for (size_t i = 0; i < rest.size(); ++i) x[rest[i]] = low[rest[i]] + extra[i];
  }
  return x;
}

// Whole budgets from the shares x: rounded up (a cascade stage that is not final), or floors
// plus +1 to the largest fractional parts up to `target` (ties to the lower layer), never
// above the cap.
std::vector<int32_t> CakeRound(const std::vector<double>& x, const std::vector<double>& cap,
                               int64_t target, bool final) {
  const size_t n = x.size();
  std::vector<int32_t> budgets(n, 0);
  if (!final) {
    for (size_t l = 0; l < n; ++l) {
      budgets[l] = static_cast<int32_t>(std::clamp(std::ceil(x[l] - kRoundTolerance), 0.0, cap[l]));
    }
    return budgets;
  }
  std::vector<double> fraction(n, 0.0);
  int64_t assigned = 0;
  for (size_t l = 0; l < n; ++l) {
    const double whole = std::clamp(std::floor(x[l] + kRoundTolerance), 0.0, cap[l]);
    budgets[l] = static_cast<int32_t>(whole);
    fraction[l] = x[l] - whole;
    assigned += budgets[l];
  }
  std::vector<bool> raised(n, false);
  for (int64_t left = target - assigned; left > 0; --left) {
    int64_t best = -1;
    for (size_t l = 0; l < n; ++l) {
      if (raised[l] || budgets[l] >= cap[l]) continue;
      if (best < 0 || fraction[l] > fraction[best] + kRoundTolerance)
        best = static_cast<int64_t>(l);
    }
    if (best < 0) break;
    raised[best] = true;
    ++budgets[best];
  }
  return budgets;
}

}  // namespace

std::vector<int32_t> CakeAllocate(absl::Span<const double> log_preferences, int64_t total,
                                  absl::Span<const int32_t> caps, int32_t floor, bool final) {
  const size_t n = std::min(log_preferences.size(), caps.size());
  if (n == 0) return {};
  std::vector<double> cap(n), low(n);
  int64_t sum_caps = 0;
  double sum_floors = 0.0;
  for (size_t l = 0; l < n; ++l) {
    cap[l] = std::max(caps[l], 0);
    low[l] = std::min(static_cast<double>(std::max(floor, 0)), cap[l]);
    sum_caps += std::max(caps[l], 0);
    sum_floors += low[l];
  }
  const int64_t target = std::clamp<int64_t>(total, 0, sum_caps);
  // Not even the floors fit: split uniformly (under each layer's floor).
  const std::vector<double> x =
      static_cast<double>(target) <= sum_floors
          ? EqualFill(static_cast<double>(target), low)
          : CakeWaterFill(CakeWeights(log_preferences, n), low, cap,
                          static_cast<double>(target) - sum_floors);
  return CakeRound(x, cap, target, final);
}

}  // namespace kvs
