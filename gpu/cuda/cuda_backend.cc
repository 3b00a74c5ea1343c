// CudaBackend (gpu/cuda/cuda_backend.h): validation on the host, kernels in cuda_kernels.cu.
#include "gpu/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/layout.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/attention_cpu.h"  // ValidatePagedLayerView, ValidateAttentionJob
#include "gpu/cpu/caote_cpu.h"      // ValidateCaoteJob
#include "gpu/cpu/copy_cpu.h"       // ValidateRowCopyJob, ValidateHostRowCopyJob
#include "gpu/cpu/keydiff_cpu.h"    // ValidateKeyDiffJob
#include "gpu/cpu/merge_cpu.h"      // ValidateNearestKeyJob, ValidateRowMergeJob
#include "gpu/cpu/pool_cpu.h"       // ValidatePoolJob
#include "gpu/cpu/topk_cpu.h"       // ValidateTopKJob
#include "gpu/cpu/window_stats_cpu.h"  // ValidateWindowVarianceJob, ValidateWindowEntropyJob
#include "gpu/cuda/cuda_kernels.h"
#include "gpu/cuda/cuda_status.h"
#include "gpu/device_counters.h"

namespace kvs {
namespace {

std::string UuidText(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

// ---------------------------------------------------------------------------------------------
// Arena: one cudaMalloc, exported once.

std::atomic<uint64_t> g_next_generation{1};

class CudaArena final : public Arena {
 public:
  static absl::StatusOr<std::unique_ptr<Arena>> Create(int device, uint64_t bytes) {
    if (bytes == 0) return absl::InvalidArgumentError("arena size must be > 0");
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
    void* base = nullptr;
    if (cudaError_t error = cudaMalloc(&base, bytes); error != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky; clear it
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes on device ",
                                                       device, ": ", cudaGetErrorString(error)));
    }
    auto arena = std::unique_ptr<CudaArena>(new CudaArena(device, static_cast<uint8_t*>(base)));
    // Zeroed like a fresh shared-memory file.
    KVS_CUDA_RETURN_IF_ERROR(cudaMemset(base, 0, bytes), "cudaMemset of a new arena");
    // Each host thread has its own default stream (CUDA_API_PER_THREAD_DEFAULT_STREAM, see
    // gpu/CMakeLists.txt): nothing orders another thread's work, or a worker's, after this one
    // but waiting here. Write and Read wait likewise.
    KVS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
    cudaIpcMemHandle_t ipc;
    KVS_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&ipc, base), "cudaIpcGetMemHandle");
    cudaDeviceProp props;
    KVS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device), "cudaGetDeviceProperties");
    ArenaHandle& handle = arena->handle_;
    handle.kind = ArenaHandle::Kind::kCudaIpc;
    handle.cuda_ipc_handle.assign(reinterpret_cast<const char*>(&ipc), sizeof(ipc));
    handle.cuda_device = device;
    handle.cuda_device_uuid = UuidText(props.uuid);
    handle.size_bytes = bytes;
    handle.generation = g_next_generation.fetch_add(1, std::memory_order_relaxed);
    return std::unique_ptr<Arena>(std::move(arena));
  }

  ~CudaArena() override {
    cudaSetDevice(device_);
    cudaFree(base_);  // an error here has nowhere to go; the context may already be gone
    // The scratch the kernels' memory pool kept (MakeCudaBackend) goes back with the arena.
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
    cudaGetLastError();
  }

  uint8_t* data() override { return base_; }
  const uint8_t* data() const override { return base_; }
  uint64_t size_bytes() const override { return handle_.size_bytes; }
  const ArenaHandle& handle() const override { return handle_; }

  absl::Status Write(uint64_t offset, const void* source, uint64_t bytes) override {
    KVS_RETURN_IF_ERROR(CheckRange(offset, bytes, source, "Write"));
    if (bytes == 0) return absl::OkStatus();
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DeviceCounters::ArenaWrite(bytes);
    DeviceCounters::Upload(bytes);
    DeviceCounters::Sync();
    KVS_CUDA_RETURN_IF_ERROR(cudaMemcpy(base_ + offset, source, bytes, cudaMemcpyDefault),
                             "arena Write (cudaMemcpy)");
    return CudaStatus(cudaStreamSynchronize(nullptr), "arena Write (cudaStreamSynchronize)");
  }

  absl::Status Read(uint64_t offset, void* destination, uint64_t bytes) const override {
    KVS_RETURN_IF_ERROR(CheckRange(offset, bytes, destination, "Read"));
    if (bytes == 0) return absl::OkStatus();
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DeviceCounters::ArenaRead(bytes);
    DeviceCounters::Download(bytes);
    DeviceCounters::Sync();
    KVS_CUDA_RETURN_IF_ERROR(cudaMemcpy(destination, base_ + offset, bytes, cudaMemcpyDefault),
                             "arena Read (cudaMemcpy)");
    return CudaStatus(cudaStreamSynchronize(nullptr), "arena Read (cudaStreamSynchronize)");
  }

  absl::Status ReadBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes,
                          void* destination) const override {
    return MoveBlocks(offsets, block_bytes, static_cast<uint8_t*>(destination), true);
  }
  absl::Status WriteBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes,
                           const void* source) override {
    return MoveBlocks(offsets, block_bytes, static_cast<uint8_t*>(const_cast<void*>(source)),
                      false);
  }

 private:
  CudaArena(int device, uint8_t* base) : device_(device), base_(base) {}

  // Block copies between the arena and a contiguous host buffer. A few runs of adjacent blocks
  // go as one transfer each. Many go through stream-ordered device scratch in pieces of up to
  // kPieceBytes: the blocks of a piece gathered into it by one kernel, then one transfer to the
  // host (the reverse for a write), so the bus sees large copies (at its page-locked speed when
  // the host buffer is pinned, as the spill buffers are) instead of one per block.
  absl::Status MoveBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes, uint8_t* host,
                          bool to_host) const {
    KVS_RETURN_IF_ERROR(CheckBlocks(offsets, block_bytes, host));
    if (offsets.empty() || block_bytes == 0) return absl::OkStatus();
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    if (to_host) {
      DeviceCounters::ArenaRead(offsets.size() * block_bytes);
    } else {
      DeviceCounters::ArenaWrite(offsets.size() * block_bytes);
    }
    constexpr size_t kFewRuns = 8;
    constexpr uint64_t kPieceBytes = uint64_t{64} << 20;
    const cudaStream_t stream = nullptr;  // this thread's default stream
    const std::vector<BlockRun> runs = BlockRuns(offsets, block_bytes);
    if (runs.size() <= kFewRuns) return CopyRuns(runs, offsets, block_bytes, host, to_host);
    const uint64_t piece_blocks = std::max<uint64_t>(1, kPieceBytes / block_bytes);
    const uint64_t scratch_bytes = std::min<uint64_t>(piece_blocks, offsets.size()) * block_bytes;
    void* scratch = nullptr;
    void* device_offsets = nullptr;
    if (cudaMallocAsync(&scratch, scratch_bytes, stream) != cudaSuccess) {
      cudaGetLastError();  // not sticky: copy run by run instead
      return CopyRuns(runs, offsets, block_bytes, host, to_host);
    }
    cudaError_t error = cudaMallocAsync(&device_offsets, offsets.size() * sizeof(uint64_t), stream);
    if (error == cudaSuccess) {
      // From pageable memory: the offsets have been taken when the call returns.
      error = cudaMemcpyAsync(device_offsets, offsets.data(), offsets.size() * sizeof(uint64_t),
                              cudaMemcpyHostToDevice, stream);
    }
    const auto* d_offsets = static_cast<const uint64_t*>(device_offsets);
    auto* piece = static_cast<uint8_t*>(scratch);
    for (uint64_t first = 0; error == cudaSuccess && first < offsets.size();
         first += piece_blocks) {
      const uint64_t count = std::min<uint64_t>(piece_blocks, offsets.size() - first);
      uint8_t* h = host + first * block_bytes;
      if (to_host) {
        error = cuda::LaunchMoveRows(piece, nullptr, base_, d_offsets + first,
                                     static_cast<int64_t>(count), block_bytes, stream);
        if (error == cudaSuccess) {
          DeviceCounters::Download(count * block_bytes);
          error = cudaMemcpyAsync(h, piece, count * block_bytes, cudaMemcpyDefault, stream);
        }
      } else {
        DeviceCounters::Upload(count * block_bytes);
        error = cudaMemcpyAsync(piece, h, count * block_bytes, cudaMemcpyDefault, stream);
        if (error == cudaSuccess) {
          error = cuda::LaunchMoveRows(base_, d_offsets + first, piece, nullptr,
                                       static_cast<int64_t>(count), block_bytes, stream);
        }
      }
    }
    // Freed behind the copies; the wait below covers them and every copy.
    if (device_offsets != nullptr) cudaFreeAsync(device_offsets, stream);
    cudaFreeAsync(scratch, stream);
    DeviceCounters::Sync();
    const cudaError_t waited = cudaStreamSynchronize(stream);
    if (error == cudaSuccess) error = waited;
    return CudaStatus(error, to_host ? "arena ReadBlocks" : "arena WriteBlocks");
  }

  // One transfer per run on this thread's default stream, then one wait.
  absl::Status CopyRuns(absl::Span<const BlockRun> runs, absl::Span<const uint64_t> offsets,
                        uint64_t block_bytes, uint8_t* host, bool to_host) const {
    cudaError_t error = cudaSuccess;
    for (const BlockRun& run : runs) {
      uint8_t* arena = base_ + offsets[run.first];
      uint8_t* h = host + run.first * block_bytes;
      if (to_host) {
        DeviceCounters::Download(run.count * block_bytes);
      } else {
        DeviceCounters::Upload(run.count * block_bytes);
      }
      error = cudaMemcpyAsync(to_host ? h : arena, to_host ? arena : h, run.count * block_bytes,
                              cudaMemcpyDefault, nullptr);
      if (error != cudaSuccess) break;
    }
    DeviceCounters::Sync();
    const cudaError_t waited = cudaStreamSynchronize(nullptr);
    return CudaStatus(error != cudaSuccess ? error : waited, "arena block copy");
  }

  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const void* buffer,
                          const char* op) const {
    const auto end = CheckedAdd(offset, bytes);
    if (!end || *end > handle_.size_bytes) {
      return absl::OutOfRangeError(absl::StrCat("arena ", op, " of ", bytes, " bytes at offset ",
                                                offset, " leaves the arena of ", handle_.size_bytes,
                                                " bytes"));
    }
    if (bytes > 0 && buffer == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("arena ", op, ": null buffer"));
    }
    return absl::OkStatus();
  }

  const int device_;
  uint8_t* const base_;
  ArenaHandle handle_;  // filled once by Create, immutable afterwards
};

// ---------------------------------------------------------------------------------------------
// Validation helpers.

// OK when the device can dereference `p` (device or managed memory, or page-locked host memory
// mapped into the device's address space); null passes (the job validators own null checks).
absl::Status CheckDeviceAccessible(const void* p, absl::string_view context,
                                   absl::string_view field) {
  if (p == nullptr) return absl::OkStatus();
  cudaPointerAttributes attributes{};
  const cudaError_t error = cudaPointerGetAttributes(&attributes, p);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not sticky: an unknown pointer
  }
  const bool ok =
      error == cudaSuccess &&
      (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged ||
       (attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr));
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      context, ": ", field,
      " is not device-accessible memory (the CUDA backend needs device memory, or page-locked "
      "host memory where a field says host)"));
}

// Copies n elements at device (or host) address p to the host, for validation.
template <typename T>
absl::StatusOr<std::vector<T>> Mirror(const T* p, int64_t n, absl::string_view context,
                                      absl::string_view field) {
  // The host copy must be affordable whatever the job claims: a garbage count is refused here
  // instead of failing an allocation.
  constexpr int64_t kMaxMirrorBytes = int64_t{1} << 30;
  if (n < 0 || n > kMaxMirrorBytes / static_cast<int64_t>(sizeof(T))) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": ", field, " of ", n, " elements is too large to validate"));
  }
  std::vector<T> out(static_cast<size_t>(n));
  if (n == 0 || p == nullptr) return out;
  KVS_RETURN_IF_ERROR(CheckDeviceAccessible(p, context, field));
  DeviceCounters::Download(sizeof(T) * n);
  DeviceCounters::Sync();  // a synchronous cudaMemcpy
  const cudaError_t error = cudaMemcpy(out.data(), p, sizeof(T) * n, cudaMemcpyDefault);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": ", field, " (", n, " elements) cannot be read: ", cudaGetErrorString(error)));
  }
  return out;
}

// A copy of `view` whose block table points at a host mirror in `storage` (when the shape lets
// the number of blocks be computed; otherwise the validators reject the shape first).
absl::StatusOr<PagedLayerView> MirrorView(const PagedLayerView& view, std::vector<int32_t>& storage,
                                          absl::string_view context, absl::string_view field) {
  PagedLayerView host = view;
  if (view.count > 0 && view.block_tokens >= 1 && view.block_table != nullptr) {
    const int64_t blocks = (int64_t{view.count} + view.block_tokens - 1) / view.block_tokens;
    KVS_ASSIGN_OR_RETURN(
        storage, Mirror(view.block_table, blocks, context, absl::StrCat(field, ".block_table")));
    host.block_table = storage.data();
  }
  return host;
}

// The kernels stage one row (head_dim fp32 values) in shared memory: the layout's limit
// (gpu/base/layout.h kMaxHeadDim) keeps that within every device's default 48 KiB.
absl::Status CheckViewAccessible(const PagedLayerView& view, absl::string_view context,
                                 absl::string_view field) {
  if (view.count == 0) return absl::OkStatus();
  if (view.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", field,
                                                   ".head_dim must be <= ", kMaxHeadDim,
                                                   " on the CUDA backend, got ", view.head_dim));
  }
  return CheckDeviceAccessible(view.arena, context, absl::StrCat(field, ".arena"));
}

cuda::DevPagedView ToDev(const PagedLayerView& v) {
  cuda::DevPagedView d;
  d.arena = v.arena;
  d.block_table = v.block_table;
  d.kv_index = v.kv_index;
  d.count = v.count;
  d.num_kv_heads = v.num_kv_heads;
  d.head_dim = v.head_dim;
  d.block_tokens = v.block_tokens;
  d.dtype = static_cast<int32_t>(v.dtype);
  d.block_bytes = v.block_bytes;
  return d;
}

// The device-side description of an attention job's inputs (the output pointer is the caller's).
cuda::DevAttentionJob ToDev(const AttentionJob& job) {
  cuda::DevAttentionJob d;
  d.keys = ToDev(job.keys);
  d.key_positions = job.key_positions;
  d.key_stride = job.key_stride;
  d.queries = job.queries;
  d.query_positions = job.query_positions;
  d.num_q_heads = job.num_q_heads;
  d.num_queries = job.num_queries;
  d.scale = job.scale;
  return d;
}

// ---------------------------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  // `trusted`: every job has been validated on the host by the caller (the staging layer) and
  // points where the device can reach; the backend then launches without checking again.
  CudaBackend(int device, bool trusted) : device_(device), trusted_(trusted) {}

  std::string_view name() const override { return "cuda"; }
  bool healthy() const override { return healthy_.load(std::memory_order_acquire); }

  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes, const ArenaOptions&) override {
    KVS_RETURN_IF_ERROR(Enter());
    auto arena = CudaArena::Create(device_, bytes);
    if (!arena.ok() && arena.status().code() == absl::StatusCode::kInternal) {
      MarkUnhealthy(arena.status());
    }
    return arena;
  }

  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const std::string context = absl::StrCat("keydiff job ", i);
      std::vector<int32_t> table;
      KeyDiffScoreJob host = jobs[i];
      KVS_ASSIGN_OR_RETURN(host.keys, MirrorView(jobs[i].keys, table, context, "keys"));
      KVS_RETURN_IF_ERROR(ValidateKeyDiffJob(host, i));
      if (jobs[i].keys.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckViewAccessible(jobs[i].keys, context, "keys"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(jobs[i].scores, context, "scores"));
    }
    // Many layers of a few thousand slots (a decode step's): one launch for all of them. Longer
    // layers (a prompt's) take the tiled kernels, one job at a time.
    constexpr int64_t kBatchedSlots = 4096;
    std::vector<cuda::DevKeyDiffJob> table;
    int64_t slots = 0;
    int32_t max_heads = 1, max_dim = 1;
    for (const KeyDiffScoreJob& job : jobs) {
      if (job.keys.count == 0) continue;
      table.push_back({ToDev(job.keys), static_cast<int>(job.anchor), static_cast<int>(job.metric),
                       job.scores});
      slots += job.keys.count;
      max_heads = std::max(max_heads, job.keys.num_kv_heads);
      max_dim = std::max(max_dim, job.keys.head_dim);
    }
    if (table.size() > 1 && slots <= kBatchedSlots * static_cast<int64_t>(table.size())) {
      return LaunchTable(table, stream, "KeyDiffScores", [&](const cuda::DevKeyDiffJob* device) {
        return cuda::LaunchKeyDiffBatch(device, static_cast<int32_t>(table.size()), max_heads,
                                        max_dim, ToStream(stream));
      });
    }
    for (const KeyDiffScoreJob& job : jobs) {
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchKeyDiff(ToDev(job.keys), static_cast<int>(job.anchor),
                                       static_cast<int>(job.metric), job.scores, ToStream(stream)),
                   "KeyDiffScores"));
    }
    return absl::OkStatus();
  }

  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const TopKJob& job = jobs[i];
      const std::string context = absl::StrCat("top-k job ", i);
      TopKJob host = job;
      std::vector<uint8_t> forced;
      if (job.forced != nullptr) {
        // Negative shapes are the validator's to report; it reads no flags then.
        host.forced = nullptr;
        if (job.rows > 0 && job.n > 0) {
          KVS_ASSIGN_OR_RETURN(forced,
                               Mirror(job.forced, int64_t{job.rows} * job.n, context, "forced"));
          host.forced = forced.data();
        }
      }
      KVS_RETURN_IF_ERROR(ValidateTopKJob(host, i));
      if (job.rows == 0 || job.k == 0) continue;
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.scores, context, "scores"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.positions, context, "positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.kept, context, "kept"));
    }
    for (const TopKJob& job : jobs) {
      KVS_RETURN_IF_ERROR(Launched(cuda::LaunchTopK(job.scores, job.positions, job.forced, job.rows,
                                                    job.n, job.k, job.kept, ToStream(stream)),
                                   "TopK"));
    }
    return absl::OkStatus();
  }

  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const RowCopyJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateRowCopyJob(job, i));
      if (job.count == 0 || job.row_bytes == 0) continue;
      const std::string context = absl::StrCat("row copy job ", i);
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.arena, context, "arena"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.src_offsets, context, "src_offsets"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.dst_offsets, context, "dst_offsets"));
    }
    for (const RowCopyJob& job : jobs) {
      KVS_RETURN_IF_ERROR(Launched(cuda::LaunchCopyRows(job.arena, job.src_offsets, job.dst_offsets,
                                                        job.count, job.row_bytes, ToStream(stream)),
                                   "CopyRows"));
    }
    return absl::OkStatus();
  }

  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const FiniteCheckJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateFiniteCheckJob(job, i));
      const std::string context = absl::StrCat("finite check job ", i);
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.first_non_finite, context, "first_non_finite"));
      if (job.count == 0 || job.row_elements == 0) continue;
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.arena, context, "arena"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.row_offsets, context, "row_offsets"));
      if (job.row_norms != nullptr) {
        KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.row_norms, context, "row_norms"));
      }
    }
    for (const FiniteCheckJob& job : jobs) {
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchFindNonFinite(job.arena, job.row_offsets, job.count,
                                             job.row_elements, static_cast<int32_t>(job.dtype),
                                             job.first_non_finite, job.row_norms, ToStream(stream)),
                   "FindNonFinite"));
    }
    return absl::OkStatus();
  }

  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // The device's address of each job's host buffer: the same pointer for cudaHostAlloc'd
    // memory, possibly another one for cudaHostRegister'ed memory on some systems.
    std::vector<uint8_t*> device_host(jobs.size(), nullptr);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const HostRowCopyJob& job = jobs[i];
      if (!trusted_) KVS_RETURN_IF_ERROR(ValidateHostRowCopyJob(job, i));
      if (job.count == 0 || job.row_bytes == 0) continue;
      const std::string context = absl::StrCat("host row copy job ", i);
      if (!trusted_) {
        KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.arena, context, "arena"));
        KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.host, context, "host"));
        KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.arena_offsets, context, "arena_offsets"));
        KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.host_offsets, context, "host_offsets"));
      }
      cudaPointerAttributes attributes{};
      KVS_RETURN_IF_ERROR(
          Launched(cudaPointerGetAttributes(&attributes, job.host), "cudaPointerGetAttributes"));
      device_host[i] = static_cast<uint8_t*>(attributes.devicePointer);
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      const HostRowCopyJob& job = jobs[i];
      if (device_host[i] == nullptr) continue;  // nothing to copy
      KVS_RETURN_IF_ERROR(Launched(
          cuda::LaunchCopyHostRows(job.arena, device_host[i], job.arena_offsets, job.host_offsets,
                                   job.count, job.row_bytes, job.to_host, ToStream(stream)),
          "CopyHostRows"));
    }
    return absl::OkStatus();
  }

  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return Attention(jobs, /*logits_only=*/false, stream);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return Attention(jobs, /*logits_only=*/true, stream);
  }
  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const PoolJob& job = jobs[i];
      const std::string context = absl::StrCat("pool job ", i);
      PoolJob host = job;
      std::vector<int32_t> lengths, order;
      if (job.count > 0 && job.num_kv_heads > 0) {
        // The validator reads both; negative shapes are its to report.
        KVS_ASSIGN_OR_RETURN(lengths, Mirror(job.lengths, job.num_kv_heads, context, "lengths"));
        KVS_ASSIGN_OR_RETURN(
            order, Mirror(job.order, int64_t{job.num_kv_heads} * job.count, context, "order"));
        host.lengths = job.lengths == nullptr ? nullptr : lengths.data();
        host.order = job.order == nullptr ? nullptr : order.data();
      }
      KVS_RETURN_IF_ERROR(ValidatePoolJob(host, i));
      if (job.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.in, context, "in"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.out, context, "out"));
    }
    for (const PoolJob& job : jobs) {
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchPool(job.in, job.order, job.lengths, job.rows, job.num_kv_heads,
                                    job.count, job.kernel_size, job.kind == PoolKind::kMax ? 1 : 0,
                                    job.out, ToStream(stream)),
                   "PoolScores"));
    }
    return absl::OkStatus();
  }

  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs,
                                    Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const WindowVarianceJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateWindowVarianceJob(job, i));
      if (job.count == 0) continue;
      const std::string context = absl::StrCat("window variance job ", i);
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.probs, context, "probs"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.scores, context, "scores"));
    }
    for (const WindowVarianceJob& job : jobs) {
      KVS_RETURN_IF_ERROR(Launched(
          cuda::LaunchWindowVariance(job.probs, job.num_q_heads, job.num_queries, job.window,
                                     job.count, job.gamma, job.scores, ToStream(stream)),
          "WindowVarianceScores"));
    }
    return absl::OkStatus();
  }

  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const WindowEntropyJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateWindowEntropyJob(job, i));
      const std::string context = absl::StrCat("window entropy job ", i);
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.probs, context, "probs"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.key_positions, context, "key_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.entropy, context, "entropy"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.shift, context, "shift"));
    }
    for (const WindowEntropyJob& job : jobs) {
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchWindowEntropy(job.probs, job.key_positions, job.num_q_heads,
                                             job.num_kv_heads, job.num_queries, job.window,
                                             job.count, job.first_query_position, job.entropy,
                                             job.shift, ToStream(stream)),
                   "WindowEntropyShift"));
    }
    return absl::OkStatus();
  }

  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs,
                                   Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const AttentionJob& job = jobs[i].attention;
      const std::string context = absl::StrCat("attention job ", i);
      std::vector<int32_t> table;
      AttentionSumsJob host = jobs[i];
      KVS_ASSIGN_OR_RETURN(host.attention.keys, MirrorView(job.keys, table, context, "keys"));
      KVS_RETURN_IF_ERROR(ValidateAttentionSumsJob(host, i));
      if (job.keys.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckViewAccessible(job.keys, context, "keys"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.key_positions, context, "key_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.queries, context, "queries"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.query_positions, context, "query_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(jobs[i].sums, context, "sums"));
    }
    for (const AttentionSumsJob& sums_job : jobs) {
      const cuda::DevAttentionJob d = ToDev(sums_job.attention);
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchAttentionColumnSums(d, sums_job.sums, ToStream(stream)),
                   "AttentionColumnSums"));
    }
    return absl::OkStatus();
  }

  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const std::string context = absl::StrCat("caote job ", i);
      std::vector<int32_t> table;
      CaoteJob host = jobs[i];
      KVS_ASSIGN_OR_RETURN(host.values, MirrorView(jobs[i].values, table, context, "values"));
      KVS_RETURN_IF_ERROR(ValidateCaoteJob(host, i));
      if (jobs[i].values.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckViewAccessible(jobs[i].values, context, "values"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(jobs[i].alpha, context, "alpha"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(jobs[i].scores, context, "scores"));
    }
    for (const CaoteJob& job : jobs) {
      KVS_RETURN_IF_ERROR(
          Launched(cuda::LaunchCaote(ToDev(job.values), job.alpha, job.rows, job.fast, job.eps,
                                     job.scores, ToStream(stream)),
                   "CaoteScores"));
    }
    return absl::OkStatus();
  }

  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const NearestKeyJob& job = jobs[i];
      const std::string context = absl::StrCat("nearest key job ", i);
      std::vector<int32_t> table, queries, candidates;
      NearestKeyJob host = job;
      KVS_ASSIGN_OR_RETURN(host.keys, MirrorView(job.keys, table, context, "keys"));
      if (job.num_queries > 0 && job.query_slots != nullptr) {
        KVS_ASSIGN_OR_RETURN(queries,
                             Mirror(job.query_slots, job.num_queries, context, "query_slots"));
        host.query_slots = queries.data();
      }
      if (job.num_queries > 0 && job.num_candidates > 0 && job.candidate_slots != nullptr) {
        KVS_ASSIGN_OR_RETURN(candidates, Mirror(job.candidate_slots, job.num_candidates, context,
                                                "candidate_slots"));
        host.candidate_slots = candidates.data();
      }
      KVS_RETURN_IF_ERROR(ValidateNearestKeyJob(host, i));
      if (job.num_queries == 0) continue;
      KVS_RETURN_IF_ERROR(CheckViewAccessible(job.keys, context, "keys"));
      KVS_RETURN_IF_ERROR(
          CheckDeviceAccessible(job.candidate_positions, context, "candidate_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.similarity, context, "similarity"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.target, context, "target"));
    }
    for (const NearestKeyJob& job : jobs) {
      KVS_RETURN_IF_ERROR(Launched(
          cuda::LaunchNearestKeys(ToDev(job.keys), job.head, job.query_slots, job.num_queries,
                                  job.candidate_slots, job.candidate_positions, job.num_candidates,
                                  job.similarity, job.target, ToStream(stream)),
          "NearestKeys"));
    }
    return absl::OkStatus();
  }

  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const RowMergeJob& job = jobs[i];
      const std::string context = absl::StrCat("row merge job ", i);
      RowMergeJob host = job;
      std::vector<int64_t> starts;
      std::vector<uint64_t> dst, src;
      if (job.rows > 0 && job.rows <= kMaxRowMergeRows) {  // else the validator refuses it
        if (job.source_starts != nullptr) {
          KVS_ASSIGN_OR_RETURN(starts,
                               Mirror(job.source_starts, job.rows + 1, context, "source_starts"));
          host.source_starts = starts.data();
        }
        if (job.dst_offsets != nullptr) {
          KVS_ASSIGN_OR_RETURN(dst, Mirror(job.dst_offsets, job.rows, context, "dst_offsets"));
          host.dst_offsets = dst.data();
        }
        // The count the starts imply, only to mirror the sources; the validator checks them.
        const int64_t sources = starts.empty() ? 0 : std::max<int64_t>(starts.back(), 0);
        if (job.src_offsets != nullptr) {
          KVS_ASSIGN_OR_RETURN(src, Mirror(job.src_offsets, sources, context, "src_offsets"));
          host.src_offsets = src.data();
        }
      }
      KVS_RETURN_IF_ERROR(ValidateRowMergeJob(host, i));
      if (job.rows == 0) continue;
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.arena, context, "arena"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.weights, context, "weights"));
    }
    for (const RowMergeJob& job : jobs) {
      if (job.rows == 0) continue;
      cuda::DevMergeJob d;
      d.arena = job.arena;
      d.dtype = static_cast<int32_t>(job.dtype);
      d.row_elements = job.row_elements;
      d.rows = job.rows;
      d.dst_offsets = job.dst_offsets;
      d.source_starts = job.source_starts;
      d.src_offsets = job.src_offsets;
      d.weights = job.weights;
      KVS_RETURN_IF_ERROR(Launched(cuda::LaunchMergeRows(d, ToStream(stream)), "MergeRows"));
    }
    return absl::OkStatus();
  }

  // Jobs validated on the host by the staging layer, which also put every array they read or
  // write where the device computes: one kernel over every (job, kv head) of the call.
  absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                           Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    if (jobs.empty()) return absl::OkStatus();
    std::vector<cuda::DevDecodeJob> device_jobs(jobs.size());
    int32_t max_heads = 1;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const DecodeEvictJob& job = jobs[i];
      cuda::DevDecodeJob& d = device_jobs[i];
      d.keys = ToDev(job.keys);
      d.stride = job.stride;
      d.positions = job.positions;
      d.new_position = job.new_position;
      d.num_q_heads = job.num_q_heads;
      d.accumulated = job.accumulated;
      d.sums = job.sums;
      d.scores = job.scores == DecodeScores::kAccumulated ? 1
                 : job.scores == DecodeScores::kRows      ? 2
                                                          : 0;
      d.rows = job.rows;
      d.rows_count = job.rows_count;
      d.rows_are_probabilities = job.rows_are_probabilities;
      d.sinks = job.sinks;
      d.recent = job.recent;
      d.evict = job.evict;
      d.evicted = job.evicted;
      d.queries = job.queries;
      d.query_values = job.query_values;
      max_heads = std::max(max_heads, job.keys.num_kv_heads);
    }
    return LaunchTable(device_jobs, stream, "DecodeEvict", [&](const cuda::DevDecodeJob* table) {
      return cuda::LaunchDecodeEvict(table, static_cast<int32_t>(device_jobs.size()), max_heads,
                                     stage == DecodeStage::kChoose ? 0 : 1, ToStream(stream));
    });
  }

  absl::Status Synchronize(Stream stream) override {
    KVS_RETURN_IF_ERROR(Enter());
    DeviceCounters::Sync();
    return Launched(cudaStreamSynchronize(ToStream(stream)), "cudaStreamSynchronize");
  }

  // cudaHostRegisterPortable: the pages are locked for every context of the process, so a copy
  // issued on any thread's device context runs at the bus's speed.
  bool PinHostMemory(void* p, uint64_t bytes) override {
    if (p == nullptr || bytes == 0 || !Enter().ok()) return false;
    if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: the memory is simply not pinned
      return false;
    }
    return true;
  }
  void UnpinHostMemory(void* p) override {
    if (p == nullptr || !Enter().ok()) return;
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  }

 private:
  static cudaStream_t ToStream(Stream stream) { return static_cast<cudaStream_t>(stream); }

  // Every call starts here: refuse work once unhealthy, select the device for this thread.
  absl::Status Enter() {
    if (!healthy()) {
      absl::MutexLock lock(&mu_);
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA backend is unhealthy after a device error: ", first_error_));
    }
    return Launched(cudaSetDevice(device_), "cudaSetDevice");
  }

  // The status of a CUDA call made on behalf of a job; a device error marks the backend unhealthy.
  absl::Status Launched(cudaError_t error, absl::string_view what) {
    if (error == cudaSuccess) return absl::OkStatus();
    absl::Status status = CudaStatus(error, what);
    if (error == cudaErrorMemoryAllocation || error == cudaErrorInvalidValue ||
        error == cudaErrorInvalidConfiguration || error == cudaErrorLaunchOutOfResources) {
      cudaGetLastError();  // not sticky: report without condemning the device
      return status;
    }
    MarkUnhealthy(status);
    return status;
  }

  void MarkUnhealthy(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (first_error_.empty()) first_error_ = std::string(status.message());
    healthy_.store(false, std::memory_order_release);
    std::fprintf(stderr, "kvsidecar: CUDA backend marked unhealthy: %s\n", first_error_.c_str());
  }

  absl::Status Attention(absl::Span<const AttentionJob> jobs, bool logits_only, Stream stream) {
    KVS_RETURN_IF_ERROR(Enter());
    // Validated by the caller when trusted (the staging layer): no second pass, no mirrors.
    for (size_t i = 0; !trusted_ && i < jobs.size(); ++i) {
      const AttentionJob& job = jobs[i];
      const std::string context = absl::StrCat("attention job ", i);
      std::vector<int32_t> table;
      AttentionJob host = job;
      KVS_ASSIGN_OR_RETURN(host.keys, MirrorView(job.keys, table, context, "keys"));
      KVS_RETURN_IF_ERROR(ValidateAttentionJob(host, i));
      if (job.keys.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckViewAccessible(job.keys, context, "keys"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.key_positions, context, "key_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.queries, context, "queries"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.query_positions, context, "query_positions"));
      KVS_RETURN_IF_ERROR(CheckDeviceAccessible(job.probs, context, "probs"));
    }
    std::vector<cuda::DevAttentionJob> device_jobs;
    device_jobs.reserve(jobs.size());
    bool batchable = !jobs.empty();
    int64_t max_rows = 1;
    int32_t max_dim = 1;
    for (const AttentionJob& job : jobs) {
      if (job.keys.count == 0) continue;
      cuda::DevAttentionJob& d = device_jobs.emplace_back(ToDev(job));
      d.out = job.probs;
      batchable = batchable && cuda::AttentionBatchable(d);
      max_rows = std::max<int64_t>(max_rows, int64_t{job.num_q_heads} * job.num_queries);
      max_dim = std::max(max_dim, job.keys.head_dim);
    }
    const char* what = logits_only ? "AttentionLogits" : "AttentionProbs";
    // A decode step's jobs (one query each) in one launch; larger windows one launch each, on
    // the kernel their shape calls for.
    if (batchable && device_jobs.size() > 1) {
      return LaunchTable(device_jobs, stream, what, [&](const cuda::DevAttentionJob* table) {
        return cuda::LaunchAttentionBatch(table, static_cast<int32_t>(device_jobs.size()), max_rows,
                                          max_dim, logits_only, ToStream(stream));
      });
    }
    for (const cuda::DevAttentionJob& d : device_jobs) {
      KVS_RETURN_IF_ERROR(Launched(cuda::LaunchAttention(d, logits_only, ToStream(stream)), what));
    }
    return absl::OkStatus();
  }

  // Copies `table` (host job descriptors) to stream-ordered device memory, runs launch(device
  // table) and frees it behind the launch.
  template <typename T, typename Launch>
  absl::Status LaunchTable(const std::vector<T>& table, Stream stream, const char* what,
                           const Launch& launch) {
    const cudaStream_t s = ToStream(stream);
    const size_t bytes = table.size() * sizeof(T);
    void* device = nullptr;
    KVS_RETURN_IF_ERROR(Launched(cudaMallocAsync(&device, bytes, s), "cudaMallocAsync"));
    cudaError_t error = cudaMemcpyAsync(device, table.data(), bytes, cudaMemcpyHostToDevice, s);
    if (error == cudaSuccess) error = launch(static_cast<const T*>(device));
    cudaFreeAsync(device, s);
    return Launched(error, what);
  }

  const int device_;
  const bool trusted_;
  std::atomic<bool> healthy_{true};
  mutable absl::Mutex mu_;
  std::string first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    if (why != nullptr) {
      *why = absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(error), " (",
                          cudaGetErrorString(error), ")");
    }
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "cudaGetDeviceCount: 0 devices";
  return count;
}

std::string CudaDeviceDescription(int ordinal) {
  cudaDeviceProp props;
  if (cudaError_t error = cudaGetDeviceProperties(&props, ordinal); error != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("device ", ordinal, ": ", cudaGetErrorString(error));
  }
  return absl::StrCat(props.name, " (sm_", props.major, props.minor, ", ",
                      props.totalGlobalMem >> 20, " MiB)");
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, bool trusted) {
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count == 0) return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", why));
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " present)"));
  }
  if (cudaError_t error = cudaSetDevice(device); error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " cannot be used: ", cudaGetErrorString(error)));
  }
  // Create the context now, so that a broken device fails here and not in the first call.
  if (cudaError_t error = cudaFree(nullptr); error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device ", device, " cannot be initialised: ", cudaGetErrorString(error)));
  }
  // The kernels take their scratch with cudaMallocAsync. With the pool's default release
  // threshold (0) every synchronisation hands the freed scratch back to the driver, and the next
  // call maps it again: about a millisecond per launch in a device run. The pool keeps up to
  // kKeptScratch instead (more would be held from arenas and staging buffers, which take plain
  // cudaMalloc: a prompt's full attention can take gigabytes of scratch once), and gives it back
  // when an arena is freed (~CudaArena), so that a detached session leaves nothing behind.
  constexpr uint64_t kKeptScratch = uint64_t{256} << 20;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep = kKeptScratch;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);  // best effort
  }
  cudaGetLastError();
  return std::unique_ptr<Backend>(new CudaBackend(device, trusted));
}

}  // namespace kvs
