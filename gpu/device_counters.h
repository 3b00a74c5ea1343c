// DeviceCounters: process-wide counts of what the cache core asks of the compute seam and of what
// reaching a device costs: backend calls and their jobs by method, host<->device
// synchronisations, transfers to and from the device with their bytes, host copies into and out
// of arenas, and kernel launches. A call's shape (how many round trips a decode step makes, how
// many bytes it brings back) is what decides its speed on a GPU, and it can be counted where no
// GPU is: the simulated device counts the events a CUDA device would have, so the shape of every
// RPC is asserted in CI (tests/e2e/device_counts_test.cc) and printed by bench/rpc_counts.
//
// What counts as what:
//   calls / jobs  every Backend method the core calls (Synchronize excepted), counted once at the
//                 top of the stack (CountingBackend, gpu/counting_backend.h), with its job count;
//   syncs         every point where the host waits for a device: Synchronize on a device
//                 backend, every synchronous copy (DeviceMemory copies, Arena Read/Write on a
//                 device arena), an allocation that waits for its stream. The CPU backend has no
//                 device and counts none;
//   uploads / downloads, up_bytes / down_bytes
//                 copies host -> device and device -> host (DeviceMemory copies, device arena
//                 Read/Write and block copies);
//   arena_writes / arena_reads (with bytes)
//                 Arena::Write / Read / WriteBlocks / ReadBlocks calls, on every backend (on the
//                 CPU backend they are memcpys; on a device each is a transfer as well);
//   launches      kernels a device backend started (CUDA), or the launches the simulated device
//                 stands for (one per device call that runs jobs).
//
// Counters only rise; a caller takes a snapshot before and after what it measures (Delta). A
// snapshot of concurrent work mixes that work's events: measure one call at a time.
//
// Threading: every function is safe to call from any thread (relaxed atomics).
#ifndef KVSIDECAR_GPU_DEVICE_COUNTERS_H_
#define KVSIDECAR_GPU_DEVICE_COUNTERS_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kvs {

// The Backend methods that do work, in the order gpu/backend.h declares them.
enum class BackendMethod : int {
  kKeyDiffScores = 0,
  kTopK,
  kCopyRows,
  kAttentionProbs,
  kAttentionLogits,
  kAttentionColumnSums,
  kPoolScores,
  kWindowVarianceScores,
  kWindowEntropyShift,
  kCopyHostRows,
  kCaoteScores,
  kNearestKeys,
  kMergeRows,
  kFindNonFinite,
  kDecodeEvict,
  kCount,  // not a method
};
inline constexpr size_t kNumBackendMethods = static_cast<size_t>(BackendMethod::kCount);

// The method's name as gpu/backend.h spells it ("TopK"), the label value of the metrics.
inline const char* BackendMethodName(BackendMethod method) {
  static constexpr std::array<const char*, kNumBackendMethods> kNames = {
      "KeyDiffScores",      "TopK",
      "CopyRows",           "AttentionProbs",
      "AttentionLogits",    "AttentionColumnSums",
      "PoolScores",         "WindowVarianceScores",
      "WindowEntropyShift", "CopyHostRows",
      "CaoteScores",        "NearestKeys",
      "MergeRows",          "FindNonFinite",
      "DecodeEvict"};
  const size_t i = static_cast<size_t>(method);
  return i < kNumBackendMethods ? kNames[i] : "unknown";
}

// One reading of every counter (plain values).
struct DeviceCounts {
  std::array<uint64_t, kNumBackendMethods> calls{};
  std::array<uint64_t, kNumBackendMethods> jobs{};
  uint64_t syncs = 0;
  uint64_t uploads = 0;
  uint64_t downloads = 0;
  uint64_t up_bytes = 0;
  uint64_t down_bytes = 0;
  uint64_t arena_writes = 0;
  uint64_t arena_write_bytes = 0;
  uint64_t arena_reads = 0;
  uint64_t arena_read_bytes = 0;
  uint64_t launches = 0;

  uint64_t total_calls() const {
    uint64_t sum = 0;
    for (uint64_t c : calls) sum += c;
    return sum;
  }
  uint64_t total_jobs() const {
    uint64_t sum = 0;
    for (uint64_t j : jobs) sum += j;
    return sum;
  }
  // What happened between `before` and this reading.
  DeviceCounts Since(const DeviceCounts& before) const {
    DeviceCounts d;
    for (size_t i = 0; i < kNumBackendMethods; ++i) {
      d.calls[i] = calls[i] - before.calls[i];
      d.jobs[i] = jobs[i] - before.jobs[i];
    }
    d.syncs = syncs - before.syncs;
    d.uploads = uploads - before.uploads;
    d.downloads = downloads - before.downloads;
    d.up_bytes = up_bytes - before.up_bytes;
    d.down_bytes = down_bytes - before.down_bytes;
    d.arena_writes = arena_writes - before.arena_writes;
    d.arena_write_bytes = arena_write_bytes - before.arena_write_bytes;
    d.arena_reads = arena_reads - before.arena_reads;
    d.arena_read_bytes = arena_read_bytes - before.arena_read_bytes;
    d.launches = launches - before.launches;
    return d;
  }
};

// The process's counters. Header-only, so that every gpu/ folder (cpu, sim, cuda) counts into the
// same instance without a library of its own.
class DeviceCounters {
 public:
  static void Call(BackendMethod method, size_t jobs) {
    const size_t i = static_cast<size_t>(method);
    if (i >= kNumBackendMethods) return;
    Get().calls_[i].fetch_add(1, std::memory_order_relaxed);
    Get().jobs_[i].fetch_add(jobs, std::memory_order_relaxed);
  }
  static void Sync() { Add(Get().syncs_, 1); }
  static void Upload(uint64_t bytes) {
    Add(Get().uploads_, 1);
    Add(Get().up_bytes_, bytes);
  }
  static void Download(uint64_t bytes) {
    Add(Get().downloads_, 1);
    Add(Get().down_bytes_, bytes);
  }
  static void ArenaWrite(uint64_t bytes) {
    Add(Get().arena_writes_, 1);
    Add(Get().arena_write_bytes_, bytes);
  }
  static void ArenaRead(uint64_t bytes) {
    Add(Get().arena_reads_, 1);
    Add(Get().arena_read_bytes_, bytes);
  }
  static void Launch(uint64_t kernels = 1) { Add(Get().launches_, kernels); }

  static DeviceCounts Read() {
    const DeviceCounters& c = Get();
    DeviceCounts out;
    for (size_t i = 0; i < kNumBackendMethods; ++i) {
      out.calls[i] = c.calls_[i].load(std::memory_order_relaxed);
      out.jobs[i] = c.jobs_[i].load(std::memory_order_relaxed);
    }
    out.syncs = Load(c.syncs_);
    out.uploads = Load(c.uploads_);
    out.downloads = Load(c.downloads_);
    out.up_bytes = Load(c.up_bytes_);
    out.down_bytes = Load(c.down_bytes_);
    out.arena_writes = Load(c.arena_writes_);
    out.arena_write_bytes = Load(c.arena_write_bytes_);
    out.arena_reads = Load(c.arena_reads_);
    out.arena_read_bytes = Load(c.arena_read_bytes_);
    out.launches = Load(c.launches_);
    return out;
  }

 private:
  static DeviceCounters& Get() {
    static DeviceCounters counters;  // one per process: an inline function's static
    return counters;
  }
  static void Add(std::atomic<uint64_t>& counter, uint64_t n) {
    counter.fetch_add(n, std::memory_order_relaxed);
  }
  static uint64_t Load(const std::atomic<uint64_t>& counter) {
    return counter.load(std::memory_order_relaxed);
  }

  std::array<std::atomic<uint64_t>, kNumBackendMethods> calls_{};
  std::array<std::atomic<uint64_t>, kNumBackendMethods> jobs_{};
  std::atomic<uint64_t> syncs_{0}, uploads_{0}, downloads_{0}, up_bytes_{0}, down_bytes_{0};
  std::atomic<uint64_t> arena_writes_{0}, arena_write_bytes_{0}, arena_reads_{0},
      arena_read_bytes_{0};
  std::atomic<uint64_t> launches_{0};
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_DEVICE_COUNTERS_H_
