// OmniKvKind: an OmniKV sequence's Select (policies/omnikv.md §3-§4, §10).
//
// An OmniKV sequence never evicts, so in every layer slot order is position order and, because
// the worker appends every token to every layer, the prompt (positions below N) occupies the
// first slots of each layer. The exception is a sliding-window layer, which keeps only its last
// W tokens; the plan makes it neither a filter nor a sparse layer, so nothing here reads it.
// Offloading a sparse layer moves those slots to the host tier and slides the layer's generated
// tokens to the front; a filter layer and the sparse layers of its segment therefore index the
// prompt the same way (checked at the first Select), and T_f is kept both as positions (for the
// worker) and as prompt indices (for the gathers).
#include "cache/omnikv.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/sequence.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

int32_t BlocksFor(int64_t tokens, int32_t block_tokens) {
  return static_cast<int32_t>((tokens + block_tokens - 1) / block_tokens);
}

int32_t FilterIndex(const OmniKvConfig& config, int32_t layer) {
  for (size_t i = 0; i < config.filter_layers.size(); ++i) {
    if (config.filter_layers[i] == layer) return static_cast<int32_t>(i);
  }
  return -1;
}

uint64_t RowBytes(const ModelLayout& layout) {
  return static_cast<uint64_t>(layout.head_dim) * DTypeBytes(layout.dtype);
}

// Offset of row (kv, h, t) in a host buffer laid out [2][H][n][D].
uint64_t HostRowOffset(int32_t kv, int32_t h, int32_t t, int32_t heads, int32_t n,
                       uint64_t row_bytes) {
  return ((uint64_t{static_cast<uint32_t>(kv)} * heads + h) * n + static_cast<uint64_t>(t)) *
         row_bytes;
}

}  // namespace

void OmniKvKind::AppendPinnedKeys(std::vector<SpillKey>& keys) const {
  if (state_ != nullptr && state_->host != nullptr) keys.push_back(state_->host_key);
}

void OmniKvKind::Release(std::vector<int32_t>& to_free) {
  if (state_ == nullptr) return;
  for (const std::vector<int32_t>& staging : state_->staging) {
    to_free.insert(to_free.end(), staging.begin(), staging.end());
  }
  state_.reset();
}

int32_t OmniKvKind::PromptSlots(const Sequence& sequence, int32_t layer, int64_t prompt_end) {
  const Sequence::LayerState& state = sequence.layers_[layer];
  if (state.count == 0 || state.positions.empty()) return 0;
  const std::vector<int32_t>& head = state.positions[0];
  return static_cast<int32_t>(
      std::lower_bound(head.begin(), head.begin() + state.count, prompt_end) - head.begin());
}

absl::Status OmniKvKind::CheckSelect(const Sequence& sequence, const SelectItem& item) const {
  const AttentionInput& attention = item.attention;
  if (attention.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention.layers must list the filter layers whose queries the call carries (filter "
        "layers: ",
        absl::StrJoin(config_.filter_layers, ", "), ")"));
  }
  if (!attention.scores.empty()) {
    return absl::InvalidArgumentError(
        "attention.attention_scores is not accepted by Select; send attention.inline_queries");
  }
  if (attention.staging_offset.has_value()) {
    return absl::InvalidArgumentError(
        "attention.staging_offset is not accepted by Select yet; send attention.inline_queries");
  }
  KVS_ASSIGN_OR_RETURN(Sequence::StepAttention resolved,
                       sequence.ValidateAttention(attention, sequence.counts(),
                                                  sequence.next_position_, /*decode=*/false));
  for (size_t i = 0; i < resolved.layers.size(); ++i) {
    if (FilterIndex(config_, resolved.layers[i]) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention.layers[", i, "] = ", resolved.layers[i],
                       " is not a filter layer of the sequence's omnikv policy (filter layers: ",
                       absl::StrJoin(config_.filter_layers, ", "), ")"));
    }
  }
  if (item.prompt_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_tokens must be >= 0, got ", item.prompt_tokens));
  }
  if (state_ == nullptr) return CheckFirstSelect(sequence, item);
  if (item.prompt_tokens != 0 && item.prompt_tokens != state_->prompt_end) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens ", item.prompt_tokens,
                                                   " differs from the ", state_->prompt_end,
                                                   " the sequence's first Select fixed"));
  }
  return absl::OkStatus();
}

absl::Status OmniKvKind::CheckFirstSelect(const Sequence& sequence,
                                          const SelectItem& item) const {
  // The first Select fixes N and checks that each segment indexes the prompt alike.
  const int64_t next_position = sequence.next_position_;
  const int64_t prompt_end = item.prompt_tokens > 0 ? item.prompt_tokens : next_position;
  if (prompt_end > next_position) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens ", item.prompt_tokens,
                                                   " is beyond the sequence's ", next_position,
                                                   " positions"));
  }
  if (config_.offload && sequence.pending_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence.id_, " has a pending reservation (",
                     sequence.pending_->id,
                     "); the first Select offloads the prompt: commit or cancel it first"));
  }
  KVS_ASSIGN_OR_RETURN(OmniKvPlan plan, PlanOmniKvLayers(config_, sequence.layout_.num_layers,
                                                         sequence.layer_windows()));
  for (size_t i = 0; i < config_.filter_layers.size(); ++i) {
    const int32_t f = config_.filter_layers[i];
    const int32_t prompt = PromptSlots(sequence, f, prompt_end);
    for (int32_t j : plan.sparse[i]) {
      const int32_t sparse_prompt = PromptSlots(sequence, j, prompt_end);
      bool same = sparse_prompt == prompt;
      for (int32_t t = 0; same && t < prompt; ++t) {
        same = sequence.layers_[j].positions[0][t] == sequence.layers_[f].positions[0][t];
      }
      if (!same) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer ", j, " holds ", sparse_prompt, " prompt tokens that differ from the ", prompt,
            " of its filter layer ", f, "; every layer of a segment must hold the same prompt"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status OmniKvKind::Begin(Sequence& sequence, SelectTask& task) {
  if (task.scratch == nullptr) task.scratch = std::make_unique<SelectScratch>();
  if (state_ != nullptr) return absl::OkStatus();
  const ModelLayout& layout = sequence.layout_;
  auto state = std::make_unique<OmniKvState>();
  KVS_ASSIGN_OR_RETURN(state->plan,
                       PlanOmniKvLayers(config_, layout.num_layers, sequence.layer_windows()));
  state->prompt_end =
      task.item->prompt_tokens > 0 ? task.item->prompt_tokens : sequence.next_position_;
  state->k = ResolveOmniKvBudget(config_, state->prompt_end);
  state->filters.resize(config_.filter_layers.size());
  state->staging.resize(layout.num_layers);
  state->host_tokens.assign(layout.num_layers, 0);
  if (config_.offload) {
    KVS_RETURN_IF_ERROR(OffloadPrompt(sequence, *task.env, *task.pin, *state));
    KVS_RETURN_IF_ERROR(
        DropOffloadedRows(sequence, *task.env, *task.pin, *state, task.released));
    ++sequence.version_;
  }
  state_ = std::move(state);
  return absl::OkStatus();
}

absl::Status OmniKvKind::OffloadPrompt(Sequence& sequence, const SequenceEnv& env,
                                       const HostPin& pin, OmniKvState& state) const {
  // The sparse layers' prompt rows go to one host buffer per layer, [2][H][n][D].
  const ModelLayout& layout = sequence.layout_;
  const int32_t heads = layout.num_kv_heads;
  const uint64_t row_bytes = RowBytes(layout);
  auto data = std::make_shared<SpilledSequence>();
  data->meta = "omnikv offloaded prompt";
  data->layers.resize(layout.num_layers);
  std::vector<std::vector<uint64_t>> arena_offsets(layout.num_layers);
  std::vector<std::vector<uint64_t>> host_offsets(layout.num_layers);
  std::vector<HostRowCopyJob> jobs;
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    if (state.plan.roles[l] != OmniKvRole::kSparse) continue;
    const int32_t n = PromptSlots(sequence, l, state.prompt_end);
    if (n == 0) continue;
    state.host_tokens[l] = n;
    const uint64_t rows = uint64_t{2} * heads * n;
    data->layers[l].resize(rows * row_bytes);
    std::vector<uint64_t>& arena_rows = arena_offsets[l];
    std::vector<uint64_t>& host_rows = host_offsets[l];
    arena_rows.reserve(rows);
    host_rows.reserve(rows);
    const int32_t* blocks = sequence.layers_[l].blocks.data();
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t t = 0; t < n; ++t) {
          arena_rows.push_back(layout.SlotRowOffset(blocks, kv, h, t));
          host_rows.push_back(HostRowOffset(kv, h, t, heads, n, row_bytes));
        }
      }
    }
    HostRowCopyJob job;
    job.arena = env.arena.data();
    job.host = reinterpret_cast<uint8_t*>(data->layers[l].data());
    job.arena_offsets = arena_rows.data();
    job.host_offsets = host_rows.data();
    job.count = static_cast<int64_t>(rows);
    job.row_bytes = row_bytes;
    job.to_host = true;
    jobs.push_back(job);
  }
  KVS_RETURN_IF_ERROR(env.backend.CopyHostRows(jobs, nullptr));
  state.host_key = SpillKey{"", "", absl::StrCat(sequence.id_, "#omnikv")};
  if (!jobs.empty()) {
    KVS_RETURN_IF_ERROR(pin(state.host_key, data));
    state.host = std::move(data);
  }
  return absl::OkStatus();
}

absl::Status OmniKvKind::DropOffloadedRows(Sequence& sequence, const SequenceEnv& env,
                                           const HostPin& pin, OmniKvState& state,
                                           std::vector<int32_t>& released) const {
  // Each sparse layer keeps only its generated tokens, slid to the front.
  const ModelLayout& layout = sequence.layout_;
  const int32_t heads = layout.num_kv_heads;
  std::vector<RowCopyJob> slides;
  std::vector<std::vector<uint64_t>> slide_src(layout.num_layers), slide_dst(layout.num_layers);
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    const int32_t n = state.host_tokens[l];
    if (n == 0) continue;
    const Sequence::LayerState& layer = sequence.layers_[l];
    const int32_t tail = layer.count - n;
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t i = 0; i < tail; ++i) {
          slide_src[l].push_back(layout.SlotRowOffset(layer.blocks.data(), kv, h, n + i));
          slide_dst[l].push_back(layout.SlotRowOffset(layer.blocks.data(), kv, h, i));
        }
      }
    }
    slides.push_back(RowCopyJob{env.arena.data(), slide_src[l].data(), slide_dst[l].data(),
                                static_cast<int64_t>(slide_src[l].size()), RowBytes(layout)});
  }
  if (absl::Status copied = env.backend.CopyRows(slides, nullptr); !copied.ok()) {
    if (state.host != nullptr) pin(state.host_key, nullptr).IgnoreError();
    return copied;
  }
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    const int32_t n = state.host_tokens[l];
    if (n == 0) continue;
    Sequence::LayerState& layer = sequence.layers_[l];
    layer.count -= n;
    for (std::vector<int32_t>& head : layer.positions) head.erase(head.begin(), head.begin() + n);
    const int32_t keep_blocks = BlocksFor(layer.count, layout.block_tokens);
    released.insert(released.end(), layer.blocks.begin() + keep_blocks, layer.blocks.end());
    layer.blocks.resize(keep_blocks);
  }
  return absl::OkStatus();
}

absl::Status OmniKvKind::Choose(const Sequence& sequence, SelectTask& task) {
  OmniKvState& state = *state_;
  const AttentionInput& attention = task.item->attention;
  SelectScratch& scratch = *task.scratch;
  task.result.prompt_tokens = state.prompt_end;
  task.result.budget_tokens = state.k;
  scratch.selected_slots.assign(attention.layers.size(), {});
  for (size_t li = 0; li < attention.layers.size(); ++li) {
    const int32_t f = attention.layers[li];
    const int32_t fi = FilterIndex(config_, f);
    OmniKvState::Filter& filter = state.filters[fi];
    if (filter.last_step != task.item->step_id) {
      KVS_RETURN_IF_ERROR(ChooseFilter(sequence, task, li, filter));
    }
    // Prompt index of each selected position (ascending both ways).
    const int32_t prompt = PromptSlots(sequence, f, state.prompt_end);
    const std::vector<std::vector<int32_t>>& positions = sequence.layers_[f].positions;
    for (int32_t position : filter.selected) {
      scratch.selected_slots[li].push_back(static_cast<int32_t>(
          std::lower_bound(positions[0].begin(), positions[0].begin() + prompt, position) -
          positions[0].begin()));
    }
    FilterSelection selection;
    selection.filter_layer = f;
    selection.positions = filter.selected;
    selection.sparse_layers = state.plan.sparse[fi];
    task.result.filters.push_back(std::move(selection));
  }
  PlanGathers(sequence, attention, scratch);
  return absl::OkStatus();
}

absl::Status OmniKvKind::ChooseFilter(const Sequence& sequence, const SelectTask& task,
                                      size_t listed, OmniKvState::Filter& filter) const {
  const OmniKvState& state = *state_;
  const AttentionInput& attention = task.item->attention;
  const ModelLayout& layout = sequence.layout_;
  const int32_t f = attention.layers[listed];
  const int32_t prompt = PromptSlots(sequence, f, state.prompt_end);
  int32_t nq = 1;
  int32_t p = 0;  // prompt queries in the window (their tokens are forced in)
  const std::vector<float> queries = SelectorQueries(attention, listed, layout.num_q_heads,
                                                     layout.head_dim, filter, &nq, &p);
  p = std::min(p, prompt);
  const int32_t candidates = prompt - p;
  const int32_t k =
      state.k == 0 ? 0 : std::min(candidates, p > 0 ? std::max(1, state.k - p) : state.k);
  std::vector<int32_t> kept;
  if (k > 0) {
    KVS_ASSIGN_OR_RETURN(kept, TopCandidates(sequence, *task.env, f, attention.softmax_scale,
                                             queries, nq, candidates, k));
  }
  // The window's own prompt tokens are always attended (omnikv.md §4.5).
  for (int32_t t = candidates; t < prompt; ++t) kept.push_back(t);
  filter.last_step = task.item->step_id;
  filter.selected.clear();
  for (int32_t slot : kept) filter.selected.push_back(sequence.layers_[f].positions[0][slot]);
  return absl::OkStatus();
}

std::vector<float> OmniKvKind::SelectorQueries(const AttentionInput& attention, size_t listed,
                                               int32_t hq, int32_t dim,
                                               OmniKvState::Filter& filter, int32_t* num_queries,
                                               int32_t* prompt_queries) const {
  const int32_t w = attention.num_queries;
  // This layer's queries, [Hq][w][D] inside the [listed][Hq][w][D] input.
  const float* layer_queries = attention.queries.data() + listed * hq * w * dim;
  const size_t row = sizeof(float) * dim;
  std::vector<float> queries;
  if (config_.selector != OmniKvSelector::kUniform && config_.selector != OmniKvSelector::kExp) {
    // The newest query alone.
    *num_queries = 1;
    queries.resize(static_cast<size_t>(hq) * dim);
    for (int32_t h = 0; h < hq; ++h) {
      std::memcpy(queries.data() + static_cast<size_t>(h) * dim,
                  layer_queries + (static_cast<size_t>(h) * w + (w - 1)) * dim, row);
    }
    return queries;
  }
  for (int32_t j = 0; j < w; ++j) {
    std::vector<float> query(static_cast<size_t>(hq) * dim);
    for (int32_t h = 0; h < hq; ++h) {
      std::memcpy(query.data() + static_cast<size_t>(h) * dim,
                  layer_queries + (static_cast<size_t>(h) * w + j) * dim, row);
    }
    filter.window_queries.push_back(std::move(query));
    // Queries without explicit positions are decode queries (past the prompt).
    filter.window_positions.push_back(attention.query_positions.empty()
                                          ? std::numeric_limits<int64_t>::max()
                                          : attention.query_positions[j]);
  }
  while (static_cast<int32_t>(filter.window_queries.size()) > config_.window) {
    filter.window_queries.pop_front();
    filter.window_positions.pop_front();
  }
  const int32_t nq = static_cast<int32_t>(filter.window_queries.size());
  *num_queries = nq;
  queries.resize(static_cast<size_t>(hq) * nq * dim);
  for (int32_t j = 0; j < nq; ++j) {
    for (int32_t h = 0; h < hq; ++h) {
      std::memcpy(queries.data() + (static_cast<size_t>(h) * nq + j) * dim,
                  filter.window_queries[j].data() + static_cast<size_t>(h) * dim, row);
    }
    if (filter.window_positions[j] < state_->prompt_end) ++*prompt_queries;
  }
  return queries;
}

absl::StatusOr<std::vector<int32_t>> OmniKvKind::TopCandidates(
    const Sequence& sequence, const SequenceEnv& env, int32_t f, float scale,
    absl::Span<const float> queries, int32_t num_queries, int32_t candidates, int32_t k) const {
  const Sequence::LayerState& layer = sequence.layers_[f];
  const int32_t hq = sequence.layout_.num_q_heads;
  const int32_t heads = sequence.layout_.num_kv_heads;
  PagedLayerView keys = sequence.KeysView(env, f);
  keys.count = candidates;
  std::vector<int32_t> key_positions(static_cast<size_t>(heads) * candidates);
  for (int32_t h = 0; h < heads; ++h) {
    std::copy_n(layer.positions[h].begin(), candidates,
                key_positions.begin() + static_cast<size_t>(h) * candidates);
  }
  std::vector<int32_t> query_positions(num_queries, std::numeric_limits<int32_t>::max());
  std::vector<float> rows(static_cast<size_t>(hq) * num_queries * candidates);
  AttentionJob job;
  job.keys = keys;
  job.key_positions = key_positions.data();
  job.queries = queries.data();
  job.query_positions = query_positions.data();
  job.num_q_heads = hq;
  job.num_queries = num_queries;
  job.scale = scale;
  job.probs = rows.data();
  if (config_.selector == OmniKvSelector::kLast) {
    KVS_RETURN_IF_ERROR(env.backend.AttentionLogits({&job, 1}, nullptr));
  } else {
    KVS_RETURN_IF_ERROR(env.backend.AttentionProbs({&job, 1}, nullptr));
  }
  std::vector<float> scores(candidates);
  OmniKvCandidateScores(config_.selector, rows, hq, num_queries, candidates,
                        absl::MakeSpan(scores));
  std::vector<int32_t> kept(k);
  TopKJob topk;
  topk.scores = scores.data();
  topk.positions = layer.positions[0].data();
  topk.rows = 1;
  topk.n = candidates;
  topk.k = k;
  topk.kept = kept.data();
  KVS_RETURN_IF_ERROR(env.backend.TopK({&topk, 1}, nullptr));
  return kept;
}

void OmniKvKind::PlanGathers(const Sequence& sequence, const AttentionInput& attention,
                             SelectScratch& scratch) const {
  const OmniKvState& state = *state_;
  scratch.gathers.clear();
  for (size_t li = 0; li < attention.layers.size(); ++li) {
    const int32_t fi = FilterIndex(config_, attention.layers[li]);
    for (int32_t j : state.plan.sparse[fi]) {
      const Sequence::LayerState& layer = sequence.layers_[j];
      const int32_t tail_first =
          state.host_tokens[j] > 0 ? 0 : PromptSlots(sequence, j, state.prompt_end);
      SelectScratch::Gather gather;
      gather.layer = j;
      gather.selected = static_cast<int32_t>(scratch.selected_slots[li].size());
      gather.tail_first = tail_first;
      gather.tail = layer.count - tail_first;
      gather.slots = &scratch.selected_slots[li];
      scratch.gathers.push_back(gather);
    }
  }
  std::sort(scratch.gathers.begin(), scratch.gathers.end(),
            [](const SelectScratch::Gather& a, const SelectScratch::Gather& b) {
              return a.layer < b.layer;
            });
}

int32_t OmniKvKind::BlocksToStage(const Sequence& sequence, const SelectTask& task) const {
  int32_t needed = 0;
  for (const SelectScratch::Gather& g : task.scratch->gathers) {
    needed += std::max(0, BlocksFor(int64_t{g.selected} + g.tail, sequence.layout_.block_tokens) -
                              static_cast<int32_t>(state_->staging[g.layer].size()));
  }
  return needed;
}

void OmniKvKind::Stage(SelectTask& task, absl::Span<const int32_t> fresh) {
  const int32_t block_tokens = task.env->layout.block_tokens;
  size_t next = 0;
  for (const SelectScratch::Gather& g : task.scratch->gathers) {
    std::vector<int32_t>& staging = state_->staging[g.layer];
    const int32_t want = BlocksFor(int64_t{g.selected} + g.tail, block_tokens);
    while (static_cast<int32_t>(staging.size()) < want) staging.push_back(fresh[next++]);
  }
}

void OmniKvKind::AppendGatherJobs(const Sequence& sequence, const SequenceEnv& env,
                                  const SelectScratch::Gather& g, std::vector<uint64_t>* offsets,
                                  std::vector<HostRowCopyJob>& host_jobs,
                                  std::vector<RowCopyJob>& arena_jobs) const {
  const ModelLayout& layout = sequence.layout_;
  const int32_t heads = layout.num_kv_heads;
  const uint64_t row_bytes = RowBytes(layout);
  const Sequence::LayerState& layer = sequence.layers_[g.layer];
  const std::vector<int32_t>& staging = state_->staging[g.layer];
  std::vector<uint64_t>& sel_src = offsets[0];
  std::vector<uint64_t>& sel_dst = offsets[1];
  std::vector<uint64_t>& tail_src = offsets[2];
  std::vector<uint64_t>& tail_dst = offsets[3];
  const int32_t n = state_->host_tokens[g.layer];
  const bool from_host = n > 0;
  for (int32_t kv = 0; kv < 2; ++kv) {
    for (int32_t h = 0; h < heads; ++h) {
      for (int32_t s = 0; s < g.selected; ++s) {
        const int32_t t = (*g.slots)[s];
        sel_src.push_back(from_host ? HostRowOffset(kv, h, t, heads, n, row_bytes)
                                    : layout.SlotRowOffset(layer.blocks.data(), kv, h, t));
        sel_dst.push_back(layout.SlotRowOffset(staging.data(), kv, h, s));
      }
      for (int32_t i = 0; i < g.tail; ++i) {
        tail_src.push_back(layout.SlotRowOffset(layer.blocks.data(), kv, h, g.tail_first + i));
        tail_dst.push_back(layout.SlotRowOffset(staging.data(), kv, h, g.selected + i));
      }
    }
  }
  if (from_host) {
    HostRowCopyJob job;
    job.arena = env.arena.data();
    // The host copy is only read here (host -> arena).
    job.host =
        reinterpret_cast<uint8_t*>(const_cast<char*>(state_->host->layers[g.layer].data()));
    job.host_offsets = sel_src.data();
    job.arena_offsets = sel_dst.data();
    job.count = static_cast<int64_t>(sel_src.size());
    job.row_bytes = row_bytes;
    job.to_host = false;
    host_jobs.push_back(job);
  } else {
    arena_jobs.push_back(RowCopyJob{env.arena.data(), sel_src.data(), sel_dst.data(),
                                    static_cast<int64_t>(sel_src.size()), row_bytes});
  }
  arena_jobs.push_back(RowCopyJob{env.arena.data(), tail_src.data(), tail_dst.data(),
                                  static_cast<int64_t>(tail_src.size()), row_bytes});
}

absl::Status OmniKvKind::Gather(const Sequence& sequence, SelectTask& task) {
  const SequenceEnv& env = *task.env;
  const std::vector<SelectScratch::Gather>& gathers = task.scratch->gathers;
  std::vector<std::vector<uint64_t>> offsets(4 * gathers.size());
  std::vector<HostRowCopyJob> host_jobs;
  std::vector<RowCopyJob> arena_jobs;
  for (size_t gi = 0; gi < gathers.size(); ++gi) {
    AppendGatherJobs(sequence, env, gathers[gi], &offsets[4 * gi], host_jobs, arena_jobs);
  }
  KVS_RETURN_IF_ERROR(env.backend.CopyHostRows(host_jobs, nullptr));
  KVS_RETURN_IF_ERROR(env.backend.CopyRows(arena_jobs, nullptr));
  const int32_t block_tokens = sequence.layout_.block_tokens;
  for (const SelectScratch::Gather& g : gathers) {
    LayerLayoutView view;
    view.layer = g.layer;
    view.count = g.selected + g.tail;
    const std::vector<int32_t>& staging = state_->staging[g.layer];
    view.block_table.assign(staging.begin(), staging.begin() + BlocksFor(view.count, block_tokens));
    task.result.sparse_layers.push_back(std::move(view));
  }
  task.result.host_bytes = state_->host_bytes();
  return absl::OkStatus();
}

absl::Status ResolveOmniKvSequence(PolicyConfig& policy, const SequenceParams& params,
                                   int32_t num_layers, bool has_tiers) {
  if (params.retain_evicted) {
    return absl::InvalidArgumentError(
        "retain_evicted does not apply to policy omnikv, which never evicts");
  }
  if (policy.omnikv.filter_layers.empty()) {
    policy.omnikv.filter_layers = DefaultOmniKvFilterLayers(num_layers);
  }
  if (policy.omnikv.filter_layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.omnikv.filter_layers is required: no default is known for a model of ",
        num_layers, " layers (defaults exist for 32, 48 and 80)"));
  }
  KVS_RETURN_IF_ERROR(PlanOmniKvLayers(policy.omnikv, num_layers, params.layer_windows).status());
  if (policy.omnikv.offload && !has_tiers) {
    return absl::FailedPreconditionError(
        "policy.omnikv.offload needs the host tier, which this pool was built without");
  }
  if (params.budget.has_value() &&
      (params.budget->tokens_per_layer != 0 || !params.budget->per_layer_tokens.empty())) {
    return absl::InvalidArgumentError(
        "budget must be unset for policy omnikv, which never evicts (Select bounds what the "
        "sparse layers attend to)");
  }
  return absl::OkStatus();
}

}  // namespace kvs
