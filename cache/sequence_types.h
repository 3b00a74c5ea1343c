// The value types of KvPool's sequence calls: creating a sequence, reservations and commits,
// compression, decode steps, scores, layouts, retained tokens and the sequences Admin lists.
// Plain data converted from the contract by the service; no protobuf here.
#ifndef KVSIDECAR_CACHE_SEQUENCE_TYPES_H_
#define KVSIDECAR_CACHE_SEQUENCE_TYPES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cache/policy/policy_config.h"
#include "cache/tier.h"

namespace kvs {

struct SequenceParams {
  std::optional<PolicyConfig> policy;  // nullopt = pool default
  std::optional<BudgetConfig> budget;  // nullopt = pool default
  std::string sequence_id;             // empty = generated
  // Keep every token this sequence evicts (K, V, position, selection score) in the host tier
  // (GetRetained reads them back). Needs tiers (FAILED_PRECONDITION); not with omnikv. Such a
  // sequence cannot be spilled. A host tier or quota too full for an eviction's tokens fails the
  // evicting call with RESOURCE_EXHAUSTED, changing nothing.
  bool retain_evicted = false;
  // Per-layer sliding windows: empty, or one per layer of the session, each >= 0 (0 = a global
  // layer). A layer with W > 0 holds exactly its last W tokens, whatever the policy and budget
  // (Sequence::set_layer_windows). With omnikv a windowed layer is neither a filter
  // (INVALID_ARGUMENT naming policy.omnikv.filter_layers) nor a sparse layer.
  std::vector<int32_t> layer_windows;
  // Start from the prefix published under this key by the session's tenant (KvPool::Publish)
  // instead of empty; policy and budget, when set, must equal the published ones.
  std::string from_prefix;
};

struct SequenceCreated {
  std::string sequence_id;
  PolicyConfig policy;
  BudgetConfig budget;
};

// Token i of a reservation sits, for every kv head of `layer`, in slot first_slot + i:
// block blocks[(first_slot + i) / B - first_slot / B], index (first_slot + i) % B.
struct LayerSlots {
  int32_t layer = 0;
  int32_t first_slot = 0;
  std::vector<int32_t> blocks;
};

struct Reservation {
  uint64_t reservation_id = 0;
  std::vector<LayerSlots> layers;  // the reserved layers, in the order asked
  std::vector<int32_t> positions;  // positions of the new tokens
  int32_t evicted_before = 0;      // strict budget: tokens evicted per layer (max) first
  uint64_t payload_bytes = 0;      // inline payload size [layers][2][H][T][D]
};

// This step's attention, as the worker sent it (kvsidecar.v1.AttentionInputs, converted): the
// queries of the step per listed layer, or the worker's own probabilities. Which policy needs
// what is documented in the proto; the sequence computes the probabilities itself from the keys
// it holds (Backend::AttentionProbs).
struct AttentionInput {
  std::vector<int32_t> layers;  // empty = every layer, in order; else distinct
  int32_t num_queries = 0;      // w >= 1
  // Absolute positions of the queries (size w, increasing). Empty = the newest w positions of
  // the sequence (after this call's commit): the usual case, the step's own tokens.
  std::vector<int32_t> query_positions;
  float softmax_scale = 0.0f;  // > 0, finite
  std::vector<float> queries;  // [layers][Hq][w][D] fp32, or empty
  // Instead of `queries`: the same fp32 array in the session's query staging area, from this
  // byte offset of the area (SequenceEnv::staging_offset), where the worker wrote it.
  std::optional<uint64_t> staging_offset;
  std::vector<float> scores;   // [layers][Hq][w][count of the layer] fp32, or empty
};

struct CommitResult {
  std::vector<int32_t> counts;  // tokens per layer after commit (and compression)
  int32_t evicted = 0;          // evicted per layer by compression (max over layers)
};

// One item of CommitBatch: the arguments of one Commit.
struct CommitItem {
  std::string_view session_id;
  std::string_view sequence_id;
  uint64_t reservation_id = 0;
  bool compress_if_over_budget = false;
  const AttentionInput* attention = nullptr;  // may be null
};

// What CommitBatch did: items [0, results.size()) were committed, in order; `failed` is the item
// whose error `status` is (-1 and OK when every item was committed).
struct CommitBatchResult {
  std::vector<CommitResult> results;
  absl::Status status;
  int32_t failed = -1;
};

struct CompressParams {
  int32_t budget_tokens = 0;           // 0 = the sequence's budget
  std::optional<PolicyConfig> policy;  // nullopt = the sequence's policy
  bool return_positions = false;
  std::optional<AttentionInput> attention;
};

struct LayerCompressResult {
  int32_t layer = 0;
  int32_t kept = 0;
  int32_t evicted = 0;
  int32_t merged = 0;
  std::vector<int32_t> positions;  // [H][kept] in slot order, if asked
};

struct CompressResult {
  std::vector<LayerCompressResult> layers;
  int32_t blocks_freed = 0;
  int32_t floor_applied_layers = 0;  // layers the allocator raised to its floor
  uint64_t bytes_copied = 0;         // K/V bytes compaction copied (blocks left whole: none)
};

// One sequence's decode step (DecodeStep): its new token (a pending one-token reservation in
// every layer to commit, inline K/V [L][2][H][1][D] to append, or neither) and its query.
struct DecodeItem {
  std::string session_id;
  std::string sequence_id;
  AttentionInput attention;
  uint64_t reservation_id = 0;     // 0 = none
  std::vector<uint8_t> inline_kv;  // empty = none
};

struct DecodeResult {
  std::vector<int32_t> counts;             // per layer after the step
  std::vector<int32_t> evicted_positions;  // [L][H], -1 = none (lowest if several)
  int32_t merged = 0;
  int32_t position = -1;  // the inline token's position
};

// Score (dry run): what Compress would keep, changing nothing.
struct ScoreParams {
  int32_t budget_tokens = 0;           // 0 = the sequence's budget (one of them must be > 0)
  std::optional<PolicyConfig> policy;  // nullopt = the sequence's policy
  std::optional<AttentionInput> attention;
  std::vector<int32_t> layers;  // empty = all
};

struct LayerScores {
  int32_t layer = 0;
  int32_t kept = 0;                 // tokens per head that would stay
  std::vector<float> scores;        // [H][count] slot order, +inf = protected
  std::vector<int32_t> kept_slots;  // [H][kept] ascending
  std::vector<int32_t> positions;   // [H][count] slot order
};

struct LayerLayoutView {
  int32_t layer = 0;
  int32_t count = 0;
  std::vector<int32_t> block_table;  // ceil(count / B) blocks
  std::vector<int32_t> positions;    // [H][count], slot order (empty if not asked)
  int32_t budget = 0;                // 0 = unbounded
  int32_t window = 0;                // sliding window (SequenceParams::layer_windows), 0 = none
};

struct SequenceLayout {
  std::vector<LayerLayoutView> layers;
  int32_t next_position = 0;
  int64_t tokens_appended = 0;
  PolicyConfig policy;
  BudgetConfig budget;
  uint64_t version = 0;  // changes on every mutation of the sequence
};

// Tokens a retain_evicted sequence evicted, per (layer, kv head), in eviction order.
struct RetainedHead {
  int32_t layer = 0;
  int32_t head = 0;
  std::vector<int32_t> positions;
  std::vector<float> scores;  // the selection score each had when evicted (+inf: protected)
  std::string keys;           // [n][D] in the session dtype
  std::string values;
};

struct SequenceInfo {
  std::string session_id;
  std::string sequence_id;
  std::string tenant;
  PolicyConfig policy;
  BudgetConfig budget;
  std::vector<int32_t> tokens_per_layer;
  uint64_t arena_bytes = 0;
  absl::Time created;
  absl::Time last_used;
  // A spilled sequence (KvPool::Spill) is listed with its tier and bytes there, and with the
  // policy, budget and tokens_per_layer it had when it left the arena (unchanged since).
  StorageTier tier = StorageTier::kArena;
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SEQUENCE_TYPES_H_
