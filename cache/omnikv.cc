// Sequence::Select and the rest of the sequence's OmniKV half (policies/omnikv.md §3-§4, §10).
//
// An OmniKV sequence never evicts, so in every layer slot order is position order and, because
// the worker appends every token to every layer, the prompt (positions below N) occupies the
// first slots of each layer. Offloading a sparse layer moves those slots to the host tier and
// slides the layer's generated tokens to the front; a filter layer and the sparse layers of its
// segment therefore index the prompt the same way (checked at the first Select), and T_f is kept
// both as positions (for the worker) and as prompt indices (for the gathers).
#include "cache/omnikv.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/sequence.h"
#include "cache/policy/registry.h"
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

}  // namespace

Sequence::~Sequence() = default;

bool Sequence::never_evicts() const { return CapabilitiesOf(policy_->config()).never_evicts; }

bool Sequence::spillable() const { return omnikv_ == nullptr && !retain_evicted_; }

std::vector<SpillKey> Sequence::pinned_host_keys() const {
  std::vector<SpillKey> keys = retained_keys_;
  if (omnikv_ != nullptr && omnikv_->host != nullptr) keys.push_back(omnikv_->host_key);
  return keys;
}

uint64_t Sequence::host_bytes() const {
  uint64_t bytes = omnikv_ == nullptr ? 0 : omnikv_->host_bytes();
  for (const auto& chunk : retained_) bytes += chunk->bytes();
  return bytes;
}

int32_t Sequence::PromptSlots(int32_t layer, int64_t prompt_end) const {
  const LayerState& state = layers_[layer];
  if (state.count == 0 || state.positions.empty()) return 0;
  const std::vector<int32_t>& head = state.positions[0];
  return static_cast<int32_t>(
      std::lower_bound(head.begin(), head.begin() + state.count, prompt_end) - head.begin());
}

absl::Status Sequence::CheckSelect(const SequenceEnv& env, const SelectItem& item) const {
  (void)env;
  if (!never_evicts()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_, " uses policy ", policy_->config().name,
                     "; Select needs a sequence created with policy omnikv"));
  }
  const OmniKvConfig& config = policy_->config().omnikv;
  const AttentionInput& attention = item.attention;
  if (attention.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention.layers must list the filter layers whose queries the call carries (filter "
        "layers: ",
        absl::StrJoin(config.filter_layers, ", "), ")"));
  }
  if (!attention.scores.empty()) {
    return absl::InvalidArgumentError(
        "attention.attention_scores is not accepted by Select; send attention.inline_queries");
  }
  KVS_ASSIGN_OR_RETURN(StepAttention resolved,
                       ValidateAttention(attention, counts(), next_position_, /*decode=*/false));
  for (size_t i = 0; i < resolved.layers.size(); ++i) {
    if (FilterIndex(config, resolved.layers[i]) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention.layers[", i, "] = ", resolved.layers[i],
                       " is not a filter layer of the sequence's omnikv policy (filter layers: ",
                       absl::StrJoin(config.filter_layers, ", "), ")"));
    }
  }
  if (item.prompt_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_tokens must be >= 0, got ", item.prompt_tokens));
  }
  if (omnikv_ != nullptr) {
    if (item.prompt_tokens != 0 && item.prompt_tokens != omnikv_->prompt_end) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_tokens ", item.prompt_tokens,
                                                     " differs from the ", omnikv_->prompt_end,
                                                     " the sequence's first Select fixed"));
    }
    return absl::OkStatus();
  }
  // The first Select fixes N and checks that each segment indexes the prompt alike.
  const int64_t prompt_end = item.prompt_tokens > 0 ? item.prompt_tokens : next_position_;
  if (prompt_end > next_position_) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens ", item.prompt_tokens,
                                                   " is beyond the sequence's ", next_position_,
                                                   " positions"));
  }
  if (config.offload && pending_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_, " has a pending reservation (", pending_->id,
                     "); the first Select offloads the prompt: commit or cancel it first"));
  }
  KVS_ASSIGN_OR_RETURN(OmniKvPlan plan, PlanOmniKvLayers(config, layout_.num_layers));
  for (size_t i = 0; i < config.filter_layers.size(); ++i) {
    const int32_t f = config.filter_layers[i];
    const int32_t prompt = PromptSlots(f, prompt_end);
    for (int32_t j : plan.sparse[i]) {
      const int32_t sparse_prompt = PromptSlots(j, prompt_end);
      bool same = sparse_prompt == prompt;
      for (int32_t t = 0; same && t < prompt; ++t) {
        same = layers_[j].positions[0][t] == layers_[f].positions[0][t];
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

absl::Status Sequence::StartOmniKv(const SequenceEnv& env, const SelectItem& item,
                                   const HostPin& pin) {
  const OmniKvConfig& config = policy_->config().omnikv;
  auto state = std::make_unique<OmniKvState>();
  KVS_ASSIGN_OR_RETURN(state->plan, PlanOmniKvLayers(config, layout_.num_layers));
  state->prompt_end = item.prompt_tokens > 0 ? item.prompt_tokens : next_position_;
  state->k = ResolveOmniKvBudget(config, state->prompt_end);
  state->filters.resize(config.filter_layers.size());
  state->staging.resize(layout_.num_layers);
  state->host_tokens.assign(layout_.num_layers, 0);
  if (!config.offload) {
    omnikv_ = std::move(state);
    return absl::OkStatus();
  }

  // Offload: the sparse layers' prompt rows go to one host buffer per layer, [2][H][n][D].
  const int32_t heads = layout_.num_kv_heads;
  const uint64_t row_bytes = static_cast<uint64_t>(layout_.head_dim) * DTypeBytes(layout_.dtype);
  auto data = std::make_shared<SpilledSequence>();
  data->meta = "omnikv offloaded prompt";
  data->layers.resize(layout_.num_layers);
  std::vector<std::vector<uint64_t>> arena_offsets(layout_.num_layers);
  std::vector<std::vector<uint64_t>> host_offsets(layout_.num_layers);
  std::vector<HostRowCopyJob> jobs;
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    if (state->plan.roles[l] != OmniKvRole::kSparse) continue;
    const int32_t n = PromptSlots(l, state->prompt_end);
    if (n == 0) continue;
    state->host_tokens[l] = n;
    const uint64_t rows = uint64_t{2} * heads * n;
    data->layers[l].resize(rows * row_bytes);
    std::vector<uint64_t>& arena_rows = arena_offsets[l];
    std::vector<uint64_t>& host_rows = host_offsets[l];
    arena_rows.reserve(rows);
    host_rows.reserve(rows);
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t t = 0; t < n; ++t) {
          arena_rows.push_back(layout_.SlotRowOffset(layers_[l].blocks.data(), kv, h, t));
          host_rows.push_back(((uint64_t{static_cast<uint32_t>(kv)} * heads + h) * n + t) *
                              row_bytes);
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
  state->host_key = SpillKey{"", "", absl::StrCat(id_, "#omnikv")};
  if (!jobs.empty()) {
    KVS_RETURN_IF_ERROR(pin(state->host_key, data));
    state->host = std::move(data);
  }

  // Each sparse layer keeps only its generated tokens, slid to the front; freed blocks return.
  std::vector<RowCopyJob> slides;
  std::vector<std::vector<uint64_t>> slide_src(layout_.num_layers), slide_dst(layout_.num_layers);
  std::vector<int32_t> to_free;
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    const int32_t n = state->host_tokens[l];
    if (n == 0) continue;
    LayerState& layer = layers_[l];
    const int32_t tail = layer.count - n;
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t i = 0; i < tail; ++i) {
          slide_src[l].push_back(layout_.SlotRowOffset(layer.blocks.data(), kv, h, n + i));
          slide_dst[l].push_back(layout_.SlotRowOffset(layer.blocks.data(), kv, h, i));
        }
      }
    }
    RowCopyJob job;
    job.arena = env.arena.data();
    job.src_offsets = slide_src[l].data();
    job.dst_offsets = slide_dst[l].data();
    job.count = static_cast<int64_t>(slide_src[l].size());
    job.row_bytes = row_bytes;
    slides.push_back(job);
  }
  if (absl::Status copied = env.backend.CopyRows(slides, nullptr); !copied.ok()) {
    if (state->host != nullptr) pin(state->host_key, nullptr).IgnoreError();
    return copied;
  }
  for (int32_t l = 0; l < layout_.num_layers; ++l) {
    const int32_t n = state->host_tokens[l];
    if (n == 0) continue;
    LayerState& layer = layers_[l];
    layer.count -= n;
    for (std::vector<int32_t>& head : layer.positions) head.erase(head.begin(), head.begin() + n);
    const int32_t keep_blocks = BlocksFor(layer.count, layout_.block_tokens);
    to_free.insert(to_free.end(), layer.blocks.begin() + keep_blocks, layer.blocks.end());
    layer.blocks.resize(keep_blocks);
  }
  (void)env.allocator.Free(to_free);
  ++version_;
  omnikv_ = std::move(state);
  return absl::OkStatus();
}

absl::StatusOr<SelectResult> Sequence::Select(const SequenceEnv& env, const SelectItem& item,
                                              const HostPin& pin) {
  KVS_RETURN_IF_ERROR(CheckSelect(env, item));
  if (omnikv_ == nullptr) KVS_RETURN_IF_ERROR(StartOmniKv(env, item, pin));
  OmniKvState& state = *omnikv_;
  const OmniKvConfig& config = policy_->config().omnikv;
  const AttentionInput& attention = item.attention;
  const int32_t hq = layout_.num_q_heads;
  const int32_t heads = layout_.num_kv_heads;
  const int32_t dim = layout_.head_dim;
  const int32_t w = attention.num_queries;
  const bool window_selector =
      config.selector == OmniKvSelector::kUniform || config.selector == OmniKvSelector::kExp;

  SelectResult result;
  result.prompt_tokens = state.prompt_end;
  result.budget_tokens = state.k;
  // Prompt indices of T_f per listed filter (the positions go to the result).
  std::vector<std::vector<int32_t>> selected_slots(attention.layers.size());
  for (size_t li = 0; li < attention.layers.size(); ++li) {
    const int32_t f = attention.layers[li];
    const int32_t fi = FilterIndex(config, f);
    OmniKvState::Filter& filter = state.filters[fi];
    const int32_t prompt = PromptSlots(f, state.prompt_end);
    static const std::vector<int32_t> kNone;
    const std::vector<int32_t>& positions =
        layers_[f].positions.empty() ? kNone : layers_[f].positions[0];
    if (filter.last_step != item.step_id) {
      // This layer's queries, [Hq][w][D] inside the [listed][Hq][w][D] input.
      const float* layer_queries =
          attention.queries.data() + static_cast<size_t>(li) * hq * w * dim;
      std::vector<float> queries;  // [Hq][nq][D]
      std::vector<int32_t> query_positions;
      int32_t nq = 1;
      int32_t p = 0;  // prompt queries in the window (their tokens are forced in)
      if (window_selector) {
        for (int32_t j = 0; j < w; ++j) {
          std::vector<float> query(static_cast<size_t>(hq) * dim);
          for (int32_t h = 0; h < hq; ++h) {
            std::memcpy(query.data() + static_cast<size_t>(h) * dim,
                        layer_queries + (static_cast<size_t>(h) * w + j) * dim,
                        sizeof(float) * dim);
          }
          filter.window_queries.push_back(std::move(query));
          // Queries without explicit positions are decode queries (past the prompt).
          filter.window_positions.push_back(attention.query_positions.empty()
                                                ? std::numeric_limits<int64_t>::max()
                                                : attention.query_positions[j]);
        }
        while (static_cast<int32_t>(filter.window_queries.size()) > config.window) {
          filter.window_queries.pop_front();
          filter.window_positions.pop_front();
        }
        nq = static_cast<int32_t>(filter.window_queries.size());
        queries.resize(static_cast<size_t>(hq) * nq * dim);
        for (int32_t j = 0; j < nq; ++j) {
          for (int32_t h = 0; h < hq; ++h) {
            std::memcpy(queries.data() + (static_cast<size_t>(h) * nq + j) * dim,
                        filter.window_queries[j].data() + static_cast<size_t>(h) * dim,
                        sizeof(float) * dim);
          }
          if (filter.window_positions[j] < state.prompt_end) ++p;
        }
      } else {
        queries.resize(static_cast<size_t>(hq) * dim);
        for (int32_t h = 0; h < hq; ++h) {
          std::memcpy(queries.data() + static_cast<size_t>(h) * dim,
                      layer_queries + (static_cast<size_t>(h) * w + (w - 1)) * dim,
                      sizeof(float) * dim);
        }
      }
      p = std::min(p, prompt);
      const int32_t candidates = prompt - p;
      const int32_t k =
          state.k == 0 ? 0 : std::min(candidates, p > 0 ? std::max(1, state.k - p) : state.k);
      std::vector<int32_t> kept(k);
      if (k > 0) {
        PagedLayerView keys = KeysView(env, f);
        keys.count = candidates;
        std::vector<int32_t> key_positions(static_cast<size_t>(heads) * candidates);
        for (int32_t h = 0; h < heads; ++h) {
          std::copy_n(layers_[f].positions[h].begin(), candidates,
                      key_positions.begin() + static_cast<size_t>(h) * candidates);
        }
        query_positions.assign(nq, std::numeric_limits<int32_t>::max());
        std::vector<float> rows(static_cast<size_t>(hq) * nq * candidates);
        AttentionJob job;
        job.keys = keys;
        job.key_positions = key_positions.data();
        job.queries = queries.data();
        job.query_positions = query_positions.data();
        job.num_q_heads = hq;
        job.num_queries = nq;
        job.scale = attention.softmax_scale;
        job.probs = rows.data();
        if (config.selector == OmniKvSelector::kLast) {
          KVS_RETURN_IF_ERROR(env.backend.AttentionLogits({&job, 1}, nullptr));
        } else {
          KVS_RETURN_IF_ERROR(env.backend.AttentionProbs({&job, 1}, nullptr));
        }
        std::vector<float> scores(candidates);
        OmniKvCandidateScores(config.selector, rows, hq, nq, candidates, absl::MakeSpan(scores));
        TopKJob topk;
        topk.scores = scores.data();
        topk.positions = positions.data();
        topk.rows = 1;
        topk.n = candidates;
        topk.k = k;
        topk.kept = kept.data();
        KVS_RETURN_IF_ERROR(env.backend.TopK({&topk, 1}, nullptr));
      }
      // The window's own prompt tokens are always attended (omnikv.md §4.5).
      for (int32_t t = candidates; t < prompt; ++t) kept.push_back(t);
      filter.last_step = item.step_id;
      filter.selected.clear();
      for (int32_t slot : kept) filter.selected.push_back(positions[slot]);
    }
    // Prompt index of each selected position (ascending both ways).
    std::vector<int32_t>& slots = selected_slots[li];
    for (int32_t position : filter.selected) {
      slots.push_back(static_cast<int32_t>(
          std::lower_bound(positions.begin(), positions.begin() + prompt, position) -
          positions.begin()));
    }
    FilterSelection selection;
    selection.filter_layer = f;
    selection.positions = filter.selected;
    selection.sparse_layers = state.plan.sparse[fi];
    result.filters.push_back(std::move(selection));
  }

  // Staging: per sparse layer, T_f's tokens then the layer's generated ones.
  const uint64_t row_bytes = static_cast<uint64_t>(dim) * DTypeBytes(layout_.dtype);
  struct Gather {
    int32_t layer;
    int32_t selected;
    int32_t tail_first;  // first slot of the generated tokens in the layer
    int32_t tail;
    const std::vector<int32_t>* slots;
  };
  std::vector<Gather> gathers;
  for (size_t li = 0; li < attention.layers.size(); ++li) {
    const int32_t fi = FilterIndex(config, attention.layers[li]);
    for (int32_t j : state.plan.sparse[fi]) {
      const LayerState& layer = layers_[j];
      const int32_t tail_first = state.host_tokens[j] > 0 ? 0 : PromptSlots(j, state.prompt_end);
      gathers.push_back(Gather{j, static_cast<int32_t>(selected_slots[li].size()), tail_first,
                               layer.count - tail_first, &selected_slots[li]});
    }
  }
  std::sort(gathers.begin(), gathers.end(),
            [](const Gather& a, const Gather& b) { return a.layer < b.layer; });
  // Blocks first, so that a full arena fails the call before anything is copied.
  int32_t needed = 0;
  for (const Gather& g : gathers) {
    needed += std::max(0, BlocksFor(int64_t{g.selected} + g.tail, layout_.block_tokens) -
                              static_cast<int32_t>(state.staging[g.layer].size()));
  }
  if (needed > 0) {
    std::vector<int32_t> fresh;
    if (absl::Status allocated = env.allocator.Allocate(needed, &fresh); !allocated.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", id_, ": staging the selected tokens needs ", needed,
          " more blocks than the session's arena has free (", allocated.message(), ")"));
    }
    size_t next = 0;
    for (const Gather& g : gathers) {
      std::vector<int32_t>& staging = state.staging[g.layer];
      const int32_t want = BlocksFor(int64_t{g.selected} + g.tail, layout_.block_tokens);
      while (static_cast<int32_t>(staging.size()) < want) staging.push_back(fresh[next++]);
    }
  }
  std::vector<std::vector<uint64_t>> offsets(4 * gathers.size());
  std::vector<HostRowCopyJob> host_jobs;
  std::vector<RowCopyJob> arena_jobs;
  for (size_t gi = 0; gi < gathers.size(); ++gi) {
    const Gather& g = gathers[gi];
    const LayerState& layer = layers_[g.layer];
    const std::vector<int32_t>& staging = state.staging[g.layer];
    std::vector<uint64_t>& sel_src = offsets[4 * gi];
    std::vector<uint64_t>& sel_dst = offsets[4 * gi + 1];
    std::vector<uint64_t>& tail_src = offsets[4 * gi + 2];
    std::vector<uint64_t>& tail_dst = offsets[4 * gi + 3];
    const bool from_host = state.host_tokens[g.layer] > 0;
    const int32_t n = state.host_tokens[g.layer];
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t s = 0; s < g.selected; ++s) {
          const int32_t t = (*g.slots)[s];
          sel_src.push_back(from_host ? ((uint64_t{static_cast<uint32_t>(kv)} * heads + h) * n +
                                         static_cast<uint64_t>(t)) *
                                            row_bytes
                                      : layout_.SlotRowOffset(layer.blocks.data(), kv, h, t));
          sel_dst.push_back(layout_.SlotRowOffset(staging.data(), kv, h, s));
        }
        for (int32_t i = 0; i < g.tail; ++i) {
          tail_src.push_back(layout_.SlotRowOffset(layer.blocks.data(), kv, h, g.tail_first + i));
          tail_dst.push_back(layout_.SlotRowOffset(staging.data(), kv, h, g.selected + i));
        }
      }
    }
    if (from_host) {
      HostRowCopyJob job;
      job.arena = env.arena.data();
      // The host copy is only read here (host -> arena).
      job.host = reinterpret_cast<uint8_t*>(const_cast<char*>(state.host->layers[g.layer].data()));
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
  KVS_RETURN_IF_ERROR(env.backend.CopyHostRows(host_jobs, nullptr));
  KVS_RETURN_IF_ERROR(env.backend.CopyRows(arena_jobs, nullptr));
  for (const Gather& g : gathers) {
    LayerLayoutView view;
    view.layer = g.layer;
    view.count = g.selected + g.tail;
    const std::vector<int32_t>& staging = state.staging[g.layer];
    view.block_table.assign(staging.begin(),
                            staging.begin() + BlocksFor(view.count, layout_.block_tokens));
    result.sparse_layers.push_back(std::move(view));
  }
  result.host_bytes = state.host_bytes();
  return result;
}

}  // namespace kvs
