#include "cache/sequence.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/compaction.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr int64_t kMaxPosition = std::numeric_limits<int32_t>::max();
// Rows per Backend::CopyRows job of a compaction (see Evict).
constexpr int64_t kCopyJobRows = 4096;

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
      layers_(layout.num_layers) {}

std::vector<int32_t> Sequence::counts() const {
  std::vector<int32_t> result(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) result[l] = layers_[l].count;
  return result;
}

int32_t Sequence::blocks_held() const {
  int64_t blocks = 0;
  for (const LayerState& layer : layers_) blocks += static_cast<int64_t>(layer.blocks.size());
  return static_cast<int32_t>(blocks);
}

std::vector<int32_t> Sequence::KeepUnder(const Policy& policy, int32_t budget) {
  const std::vector<int32_t> current = counts();
  std::vector<LayerPolicyState> states(current.size());
  AllocationRequest request;
  request.budget = budget;
  request.counts = current;
  request.states = absl::MakeSpan(states);
  request.block_tokens = layout_.block_tokens;
  std::vector<int32_t> keep = current;
  if (absl::StatusOr<Allocation> allocation = policy.AllocateLayers(request); allocation.ok()) {
    keep = std::move(allocation->keep);
  }
  for (size_t l = 0; l < keep.size(); ++l) keep[l] = std::clamp(keep[l], 0, current[l]);
  return keep;
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
  } else {
    if (positions.size() != static_cast<size_t>(num_tokens)) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions has ", positions.size(), " entries, num_tokens is ", num_tokens));
    }
    if (positions[0] < next_position_) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions[0] = ", positions[0],
                       " must be above every position already appended (>= ", next_position_, ")"));
    }
    for (size_t i = 1; i < positions.size(); ++i) {
      if (positions[i] <= positions[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "positions must be strictly increasing: positions[", i, "] = ", positions[i],
            " after positions[", i - 1, "] = ", positions[i - 1]));
      }
    }
    new_positions.assign(positions.begin(), positions.end());
  }
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
  std::vector<int32_t> keep = counts();
  if (strict) {
    const std::vector<int32_t> budgeted = KeepUnder(*policy_, budget_.tokens_per_layer);
    for (int32_t layer : targets) keep[layer] = budgeted[layer];
  }
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

  // Mutations from here on.
  Reservation reservation;
  if (strict) {
    std::vector<int32_t> evict_keep = counts();
    for (int32_t layer : targets) evict_keep[layer] = keep[layer];
    KVS_ASSIGN_OR_RETURN(Eviction eviction, Evict(env, *policy_, evict_keep));
    for (int32_t evicted : eviction.evicted) {
      reservation.evicted_before = std::max(reservation.evicted_before, evicted);
    }
  }
  std::vector<int32_t> new_blocks;
  KVS_RETURN_IF_ERROR(env.allocator.Allocate(static_cast<int32_t>(needed), &new_blocks));
  size_t next_block = 0;
  reservation.reservation_id = reservation_id;
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

absl::StatusOr<CommitResult> Sequence::Commit(const SequenceEnv& env, uint64_t reservation_id,
                                              bool compress_if_over_budget) {
  KVS_RETURN_IF_ERROR(CheckPending(reservation_id));
  Pending pending = std::move(*pending_);
  pending_.reset();
  for (int32_t layer : pending.layers) {
    LayerState& state = layers_[layer];
    // Position rows are made on a layer's first tokens, so an empty sequence stays small even
    // for the largest layouts.
    if (state.positions.empty()) state.positions.resize(layout_.num_kv_heads);
    for (std::vector<int32_t>& head : state.positions) {
      head.insert(head.end(), pending.positions.begin(), pending.positions.end());
    }
    state.count += pending.num_tokens;
    state.appended += pending.num_tokens;
  }
  next_position_ = int64_t{pending.positions.back()} + 1;
  last_committed_ = reservation_id;
  ++version_;
  if (env.tokens_appended != nullptr) {
    *env.tokens_appended +=
        int64_t{pending.num_tokens} * static_cast<int64_t>(pending.layers.size());
  }

  CommitResult result;
  if (compress_if_over_budget && budget_.tokens_per_layer > 0) {
    const std::vector<int32_t> keep = KeepUnder(*policy_, budget_.tokens_per_layer);
    KVS_ASSIGN_OR_RETURN(Eviction eviction, Evict(env, *policy_, keep));
    for (int32_t evicted : eviction.evicted) result.evicted = std::max(result.evicted, evicted);
  }
  result.counts = counts();
  return result;
}

absl::StatusOr<CompressResult> Sequence::Compress(const SequenceEnv& env,
                                                  const CompressParams& params) {
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
  const int32_t budget = params.budget_tokens > 0 ? params.budget_tokens : budget_.tokens_per_layer;

  CompressResult result;
  std::vector<int32_t> evicted(layers_.size(), 0);
  if (budget > 0) {
    const std::vector<int32_t> keep = KeepUnder(policy, budget);
    KVS_ASSIGN_OR_RETURN(Eviction eviction, Evict(env, policy, keep));
    evicted = std::move(eviction.evicted);
    result.blocks_freed = eviction.blocks_freed;
  }
  result.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerCompressResult& out = result.layers[l];
    out.layer = static_cast<int32_t>(l);
    out.kept = layers_[l].count;
    out.evicted = evicted[l];
    if (params.return_positions) {
      out.positions.reserve(static_cast<size_t>(layout_.num_kv_heads) * out.kept);
      for (const std::vector<int32_t>& head : layers_[l].positions) {
        out.positions.insert(out.positions.end(), head.begin(), head.end());
      }
    }
  }
  return result;
}

absl::StatusOr<Sequence::Eviction> Sequence::Evict(const SequenceEnv& env, const Policy& policy,
                                                   absl::Span<const int32_t> keep) {
  Eviction eviction;
  eviction.evicted.assign(layers_.size(), 0);
  std::vector<int32_t> victims;  // layers that lose tokens
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (keep[l] < layers_[l].count) victims.push_back(static_cast<int32_t>(l));
  }
  if (victims.empty()) return eviction;

  // 1. Choose (no mutation).
  const int32_t heads = layout_.num_kv_heads;
  std::vector<std::vector<int32_t>> flat_positions(victims.size());
  std::vector<std::vector<int32_t>> kept(victims.size());
  std::vector<LayerSelection> selections(victims.size());
  for (size_t i = 0; i < victims.size(); ++i) {
    const LayerState& state = layers_[victims[i]];
    flat_positions[i].reserve(static_cast<size_t>(heads) * state.count);
    for (const std::vector<int32_t>& head : state.positions) {
      flat_positions[i].insert(flat_positions[i].end(), head.begin(), head.end());
    }
    kept[i].resize(static_cast<size_t>(heads) * keep[victims[i]]);
    LayerSelection& selection = selections[i];
    selection.layer = victims[i];
    selection.keys.arena = env.arena.data();
    selection.keys.block_table = state.blocks.data();
    selection.keys.count = state.count;
    selection.keys.num_kv_heads = heads;
    selection.keys.head_dim = layout_.head_dim;
    selection.keys.block_tokens = layout_.block_tokens;
    selection.keys.dtype = layout_.dtype;
    selection.keys.block_bytes = layout_.block_bytes();
    selection.positions = flat_positions[i];
    selection.keep = keep[victims[i]];
    selection.kept = absl::MakeSpan(kept[i]);
    selection.num_q_heads = layout_.num_q_heads;
    selection.state = &layers_[victims[i]].policy_state;
    selection.writable_arena = env.arena.data();
  }
  KVS_RETURN_IF_ERROR(policy.Select(env.backend, Phase::kPrefill, selections));

  // 2. Plan the hole-filling moves (no mutation).
  std::vector<CompactionPlan> plans(victims.size());
  std::vector<RowCopyJob> jobs;
  for (size_t i = 0; i < victims.size(); ++i) {
    const LayerState& state = layers_[victims[i]];
    KVS_ASSIGN_OR_RETURN(plans[i], PlanCompaction(layout_, state.blocks, state.count,
                                                  keep[victims[i]], kept[i], state.positions));
    // Pieces of kCopyJobRows rows (1 MiB of 256-byte rows): enough of them for the backend to
    // spread even a single layer's compaction over its threads.
    plans[i].AppendJobs(env.arena.data(), layout_.row_bytes(), kCopyJobRows, jobs);
  }

  // 3. Move rows, then publish the new tables and give the tail blocks back.
  if (!jobs.empty()) {
    KVS_RETURN_IF_ERROR(env.backend.CopyRows(jobs, nullptr));
    KVS_RETURN_IF_ERROR(env.backend.Synchronize(nullptr));
  }
  std::vector<int32_t> to_free;
  int64_t evicted_total = 0;
  for (size_t i = 0; i < victims.size(); ++i) {
    LayerState& state = layers_[victims[i]];
    const int32_t evicted = state.count - keep[victims[i]];
    eviction.evicted[victims[i]] = evicted;
    evicted_total += evicted;
    state.count = keep[victims[i]];
    state.positions = std::move(plans[i].positions);
    to_free.insert(to_free.end(), state.blocks.begin() + plans[i].keep_blocks, state.blocks.end());
    state.blocks.resize(plans[i].keep_blocks);
  }
  eviction.blocks_freed = static_cast<int32_t>(to_free.size());
  ++version_;
  if (env.tokens_evicted != nullptr) *env.tokens_evicted += evicted_total;
  // The blocks were this sequence's, so a failure here is a bookkeeping bug.
  KVS_RETURN_IF_ERROR(env.allocator.Free(to_free));
  return eviction;
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
    view.budget = budget_.tokens_per_layer;
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
  std::vector<int32_t> to_free;
  for (LayerState& state : layers_) {
    to_free.insert(to_free.end(), state.blocks.begin(), state.blocks.end());
    state.blocks.clear();
    state.count = 0;
    state.positions.clear();
  }
  pending_.reset();
  ++version_;
  // Every block was allocated to this sequence; Free cannot fail unless bookkeeping is broken,
  // and then keeping the ids would only leak them for good.
  (void)env.allocator.Free(to_free);
  return static_cast<int32_t>(to_free.size());
}

}  // namespace kvs
