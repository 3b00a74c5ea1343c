// Sequence's policy step, run over one sequence or over every sequence of a call at once:
// observe -> allocate -> select -> merge -> plan and apply the compaction. Each phase is one
// backend call for all the items' layers (a call's attention, one TopK, one CopyRows, ...), so a
// decode step of 64 sequences x 32 layers costs a device what one of one sequence does, instead
// of a round trip per (sequence, layer). On a backend that computes on host memory a call costs
// nothing to split, and the policy's own host work (scoring, ranking) is spread across the host
// threads one layer at a time, as before (Backend::batches_calls).
//
// Policies are immutable and treat every layer on its own (cache/policy/policy.h), so layers of
// different sequences whose policies have equal configurations go to one policy call.
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache/compaction.h"
#include "cache/policy/registry.h"
#include "cache/sequence.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {

// Rows per Backend::CopyRows job of a compaction: enough pieces for the backend to spread even
// a single layer's compaction over its threads.
constexpr int64_t kCopyJobRows = 4096;
// Probabilities computed at once by an observation (a chunk of layers; one layer may exceed it).
constexpr uint64_t kMaxProbsBytes = uint64_t{64} << 20;

// Runs run(layers) for a policy call over `layers`: all of them in one call where the backend
// asks for whole batches; otherwise one layer per call, side by side on the host threads (the
// policy's host work per layer is serial: TOVA's means over 32 query heads x 8K slots ran on one
// thread). The first error in layer order is returned.
template <typename Layer, typename Run>
absl::Status SideBySide(const Backend& backend, ThreadPool* host_pool,
                        absl::Span<const Layer> layers, const Run& run) {
  if (layers.empty()) return absl::OkStatus();
  if (backend.batches_calls() || host_pool == nullptr || layers.size() < 2) return run(layers);
  std::vector<absl::Status> statuses(layers.size());
  host_pool->ParallelFor(static_cast<int64_t>(layers.size()),
                         [&](int64_t k) { statuses[k] = run(layers.subspan(k, 1)); });
  for (const absl::Status& status : statuses) KVS_RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

// fn(i) for every item, side by side on the host threads: per-sequence bookkeeping of a step
// (choices, publishing) touches only its own sequence. The first error in item order.
template <typename Fn>
absl::Status EachItem(ThreadPool* host_pool, size_t n, const Fn& fn) {
  std::vector<absl::Status> statuses(n);
  if (host_pool != nullptr && n > 1) {
    host_pool->ParallelFor(static_cast<int64_t>(n), [&](int64_t i) { statuses[i] = fn(i); });
  } else {
    for (size_t i = 0; i < n; ++i) statuses[i] = fn(i);
  }
  for (const absl::Status& status : statuses) KVS_RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

// The items' policies in groups of equal configuration and phase, in the order first met. One
// policy of a group serves the layers of every item in it.
class PolicyGroups {
 public:
  size_t Of(const Policy& policy, Phase phase) {
    const auto known = by_policy_.find(std::make_pair(&policy, phase));
    if (known != by_policy_.end()) return known->second;
    FieldWriter writer;
    // A configuration the registry cannot encode gets a group of its own.
    std::string key = EncodePolicyConfig(policy.config(), writer).ok()
                          ? writer.Take()
                          : absl::StrCat("policy@", reinterpret_cast<uintptr_t>(&policy));
    key.push_back(phase == Phase::kDecode ? 'd' : 'p');
    size_t group = policies_.size();
    for (size_t g = 0; g < keys_.size(); ++g) {
      if (keys_[g] == key) group = g;
    }
    if (group == policies_.size()) {
      keys_.push_back(std::move(key));
      policies_.push_back(&policy);
      phases_.push_back(phase);
    }
    by_policy_[std::make_pair(&policy, phase)] = group;
    return group;
  }
  size_t size() const { return policies_.size(); }
  const Policy& policy(size_t group) const { return *policies_[group]; }
  Phase phase(size_t group) const { return phases_[group]; }

 private:
  absl::flat_hash_map<std::pair<const Policy*, Phase>, size_t> by_policy_;
  std::vector<std::string> keys_;
  std::vector<const Policy*> policies_;
  std::vector<Phase> phases_;
};

// Each policy group's Observe over its steps: steps[k]'s policy and phase are policy_of(k).
template <typename PolicyOf>
absl::Status ObserveByGroup(Backend& backend, ThreadPool* host_pool,
                            absl::Span<const LayerStep> steps, const PolicyOf& policy_of) {
  PolicyGroups groups;
  std::vector<std::vector<LayerStep>> grouped;  // contiguous for each group's call
  for (size_t k = 0; k < steps.size(); ++k) {
    const auto [policy, phase] = policy_of(k);
    const size_t g = groups.Of(*policy, phase);
    if (g == grouped.size()) grouped.emplace_back();
    grouped[g].push_back(steps[k]);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const Policy& policy = groups.policy(g);
    const Phase phase = groups.phase(g);
    KVS_RETURN_IF_ERROR(SideBySide<LayerStep>(
        backend, host_pool, grouped[g],
        [&](absl::Span<const LayerStep> some) { return policy.Observe(backend, phase, some); }));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Observe ---------------------------------------------------------------------------------

absl::Status Sequence::ObserveAll(absl::Span<const ObserveItem> items) {
  // One entry per (item, listed layer holding tokens), with the rows its policy reads.
  std::vector<ObserveEntry> entries;
  for (size_t t = 0; t < items.size(); ++t) {
    const ObserveItem& item = items[t];
    if (item.attention == nullptr) continue;
    const AttentionRequirement requirement = item.policy->attention(item.phase);
    // A policy that reads no attention (keydiff, streaming_llm) ignores what the worker sent:
    // computing probabilities for it would only cost a pass over every key.
    if (!requirement.needed && !item.policy->needs_accumulated()) continue;
    const AttentionInput& input = *item.attention->input;
    const int32_t w = input.num_queries;
    const int32_t rows =
        requirement.trailing_queries > 0 ? std::min(requirement.trailing_queries, w) : w;
    // The backend sums the rows as it computes them: one [Hq][count] row set per layer instead
    // of `rows` of them (worker-supplied scores are used as sent).
    const bool summed = item.attention->has_queries() && requirement.column_sums && rows > 1;
    const Sequence& sequence = *item.sequence;
    for (size_t i = 0; i < item.attention->layers.size(); ++i) {
      const int32_t count = sequence.layers_[item.attention->layers[i]].count;
      if (count == 0) continue;
      const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(sequence.layout_.num_q_heads) *
                             static_cast<uint64_t>(summed ? 1 : rows) * count;
      entries.push_back(ObserveEntry{t, i, rows, summed, bytes});
    }
  }
  // Chunks whose probabilities fit kMaxProbsBytes (a chunk has at least one layer), so that a
  // long prompt over many layers never holds every layer's at once.
  size_t begin = 0;
  while (begin < entries.size()) {
    size_t end = begin;
    uint64_t bytes = 0;
    while (end < entries.size()) {
      if (end > begin && bytes + entries[end].bytes > kMaxProbsBytes) break;
      bytes += entries[end].bytes;
      ++end;
    }
    KVS_RETURN_IF_ERROR(
        ObserveEntries(items, absl::MakeConstSpan(entries).subspan(begin, end - begin)));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status Sequence::ObserveEntries(absl::Span<const ObserveItem> items,
                                      absl::Span<const ObserveEntry> entries) {
  const size_t n = entries.size();
  Backend& backend = items[entries[0].item].env->backend;
  // Not zeroed: the backend or the copy below writes every value. One buffer per layer (tens of
  // MiB at most) stays below glibc's mmap threshold, so its pages are reused from the heap.
  std::vector<std::unique_ptr<float[]>> probs_buffers(n);
  std::vector<absl::Span<float>> probs(n);
  std::vector<std::vector<int32_t>> positions(n);
  std::vector<std::vector<float>> query_rows(n);
  std::vector<std::vector<int32_t>> query_positions(n);
  std::vector<AttentionJob> jobs;
  std::vector<AttentionSumsJob> sums_jobs;
  for (size_t k = 0; k < n; ++k) {
    const ObserveEntry& entry = entries[k];
    const ObserveItem& item = items[entry.item];
    const Sequence& sequence = *item.sequence;
    const AttentionInput& input = *item.attention->input;
    const int32_t l = item.attention->layers[entry.listed];
    const int64_t count = sequence.layers_[l].count;
    const int64_t hq = sequence.layout_.num_q_heads;
    const int64_t dim = sequence.layout_.head_dim;
    const int32_t w = input.num_queries;
    const int32_t rows = entry.rows;
    const int32_t first_row = w - rows;
    const size_t size = static_cast<size_t>(hq) * (entry.summed ? 1 : rows) * count;
    probs_buffers[k].reset(new float[size]);
    probs[k] = absl::MakeSpan(probs_buffers[k].get(), size);
    positions[k] = sequence.FlatPositions(l);
    query_positions[k].assign(item.attention->query_positions.begin() + first_row,
                              item.attention->query_positions.end());
    if (!item.attention->has_queries()) {
      const float* layer_scores = input.scores.data() + item.attention->score_offsets[entry.listed];
      for (int64_t q = 0; q < hq; ++q) {
        std::copy_n(layer_scores + (q * w + first_row) * count, rows * count,
                    probs[k].data() + q * rows * count);
      }
      continue;
    }
    // [Hq][w][D] of this layer; only the trailing rows when the policy reads no others.
    const float* layer_queries = item.attention->host_queries() + entry.listed * hq * w * dim;
    const float* job_queries = layer_queries;
    if (rows < w) {
      query_rows[k].resize(static_cast<size_t>(hq * rows * dim));
      for (int64_t q = 0; q < hq; ++q) {
        std::copy_n(layer_queries + (q * w + first_row) * dim, rows * dim,
                    query_rows[k].data() + q * rows * dim);
      }
      job_queries = query_rows[k].data();
    }
    AttentionJob job;
    job.keys = sequence.KeysView(*item.env, l);
    job.key_positions = positions[k].data();
    job.queries = job_queries;
    job.query_positions = query_positions[k].data();
    job.num_q_heads = static_cast<int32_t>(hq);
    job.num_queries = rows;
    job.scale = input.softmax_scale;
    if (entry.summed) {
      sums_jobs.push_back({.attention = job, .sums = probs[k].data()});
    } else {
      job.probs = probs[k].data();
      jobs.push_back(job);
    }
  }
  if (!jobs.empty()) {
    KVS_RETURN_IF_ERROR(backend.AttentionProbs(jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  if (!sums_jobs.empty()) {
    KVS_RETURN_IF_ERROR(backend.AttentionColumnSums(sums_jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  std::vector<LayerStep> steps(n);
  for (size_t k = 0; k < n; ++k) {
    const ObserveEntry& entry = entries[k];
    const ObserveItem& item = items[entry.item];
    const Sequence& sequence = *item.sequence;
    const int32_t l = item.attention->layers[entry.listed];
    LayerStep& step = steps[k];
    step.layer = l;
    step.keys = sequence.KeysView(*item.env, l);
    step.positions = positions[k];
    step.num_q_heads = sequence.layout_.num_q_heads;
    step.probs = probs[k];
    step.num_queries = entry.rows;
    step.query_positions = query_positions[k];
    step.step_queries = item.attention->input->num_queries;
    step.summed_rows = entry.summed ? entry.rows : 0;
    step.state = &item.states[l];
  }
  return ObserveByGroup(backend, items[entries[0].item].env->host_pool, steps, [&](size_t k) {
    const ObserveItem& item = items[entries[k].item];
    return std::make_pair(item.policy, item.phase);
  });
}

absl::Status Sequence::Observe(const SequenceEnv& env, const Policy& policy, Phase phase,
                               const StepAttention& attention,
                               absl::Span<LayerPolicyState> states) const {
  const ObserveItem item{this, &env, &policy, phase, &attention, states};
  return ObserveAll(absl::MakeConstSpan(&item, 1));
}

// ---- The whole step --------------------------------------------------------------------------

absl::Status Sequence::RunSteps(absl::Span<StepItem> items) {
  std::vector<ObserveItem> observe;
  for (StepItem& item : items) {
    if (item.attention == nullptr) continue;
    Sequence& sequence = *item.sequence;
    observe.push_back(ObserveItem{&sequence, item.env, item.policy, item.phase, item.attention,
                                  absl::MakeSpan(sequence.states_)});
  }
  KVS_RETURN_IF_ERROR(ObserveAll(observe));
  std::vector<EvictItem> evict;
  evict.reserve(items.size());
  std::vector<size_t> evict_of(items.size(), std::numeric_limits<size_t>::max());
  for (size_t t = 0; t < items.size(); ++t) {
    StepItem& item = items[t];
    Sequence& sequence = *item.sequence;
    item.floor_applied = 0;
    const std::vector<int32_t> current = sequence.counts();
    item.eviction = Eviction{};
    item.eviction.evicted.assign(sequence.layers_.size(), 0);
    item.eviction.merged.assign(sequence.layers_.size(), 0);
    item.eviction.evicted_positions.resize(sequence.layers_.size());
    if (!item.budget.any() && sequence.windows_.empty()) continue;
    KVS_ASSIGN_OR_RETURN(std::vector<int32_t> keep,
                         sequence.KeepFor(*item.policy, item.phase, item.budget, current,
                                          absl::MakeSpan(sequence.states_), &item.floor_applied));
    // Checked before anything changed already; an allocator that moved budgets after observing
    // can still leave an unobserved layer to evict, which must not be chosen blind.
    KVS_RETURN_IF_ERROR(sequence.CoverageError(*item.policy, item.phase, keep, current,
                                               sequence.states_, item.attention));
    // What GetLayout reports as a layer's budget: an allocation other than the uniform one.
    for (size_t l = 0; l < keep.size(); ++l) {
      // A window is not an allocation, and without a budget (windows only) nothing is allocated.
      sequence.allocated_[l] = item.budget.any() && sequence.Window(l) == 0 &&
                                       keep[l] != std::min(item.budget.tokens, current[l])
                                   ? keep[l]
                                   : 0;
    }
    evict_of[t] = evict.size();
    EvictItem& e = evict.emplace_back();
    e.sequence = &sequence;
    e.env = item.env;
    e.policy = item.policy;
    e.phase = item.phase;
    e.keep = std::move(keep);
  }
  KVS_RETURN_IF_ERROR(EvictAll(absl::MakeSpan(evict)));
  for (size_t t = 0; t < items.size(); ++t) {
    if (evict_of[t] < evict.size()) items[t].eviction = std::move(evict[evict_of[t]].eviction);
  }
  return absl::OkStatus();
}

absl::StatusOr<Sequence::Eviction> Sequence::RunStep(const SequenceEnv& env, const Policy& policy,
                                                     Phase phase, const StepAttention* attention,
                                                     const StepBudget& budget,
                                                     int32_t* floor_applied) {
  StepItem item;
  item.sequence = this;
  item.env = &env;
  item.policy = &policy;
  item.phase = phase;
  item.attention = attention;
  item.budget = budget;
  KVS_RETURN_IF_ERROR(RunSteps(absl::MakeSpan(&item, 1)));
  *floor_applied = item.floor_applied;
  return std::move(item.eviction);
}

// ---- Eviction --------------------------------------------------------------------------------

absl::Status Sequence::ChooseAll(absl::Span<EvictItem> items) {
  // Every item's choices first (their buffers are sized before any selection points into them),
  // then one policy call per group over every item's layers.
  ThreadPool* host_pool = items.empty() ? nullptr : items[0].env->host_pool;
  KVS_RETURN_IF_ERROR(EachItem(host_pool, items.size(), [&](size_t t) {
    EvictItem& item = items[t];
    if (!item.victims.empty()) {
      item.sequence->PrepareChoice(*item.env, item.victims, item.keep, item.choice);
    }
    return absl::OkStatus();
  }));
  PolicyGroups groups;
  std::vector<std::vector<LayerSelection>> selections;
  std::vector<std::vector<std::pair<size_t, size_t>>> origins;  // (item, selection) per entry
  for (size_t t = 0; t < items.size(); ++t) {
    EvictItem& item = items[t];
    if (item.victims.empty()) continue;
    const size_t g = groups.Of(*item.policy, item.phase);
    if (g == selections.size()) {
      selections.emplace_back();
      origins.emplace_back();
    }
    for (size_t s = 0; s < item.choice.selections.size(); ++s) {
      selections[g].push_back(item.choice.selections[s]);
      origins[g].emplace_back(t, s);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (selections[g].empty()) continue;
    const EvictItem& first = items[origins[g][0].first];
    Backend& backend = first.env->backend;
    const Policy& policy = groups.policy(g);
    const Phase phase = groups.phase(g);
    KVS_RETURN_IF_ERROR(SideBySide<LayerSelection>(backend, first.env->host_pool, selections[g],
                                                   [&](absl::Span<const LayerSelection> some) {
                                                     return policy.Select(backend, phase, some);
                                                   }));
  }
  return absl::OkStatus();
}

void Sequence::PrepareChoice(const SequenceEnv& env, absl::Span<const int32_t> victims,
                             absl::Span<const int32_t> keep, EvictChoice& choice) {
  const int32_t heads = layout_.num_kv_heads;
  choice.flat_positions.resize(victims.size());
  choice.kept.resize(victims.size());
  choice.scores.resize(retain_evicted_ ? victims.size() : 0);
  choice.selections.reserve(victims.size());  // the policy's layers (windowed ones are not)
  for (size_t i = 0; i < victims.size(); ++i) {
    const int32_t l = victims[i];
    choice.flat_positions[i] = FlatPositions(l);
    choice.kept[i].resize(static_cast<size_t>(heads) * keep[l]);
    if (Window(l) > 0) {
      KeepNewest(l, keep[l], absl::MakeSpan(choice.kept[i]));
      if (retain_evicted_) {
        choice.scores[i].assign(static_cast<size_t>(heads) * layers_[l].count, 0.0f);
      }
      continue;
    }
    LayerSelection& selection = choice.selections.emplace_back();
    selection.layer = l;
    selection.keys = KeysView(env, l);
    selection.positions = choice.flat_positions[i];
    selection.keep = keep[l];
    selection.kept = absl::MakeSpan(choice.kept[i]);
    selection.num_q_heads = layout_.num_q_heads;
    selection.state = &states_[l];
    selection.writable_arena = env.arena.data();
    if (retain_evicted_) {
      choice.scores[i].resize(static_cast<size_t>(heads) * layers_[l].count);
      selection.scores_out = choice.scores[i].data();
    }
  }
}

absl::Status Sequence::PlanAll(absl::Span<EvictItem> items) {
  // Layers are planned independently (reads of their sequence's tables, writes to their own
  // plan and row of evicted_positions), so every (item, victim) runs side by side.
  std::vector<std::pair<size_t, size_t>> work;
  for (size_t t = 0; t < items.size(); ++t) {
    items[t].plans.resize(items[t].victims.size());
    for (size_t i = 0; i < items[t].victims.size(); ++i) work.emplace_back(t, i);
  }
  std::vector<absl::Status> statuses(work.size());
  auto plan_layer = [&](int64_t w) {
    EvictItem& item = items[work[w].first];
    const size_t i = work[w].second;
    const Sequence& sequence = *item.sequence;
    const int32_t l = item.victims[i];
    const LayerState& state = sequence.layers_[l];
    absl::StatusOr<CompactionPlan> plan =
        PlanCompaction(sequence.layout_, state.blocks, state.count, item.keep[l],
                       item.choice.kept[i], state.positions);
    if (!plan.ok()) {
      statuses[w] = plan.status();
      return;
    }
    item.plans[i] = *std::move(plan);
    sequence.LowestEvicted(state, item.keep[l], item.choice.kept[i],
                           item.eviction.evicted_positions[l]);
  };
  ThreadPool* host_pool = items.empty() ? nullptr : items[0].env->host_pool;
  if (host_pool != nullptr) {
    host_pool->ParallelFor(static_cast<int64_t>(work.size()), plan_layer);
  } else {
    for (size_t w = 0; w < work.size(); ++w) plan_layer(static_cast<int64_t>(w));
  }
  for (const absl::Status& status : statuses) KVS_RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

absl::Status Sequence::MergeAll(absl::Span<EvictItem> items) {
  PolicyGroups groups;
  std::vector<std::vector<LayerSelection>> selections;
  std::vector<std::vector<std::pair<size_t, size_t>>> origins;
  for (size_t t = 0; t < items.size(); ++t) {
    EvictItem& item = items[t];
    if (item.victims.empty()) continue;
    const size_t g = groups.Of(*item.policy, item.phase);
    if (g == selections.size()) {
      selections.emplace_back();
      origins.emplace_back();
    }
    for (size_t s = 0; s < item.choice.selections.size(); ++s) {
      selections[g].push_back(item.choice.selections[s]);
      origins[g].emplace_back(t, s);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (selections[g].empty()) continue;
    std::vector<int32_t> merged(selections[g].size(), 0);
    const EvictItem& first = items[origins[g][0].first];
    Backend& backend = first.env->backend;
    const Policy& policy = groups.policy(g);
    const Phase phase = groups.phase(g);
    const LayerSelection* base = selections[g].data();
    // D2O's merge decisions are host work per layer, as its scoring is.
    KVS_RETURN_IF_ERROR(SideBySide<LayerSelection>(
        backend, first.env->host_pool, selections[g], [&](absl::Span<const LayerSelection> some) {
          return policy.Merge(backend, phase, some,
                              absl::MakeSpan(merged).subspan(some.data() - base, some.size()));
        }));
    for (size_t k = 0; k < merged.size(); ++k) {
      EvictItem& item = items[origins[g][k].first];
      const LayerSelection& selection = item.choice.selections[origins[g][k].second];
      item.eviction.merged[selection.layer] = merged[k];
      item.sequence->totals_.merged += merged[k];
      // Merging rewrote kept keys in place: their norms are no longer known.
      if (merged[k] > 0) selection.state->key_norms.clear();
    }
  }
  return absl::OkStatus();
}

absl::Status Sequence::ApplyAll(absl::Span<EvictItem> items) {
  std::vector<RowCopyJob> jobs;
  for (EvictItem& item : items) {
    const uint64_t row_bytes = item.sequence->layout_.row_bytes();
    for (CompactionPlan& plan : item.plans) {
      plan.AppendJobs(item.env->arena.data(), row_bytes, kCopyJobRows, jobs);
    }
  }
  if (!jobs.empty()) {
    Backend& backend = items[0].env->backend;
    KVS_RETURN_IF_ERROR(backend.CopyRows(jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  // Each sequence's tables and policy state, side by side (they share nothing but the
  // thread-safe block allocator and the pool's atomic counters).
  return EachItem(items[0].env->host_pool, items.size(), [&](size_t t) {
    EvictItem& item = items[t];
    return item.victims.empty() ? absl::OkStatus()
                                : item.sequence->PublishCompaction(*item.env, item);
  });
}

absl::Status Sequence::PublishCompaction(const SequenceEnv& env, EvictItem& item) {
  const int32_t heads = layout_.num_kv_heads;
  std::vector<int32_t> to_free;
  int64_t evicted_total = 0;
  for (size_t i = 0; i < item.victims.size(); ++i) {
    const int32_t l = item.victims[i];
    LayerState& state = layers_[l];
    CompactionPlan& plan = item.plans[i];
    const int32_t evicted = state.count - item.keep[l];
    item.eviction.evicted[l] = evicted;
    evicted_total += evicted;
    states_[l].Compact(heads, state.count, plan.sources);
    state.count = item.keep[l];
    state.positions = std::move(plan.positions);
    to_free.insert(to_free.end(), plan.freed_blocks.begin(), plan.freed_blocks.end());
    state.blocks = std::move(plan.block_table);
    item.eviction.bytes_copied += plan.bytes_copied;
  }
  item.eviction.blocks_freed = static_cast<int32_t>(to_free.size());
  ++version_;
  totals_.evicted += evicted_total;
  if (env.tokens_evicted != nullptr) *env.tokens_evicted += evicted_total;
  // The blocks were this sequence's, so a failure here is a bookkeeping bug.
  return env.allocator.Free(to_free);
}

absl::Status Sequence::EvictAll(absl::Span<EvictItem> items) {
  if (items.empty()) return absl::OkStatus();
  for (EvictItem& item : items) {
    Sequence& sequence = *item.sequence;
    item.eviction.evicted.assign(sequence.layers_.size(), 0);
    item.eviction.merged.assign(sequence.layers_.size(), 0);
    item.eviction.evicted_positions.resize(sequence.layers_.size());
    item.victims.clear();  // layers that lose tokens
    for (size_t l = 0; l < sequence.layers_.size(); ++l) {
      if (item.keep[l] < sequence.layers_[l].count) item.victims.push_back(static_cast<int32_t>(l));
    }
  }
  // 1. Choose (no mutation).
  KVS_RETURN_IF_ERROR(ChooseAll(items));
  // retain_evicted: the rows leave for the host tier before anything changes here. A retained
  // chunk is not part of a Checkpoint, so from here on a failure is not rolled back. A failed
  // RetainEvicted keeps nothing (its chunk is pinned last), so the step still rolls back.
  for (EvictItem& item : items) {
    Sequence& sequence = *item.sequence;
    if (!sequence.retain_evicted_ || item.victims.empty()) continue;
    KVS_RETURN_IF_ERROR(sequence.RetainEvicted(*item.env, item.victims, item.keep, item.choice.kept,
                                               item.choice.scores));
    sequence.rows_moved_ = true;
  }
  // 2. Plan the compaction (blocks nobody keeps leave the table, then hole filling; no
  // mutation), and note what each head evicts.
  KVS_RETURN_IF_ERROR(PlanAll(items));
  // 3. Merge evicted rows into kept ones (D2O) while every row is still in place. From here on
  // arena rows change: a failure can no longer be rolled back (gpu/backend.h errors only).
  for (EvictItem& item : items) {
    if (!item.victims.empty()) item.sequence->rows_moved_ = true;
  }
  KVS_RETURN_IF_ERROR(MergeAll(items));
  // 4. Move rows, then publish the new tables, permute the policy state the same way and give
  // the tail blocks back.
  return ApplyAll(items);
}

absl::StatusOr<Sequence::Eviction> Sequence::Evict(const SequenceEnv& env, const Policy& policy,
                                                   Phase phase, absl::Span<const int32_t> keep) {
  EvictItem item;
  item.sequence = this;
  item.env = &env;
  item.policy = &policy;
  item.phase = phase;
  item.keep.assign(keep.begin(), keep.end());
  KVS_RETURN_IF_ERROR(EvictAll(absl::MakeSpan(&item, 1)));
  return std::move(item.eviction);
}

void Sequence::LowestEvicted(const LayerState& state, int32_t keep, absl::Span<const int32_t> kept,
                             std::vector<int32_t>& lowest) const {
  const int32_t heads = layout_.num_kv_heads;
  lowest.assign(heads, -1);
  // Kept slots are distinct, so a head evicts exactly when it keeps fewer than it holds.
  if (keep >= state.count) return;
  // The kept slots masked out by their positions' replacement with the largest value, then one
  // min over the head: a straight loop the compiler vectorises, where a walk over the gaps
  // between kept slots (a few slots each) was mostly branches.
  thread_local std::vector<int32_t> masked;
  masked.resize(state.count);
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  for (int32_t h = 0; h < heads; ++h) {
    const int32_t* positions = state.positions[h].data();
    const int32_t* kept_slots = kept.data() + int64_t{h} * keep;
    std::copy_n(positions, state.count, masked.data());
    for (int32_t t = 0; t < keep; ++t) masked[kept_slots[t]] = kNone;
    int32_t low = kNone;
    for (int32_t s = 0; s < state.count; ++s) low = std::min(low, masked[s]);
    lowest[h] = low;
  }
}

absl::Status Sequence::SelectDryRun(const SequenceEnv& env, const Policy& policy,
                                    absl::Span<const LayerSelection> selections) const {
  return SideBySide<LayerSelection>(env.backend, env.host_pool, selections,
                                    [&](absl::Span<const LayerSelection> some) {
                                      return policy.Select(env.backend, Phase::kPrefill, some);
                                    });
}

}  // namespace kvs
