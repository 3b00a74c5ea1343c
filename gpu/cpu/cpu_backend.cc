// CpuBackend: the reference Backend (gpu/backend.h). Every call runs to completion on the calling
// thread plus a shared worker pool; streams are ignored.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/backend.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/attention_cpu.h"
#include "gpu/cpu/caote_cpu.h"
#include "gpu/cpu/copy_cpu.h"
#include "gpu/cpu/decode_evict_cpu.h"
#include "gpu/cpu/keydiff_cpu.h"
#include "gpu/cpu/merge_cpu.h"
#include "gpu/cpu/pool_cpu.h"
#include "gpu/cpu/shm_arena.h"
#include "gpu/cpu/thread_pool.h"
#include "gpu/cpu/topk_cpu.h"
#include "gpu/cpu/window_stats_cpu.h"

namespace kvs {
namespace {

// Below this many key bytes in a whole KeyDiffScores call the work runs on the calling thread.
constexpr uint64_t kParallelKeyDiffMinBytes = 256 << 10;
// Below this many candidate slots in a whole TopK call the pool hand-off costs more than it saves.
constexpr int64_t kParallelTopKMinSlots = 1 << 15;
// Below this many bytes in a whole CopyRows call the rows are copied on the calling thread.
constexpr uint64_t kParallelCopyMinBytes = 256 << 10;

// Rows of one job, in order. A plain memmove per row: measured on this path (256-byte rows
// scattered over a 1 GiB arena) it beat inlined fixed-size SSE/AVX copies, with or without
// software prefetch or streaming stores; the copy is bound by memory latency, not by the call.
void CopyJobRows(const RowCopyJob& job) {
  if (job.count <= 0 || job.row_bytes == 0) return;  // offsets may be null then
  for (int64_t r = 0; r < job.count; ++r) {
    std::memmove(job.arena + job.dst_offsets[r], job.arena + job.src_offsets[r], job.row_bytes);
  }
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : pool_(num_threads), isa_(CpuSupportsAvx2() ? KeyDiffIsa::kAvx2 : KeyDiffIsa::kScalar) {}

  std::string_view name() const override { return "cpu"; }
  bool healthy() const override { return true; }

  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    return CreateShmArena(bytes, options);
  }

  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream) override {
    // Validate everything first so that a failed call writes no scores.
    std::vector<int64_t> first_task(jobs.size() + 1, 0);
    uint64_t key_bytes = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (auto status = ValidateKeyDiffJob(jobs[i], i); !status.ok()) return status;
      const PagedLayerView& keys = jobs[i].keys;
      const int64_t heads = keys.count > 0 ? keys.num_kv_heads : 0;
      first_task[i + 1] = first_task[i] + heads;
      key_bytes +=
          static_cast<uint64_t>(heads) * keys.count * keys.head_dim * DTypeBytes(keys.dtype);
    }
    // One task per (job, head): independent, similar in size, enough of them to balance. Small
    // calls (decode steps of short sequences) run inline: waking a worker costs more than that.
    pool_.ParallelFor(
        first_task.back(),
        [&](int64_t task) {
          const size_t job =
              std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
          KeyDiffScoreHead(jobs[job], static_cast<int>(task - first_task[job]), isa_);
        },
        key_bytes < kParallelKeyDiffMinBytes ? 1 : 0);
    return absl::OkStatus();
  }

  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream) override {
    std::vector<int64_t> first_row(jobs.size() + 1, 0);
    int64_t slots = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (auto status = ValidateTopKJob(jobs[i], i); !status.ok()) return status;
      first_row[i + 1] = first_row[i] + jobs[i].rows;
      slots += static_cast<int64_t>(jobs[i].rows) * jobs[i].n;
    }
    const int64_t rows = first_row.back();
    if (slots < kParallelTopKMinSlots) {
      TopKScratch scratch;
      for (const TopKJob& job : jobs) {
        for (int32_t row = 0; row < job.rows; ++row) TopKRow(job, row, scratch);
      }
      return absl::OkStatus();
    }
    pool_.ParallelFor(rows, [&](int64_t task) {
      thread_local TopKScratch scratch;
      const size_t job =
          std::upper_bound(first_row.begin(), first_row.end(), task) - first_row.begin() - 1;
      TopKRow(jobs[job], static_cast<int32_t>(task - first_row[job]), scratch);
    });
    return absl::OkStatus();
  }

  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream) override {
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (auto status = ValidateRowCopyJob(jobs[i], i); !status.ok()) return status;
    }
    // Jobs are independent (gpu/backend.h), so they spread over the pool; rows of one job are
    // copied in order by one thread, which keeps the documented chain semantics (a destination
    // may be an earlier row's source). Small calls (a decode step's eviction) run inline.
    uint64_t bytes = 0;
    for (const RowCopyJob& job : jobs) bytes += static_cast<uint64_t>(job.count) * job.row_bytes;
    if (bytes == 0) return absl::OkStatus();
    pool_.ParallelFor(
        static_cast<int64_t>(jobs.size()), [&](int64_t i) { CopyJobRows(jobs[i]); },
        bytes < kParallelCopyMinBytes ? 1 : 0);
    return absl::OkStatus();
  }

  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream) override {
    return RunAttentionProbs(jobs, pool_);
  }
  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, Stream) override {
    return RunAttentionColumnSums(jobs, pool_);
  }
  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream) override {
    return RunPoolScores(jobs, &pool_);
  }
  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, Stream) override {
    return RunWindowVarianceScores(jobs, &pool_);
  }
  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream) override {
    return RunWindowEntropyShift(jobs, &pool_);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream) override {
    return RunAttentionLogits(jobs, pool_);
  }

  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream) override {
    uint64_t bytes = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const HostRowCopyJob& job = jobs[i];
      if (auto status = ValidateHostRowCopyJob(job, i); !status.ok()) return status;
      bytes += static_cast<uint64_t>(job.count) * job.row_bytes;
    }
    if (bytes == 0) return absl::OkStatus();
    pool_.ParallelFor(
        static_cast<int64_t>(jobs.size()),
        [&](int64_t i) {
          const HostRowCopyJob& job = jobs[i];
          for (int64_t r = 0; r < job.count; ++r) {
            uint8_t* arena_row = job.arena + job.arena_offsets[r];
            uint8_t* host_row = job.host + job.host_offsets[r];
            if (job.to_host) {
              std::memcpy(host_row, arena_row, job.row_bytes);
            } else {
              std::memcpy(arena_row, host_row, job.row_bytes);
            }
          }
        },
        bytes < kParallelCopyMinBytes ? 1 : 0);
    return absl::OkStatus();
  }

  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream) override {
    return RunCaoteScores(jobs, pool_);
  }
  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream) override {
    return RunNearestKeys(jobs, pool_);
  }
  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream) override {
    return RunMergeRows(jobs, pool_);
  }

  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream) override {
    uint64_t bytes = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (auto status = ValidateFiniteCheckJob(jobs[i], i); !status.ok()) return status;
      bytes += static_cast<uint64_t>(jobs[i].count) * jobs[i].row_elements *
               DTypeBytes(jobs[i].dtype);
    }
    // One job per (sequence, layer, K or V) of a commit: runs of consecutive jobs of about
    // equal bytes spread over the pool (a run reads ahead across its jobs); a few rows are
    // checked inline.
    const int parallel = bytes < kParallelCopyMinBytes ? 1 : pool_.num_threads();
    const uint64_t per_run = bytes / (static_cast<uint64_t>(parallel) * 4) + 1;
    std::vector<size_t> run_begin = {0};
    uint64_t in_run = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (in_run >= per_run) {
        run_begin.push_back(i);
        in_run = 0;
      }
      in_run += static_cast<uint64_t>(jobs[i].count) * jobs[i].row_elements *
                DTypeBytes(jobs[i].dtype);
    }
    run_begin.push_back(jobs.size());
    pool_.ParallelFor(
        static_cast<int64_t>(run_begin.size() - 1),
        [&](int64_t r) {
          FindNonFiniteRows(jobs.subspan(run_begin[r], run_begin[r + 1] - run_begin[r]), isa_);
        },
        parallel);
    return absl::OkStatus();
  }

  absl::Status Synchronize(Stream) override { return absl::OkStatus(); }

  absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                           Stream) override {
    for (size_t i = 0; i < jobs.size(); ++i) {
      KVS_RETURN_IF_ERROR(ValidateDecodeEvictJob(jobs[i], i));
    }
    // One task per (sequence, layer): a decode step has thousands of them.
    pool_.ParallelFor(static_cast<int64_t>(jobs.size()),
                      [&](int64_t j) { DecodeEvictCpu(jobs[j], stage); });
    return absl::OkStatus();
  }

 private:
  ThreadPool pool_;
  const KeyDiffIsa isa_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int num_threads) {
  if (num_threads <= 0) {
    num_threads = std::max(1u, std::thread::hardware_concurrency());
  }
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace kvs
