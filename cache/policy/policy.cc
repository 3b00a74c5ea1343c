#include "cache/policy/policy.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

// Whether every row of `job` equals its first: scores bit for bit, positions and forced flags.
bool RowsIdentical(const TopKJob& job) {
  const size_t n = static_cast<size_t>(job.n);
  for (int32_t r = 1; r < job.rows; ++r) {
    const int64_t at = int64_t{r} * job.n;
    if (std::memcmp(job.positions, job.positions + at, n * sizeof(int32_t)) != 0 ||
        std::memcmp(job.scores, job.scores + at, n * sizeof(float)) != 0 ||
        (job.forced != nullptr && std::memcmp(job.forced, job.forced + at, n) != 0)) {
      return false;
    }
  }
  return true;
}

absl::Status CheckSelection(const LayerSelection& layer) {
  const int64_t heads = layer.keys.num_kv_heads;
  const int64_t count = layer.keys.count;
  if (heads < 1 || count < 0 || layer.keep < 0 || layer.keep > count ||
      static_cast<int64_t>(layer.positions.size()) != heads * count ||
      static_cast<int64_t>(layer.kept.size()) != heads * layer.keep) {
    return absl::InternalError(absl::StrCat("malformed selection for layer ", layer.layer,
                                            ": heads ", heads, ", count ", count, ", keep ",
                                            layer.keep, ", positions ", layer.positions.size(),
                                            ", kept ", layer.kept.size()));
  }
  return absl::OkStatus();
}

// The layer allocator's part of a policy config, shared by every policy.
absl::Status ResolveAllocatorConfig(AllocatorConfig& allocator) {
  switch (allocator.kind) {
    case LayerAllocatorKind::kDefault:
    case LayerAllocatorKind::kUniform:
    case LayerAllocatorKind::kPyramidKv:
    case LayerAllocatorKind::kD2o:
    case LayerAllocatorKind::kCake:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.allocator.kind is not a known allocator: ", static_cast<int>(allocator.kind)));
  }
  if (allocator.min_layer_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.allocator.min_layer_tokens must be >= 0, got ", allocator.min_layer_tokens));
  }
  if (allocator.pyramid_beta == 0.0f) allocator.pyramid_beta = 20.0f;  // zero = the default
  // Written so that NaN fails too.
  if (!(allocator.pyramid_beta >= 1.0f && allocator.pyramid_beta <= 1e6f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.allocator.pyramid_beta must be in [1, 1e6], got ", allocator.pyramid_beta));
  }
  return absl::OkStatus();
}

}  // namespace

void LayerPolicyState::Compact(int32_t num_kv_heads, int32_t old_count,
                               absl::Span<const std::vector<int32_t>> sources) {
  const int32_t keep = sources.empty() ? 0 : static_cast<int32_t>(sources[0].size());
  // Hole-filling plans keep most slots where they are (source[t] == t) and fill the holes from
  // slots at or past `keep`. Then each row shrinks in place with one memmove of its first
  // `keep` values, and only the filled holes are patched, from beyond what the move wrote; a
  // decode step that drops one token per head costs a move, not a gather. Other plans take a
  // copy and gather.
  bool hole_filling = true;
  std::vector<std::vector<int32_t>> filled(sources.size());
  for (size_t h = 0; h < sources.size() && hole_filling; ++h) {
    const std::vector<int32_t>& source = sources[h];
    for (int32_t t = 0; t < static_cast<int32_t>(source.size()); ++t) {
      if (source[t] == t) continue;
      if (source[t] < keep) {
        hole_filling = false;
        break;
      }
      filled[h].push_back(t);
    }
  }
  // The step's scores were read by the selection this compaction carries out, and nothing reads
  // them after it: dropped rather than moved, which for SnapKV and CAKE is a [Hq][count] pass
  // per layer and decode step.
  step_scores.clear();
  step_protected_recent = 0;
  std::vector<float> original;
  for (std::vector<float>* array : {&accumulated, &indicator, &key_norms}) {
    if (array->empty()) continue;
    if (old_count == 0) continue;
    const int64_t rows = static_cast<int64_t>(array->size()) / old_count;
    const int64_t rows_per_head = std::max<int64_t>(1, rows / std::max(1, num_kv_heads));
    float* data = array->data();
    if (hole_filling) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = r / rows_per_head;
        const float* from = data + r * old_count;
        float* to = data + r * keep;
        std::memmove(to, from, sizeof(float) * keep);
        for (int32_t t : filled[h]) to[t] = from[sources[h][t]];
      }
    } else {
      original = *array;
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<int32_t>& source = sources[r / rows_per_head];
        const float* from = original.data() + r * old_count;
        float* to = data + r * keep;
        for (int32_t t = 0; t < keep; ++t) to[t] = from[source[t]];
      }
    }
    array->resize(static_cast<size_t>(rows * keep));
  }
}

void LayerPolicyState::Extend(int32_t num_kv_heads, int32_t old_count, int32_t added,
                              const float* added_key_norms) {
  if (added > 0) {
    const size_t heads = static_cast<size_t>(num_kv_heads);
    if (added_key_norms == nullptr || key_norms.size() != heads * old_count) {
      key_norms.clear();  // not known for the new keys, or not for the old ones
    } else {
      // Grown in place, last head first, each head's new norms after its old ones.
      const size_t new_count = static_cast<size_t>(old_count) + added;
      key_norms.resize(heads * new_count);
      float* data = key_norms.data();
      for (size_t h = heads; h-- > 0;) {
        std::memmove(data + h * new_count, data + h * old_count, sizeof(float) * old_count);
        std::memcpy(data + h * new_count + old_count, added_key_norms + h * added,
                    sizeof(float) * added);
      }
    }
  }
  for (std::vector<float>* array : {&accumulated, &indicator, &step_scores}) {
    if (array->empty() || old_count == 0 || added <= 0) continue;
    const int64_t rows = static_cast<int64_t>(array->size()) / old_count;
    const int64_t new_count = int64_t{old_count} + added;
    // Grown in place, last row first (each row moves right), so a decode step's one new slot
    // costs a move of the array rather than a fresh allocation and copy.
    array->resize(static_cast<size_t>(rows * new_count));
    float* data = array->data();
    for (int64_t r = rows - 1; r >= 0; --r) {
      if (r > 0)
        std::memmove(data + r * new_count, data + r * old_count, sizeof(float) * old_count);
      std::fill(data + r * new_count + old_count, data + (r + 1) * new_count, 0.0f);
    }
  }
}

absl::Status LayerAllocator::Observe(Backend&, Phase, const LayerStep&) const {
  return absl::OkStatus();
}

absl::Status LayerAllocator::ObserveLayers(Backend& backend, Phase phase,
                                           absl::Span<const LayerStep> layers) const {
  for (const LayerStep& layer : layers) KVS_RETURN_IF_ERROR(Observe(backend, phase, layer));
  return absl::OkStatus();
}

AttentionRequirement Policy::attention(Phase phase) const {
  const AttentionRequirement scorer = ScorerAttention(phase);
  const AttentionRequirement allocator = allocator_->attention(phase);
  AttentionRequirement combined;
  combined.needed = scorer.needed || allocator.needed;
  // 0 means "every query": it wins over any trailing count.
  if ((scorer.needed && scorer.trailing_queries == 0) ||
      (allocator.needed && allocator.trailing_queries == 0)) {
    combined.trailing_queries = 0;
  } else {
    combined.trailing_queries = std::max(scorer.needed ? scorer.trailing_queries : 0,
                                         allocator.needed ? allocator.trailing_queries : 0);
  }
  // Sums serve when every part that reads attention reads only the column sums of the same rows
  // (D2O's scorer and allocator both read the accumulated sums of every query). Accumulated
  // attention is itself a column sum (AccumulateColumnSums adds a summed step's one row as it
  // would add every row).
  const bool scorer_sums = !scorer.needed || scorer.column_sums;
  const bool allocator_sums = !allocator.needed || allocator.column_sums;
  const bool same_rows =
      !scorer.needed || !allocator.needed || scorer.trailing_queries == allocator.trailing_queries;
  combined.column_sums = combined.needed && scorer_sums && allocator_sums && same_rows;
  return combined;
}

absl::Status Policy::Observe(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const {
  // Accumulated attention (H2O's and D2O's scores, D2O's layer density) is kept here, once,
  // whichever of the scorer and the allocator reads it.
  if (needs_accumulated()) {
    for (const LayerStep& layer : layers) {
      KVS_RETURN_IF_ERROR(AccumulateColumnSums(config_.name, layer));
    }
  }
  KVS_RETURN_IF_ERROR(ObserveLayers(backend, phase, layers));
  return allocator_->ObserveLayers(backend, phase, layers);
}

absl::Status Policy::ObserveLayers(Backend&, Phase, absl::Span<const LayerStep>) const {
  return absl::OkStatus();
}

absl::Status Policy::Merge(Backend&, Phase, absl::Span<const LayerSelection>,
                           absl::Span<int32_t> merged) const {
  std::fill(merged.begin(), merged.end(), 0);
  return absl::OkStatus();
}

absl::Status ScoredPolicy::Select(Backend& backend, Phase phase,
                                  absl::Span<const LayerSelection> layers) const {
  std::vector<LayerSelection> active;
  for (const LayerSelection& layer : layers) {
    KVS_RETURN_IF_ERROR(CheckSelection(layer));
    const int32_t count = layer.keys.count;
    if (layer.scores_out != nullptr && count > 0) {
      active.push_back(layer);         // a dry run wants the scores even when nothing is evicted
    } else if (layer.keep == count) {  // nothing to choose: keep every slot
      for (int32_t h = 0; h < layer.keys.num_kv_heads; ++h) {
        std::iota(layer.kept.begin() + int64_t{h} * count,
                  layer.kept.begin() + int64_t{h + 1} * count, 0);
      }
    } else if (layer.keep > 0 && !RanksTokens()) {
      KVS_RETURN_IF_ERROR(KeepProtected(phase, layer));
    } else if (layer.keep > 0) {
      active.push_back(layer);
    }
  }
  if (active.empty()) return absl::OkStatus();

  // One zeroed buffer for every active layer's scores, another for the forced masks.
  std::vector<size_t> offsets(active.size() + 1, 0);
  for (size_t i = 0; i < active.size(); ++i) {
    offsets[i + 1] = offsets[i] + active[i].positions.size();
  }
  std::vector<float> scores(offsets.back(), 0.0f);
  std::vector<float*> score_ptrs(active.size());
  for (size_t i = 0; i < active.size(); ++i) score_ptrs[i] = scores.data() + offsets[i];
  KVS_RETURN_IF_ERROR(Score(backend, phase, active, score_ptrs));

  std::vector<uint8_t> forced;
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  std::vector<TopKJob> jobs(active.size());
  for (size_t i = 0; i < active.size(); ++i) {
    const LayerSelection& layer = active[i];
    const int32_t heads = layer.keys.num_kv_heads;
    const int32_t count = layer.keys.count;
    const Protection protection = Protect(phase, layer);
    if (protection.sinks < 0 || protection.recent < 0 ||
        int64_t{protection.sinks} + protection.recent > layer.keep) {
      return absl::InternalError(absl::StrCat("policy ", config().name, " protects ",
                                              protection.sinks, " + ", protection.recent,
                                              " tokens of ", layer.keep));
    }
    TopKJob& job = jobs[i];
    job.scores = score_ptrs[i];
    job.positions = layer.positions.data();
    job.rows = heads;
    job.n = count;
    job.k = layer.keep;
    job.kept = layer.kept.data();
    if (protection.sinks + protection.recent > 0) {
      if (forced.empty()) forced.resize(offsets.back());
      uint8_t* mask = forced.data() + offsets[i];
      for (int32_t h = 0; h < heads; ++h) {
        MarkSinksAndRecent(layer.positions.data() + int64_t{h} * count, count, protection.sinks,
                           protection.recent, scratch, bitmap, mask + int64_t{h} * count);
      }
      job.forced = mask;
    }
  }
  // `forced` may have been allocated after some jobs were filled: it is sized once, before the
  // first mask is written, so the pointers taken above stay valid.
  // A layer whose heads all hold the same positions, scores and protection (TOVA over all heads,
  // before any per-head eviction) has one choice for every head: rank one row, copy it.
  std::vector<int32_t> full_rows(jobs.size(), 0);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].rows > 1 && RowsIdentical(jobs[i])) {
      full_rows[i] = jobs[i].rows;
      jobs[i].rows = 1;
    }
  }
  KVS_RETURN_IF_ERROR(backend.TopK(jobs, nullptr));
  KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (full_rows[i] == 0) continue;
    for (int32_t h = 1; h < full_rows[i]; ++h) {
      std::copy(jobs[i].kept, jobs[i].kept + jobs[i].k, jobs[i].kept + int64_t{h} * jobs[i].k);
    }
    jobs[i].rows = full_rows[i];
  }
  // Dry runs: the scores as the selector saw them, protected slots as +inf.
  for (size_t i = 0; i < active.size(); ++i) {
    if (active[i].scores_out == nullptr) continue;
    const size_t n = active[i].positions.size();
    for (size_t j = 0; j < n; ++j) {
      const bool is_forced = jobs[i].forced != nullptr && jobs[i].forced[j] != 0;
      active[i].scores_out[j] =
          is_forced ? std::numeric_limits<float>::infinity() : score_ptrs[i][j];
    }
  }
  return absl::OkStatus();
}

std::optional<DeviceDecodeRule> ScoredPolicy::DeviceDecode(int32_t keep, int32_t count) const {
  std::optional<DeviceDecodeRule> rule = DeviceScores();
  if (!rule.has_value()) return std::nullopt;
  // What Protect reads of a decode step's layer: its keep and count (SnapKV's step window, which
  // has no device rule, would read the state).
  LayerPolicyState state;
  LayerSelection layer;
  layer.keep = keep;
  layer.keys.count = count;
  layer.state = &state;
  const Protection protection = Protect(Phase::kDecode, layer);
  rule->sinks = protection.sinks;
  rule->recent = protection.recent;
  return rule;
}

absl::Status ScoredPolicy::KeepProtected(Phase phase, const LayerSelection& layer) const {
  const Protection protection = Protect(phase, layer);
  if (protection.sinks < 0 || protection.recent < 0 ||
      int64_t{protection.sinks} + protection.recent != layer.keep) {
    return absl::InternalError(absl::StrCat("policy ", config().name, " protects ",
                                            protection.sinks, " + ", protection.recent,
                                            " tokens but must keep ", layer.keep));
  }
  const int32_t count = layer.keys.count;
  std::vector<uint8_t> forced;
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (int32_t h = 0; h < layer.keys.num_kv_heads; ++h) {
    const int32_t* positions = layer.positions.data() + int64_t{h} * count;
    int32_t* kept = layer.kept.data() + int64_t{h} * layer.keep;
    if (HoldsConsecutivePositions(positions, count)) {  // nothing evicted yet
      std::iota(kept, kept + protection.sinks, 0);
      std::iota(kept + protection.sinks, kept + layer.keep, count - protection.recent);
      continue;
    }
    forced.resize(static_cast<size_t>(count));
    MarkSinksAndRecent(positions, count, protection.sinks, protection.recent, scratch, bitmap,
                       forced.data());
    int32_t written = 0;
    for (int32_t s = 0; s < count && written < layer.keep; ++s) {
      if (forced[s] != 0) kept[written++] = s;
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionScoredPolicy::Score(Backend& backend, Phase phase,
                                          absl::Span<const LayerSelection> layers,
                                          absl::Span<float* const> scores) const {
  std::vector<float> storage;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSelection& layer = layers[i];
    const int32_t heads = layer.keys.num_kv_heads;
    const int32_t count = layer.keys.count;
    KVS_ASSIGN_OR_RETURN(const RawRows raw, RawScores(backend, phase, layer, storage));
    const int32_t rows = raw.rows;
    if (rows < heads || rows % heads != 0 ||
        raw.values.size() != static_cast<size_t>(rows) * static_cast<size_t>(count)) {
      return absl::InternalError(absl::StrCat("policy ", config().name, " gave ", raw.values.size(),
                                              " raw scores in ", rows, " rows for layer ",
                                              layer.layer, " of ", heads, " x ", count));
    }
    GqaMean(raw.values, rows, heads, count,
            absl::MakeSpan(scores[i], static_cast<size_t>(heads) * count));
  }
  return absl::OkStatus();
}

absl::StatusOr<PolicyConfig> ResolvePolicyConfig(const PolicyConfig& config) {
  KVS_ASSIGN_OR_RETURN(const PolicyUnit* unit, FindPolicyUnit(config.name));
  PolicyConfig resolved = config;
  if (unit->resolve != nullptr) KVS_RETURN_IF_ERROR(unit->resolve(resolved));
  KVS_RETURN_IF_ERROR(ResolveAllocatorConfig(resolved.allocator));
  if (!unit->capabilities.composes_with_allocators &&
      resolved.allocator.kind != LayerAllocatorKind::kDefault &&
      resolved.allocator.kind != LayerAllocatorKind::kUniform) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.allocator.kind does not apply to policy ", unit->name,
        ", which splits no budget across layers"));
  }
  return resolved;
}

absl::StatusOr<std::unique_ptr<Policy>> MakePolicy(const PolicyConfig& config) {
  KVS_ASSIGN_OR_RETURN(const PolicyUnit* unit, FindPolicyUnit(config.name));
  KVS_ASSIGN_OR_RETURN(PolicyConfig resolved, ResolvePolicyConfig(config));
  return unit->make(resolved);
}

}  // namespace kvs
