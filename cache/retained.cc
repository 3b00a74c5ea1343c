// Sequence's retain_evicted half: what an eviction copies aside into the host tier, and reading
// it back (KvPool::GetRetained).
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/sequence.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

// One retained token of one (layer, head) in a chunk's meta.
struct RetainedEntry {
  int32_t layer;
  int32_t head;
  int32_t position;
  float score;
};
static_assert(sizeof(RetainedEntry) == 16);

}  // namespace

absl::Status Sequence::RetainEvicted(const SequenceEnv& env, absl::Span<const int32_t> victims,
                                     absl::Span<const int32_t> keep,
                                     absl::Span<const std::vector<int32_t>> kept,
                                     absl::Span<const std::vector<float>> scores) {
  if (env.host_pin == nullptr || !*env.host_pin) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", id_, " retains what it evicts, and this call has no host tier to keep it in"));
  }
  const int32_t heads = layout_.num_kv_heads;
  const uint64_t row_bytes = layout_.row_bytes();
  std::vector<RetainedEntry> entries;
  std::vector<uint64_t> arena_offsets;
  std::vector<uint8_t> is_kept;
  std::vector<int32_t> evicted;
  for (size_t i = 0; i < victims.size(); ++i) {
    const int32_t l = victims[i];
    const LayerState& state = layers_[l];
    const int32_t k = keep[l];
    for (int32_t h = 0; h < heads; ++h) {
      is_kept.assign(state.count, 0);
      for (int32_t t = 0; t < k; ++t) is_kept[kept[i][static_cast<size_t>(h) * k + t]] = 1;
      evicted.clear();
      for (int32_t s = 0; s < state.count; ++s) {
        if (is_kept[s] == 0) evicted.push_back(s);
      }
      // The tokens of one eviction in position order: slot order follows the block table, which
      // compaction reorders (its fullest blocks first).
      const std::vector<int32_t>& head_positions = state.positions[h];
      std::sort(evicted.begin(), evicted.end(), [&](int32_t a, int32_t b) {
        return head_positions[a] < head_positions[b];
      });
      for (int32_t s : evicted) {
        entries.push_back(RetainedEntry{l, h, head_positions[s],
                                        scores[i][static_cast<size_t>(h) * state.count + s]});
        arena_offsets.push_back(layout_.SlotRowOffset(state.blocks.data(), 0, h, s));
        arena_offsets.push_back(layout_.SlotRowOffset(state.blocks.data(), 1, h, s));
      }
    }
  }
  if (entries.empty()) return absl::OkStatus();
  auto chunk = std::make_shared<SpilledSequence>();
  chunk->meta.resize(entries.size() * sizeof(RetainedEntry));
  std::memcpy(chunk->meta.data(), entries.data(), chunk->meta.size());
  chunk->layers.resize(1);
  chunk->layers[0].resize(arena_offsets.size() * row_bytes);
  std::vector<uint64_t> host_offsets(arena_offsets.size());
  for (size_t r = 0; r < host_offsets.size(); ++r) host_offsets[r] = r * row_bytes;
  HostRowCopyJob job;
  job.arena = env.arena.data();
  job.host = reinterpret_cast<uint8_t*>(chunk->layers[0].data());
  job.arena_offsets = arena_offsets.data();
  job.host_offsets = host_offsets.data();
  job.count = static_cast<int64_t>(arena_offsets.size());
  job.row_bytes = row_bytes;
  job.to_host = true;
  KVS_RETURN_IF_ERROR(env.backend.CopyHostRows({&job, 1}, nullptr));
  const SpillKey key{"", "", absl::StrCat(id_, "#retained#", retained_keys_.size())};
  if (absl::Status pinned = (*env.host_pin)(key, chunk); !pinned.ok()) {
    return absl::Status(pinned.code(),
                        absl::StrCat("retain_evicted: keeping ", entries.size(),
                                     " evicted (layer, head) tokens of sequence ", id_,
                                     " failed, nothing was evicted: ", pinned.message()));
  }
  retained_.push_back(std::move(chunk));
  retained_keys_.push_back(key);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RetainedHead>> Sequence::Retained(
    absl::Span<const int32_t> layers) const {
  if (!retain_evicted_) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id_, " was not created with retain_evicted"));
  }
  KVS_ASSIGN_OR_RETURN(std::vector<int32_t> targets, ResolveLayers(layers, layout_.num_layers));
  std::vector<int32_t> index(layout_.num_layers, -1);  // layer -> position in targets
  for (size_t i = 0; i < targets.size(); ++i) index[targets[i]] = static_cast<int32_t>(i);
  const int32_t heads = layout_.num_kv_heads;
  std::vector<RetainedHead> result(targets.size() * heads);
  for (size_t i = 0; i < targets.size(); ++i) {
    for (int32_t h = 0; h < heads; ++h) {
      result[i * heads + h].layer = targets[i];
      result[i * heads + h].head = h;
    }
  }
  const uint64_t row_bytes = layout_.row_bytes();
  for (const auto& chunk : retained_) {
    const size_t n = chunk->meta.size() / sizeof(RetainedEntry);
    for (size_t e = 0; e < n; ++e) {
      RetainedEntry entry;
      std::memcpy(&entry, chunk->meta.data() + e * sizeof(RetainedEntry), sizeof(entry));
      if (index[entry.layer] < 0) continue;
      RetainedHead& out = result[static_cast<size_t>(index[entry.layer]) * heads + entry.head];
      out.positions.push_back(entry.position);
      out.scores.push_back(entry.score);
      out.keys.append(chunk->layers[0].data() + 2 * e * row_bytes, row_bytes);
      out.values.append(chunk->layers[0].data() + (2 * e + 1) * row_bytes, row_bytes);
    }
  }
  return result;
}

}  // namespace kvs
