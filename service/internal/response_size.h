// Upper bounds of the size of the responses whose bulk is positions (GetLayout, Score, Compress,
// the Export header) or block tables (DecodeStep's return_layout), computed from the counts alone
// so that an oversized request is refused before anything is built, copied or evicted. Internal
// to service/.
#ifndef KVSIDECAR_SERVICE_INTERNAL_RESPONSE_SIZE_H_
#define KVSIDECAR_SERVICE_INTERNAL_RESPONSE_SIZE_H_

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "cache/pool.h"

namespace kvs {
namespace service_internal {

// Responses whose bulk is positions ([H][count] per layer) can exceed the message limit for long
// sequences. They are sized from the counts alone (a pool GetLayout without positions) so that
// an oversized request is refused before anything is built, copied or evicted. Every figure is an
// upper bound: each value is counted at the varint size of the largest value it can hold.

// Bytes of the varint encoding of `value`.
inline uint64_t VarintBytes(uint64_t value) {
  uint64_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

// A packed repeated int32 field of `n` values, each at most `value_bytes` long: tag, length,
// payload.
inline uint64_t PackedBytes(uint64_t n, uint64_t value_bytes) {
  if (n == 0) return 0;
  const uint64_t payload = n * value_bytes;
  return 1 + VarintBytes(payload) + payload;
}

// A length-delimited sub-message (tag, length, body).
inline uint64_t EmbeddedBytes(uint64_t body) { return 1 + VarintBytes(body) + body; }

// `fields` int32 scalar fields (tag + varint), none above `max_value`.
inline uint64_t ScalarBytes(int fields, int64_t max_value) {
  return static_cast<uint64_t>(fields) *
         (1 + VarintBytes(static_cast<uint64_t>(std::max<int64_t>(max_value, 0))));
}

// Everything outside the per-layer entries of a GetLayoutResponse or an ExportHeader (next
// position, counts, tier, policy, budget, layout): far below this.
inline constexpr uint64_t kResponseFixedBytes = 4096;

// Bytes one position costs at most: positions are below the sequence's next position.
inline uint64_t PositionBytes(const SequenceLayout& layout) {
  return VarintBytes(static_cast<uint64_t>(std::max<int64_t>(layout.next_position, 0)));
}

// The repeated LayerLayout entries of a GetLayoutResponse or an ExportHeader built from
// `layout` (counts and block tables as loaded without positions), with positions if asked.
inline uint64_t LayerLayoutsBytes(const SequenceLayout& layout, const SessionRef& session,
                                  bool with_positions) {
  const uint64_t block_bytes =
      VarintBytes(static_cast<uint64_t>(std::max<int64_t>(session.num_blocks(), 0)));
  const uint64_t position_bytes = PositionBytes(layout);
  uint64_t total = 0;
  for (const LayerLayoutView& layer : layout.layers) {
    // layer, count, budget, window
    uint64_t body =
        ScalarBytes(4, std::max({layer.layer, layer.count, layer.budget, layer.window})) +
        PackedBytes(layer.block_table.size(), block_bytes);
    if (with_positions) {
      body += PackedBytes(static_cast<uint64_t>(session.layout().num_kv_heads) *
                              static_cast<uint64_t>(std::max(layer.count, 0)),
                          position_bytes);
    }
    total += EmbeddedBytes(body);
  }
  return total;
}

// The LayerLayout entries (without positions) of every layer of one sequence of `session`, as a
// DecodeStep item with return_layout answers them, bounded without looking at the sequence:
// count, budget and window at the varint size of the most tokens the arena holds, and each
// table's tag and length. The tables' entries are counted apart (SessionTableBytes): the tables of
// a session's sequences hold each of its arena's blocks at most once.
inline uint64_t SequenceLayoutEntriesBytes(const SessionRef& session) {
  const int64_t blocks = std::max<int64_t>(session.num_blocks(), 0);
  const int64_t max_tokens = blocks * std::max<int64_t>(session.layout().block_tokens, 1);
  const uint64_t body = ScalarBytes(4, std::max<int64_t>(max_tokens, session.layout().num_layers)) +
                        1 + VarintBytes(static_cast<uint64_t>(blocks) * 5);
  return static_cast<uint64_t>(session.layout().num_layers) * EmbeddedBytes(body);
}

// Every block of `session`'s arena as a block-table entry.
inline uint64_t SessionTableBytes(const SessionRef& session) {
  const uint64_t blocks = static_cast<uint64_t>(std::max<int64_t>(session.num_blocks(), 0));
  return blocks * VarintBytes(blocks);
}

// RESOURCE_EXHAUSTED "<what> would be about N bytes, above the 64 MiB message limit; <advice>".
inline absl::Status TooLarge(absl::string_view what, uint64_t bytes, uint64_t limit,
                             absl::string_view advice) {
  return absl::ResourceExhaustedError(absl::StrCat(what, " would be about ", bytes,
                                                   " bytes, above the ", limit >> 20,
                                                   " MiB message limit; ", advice));
}

inline constexpr absl::string_view kGetLayoutAdvice = "ask for fewer layers or set omit_positions";
inline constexpr absl::string_view kScoreAdvice = "ask for fewer layers (layers)";

// Whether `policy` splits the budget evenly (every layer keeps at most the budget).
inline bool UniformSplit(const PolicyConfig& policy) {
  switch (policy.allocator.kind) {
    case LayerAllocatorKind::kUniform:
      return true;
    case LayerAllocatorKind::kDefault:
      return AllocatorDefaultsOf(policy).kind == LayerAllocatorKind::kUniform &&
             !CapabilitiesOf(policy).never_evicts;
    default:
      return false;
  }
}

// Upper bound of a ScoreResponse for the layers of `counts` (loaded without positions): per
// layer and head, `count` fp32 scores, at most `count` kept slots and `count` positions.
inline uint64_t EstimateScoreResponseBytes(const SequenceLayout& counts,
                                           const ModelLayout& model) {
  const uint64_t position_bytes = PositionBytes(counts);
  uint64_t total = 0;
  for (const LayerLayoutView& layer : counts.layers) {
    const uint64_t n = static_cast<uint64_t>(model.num_kv_heads) *
                       static_cast<uint64_t>(std::max(layer.count, 0));
    const uint64_t slot_bytes =
        VarintBytes(static_cast<uint64_t>(std::max<int64_t>(layer.count, 0)));
    uint64_t body = ScalarBytes(2, std::max(layer.layer, layer.count));  // layer, kept
    if (n > 0) body += 1 + VarintBytes(4 * n) + 4 * n;                   // scores, fixed32
    body += PackedBytes(n, slot_bytes) + PackedBytes(n, position_bytes);
    total += EmbeddedBytes(body);
  }
  return total;
}
inline constexpr absl::string_view kCompressAdvice =
    "set return_positions=false (and read positions with GetLayout, a few layers at a time)";

}  // namespace service_internal
}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_INTERNAL_RESPONSE_SIZE_H_
