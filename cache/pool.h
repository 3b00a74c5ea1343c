// KvPool: the cache core's front door. Owns every attached session (its arena, block allocator,
// lease) and every sequence in it, and runs the policies. The service layer converts protobuf to
// the plain types below and calls in; nothing here knows gRPC, CUDA or RocksDB.
//
// Errors (absl codes, mapped 1:1 to gRPC by the service): INVALID_ARGUMENT names the offending
// field using the proto field names; NOT_FOUND for unknown session/sequence/reservation;
// FAILED_PRECONDITION for calls in the wrong state; RESOURCE_EXHAUSTED when the arena or the pool
// is full; ABORTED when a sequence changed under a multi-call read (export). A failed call leaves
// every session and sequence exactly as it was.
//
// Threading: every method is thread-safe. The session map has its own lock; each session has a
// lock that serialises work on its sequences, so different sessions proceed in parallel.
#ifndef KVSIDECAR_CACHE_POOL_H_
#define KVSIDECAR_CACHE_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/clock.h"
#include "cache/policy/policy_config.h"
#include "cache/tier.h"
#include "gpu/arena.h"
#include "gpu/backend.h"
#include "gpu/base/layout.h"

namespace kvs {

struct PoolOptions {
  // Sum of all sessions' arenas may not exceed this.
  uint64_t arena_capacity_bytes = uint64_t{1} << 30;
  // Arena size of a session that asks for 0 blocks.
  uint64_t default_session_bytes = uint64_t{256} << 20;
  absl::Duration default_lease = absl::Seconds(10);
  absl::Duration min_lease = absl::Milliseconds(100);
  absl::Duration max_lease = absl::Minutes(10);
  // At most this many sessions, and per session at most
  // min(max_sequences_per_session, max(16, num_blocks)) sequences: each costs host memory for its
  // tables whether or not it holds tokens, so a tiny arena cannot pin unbounded metadata.
  int32_t max_sessions = 256;
  int32_t max_sequences_per_session = 4096;
  int32_t max_tokens_per_call = 1 << 20;  // num_tokens of one Reserve/Append
  // Threads that run the sequences of one DecodeStep side by side (each sequence's own steps
  // stay in order); <= 0 picks the hardware concurrency, 1 runs them on the caller.
  int32_t decode_threads = 0;
  ArenaOptions arena_options;
  PolicyConfig default_policy;  // for sequences created without a policy
  // Where Spill puts sequences (storage/tier_manager.h); must outlive the pool. Null = Spill and
  // Restore answer UNIMPLEMENTED.
  SequenceTiers* tiers = nullptr;
  // Device -> host demotion: when a Reserve finds its session's arena full, spill the session's
  // least recently used other sequences (none with a pending reservation) to the host tier (which
  // moves its oldest copies to disk when full) until the Reserve fits. Needs `tiers`.
  bool spill_on_pressure = false;
  BudgetConfig default_budget;  // tokens_per_layer 0 = unbounded
};

struct AttachParams {
  ModelLayout layout;  // block_tokens 0 is resolved to the default
  std::string tenant = "default";
  std::string worker_name;
  int32_t num_blocks = 0;                       // 0 = PoolOptions::default_session_bytes worth
  absl::Duration lease = absl::ZeroDuration();  // 0 = default
};

struct SessionView {
  std::string session_id;
  std::string tenant;  // owner (authorization checks)
  ModelLayout layout;
  ArenaHandle arena;
  int32_t num_blocks = 0;
  uint64_t block_bytes = 0;
  absl::Duration lease;
  absl::Time lease_expires;
};

struct HeartbeatResult {
  absl::Time lease_expires;
  int32_t free_blocks = 0;  // free blocks of the session's arena after its last completed call
};

struct ReleaseCounts {
  int32_t sequences = 0;
  int32_t blocks = 0;
};

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
  // (Sequence::set_layer_windows). Not with omnikv (INVALID_ARGUMENT).
  std::vector<int32_t> layer_windows;
  // Start from the prefix published under this key by the session's tenant (KvPool::Publish)
  // instead of empty; policy and budget, when set, must equal the published ones.
  std::string from_prefix;
};

// Published prefixes live in the tiers under the publishing tenant, this pseudo session id (no
// session id has a '#') and the sequence id "prefix/<key>" (no sequence id has a '/', so a prefix
// never collides with a spilled sequence, the remote tier's (tenant, sequence id) names included).
inline constexpr char kPrefixSessionId[] = "#prefix";
inline SpillKey PrefixSpillKey(std::string tenant, std::string_view prefix_key) {
  return SpillKey{std::move(tenant), kPrefixSessionId, std::string("prefix/").append(prefix_key)};
}
// OK when `prefix_key` is a content key's shape: 64 lowercase hex digits (a sha256); else
// INVALID_ARGUMENT naming `field`.
absl::Status ValidatePrefixKey(std::string_view prefix_key, std::string_view field);
// Whether the tokens `policy` keeps depend on the prompt's queries (so a compressed prefix is
// reusable only together with the queries that drove it): every policy whose registry unit is not
// query-agnostic (streaming_llm, keydiff, knorm are), and any policy with the cake layer
// allocator. sidecar.proto PublishRequest says why.
bool PolicyIsQueryAware(const PolicyConfig& policy);

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

// OmniKV Select (policies/omnikv.md §4, §10): one item per sequence of a decode step.
struct SelectItem {
  std::string session_id;
  std::string sequence_id;
  // Idempotency key: a filter layer already selected at this step returns the same selection.
  int64_t step_id = 0;
  // The listed filter layers' queries (attention.layers: filter layers of the sequence's
  // policy, non-empty; queries only). The newest query is the current token's; uniform/exp keep
  // a window of the last W queries per filter layer across calls.
  AttentionInput attention;
  // N: tokens at positions below it are the prompt (the candidates); fixed by the sequence's
  // first Select. 0 = the sequence's next position at that call.
  int64_t prompt_tokens = 0;
};

struct FilterSelection {
  int32_t filter_layer = 0;
  std::vector<int32_t> positions;      // T_f, ascending
  std::vector<int32_t> sparse_layers;  // the layers that attend to T_f (ascending)
};

struct SelectResult {
  std::vector<FilterSelection> filters;  // in the order attention.layers lists them
  // One staging view per sparse layer of the listed filters, in layer order: slots
  // [0, positions.size()) hold T_f's tokens in position order, then the layer's generated tokens
  // (positions >= N) in position order. positions left empty (they are filters[].positions
  // followed by the generated positions).
  std::vector<LayerLayoutView> sparse_layers;
  int64_t prompt_tokens = 0;  // N
  int32_t budget_tokens = 0;  // k
  uint64_t host_bytes = 0;    // the sequence's offloaded prompt K/V in the host tier
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

struct SessionInfo {
  std::string session_id;
  std::string tenant;
  std::string worker_name;
  ModelLayout layout;
  int32_t num_blocks = 0;
  int32_t free_blocks = 0;
  int32_t sequences = 0;          // in the arena and spilled
  int32_t sequences_spilled = 0;  // of `sequences`, those in the host or disk tier
  absl::Time attached;
  absl::Time last_heartbeat;
  absl::Time lease_expires;
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

// Spill / Restore: where the sequence is now (Spill) or came from (Restore), and the bytes moved.
struct SpillResult {
  StorageTier tier = StorageTier::kArena;
  uint64_t bytes = 0;
};

struct PoolStats {
  int32_t sessions = 0;
  // Sequences of attached sessions, in the arena and spilled (as counted for tenants' quotas);
  // sequences_spilled of them are in the host or disk tier.
  int32_t sequences = 0;
  int32_t sequences_spilled = 0;
  uint64_t arena_bytes_capacity = 0;
  uint64_t arena_bytes_reserved = 0;  // sum of session arenas
  uint64_t arena_bytes_used = 0;      // blocks in use * block bytes
  int64_t tokens_appended = 0;
  int64_t tokens_evicted = 0;
  int64_t sessions_reclaimed = 0;   // by lease expiry or Reclaim()
  int64_t spilled_on_pressure = 0;  // sequences PoolOptions::spill_on_pressure moved out
};

// A tenant's limits (Admin.SetQuota); 0 = unlimited. arena_bytes bounds the arena blocks in use
// by the tenant's sequences (checked before every Reserve and DecodeStep: a tenant at or above
// it may not grow; and before every restore, explicit or automatic, with the copy's bytes);
// sequences bounds CreateSequence; host_bytes, disk_bytes and remote_bytes bound the spill
// tiers (checked through CheckTierQuota by whoever spills). remote_bytes counts the tenant's
// copies in the remote tier from every sidecar sharing it.
struct TenantQuota {
  uint64_t arena_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  int32_t sequences = 0;
  uint64_t remote_bytes = 0;
  bool unlimited() const {
    return arena_bytes == 0 && host_bytes == 0 && disk_bytes == 0 && sequences == 0 &&
           remote_bytes == 0;
  }
};

// What a tenant uses now. host_bytes/disk_bytes come from the tier-usage hook (0 without one).
struct TenantUsage {
  uint64_t arena_bytes = 0;           // blocks in use x block bytes
  uint64_t arena_bytes_reserved = 0;  // its sessions' arenas
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  int32_t sequences = 0;
  int32_t sessions = 0;
  // Only filled by TenantRemoteBytes' callers (it asks Redis): 0 in AllTenantUsage.
  uint64_t remote_bytes = 0;
};

// Layer-token totals of one policy over the pool's lifetime (live + released sequences), and
// what its live sequences hold now.
struct PolicyTokenTotals {
  std::string policy;
  int64_t appended = 0;
  int64_t evicted = 0;
  int64_t merged = 0;
  int64_t kept = 0;              // layer-tokens held now
  int32_t sequences = 0;         // live
  std::vector<int32_t> budgets;  // per live sequence: its budget tokens per layer (0 = unbounded)
};

struct RebudgetResult {
  int32_t rebudgeted = 0;            // sequences that got the budget (compressed when needed)
  std::vector<std::string> skipped;  // "session/sequence: reason"
};

class Session;     // defined in cache/pool.cc
class Sequence;    // cache/sequence.h
class ThreadPool;  // gpu/cpu/thread_pool.h

class KvPool {
 public:
  // `backend` and `clock` must outlive the pool.
  KvPool(Backend* backend, const Clock* clock, PoolOptions options);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // Sessions.
  absl::StatusOr<SessionView> Attach(const AttachParams& params);
  // Extends the lease. Never waits for a call in progress on the session.
  absl::StatusOr<HeartbeatResult> Heartbeat(std::string_view session_id);
  absl::StatusOr<ReleaseCounts> Detach(std::string_view session_id);
  // Reclaims every session whose lease lapsed at clock->Now(); returns how many.
  int ReapExpired();
  // Reclaims one session at once (its worker's connection ended). NOT_FOUND if already gone.
  absl::StatusOr<ReleaseCounts> Reclaim(std::string_view session_id);
  absl::StatusOr<SessionView> GetSession(std::string_view session_id) const;
  // A new descriptor of the session's arena memory (the caller closes it), for the arena socket
  // to hand to the session's worker. NOT_FOUND for an unknown session; FAILED_PRECONDITION when
  // its arena is not a memfd (a named file or device memory).
  absl::StatusOr<int> DuplicateArenaFd(std::string_view session_id) const;

  // Sequences.
  absl::StatusOr<SequenceCreated> CreateSequence(std::string_view session_id,
                                                 const SequenceParams& params);
  absl::StatusOr<ReleaseCounts> ReleaseSequence(std::string_view session_id,
                                                std::string_view sequence_id);

  // Reserves slots for `num_tokens` new tokens in `layers` (empty = all, else distinct, any
  // order). `positions` empty = next positions; else strictly increasing and each above every
  // position already in the sequence. One outstanding reservation per sequence
  // (FAILED_PRECONDITION otherwise). Strict budgets first evict down to the budget and refuse
  // num_tokens > prefill_block_tokens. A policy that needs attention cannot choose without it:
  // under a strict budget it evicts at Commit instead (whose attention is then required when
  // the sequence would be over budget), keeping the same bound of budget + prefill_block_tokens.
  absl::StatusOr<Reservation> Reserve(std::string_view session_id, std::string_view sequence_id,
                                      int32_t num_tokens, absl::Span<const int32_t> positions,
                                      absl::Span<const int32_t> layers);
  // Drops a pending reservation, returning its blocks.
  absl::Status CancelReservation(std::string_view session_id, std::string_view sequence_id,
                                 uint64_t reservation_id);
  // OK if `reservation_id` is the sequence's pending reservation (the check Commit makes, with the
  // same codes and messages); changes nothing.
  absl::Status CheckReservation(std::string_view session_id, std::string_view sequence_id,
                                uint64_t reservation_id) const;
  // Copies inline payload bytes (layout [layers][2][H][T][D] of the reservation) starting at
  // `payload_offset` into the reserved slots. OUT_OF_RANGE past payload_bytes.
  absl::Status WriteReserved(std::string_view session_id, std::string_view sequence_id,
                             uint64_t reservation_id, uint64_t payload_offset,
                             absl::Span<const uint8_t> bytes);
  // Publishes a reservation: the tokens become part of the sequence.
  // `attention` (may be null) is observed after the commit and used by the compression.
  // INVALID_ARGUMENT naming the attention.* field for a malformed input, or naming the policy
  // and `attention` when the call must evict a layer the policy needs attention for and the
  // input does not list it; nothing changes then (the reservation stays pending).
  absl::StatusOr<CommitResult> Commit(std::string_view session_id, std::string_view sequence_id,
                                      uint64_t reservation_id, bool compress_if_over_budget,
                                      const AttentionInput* attention = nullptr);
  // The commits of one BatchCommit, each as Commit does it, with one lookup per session: the
  // batch's sessions are locked (in id order) for the whole call; every item's sequence and
  // pending reservation is checked before any item is committed (a failure there commits
  // nothing), then the items are committed in order, and a failing item stops the batch with
  // the items before it committed. A sequence named twice is INVALID_ARGUMENT.
  CommitBatchResult CommitBatch(absl::Span<const CommitItem> items);

  absl::StatusOr<CompressResult> Compress(std::string_view session_id, std::string_view sequence_id,
                                          const CompressParams& params);

  // One decode step for many sequences (Phase::kDecode). Every item is validated before any is
  // executed (a bad item: its error, prefixed "items[i]: ", and nothing changed); then the items
  // run side by side on PoolOptions::decode_threads threads, with every session of the batch
  // locked for the whole step. Results in item order. An item that fails while running (arena
  // exhausted, backend error) fails the call with the lowest such item's error; the other items
  // have run.
  absl::StatusOr<std::vector<DecodeResult>> DecodeStep(absl::Span<const DecodeItem> items);

  // OmniKV: per item, the top-k prompt tokens of each listed filter layer and their K/V gathered
  // (host tier or arena -> staging blocks in the arena) for every sparse layer of its segment.
  // The first Select of a sequence fixes N and k and, with offload, moves the sparse layers'
  // prompt K/V to the host tier (freeing their blocks). The call's sessions are locked together
  // and every item is validated first (a bad item, or a sequence named twice: "items[i]: " and
  // its error, nothing changed); the items then run side by side on PoolOptions::decode_threads
  // threads with the results of running them in order (RunSelects, cache/sequence_kind.h); the
  // lowest item that fails while running (arena or host tier full) fails the call with its error,
  // earlier items having run. FAILED_PRECONDITION for a sequence whose policy is not omnikv.
  absl::StatusOr<std::vector<SelectResult>> Select(absl::Span<const SelectItem> items);

  // The tokens a retain_evicted sequence evicted, per (layer in `layers` (empty = all), kv head),
  // in eviction order. FAILED_PRECONDITION for a sequence created without retain_evicted.
  absl::StatusOr<std::vector<RetainedHead>> GetRetained(std::string_view session_id,
                                                        std::string_view sequence_id,
                                                        absl::Span<const int32_t> layers);

  // Dry run of Compress: scores and kept sets per layer; the sequence is unchanged.
  absl::StatusOr<std::vector<LayerScores>> Score(std::string_view session_id,
                                                 std::string_view sequence_id,
                                                 const ScoreParams& params);

  // `layers` empty = all. Positions only if `with_positions`.
  absl::StatusOr<SequenceLayout> GetLayout(std::string_view session_id,
                                           std::string_view sequence_id,
                                           absl::Span<const int32_t> layers,
                                           bool with_positions) const;
  // Reads `out.size()` bytes at `payload_offset` of the export payload [layers][2][H][count][D]
  // (slot order) of `layers`, provided the sequence is still at `version` (ABORTED otherwise).
  absl::Status ReadExport(std::string_view session_id, std::string_view sequence_id,
                          absl::Span<const int32_t> layers, uint64_t version,
                          uint64_t payload_offset, absl::Span<uint8_t> out) const;

  // Tiers (PoolOptions::tiers; UNIMPLEMENTED without). Spill moves a sequence out of the arena to
  // kHost, kDisk or kRemote (its blocks are freed; a spilled sequence can move between the
  // tiers);
  // FAILED_PRECONDITION with a pending reservation or when the disk tier is unavailable,
  // RESOURCE_EXHAUSTED when the tier or the tenant's tier quota is full. Every data-plane call
  // on a spilled sequence (Reserve, Commit, Append, Compress, DecodeStep, Score, GetLayout,
  // Export) restores it first, with Restore's errors.
  absl::StatusOr<SpillResult> Spill(std::string_view session_id, std::string_view sequence_id,
                                    StorageTier target);
  // Brings a spilled sequence back into the session's arena (new block table; K/V, positions and
  // policy state bit-identical) and deletes the spilled copy. Already in the arena: OK, tier
  // kArena. `from_session_id` (empty = `session_id`) adopts a disk copy left by a session that
  // ended (detached, reclaimed, or the sidecar restarted), or a remote copy spilled by any
  // sidecar sharing the remote tier (a remote copy is named by tenant and sequence id, so any
  // from_session_id not attached here names it; by convention the spilling session's id): same
  // tenant and model layout required,
  // FAILED_PRECONDITION while that session is still attached; ABORTED while another session
  // adopts the same copy (one adoption wins). RESOURCE_EXHAUSTED when the arena lacks blocks or
  // the copy would take the tenant past its arena_bytes quota (the spilled copy stays); DATA_LOSS
  // when the copy fails its checksum.
  absl::StatusOr<SpillResult> Restore(std::string_view session_id, std::string_view sequence_id,
                                      std::string_view from_session_id = {});
  // Compressed prefix reuse (sidecar.proto PublishRequest). Publish copies the sequence's state
  // (what Spill stores) under PrefixSpillKey(tenant, prefix_key) into the remote tier when one is
  // configured, else the disk tier; the sequence stays in the arena, unchanged. A query-aware
  // policy (PolicyIsQueryAware) that evicted tokens publishes only with query_window > 0
  // (FAILED_PRECONDITION otherwise). Held to the tenant's quota of that tier. Unpublish deletes
  // the tenant's copy under `prefix_key` wherever it is (NOT_FOUND without one).
  // CreateSequence(SequenceParams::from_prefix) starts sequences from a published copy.
  absl::StatusOr<SpillResult> Publish(std::string_view session_id, std::string_view sequence_id,
                                      std::string_view prefix_key, int32_t query_window);
  absl::Status Unpublish(std::string_view session_id, std::string_view prefix_key);
  // Every spilled copy the tiers hold (those of ended sessions and earlier runs included, lost
  // ones with their error), ordered by key. Empty without tiers.
  std::vector<SpilledInfo> ListSpilled() const;

  // Introspection (Admin).
  PoolStats GetStats() const;
  std::vector<SessionInfo> ListSessions() const;
  std::vector<SequenceInfo> ListSequences(std::string_view session_id) const;  // empty = all

  // Live defaults (Admin.SetDefaults): what CreateSequence uses for a sequence created without a
  // policy / budget. Start as options().default_policy / default_budget; a change applies to the
  // next CreateSequence. Callers validate (MakePolicy, budget range) before setting.
  void SetDefaults(std::optional<PolicyConfig> policy, std::optional<BudgetConfig> budget);
  PolicyConfig default_policy() const;
  BudgetConfig default_budget() const;

  // Tenant quotas (Admin.SetQuota). An unlimited quota removes the entry. Sequences over a
  // lowered quota stay; only growth is refused (RESOURCE_EXHAUSTED naming tenant and quota).
  void SetTenantQuota(const std::string& tenant, const TenantQuota& quota);
  TenantQuota GetTenantQuota(std::string_view tenant) const;              // unlimited if none
  std::vector<std::pair<std::string, TenantQuota>> TenantQuotas() const;  // sorted by tenant
  TenantUsage GetTenantUsage(std::string_view tenant) const;
  // Every tenant that has a session, with its usage, sorted by tenant.
  std::vector<std::pair<std::string, TenantUsage>> AllTenantUsage() const;
  // RESOURCE_EXHAUSTED if storing `extra_bytes` more in the host (host=true) or disk tier would
  // take `tenant` over its host_bytes / disk_bytes quota; for the spill path.
  absl::Status CheckTierQuota(std::string_view tenant, bool host, uint64_t extra_bytes) const;
  // Tier usage hook: (tenant, host) -> bytes the tenant holds in that tier. Set once at start by
  // whoever owns the tiers; null = 0.
  void SetTierUsageFn(std::function<uint64_t(std::string_view tenant, bool host)> fn);
  // The same for `tier` (kHost, kDisk or kRemote: its quota field).
  absl::Status CheckTierQuota(std::string_view tenant, StorageTier tier,
                              uint64_t extra_bytes) const;
  // Remote tier usage hook: tenant -> bytes of its remote copies (a Redis round trip, so it is
  // asked only by Spill to the remote tier and by Admin). Null = 0.
  void SetRemoteUsageFn(std::function<uint64_t(std::string_view tenant)> fn);
  uint64_t TenantRemoteBytes(std::string_view tenant) const;
  // Gives every sequence of `tenant` ("*" = every tenant) the budget `tokens_per_layer` (explicit
  // per-layer budgets cleared; strictness and prefill block kept) and compresses it to that
  // budget with its own policy. A sequence that cannot take it (capacity, a pending reservation,
  // an attention policy over budget without queries) is listed in `skipped`, unchanged except
  // that an attention policy keeps the new budget for its next Commit/DecodeStep.
  RebudgetResult RebudgetTenant(std::string_view tenant, int32_t tokens_per_layer);
  // Per policy, sorted by name (metrics).
  std::vector<PolicyTokenTotals> PolicyTotals() const;

  const PoolOptions& options() const { return options_; }
  Backend* backend() const { return backend_; }

 private:
  absl::StatusOr<std::shared_ptr<Session>> FindSession(std::string_view session_id) const;
  // Takes the session out of the map and releases everything it holds.
  absl::StatusOr<ReleaseCounts> RemoveSession(std::string_view session_id, bool reclaimed);
  ReleaseCounts DestroySession(std::shared_ptr<Session> session);

  Backend* const backend_;
  const Clock* const clock_;
  const PoolOptions options_;
  const std::unique_ptr<ThreadPool> decode_pool_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t arena_bytes_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sessions_reclaimed_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t sessions_pending_ ABSL_GUARDED_BY(mu_) = 0;  // admitted, arena being created
  // The tenant's arena quota: RESOURCE_EXHAUSTED when its blocks in use reach it.
  absl::Status CheckArenaQuota(const std::string& tenant) const;
  // Bumps the tenant's sequence count if below its quota (RESOURCE_EXHAUSTED otherwise).
  absl::Status AddTenantSequence(const std::string& tenant);
  // With session.mu held, before a sequence joins `session`: the session's end, a taken id
  // (ALREADY_EXISTS), the session's and the tenant's sequence limits (RESOURCE_EXHAUSTED). Then
  // counts the sequence for its tenant and returns its id (`requested`, or a fresh one if empty).
  absl::StatusOr<std::string> AdmitSequenceLocked(Session& session, std::string_view session_id,
                                                  const std::string& requested);
  // CreateSequence with params.from_prefix.
  absl::StatusOr<SequenceCreated> CreateFromPrefix(std::string_view session_id,
                                                   const SequenceParams& params);
  void RemoveTenantSequences(const std::string& tenant, int32_t count);
  // Adds a released sequence's totals to its policy's.
  void RetireTotals(const Sequence& sequence);

  // Leaf lock (nothing else is taken while it is held): live defaults, quotas, sequence counts.
  mutable absl::Mutex quota_mu_;
  PolicyConfig live_default_policy_ ABSL_GUARDED_BY(quota_mu_);
  BudgetConfig live_default_budget_ ABSL_GUARDED_BY(quota_mu_);
  absl::flat_hash_map<std::string, TenantQuota> quotas_ ABSL_GUARDED_BY(quota_mu_);
  absl::flat_hash_map<std::string, int32_t> tenant_sequences_ ABSL_GUARDED_BY(quota_mu_);
  std::function<uint64_t(std::string_view, bool)> tier_usage_fn_ ABSL_GUARDED_BY(quota_mu_);
  std::function<uint64_t(std::string_view)> remote_usage_fn_ ABSL_GUARDED_BY(quota_mu_);
  absl::flat_hash_map<std::string, PolicyTokenTotals> retired_ ABSL_GUARDED_BY(quota_mu_);

  // Leaf lock: spilled copies being adopted (Restore with from_session_id) -> the adopting
  // session, so that two sessions never both restore one copy.
  absl::Mutex adopt_mu_;
  absl::flat_hash_map<SpillKey, std::string> adopting_ ABSL_GUARDED_BY(adopt_mu_);

  // Lifetime totals for PoolStats (layer-tokens), bumped by sessions without taking mu_.
  std::atomic<int64_t> tokens_appended_{0};
  std::atomic<int64_t> tokens_evicted_{0};
  std::atomic<int64_t> spilled_on_pressure_{0};
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POOL_H_
