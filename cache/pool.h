// KvPool: the cache core's front door. Owns every attached session (its arena, block allocator,
// lease) and every sequence in it, and runs the policies. The service layer converts protobuf to
// plain value types (session_types.h, sequence_types.h, select_types.h, tier_types.h,
// tenant_types.h; PoolOptions in pool_options.h) and calls in; nothing here knows gRPC, CUDA or
// RocksDB.
//
// Errors (absl codes, mapped 1:1 to gRPC by the service): INVALID_ARGUMENT names the offending
// field using the proto field names; NOT_FOUND for unknown session/sequence/reservation;
// FAILED_PRECONDITION for calls in the wrong state; RESOURCE_EXHAUSTED when the arena or the pool
// is full; ABORTED when a sequence changed under a multi-call read (export). A failed call leaves
// every session and sequence exactly as it was.
//
// KvPool is the facade over its parts (cache/internal/): SessionTable (sessions, leases, the
// arena capacity), TenantLedger (quotas and usage; it admits or refuses growth) and TierMover
// (spill, restore, pressure demotion, published prefixes). Each public method looks its session
// up once; the calls that take a SessionRef (cache/session_ref.h) none.
//
// Threading: every method is thread-safe. The session table has its own lock; each session has a
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
#include "cache/pool_options.h"
#include "cache/select_types.h"
#include "cache/sequence_types.h"
#include "cache/session_ref.h"
#include "cache/session_types.h"
#include "cache/tenant_types.h"
#include "cache/tier.h"
#include "cache/tier_types.h"
#include "gpu/arena.h"
#include "gpu/backend.h"
#include "gpu/base/layout.h"

namespace kvs {

class Sequence;      // cache/sequence.h
struct SequenceEnv;  // cache/sequence.h
class Session;       // cache/internal/session.h
class SessionTable;  // cache/internal/session_table.h
class TenantLedger;  // cache/internal/tenant_ledger.h
class TierMover;     // cache/internal/tier_mover.h
class ThreadPool;    // gpu/cpu/thread_pool.h

// One item of KvPool::ReserveBatch: Reserve's arguments. Views: they must outlive the call.
struct ReserveItem {
  std::string_view session_id;
  std::string_view sequence_id;
  int32_t num_tokens = 0;
  absl::Span<const int32_t> positions;  // empty = next positions
  absl::Span<const int32_t> layers;     // empty = all
};

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
  // The same on a session already looked up: NOT_FOUND, as by id, once it has ended (the table
  // holds another session or none under its id), and nothing changes.
  absl::StatusOr<HeartbeatResult> Heartbeat(const SessionRef& session);
  absl::StatusOr<ReleaseCounts> Detach(const SessionRef& session);
  // Reclaims every session whose lease lapsed at clock->Now(); returns how many.
  int ReapExpired();
  // Reclaims one session at once (its worker's connection ended). NOT_FOUND if already gone.
  absl::StatusOr<ReleaseCounts> Reclaim(std::string_view session_id);
  absl::StatusOr<SessionView> GetSession(std::string_view session_id) const;
  // The live session under `session_id`, as a handle for the calls below that take one (a
  // handler that needs the layout or owner first then looks the session up once per RPC).
  // NOT_FOUND as every call by id answers for an unknown or lapsed session.
  absl::StatusOr<SessionRef> FindSession(std::string_view session_id) const;
  // A new descriptor of the session's arena memory (the caller closes it), for the arena socket
  // to hand to the session's worker. NOT_FOUND for an unknown session; FAILED_PRECONDITION when
  // its arena is not a memfd (a named file or device memory).
  absl::StatusOr<int> DuplicateArenaFd(std::string_view session_id) const;
  // Copies `bytes` of the session's arena from `offset` into host memory `out` (Arena::Read):
  // what a worker would see there, on any backend, for diagnostics and tests. NOT_FOUND for an
  // unknown session; OUT_OF_RANGE past the arena's end.
  absl::Status ReadArena(std::string_view session_id, uint64_t offset, void* out,
                         uint64_t bytes) const;

  // Sequences.
  absl::StatusOr<SequenceCreated> CreateSequence(std::string_view session_id,
                                                 const SequenceParams& params);
  absl::StatusOr<SequenceCreated> CreateSequence(const SessionRef& session,
                                                 const SequenceParams& params);
  absl::StatusOr<ReleaseCounts> ReleaseSequence(std::string_view session_id,
                                                std::string_view sequence_id);
  absl::StatusOr<ReleaseCounts> ReleaseSequence(const SessionRef& session,
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
  absl::StatusOr<Reservation> Reserve(const SessionRef& session, std::string_view sequence_id,
                                      int32_t num_tokens, absl::Span<const int32_t> positions,
                                      absl::Span<const int32_t> layers);
  // Drops a pending reservation, returning its blocks.
  absl::Status CancelReservation(std::string_view session_id, std::string_view sequence_id,
                                 uint64_t reservation_id);
  absl::Status CancelReservation(const SessionRef& session, std::string_view sequence_id,
                                 uint64_t reservation_id);
  // The reservations of one BatchReserve, all or nothing, with one lookup per session: the
  // batch's sessions are locked (in id order) for the whole call; every item's sequence is found
  // (restored first when spilled) before any item reserves (a failure there reserves nothing),
  // then the items reserve in order, each as Reserve does it (the tenant's arena quota, then
  // the reservation, demoting under pressure); if item i fails, the reservations of items < i
  // are cancelled under the same locks, so no other call saw them. On failure `*failed` (if not
  // null) is the item whose error is returned. Caveat, as for Reserve: a strict-budget item
  // evicts before it reserves, and the rollback does not undo that eviction.
  // `found`: as for CommitBatch.
  absl::StatusOr<std::vector<Reservation>> ReserveBatch(absl::Span<const ReserveItem> items,
                                                        absl::Span<const SessionRef> found = {},
                                                        int32_t* failed = nullptr);
  // OK if `reservation_id` is the sequence's pending reservation (the check Commit makes, with the
  // same codes and messages); changes nothing.
  absl::Status CheckReservation(std::string_view session_id, std::string_view sequence_id,
                                uint64_t reservation_id) const;
  // Copies inline payload bytes (layout [layers][2][H][T][D] of the reservation) starting at
  // `payload_offset` into the reserved slots. OUT_OF_RANGE past payload_bytes.
  absl::Status WriteReserved(std::string_view session_id, std::string_view sequence_id,
                             uint64_t reservation_id, uint64_t payload_offset,
                             absl::Span<const uint8_t> bytes);
  absl::Status WriteReserved(const SessionRef& session, std::string_view sequence_id,
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
  absl::StatusOr<CommitResult> Commit(const SessionRef& session, std::string_view sequence_id,
                                      uint64_t reservation_id, bool compress_if_over_budget,
                                      const AttentionInput* attention = nullptr);
  // The commits of one BatchCommit, each as Commit does it, with one lookup per session: the
  // batch's sessions are locked (in id order) for the whole call; every item's sequence and
  // pending reservation is checked before any item is committed (a failure there commits
  // nothing), then the items are committed in order, and a failing item stops the batch with
  // the items before it committed. A sequence named twice is INVALID_ARGUMENT.
  // `found`: sessions of the batch the caller has already looked up (FindSession); the batch
  // uses them as they are and looks up only the others.
  CommitBatchResult CommitBatch(absl::Span<const CommitItem> items,
                                absl::Span<const SessionRef> found = {});

  absl::StatusOr<CompressResult> Compress(std::string_view session_id, std::string_view sequence_id,
                                          const CompressParams& params);
  absl::StatusOr<CompressResult> Compress(const SessionRef& session, std::string_view sequence_id,
                                          const CompressParams& params);

  // One decode step for many sequences (Phase::kDecode). Every item is validated before any is
  // executed (a bad item: its error, prefixed "items[i]: ", and nothing changed); then the items
  // run side by side on PoolOptions::decode_threads threads, with every session of the batch
  // locked for the whole step. Results in item order. An item that fails while running (arena
  // exhausted, backend error) fails the call with the lowest such item's error; the other items
  // have run. `found`: as for CommitBatch.
  absl::StatusOr<std::vector<DecodeResult>> DecodeStep(absl::Span<const DecodeItem> items,
                                                       absl::Span<const SessionRef> found = {});

  // OmniKV: per item, the top-k prompt tokens of each listed filter layer and their K/V gathered
  // (host tier or arena -> staging blocks in the arena) for every sparse layer of its segment.
  // The first Select of a sequence fixes N and k and, with offload, moves the sparse layers'
  // prompt K/V to the host tier (freeing their blocks). The call's sessions are locked together
  // and every item is validated first (a bad item, or a sequence named twice: "items[i]: " and
  // its error, nothing changed); the items then run side by side on PoolOptions::decode_threads
  // threads with the results of running them in order (RunSelects, cache/sequence_kind.h); the
  // lowest item that fails while running (arena or host tier full) fails the call with its error,
  // earlier items having run. FAILED_PRECONDITION for a sequence whose policy is not omnikv.
  // `found`: as for CommitBatch.
  absl::StatusOr<std::vector<SelectResult>> Select(absl::Span<const SelectItem> items,
                                                   absl::Span<const SessionRef> found = {});

  // The tokens a retain_evicted sequence evicted, per (layer in `layers` (empty = all), kv head),
  // in eviction order. FAILED_PRECONDITION for a sequence created without retain_evicted.
  absl::StatusOr<std::vector<RetainedHead>> GetRetained(std::string_view session_id,
                                                        std::string_view sequence_id,
                                                        absl::Span<const int32_t> layers);
  absl::StatusOr<std::vector<RetainedHead>> GetRetained(const SessionRef& session,
                                                        std::string_view sequence_id,
                                                        absl::Span<const int32_t> layers);

  // Dry run of Compress: scores and kept sets per layer; the sequence is unchanged.
  absl::StatusOr<std::vector<LayerScores>> Score(std::string_view session_id,
                                                 std::string_view sequence_id,
                                                 const ScoreParams& params);
  absl::StatusOr<std::vector<LayerScores>> Score(const SessionRef& session,
                                                 std::string_view sequence_id,
                                                 const ScoreParams& params);

  // `layers` empty = all. Positions only if `with_positions`.
  absl::StatusOr<SequenceLayout> GetLayout(std::string_view session_id,
                                           std::string_view sequence_id,
                                           absl::Span<const int32_t> layers,
                                           bool with_positions) const;
  absl::StatusOr<SequenceLayout> GetLayout(const SessionRef& session,
                                           std::string_view sequence_id,
                                           absl::Span<const int32_t> layers,
                                           bool with_positions) const;
  // Reads `out.size()` bytes at `payload_offset` of the export payload [layers][2][H][count][D]
  // (slot order) of `layers`, provided the sequence is still at `version` (ABORTED otherwise).
  absl::Status ReadExport(std::string_view session_id, std::string_view sequence_id,
                          absl::Span<const int32_t> layers, uint64_t version,
                          uint64_t payload_offset, absl::Span<uint8_t> out) const;
  absl::Status ReadExport(const SessionRef& session, std::string_view sequence_id,
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
  // Spill, Restore, Publish and Unpublish on the session as the caller looked it up (FindSession):
  // its lookup's error is answered where the call by id would meet it, after the checks of the
  // tiers and the parameters, so that a request with a bad parameter and a missing session
  // answers the same either way. A session that ended after the lookup answers NOT_FOUND.
  absl::StatusOr<SpillResult> Spill(const absl::StatusOr<SessionRef>& session,
                                    std::string_view sequence_id, StorageTier target);
  absl::StatusOr<SpillResult> Restore(const absl::StatusOr<SessionRef>& session,
                                      std::string_view sequence_id,
                                      std::string_view from_session_id = {});
  // `target`: PublishRequest.tier (nullopt = unspecified: the remote tier, else disk).
  absl::StatusOr<SpillResult> Publish(const absl::StatusOr<SessionRef>& session,
                                      std::string_view sequence_id, std::string_view prefix_key,
                                      int32_t query_window,
                                      std::optional<StorageTier> target = std::nullopt);
  // sidecar.proto LookupPrefixesRequest: for each key, where the session's tenant has a prefix
  // under it (nullopt: none). INVALID_ARGUMENT naming prefix_keys[i] for a malformed key.
  absl::StatusOr<std::vector<std::optional<SpilledInfo>>> LookupPrefixes(
      const absl::StatusOr<SessionRef>& session, const std::vector<std::string>& keys) const;
  absl::Status Unpublish(const absl::StatusOr<SessionRef>& session, std::string_view prefix_key);
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
  // Takes the session out of the table and releases everything it holds.
  absl::StatusOr<ReleaseCounts> RemoveSession(std::string_view session_id, bool reclaimed);
  ReleaseCounts DestroySession(std::shared_ptr<Session> session);
  // What a call on one of the session's sequences borrows (the session's lock held), with the
  // pool's token counters.
  SequenceEnv EnvOf(Session& session);
  // Looks the session up once and runs fn(sequence, env, session) on `sequence_id` under the
  // session's lock, restoring a spilled sequence first; NOT_FOUND for an unknown session or
  // sequence. The const form's env counts nothing (reads). Defined in pool.cc, their only user.
  template <typename Fn>
  auto OnSequence(std::string_view session_id, std::string_view sequence_id, Fn&& fn);
  template <typename Fn>
  auto OnSequence(std::string_view session_id, std::string_view sequence_id, Fn&& fn) const;
  // The same on a session already looked up (SessionRef): a session that ended since answers
  // NOT_FOUND as an unknown one does.
  template <typename Fn>
  auto OnSequence(Session& session, std::string_view sequence_id, Fn&& fn);
  template <typename Fn>
  auto OnSequence(Session& session, std::string_view sequence_id, Fn&& fn) const;
  static Session& Of(const SessionRef& ref) { return *ref.session_; }
  static const std::shared_ptr<Session>& SharedOf(const SessionRef& ref) { return ref.session_; }
  // With session.mu held, before a sequence joins `session`: the session's end, a taken id
  // (ALREADY_EXISTS), the session's and the tenant's sequence limits (RESOURCE_EXHAUSTED). Then
  // counts the sequence for its tenant and returns its id (`requested`, or a fresh one if empty).
  absl::StatusOr<std::string> AdmitSequenceLocked(Session& session, const std::string& requested);
  // CreateSequence on a session already looked up, without params.from_prefix.
  absl::StatusOr<SequenceCreated> CreateInSession(Session& session, const SequenceParams& params);
  // CreateSequence with params.from_prefix. `found`: the session if the caller already looked it
  // up (else it is looked up after the parameters are checked, as by id).
  absl::StatusOr<SequenceCreated> CreateFromPrefix(std::string_view session_id,
                                                   const SequenceParams& params,
                                                   const SessionRef* found = nullptr);
  // Reserve's work on `sequence` with session.mu held: the reservation, demoting the session's
  // least recently used other sequences while the arena is full (spill_on_pressure).
  absl::StatusOr<Reservation> ReserveLocked(Session& session, Sequence& sequence,
                                            const SequenceEnv& env, int32_t num_tokens,
                                            absl::Span<const int32_t> positions,
                                            absl::Span<const int32_t> layers);
  // Releases one sequence in the arena: its blocks and pinned host entries; its totals retired.
  ReleaseCounts ReleaseLocked(Session& session, Sequence& sequence);
  // Adds a released sequence's totals to its policy's.
  void RetireTotals(const Sequence& sequence);

  Backend* const backend_;
  const Clock* const clock_;
  const PoolOptions options_;
  const std::unique_ptr<ThreadPool> decode_pool_;
  // The pool's parts (cache/internal/): sessions and leases, the tenant ledger, tier movement.
  const std::unique_ptr<SessionTable> sessions_;
  const std::unique_ptr<TenantLedger> ledger_;
  const std::unique_ptr<TierMover> mover_;

  // Leaf lock (nothing else is taken while it is held): live defaults, released totals.
  mutable absl::Mutex defaults_mu_;
  PolicyConfig live_default_policy_ ABSL_GUARDED_BY(defaults_mu_);
  BudgetConfig live_default_budget_ ABSL_GUARDED_BY(defaults_mu_);
  absl::flat_hash_map<std::string, PolicyTokenTotals> retired_ ABSL_GUARDED_BY(defaults_mu_);

  // Lifetime totals for PoolStats (layer-tokens), bumped by sessions without a pool lock.
  std::atomic<int64_t> tokens_appended_{0};
  std::atomic<int64_t> tokens_evicted_{0};
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POOL_H_
