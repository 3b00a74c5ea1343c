// Sequence snapshots: the complete state of a Sequence (layout, resolved policy configuration,
// budget, per-layer counts, positions, append totals, every LayerPolicyState, allocations,
// next position, version) as plain values, and its binary encoding (the `meta` of a
// SpilledSequence, cache/tier.h). Sequence::Spill / Sequence::Restore (cache/sequence.h,
// implemented in sequence_snapshot.cc) capture and rebuild a sequence from it, so that a restored
// sequence is bit-identical and behaves exactly as before.
//
// Encoding (format 2): "KVSSNAP2", then a tagged field stream (cache/policy/registry.h) in which
// the policy's parameters and every layer's policy state are encoded by the policy's registry
// unit, each with its own version. A field added later reads back as its default from an older
// snapshot and is skipped by an older build, so a restarted sidecar reads what an earlier build
// spilled to disk. Format 1 ("KVSSNAP1": fixed-width fields in a fixed order) is still read.
// Decoding checks every length and every value range it relies on: malformed bytes are
// DATA_LOSS, never a crash.
//
// Threading: pure functions of their arguments.
#ifndef KVSIDECAR_CACHE_SEQUENCE_SNAPSHOT_H_
#define KVSIDECAR_CACHE_SEQUENCE_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/policy/policy.h"
#include "cache/policy/policy_config.h"
#include "gpu/base/layout.h"

namespace kvs {

struct SequenceSnapshot {
  struct Layer {
    int32_t count = 0;
    int64_t appended = 0;
    std::vector<std::vector<int32_t>> positions;  // [H][count] or empty (never used)
    int32_t allocated = 0;
    LayerPolicyState state;  // the transient step fields are always empty between calls
    // Above every position committed to this layer; -1 = not recorded (a snapshot written before
    // layers tracked their own): the sequence's next_position then stands for it.
    int64_t next_position = -1;
  };
  std::string id;
  ModelLayout layout;
  PolicyConfig policy;  // resolved
  BudgetConfig budget;
  absl::Time created;
  absl::Time last_used;
  int64_t next_position = 0;
  uint64_t version = 0;
  uint64_t last_committed = 0;
  uint64_t last_cancelled = 0;
  std::vector<Layer> layers;
  // Per-layer sliding windows (empty = none). Encoded last, after the layers, so that snapshots
  // written before windows existed decode as having none.
  std::vector<int32_t> layer_windows;

  // Blocks layer `l` holds: ceil(count / block_tokens).
  int64_t LayerBlocks(size_t l) const {
    return (int64_t{layers[l].count} + layout.block_tokens - 1) / layout.block_tokens;
  }
};

std::string EncodeSnapshot(const SequenceSnapshot& snapshot);
// DATA_LOSS (naming what is wrong) for bytes that are not an encoded snapshot.
absl::StatusOr<SequenceSnapshot> DecodeSnapshot(std::string_view bytes);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SEQUENCE_SNAPSHOT_H_
