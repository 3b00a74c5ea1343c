#include "cache/policy/d2o.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/attention_stats.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr float kDefaultBeta = 0.7f;
constexpr float kDefaultMinRatio = 0.01f;
constexpr float kDefaultMaxRatio = 1.0f;

// Byte offset of slot `slot` of kv head `head` (kv 0 keys, 1 values) in the arena.
uint64_t RowOffset(const PagedLayerView& view, int32_t kv, int32_t head, int32_t slot) {
  const uint64_t block = static_cast<uint64_t>(view.block_table[slot / view.block_tokens]);
  const uint64_t row = (static_cast<uint64_t>(kv) * view.num_kv_heads + head) * view.block_tokens +
                       slot % view.block_tokens;
  return block * view.block_bytes + row * view.head_dim * DTypeBytes(view.dtype);
}

// One (layer, kv head) with evictions: its slots split into kept and evicted (by position).
struct HeadMerge {
  size_t layer = 0;
  int32_t head = 0;
  std::vector<int32_t> evicted;  // slots, ascending position
  std::vector<int32_t> kept;     // slots, as Select wrote them
  std::vector<int32_t> kept_positions;
  std::vector<float> similarity;  // u_i per evicted
  std::vector<int32_t> target;    // index into kept per evicted
  std::vector<uint8_t> merge;     // decision per evicted
};

// Mean of the finite entries; false when there are none.
bool FiniteMean(absl::Span<const float> values, double& mean) {
  double sum = 0.0;
  int64_t n = 0;
  for (float v : values) {
    if (std::isfinite(v)) {
      sum += v;
      ++n;
    }
  }
  if (n == 0) return false;
  mean = sum / static_cast<double>(n);
  return true;
}

}  // namespace

absl::StatusOr<int32_t> D2oPolicy::RawScores(Backend&, Phase, const LayerSelection& layer,
                                             std::vector<float>& raw) const {
  const std::vector<float>& accumulated = layer.state->accumulated;
  const int64_t count = layer.keys.count;
  if (accumulated.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("policy d2o needs the attention of layer ",
                                                   layer.layer, " to evict: field attention"));
  }
  const int64_t heads = layer.keys.num_kv_heads;
  const int64_t rows = count > 0 ? static_cast<int64_t>(accumulated.size()) / count : 0;
  if (rows < heads || rows % heads != 0 ||
      static_cast<int64_t>(accumulated.size()) != rows * count) {
    return absl::InternalError(absl::StrCat("layer ", layer.layer, " accumulates ",
                                            accumulated.size(), " scores for ", count,
                                            " tokens of ", heads, " kv heads"));
  }
  // The spec sums over the group; the selector's GQA mean ranks the same.
  raw = accumulated;
  return static_cast<int32_t>(rows);
}

ScoredPolicy::Protection D2oPolicy::Protect(Phase, const LayerSelection& layer) const {
  const D2oSplit split = SplitD2oBudget(layer.keep, config().d2o.n_sink, config().d2o.recent_frac);
  return Protection{split.sinks, split.recent};
}

absl::Status D2oPolicy::Merge(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                              absl::Span<int32_t> merged) const {
  if (merged.size() < layers.size()) {
    return absl::InternalError(
        absl::StrCat("merge counts for ", merged.size(), " of ", layers.size(), " layers"));
  }
  std::fill(merged.begin(), merged.end(), 0);
  const D2oConfig& d2o = config().d2o;

  // 1. Kept / evicted slots of every (layer, head) that evicts into something.
  std::vector<HeadMerge> work;
  std::vector<uint8_t> is_kept;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSelection& layer = layers[i];
    const int32_t heads = layer.keys.num_kv_heads;
    const int32_t count = layer.keys.count;
    // Nothing evicted (full-cache layers, layers within budget), or nothing to merge into.
    if (layer.keep >= count || layer.keep <= 0) continue;
    if (heads < 1 || layer.state == nullptr ||
        static_cast<int64_t>(layer.positions.size()) != int64_t{heads} * count ||
        static_cast<int64_t>(layer.kept.size()) != int64_t{heads} * layer.keep ||
        layer.writable_arena == nullptr || layer.writable_arena != layer.keys.arena) {
      return absl::InternalError(absl::StrCat("malformed merge for layer ", layer.layer));
    }
    for (int32_t h = 0; h < heads; ++h) {
      HeadMerge head;
      head.layer = i;
      head.head = h;
      const int32_t* positions = layer.positions.data() + int64_t{h} * count;
      const int32_t* kept = layer.kept.data() + int64_t{h} * layer.keep;
      is_kept.assign(count, 0);
      for (int32_t t = 0; t < layer.keep; ++t) {
        if (kept[t] < 0 || kept[t] >= count || is_kept[kept[t]] != 0) {
          return absl::InternalError(absl::StrCat("layer ", layer.layer, " head ", h,
                                                  " keeps slot ", kept[t], " of ", count));
        }
        is_kept[kept[t]] = 1;
        head.kept.push_back(kept[t]);
        head.kept_positions.push_back(positions[kept[t]]);
      }
      for (int32_t s = 0; s < count; ++s) {
        if (is_kept[s] == 0) head.evicted.push_back(s);
      }
      std::sort(head.evicted.begin(), head.evicted.end(),
                [positions](int32_t a, int32_t b) { return positions[a] < positions[b]; });
      head.similarity.assign(head.evicted.size(), 0.0f);
      head.target.assign(head.evicted.size(), 0);
      head.merge.assign(head.evicted.size(), 0);
      work.push_back(std::move(head));
    }
  }
  if (work.empty()) return absl::OkStatus();

  // 2. Nearest kept key of every evicted one, one batch for all layers.
  std::vector<NearestKeyJob> nearest(work.size());
  for (size_t w = 0; w < work.size(); ++w) {
    HeadMerge& head = work[w];
    NearestKeyJob& job = nearest[w];
    job.keys = layers[head.layer].keys;
    job.keys.kv_index = 0;
    job.head = head.head;
    job.query_slots = head.evicted.data();
    job.num_queries = static_cast<int32_t>(head.evicted.size());
    job.candidate_slots = head.kept.data();
    job.candidate_positions = head.kept_positions.data();
    job.num_candidates = static_cast<int32_t>(head.kept.size());
    job.similarity = head.similarity.data();
    job.target = head.target.data();
  }
  KVS_RETURN_IF_ERROR(backend.NearestKeys(nearest, nullptr));
  KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));

  // 3. Thresholds and merge decisions, per layer (work is grouped by layer, heads in order).
  const double beta = d2o.beta;
  std::vector<std::vector<float>> new_thresholds(layers.size());
  for (size_t begin = 0; begin < work.size();) {
    const size_t i = work[begin].layer;
    size_t end = begin;
    while (end < work.size() && work[end].layer == i) ++end;
    const LayerSelection& layer = layers[i];
    const int32_t heads = layer.keys.num_kv_heads;
    const std::vector<float>& previous = layer.state->threshold;
    std::vector<float>& tau = new_thresholds[i];
    if (d2o.threshold_scope == D2oThresholdScope::kLayerHead) {
      if (!previous.empty() && static_cast<int32_t>(previous.size()) != heads) {
        return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", previous.size(),
                                                " merge thresholds for ", heads, " kv heads"));
      }
      tau = previous.empty() ? std::vector<float>(heads, 0.0f) : previous;
      int32_t observed = 0;
      for (size_t w = begin; w < end; ++w) {
        HeadMerge& head = work[w];
        double observation = 0.0;
        if (!FiniteMean(head.similarity, observation)) continue;  // tau unchanged
        ++observed;
        const double next = previous.empty()
                                ? observation
                                : beta * observation + (1.0 - beta) * previous[head.head];
        tau[head.head] = static_cast<float>(next);
        for (size_t e = 0; e < head.evicted.size(); ++e) {
          const float u = head.similarity[e];
          head.merge[e] = std::isfinite(u) && u >= tau[head.head] ? 1 : 0;
        }
      }
      // A first threshold is stored only when every head observed one (NaN keys aside).
      if (previous.empty() && observed < heads) tau.clear();
    } else {
      // One tau per layer (the released code): the observation is the mean over heads of each
      // head's mean, and the r-th evicted token of every head follows the heads' mean u at r.
      if (!previous.empty() && previous.size() != 1) {
        return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", previous.size(),
                                                " merge thresholds, expected 1"));
      }
      tau = previous.empty() ? std::vector<float>(1, 0.0f) : previous;
      std::vector<float> head_means;
      for (size_t w = begin; w < end; ++w) {
        double mean = 0.0;
        if (FiniteMean(work[w].similarity, mean)) head_means.push_back(static_cast<float>(mean));
      }
      double observation = 0.0;
      if (!FiniteMean(head_means, observation)) {
        tau.clear();  // nothing observed: no merge, tau unchanged
      } else {
        tau[0] = static_cast<float>(
            previous.empty() ? observation : beta * observation + (1.0 - beta) * previous[0]);
        const size_t evicted = work[begin].evicted.size();  // every head evicts as many
        std::vector<float> column;
        for (size_t r = 0; r < evicted; ++r) {
          column.clear();
          for (size_t w = begin; w < end; ++w) column.push_back(work[w].similarity[r]);
          double mean_u = 0.0;
          const bool merge = FiniteMean(column, mean_u) && static_cast<float>(mean_u) >= tau[0];
          for (size_t w = begin; w < end; ++w) {
            work[w].merge[r] = merge && std::isfinite(work[w].similarity[r]) ? 1 : 0;
          }
        }
      }
    }
    begin = end;
  }

  // 4. Weighted merges: one job per (kept target, kv), the target its own first source.
  struct Group {
    size_t work = 0;
    int32_t target = 0;           // index into kept
    std::vector<size_t> members;  // indices into evicted
  };
  std::vector<Group> groups;
  std::vector<int32_t> group_of;
  for (size_t w = 0; w < work.size(); ++w) {
    const HeadMerge& head = work[w];
    group_of.assign(head.kept.size(), -1);
    for (size_t e = 0; e < head.evicted.size(); ++e) {
      if (head.merge[e] == 0) continue;
      const int32_t t = head.target[e];
      if (t < 0 || t >= static_cast<int32_t>(head.kept.size())) {
        return absl::InternalError(
            absl::StrCat("nearest key target ", t, " of ", head.kept.size()));
      }
      if (group_of[t] < 0) {
        group_of[t] = static_cast<int32_t>(groups.size());
        groups.push_back(Group{w, t, {}});
      }
      groups[group_of[t]].members.push_back(e);
    }
  }
  std::vector<uint64_t> offsets;
  std::vector<float> weights;
  std::vector<size_t> starts;
  std::vector<RowMergeJob> jobs;
  for (const Group& group : groups) {
    const HeadMerge& head = work[group.work];
    const PagedLayerView& view = layers[head.layer].keys;
    // Weights in double, then rounded once: both schemes from the key similarities alone.
    std::vector<double> w(group.members.size() + 1);
    if (d2o.merge_weighting == D2oMergeWeighting::kPaper) {
      const double self = std::exp(1.0);
      double total = self;
      for (size_t m = 0; m < group.members.size(); ++m) {
        w[m + 1] = std::exp(static_cast<double>(head.similarity[group.members[m]]));
        total += w[m + 1];
      }
      w[0] = self;
      for (double& x : w) x /= total;
    } else {
      const double denominator = 1.0 + static_cast<double>(group.members.size());
      w[0] = 1.0 / denominator;
      for (size_t m = 0; m < group.members.size(); ++m) {
        w[m + 1] = head.similarity[group.members[m]] / denominator;
      }
    }
    for (int32_t kv = 0; kv < 2; ++kv) {
      starts.push_back(offsets.size());
      offsets.push_back(RowOffset(view, kv, head.head, head.kept[group.target]));
      weights.push_back(static_cast<float>(w[0]));
      for (size_t m = 0; m < group.members.size(); ++m) {
        offsets.push_back(RowOffset(view, kv, head.head, head.evicted[group.members[m]]));
        weights.push_back(static_cast<float>(w[m + 1]));
      }
      RowMergeJob job;
      job.arena = layers[head.layer].writable_arena;
      job.dtype = view.dtype;
      job.row_elements = view.head_dim;
      job.dst_offset = offsets[starts.back()];
      job.num_sources = static_cast<int32_t>(group.members.size() + 1);
      jobs.push_back(job);
    }
    merged[head.layer] += static_cast<int32_t>(group.members.size());
  }
  // The offset and weight buffers no longer grow: point the jobs into them.
  for (size_t j = 0; j < jobs.size(); ++j) {
    jobs[j].src_offsets = offsets.data() + starts[j];
    jobs[j].weights = weights.data() + starts[j];
  }
  if (!jobs.empty()) {
    absl::Status status = backend.MergeRows(jobs, nullptr);
    if (status.ok()) status = backend.Synchronize(nullptr);
    if (!status.ok()) {
      std::fill(merged.begin(), merged.end(), 0);
      return status;
    }
  }
  // The thresholds move only once the step's merges are done.
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!new_thresholds[i].empty()) layers[i].state->threshold = std::move(new_thresholds[i]);
  }
  return absl::OkStatus();
}

absl::Status ResolveD2oConfig(PolicyConfig& config) {
  D2oConfig& d2o = config.d2o;
  // Zero is not a valid value of these three: it stands for the spec's default.
  if (d2o.beta == 0.0f) d2o.beta = kDefaultBeta;
  if (d2o.min_ratio == 0.0f) d2o.min_ratio = kDefaultMinRatio;
  if (d2o.max_ratio == 0.0f) d2o.max_ratio = kDefaultMaxRatio;
  // Every comparison is written so that NaN fails it.
  if (!(d2o.rho >= 0.0f && d2o.rho <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.d2o.rho must be in [0, 1], got ", d2o.rho));
  }
  if (!(d2o.recent_frac >= 0.0f && d2o.recent_frac <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.d2o.recent_frac must be in [0, 1], got ", d2o.recent_frac));
  }
  if (d2o.n_sink < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.d2o.n_sink must be >= 0, got ", d2o.n_sink));
  }
  if (!(d2o.beta > 0.0f && d2o.beta <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.d2o.beta must be in (0, 1], got ", d2o.beta));
  }
  if (!(d2o.max_ratio > 0.0f && d2o.max_ratio <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.d2o.max_ratio must be in (0, 1], got ", d2o.max_ratio));
  }
  if (!(d2o.min_ratio > 0.0f && d2o.min_ratio <= d2o.max_ratio)) {
    return absl::InvalidArgumentError(absl::StrCat("policy.d2o.min_ratio must be in (0, ",
                                                   d2o.max_ratio, "], got ", d2o.min_ratio));
  }
  for (int32_t layer : d2o.full_cache_layers) {
    if (layer < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.d2o.full_cache_layers must be >= 0, got ", layer));
    }
  }
  switch (d2o.density_mode) {
    case D2oDensityMode::kHeadNorm:
    case D2oDensityMode::kRaw:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.d2o.density_mode is not a known mode: ", static_cast<int>(d2o.density_mode)));
  }
  switch (d2o.merge_weighting) {
    case D2oMergeWeighting::kPaper:
    case D2oMergeWeighting::kCode:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy.d2o.merge_weighting is not a known weighting: ",
                       static_cast<int>(d2o.merge_weighting)));
  }
  switch (d2o.threshold_scope) {
    case D2oThresholdScope::kLayerHead:
    case D2oThresholdScope::kLayer:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy.d2o.threshold_scope is not a known scope: ",
                       static_cast<int>(d2o.threshold_scope)));
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeD2oPolicy(const PolicyConfig& config) {
  return std::make_unique<D2oPolicy>(config);
}

}  // namespace kvs
