#include "cache/policy/d2o.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/registry.h"
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

// One (layer, kv head) with evictions. Its evicted slots, candidate positions and per-evicted
// outputs are ranges of the flat arrays of MergeScratch (one allocation per call at most, none
// once a thread's scratch has grown); its kept slots are read in place from the selection.
struct HeadMerge {
  size_t layer = 0;
  int32_t head = 0;
  const int32_t* kept = nullptr;  // slots, as Select wrote them (layer.kept)
  int32_t num_kept = 0;
  size_t evicted_begin = 0;  // into MergeScratch::evicted / similarity / target / merge
  int32_t num_evicted = 0;
  size_t kept_begin = 0;  // into MergeScratch::kept_positions
};

// A token folded into a kept one: (head, target index into kept, evicted index). Sorted, the
// tokens of one target are adjacent and in evicted order (ascending position).
struct MergeEntry {
  uint32_t work = 0;
  int32_t target = 0;
  int32_t evicted = 0;
  bool operator<(const MergeEntry& o) const {
    return work != o.work       ? work < o.work
           : target != o.target ? target < o.target
                                : evicted < o.evicted;
  }
};

// Per-thread buffers of Merge, reused across calls: a decode step calls Merge for every
// sequence with ~256 (layer, head) pieces of bookkeeping, and sequences may merge on several
// threads at once.
struct MergeScratch {
  std::vector<HeadMerge> work;
  std::vector<int32_t> evicted;         // slots, ascending position within each head
  std::vector<int32_t> kept_positions;  // per head, aligned with its kept slots
  std::vector<float> similarity;        // u_i per evicted
  std::vector<int32_t> target;          // index into kept per evicted
  std::vector<uint8_t> merge;           // decision per evicted
  std::vector<uint8_t> is_kept;         // fallback for kept lists that do not ascend
  std::vector<NearestKeyJob> nearest;
  std::vector<float> thresholds;        // the new taus of the layers, in layer order
  std::vector<int32_t> threshold_size;  // per layer: its taus in thresholds; -1 = unchanged
  std::vector<float> head_means, column;
  std::vector<MergeEntry> entries;
  std::vector<double> weights_double;
  // The merge jobs' CSR arrays, every job's in one buffer: dst rows, the rows' source starts
  // (each job's own from 0), and the sources' offsets and weights.
  std::vector<uint64_t> dst;
  std::vector<int64_t> source_starts;
  std::vector<uint64_t> offsets;
  std::vector<float> weights;
  struct JobSpan {
    size_t dst, starts, sources;  // where the job's part of each buffer begins
  };
  std::vector<JobSpan> spans;
  std::vector<RowMergeJob> jobs;
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

absl::StatusOr<AttentionScoredPolicy::RawRows> D2oPolicy::RawScores(Backend&, Phase,
                                                                    const LayerSelection& layer,
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
  // The spec sums over the group; the selector's GQA mean ranks the same. The mean is taken
  // here, straight from the state (the selector's mean of one row per head is then a copy): a
  // quarter of the [Hq][count] copy the selector would otherwise make and reduce, every step.
  raw.resize(static_cast<size_t>(heads) * count);
  GqaMean(accumulated, static_cast<int32_t>(rows), static_cast<int32_t>(heads),
          static_cast<int32_t>(count), absl::MakeSpan(raw));
  return RawRows{raw, static_cast<int32_t>(heads)};
}

ScoredPolicy::Protection D2oPolicy::Protect(Phase, const LayerSelection& layer) const {
  const D2oSplit split = SplitD2oBudget(layer.keep, config().d2o.n_sink, config().d2o.recent_frac);
  return Protection{split.sinks, split.recent};
}

namespace {

// Step 1 for one (layer, head): its kept positions and evicted slots (ascending position) into
// the scratch. `i` indexes `layer` in the call's layers.
absl::Status SplitHead(const LayerSelection& layer, size_t i, int32_t h, MergeScratch& x) {
  const int32_t count = layer.keys.count;
  HeadMerge head;
  head.layer = i;
  head.head = h;
  const int32_t* positions = layer.positions.data() + int64_t{h} * count;
  const int32_t* kept = layer.kept.data() + int64_t{h} * layer.keep;
  head.kept = kept;
  head.num_kept = layer.keep;
  head.kept_begin = x.kept_positions.size();
  head.evicted_begin = x.evicted.size();
  // Select writes kept slots ascending: then they are in range and distinct when the ends
  // are in range and every step rises, and the evicted slots are the gaps between them.
  // Anything else takes the general path below.
  x.kept_positions.resize(head.kept_begin + layer.keep);
  int32_t* kept_positions = x.kept_positions.data() + head.kept_begin;
  int ascending = kept[0] >= 0 && kept[layer.keep - 1] < count;
  for (int32_t t = 1; t < layer.keep; ++t) ascending &= kept[t] > kept[t - 1];
  if (ascending) {
    for (int32_t t = 0; t < layer.keep; ++t) kept_positions[t] = positions[kept[t]];
    int32_t next = 0;  // the first slot not yet accounted for
    for (int32_t t = 0; t < layer.keep; ++t) {
      for (int32_t s = next; s < kept[t]; ++s) x.evicted.push_back(s);
      next = kept[t] + 1;
    }
    for (int32_t s = next; s < count; ++s) x.evicted.push_back(s);
  } else {
    x.is_kept.assign(count, 0);
    for (int32_t t = 0; t < layer.keep; ++t) {
      if (kept[t] < 0 || kept[t] >= count || x.is_kept[kept[t]] != 0) {
        return absl::InternalError(absl::StrCat("layer ", layer.layer, " head ", h,
                                                " keeps slot ", kept[t], " of ", count));
      }
      x.is_kept[kept[t]] = 1;
      kept_positions[t] = positions[kept[t]];
    }
    for (int32_t s = 0; s < count; ++s) {
      if (x.is_kept[s] == 0) x.evicted.push_back(s);
    }
  }
  head.num_evicted = static_cast<int32_t>(x.evicted.size() - head.evicted_begin);
  if (head.num_evicted > 1) {
    std::sort(x.evicted.begin() + head.evicted_begin, x.evicted.end(),
              [positions](int32_t a, int32_t b) { return positions[a] < positions[b]; });
  }
  x.work.push_back(head);
  return absl::OkStatus();
}

// Step 1: kept / evicted slots of every (layer, head) that evicts into something.
absl::Status CollectHeads(absl::Span<const LayerSelection> layers, MergeScratch& x) {
  x.work.clear();
  x.evicted.clear();
  x.kept_positions.clear();
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
    for (int32_t h = 0; h < heads; ++h) KVS_RETURN_IF_ERROR(SplitHead(layer, i, h, x));
  }
  return absl::OkStatus();
}

// Step 2: the nearest kept key of every evicted one, one batch for all layers.
absl::Status FindNearest(Backend& backend, absl::Span<const LayerSelection> layers,
                         MergeScratch& x) {
  const size_t evicted_total = x.evicted.size();
  x.similarity.assign(evicted_total, 0.0f);
  x.target.assign(evicted_total, 0);
  x.merge.assign(evicted_total, 0);
  x.nearest.resize(x.work.size());
  for (size_t w = 0; w < x.work.size(); ++w) {
    const HeadMerge& head = x.work[w];
    NearestKeyJob& job = x.nearest[w];
    job = NearestKeyJob{};
    job.keys = layers[head.layer].keys;
    job.keys.kv_index = 0;
    job.head = head.head;
    job.query_slots = x.evicted.data() + head.evicted_begin;
    job.num_queries = head.num_evicted;
    job.candidate_slots = head.kept;
    job.candidate_positions = x.kept_positions.data() + head.kept_begin;
    job.num_candidates = head.num_kept;
    job.similarity = x.similarity.data() + head.evicted_begin;
    job.target = x.target.data() + head.evicted_begin;
  }
  KVS_RETURN_IF_ERROR(backend.NearestKeys(x.nearest, nullptr));
  return backend.Synchronize(nullptr);
}

absl::Span<const float> Similarities(const MergeScratch& x, const HeadMerge& head) {
  return absl::Span<const float>(x.similarity.data() + head.evicted_begin, head.num_evicted);
}

// Step 3 with one tau per (layer, kv head), for the heads x.work[begin, end) of layer `i`.
absl::Status DecidePerHead(const LayerSelection& layer, size_t i, size_t begin, size_t end,
                           double beta, MergeScratch& x) {
  const int32_t heads = layer.keys.num_kv_heads;
  const std::vector<float>& previous = layer.state->threshold;
  const size_t tau_begin = x.thresholds.size();
  if (!previous.empty() && static_cast<int32_t>(previous.size()) != heads) {
    return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", previous.size(),
                                            " merge thresholds for ", heads, " kv heads"));
  }
  if (previous.empty()) {
    x.thresholds.resize(tau_begin + heads, 0.0f);
  } else {
    x.thresholds.insert(x.thresholds.end(), previous.begin(), previous.end());
  }
  float* tau = x.thresholds.data() + tau_begin;
  int32_t observed = 0;
  for (size_t w = begin; w < end; ++w) {
    const HeadMerge& head = x.work[w];
    double observation = 0.0;
    if (!FiniteMean(Similarities(x, head), observation)) continue;  // tau unchanged
    ++observed;
    const double next =
        previous.empty() ? observation : beta * observation + (1.0 - beta) * previous[head.head];
    tau[head.head] = static_cast<float>(next);
    for (int32_t e = 0; e < head.num_evicted; ++e) {
      const float u = x.similarity[head.evicted_begin + e];
      x.merge[head.evicted_begin + e] = std::isfinite(u) && u >= tau[head.head] ? 1 : 0;
    }
  }
  // A first threshold is stored only when every head observed one (NaN keys aside).
  if (previous.empty() && observed < heads) {
    x.thresholds.resize(tau_begin);
  } else {
    x.threshold_size[i] = heads;
  }
  return absl::OkStatus();
}

// Step 3 with one tau per layer (the released code): the observation is the mean over heads of
// each head's mean, and the r-th evicted token of every head follows the heads' mean u at r.
absl::Status DecidePerLayer(const LayerSelection& layer, size_t i, size_t begin, size_t end,
                            double beta, MergeScratch& x) {
  const std::vector<float>& previous = layer.state->threshold;
  if (!previous.empty() && previous.size() != 1) {
    return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", previous.size(),
                                            " merge thresholds, expected 1"));
  }
  x.head_means.clear();
  for (size_t w = begin; w < end; ++w) {
    double mean = 0.0;
    if (FiniteMean(Similarities(x, x.work[w]), mean)) {
      x.head_means.push_back(static_cast<float>(mean));
    }
  }
  double observation = 0.0;
  if (!FiniteMean(x.head_means, observation)) return absl::OkStatus();  // no merge, tau unchanged
  const float tau = static_cast<float>(
      previous.empty() ? observation : beta * observation + (1.0 - beta) * previous[0]);
  x.thresholds.push_back(tau);
  x.threshold_size[i] = 1;
  const int32_t evicted = x.work[begin].num_evicted;  // every head evicts as many
  for (int32_t r = 0; r < evicted; ++r) {
    x.column.clear();
    for (size_t w = begin; w < end; ++w) {
      x.column.push_back(x.similarity[x.work[w].evicted_begin + r]);
    }
    double mean_u = 0.0;
    const bool merge = FiniteMean(x.column, mean_u) && static_cast<float>(mean_u) >= tau;
    for (size_t w = begin; w < end; ++w) {
      const size_t at = x.work[w].evicted_begin + r;
      x.merge[at] = merge && std::isfinite(x.similarity[at]) ? 1 : 0;
    }
  }
  return absl::OkStatus();
}

// Step 3: thresholds and merge decisions, per layer (work is grouped by layer, heads in order).
// The new taus go to scratch and into the states only once the merges are done.
absl::Status DecideMerges(const D2oConfig& d2o, absl::Span<const LayerSelection> layers,
                          MergeScratch& x) {
  x.threshold_size.assign(layers.size(), -1);
  x.thresholds.clear();
  for (size_t begin = 0; begin < x.work.size();) {
    const size_t i = x.work[begin].layer;
    size_t end = begin;
    while (end < x.work.size() && x.work[end].layer == i) ++end;
    if (d2o.threshold_scope == D2oThresholdScope::kLayerHead) {
      KVS_RETURN_IF_ERROR(DecidePerHead(layers[i], i, begin, end, d2o.beta, x));
    } else {
      KVS_RETURN_IF_ERROR(DecidePerLayer(layers[i], i, begin, end, d2o.beta, x));
    }
    begin = end;
  }
  return absl::OkStatus();
}

// The weights of one merge group, target first, in double (rounded once by the caller): both
// schemes from the key similarities alone.
void GroupWeights(D2oMergeWeighting weighting, const MergeScratch& x, const HeadMerge& head,
                  size_t g, size_t members, std::vector<double>& w) {
  auto similarity_of = [&](size_t m) {
    return x.similarity[head.evicted_begin + x.entries[g + m].evicted];
  };
  w.assign(members + 1, 0.0);
  if (weighting == D2oMergeWeighting::kPaper) {
    const double self = std::exp(1.0);
    double total = self;
    for (size_t m = 0; m < members; ++m) {
      w[m + 1] = std::exp(static_cast<double>(similarity_of(m)));
      total += w[m + 1];
    }
    w[0] = self;
    for (double& v : w) v /= total;
  } else {
    const double denominator = 1.0 + static_cast<double>(members);
    w[0] = 1.0 / denominator;
    for (size_t m = 0; m < members; ++m) w[m + 1] = similarity_of(m) / denominator;
  }
}

// The merge entries of every evicted token that merges, grouped by (work, target).
absl::Status CollectEntries(MergeScratch& x) {
  x.entries.clear();
  for (size_t w = 0; w < x.work.size(); ++w) {
    const HeadMerge& head = x.work[w];
    for (int32_t e = 0; e < head.num_evicted; ++e) {
      if (x.merge[head.evicted_begin + e] == 0) continue;
      const int32_t t = x.target[head.evicted_begin + e];
      if (t < 0 || t >= head.num_kept) {
        return absl::InternalError(absl::StrCat("nearest key target ", t, " of ", head.num_kept));
      }
      x.entries.push_back(MergeEntry{static_cast<uint32_t>(w), t, e});
    }
  }
  // Already in (work, evicted) order; sorting groups each target's tokens, in evicted order.
  std::sort(x.entries.begin(), x.entries.end());
  return absl::OkStatus();
}

// Step 4: one weighted-merge job per layer, one merged row per (kept target, kv), the target
// its own first source; merged[layer] counts the folded tokens.
absl::Status BuildMergeJobs(D2oMergeWeighting weighting, absl::Span<const LayerSelection> layers,
                            MergeScratch& x, absl::Span<int32_t> merged) {
  KVS_RETURN_IF_ERROR(CollectEntries(x));
  x.dst.clear();
  x.source_starts.clear();
  x.offsets.clear();
  x.weights.clear();
  x.spans.clear();
  x.jobs.clear();
  size_t job_layer = std::numeric_limits<size_t>::max();
  for (size_t g = 0; g < x.entries.size();) {
    size_t g_end = g + 1;
    while (g_end < x.entries.size() && x.entries[g_end].work == x.entries[g].work &&
           x.entries[g_end].target == x.entries[g].target) {
      ++g_end;
    }
    const HeadMerge& head = x.work[x.entries[g].work];
    const PagedLayerView& view = layers[head.layer].keys;
    if (head.layer != job_layer) {
      RowMergeJob& job = x.jobs.emplace_back();
      job.arena = layers[head.layer].writable_arena;
      job.dtype = view.dtype;
      job.row_elements = view.head_dim;
      x.spans.push_back({x.dst.size(), x.source_starts.size(), x.offsets.size()});
      x.source_starts.push_back(0);
      job_layer = head.layer;
    }
    RowMergeJob& job = x.jobs.back();
    const size_t source_base = x.spans.back().sources;
    const size_t members = g_end - g;
    std::vector<double>& w = x.weights_double;
    GroupWeights(weighting, x, head, g, members, w);
    const int32_t target_slot = head.kept[x.entries[g].target];
    for (int32_t kv = 0; kv < 2; ++kv) {
      const uint64_t dst = RowOffset(view, kv, head.head, target_slot);
      x.dst.push_back(dst);
      x.offsets.push_back(dst);
      x.weights.push_back(static_cast<float>(w[0]));
      for (size_t m = 0; m < members; ++m) {
        const int32_t slot = x.evicted[head.evicted_begin + x.entries[g + m].evicted];
        x.offsets.push_back(RowOffset(view, kv, head.head, slot));
        x.weights.push_back(static_cast<float>(w[m + 1]));
      }
      x.source_starts.push_back(static_cast<int64_t>(x.offsets.size() - source_base));
      ++job.rows;
    }
    merged[head.layer] += static_cast<int32_t>(members);
    g = g_end;
  }
  // The buffers no longer grow: point the jobs into them.
  for (size_t j = 0; j < x.jobs.size(); ++j) {
    const MergeScratch::JobSpan& span = x.spans[j];
    x.jobs[j].dst_offsets = x.dst.data() + span.dst;
    x.jobs[j].source_starts = x.source_starts.data() + span.starts;
    x.jobs[j].src_offsets = x.offsets.data() + span.sources;
    x.jobs[j].weights = x.weights.data() + span.sources;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status D2oPolicy::Merge(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                              absl::Span<int32_t> merged) const {
  if (merged.size() < layers.size()) {
    return absl::InternalError(
        absl::StrCat("merge counts for ", merged.size(), " of ", layers.size(), " layers"));
  }
  std::fill(merged.begin(), merged.end(), 0);
  const D2oConfig& d2o = config().d2o;
  thread_local MergeScratch scratch;
  MergeScratch& x = scratch;

  KVS_RETURN_IF_ERROR(CollectHeads(layers, x));
  if (x.work.empty()) return absl::OkStatus();
  KVS_RETURN_IF_ERROR(FindNearest(backend, layers, x));
  KVS_RETURN_IF_ERROR(DecideMerges(d2o, layers, x));
  KVS_RETURN_IF_ERROR(BuildMergeJobs(d2o.merge_weighting, layers, x, merged));
  if (!x.jobs.empty()) {
    absl::Status status = backend.MergeRows(x.jobs, nullptr);
    if (status.ok()) status = backend.Synchronize(nullptr);
    if (!status.ok()) {
      std::fill(merged.begin(), merged.end(), 0);
      return status;
    }
  }
  // The thresholds move only once the step's merges are done (assign reuses the capacity).
  const float* tau = x.thresholds.data();
  for (size_t i = 0; i < layers.size(); ++i) {
    if (x.threshold_size[i] < 0) continue;
    layers[i].state->threshold.assign(tau, tau + x.threshold_size[i]);
    tau += x.threshold_size[i];
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


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeD2oParams(const PolicyConfig& config, FieldWriter& out) {
  const D2oConfig& d = config.d2o;
  out.F32(1, d.rho);
  out.F32(2, d.recent_frac);
  out.I32(3, d.n_sink);
  out.F32(4, d.beta);
  out.Enum(5, d.density_mode);
  out.F32(6, d.min_ratio);
  out.F32(7, d.max_ratio);
  out.I32s(8, d.full_cache_layers);
  out.Enum(9, d.merge_weighting);
  out.Enum(10, d.threshold_scope);
}
bool DecodeD2oParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  D2oConfig& d = config->d2o;
  return in.F32(1, &d.rho) && in.F32(2, &d.recent_frac) && in.I32(3, &d.n_sink) &&
         in.F32(4, &d.beta) && in.Enum(5, &d.density_mode) && in.F32(6, &d.min_ratio) &&
         in.F32(7, &d.max_ratio) && in.I32s(8, &d.full_cache_layers) &&
         in.Enum(9, &d.merge_weighting) && in.Enum(10, &d.threshold_scope);
}
AllocatorDefaults D2oAllocatorDefaults(const PolicyConfig&) {
  return {LayerAllocatorKind::kD2o, nullptr, 0};
}
}  // namespace

extern const PolicyUnit kD2oUnit;
const PolicyUnit kD2oUnit = {
    .name = kPolicyD2o,
    .capabilities = {.needs_attention = true, .merges = true},
    .resolve = &ResolveD2oConfig,
    .make = &MakeD2oPolicy,
    .allocator_defaults = &D2oAllocatorDefaults,
    .encode_params = &EncodeD2oParams,
    .decode_params = &DecodeD2oParams,
};

}  // namespace kvs
