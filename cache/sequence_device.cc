// Sequence's decode step on the device: the path a DecodeStep takes on a device backend when
// every item's policy has a device rule (Policy::DeviceDecode) and every layer drops at most one
// token. The sequence's positions and accumulated attention stay in device memory between steps
// (DeviceTables); a step is a few calls queued on one stream, every sequence and layer of the call
// in each: the inline tokens' rows, this step's attention (or KeyDiff scores), the choice of the
// evicted slots (the one transfer back, and the first wait), the compaction, and one final wait.
// Only the evicted slots cross the bus: the host updates its own positions, counts and blocks
// from them, which the host path would have computed the same way. Anything the device finds
// wrong (non-finite rows, bad probabilities) sends the call to the host path, which reports it;
// the device changed nothing the host reads until then.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/sequence.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr uint64_t kScratchAlignment = 256;

uint64_t AlignUp(uint64_t n) {
  return (n + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// Room for growth: a mirror is made again only when a layer outgrows it.
int32_t StrideFor(int32_t count) { return (count + 64) / 32 * 32 + 32; }

}  // namespace

absl::Status Sequence::SyncHostTables(const SequenceEnv& env) const {
  if (device_ == nullptr || !device_->host_stale) return absl::OkStatus();
  DeviceTables& tables = *device_;
  std::vector<uint8_t> image(tables.buffer->size());
  KVS_RETURN_IF_ERROR(env.backend.ReadBuffer(*tables.buffer, 0, image.data(), image.size()));
  // Logically const: the host copy of state the device holds, brought up to date.
  Sequence& self = const_cast<Sequence&>(*this);
  const int32_t hq = layout_.num_q_heads;
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    const int32_t count = layers_[l].count;
    std::vector<float>& accumulated = self.states_[l].accumulated;
    accumulated.resize(static_cast<size_t>(hq) * count);
    const uint8_t* rows = image.data() + l * tables.layer_bytes + tables.accumulated_offset;
    for (int32_t r = 0; r < hq; ++r) {
      std::memcpy(accumulated.data() + int64_t{r} * count,
                  rows + sizeof(float) * static_cast<uint64_t>(r) * tables.stride,
                  sizeof(float) * count);
    }
  }
  tables.host_stale = false;
  return absl::OkStatus();
}

absl::Status Sequence::LeaveDevice(const SequenceEnv& env) {
  if (device_ == nullptr) return absl::OkStatus();
  KVS_RETURN_IF_ERROR(SyncHostTables(env));
  device_.reset();
  return absl::OkStatus();
}

absl::Status Sequence::EnsureDeviceTables(const SequenceEnv& env, bool accumulated) {
  int32_t longest = 0;
  for (const LayerState& layer : layers_) longest = std::max(longest, layer.count);
  // The step's token joins every layer: its slot must fit.
  if (device_ != nullptr && device_->stride > longest && (!accumulated || device_->accumulated)) {
    return absl::OkStatus();
  }
  KVS_RETURN_IF_ERROR(LeaveDevice(env));
  auto tables = std::make_unique<DeviceTables>();
  const int32_t heads = layout_.num_kv_heads;
  const int32_t hq = layout_.num_q_heads;
  tables->stride = StrideFor(longest + 1);
  tables->accumulated = accumulated;
  const uint64_t positions_bytes = sizeof(int32_t) * static_cast<uint64_t>(heads) * tables->stride;
  tables->accumulated_offset = AlignUp(positions_bytes);
  const uint64_t accumulated_bytes =
      accumulated ? sizeof(float) * static_cast<uint64_t>(hq) * tables->stride : 0;
  tables->layer_bytes = AlignUp(tables->accumulated_offset + accumulated_bytes);
  const uint64_t total = tables->layer_bytes * static_cast<uint64_t>(layout_.num_layers);
  KVS_ASSIGN_OR_RETURN(tables->buffer, env.backend.AllocateBuffer(total));
  // One image of every layer's tables, one copy to the device.
  std::vector<uint8_t> image(total, 0);
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    const LayerState& layer = layers_[l];
    uint8_t* base = image.data() + l * tables->layer_bytes;
    for (int32_t h = 0; h < heads && !layer.positions.empty(); ++h) {
      std::memcpy(base + sizeof(int32_t) * static_cast<uint64_t>(h) * tables->stride,
                  layer.positions[h].data(), sizeof(int32_t) * layer.count);
    }
    const std::vector<float>& sums = states_[l].accumulated;
    if (!accumulated || sums.size() != static_cast<size_t>(hq) * layer.count) continue;
    for (int32_t r = 0; r < hq; ++r) {
      std::memcpy(base + tables->accumulated_offset +
                      sizeof(float) * static_cast<uint64_t>(r) * tables->stride,
                  sums.data() + int64_t{r} * layer.count, sizeof(float) * layer.count);
    }
  }
  KVS_RETURN_IF_ERROR(env.backend.WriteBuffer(*tables->buffer, 0, image.data(), total));
  device_ = std::move(tables);
  return absl::OkStatus();
}

bool Sequence::PlanDeviceStep(const SequenceEnv& env, const DecodeTask& task, DeviceStep& step) {
  const Policy& policy = *policy_;
  if (never_evicts() || !windows_.empty() || retain_evicted_ || layout_.block_tokens < 2) {
    return false;
  }
  // An allocator that reads this step's attention or accumulated attention decides on the host.
  if (policy.allocator().needs_accumulated() ||
      policy.allocator().attention(Phase::kDecode).needed) {
    return false;
  }
  const DecodeItem& item = *task.item;
  if (item.reservation_id == 0 && item.inline_kv.empty()) return false;  // no token: host path
  step.new_position =
      item.reservation_id != 0 ? pending_->positions[0] : static_cast<int32_t>(next_position_);
  if (item.reservation_id == 0) {
    absl::StatusOr<std::vector<int32_t>> flushed = StrictFlushKeep();
    if (!flushed.ok() || *flushed != counts()) return false;
  }
  const StepAttention* attention =
      task.plan.attention.has_value() ? &*task.plan.attention : nullptr;
  // A query below a key masks it (causal): the device step assumes none is.
  if (attention != nullptr && attention->query_positions.back() < step.new_position) return false;
  std::vector<int32_t> after = counts();
  for (int32_t& count : after) ++count;
  int32_t floor_applied = 0;
  absl::StatusOr<std::vector<int32_t>> keep = KeepFor(
      policy, Phase::kDecode, SequenceBudget(), after, absl::MakeSpan(states_), &floor_applied);
  if (!keep.ok()) return false;
  step.keep = *std::move(keep);
  step.rules.resize(after.size());
  step.accumulated = false;
  for (size_t l = 0; l < after.size(); ++l) {
    if (after[l] - step.keep[l] > 1) return false;
    std::optional<DeviceDecodeRule> rule = policy.DeviceDecode(step.keep[l], after[l]);
    if (!rule.has_value()) return false;
    step.rules[l] = *rule;
    step.accumulated = step.accumulated || rule->scores == DecodeScores::kAccumulated;
  }
  return true;
}

absl::StatusOr<bool> Sequence::DecodeOnDevice(absl::Span<DecodeTask> tasks) {
  if (tasks.empty() || !tasks[0].env->backend.batches_calls()) return false;
  std::vector<DeviceStep> steps(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (!tasks[t].sequence->PlanDeviceStep(*tasks[t].env, tasks[t], steps[t])) return false;
  }
  for (size_t t = 0; t < tasks.size(); ++t) {
    KVS_RETURN_IF_ERROR(tasks[t].sequence->EnsureDeviceTables(*tasks[t].env, steps[t].accumulated));
  }
  DeviceCall call;
  absl::StatusOr<bool> chosen = ChooseOnDevice(tasks, absl::MakeSpan(steps), call);
  if (!chosen.ok() || !*chosen) {
    // Queued calls may still be writing the taken slots: they finish before the blocks go back.
    if (!chosen.ok()) (void)tasks[0].env->backend.Synchronize(nullptr);
    for (size_t t = 0; t < tasks.size(); ++t) {
      tasks[t].sequence->UndoDeviceStep(*tasks[t].env, steps[t]);
    }
    if (!chosen.ok()) return chosen.status();
    return false;  // the host path reports what the device found
  }
  Backend& backend = tasks[0].env->backend;
  KVS_RETURN_IF_ERROR(backend.DecodeEvict(call.jobs, DecodeStage::kApply, QueuedStream()));
  KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Sequence& sequence = *tasks[t].sequence;
    const size_t slots = sequence.layers_.size() * sequence.layout_.num_kv_heads;
    tasks[t].sequence->PublishDeviceStep(
        *tasks[t].env, tasks[t], steps[t],
        absl::MakeConstSpan(call.evicted).subspan(call.evicted_begin[t], slots));
  }
  return true;
}

absl::StatusOr<bool> Sequence::ChooseOnDevice(absl::Span<DecodeTask> tasks,
                                              absl::Span<DeviceStep> steps, DeviceCall& call) {
  Backend& backend = tasks[0].env->backend;
  // 1. The inline tokens: their slots taken, their rows written in one queued call.
  std::vector<HostRowCopyJob> writes;
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (tasks[t].item->reservation_id != 0) continue;
    Sequence& sequence = *tasks[t].sequence;
    KVS_RETURN_IF_ERROR(sequence.TakeTokenSlots(*tasks[t].env, steps[t]));
    HostRowCopyJob& job = writes.emplace_back();
    job.arena = tasks[t].env->arena.data();
    job.host = const_cast<uint8_t*>(tasks[t].item->inline_kv.data());  // read only
    job.arena_offsets = steps[t].rows.arena_offsets.data();
    job.host_offsets = steps[t].rows.host_offsets.data();
    job.count = static_cast<int64_t>(steps[t].rows.arena_offsets.size());
    job.row_bytes = sequence.layout_.row_bytes();
  }
  if (!writes.empty()) KVS_RETURN_IF_ERROR(backend.CopyHostRows(writes, QueuedStream()));
  // 2. The jobs, and the scratch for this step's attention and KeyDiff scores.
  KVS_RETURN_IF_ERROR(BuildDeviceJobs(tasks, steps, call));
  if (!call.attention.empty()) {
    KVS_RETURN_IF_ERROR(backend.AttentionProbs(call.attention, QueuedStream()));
  }
  if (!call.keydiff.empty()) {
    KVS_RETURN_IF_ERROR(backend.KeyDiffScores(call.keydiff, QueuedStream()));
  }
  // 3. The choice: the evicted slots come back, the one transfer to the host and the first wait.
  KVS_RETURN_IF_ERROR(backend.DecodeEvict(call.jobs, DecodeStage::kChoose, nullptr));
  // A job that found its input wrong says so in one of its heads' entries.
  for (const int32_t slot : call.evicted) {
    if (slot == kDecodeRowsNotFinite || slot == kDecodeScoresInvalid) return false;
  }
  return true;
}

absl::Status Sequence::TakeTokenSlots(const SequenceEnv& env, DeviceStep& step) {
  const int64_t b = layout_.block_tokens;
  int32_t needed = 0;
  for (const LayerState& state : layers_) needed += state.count % b == 0 ? 1 : 0;
  std::vector<int32_t> new_blocks;
  KVS_RETURN_IF_ERROR(env.allocator.Allocate(needed, &new_blocks));
  size_t next_block = 0;
  const int32_t heads = layout_.num_kv_heads;
  const uint64_t row_bytes = layout_.row_bytes();
  step.rows.arena_offsets.clear();
  step.rows.host_offsets.clear();
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    LayerState& state = layers_[l];
    if (state.count % b == 0) {
      state.blocks.push_back(new_blocks[next_block++]);
      step.taken_blocks.push_back(l);
    }
    // The request's rows are [layer][2][H][1][D]: row (l * 2 + kv) * H + h.
    for (int kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        step.rows.arena_offsets.push_back(
            layout_.SlotRowOffset(state.blocks.data(), kv, h, state.count));
        step.rows.host_offsets.push_back(
            ((uint64_t{static_cast<uint64_t>(l)} * 2 + kv) * heads + h) * row_bytes);
      }
    }
  }
  return absl::OkStatus();
}

void Sequence::UndoDeviceStep(const SequenceEnv& env, DeviceStep& step) {
  std::vector<int32_t> blocks;
  for (int32_t l : step.taken_blocks) {
    blocks.push_back(layers_[l].blocks.back());
    layers_[l].blocks.pop_back();
  }
  step.taken_blocks.clear();
  if (!blocks.empty()) (void)env.allocator.Free(blocks);
}

absl::Status Sequence::BuildDeviceJobs(absl::Span<DecodeTask> tasks, absl::Span<DeviceStep> steps,
                                       DeviceCall& call) {
  // Sizes first: the scratch is one buffer for the whole call.
  uint64_t scratch_bytes = 0;
  size_t jobs = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Sequence& sequence = *tasks[t].sequence;
    for (int32_t l = 0; l < sequence.layout_.num_layers; ++l) {
      const uint64_t count = static_cast<uint64_t>(sequence.layers_[l].count) + 1;
      const DeviceDecodeRule& rule = steps[t].rules[l];
      const bool probs = sequence.NeedsDeviceProbs(tasks[t], rule, l);
      if (probs) scratch_bytes += AlignUp(sizeof(float) * sequence.layout_.num_q_heads * count);
      if (rule.rows == DeviceDecodeRule::Rows::kKeyDiff) {
        scratch_bytes += AlignUp(sizeof(float) * sequence.layout_.num_kv_heads * count);
      }
      ++jobs;
    }
  }
  Backend& backend = tasks[0].env->backend;
  if (scratch_bytes > 0) {
    KVS_ASSIGN_OR_RETURN(call.scratch, backend.AllocateBuffer(scratch_bytes));
  }
  call.jobs.clear();
  call.jobs.reserve(jobs);
  call.evicted_begin.assign(tasks.size(), 0);
  size_t evicted_total = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    evicted_total += tasks[t].sequence->layers_.size() * tasks[t].sequence->layout_.num_kv_heads;
  }
  call.evicted.assign(evicted_total, -1);
  uint64_t scratch_at = 0;
  size_t evicted_at = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    call.evicted_begin[t] = evicted_at;
    tasks[t].sequence->AddDeviceJobs(tasks[t], steps[t], call, scratch_at, evicted_at);
  }
  return absl::OkStatus();
}

bool Sequence::NeedsDeviceProbs(const DecodeTask& task, const DeviceDecodeRule& rule,
                                int32_t l) const {
  const StepAttention* attention =
      task.plan.attention.has_value() ? &*task.plan.attention : nullptr;
  if (attention == nullptr || attention->listed[l] == 0) return false;
  const bool reads =
      rule.scores == DecodeScores::kAccumulated || rule.rows == DeviceDecodeRule::Rows::kAttention;
  // Worker-given probabilities are read where they are, in the request.
  return reads && attention->has_queries();
}

const float* Sequence::DeviceQueries(const DecodeTask& task, const StepAttention& attention,
                                     size_t listed) const {
  const size_t per_layer = static_cast<size_t>(layout_.num_q_heads) * layout_.head_dim;
  if (!attention.input->staging_offset.has_value() || !attention.staged.empty()) {
    return attention.host_queries() + listed * per_layer;
  }
  // Where the worker wrote them: the arena's staging area, which the device reads in place.
  const uint8_t* area =
      task.env->arena.data() + task.env->staging_offset + *attention.input->staging_offset;
  return reinterpret_cast<const float*>(area) + listed * per_layer;
}

void Sequence::AddDeviceJobs(const DecodeTask& task, const DeviceStep& step, DeviceCall& call,
                             uint64_t& scratch_at, size_t& evicted_at) const {
  const StepAttention* attention =
      task.plan.attention.has_value() ? &*task.plan.attention : nullptr;
  const int32_t heads = layout_.num_kv_heads;
  const int32_t hq = layout_.num_q_heads;
  std::vector<size_t> listed_index(layout_.num_layers, 0);
  if (attention != nullptr) {
    for (size_t i = 0; i < attention->layers.size(); ++i) listed_index[attention->layers[i]] = i;
  }
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    const LayerState& state = layers_[l];
    const int32_t count = state.count + 1;
    const DeviceDecodeRule& rule = step.rules[l];
    DecodeEvictJob& job = call.jobs.emplace_back();
    job.keys = KeysView(*task.env, l);
    job.keys.count = count;
    job.stride = device_->stride;
    job.positions = device_->positions(l);
    job.new_position = step.new_position;
    job.num_q_heads = hq;
    job.scores = rule.scores;
    job.sinks = rule.sinks;
    job.recent = rule.recent;
    job.evict = step.keep[l] < count;
    job.evicted = call.evicted.data() + evicted_at;
    evicted_at += heads;
    if (device_->accumulated) job.accumulated = device_->accumulated_of(l);
    // This step's probabilities [Hq][count]: computed on the device from the request's queries,
    // or the worker's own (in the request, staged with the call).
    const float* probs = nullptr;
    const bool listed = attention != nullptr && attention->listed[l] != 0;
    if (NeedsDeviceProbs(task, rule, l)) {
      float* out = reinterpret_cast<float*>(call.scratch->data() + scratch_at);
      scratch_at += AlignUp(sizeof(float) * hq * count);
      const size_t i = listed_index[l];
      AttentionJob& a = call.attention.emplace_back();
      a.keys = job.keys;
      a.key_positions = job.positions;
      a.key_stride = device_->stride;
      a.queries = DeviceQueries(task, *attention, i);
      if (attention->input->staging_offset.has_value() && attention->staged.empty()) {
        job.queries = a.queries;  // checked on the device: no host check read them
        job.query_values = static_cast<int64_t>(hq) * layout_.head_dim;
      }
      a.query_positions = &attention->query_positions.back();
      a.num_q_heads = hq;
      a.num_queries = 1;
      a.scale = attention->input->softmax_scale;
      a.probs = out;
      probs = out;
    } else if (listed && !attention->input->scores.empty()) {
      probs = attention->input->scores.data() + attention->score_offsets[listed_index[l]];
    }
    if (job.accumulated != nullptr && listed && rule.scores == DecodeScores::kAccumulated) {
      job.sums = probs;
    }
    if (rule.rows == DeviceDecodeRule::Rows::kAttention && probs != nullptr) {
      job.rows = probs;
      job.rows_count = hq;
      job.rows_are_probabilities = true;
    } else if (rule.rows == DeviceDecodeRule::Rows::kKeyDiff) {
      float* out = reinterpret_cast<float*>(call.scratch->data() + scratch_at);
      scratch_at += AlignUp(sizeof(float) * heads * count);
      KeyDiffScoreJob& k = call.keydiff.emplace_back();
      k.keys = job.keys;
      k.anchor = rule.anchor;
      k.metric = rule.metric;
      k.scores = out;
      job.rows = out;
      job.rows_count = heads;
    }
  }
}

void Sequence::PublishDeviceStep(const SequenceEnv& env, DecodeTask& task, const DeviceStep& step,
                                 absl::Span<const int32_t> evicted) {
  const int32_t heads = layout_.num_kv_heads;
  const int64_t b = layout_.block_tokens;
  DecodeResult& result = task.result;
  // The token joins every layer (the reservation's, or the inline one's taken slots).
  if (task.item->reservation_id != 0) {
    last_committed_ = pending_->id;
    pending_.reset();
  } else {
    last_committed_ = task.reservation_id;  // the inline token's own reservation, as on the host
    result.position = step.new_position;
  }
  std::vector<int32_t> to_free;
  int64_t evicted_total = 0;
  const StepBudget budget = SequenceBudget();
  result.evicted_positions.assign(static_cast<size_t>(layout_.num_layers) * heads, -1);
  result.merged = 0;
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    LayerState& state = layers_[l];
    if (state.positions.empty()) state.positions.resize(heads);
    for (std::vector<int32_t>& head : state.positions) head.push_back(step.new_position);
    ++state.count;
    ++state.appended;
    state.next_position = int64_t{step.new_position} + 1;
    // What GetLayout reports as the layer's budget (as the host step sets it).
    if (budget.any()) {
      allocated_[l] = step.keep[l] != std::min(budget.tokens, state.count) ? step.keep[l] : 0;
    }
    if (step.keep[l] >= state.count) continue;
    // The device moved each head's last slot into its evicted one; the host tables follow.
    const int32_t last = state.count - 1;
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t e = evicted[static_cast<size_t>(l) * heads + h];
      std::vector<int32_t>& positions = state.positions[h];
      result.evicted_positions[static_cast<size_t>(l) * heads + h] = positions[e];
      if (e != last) positions[e] = positions[last];
      positions.pop_back();
    }
    --state.count;
    ++evicted_total;
    if (state.count % b == 0 && static_cast<int64_t>(state.blocks.size()) > state.count / b) {
      to_free.push_back(state.blocks.back());
      state.blocks.pop_back();
    }
  }
  // Accumulated attention lives on the device now; the host's copy is brought back on demand
  // (SyncHostTables). Key norms the host kept are not kept up to date by the device step.
  device_->host_stale = device_->accumulated;
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    LayerPolicyState& policy_state = states_[l];
    policy_state.key_norms.clear();
    if (device_->accumulated) {
      policy_state.accumulated.resize(static_cast<size_t>(layout_.num_q_heads) * layers_[l].count);
    }
  }
  next_position_ = std::max(next_position_, int64_t{step.new_position} + 1);
  // The commit and, when a layer lost a token, the eviction, as on the host path.
  version_ += evicted_total > 0 ? 2 : 1;
  const int64_t appended = layout_.num_layers;
  totals_.appended += appended;
  totals_.evicted += evicted_total;
  if (env.tokens_appended != nullptr) *env.tokens_appended += appended;
  if (env.tokens_evicted != nullptr) *env.tokens_evicted += evicted_total;
  if (!to_free.empty()) (void)env.allocator.Free(to_free);
  result.counts = counts();
}

}  // namespace kvs
