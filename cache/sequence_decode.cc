// Sequence's decode step (KvPool::DecodeStep): every item checked once, with nothing changed
// (CheckDecode, whose result the step then runs on), then the items of a call stepped together
// (DecodeAll): every new token committed from its reservation or written from the request in one
// backend call, then one policy step over all the items' layers (RunSteps).
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/sequence.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/finite.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {

constexpr int64_t kMaxPosition = std::numeric_limits<int32_t>::max();

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// DecodeItem.attention left at its defaults: the worker sent none.
bool IsEmptyAttention(const AttentionInput& input) {
  return input.layers.empty() && input.num_queries == 0 && input.query_positions.empty() &&
         input.queries.empty() && input.scores.empty() && !input.staging_offset.has_value();
}

// INVALID_ARGUMENT naming the first non-finite value of an inline token [layer][2][H][1][D].
absl::Status CheckInlineToken(const ModelLayout& layout, absl::Span<const uint8_t> kv) {
  const int64_t bad = FirstNonFinite(
      kv.data(), static_cast<int64_t>(kv.size()) / layout.dtype_bytes(), layout.dtype);
  if (bad < 0) return absl::OkStatus();
  const int64_t dim = bad % layout.head_dim;
  const int64_t row = bad / layout.head_dim;  // (layer * 2 + kv) * H + head
  const int64_t head = row % layout.num_kv_heads;
  const int64_t k_or_v = row / layout.num_kv_heads % 2;
  const int64_t layer = row / layout.num_kv_heads / 2;
  return absl::InvalidArgumentError(
      absl::StrCat("inline_kv: non-finite value (NaN or inf) in ", k_or_v == 0 ? "K" : "V",
                   " at layer ", layer, " head ", head, " dim ", dim, "; K/V must be finite"));
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> Sequence::CheckInlineDecode(const SequenceEnv& env,
                                                                 const DecodeItem& item) const {
  const std::optional<uint64_t> expected = CheckedProduct(
      {layout_.num_layers, 2, layout_.num_kv_heads, layout_.head_dim, layout_.dtype_bytes()});
  if (!expected || *expected != item.inline_kv.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline_kv has ", item.inline_kv.size(), " bytes, expected ",
                     expected ? absl::StrCat(*expected) : std::string("an overflowing count"),
                     " ([layers][2][num_kv_heads][1][head_dim] in the session dtype)"));
  }
  // Checked here, on the request's bytes, before anything is written.
  KVS_RETURN_IF_ERROR(CheckInlineToken(layout_, item.inline_kv));
  if (next_position_ > kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline_kv: sequence ", id_, " has no position left"));
  }
  // Under a strict budget the token goes in after the flush down to the budget (keydiff.md §9,
  // as Reserve does), so the blocks are counted after it.
  KVS_ASSIGN_OR_RETURN(const std::vector<int32_t> flushed, StrictFlushKeep());
  const int64_t b = layout_.block_tokens;
  int64_t needed = 0;
  int64_t freed = 0;
  std::vector<int32_t> after(flushed.size());
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    freed += CeilDiv(layers_[l].count, b) - CeilDiv(flushed[l], b);
    if (flushed[l] % b == 0) ++needed;
    after[l] = flushed[l] + 1;
  }
  const int64_t available = env.allocator.free_blocks() + freed;
  if (needed > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "arena of session ", absl::string_view(env.session_id.data(), env.session_id.size()),
        " has ", available, " free blocks, the decode token needs ", needed));
  }
  return after;
}

absl::StatusOr<Sequence::DecodePlan> Sequence::CheckDecode(const SequenceEnv& env,
                                                           const DecodeItem& item,
                                                           PendingRowChecks* checks) {
  const bool has_inline = !item.inline_kv.empty();
  if (item.reservation_id != 0 && has_inline) {
    return absl::InvalidArgumentError(
        "reservation_id and inline_kv are exclusive: give one new token, not two");
  }
  DecodePlan plan;
  std::vector<int32_t> after = counts();
  int64_t next_after = next_position_;
  if (item.reservation_id != 0) {
    KVS_RETURN_IF_ERROR(CheckPending(item.reservation_id));
    if (pending_->num_tokens != 1 ||
        pending_->layers.size() != static_cast<size_t>(layout_.num_layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("reservation_id: reservation ", item.reservation_id, " holds ",
                       pending_->num_tokens, " tokens in ", pending_->layers.size(),
                       " layers; a decode step commits 1 token in all ", layout_.num_layers));
    }
    if (checks != nullptr && env.backend.batches_calls()) {
      plan.rows_deferred = true;
    } else if (checks != nullptr) {
      // The rows the worker wrote, checked with every other item's in one backend call.
      plan.rows_group = checks->groups();
      AddPendingRowChecks(env, *checks);
    } else {
      KVS_RETURN_IF_ERROR(CheckPendingFinite(env));
    }
    after = CountsAfterPending();
    next_after = int64_t{pending_->positions.back()} + 1;
  } else if (pending_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_, " has a pending reservation ", pending_->id,
                     "; give it as reservation_id or cancel it before a decode step"));
  }
  if (has_inline) {
    KVS_ASSIGN_OR_RETURN(after, CheckInlineDecode(env, item));
    next_after = next_position_ + 1;
  }
  if (!IsEmptyAttention(item.attention)) {
    KVS_ASSIGN_OR_RETURN(plan.attention,
                         ValidateAttention(item.attention, after, next_after, true, &env));
  }
  KVS_RETURN_IF_ERROR(
      CheckAttentionCoverage(*policy_, Phase::kDecode, SequenceBudget(), after,
                             plan.attention.has_value() ? &*plan.attention : nullptr));
  return plan;
}

absl::Status Sequence::StageInlineToken(const SequenceEnv& env, const DecodeItem& item,
                                        uint64_t reservation_id, InlineRows& rows) {
  // Under a strict budget the layers are flushed down to it first (CheckInlineDecode counted it).
  KVS_ASSIGN_OR_RETURN(const std::vector<int32_t> flushed, StrictFlushKeep());
  if (flushed != counts()) {
    KVS_RETURN_IF_ERROR(Evict(env, *policy_, Phase::kPrefill, flushed).status());
  }
  // One token in every layer: a block where a layer's last block is full.
  const int64_t b = layout_.block_tokens;
  int32_t needed = 0;
  for (const LayerState& state : layers_) needed += state.count % b == 0 ? 1 : 0;
  std::vector<int32_t> new_blocks;
  KVS_RETURN_IF_ERROR(env.allocator.Allocate(needed, &new_blocks));
  size_t next_block = 0;
  Pending pending;
  pending.id = reservation_id;
  pending.num_tokens = 1;
  const int32_t heads = layout_.num_kv_heads;
  const uint64_t row_bytes = layout_.row_bytes();
  rows.arena_offsets.clear();
  rows.host_offsets.clear();
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    LayerState& state = layers_[l];
    if (state.count % b == 0) state.blocks.push_back(new_blocks[next_block++]);
    pending.layers.push_back(l);
    // The request's rows are [layer][2][H][1][D]: row (l * 2 + kv) * H + h.
    for (int kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        rows.arena_offsets.push_back(
            layout_.SlotRowOffset(state.blocks.data(), kv, h, state.count));
        rows.host_offsets.push_back(((uint64_t{static_cast<uint64_t>(l)} * 2 + kv) * heads + h) *
                                    row_bytes);
      }
    }
  }
  pending.positions = {static_cast<int32_t>(next_position_)};
  pending.payload_bytes = item.inline_kv.size();
  pending_ = std::move(pending);
  return absl::OkStatus();
}

absl::Status Sequence::CommitNewTokens(absl::Span<DecodeTask> tasks) {
  std::vector<InlineRows> rows(tasks.size());
  std::vector<HostRowCopyJob> writes;
  std::vector<size_t> inline_tasks;
  // Blocks are taken in item order (StageInlineToken), so that what each sequence gets does not
  // depend on the schedule; the commits after run side by side.
  for (size_t t = 0; t < tasks.size(); ++t) {
    DecodeTask& task = tasks[t];
    Sequence& sequence = *task.sequence;
    if (task.item->reservation_id != 0 || task.item->inline_kv.empty()) continue;
    KVS_RETURN_IF_ERROR(
        sequence.StageInlineToken(*task.env, *task.item, task.reservation_id, rows[t]));
    task.result.position = sequence.pending_->positions[0];
    inline_tasks.push_back(t);
    HostRowCopyJob& job = writes.emplace_back();
    job.arena = task.env->arena.data();
    // Read only (to_host is false): the request's bytes, checked finite before.
    job.host = const_cast<uint8_t*>(task.item->inline_kv.data());
    job.arena_offsets = rows[t].arena_offsets.data();
    job.host_offsets = rows[t].host_offsets.data();
    job.count = static_cast<int64_t>(rows[t].arena_offsets.size());
    job.row_bytes = sequence.layout_.row_bytes();
    job.to_host = false;
  }
  Backend& backend = tasks[0].env->backend;
  ThreadPool* host_pool = tasks[0].env->host_pool;
  // Every inline token of the call in one backend call: a device gets them in one transfer and
  // one scatter, where a copy per row was a synchronous transfer each.
  if (!writes.empty()) {
    KVS_RETURN_IF_ERROR(backend.CopyHostRows(writes, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  // A policy that keeps key norms takes them through the backend's check of the written rows, so
  // they are the norms its pass over the keys would compute; one call for every such token.
  // The reserved rows whose check was left to the step (DecodePlan::rows_deferred) join it.
  PendingRowChecks checks;
  std::vector<std::pair<size_t, size_t>> groups;  // (task, group)
  for (size_t t : inline_tasks) {
    Sequence& sequence = *tasks[t].sequence;
    if (!sequence.policy_->keeps_key_norms()) continue;
    groups.emplace_back(t, checks.groups());
    sequence.AddPendingRowChecks(*tasks[t].env, checks);
  }
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (!tasks[t].plan.rows_deferred) continue;
    groups.emplace_back(t, checks.groups());
    tasks[t].sequence->AddPendingRowChecks(*tasks[t].env, checks);
  }
  std::sort(groups.begin(), groups.end());  // the lowest failing item is the one reported
  if (!groups.empty()) {
    KVS_RETURN_IF_ERROR(checks.Run(backend));
    for (const auto& [t, group] : groups) {
      const absl::Status rows = tasks[t].sequence->PendingRowsResult(checks.first(group));
      if (!rows.ok()) {
        return absl::Status(rows.code(), absl::StrCat("items[", t, "]: ", rows.message()));
      }
    }
  }
  // Every token joins its sequence (a reserved one's position stays -1: the worker placed it).
  auto commit = [&](int64_t t) {
    const DecodeTask& task = tasks[t];
    if (task.item->reservation_id != 0 || !task.item->inline_kv.empty()) {
      task.sequence->CommitPending(*task.env);
    }
  };
  if (host_pool != nullptr && tasks.size() > 1) {
    host_pool->ParallelFor(static_cast<int64_t>(tasks.size()), commit);
  } else {
    for (size_t t = 0; t < tasks.size(); ++t) commit(static_cast<int64_t>(t));
  }
  return absl::OkStatus();
}

absl::Status Sequence::DecodeChecked(absl::Span<DecodeTask> tasks) {
  KVS_RETURN_IF_ERROR(CommitNewTokens(tasks));
  std::vector<StepItem> steps(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    Sequence& sequence = *tasks[t].sequence;
    StepItem& step = steps[t];
    step.sequence = &sequence;
    step.env = tasks[t].env;
    step.policy = sequence.policy_.get();
    step.phase = Phase::kDecode;
    step.attention = tasks[t].plan.attention.has_value() ? &*tasks[t].plan.attention : nullptr;
    step.budget = sequence.SequenceBudget();
  }
  const absl::Status stepped = RunSteps(absl::MakeSpan(steps));
  for (DecodeTask& task : tasks) task.sequence->ClearStepScores();
  KVS_RETURN_IF_ERROR(stepped);
  for (size_t t = 0; t < tasks.size(); ++t) {
    Sequence& sequence = *tasks[t].sequence;
    DecodeResult& result = tasks[t].result;
    const Eviction& eviction = steps[t].eviction;
    result.counts = sequence.counts();
    const int32_t heads = sequence.layout_.num_kv_heads;
    result.evicted_positions.assign(static_cast<size_t>(sequence.layout_.num_layers) * heads, -1);
    result.merged = 0;
    for (size_t l = 0; l < sequence.layers_.size(); ++l) {
      const std::vector<int32_t>& lowest = eviction.evicted_positions[l];
      for (size_t h = 0; h < lowest.size(); ++h) {
        result.evicted_positions[l * heads + h] = lowest[h];
      }
      result.merged += eviction.merged[l];
    }
  }
  return absl::OkStatus();
}

absl::Status Sequence::LoadStagedQueries(absl::Span<DecodeTask> tasks) {
  std::vector<HostRowCopyJob> reads;
  std::vector<size_t> read_tasks;
  std::vector<uint64_t> offsets(tasks.size());
  static constexpr uint64_t kStart = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (!tasks[t].plan.attention.has_value()) continue;
    StepAttention& step = *tasks[t].plan.attention;
    const AttentionInput& input = *step.input;
    if (!input.staging_offset.has_value() || !step.staged.empty()) continue;
    const ModelLayout& layout = tasks[t].sequence->layout_;
    step.staged.resize(step.layers.size() * static_cast<size_t>(layout.num_q_heads) *
                       input.num_queries * layout.head_dim);
    offsets[t] = tasks[t].env->staging_offset + *input.staging_offset;
    HostRowCopyJob& job = reads.emplace_back();
    job.arena = tasks[t].env->arena.data();
    job.host = reinterpret_cast<uint8_t*>(step.staged.data());
    job.arena_offsets = &offsets[t];
    job.host_offsets = &kStart;
    job.count = 1;
    job.row_bytes = step.staged.size() * sizeof(float);
    job.to_host = true;
    read_tasks.push_back(t);
  }
  if (reads.empty()) return absl::OkStatus();
  Backend& backend = tasks[read_tasks[0]].env->backend;
  absl::Status read = backend.CopyHostRows(reads, nullptr);
  if (read.ok()) read = backend.Synchronize(nullptr);
  for (size_t t : read_tasks) {
    StepAttention& step = *tasks[t].plan.attention;
    if (!read.ok()) {
      step.staged.clear();
      continue;
    }
    read = tasks[t].sequence->CheckLoadedQueries(step);
    if (!read.ok()) {
      read = absl::Status(read.code(), absl::StrCat("items[", t, "]: ", read.message()));
    }
  }
  return read;
}

absl::Status Sequence::DecodeAll(absl::Span<DecodeTask> tasks) {
  if (tasks.empty()) return absl::OkStatus();  // a DecodeStep of no items steps nothing
  // On a device backend the step runs where the tables are when every item can (the device
  // path); otherwise, or when the device found an input wrong, on the host.
  KVS_ASSIGN_OR_RETURN(const bool on_device, DecodeOnDevice(tasks));
  if (on_device) return absl::OkStatus();
  // A host step reads staged queries on the host, checked before anything changes.
  KVS_RETURN_IF_ERROR(LoadStagedQueries(tasks));
  for (DecodeTask& task : tasks) KVS_RETURN_IF_ERROR(task.sequence->LeaveDevice(*task.env));
  std::vector<Checkpoint> checkpoints;
  checkpoints.reserve(tasks.size());
  for (DecodeTask& task : tasks) checkpoints.push_back(task.sequence->TakeCheckpoint());
  const absl::Status status = DecodeChecked(tasks);
  if (!status.ok()) {
    for (size_t t = 0; t < tasks.size(); ++t) {
      tasks[t].sequence->RollbackIfUnmoved(*tasks[t].env, std::move(checkpoints[t]));
    }
  }
  return status;
}

absl::StatusOr<DecodeResult> Sequence::Decode(const SequenceEnv& env, const DecodeItem& item,
                                              uint64_t reservation_id) {
  DecodeTask task;
  task.sequence = this;
  task.env = &env;
  task.item = &item;
  task.reservation_id = reservation_id;
  KVS_ASSIGN_OR_RETURN(task.plan, CheckDecode(env, item, nullptr));
  KVS_RETURN_IF_ERROR(DecodeAll(absl::MakeSpan(&task, 1)));
  return std::move(task.result);
}

}  // namespace kvs
