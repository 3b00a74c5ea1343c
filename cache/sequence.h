// Sequence: one request's cache inside a session: per layer a block table, a token count (the
// same for every kv head) and the original position of the token in every (head, slot); the
// pending reservation; the policy and budget. Implements the sequence half of KvPool (see
// cache/pool.h for the contract of each call): reserve -> write -> commit, eviction to a budget
// with hole-filling compaction, layouts and export reads.
//
// Inline payloads ([layer][2][H][T][D]) are copied in runs of rows that are contiguous in one
// block, through Arena::Write/Read; eviction goes through the Policy and Backend::CopyRows.
//
// Every call that may evict (Commit, Compress, DecodeStep, Score, strict Reserve) runs one policy
// step (cache/policy/policy.h): validate the attention input (before anything changes) ->
// Observe the layers it lists (probabilities from Backend::AttentionProbs, or the worker's own)
// -> allocate per-layer keeps (explicit per-layer budgets, else the policy's allocator) -> Select
// -> Merge -> compact the rows and every layer's LayerPolicyState together. Score runs the same
// step on copies of the states and stops after Select. The transient step scores are cleared at
// the end of every call, whether it succeeded or not.
//
// K/V and queries must be finite: inline K/V is checked on the host before it is written, rows a
// worker wrote into reserved slots are checked through Backend::FindNonFinite when they are
// committed (Commit, DecodeStep), and attention inputs in ValidateAttention; a non-finite value
// is INVALID_ARGUMENT naming where it is, with nothing changed.
//
// Threading: not thread-safe; the owning session serialises every call under its lock. A failed
// call leaves the sequence as it was: everything is validated first, and a step that still fails
// after the token was appended (a policy or allocator error) is rolled back from a checkpoint of
// the metadata taken before the call. Only a backend failure after compaction started moving
// rows cannot be undone; it reports INTERNAL.
#ifndef KVSIDECAR_CACHE_SEQUENCE_H_
#define KVSIDECAR_CACHE_SEQUENCE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/block_allocator.h"
#include "cache/compaction.h"
#include "cache/policy/policy.h"
#include "cache/pool.h"
#include "cache/sequence_kind.h"
#include "cache/tier.h"
#include "gpu/arena.h"
#include "gpu/backend.h"
#include "gpu/base/layout.h"

namespace kvs {

class ThreadPool;  // gpu/cpu/thread_pool.h

// Stores (data non-null) or drops (null) a sequence's pinned host-tier entry; the sequence gives
// the key's sequence_id, the caller completes the key with tenant and session.
using HostPin =
    std::function<absl::Status(const SpillKey& key, std::shared_ptr<const SpilledSequence> data)>;

// What a sequence borrows from its session for one call.
struct SequenceEnv {
  const ModelLayout& layout;
  Arena& arena;
  BlockAllocator& allocator;
  Backend& backend;
  std::string_view session_id;  // for messages
  int32_t max_tokens_per_call = 1 << 20;
  // Pool-wide counters in layer-tokens (a token appended to 3 layers counts 3); may be null.
  std::atomic<int64_t>* tokens_appended = nullptr;
  std::atomic<int64_t>* tokens_evicted = nullptr;
  // Where retain_evicted sequences keep what they evict (null = such an eviction fails).
  const HostPin* host_pin = nullptr;
  // Host threads for bookkeeping that touches no K/V (planning an eviction layer by layer); null
  // runs it on the calling thread. A loop started inside another loop of the pool runs inline.
  ThreadPool* host_pool = nullptr;
  // The session's query staging area in the arena (AttentionInput::staging_offset is relative
  // to its start); staging_bytes 0 = none.
  uint64_t staging_offset = 0;
  uint64_t staging_bytes = 0;
};

// `layers` as a request gives them: empty = all of [0, num_layers); else each in range and
// distinct, kept in the order given. INVALID_ARGUMENT naming "layers[i]" otherwise.
absl::StatusOr<std::vector<int32_t>> ResolveLayers(absl::Span<const int32_t> layers,
                                                   int32_t num_layers);

// The finiteness checks of the rows workers wrote into the pending reservations of several
// sequences, run as one Backend::FindNonFinite call: a decode BatchCommit checks a few rows of
// every (sequence, layer, K or V), and one call over the whole batch lets the backend spread
// them over its threads and keep the reads of many rows in flight, where one small call per
// sequence ran each on one thread.
class PendingRowChecks {
 public:
  // Starts the jobs of one more sequence; the index it returns names them in first().
  size_t AddGroup();
  // Groups added so far (the index the next AddGroup returns).
  size_t groups() const { return group_begin_.size(); }
  // One job of the current group: `rows` row offsets (filled in by the caller) of `row_elements`
  // values of `dtype` in `arena`.
  // With `norms` ([rows], kept alive until Run returns), the check writes each row's L2 norm there
  // (FiniteCheckJob::row_norms).
  uint64_t* AddJob(const uint8_t* arena, int64_t rows, int32_t row_elements, DType dtype,
                   float* norms = nullptr);
  // One backend call over every job (and a synchronisation); then first() holds the results.
  absl::Status Run(Backend& backend);
  // Per job of group `group`, in the order added: the first non-finite flat index, or -1.
  absl::Span<const int64_t> first(size_t group) const;

 private:
  std::vector<uint64_t> offsets_;
  std::vector<FiniteCheckJob> jobs_;  // row_offsets and first_non_finite are set by Run
  std::vector<size_t> offset_begin_;  // per job: where its rows start in offsets_
  std::vector<size_t> group_begin_;   // per group: its first job
  std::vector<int64_t> first_;
};

class Sequence {
 public:
  // `policy` must be non-null; `budget` must already be validated against the session.
  Sequence(std::string id, const ModelLayout& layout, std::unique_ptr<Policy> policy,
           BudgetConfig budget, absl::Time created);

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;
  ~Sequence();

  const std::string& id() const { return id_; }
  const PolicyConfig& policy_config() const { return policy_->config(); }
  const BudgetConfig& budget() const { return budget_; }
  // Admin re-budget: the caller validated `budget` against the session and compresses after.
  void set_budget(const BudgetConfig& budget) { budget_ = budget; }
  // Lifetime layer-token totals of this sequence (metrics per policy).
  struct Totals {
    int64_t appended = 0;
    int64_t evicted = 0;
    int64_t merged = 0;
  };
  const Totals& totals() const { return totals_; }
  uint64_t version() const { return version_; }
  absl::Time created() const { return created_; }
  absl::Time last_used() const { return last_used_; }
  void Touch(absl::Time now) { last_used_ = now; }

  std::vector<int32_t> counts() const;
  // Blocks this sequence holds, the pending reservation's included.
  int32_t blocks_held() const;
  bool has_pending() const { return pending_.has_value(); }

  absl::StatusOr<Reservation> Reserve(const SequenceEnv& env, uint64_t reservation_id,
                                      int32_t num_tokens, absl::Span<const int32_t> positions,
                                      absl::Span<const int32_t> layers);
  absl::Status Cancel(const SequenceEnv& env, uint64_t reservation_id);
  absl::Status WriteReserved(const SequenceEnv& env, uint64_t reservation_id,
                             uint64_t payload_offset, absl::Span<const uint8_t> bytes);
  // `attention` (may be null) is observed after the commit (Phase::kPrefill). Under a strict
  // budget a policy that needs attention evicts here (not in Reserve), whatever
  // `compress_if_over_budget` says, so the commit must then carry attention.
  // `rows_checked`: the outcome of the pending rows' finiteness check when the caller ran it
  // already (KvPool::CommitBatch checks every item's rows in one backend call, through
  // AddPendingRowChecks and PendingRowsResult); null: Commit runs the check itself. Either way
  // it is reported at the same point of the validation.
  absl::StatusOr<CommitResult> Commit(const SequenceEnv& env, uint64_t reservation_id,
                                      bool compress_if_over_budget,
                                      const AttentionInput* attention = nullptr,
                                      const absl::Status* rows_checked = nullptr);
  // The finiteness check of the pending reservation's rows in two halves, for a caller batching
  // several sequences' checks: the jobs of those rows (one per listed layer and K or V, rows
  // [head][token]) as one group of `checks`; then, once `checks` ran, the outcome from that
  // group's results (INVALID_ARGUMENT naming the first non-finite value). Needs a pending
  // reservation; changes nothing the sequence holds (a policy that keeps key norms gets the
  // pending keys' norms, which the commit then publishes with them).
  void AddPendingRowChecks(const SequenceEnv& env, PendingRowChecks& checks);
  absl::Status PendingRowsResult(absl::Span<const int64_t> first) const;
  absl::StatusOr<CompressResult> Compress(const SequenceEnv& env, const CompressParams& params);
  // Dry run of Compress on copies of the policy state; changes nothing.
  absl::StatusOr<std::vector<LayerScores>> Score(const SequenceEnv& env,
                                                 const ScoreParams& params) const;
  absl::StatusOr<SequenceLayout> GetLayout(const SequenceEnv& env, absl::Span<const int32_t> layers,
                                           bool with_positions) const;
  absl::Status ReadExport(const SequenceEnv& env, absl::Span<const int32_t> layers,
                          uint64_t version, uint64_t payload_offset, absl::Span<uint8_t> out) const;
  // Returns every block (pending ones included) to the allocator; the sequence is then empty.
  // Returns how many blocks were freed.
  int32_t Release(const SequenceEnv& env);

  // OK if `reservation_id` is the pending reservation; NOT_FOUND or FAILED_PRECONDITION (already
  // committed or cancelled) otherwise.
  absl::Status CheckPending(uint64_t reservation_id) const;

  // The kind chosen at creation from the policy's capabilities (cache/sequence_kind.h).
  SequenceKind& kind() { return *kind_; }
  // A kind that never evicts (OmniKV) has no budget, and Compress and Score answer
  // FAILED_PRECONDITION.
  bool never_evicts() const;
  // False once an OmniKV sequence has selected (its state spans arena, staging and host tier).
  bool spillable() const;
  // Validates a Select item against the sequence; changes nothing.
  absl::Status CheckSelect(const SequenceEnv& env, const SelectItem& item) const;
  // Keys (sequence_id part only) of the sequence's pinned host-tier entries: OmniKV's offloaded
  // prompt and retain_evicted's chunks. The owner erases them when it releases the sequence.
  std::vector<SpillKey> pinned_host_keys() const;
  uint64_t host_bytes() const;  // bytes those entries hold

  // retain_evicted: every later eviction first copies the evicted rows, their positions and
  // selection scores into a pinned host-tier chunk (SequenceEnv::host_pin); a full host tier
  // fails the evicting call before anything changes.
  void set_retain_evicted(bool retain) { retain_evicted_ = retain; }
  bool retain_evicted() const { return retain_evicted_; }
  // Per-layer sliding windows (empty or one per layer, validated by the caller; 0 = none): a
  // layer with a window holds exactly its last W tokens, chosen by position, never by the
  // policy. Set once, before the first append.
  void set_layer_windows(std::vector<int32_t> windows) { windows_ = std::move(windows); }
  const std::vector<int32_t>& layer_windows() const { return windows_; }
  // The retained tokens of `layers` (empty = all), per (layer, head).
  absl::StatusOr<std::vector<RetainedHead>> Retained(absl::Span<const int32_t> layers) const;

  // Spill (cache/sequence_snapshot.cc): the sequence's full state (EncodeSnapshot) and the bytes
  // of every layer's blocks. FAILED_PRECONDITION while a reservation is pending. Changes nothing.
  absl::StatusOr<SpilledSequence> Spill(const SequenceEnv& env) const;
  // A sequence rebuilt from what Spill produced, in fresh blocks of env.allocator: bit-identical
  // K/V, positions and policy state. RESOURCE_EXHAUSTED (nothing allocated) when the arena lacks
  // the blocks; DATA_LOSS when `data` is malformed; FAILED_PRECONDITION when it was spilled from
  // a different model layout. A non-empty `id` names the rebuilt sequence instead of the id it
  // was spilled with (a sequence started from a published prefix, KvPool::CreateSequence).
  static absl::StatusOr<std::unique_ptr<Sequence>> Restore(const SequenceEnv& env,
                                                           const SpilledSequence& data,
                                                           std::string_view id = {});

 private:
  // The OmniKV kind reads the layers and moves the offloaded prompt out of them.
  friend class OmniKvKind;

  struct LayerState {
    std::vector<int32_t> blocks;  // ceil(count / B) + the pending reservation's
    int32_t count = 0;
    std::vector<std::vector<int32_t>> positions;  // [H][count], slot order; empty until used
    int64_t appended = 0;                         // tokens ever committed to this layer
    // Above every position ever committed to this layer: a layer's new positions must start
    // here, whatever other layers hold (a cascading prefill commits the prompt's positions
    // layer by layer).
    int64_t next_position = 0;
  };
  struct Pending {
    uint64_t id = 0;
    int32_t num_tokens = 0;
    std::vector<int32_t> layers;  // in the order asked
    std::vector<int32_t> positions;
    uint64_t payload_bytes = 0;
    // [i][H][num_tokens]: the norms of the keys of layers[i], written by the finiteness check
    // when the policy keeps key norms (AddPendingRowChecks); empty otherwise.
    std::vector<float> key_norms;
  };
  // Per-layer result of an eviction.
  struct Eviction {
    std::vector<int32_t> evicted;  // per layer of the sequence (0 where untouched)
    std::vector<int32_t> merged;   // per layer, from Policy::Merge
    // Per layer [H]: the lowest position each head evicted, -1 = none (DecodeStep).
    std::vector<std::vector<int32_t>> evicted_positions;
    int32_t blocks_freed = 0;
    uint64_t bytes_copied = 0;  // K/V bytes the compaction copied, every layer
  };
  // A validated AttentionInput, resolved against the sequence it will be observed on.
  struct StepAttention {
    const AttentionInput* input = nullptr;
    std::vector<int32_t> layers;           // listed layers, in the order given
    std::vector<uint64_t> score_offsets;   // per listed layer: first float in input->scores
    std::vector<int32_t> query_positions;  // [w], resolved (defaults filled in)
    std::vector<uint8_t> listed;           // per layer of the model
    // Queries in the staging area, read to the host for a host step (LoadStagedQueries); a
    // device step reads them where they are.
    std::vector<float> staged;
    bool has_queries() const {
      return !input->queries.empty() || input->staging_offset.has_value();
    }
    // The queries on the host: inline, or staged once loaded.
    const float* host_queries() const {
      return input->staging_offset.has_value() ? staged.data() : input->queries.data();
    }
  };
  // The budget of one step: explicit per-layer tokens win over `tokens` (the allocator's).
  struct StepBudget {
    int32_t tokens = 0;
    absl::Span<const int32_t> per_layer;
    bool any() const { return tokens > 0 || !per_layer.empty(); }
  };

 public:
  // DecodeStep (KvPool::DecodeStep, cache/sequence_decode.cc). CheckDecode validates one item
  // against the sequence as it will be after the step, changing nothing (a pending token's key
  // norms are taken with its check), and returns what the step runs on: its attention resolved,
  // and with `checks`, the group of `checks` that holds its reserved rows' finiteness check (the
  // caller runs the checks of every item in one call and refuses the item whose rows fail;
  // without, the check runs here). DecodeAll then steps every checked item of a call together:
  // each new token committed (inline ones written in one backend call), then one policy step
  // over all the items' layers. A failure fails every item and leaves each as it was.
  struct DecodePlan {
    std::optional<StepAttention> attention;
    std::optional<size_t> rows_group;
    // The reserved rows' finite check is left to the step (a backend that batches calls): the
    // device path's kChoose reads those rows anyway, and the host path checks them in its one
    // call for the new tokens (CommitNewTokens), so the step pays no wait of its own for them.
    bool rows_deferred = false;
  };
  absl::StatusOr<DecodePlan> CheckDecode(const SequenceEnv& env, const DecodeItem& item,
                                         PendingRowChecks* checks);
  struct DecodeTask {
    Sequence* sequence = nullptr;
    const SequenceEnv* env = nullptr;
    const DecodeItem* item = nullptr;
    uint64_t reservation_id = 0;  // the id an inline token's internal reservation takes
    DecodePlan plan;              // CheckDecode's
    DecodeResult result;          // out
  };
  static absl::Status DecodeAll(absl::Span<DecodeTask> tasks);
  // One item: CheckDecode, then DecodeAll of it alone.
  absl::StatusOr<DecodeResult> Decode(const SequenceEnv& env, const DecodeItem& item,
                                      uint64_t reservation_id);

 private:
  // Reserve's steps. The positions of a reservation of `num_tokens` in `targets` (given ones
  // checked against each target layer's own positions, or the sequence's next ones).
  absl::StatusOr<std::vector<int32_t>> ReservePositions(int32_t num_tokens,
                                                        absl::Span<const int32_t> positions,
                                                        absl::Span<const int32_t> targets) const;
  // New blocks the reservation takes once every target layer holds keep[layer] tokens;
  // RESOURCE_EXHAUSTED when the arena cannot give them (counting what eviction frees).
  absl::StatusOr<int64_t> ReserveBlocksNeeded(const SequenceEnv& env,
                                              absl::Span<const int32_t> targets,
                                              absl::Span<const int32_t> keep,
                                              int32_t num_tokens) const;
  // Takes `needed` blocks and appends them to the target layers' tables; fills
  // reservation.layers.
  absl::Status PlaceReservation(const SequenceEnv& env, absl::Span<const int32_t> targets,
                                int32_t num_tokens, int64_t needed, Reservation& reservation);
  // Validates `input` against per-layer `counts` (as they will be when it is observed) and the
  // sequence's next position then; INVALID_ARGUMENT naming the attention.* field.
  // Staged queries (AttentionInput::staging_offset) are checked for their place in the
  // session's staging area (`env`; null = none) here, and for their values when read.
  absl::StatusOr<StepAttention> ValidateAttention(const AttentionInput& input,
                                                  absl::Span<const int32_t> counts,
                                                  int64_t next_position, bool decode,
                                                  const SequenceEnv* env = nullptr) const;
  // A host step's staged queries: read from the arena and checked finite (INVALID_ARGUMENT
  // naming the first that is not). Nothing for inline ones.
  absl::Status LoadStagedQueries(const SequenceEnv& env, StepAttention& step) const;
  // The same for every host step of a DecodeStep: one backend call and one wait for all their
  // reads (a read each was a wait each); errors name the item.
  static absl::Status LoadStagedQueries(absl::Span<DecodeTask> tasks);
  // LoadStagedQueries' check of the queries read into step.staged (cleared when they fail).
  absl::Status CheckLoadedQueries(StepAttention& step) const;
  // The tokens each layer keeps under `budget` (counts unchanged when it has none). A windowed
  // layer keeps its window; the allocator splits the budget over the global layers alone.
  absl::StatusOr<std::vector<int32_t>> KeepFor(const Policy& policy, Phase phase,
                                               const StepBudget& budget,
                                               absl::Span<const int32_t> counts,
                                               absl::Span<LayerPolicyState> states,
                                               int32_t* floor_applied) const;
  // The attention check of a step that may evict, made before anything changes: on copies of
  // the states (extended to `counts`), the layers that would evict must all be listed in
  // `attention` when the policy needs attention.
  absl::Status CheckAttentionCoverage(const Policy& policy, Phase phase, const StepBudget& budget,
                                      absl::Span<const int32_t> counts,
                                      const StepAttention* attention) const;
  // The window of layer `l` (0 = none).
  int32_t Window(size_t l) const { return windows_.empty() ? 0 : windows_[l]; }
  // Caps every windowed layer's keep at its window (and lifts any lower keep to it): the policy
  // does not choose in those layers.
  void ApplyWindows(absl::Span<const int32_t> counts, std::vector<int32_t>& keep) const;
  // Fills `kept` ([H][keep] slots) with the slots of the `keep` highest positions of each head.
  void KeepNewest(int32_t l, int32_t keep, absl::Span<int32_t> kept) const;
  // The same check on a computed keep (windowed layers need no attention).
  absl::Status CoverageError(const Policy& policy, Phase phase,
                                    absl::Span<const int32_t> keep,
                                    absl::Span<const int32_t> counts,
                                    absl::Span<const LayerPolicyState> states,
                                    const StepAttention* attention) const;
  // Observes `attention` on `states` (one per layer of the model).
  absl::Status Observe(const SequenceEnv& env, const Policy& policy, Phase phase,
                       const StepAttention& attention, absl::Span<LayerPolicyState> states) const;
  // Observe -> allocate -> Select -> Merge -> compact on the real state. `budget` without
  // tokens only observes.
  absl::StatusOr<Eviction> RunStep(const SequenceEnv& env, const Policy& policy, Phase phase,
                                   const StepAttention* attention, const StepBudget& budget,
                                   int32_t* floor_applied);
  // Evicts every layer l with keep[l] < count down to keep[l] with `policy` (Select, Merge),
  // then compacts rows and policy state and frees the blocks past the new ends. `keep` has one
  // entry per layer.
  absl::StatusOr<Eviction> Evict(const SequenceEnv& env, const Policy& policy, Phase phase,
                                 absl::Span<const int32_t> keep);

  // The step over several sequences at once (cache/sequence_step.cc): each phase is one backend
  // call for every item's layers, and the layers of items whose policies have equal
  // configurations go to one policy call. A failed phase fails every item (each caller rolls its
  // sequence back from its checkpoint); the items are distinct sequences.
  //
  // One sequence's observation: `attention` on `states` (one per layer of the model).
  struct ObserveItem {
    const Sequence* sequence = nullptr;
    const SequenceEnv* env = nullptr;
    const Policy* policy = nullptr;
    Phase phase = Phase::kPrefill;
    const StepAttention* attention = nullptr;  // null: nothing to observe
    absl::Span<LayerPolicyState> states;
  };
  // One (item, listed layer) of an observation and the rows its policy reads.
  struct ObserveEntry {
    size_t item = 0;
    size_t listed = 0;  // index into the item's attention.layers
    int32_t rows = 0;
    bool summed = false;
    uint64_t bytes = 0;  // of its probabilities
  };
  static absl::Status ObserveAll(absl::Span<const ObserveItem> items);
  // One chunk of entries: their probabilities in one backend call, then the policies' Observe.
  static absl::Status ObserveEntries(absl::Span<const ObserveItem> items,
                                     absl::Span<const ObserveEntry> entries);
  // One sequence's whole step (RunStep's arguments and results).
  struct StepItem {
    Sequence* sequence = nullptr;
    const SequenceEnv* env = nullptr;
    const Policy* policy = nullptr;
    Phase phase = Phase::kPrefill;
    const StepAttention* attention = nullptr;
    StepBudget budget;
    int32_t floor_applied = 0;  // out
    Eviction eviction;          // out
  };
  static absl::Status RunSteps(absl::Span<StepItem> items);
  // The kept slots of every victim layer ([H][keep] each): newest positions in windowed layers,
  // the policy's Select in the others (no mutation).
  struct EvictChoice {
    std::vector<std::vector<int32_t>> flat_positions;  // per victim, [H * count]
    std::vector<std::vector<int32_t>> kept;            // per victim, [H][keep] slots
    std::vector<std::vector<float>> scores;            // retain_evicted only, [H][count]
    std::vector<LayerSelection> selections;            // the policy's layers, into the above
  };
  // One sequence's eviction (Evict's arguments, its working data and its result).
  struct EvictItem {
    Sequence* sequence = nullptr;
    const SequenceEnv* env = nullptr;
    const Policy* policy = nullptr;
    Phase phase = Phase::kPrefill;
    std::vector<int32_t> keep;     // per layer
    Eviction eviction;             // out
    std::vector<int32_t> victims;  // layers that lose tokens
    EvictChoice choice;
    std::vector<CompactionPlan> plans;  // per victim
  };
  static absl::Status EvictAll(absl::Span<EvictItem> items);
  // EvictAll's steps: 1. the choices (one Select per policy group);
  static absl::Status ChooseAll(absl::Span<EvictItem> items);
  void PrepareChoice(const SequenceEnv& env, absl::Span<const int32_t> victims,
                     absl::Span<const int32_t> keep, EvictChoice& choice);
  // 2. the compaction plans and the lowest position each head evicts (no mutation);
  static absl::Status PlanAll(absl::Span<EvictItem> items);
  // 3. the merges (D2O) while every row is in place;
  static absl::Status MergeAll(absl::Span<EvictItem> items);
  // 4. every item's rows moved in one call, then each sequence's new tables, positions and
  // policy state published and the blocks past the new ends freed.
  static absl::Status ApplyAll(absl::Span<EvictItem> items);
  absl::Status PublishCompaction(const SequenceEnv& env, EvictItem& item);
  // The lowest position each head of `state` evicts when it keeps the slots `kept` ([H][keep]);
  // -1 for a head that evicts nothing.
  void LowestEvicted(const LayerState& state, int32_t keep, absl::Span<const int32_t> kept,
                     std::vector<int32_t>& lowest) const;
  // Score's Select on scratch states, layer by layer as a step runs it.
  absl::Status SelectDryRun(const SequenceEnv& env, const Policy& policy,
                            absl::Span<const LayerSelection> selections) const;
  // Clears the transient step scores of every layer.
  void ClearStepScores();
  // The keys of layer `l` as a backend view.
  PagedLayerView KeysView(const SequenceEnv& env, int32_t l) const;
  std::vector<int32_t> FlatPositions(int32_t l) const;
  // Per-layer counts once the pending reservation (if any) is committed.
  std::vector<int32_t> CountsAfterPending() const;
  // Publishes the pending reservation (no eviction).
  void CommitPending(const SequenceEnv& env);
  // INVALID_ARGUMENT naming the layer, K or V, head, token and dim of the first non-finite value
  // in the pending reservation's rows (read through the backend); changes nothing the sequence
  // holds (AddPendingRowChecks).
  absl::Status CheckPendingFinite(const SequenceEnv& env);
  // What a failed call must restore: the sequence's metadata before the call. The arena rows
  // need no copy as long as rows_moved_ stays false (nothing but new, unpublished rows written).
  struct Checkpoint {
    std::vector<LayerState> layers;
    std::vector<LayerPolicyState> states;
    std::vector<int32_t> allocated;
    std::optional<Pending> pending;
    int64_t next_position = 0;
    uint64_t version = 0;
    uint64_t last_committed = 0;
    uint64_t last_cancelled = 0;
    Totals totals;
  };
  Checkpoint TakeCheckpoint();  // also clears rows_moved_
  // Puts `checkpoint` back when no row has moved since it was taken (else leaves the sequence
  // as it is: the caller reports the failure) and frees the blocks taken since.
  void RollbackIfUnmoved(const SequenceEnv& env, Checkpoint checkpoint);
  absl::StatusOr<CommitResult> CommitChecked(const SequenceEnv& env, const StepAttention* step,
                                             const StepBudget& budget, bool evict);
  absl::StatusOr<CompressResult> CompressChecked(const SequenceEnv& env, const Policy& policy,
                                                 const StepAttention* step,
                                                 const StepBudget& budget, bool return_positions);
  // DecodeAll's parts: the new tokens of every task, then the policy step; no rollback.
  static absl::Status DecodeChecked(absl::Span<DecodeTask> tasks);
  static absl::Status CommitNewTokens(absl::Span<DecodeTask> tasks);
  // An inline token's checks (size, finite values, position, blocks): the counts after it.
  absl::StatusOr<std::vector<int32_t>> CheckInlineDecode(const SequenceEnv& env,
                                                         const DecodeItem& item) const;
  // The rows of an inline token: arena offset and offset in the request of each of its
  // [layer][2][H] rows.
  struct InlineRows {
    std::vector<uint64_t> arena_offsets;
    std::vector<uint64_t> host_offsets;
  };
  // Takes the token's slots (after a strict budget's flush) as a pending reservation of one token
  // in every layer, and the rows to write into them.
  absl::Status StageInlineToken(const SequenceEnv& env, const DecodeItem& item,
                                uint64_t reservation_id, InlineRows& rows);
  // ---- The device path of a decode step (cache/sequence_device.cc) ----
  // The device copies of the slot tables the device step reads and updates in place: per layer
  // its positions [H][stride] and, for a policy scoring by accumulated attention, that attention
  // [Hq][stride], in one buffer (layer l at l * layer_bytes). Host positions are kept equal by
  // every step; host accumulated attention is brought back on demand (SyncHostTables).
  struct DeviceTables {
    std::unique_ptr<DeviceBuffer> buffer;
    int32_t stride = 0;
    bool accumulated = false;
    uint64_t layer_bytes = 0;
    uint64_t accumulated_offset = 0;  // within a layer's bytes
    // The device's accumulated attention is newer than states_' (a device step changed it).
    bool host_stale = false;
    int32_t* positions(int32_t l) const {
      return reinterpret_cast<int32_t*>(buffer->data() + l * layer_bytes);
    }
    float* accumulated_of(int32_t l) const {
      return reinterpret_cast<float*>(buffer->data() + l * layer_bytes + accumulated_offset);
    }
  };
  // One task's device step, planned on the host before anything changes.
  struct DeviceStep {
    std::vector<int32_t> keep;            // per layer, after the token joins
    std::vector<DeviceDecodeRule> rules;  // per layer
    bool accumulated = false;             // a layer scores by accumulated attention
    int32_t new_position = 0;
    std::vector<int32_t> taken_blocks;  // layers given a block for an inline token
    InlineRows rows;                    // an inline token's rows
  };
  // The jobs of one call's device step and what they read and write.
  struct DeviceCall {
    std::vector<DecodeEvictJob> jobs;  // per (task, layer)
    std::vector<AttentionJob> attention;
    std::vector<KeyDiffScoreJob> keydiff;
    std::unique_ptr<DeviceBuffer> scratch;  // the probabilities and KeyDiff scores
    std::vector<int32_t> evicted;           // per job [H]
    std::vector<size_t> evicted_begin;      // per task: its first entry of `evicted`
  };
  // The step of every task on the device; false (nothing changed) when a task cannot take it or
  // the device found its input wrong, so that the host path runs (and reports it).
  static absl::StatusOr<bool> DecodeOnDevice(absl::Span<DecodeTask> tasks);
  bool PlanDeviceStep(const SequenceEnv& env, const DecodeTask& task, DeviceStep& step);
  static absl::StatusOr<bool> ChooseOnDevice(absl::Span<DecodeTask> tasks,
                                             absl::Span<DeviceStep> steps, DeviceCall& call);
  static absl::Status BuildDeviceJobs(absl::Span<DecodeTask> tasks, absl::Span<DeviceStep> steps,
                                      DeviceCall& call);
  bool NeedsDeviceProbs(const DecodeTask& task, const DeviceDecodeRule& rule, int32_t l) const;
  // Listed layer `listed`'s queries [Hq][1][D] where the device reads them: inline ones (on the
  // host, staged with the call), or staged ones in the arena.
  const float* DeviceQueries(const DecodeTask& task, const StepAttention& attention,
                             size_t listed) const;
  void AddDeviceJobs(const DecodeTask& task, const DeviceStep& step, DeviceCall& call,
                     uint64_t& scratch_at, size_t& evicted_at) const;
  // An inline token's slots: a block where a layer's last one is full; its rows.
  absl::Status TakeTokenSlots(const SequenceEnv& env, DeviceStep& step);
  void UndoDeviceStep(const SequenceEnv& env, DeviceStep& step);
  // The host tables after the device's step: the token joined, each evicted slot refilled from
  // the last one, the emptied tail blocks freed.
  void PublishDeviceStep(const SequenceEnv& env, DecodeTask& task, const DeviceStep& step,
                         absl::Span<const int32_t> evicted);
  // The device tables, made (and filled from the host's) unless they hold the step's slots.
  absl::Status EnsureDeviceTables(const SequenceEnv& env, bool accumulated);
  // The host's accumulated attention brought up to date with the device's (logically const).
  absl::Status SyncHostTables(const SequenceEnv& env) const;
  // Before the host changes the tables: brought up to date, then the device copies dropped.
  absl::Status LeaveDevice(const SequenceEnv& env);

  // The sequence's budget: its token budget, else (none given) the policy's budget_fraction of
  // the prompt, FloorFraction(fraction, P) tokens per layer (at least 1) with P the longest
  // layer's count, fixed at the first allocation that freezes the layers' budgets (D2O).
  StepBudget SequenceBudget() const;
  int32_t FractionBudget(float fraction) const;
  // LayerLayoutView::budget of layer `l`: its explicit budget, its frozen allocation, its last
  // non-uniform allocation, or the sequence budget.
  int32_t LayerBudget(int32_t l) const;
  // Per-layer counts after the evict-then-append flush a strict budget makes before an inline
  // decode token (policies that need no attention, like Reserve); counts() otherwise.
  absl::StatusOr<std::vector<int32_t>> StrictFlushKeep() const;

  const std::string id_;
  const ModelLayout layout_;
  const std::unique_ptr<Policy> policy_;
  BudgetConfig budget_;  // changed only by set_budget (Admin re-budget), under the session lock
  Totals totals_;
  const absl::Time created_;
  absl::Time last_used_;

  std::vector<LayerState> layers_;
  // The policy's per-layer state, one per layer (contiguous: allocators take a span of them),
  // slot-aligned with layers_[l] (Extend on commit, Compact on compaction).
  std::vector<LayerPolicyState> states_;
  // Per layer: the last allocation when it differed from the uniform one (0 = none), for
  // LayerLayoutView::budget ("tokens this layer may keep, after allocation").
  std::vector<int32_t> allocated_;
  std::optional<Pending> pending_;
  int64_t next_position_ = 0;
  uint64_t version_ = 1;
  uint64_t last_committed_ = 0;  // to tell a double commit from an unknown id
  uint64_t last_cancelled_ = 0;
  // What this kind of sequence adds (OmniKV's Select state); set at creation, never null.
  std::unique_ptr<SequenceKind> kind_;
  bool retain_evicted_ = false;
  std::vector<int32_t> windows_;  // per layer, or empty (no windows)
  // The device path's copies of the slot tables (null until a device step made them, dropped when
  // the host changes the tables; cache/sequence_device.cc).
  std::unique_ptr<DeviceTables> device_;
  // Set when an eviction starts changing what cannot be restored from a Checkpoint (arena rows,
  // retained chunks); cleared by TakeCheckpoint.
  bool rows_moved_ = false;
  // retain_evicted chunks (meta: [n] x {layer, head, position, score}; layers[0]: [n] x {K, V}
  // rows), each pinned in the host tier under retained_keys_[i].
  std::vector<std::shared_ptr<const SpilledSequence>> retained_;
  std::vector<SpillKey> retained_keys_;
  // Copies the evicted rows of `victims` (kept[i]: [H][keep] slots; scores[i]: [H][count]) into
  // a new pinned chunk.
  absl::Status RetainEvicted(const SequenceEnv& env, absl::Span<const int32_t> victims,
                             absl::Span<const int32_t> keep,
                             absl::Span<const std::vector<int32_t>> kept,
                             absl::Span<const std::vector<float>> scores);
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SEQUENCE_H_
