// Sequence: one request's cache inside a session: per layer a block table, a token count (the
// same for every kv head) and the original position of the token in every (head, slot); the
// pending reservation; the policy and budget. Implements the sequence half of KvPool (see
// cache/pool.h for the contract of each call): reserve -> write -> commit, eviction to a budget
// with hole-filling compaction, layouts and export reads.
//
// Inline payloads ([layer][2][H][T][D]) are copied in runs of rows that are contiguous in one
// block, through Arena::Write/Read; eviction goes through the Policy and Backend::CopyRows.
//
// Threading: not thread-safe; the owning session serialises every call under its lock. A failed
// call leaves the sequence as it was (a backend failure in the middle of a compaction excepted,
// which reports INTERNAL).
#ifndef KVSIDECAR_CACHE_SEQUENCE_H_
#define KVSIDECAR_CACHE_SEQUENCE_H_

#include <atomic>
#include <cstdint>
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
#include "cache/policy/policy.h"
#include "cache/pool.h"
#include "gpu/arena.h"
#include "gpu/backend.h"
#include "gpu/base/layout.h"

namespace kvs {

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
};

// `layers` as a request gives them: empty = all of [0, num_layers); else each in range and
// distinct, kept in the order given. INVALID_ARGUMENT naming "layers[i]" otherwise.
absl::StatusOr<std::vector<int32_t>> ResolveLayers(absl::Span<const int32_t> layers,
                                                   int32_t num_layers);

class Sequence {
 public:
  // `policy` must be non-null; `budget` must already be validated against the session.
  Sequence(std::string id, const ModelLayout& layout, std::unique_ptr<Policy> policy,
           BudgetConfig budget, absl::Time created);

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  const std::string& id() const { return id_; }
  const PolicyConfig& policy_config() const { return policy_->config(); }
  const BudgetConfig& budget() const { return budget_; }
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
  absl::StatusOr<CommitResult> Commit(const SequenceEnv& env, uint64_t reservation_id,
                                      bool compress_if_over_budget);
  absl::StatusOr<CompressResult> Compress(const SequenceEnv& env, const CompressParams& params);
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

 private:
  struct LayerState {
    std::vector<int32_t> blocks;  // ceil(count / B) + the pending reservation's
    int32_t count = 0;
    std::vector<std::vector<int32_t>> positions;  // [H][count], slot order; empty until used
    int64_t appended = 0;                         // tokens ever committed to this layer
    LayerPolicyState policy_state;
  };
  struct Pending {
    uint64_t id = 0;
    int32_t num_tokens = 0;
    std::vector<int32_t> layers;  // in the order asked
    std::vector<int32_t> positions;
    uint64_t payload_bytes = 0;
  };
  // Per-layer result of an eviction.
  struct Eviction {
    std::vector<int32_t> evicted;  // per layer of the sequence (0 where untouched)
    int32_t blocks_freed = 0;
  };

  // Evicts every layer l with keep[l] < count down to keep[l] with `policy`, then compacts and
  // frees the blocks past the new ends. `keep` has one entry per layer.
  absl::StatusOr<Eviction> Evict(const SequenceEnv& env, const Policy& policy,
                                 absl::Span<const int32_t> keep);
  // Per-layer token counts each layer keeps under `budget` (> 0) with `policy`.
  std::vector<int32_t> KeepUnder(const Policy& policy, int32_t budget);

  const std::string id_;
  const ModelLayout layout_;
  const std::unique_ptr<Policy> policy_;
  const BudgetConfig budget_;
  const absl::Time created_;
  absl::Time last_used_;

  std::vector<LayerState> layers_;
  std::optional<Pending> pending_;
  int64_t next_position_ = 0;
  uint64_t version_ = 1;
  uint64_t last_committed_ = 0;  // to tell a double commit from an unknown id
  uint64_t last_cancelled_ = 0;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SEQUENCE_H_
