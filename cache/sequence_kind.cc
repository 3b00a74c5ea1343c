// The sequence kinds (cache/sequence_kind.h): the evicting kind, the choice of a kind from the
// policy's capabilities, the Sequence calls that answer through the kind, and RunSelects.
#include "cache/sequence_kind.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/omnikv.h"
#include "cache/policy/registry.h"
#include "cache/sequence.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {

// Every policy that evicts: the sequence's own state is all there is; Select does not apply.
class EvictingKind final : public SequenceKind {
 public:
  explicit EvictingKind(std::string policy) : policy_(std::move(policy)) {}

  bool evicts() const override { return true; }
  bool spillable() const override { return true; }
  int32_t extra_blocks() const override { return 0; }
  void AppendPinnedKeys(std::vector<SpillKey>&) const override {}
  uint64_t host_bytes() const override { return 0; }
  void Release(std::vector<int32_t>&) override {}

  absl::Status CheckSelect(const Sequence& sequence, const SelectItem&) const override {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence.id(), " uses policy ", policy_,
                     "; Select needs a sequence created with policy omnikv"));
  }
  // Never reached: CheckSelect refuses every item first.
  absl::Status Begin(Sequence& sequence, SelectTask& task) override {
    return CheckSelect(sequence, *task.item);
  }
  absl::Status Choose(const Sequence& sequence, SelectTask& task) override {
    return CheckSelect(sequence, *task.item);
  }
  int32_t BlocksToStage(const Sequence&, const SelectTask&) const override { return 0; }
  void Stage(SelectTask&, absl::Span<const int32_t>) override {}
  absl::Status Gather(const Sequence& sequence, SelectTask& task) override {
    return CheckSelect(sequence, *task.item);
  }

 private:
  std::string policy_;
};

absl::Status ItemError(size_t i, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("items[", i, "]: ", status.message()));
}

// Returns the blocks Begin released to the allocator. They were the sequence's; Free cannot fail
// unless bookkeeping is broken, and then keeping the ids would only leak them for good.
void FreeReleased(SelectTask& task) {
  (void)task.env->allocator.Free(task.released);
  task.released.clear();
}

// Takes the blocks the task's gathers need from its session's allocator, right after returning
// those Begin released; RESOURCE_EXHAUSTED (nothing taken) when the arena lacks them.
absl::Status StageTask(SelectTask& task) {
  FreeReleased(task);
  SequenceKind& kind = task.sequence->kind();
  const int32_t needed = kind.BlocksToStage(*task.sequence, task);
  std::vector<int32_t> fresh;
  if (needed > 0) {
    if (absl::Status allocated = task.env->allocator.Allocate(needed, &fresh); !allocated.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", task.sequence->id(), ": staging the selected tokens needs ", needed,
          " more blocks than the session's arena has free (", allocated.message(), ")"));
    }
  }
  kind.Stage(task, fresh);
  return absl::OkStatus();
}

// Runs `step` for tasks [0, limit) side by side; returns the lowest failing task, or `limit`.
template <typename Step>
size_t SideBySide(absl::Span<SelectTask> tasks, size_t limit, ThreadPool& pool,
                  std::vector<absl::Status>& statuses, Step step) {
  pool.ParallelFor(static_cast<int64_t>(limit),
                   [&](int64_t i) { statuses[i] = step(tasks[i]); });
  for (size_t i = 0; i < limit; ++i) {
    if (!statuses[i].ok()) return i;
  }
  return limit;
}

}  // namespace

SelectTask::SelectTask() = default;
SelectTask::~SelectTask() = default;
SelectTask::SelectTask(SelectTask&&) noexcept = default;
SelectTask& SelectTask::operator=(SelectTask&&) noexcept = default;

std::unique_ptr<SequenceKind> MakeSequenceKind(const PolicyConfig& config) {
  if (CapabilitiesOf(config).never_evicts) return std::make_unique<OmniKvKind>(config.omnikv);
  return std::make_unique<EvictingKind>(config.name);
}

absl::StatusOr<SequenceAdmission> SequenceAdmission::Resolve(PolicyConfig& policy,
                                                             const SequenceParams& params,
                                                             int32_t num_layers, bool has_tiers) {
  if (!CapabilitiesOf(policy).never_evicts) return SequenceAdmission(true);
  KVS_RETURN_IF_ERROR(ResolveOmniKvSequence(policy, params, num_layers, has_tiers));
  return SequenceAdmission(false);
}

BudgetConfig SequenceAdmission::Budget(const BudgetConfig& requested) const {
  return evicts_ ? requested : BudgetConfig{};
}

absl::StatusOr<std::vector<SelectResult>> RunSelects(absl::Span<SelectTask> tasks,
                                                     ThreadPool& pool) {
  std::vector<absl::Status> statuses(tasks.size());
  // Begin frees blocks and pins host entries: in task order, so that what each sequence gets
  // does not depend on the schedule.
  size_t limit = tasks.size();
  for (size_t i = 0; i < limit; ++i) {
    statuses[i] = tasks[i].sequence->kind().Begin(*tasks[i].sequence, tasks[i]);
    if (!statuses[i].ok()) limit = i;
  }
  limit = SideBySide(tasks, limit, pool, statuses, [](SelectTask& task) {
    return task.sequence->kind().Choose(*task.sequence, task);
  });
  // Staging blocks in task order, for the same reason; the tasks that stopped before return
  // what their Begin released.
  for (size_t i = 0; i < limit; ++i) {
    statuses[i] = StageTask(tasks[i]);
    if (!statuses[i].ok()) limit = i;
  }
  for (size_t i = limit; i < tasks.size(); ++i) FreeReleased(tasks[i]);
  limit = SideBySide(tasks, limit, pool, statuses, [](SelectTask& task) {
    return task.sequence->kind().Gather(*task.sequence, task);
  });
  if (limit < tasks.size()) return ItemError(limit, statuses[limit]);
  std::vector<SelectResult> results;
  results.reserve(tasks.size());
  for (SelectTask& task : tasks) results.push_back(std::move(task.result));
  return results;
}

Sequence::~Sequence() = default;

bool Sequence::never_evicts() const { return !kind_->evicts(); }

bool Sequence::spillable() const { return kind_->spillable() && !retain_evicted_; }

std::vector<SpillKey> Sequence::pinned_host_keys() const {
  std::vector<SpillKey> keys = retained_keys_;
  kind_->AppendPinnedKeys(keys);
  return keys;
}

uint64_t Sequence::host_bytes() const {
  uint64_t bytes = kind_->host_bytes();
  for (const auto& chunk : retained_) bytes += chunk->bytes();
  return bytes;
}

absl::Status Sequence::CheckSelect(const SequenceEnv& env, const SelectItem& item) const {
  (void)env;
  return kind_->CheckSelect(*this, item);
}

}  // namespace kvs
