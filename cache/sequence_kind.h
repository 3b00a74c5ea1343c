// SequenceKind: what differs between the kinds of sequence the pool holds. A sequence keeps the
// parts every kind shares (block tables, counts, positions, reservations, the policy's per-layer
// state); its kind, chosen once when the sequence is created from the policy's capabilities
// (cache/policy/registry.h), owns the rest:
//   - EvictingKind: every evicting policy. A budget bounds the layers; Select does not apply.
//   - OmniKvKind (cache/omnikv.h): a policy that never evicts and selects per decode step
//     instead. It owns the state of its Select: N, k, the layer plan, the sparse layers' prompt
//     offloaded to the host tier, the staging blocks and each filter layer's last selection.
// The generic code asks the kind instead of testing which policy a sequence uses.
//
// Select runs in steps (Begin, Choose, Stage, Gather) so that KvPool::Select can run the
// sequences of one call side by side: Choose and Gather touch only their own sequence and may run
// in parallel; Begin and Stage take or free blocks and run in item order, so that the blocks each
// sequence gets do not depend on the schedule (RunSelects).
//
// Threading: a kind is part of its sequence; the owning session's lock serialises every call.
#ifndef KVSIDECAR_CACHE_SEQUENCE_KIND_H_
#define KVSIDECAR_CACHE_SEQUENCE_KIND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/pool.h"
#include "cache/tier.h"

namespace kvs {

class Sequence;
class ThreadPool;  // gpu/cpu/thread_pool.h
struct SequenceEnv;
struct SelectScratch;  // a kind's working data between the steps of one Select

// Stores (data non-null) or drops (null) a sequence's pinned host-tier entry; the sequence gives
// the key's sequence_id, the caller completes the key with tenant and session.
using HostPin =
    std::function<absl::Status(const SpillKey& key, std::shared_ptr<const SpilledSequence> data)>;

// One item of a Select call: what it runs on, its result and the steps' working data.
struct SelectTask {
  SelectTask();
  ~SelectTask();
  SelectTask(SelectTask&&) noexcept;
  SelectTask& operator=(SelectTask&&) noexcept;

  Sequence* sequence = nullptr;
  const SequenceEnv* env = nullptr;
  const SelectItem* item = nullptr;
  const HostPin* pin = nullptr;
  SelectResult result;
  std::unique_ptr<SelectScratch> scratch;
  // Blocks Begin took out of the sequence's layers. They go back to the allocator right before
  // the task's staging blocks are taken, so that the blocks a sequence gets are those it would
  // get from a call of its own.
  std::vector<int32_t> released;
};

class SequenceKind {
 public:
  virtual ~SequenceKind() = default;

  // False for a kind that never evicts: it has no budget, and Compress and Score do not apply.
  virtual bool evicts() const = 0;
  // False while the kind holds state a snapshot does not carry (OmniKV after its first Select).
  virtual bool spillable() const = 0;
  // Arena blocks the kind holds beyond the layers' block tables.
  virtual int32_t extra_blocks() const = 0;
  // Pinned host-tier entries the kind holds (key and bytes).
  virtual void AppendPinnedKeys(std::vector<SpillKey>& keys) const = 0;
  virtual uint64_t host_bytes() const = 0;
  // Appends every block the kind holds to `to_free` and forgets its state (Sequence::Release).
  virtual void Release(std::vector<int32_t>& to_free) = 0;

  // Select (KvPool::Select), validation first: changes nothing.
  virtual absl::Status CheckSelect(const Sequence& sequence, const SelectItem& item) const = 0;
  // The steps of one Select on a checked item. Begin: the first Select's set-up (may take host
  // space; blocks it no longer needs go to task.released). Choose: the tokens of each listed filter layer (no block changes).
  // BlocksToStage / Stage: the staging blocks the gathers need, taken from `fresh` in order.
  // Gather: the copies into staging and the views of the result.
  virtual absl::Status Begin(Sequence& sequence, SelectTask& task) = 0;
  virtual absl::Status Choose(const Sequence& sequence, SelectTask& task) = 0;
  virtual int32_t BlocksToStage(const Sequence& sequence, const SelectTask& task) const = 0;
  virtual void Stage(SelectTask& task, absl::Span<const int32_t> fresh) = 0;
  virtual absl::Status Gather(const Sequence& sequence, SelectTask& task) = 0;
};

// The kind of a sequence whose policy is `config`: OmniKV when the registry says the policy never
// evicts, evicting otherwise.
std::unique_ptr<SequenceKind> MakeSequenceKind(const PolicyConfig& config);

// A new sequence's parameters as its kind takes them, settled before the sequence exists
// (KvPool::CreateSequence), so that the generic path asks the kind rather than testing for a
// policy. The kind is chosen as MakeSequenceKind chooses it. A kind that never evicts (OmniKV)
// completes its configuration and refuses what applies only to eviction (retain_evicted, a
// budget) or cannot serve its plan (a sliding-window filter layer); an evicting kind takes the
// parameters as given.
class SequenceAdmission {
 public:
  // Before the policy is made from `policy`, which it may complete. `has_tiers`: the pool has
  // the host tier. The error names the field.
  static absl::StatusOr<SequenceAdmission> Resolve(PolicyConfig& policy,
                                                   const SequenceParams& params,
                                                   int32_t num_layers, bool has_tiers);

  bool evicts() const { return evicts_; }
  // The budget the sequence runs with: `requested` for a kind that evicts, none otherwise.
  BudgetConfig Budget(const BudgetConfig& requested) const;

 private:
  explicit SequenceAdmission(bool evicts) : evicts_(evicts) {}
  bool evicts_ = true;
};

// Runs the Selects of `tasks` (checked, distinct sequences, their sessions locked): Begin and the
// staging allocation in task order, Choose and Gather side by side on `pool`. The results, block
// tables included, are those of running the tasks one after another. A failing task fails the call with the lowest
// such task's error, prefixed "items[i]: "; Choose and Gather of every task before the lowest
// failing step have run (a retry with the same step_id reuses the selections).
absl::StatusOr<std::vector<SelectResult>> RunSelects(absl::Span<SelectTask> tasks,
                                                     ThreadPool& pool);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SEQUENCE_KIND_H_
