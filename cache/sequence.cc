#include "cache/sequence.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "cache/compaction.h"
#include "cache/policy/registry.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {

constexpr int64_t kMaxPosition = std::numeric_limits<int32_t>::max();
// Queries of one attention input (AttentionInputs.num_queries).
constexpr int32_t kMaxAttentionQueries = 4096;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One layer's part of an inline payload: `tokens` tokens in slots [first_slot, first_slot +
// tokens) of a layer whose block table is `table`. The part is laid out [2][H][tokens][D].
struct PayloadSegment {
  const std::vector<int32_t>* table = nullptr;
  int32_t first_slot = 0;
  int32_t tokens = 0;
};

uint64_t SegmentBytes(const ModelLayout& layout, const PayloadSegment& segment) {
  return 2ull * layout.num_kv_heads * static_cast<uint64_t>(segment.tokens) * layout.row_bytes();
}

// Calls copy(arena_offset, offset_in_request, bytes) for the payload bytes [offset, offset +
// length), one call per run of rows that are contiguous both in the payload and in one block:
// the same (kv, head) and consecutive in-block slots. Runs may start or end mid-row. The caller
// has checked that [offset, offset + length) lies inside the payload.
template <typename CopyFn>
absl::Status ForEachRun(const ModelLayout& layout, absl::Span<const PayloadSegment> segments,
                        uint64_t offset, uint64_t length, CopyFn&& copy) {
  const uint64_t row_bytes = layout.row_bytes();
  const uint64_t block_bytes = layout.block_bytes();
  const int32_t heads = layout.num_kv_heads;
  const int32_t block_tokens = layout.block_tokens;
  const uint64_t end = offset + length;
  uint64_t segment_start = 0;
  size_t index = 0;
  uint64_t pos = offset;
  while (pos < end) {
    while (index < segments.size() &&
           pos >= segment_start + SegmentBytes(layout, segments[index])) {
      segment_start += SegmentBytes(layout, segments[index]);
      ++index;
    }
    if (index == segments.size()) {
      return absl::InternalError("payload offset past the last layer");
    }
    const PayloadSegment& segment = segments[index];
    const uint64_t local = pos - segment_start;
    const uint64_t row = local / row_bytes;
    const uint64_t in_row = local % row_bytes;
    const int32_t token = static_cast<int32_t>(row % segment.tokens);
    const int32_t kv_head = static_cast<int32_t>(row / segment.tokens);
    const int kv = kv_head / heads;
    const int head = kv_head % heads;
    const int32_t slot = segment.first_slot + token;
    const int32_t in_block = slot % block_tokens;
    const size_t block_index = static_cast<size_t>(slot / block_tokens);
    if (block_index >= segment.table->size()) {
      return absl::InternalError(absl::StrCat("slot ", slot, " has no block"));
    }
    const uint64_t arena_offset =
        static_cast<uint64_t>((*segment.table)[block_index]) * block_bytes +
        layout.RowOffsetInBlock(kv, head, in_block) + in_row;
    const uint64_t to_block_end =
        static_cast<uint64_t>(block_tokens - in_block) * row_bytes - in_row;
    const uint64_t to_segment_rows_end =
        static_cast<uint64_t>(segment.tokens - token) * row_bytes - in_row;
    const uint64_t run = std::min({end - pos, to_block_end, to_segment_rows_end});
    KVS_RETURN_IF_ERROR(copy(arena_offset, pos - offset, run));
    pos += run;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> ResolveLayers(absl::Span<const int32_t> layers,
                                                   int32_t num_layers) {
  std::vector<int32_t> resolved;
  if (layers.empty()) {
    resolved.resize(num_layers);
    for (int32_t l = 0; l < num_layers; ++l) resolved[l] = l;
    return resolved;
  }
  if (layers.size() > static_cast<size_t>(num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers lists ", layers.size(), " layers, the model has ", num_layers));
  }
  std::vector<int32_t> first_index(num_layers, -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int32_t layer = layers[i];
    if (layer < 0 || layer >= num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", i, "] must be in [0, ", num_layers, "), got ", layer));
    }
    if (first_index[layer] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layers[", i, "] = ", layer, " is already listed at layers[", first_index[layer], "]"));
    }
    first_index[layer] = static_cast<int32_t>(i);
  }
  resolved.assign(layers.begin(), layers.end());
  return resolved;
}

Sequence::Sequence(std::string id, const ModelLayout& layout, std::unique_ptr<Policy> policy,
                   BudgetConfig budget, absl::Time created)
    : id_(std::move(id)),
      layout_(layout),
      policy_(std::move(policy)),
      budget_(budget),
      created_(created),
      last_used_(created),
      layers_(layout.num_layers),
      states_(layout.num_layers),
      allocated_(layout.num_layers, 0),
      kind_(MakeSequenceKind(policy_->config())) {}

std::vector<int32_t> Sequence::counts() const {
  std::vector<int32_t> result(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) result[l] = layers_[l].count;
  return result;
}

int32_t Sequence::blocks_held() const {
  int64_t blocks = kind_->extra_blocks();
  for (const LayerState& layer : layers_) blocks += static_cast<int64_t>(layer.blocks.size());
  return static_cast<int32_t>(blocks);
}

absl::Status Sequence::CheckPending(uint64_t reservation_id) const {
  if (pending_.has_value() && pending_->id == reservation_id) return absl::OkStatus();
  if (reservation_id != 0 && reservation_id == last_committed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "reservation ", reservation_id, " of sequence ", id_, " is already committed"));
  }
  if (reservation_id != 0 && reservation_id == last_cancelled_) {
    return absl::FailedPreconditionError(
        absl::StrCat("reservation ", reservation_id, " of sequence ", id_, " was cancelled"));
  }
  return absl::NotFoundError(
      absl::StrCat("reservation ", reservation_id, " not found in sequence ", id_));
}

absl::StatusOr<std::vector<int32_t>> Sequence::ReservePositions(
    int32_t num_tokens, absl::Span<const int32_t> positions,
    absl::Span<const int32_t> targets) const {
  std::vector<int32_t> new_positions(num_tokens);
  if (positions.empty()) {
    if (next_position_ + num_tokens - 1 > kMaxPosition) {
      return absl::InvalidArgumentError(absl::StrCat("num_tokens ", num_tokens,
                                                     " would take positions past ", kMaxPosition,
                                                     " (next_position is ", next_position_, ")"));
    }
    for (int32_t i = 0; i < num_tokens; ++i) {
      new_positions[i] = static_cast<int32_t>(next_position_ + i);
    }
    return new_positions;
  }
  if (positions.size() != static_cast<size_t>(num_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("positions has ", positions.size(), " entries, num_tokens is ", num_tokens));
  }
  // Each layer against its own positions: a cascading prefill commits the same prompt
  // positions layer by layer.
  for (int32_t layer : targets) {
    if (positions[0] < layers_[layer].next_position) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions[0] = ", positions[0],
                       " must be above every position already appended to layer ", layer,
                       " (>= ", layers_[layer].next_position, ")"));
    }
  }
  for (size_t i = 1; i < positions.size(); ++i) {
    if (positions[i] <= positions[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "positions must be strictly increasing: positions[", i, "] = ", positions[i],
          " after positions[", i - 1, "] = ", positions[i - 1]));
    }
  }
  new_positions.assign(positions.begin(), positions.end());
  return new_positions;
}

absl::StatusOr<int64_t> Sequence::ReserveBlocksNeeded(const SequenceEnv& env,
                                                      absl::Span<const int32_t> targets,
                                                      absl::Span<const int32_t> keep,
                                                      int32_t num_tokens) const {
  const int64_t b = layout_.block_tokens;
  int64_t freed = 0;
  int64_t needed = 0;
  for (int32_t layer : targets) {
    const int64_t count = layers_[layer].count;
    const int64_t after = keep[layer];
    if (after + num_tokens > kMaxPosition) {
      return absl::ResourceExhaustedError(absl::StrCat("layer ", layer, " of sequence ", id_,
                                                       " cannot hold more than ", kMaxPosition,
                                                       " tokens"));
    }
    freed += CeilDiv(count, b) - CeilDiv(after, b);
    needed += CeilDiv(after + num_tokens, b) - CeilDiv(after, b);
  }
  const int64_t available = env.allocator.free_blocks() + freed;
  if (needed > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "arena of session ", absl::string_view(env.session_id.data(), env.session_id.size()),
        " has ", available, " free blocks",
        freed > 0 ? absl::StrCat(" (", freed, " of them after eviction)") : std::string(),
        ", reservation needs ", needed));
  }
  return needed;
}

absl::Status Sequence::PlaceReservation(const SequenceEnv& env, absl::Span<const int32_t> targets,
                                        int32_t num_tokens, int64_t needed,
                                        Reservation& reservation) {
  const int64_t b = layout_.block_tokens;
  std::vector<int32_t> new_blocks;
  KVS_RETURN_IF_ERROR(env.allocator.Allocate(static_cast<int32_t>(needed), &new_blocks));
  size_t next_block = 0;
  reservation.layers.reserve(targets.size());
  for (int32_t layer : targets) {
    LayerState& state = layers_[layer];
    const int64_t first = state.count;
    const int64_t end_blocks = CeilDiv(first + num_tokens, b);
    while (static_cast<int64_t>(state.blocks.size()) < end_blocks) {
      state.blocks.push_back(new_blocks[next_block++]);
    }
    LayerSlots slots;
    slots.layer = layer;
    slots.first_slot = static_cast<int32_t>(first);
    slots.blocks.assign(state.blocks.begin() + first / b, state.blocks.begin() + end_blocks);
    reservation.layers.push_back(std::move(slots));
  }
  return absl::OkStatus();
}

absl::StatusOr<Reservation> Sequence::Reserve(const SequenceEnv& env, uint64_t reservation_id,
                                              int32_t num_tokens,
                                              absl::Span<const int32_t> positions,
                                              absl::Span<const int32_t> layers) {
  // Validate everything before anything changes.
  if (num_tokens < 1 || num_tokens > env.max_tokens_per_call) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be in [1, ", env.max_tokens_per_call, "], got ", num_tokens));
  }
  KVS_ASSIGN_OR_RETURN(std::vector<int32_t> targets, ResolveLayers(layers, layout_.num_layers));
  KVS_ASSIGN_OR_RETURN(std::vector<int32_t> new_positions,
                       ReservePositions(num_tokens, positions, targets));
  if (pending_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id_,
                                                      " has a pending reservation ", pending_->id,
                                                      "; commit or cancel it first"));
  }
  const bool strict = budget_.strict && budget_.tokens_per_layer > 0;
  if (strict && num_tokens > budget_.prefill_block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be <= budget.prefill_block_tokens (",
                     budget_.prefill_block_tokens, ") under a strict budget, got ", num_tokens));
  }
  const std::optional<uint64_t> payload_bytes =
      CheckedProduct({static_cast<int64_t>(targets.size()), 2, layout_.num_kv_heads, num_tokens,
                      layout_.head_dim, layout_.dtype_bytes()});
  if (!payload_bytes) {
    return absl::InvalidArgumentError("num_tokens: payload size overflows");
  }

  // Strict budgets evict the reserved layers down to the budget first (keydiff.md §9
  // evict-then-append). Plan the block arithmetic of eviction + reservation up front, so an
  // arena that cannot take the reservation refuses before anything is evicted.
  // A policy that needs attention cannot choose here (Reserve carries none): it evicts at
  // Commit instead, which keeps the same bound of budget + prefill_block_tokens per layer.
  const bool evict_first = strict && !policy_->attention(Phase::kPrefill).needed;
  std::vector<int32_t> keep = counts();
  if (evict_first) {
    std::vector<LayerPolicyState> scratch = states_;  // the allocator may freeze budgets
    int32_t floor_applied = 0;
    KVS_ASSIGN_OR_RETURN(const std::vector<int32_t> budgeted,
                         KeepFor(*policy_, Phase::kPrefill, SequenceBudget(), counts(),
                                 absl::MakeSpan(scratch), &floor_applied));
    for (int32_t layer : targets) keep[layer] = budgeted[layer];
  }
  KVS_ASSIGN_OR_RETURN(const int64_t needed,
                       ReserveBlocksNeeded(env, targets, keep, num_tokens));

  // Mutations from here on.
  Reservation reservation;
  if (evict_first) {
    std::vector<int32_t> evict_keep = counts();
    for (int32_t layer : targets) evict_keep[layer] = keep[layer];
    KVS_RETURN_IF_ERROR(LeaveDevice(env));  // the host path changes the tables
    KVS_ASSIGN_OR_RETURN(Eviction eviction, Evict(env, *policy_, Phase::kPrefill, evict_keep));
    for (int32_t evicted : eviction.evicted) {
      reservation.evicted_before = std::max(reservation.evicted_before, evicted);
    }
  }
  KVS_RETURN_IF_ERROR(PlaceReservation(env, targets, num_tokens, needed, reservation));
  reservation.reservation_id = reservation_id;
  reservation.positions = new_positions;
  reservation.payload_bytes = *payload_bytes;

  Pending pending;
  pending.id = reservation_id;
  pending.num_tokens = num_tokens;
  pending.layers = std::move(targets);
  pending.positions = std::move(new_positions);
  pending.payload_bytes = *payload_bytes;
  pending_ = std::move(pending);
  ++version_;
  return reservation;
}

absl::Status Sequence::Cancel(const SequenceEnv& env, uint64_t reservation_id) {
  KVS_RETURN_IF_ERROR(CheckPending(reservation_id));
  const int64_t b = layout_.block_tokens;
  std::vector<int32_t> to_free;
  for (int32_t layer : pending_->layers) {
    LayerState& state = layers_[layer];
    const size_t committed_blocks = static_cast<size_t>(CeilDiv(state.count, b));
    to_free.insert(to_free.end(), state.blocks.begin() + committed_blocks, state.blocks.end());
  }
  KVS_RETURN_IF_ERROR(env.allocator.Free(to_free));
  for (int32_t layer : pending_->layers) {
    LayerState& state = layers_[layer];
    state.blocks.resize(static_cast<size_t>(CeilDiv(state.count, b)));
  }
  last_cancelled_ = reservation_id;
  pending_.reset();
  ++version_;
  return absl::OkStatus();
}

absl::Status Sequence::WriteReserved(const SequenceEnv& env, uint64_t reservation_id,
                                     uint64_t payload_offset, absl::Span<const uint8_t> bytes) {
  KVS_RETURN_IF_ERROR(CheckPending(reservation_id));
  const std::optional<uint64_t> end = CheckedAdd(payload_offset, bytes.size());
  if (!end || *end > pending_->payload_bytes) {
    return absl::OutOfRangeError(
        absl::StrCat("payload_offset ", payload_offset, " + ", bytes.size(),
                     " bytes is past the reservation's payload_bytes ", pending_->payload_bytes));
  }
  std::vector<PayloadSegment> segments;
  segments.reserve(pending_->layers.size());
  for (int32_t layer : pending_->layers) {
    segments.push_back(
        PayloadSegment{&layers_[layer].blocks, layers_[layer].count, pending_->num_tokens});
  }
  return ForEachRun(layout_, segments, payload_offset, bytes.size(),
                    [&](uint64_t arena_offset, uint64_t from, uint64_t run) {
                      return env.arena.Write(arena_offset, bytes.data() + from, run);
                    });
}

int32_t Sequence::LayerBudget(int32_t l) const {
  if (!budget_.per_layer_tokens.empty()) return budget_.per_layer_tokens[l];
  const int32_t tokens = SequenceBudget().tokens;
  const LayerPolicyState& state = states_[l];
  if (state.frozen_budget > 0 && state.frozen_for == tokens) {
    // A layer frozen at "unbounded" (D2O's full-cache layers) reports 0 = unbounded.
    return state.frozen_budget == std::numeric_limits<int32_t>::max() ? 0 : state.frozen_budget;
  }
  return allocated_[l] > 0 ? allocated_[l] : tokens;
}

int32_t Sequence::FractionBudget(float fraction) const {
  if (!(fraction > 0.0f)) return 0;
  // Fixed once an allocation froze the layers' budgets: they record the budget they were frozen
  // for, so decode (and a restored copy) keeps the prompt's budget instead of re-deriving it
  // from the counts that compression left.
  for (const LayerPolicyState& state : states_) {
    if (state.frozen_budget > 0 && state.frozen_for > 0) return state.frozen_for;
  }
  int64_t prompt = 0;
  for (const LayerState& layer : layers_) prompt = std::max<int64_t>(prompt, layer.count);
  if (prompt == 0) return 0;
  // A non-empty prompt keeps at least one token per layer (0 would read as "unbounded").
  return static_cast<int32_t>(std::max<int64_t>(1, FloorFraction(fraction, prompt)));
}

Sequence::StepBudget Sequence::SequenceBudget() const {
  StepBudget budget;
  if (never_evicts()) return budget;
  budget.tokens = budget_.tokens_per_layer;
  budget.per_layer = budget_.per_layer_tokens;
  // A token budget (uniform or per layer) wins; the policy's fraction form applies only to a
  // sequence that has none.
  if (budget.tokens == 0 && budget.per_layer.empty()) {
    budget.tokens = FractionBudget(policy_->budget_fraction());
  }
  return budget;
}

std::vector<int32_t> Sequence::CountsAfterPending() const {
  std::vector<int32_t> result = counts();
  if (pending_.has_value()) {
    for (int32_t layer : pending_->layers) result[layer] += pending_->num_tokens;
  }
  return result;
}

PagedLayerView Sequence::KeysView(const SequenceEnv& env, int32_t l) const {
  const LayerState& state = layers_[l];
  PagedLayerView view;
  view.arena = env.arena.data();
  view.kv_index = 0;
  view.block_table = state.blocks.data();
  view.count = state.count;
  view.num_kv_heads = layout_.num_kv_heads;
  view.head_dim = layout_.head_dim;
  view.block_tokens = layout_.block_tokens;
  view.dtype = layout_.dtype;
  view.block_bytes = layout_.block_bytes();
  return view;
}

std::vector<int32_t> Sequence::FlatPositions(int32_t l) const {
  const LayerState& state = layers_[l];
  std::vector<int32_t> flat;
  flat.reserve(static_cast<size_t>(layout_.num_kv_heads) * state.count);
  for (const std::vector<int32_t>& head : state.positions) {
    flat.insert(flat.end(), head.begin(), head.end());
  }
  return flat;
}

void Sequence::ClearStepScores() {
  for (LayerPolicyState& state : states_) {
    state.step_scores.clear();
    state.step_protected_recent = 0;
  }
}

void Sequence::CommitPending(const SequenceEnv& env) {
  Pending pending = std::move(*pending_);
  pending_.reset();
  const size_t norms_per_layer = static_cast<size_t>(layout_.num_kv_heads) * pending.num_tokens;
  const bool with_norms = pending.key_norms.size() == pending.layers.size() * norms_per_layer;
  for (size_t i = 0; i < pending.layers.size(); ++i) {
    const int32_t layer = pending.layers[i];
    LayerState& state = layers_[layer];
    // Position rows are made on a layer's first tokens, so an empty sequence stays small even
    // for the largest layouts.
    if (state.positions.empty()) state.positions.resize(layout_.num_kv_heads);
    if (pending.positions.size() == 1) {
      // A decode token: one position per head, appended without the range insert's overhead
      // (a decode commit makes layers x heads of these appends per sequence).
      const int32_t position = pending.positions.front();
      for (std::vector<int32_t>& head : state.positions) head.push_back(position);
    } else {
      for (std::vector<int32_t>& head : state.positions) {
        head.insert(head.end(), pending.positions.begin(), pending.positions.end());
      }
    }
    // New tokens start at zero in every slot-aligned policy array; their keys' norms are the
    // check's, where it took them.
    states_[layer].Extend(layout_.num_kv_heads, state.count, pending.num_tokens,
                          with_norms ? pending.key_norms.data() + i * norms_per_layer : nullptr);
    state.count += pending.num_tokens;
    state.appended += pending.num_tokens;
    state.next_position = int64_t{pending.positions.back()} + 1;
  }
  next_position_ = std::max(next_position_, int64_t{pending.positions.back()} + 1);
  last_committed_ = pending.id;
  ++version_;
  totals_.appended += int64_t{pending.num_tokens} * static_cast<int64_t>(pending.layers.size());
  if (env.tokens_appended != nullptr) {
    *env.tokens_appended +=
        int64_t{pending.num_tokens} * static_cast<int64_t>(pending.layers.size());
  }
}

size_t PendingRowChecks::AddGroup() {
  group_begin_.push_back(jobs_.size());
  return group_begin_.size() - 1;
}

uint64_t* PendingRowChecks::AddJob(const uint8_t* arena, int64_t rows, int32_t row_elements,
                                   DType dtype, float* norms) {
  FiniteCheckJob job;
  job.arena = arena;
  job.count = rows;
  job.row_elements = row_elements;
  job.dtype = dtype;
  job.row_norms = norms;
  jobs_.push_back(job);
  offset_begin_.push_back(offsets_.size());
  offsets_.resize(offsets_.size() + static_cast<size_t>(rows));
  return offsets_.data() + offset_begin_.back();
}

absl::Status PendingRowChecks::Run(Backend& backend) {
  // Pointers are set only now: offsets_ grows while jobs are added.
  first_.assign(jobs_.size(), -1);
  for (size_t j = 0; j < jobs_.size(); ++j) {
    jobs_[j].row_offsets = offsets_.data() + offset_begin_[j];
    jobs_[j].first_non_finite = &first_[j];
  }
  if (jobs_.empty()) return absl::OkStatus();
  KVS_RETURN_IF_ERROR(backend.FindNonFinite(jobs_, nullptr));
  return backend.Synchronize(nullptr);
}

absl::Span<const int64_t> PendingRowChecks::first(size_t group) const {
  const size_t begin = group_begin_[group];
  const size_t end = group + 1 < group_begin_.size() ? group_begin_[group + 1] : first_.size();
  return absl::MakeConstSpan(first_).subspan(begin, end - begin);
}

absl::Status Sequence::CheckPendingFinite(const SequenceEnv& env) {
  PendingRowChecks checks;
  AddPendingRowChecks(env, checks);
  KVS_RETURN_IF_ERROR(checks.Run(env.backend));
  return PendingRowsResult(checks.first(0));
}

void Sequence::AddPendingRowChecks(const SequenceEnv& env, PendingRowChecks& checks) {
  Pending& pending = *pending_;
  const int32_t heads = layout_.num_kv_heads;
  const int32_t tokens = pending.num_tokens;
  // One job per (layer, K or V), rows [head][token]: the backend reads the arena where it lives.
  checks.AddGroup();
  const int64_t rows_per_job = int64_t{heads} * tokens;
  // The keys' norms come with the check's read of them (sized before any job points into them).
  if (policy_->keeps_key_norms()) {
    pending.key_norms.resize(pending.layers.size() * static_cast<size_t>(rows_per_job));
  } else {
    pending.key_norms.clear();
  }
  float* norms = pending.key_norms.empty() ? nullptr : pending.key_norms.data();
  // Each token's slot is placed once per layer (its block and place in the block: a division
  // and a block-table read); every (K or V, head) row of it lies a fixed offset past that. A
  // decode BatchCommit places 64 x 32 x 2 x 8 rows.
  absl::InlinedVector<uint64_t, 16> slot_offset(static_cast<size_t>(tokens));
  for (int32_t layer : pending.layers) {
    const LayerState& state = layers_[layer];
    for (int32_t t = 0; t < tokens; ++t) {
      slot_offset[t] = layout_.SlotRowOffset(state.blocks.data(), 0, 0, int64_t{state.count} + t);
    }
    for (int kv = 0; kv < 2; ++kv) {
      uint64_t* rows = checks.AddJob(env.arena.data(), rows_per_job, layout_.head_dim,
                                     layout_.dtype, kv == 0 ? norms : nullptr);
      for (int32_t h = 0; h < heads; ++h) {
        const uint64_t head_offset = layout_.RowOffsetInBlock(kv, h, 0);
        for (int32_t t = 0; t < tokens; ++t) *rows++ = slot_offset[t] + head_offset;
      }
    }
    if (norms != nullptr) norms += rows_per_job;
  }
}

absl::Status Sequence::PendingRowsResult(absl::Span<const int64_t> first) const {
  const Pending& pending = *pending_;
  const int32_t tokens = pending.num_tokens;
  for (size_t j = 0; j < first.size(); ++j) {
    if (first[j] < 0) continue;
    const int64_t row = first[j] / layout_.head_dim;
    const int64_t token = row % tokens;
    return absl::InvalidArgumentError(absl::StrCat(
        "reservation ", pending.id, ": non-finite value (NaN or inf) in ", j % 2 == 0 ? "K" : "V",
        " at layer ", pending.layers[j / 2], " head ", row / tokens, " token ", token,
        " (position ", pending.positions[token], ") dim ", first[j] % layout_.head_dim,
        " of the rows written into the arena; nothing was committed (rewrite the rows and "
        "commit again, or cancel the reservation)"));
  }
  return absl::OkStatus();
}

Sequence::Checkpoint Sequence::TakeCheckpoint() {
  rows_moved_ = false;
  Checkpoint checkpoint;
  checkpoint.layers = layers_;
  checkpoint.states = states_;
  checkpoint.allocated = allocated_;
  checkpoint.pending = pending_;
  checkpoint.next_position = next_position_;
  checkpoint.version = version_;
  checkpoint.last_committed = last_committed_;
  checkpoint.last_cancelled = last_cancelled_;
  checkpoint.totals = totals_;
  return checkpoint;
}

void Sequence::RollbackIfUnmoved(const SequenceEnv& env, Checkpoint checkpoint) {
  if (rows_moved_) return;
  // Blocks taken since the checkpoint (an inline decode token's) go back to the allocator;
  // nothing was freed, since freeing happens only after rows moved.
  std::vector<int32_t> before;
  for (const LayerState& state : checkpoint.layers) {
    before.insert(before.end(), state.blocks.begin(), state.blocks.end());
  }
  std::sort(before.begin(), before.end());
  std::vector<int32_t> taken;
  for (const LayerState& state : layers_) {
    for (int32_t block : state.blocks) {
      if (!std::binary_search(before.begin(), before.end(), block)) taken.push_back(block);
    }
  }
  if (!taken.empty()) (void)env.allocator.Free(taken);
  const int64_t appended = totals_.appended - checkpoint.totals.appended;
  if (env.tokens_appended != nullptr && appended != 0) *env.tokens_appended -= appended;
  layers_ = std::move(checkpoint.layers);
  states_ = std::move(checkpoint.states);
  allocated_ = std::move(checkpoint.allocated);
  pending_ = std::move(checkpoint.pending);
  next_position_ = checkpoint.next_position;
  // Nobody saw the intermediate state (the session lock is held throughout): the version is the
  // one readers knew.
  version_ = checkpoint.version;
  last_committed_ = checkpoint.last_committed;
  last_cancelled_ = checkpoint.last_cancelled;
  totals_ = checkpoint.totals;
}

namespace {

// The resolved positions of an attention input's w queries: the given ones (non-negative,
// strictly increasing), or the w positions just below `next_position`.
absl::StatusOr<std::vector<int32_t>> QueryPositions(const AttentionInput& input,
                                                    int64_t next_position) {
  const int32_t w = input.num_queries;
  std::vector<int32_t> out;
  if (input.query_positions.empty()) {
    if (next_position < w) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention.num_queries ", w, " exceeds the ", next_position,
                       " positions of the sequence; give attention.query_positions"));
    }
    out.resize(w);
    for (int32_t i = 0; i < w; ++i) out[i] = static_cast<int32_t>(next_position - w + i);
    return out;
  }
  if (input.query_positions.size() != static_cast<size_t>(w)) {
    return absl::InvalidArgumentError(absl::StrCat("attention.query_positions has ",
                                                   input.query_positions.size(),
                                                   " entries, attention.num_queries is ", w));
  }
  for (size_t i = 0; i < input.query_positions.size(); ++i) {
    if (input.query_positions[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention.query_positions[", i, "] must be >= 0, got ", input.query_positions[i]));
    }
    if (i > 0 && input.query_positions[i] <= input.query_positions[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention.query_positions must be strictly increasing: query_positions[", i,
          "] = ", input.query_positions[i], " after ", input.query_positions[i - 1]));
    }
  }
  return input.query_positions;
}

// Queries [listed layers][Hq][w][D] of `input`: the scale, the size (`queries`: inline ones, or
// staged ones as read), every value finite.
absl::Status CheckQueries(const AttentionInput& input, absl::Span<const float> queries,
                          const ModelLayout& layout, absl::Span<const int32_t> layers) {
  const int32_t w = input.num_queries;
  const int64_t num_listed = static_cast<int64_t>(layers.size());
  const int64_t hq = layout.num_q_heads;
  if (!std::isfinite(input.softmax_scale) || input.softmax_scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention.softmax_scale must be finite and > 0, got ", input.softmax_scale));
  }
  const std::optional<uint64_t> expected = CheckedProduct({num_listed, hq, w, layout.head_dim});
  if (!expected || *expected != queries.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention.inline_queries has ", queries.size(), " values, expected ",
                     expected ? absl::StrCat(*expected) : std::string("an overflowing count"),
                     " ([layers ", num_listed, "][num_q_heads ", hq, "][num_queries ", w,
                     "][head_dim ", layout.head_dim, "])"));
  }
  const char* field = input.staging_offset.has_value() ? "staging_offset" : "inline_queries";
  for (size_t i = 0; i < queries.size(); ++i) {
    if (!std::isfinite(queries[i])) {
      // [listed layers][Hq][w][D]
      const int64_t dim = static_cast<int64_t>(i) % layout.head_dim;
      const int64_t row = static_cast<int64_t>(i) / layout.head_dim;
      return absl::InvalidArgumentError(absl::StrCat(
          "attention.", field, ": non-finite value at layer ", layers[row / w / hq], " q head ",
          row / w % hq, " query ", row % w, " dim ", dim, "; queries must be finite"));
    }
  }
  return absl::OkStatus();
}

// The worker's probabilities [listed layers][Hq][w][count of the layer]: the first float of
// every listed layer; the size and every value finite and >= 0 checked.
absl::StatusOr<std::vector<uint64_t>> ScoreOffsets(const AttentionInput& input,
                                                   const ModelLayout& layout,
                                                   absl::Span<const int32_t> layers,
                                                   absl::Span<const int32_t> counts) {
  const int64_t hq = layout.num_q_heads;
  uint64_t total = 0;
  std::vector<uint64_t> offsets(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    offsets[i] = total;
    const std::optional<uint64_t> size = CheckedProduct({hq, input.num_queries, counts[layers[i]]});
    const std::optional<uint64_t> next = size ? CheckedAdd(total, *size) : std::nullopt;
    if (!next) return absl::InvalidArgumentError("attention.attention_scores: size overflows");
    total = *next;
  }
  if (total != input.scores.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention.attention_scores has ", input.scores.size(), " values, expected ", total,
        " ([layers][num_q_heads ", hq, "][num_queries ", input.num_queries,
        "][count of the layer])"));
  }
  for (size_t i = 0; i < input.scores.size(); ++i) {
    const float v = input.scores[i];
    if (!std::isfinite(v) || v < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention.attention_scores[", i, "] must be finite and >= 0, got ", v));
    }
  }
  return offsets;
}

}  // namespace

// Staged queries: where they lie in the session's staging area (4-byte aligned, inside it).
absl::Status CheckStagedQueries(const AttentionInput& input, const ModelLayout& layout,
                                size_t listed, const SequenceEnv* env) {
  if (env == nullptr || env->staging_bytes == 0) {
    return absl::InvalidArgumentError(
        "attention.staging_offset: the session has no query staging area (Attach with "
        "staging_bytes > 0), or send attention.inline_queries");
  }
  const uint64_t offset = *input.staging_offset;
  const std::optional<uint64_t> bytes =
      CheckedProduct({static_cast<int64_t>(listed), layout.num_q_heads, input.num_queries,
                      layout.head_dim, int64_t{sizeof(float)}});
  const std::optional<uint64_t> end = bytes ? CheckedAdd(offset, *bytes) : std::nullopt;
  if (offset % sizeof(float) != 0 || !end || *end > env->staging_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention.staging_offset ", offset, ": ", bytes ? absl::StrCat(*bytes) : "too many",
        " bytes of fp32 queries ([layers ", listed, "][num_q_heads ", layout.num_q_heads,
        "][num_queries ", input.num_queries, "][head_dim ", layout.head_dim,
        "]) must lie 4-byte aligned in the staging area of ", env->staging_bytes, " bytes"));
  }
  if (!std::isfinite(input.softmax_scale) || input.softmax_scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention.softmax_scale must be finite and > 0, got ", input.softmax_scale));
  }
  return absl::OkStatus();
}

absl::StatusOr<Sequence::StepAttention> Sequence::ValidateAttention(
    const AttentionInput& input, absl::Span<const int32_t> counts, int64_t next_position,
    bool decode, const SequenceEnv* env) const {
  StepAttention out;
  out.input = &input;
  absl::StatusOr<std::vector<int32_t>> layers = ResolveLayers(input.layers, layout_.num_layers);
  if (!layers.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("attention.", layers.status().message()));
  }
  out.layers = *std::move(layers);
  out.listed.assign(layout_.num_layers, 0);
  for (int32_t layer : out.layers) out.listed[layer] = 1;

  const int32_t w = input.num_queries;
  if (decode && w != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention.num_queries must be 1 for a decode step, got ", w));
  }
  if (w < 1 || w > kMaxAttentionQueries) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention.num_queries must be in [1, ", kMaxAttentionQueries, "], got ", w));
  }
  KVS_ASSIGN_OR_RETURN(out.query_positions, QueryPositions(input, next_position));

  const bool staged = input.staging_offset.has_value();
  const bool has_queries = !input.queries.empty() || staged;
  const bool has_scores = !input.scores.empty();
  if (has_queries == has_scores || (staged && !input.queries.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention must carry exactly one of attention.inline_queries, "
                     "attention.staging_offset and attention.attention_scores, got ",
                     has_queries ? "more than one" : "none"));
  }
  if (staged) {
    KVS_RETURN_IF_ERROR(CheckStagedQueries(input, layout_, out.layers.size(), env));
  } else if (has_queries) {
    KVS_RETURN_IF_ERROR(CheckQueries(input, input.queries, layout_, out.layers));
  } else {
    KVS_ASSIGN_OR_RETURN(out.score_offsets, ScoreOffsets(input, layout_, out.layers, counts));
  }
  return out;
}

absl::Status Sequence::LoadStagedQueries(const SequenceEnv& env, StepAttention& step) const {
  const AttentionInput& input = *step.input;
  if (!input.staging_offset.has_value() || !step.staged.empty()) return absl::OkStatus();
  const uint64_t values = static_cast<uint64_t>(step.layers.size()) * layout_.num_q_heads *
                          input.num_queries * layout_.head_dim;
  step.staged.resize(values);
  KVS_RETURN_IF_ERROR(env.arena.Read(env.staging_offset + *input.staging_offset, step.staged.data(),
                                     values * sizeof(float)));
  return CheckLoadedQueries(step);
}

absl::Status Sequence::CheckLoadedQueries(StepAttention& step) const {
  absl::Status checked = CheckQueries(*step.input, step.staged, layout_, step.layers);
  if (!checked.ok()) step.staged.clear();
  return checked;
}

absl::StatusOr<std::vector<int32_t>> Sequence::KeepFor(const Policy& policy, Phase phase,
                                                       const StepBudget& budget,
                                                       absl::Span<const int32_t> counts,
                                                       absl::Span<LayerPolicyState> states,
                                                       int32_t* floor_applied) const {
  std::vector<int32_t> keep(counts.begin(), counts.end());
  *floor_applied = 0;
  if (!budget.per_layer.empty()) {
    // Explicit per-layer budgets are the sequence's business and override the allocator.
    for (size_t l = 0; l < keep.size(); ++l) {
      keep[l] = std::min(keep[l], budget.per_layer[l]);
    }
    ApplyWindows(counts, keep);
    return keep;
  }
  if (budget.tokens <= 0) {
    ApplyWindows(counts, keep);
    return keep;
  }
  // The budget is split over the global layers alone: a windowed layer holds its window
  // whatever the budget, so a layer allocator that saw it would either hand its share to the
  // global layers (CAKE, D2O: they would hold more than the budget) or lay its pyramid over layer
  // indices the budget never reaches (PyramidKV: the top global layer would be starved). Without
  // windows every layer is global and the allocator reads the sequence's own spans, copying
  // nothing on this per-step path.
  const bool windowed = !windows_.empty();
  std::vector<size_t> global;  // windowed: the global layers, in order
  std::vector<int32_t> global_counts;
  std::vector<LayerPolicyState> global_states;
  if (windowed) {
    for (size_t l = 0; l < counts.size(); ++l) {
      if (windows_[l] > 0) continue;
      global.push_back(l);
      global_counts.push_back(counts[l]);
      global_states.push_back(std::move(states[l]));
    }
    if (global.empty()) {
      ApplyWindows(counts, keep);
      return keep;
    }
  }
  AllocationRequest request;
  request.phase = phase;
  request.budget = budget.tokens;
  request.counts = windowed ? absl::MakeConstSpan(global_counts) : counts;
  request.states = windowed ? absl::MakeSpan(global_states) : states;
  request.block_tokens = layout_.block_tokens;
  absl::StatusOr<Allocation> allocation = policy.AllocateLayers(request);
  // The allocator may have frozen budgets in the states: they go back whatever it returned.
  for (size_t i = 0; i < global.size(); ++i) states[global[i]] = std::move(global_states[i]);
  if (!allocation.ok()) return allocation.status();
  const size_t allocated = request.counts.size();
  if (allocation->keep.size() != allocated) {
    return absl::InternalError(absl::StrCat("allocator of policy ", policy.config().name, " gave ",
                                            allocation->keep.size(), " keeps for ", allocated,
                                            " layers"));
  }
  for (size_t i = 0; i < allocated; ++i) {
    const size_t l = windowed ? global[i] : i;
    keep[l] = std::clamp(allocation->keep[i], 0, counts[l]);
  }
  *floor_applied = allocation->floor_applied_layers;
  ApplyWindows(counts, keep);
  return keep;
}

void Sequence::ApplyWindows(absl::Span<const int32_t> counts, std::vector<int32_t>& keep) const {
  for (size_t l = 0; l < windows_.size(); ++l) {
    if (windows_[l] > 0) keep[l] = std::min(counts[l], windows_[l]);
  }
}

void Sequence::KeepNewest(int32_t l, int32_t keep, absl::Span<int32_t> kept) const {
  const LayerState& state = layers_[l];
  std::vector<int32_t> order(state.count);
  for (int32_t h = 0; h < layout_.num_kv_heads; ++h) {
    const std::vector<int32_t>& positions = state.positions[h];
    std::iota(order.begin(), order.end(), 0);
    // Positions are distinct within a head: the newest `keep` are the top `keep` by position.
    std::nth_element(order.begin(), order.begin() + (state.count - keep), order.end(),
                     [&](int32_t a, int32_t b) { return positions[a] < positions[b]; });
    std::sort(order.begin() + (state.count - keep), order.end());  // kept slots in slot order
    std::copy(order.begin() + (state.count - keep), order.end(),
              kept.begin() + int64_t{h} * keep);
  }
}

absl::Status Sequence::CoverageError(const Policy& policy, Phase phase,
                                     absl::Span<const int32_t> keep,
                                     absl::Span<const int32_t> counts,
                                     absl::Span<const LayerPolicyState> states,
                                     const StepAttention* attention) const {
  if (!policy.attention(phase).needed) return absl::OkStatus();
  for (size_t l = 0; l < keep.size(); ++l) {
    if (keep[l] >= counts[l] || Window(l) > 0) continue;
    // A layer this call gives no attention for (none at all, or not listed) evicts from what
    // earlier calls left in its state: H2O/D2O (and CAOTE over H2O) from the column sums
    // accumulated by earlier Commit / DecodeStep / Compress attention, CAKE's cascade from its
    // prefill indicator (cake.md TV3), an allocator from its measured preference; so a worker
    // never resends queries the sidecar already folded in. A policy whose choice is this step's
    // attention only (TOVA, SnapKV) keeps nothing between calls. Sums are only what the policy
    // reads: another policy's state (a Compress/Score policy override) does not count.
    const LayerPolicyState& state = states[l];
    const bool remembered = state.measured || !state.indicator.empty() ||
                            (policy.needs_accumulated() && !state.accumulated.empty());
    if ((attention == nullptr || attention->listed[l] == 0) && !remembered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy ", policy.config().name,
          " needs attention (queries or attention_scores) for layer ", l, ": field attention"));
    }
  }
  return absl::OkStatus();
}

absl::Status Sequence::CheckAttentionCoverage(const Policy& policy, Phase phase,
                                              const StepBudget& budget,
                                              absl::Span<const int32_t> counts,
                                              const StepAttention* attention) const {
  if (!budget.any() || !policy.attention(phase).needed) return absl::OkStatus();
  if (attention != nullptr && std::all_of(attention->listed.begin(), attention->listed.end(),
                                          [](uint8_t listed) { return listed != 0; })) {
    return absl::OkStatus();
  }
  // Which layers would evict, decided on copies: allocators may freeze budgets in the states.
  std::vector<LayerPolicyState> scratch = states_;
  for (size_t l = 0; l < scratch.size(); ++l) {
    if (counts[l] > layers_[l].count) {
      scratch[l].Extend(layout_.num_kv_heads, layers_[l].count, counts[l] - layers_[l].count);
    }
  }
  int32_t floor_applied = 0;
  KVS_ASSIGN_OR_RETURN(
      const std::vector<int32_t> keep,
      KeepFor(policy, phase, budget, counts, absl::MakeSpan(scratch), &floor_applied));
  return CoverageError(policy, phase, keep, counts, scratch, attention);
}

absl::StatusOr<CommitResult> Sequence::Commit(const SequenceEnv& env, uint64_t reservation_id,
                                              bool compress_if_over_budget,
                                              const AttentionInput* attention,
                                              const absl::Status* rows_checked) {
  KVS_RETURN_IF_ERROR(CheckPending(reservation_id));
  KVS_RETURN_IF_ERROR(LeaveDevice(env));  // the host path changes the tables
  // Everything is validated against the sequence as it will be after the commit, before
  // anything changes.
  const std::vector<int32_t> after = CountsAfterPending();
  const int64_t next_after = int64_t{pending_->positions.back()} + 1;
  std::optional<StepAttention> step;
  if (attention != nullptr) {
    KVS_ASSIGN_OR_RETURN(step, ValidateAttention(*attention, after, next_after, false, &env));
    KVS_RETURN_IF_ERROR(LoadStagedQueries(env, *step));
  }
  const StepBudget budget = SequenceBudget();
  // Strict budgets of policies that need attention evict here, since Reserve could not.
  const bool strict_here =
      budget_.strict && budget.any() && policy_->attention(Phase::kPrefill).needed;
  const bool evict = budget.any() && (compress_if_over_budget || strict_here);
  const StepAttention* step_ptr = step.has_value() ? &*step : nullptr;
  if (evict) {
    KVS_RETURN_IF_ERROR(CheckAttentionCoverage(*policy_, Phase::kPrefill, budget, after, step_ptr));
  }

  KVS_RETURN_IF_ERROR(rows_checked != nullptr ? *rows_checked : CheckPendingFinite(env));

  // Only a policy step can fail once the checks above passed; a commit without one (a plain
  // decode token) needs no copy of the sequence's state to roll back to.
  if (step_ptr == nullptr && !evict && windows_.empty()) {
    return CommitChecked(env, step_ptr, budget, evict);
  }
  Checkpoint checkpoint = TakeCheckpoint();
  absl::StatusOr<CommitResult> result = CommitChecked(env, step_ptr, budget, evict);
  if (!result.ok()) RollbackIfUnmoved(env, std::move(checkpoint));
  return result;
}

absl::StatusOr<CommitResult> Sequence::CommitChecked(const SequenceEnv& env,
                                                     const StepAttention* step,
                                                     const StepBudget& budget, bool evict) {
  CommitPending(env);
  CommitResult result;
  // A windowed layer drops what fell out of its window at every commit, budget or not.
  if (step != nullptr || evict || !windows_.empty()) {
    int32_t floor_applied = 0;
    absl::StatusOr<Eviction> eviction = RunStep(env, *policy_, Phase::kPrefill, step,
                                                evict ? budget : StepBudget{}, &floor_applied);
    ClearStepScores();
    if (!eviction.ok()) return eviction.status();
    for (int32_t evicted : eviction->evicted) result.evicted = std::max(result.evicted, evicted);
  }
  result.counts = counts();
  return result;
}

absl::StatusOr<CompressResult> Sequence::Compress(const SequenceEnv& env,
                                                  const CompressParams& params) {
  KVS_RETURN_IF_ERROR(LeaveDevice(env));  // the host path changes the tables
  if (never_evicts()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_,
                     " uses policy omnikv, which never evicts: Compress does not apply (Select "
                     "chooses the tokens each decode step attends to)"));
  }
  if (params.policy.has_value() && CapabilitiesOf(*params.policy).never_evicts) {
    return absl::InvalidArgumentError(
        "policy: omnikv is chosen when a sequence is created; it cannot stand in for another "
        "policy in Compress");
  }
  if (params.budget_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_tokens must be >= 0, got ", params.budget_tokens));
  }
  std::unique_ptr<Policy> override_policy;
  if (params.policy.has_value()) {
    KVS_ASSIGN_OR_RETURN(override_policy, MakePolicy(*params.policy));
  }
  if (pending_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id_,
                                                      " has a pending reservation ", pending_->id,
                                                      "; commit or cancel it before compressing"));
  }
  const Policy& policy = override_policy ? *override_policy : *policy_;
  // An explicit budget_tokens is a uniform budget through the allocator; otherwise the
  // sequence's (its per-layer budgets when it has them).
  StepBudget budget = SequenceBudget();
  if (params.budget_tokens > 0) budget = StepBudget{params.budget_tokens, {}};
  std::optional<StepAttention> step;
  if (params.attention.has_value()) {
    KVS_ASSIGN_OR_RETURN(
        step, ValidateAttention(*params.attention, counts(), next_position_, false, &env));
    KVS_RETURN_IF_ERROR(LoadStagedQueries(env, *step));
  }
  const StepAttention* step_ptr = step.has_value() ? &*step : nullptr;
  KVS_RETURN_IF_ERROR(CheckAttentionCoverage(policy, Phase::kPrefill, budget, counts(), step_ptr));

  Checkpoint checkpoint = TakeCheckpoint();
  absl::StatusOr<CompressResult> result =
      CompressChecked(env, policy, step_ptr, budget, params.return_positions);
  if (!result.ok()) RollbackIfUnmoved(env, std::move(checkpoint));
  return result;
}

absl::StatusOr<CompressResult> Sequence::CompressChecked(const SequenceEnv& env,
                                                         const Policy& policy,
                                                         const StepAttention* step,
                                                         const StepBudget& budget,
                                                         bool return_positions) {
  CompressResult result;
  int32_t floor_applied = 0;
  absl::StatusOr<Eviction> eviction =
      RunStep(env, policy, Phase::kPrefill, step, budget, &floor_applied);
  ClearStepScores();
  if (!eviction.ok()) return eviction.status();
  result.blocks_freed = eviction->blocks_freed;
  result.bytes_copied = eviction->bytes_copied;
  result.floor_applied_layers = floor_applied;
  result.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerCompressResult& out = result.layers[l];
    out.layer = static_cast<int32_t>(l);
    out.kept = layers_[l].count;
    out.evicted = eviction->evicted[l];
    out.merged = eviction->merged[l];
    if (return_positions) out.positions = FlatPositions(static_cast<int32_t>(l));
  }
  return result;
}

absl::StatusOr<std::vector<int32_t>> Sequence::StrictFlushKeep() const {
  const bool flush =
      budget_.strict && budget_.tokens_per_layer > 0 && !policy_->attention(Phase::kPrefill).needed;
  if (!flush) return counts();
  std::vector<LayerPolicyState> scratch = states_;  // the allocator may freeze budgets
  int32_t floor_applied = 0;
  return KeepFor(*policy_, Phase::kPrefill, SequenceBudget(), counts(), absl::MakeSpan(scratch),
                 &floor_applied);
}

absl::StatusOr<std::vector<LayerScores>> Sequence::Score(const SequenceEnv& env,
                                                         const ScoreParams& params) const {
  KVS_RETURN_IF_ERROR(SyncHostTables(env));  // the dry run reads the policy state on the host
  if (never_evicts()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_,
                     " uses policy omnikv, which never evicts: Score does not apply (Select "
                     "chooses the tokens each decode step attends to)"));
  }
  if (params.policy.has_value() && CapabilitiesOf(*params.policy).never_evicts) {
    return absl::InvalidArgumentError(
        "policy: omnikv is chosen when a sequence is created; it cannot stand in for another "
        "policy in Score");
  }
  if (params.budget_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_tokens must be >= 0, got ", params.budget_tokens));
  }
  StepBudget budget = SequenceBudget();
  if (params.budget_tokens > 0) budget = StepBudget{params.budget_tokens, {}};
  if (!budget.any()) {
    return absl::InvalidArgumentError(absl::StrCat("budget_tokens must be > 0: sequence ", id_,
                                                   " has no budget to score against"));
  }
  KVS_ASSIGN_OR_RETURN(const std::vector<int32_t> targets,
                       ResolveLayers(params.layers, layout_.num_layers));
  std::unique_ptr<Policy> override_policy;
  if (params.policy.has_value()) {
    KVS_ASSIGN_OR_RETURN(override_policy, MakePolicy(*params.policy));
  }
  if (pending_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id_,
                                                      " has a pending reservation ", pending_->id,
                                                      "; commit or cancel it before scoring"));
  }
  const Policy& policy = override_policy ? *override_policy : *policy_;
  const std::vector<int32_t> current = counts();
  std::optional<StepAttention> step;
  if (params.attention.has_value()) {
    KVS_ASSIGN_OR_RETURN(
        step, ValidateAttention(*params.attention, current, next_position_, false, &env));
    KVS_RETURN_IF_ERROR(LoadStagedQueries(env, *step));
  }
  const StepAttention* step_ptr = step.has_value() ? &*step : nullptr;
  KVS_RETURN_IF_ERROR(CheckAttentionCoverage(policy, Phase::kPrefill, budget, current, step_ptr));

  // The whole step on copies: the sequence's own state never sees this call.
  std::vector<LayerPolicyState> scratch = states_;
  if (step_ptr != nullptr) {
    KVS_RETURN_IF_ERROR(Observe(env, policy, Phase::kPrefill, *step_ptr, absl::MakeSpan(scratch)));
  }
  int32_t floor_applied = 0;
  KVS_ASSIGN_OR_RETURN(
      const std::vector<int32_t> keep,
      KeepFor(policy, Phase::kPrefill, budget, current, absl::MakeSpan(scratch), &floor_applied));
  KVS_RETURN_IF_ERROR(CoverageError(policy, Phase::kPrefill, keep, current, scratch, step_ptr));

  const int32_t heads = layout_.num_kv_heads;
  std::vector<LayerScores> result(targets.size());
  std::vector<LayerSelection> selections;  // the policy's layers (windowed ones are not)
  selections.reserve(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    const int32_t l = targets[i];
    LayerScores& out = result[i];
    out.layer = l;
    out.kept = keep[l];
    out.positions = FlatPositions(l);
    out.scores.assign(static_cast<size_t>(heads) * current[l], 0.0f);
    out.kept_slots.assign(static_cast<size_t>(heads) * keep[l], 0);
    if (Window(l) > 0) {
      KeepNewest(l, keep[l], absl::MakeSpan(out.kept_slots));
      continue;
    }
    LayerSelection& selection = selections.emplace_back();
    selection.layer = l;
    selection.keys = KeysView(env, l);
    selection.positions = out.positions;
    selection.num_q_heads = layout_.num_q_heads;
    selection.keep = keep[l];
    selection.kept = absl::MakeSpan(out.kept_slots);
    selection.state = &scratch[l];
    selection.writable_arena = nullptr;  // a dry run writes nothing
    selection.scores_out = out.scores.data();
  }
  if (!selections.empty()) KVS_RETURN_IF_ERROR(SelectDryRun(env, policy, selections));
  return result;
}

absl::StatusOr<SequenceLayout> Sequence::GetLayout(const SequenceEnv& env,
                                                   absl::Span<const int32_t> layers,
                                                   bool with_positions) const {
  KVS_ASSIGN_OR_RETURN(std::vector<int32_t> targets, ResolveLayers(layers, layout_.num_layers));
  SequenceLayout result;
  result.layers.reserve(targets.size());
  const int64_t b = layout_.block_tokens;
  for (int32_t layer : targets) {
    const LayerState& state = layers_[layer];
    LayerLayoutView view;
    view.layer = layer;
    view.count = state.count;
    view.block_table.assign(state.blocks.begin(), state.blocks.begin() + CeilDiv(state.count, b));
    if (with_positions) {
      view.positions.reserve(static_cast<size_t>(layout_.num_kv_heads) * state.count);
      for (const std::vector<int32_t>& head : state.positions) {
        view.positions.insert(view.positions.end(), head.begin(), head.end());
      }
    }
    view.budget = LayerBudget(layer);
    view.window = Window(layer);
    result.layers.push_back(std::move(view));
  }
  result.next_position = static_cast<int32_t>(std::min(next_position_, kMaxPosition));
  for (const LayerState& state : layers_) {
    result.tokens_appended = std::max(result.tokens_appended, state.appended);
  }
  result.policy = policy_->config();
  result.budget = budget_;
  result.version = version_;
  return result;
}

absl::Status Sequence::ReadExport(const SequenceEnv& env, absl::Span<const int32_t> layers,
                                  uint64_t version, uint64_t payload_offset,
                                  absl::Span<uint8_t> out) const {
  KVS_ASSIGN_OR_RETURN(std::vector<int32_t> targets, ResolveLayers(layers, layout_.num_layers));
  if (version != version_) {
    return absl::AbortedError(absl::StrCat("sequence ", id_, " changed during the export (version ",
                                           version_, ", export of version ", version, ")"));
  }
  std::vector<PayloadSegment> segments;
  segments.reserve(targets.size());
  uint64_t total = 0;
  for (int32_t layer : targets) {
    segments.push_back(PayloadSegment{&layers_[layer].blocks, 0, layers_[layer].count});
    total += SegmentBytes(layout_, segments.back());
  }
  const std::optional<uint64_t> end = CheckedAdd(payload_offset, out.size());
  if (!end || *end > total) {
    return absl::OutOfRangeError(absl::StrCat("payload_offset ", payload_offset, " + ", out.size(),
                                              " bytes is past the export's ", total,
                                              " payload bytes"));
  }
  return ForEachRun(layout_, segments, payload_offset, out.size(),
                    [&](uint64_t arena_offset, uint64_t to, uint64_t run) {
                      return env.arena.Read(arena_offset, out.data() + to, run);
                    });
}

int32_t Sequence::Release(const SequenceEnv& env) {
  device_.reset();
  std::vector<int32_t> to_free;
  for (LayerState& state : layers_) {
    to_free.insert(to_free.end(), state.blocks.begin(), state.blocks.end());
    state.blocks.clear();
    state.count = 0;
    state.positions.clear();
  }
  for (LayerPolicyState& state : states_) state = LayerPolicyState{};
  std::fill(allocated_.begin(), allocated_.end(), 0);
  pending_.reset();
  kind_->Release(to_free);
  // The caller drops the pinned host entries (pinned_host_keys) first.
  retained_.clear();
  retained_keys_.clear();
  ++version_;
  // Every block was allocated to this sequence; Free cannot fail unless bookkeeping is broken,
  // and then keeping the ids would only leak them for good.
  (void)env.allocator.Free(to_free);
  return static_cast<int32_t>(to_free.size());
}

}  // namespace kvs
