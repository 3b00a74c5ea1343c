// StagingBackend (gpu/staging_backend.h): host validation, one packed upload, the device call,
// one download of the outputs.
#include "gpu/staging_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/attention_cpu.h"     // ValidateAttentionJob
#include "gpu/cpu/caote_cpu.h"         // ValidateCaoteJob
#include "gpu/cpu/copy_cpu.h"          // ValidateRowCopyJob, ValidateHostRowCopyJob
#include "gpu/cpu/decode_evict_cpu.h"  // ValidateDecodeEvictJob
#include "gpu/cpu/keydiff_cpu.h"       // ValidateKeyDiffJob
#include "gpu/cpu/merge_cpu.h"         // ValidateNearestKeyJob, ValidateRowMergeJob
#include "gpu/cpu/pool_cpu.h"          // ValidatePoolJob
#include "gpu/cpu/topk_cpu.h"          // ValidateTopKJob
#include "gpu/cpu/window_stats_cpu.h"  // ValidateWindowVarianceJob, ValidateWindowEntropyJob

namespace kvs {
namespace {

// A mirror for validation must stay affordable whatever a (device-resident) job claims.
constexpr uint64_t kMaxMirrorBytes = uint64_t{1} << 30;

uint64_t AlignUp(uint64_t n) { return (n + kStagingAlignment - 1) & ~(kStagingAlignment - 1); }

// The product of validated, non-negative shape factors; INVALID_ARGUMENT if it overflows (the
// validators bound most products already; this keeps every size computation checked).
absl::StatusOr<uint64_t> Elements(std::initializer_list<int64_t> factors, absl::string_view context,
                                  absl::string_view field) {
  const auto product = CheckedProduct(factors);
  if (!product) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": size of ", field, " overflows"));
  }
  return *product;
}

// Entries of a view's block table that the kernels read (0 when the view reads nothing).
int64_t TableEntries(const PagedLayerView& view) {
  if (view.count <= 0 || view.block_tokens < 1) return 0;
  return (int64_t{view.count} + view.block_tokens - 1) / view.block_tokens;
}

template <typename P>
void SetPointer(void* field, uint8_t* address) {
  *static_cast<P*>(field) = reinterpret_cast<P>(address);
}

using TraceClock = std::chrono::steady_clock;

// KVS_STAGING_TRACE set to anything but "" or "0": StagingBackend::Run traces every call.
bool TraceOn() {
  static const bool on = [] {
    const char* value = std::getenv("KVS_STAGING_TRACE");
    return value != nullptr && *value != '\0' && std::string_view(value) != "0";
  }();
  return on;
}

// Now when tracing, else a zero time point: an untraced call reads no clock.
TraceClock::time_point TraceNow() {
  return TraceOn() ? TraceClock::now() : TraceClock::time_point();
}

// Page-locked host buffers the stagers pack inputs into and take outputs back in. A copy from
// pageable memory runs at a fraction of the bus's speed (the driver bounces it through a
// page-locked buffer of its own: 0.3-2.6 GB/s in the staging trace on an H200), and pinning
// costs more than a copy, so buffers are kept for reuse: sizes are powers of two, so that the
// sizes of repeated calls meet again, and at most kKeptBytes stay pinned between calls. Pinning
// is best effort: a buffer the device refuses to pin works, only slower. (The spill buffers,
// cache/spill_buffers.h, are kept the same way, but they live above gpu/ and are the tiers'
// layer strings, so the staging layer keeps its own.)
class HostBuffers {
 public:
  struct Buffer {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
    bool pinned = false;
  };

  explicit HostBuffers(Backend& device) : device_(device) {}
  ~HostBuffers() {
    for (auto& [bytes, buffer] : free_) Release(buffer);
  }
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;

  // A buffer of at least `bytes` (> 0): the smallest kept one that fits (and is not more than
  // four times the size), else a new one.
  absl::StatusOr<Buffer> Take(uint64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      // A small call does not hold a large buffer another call may need.
      if (auto it = free_.lower_bound(bytes); it != free_.end() && it->first / 4 <= bytes) {
        const Buffer buffer = it->second;
        free_.erase(it);
        kept_ -= buffer.bytes;
        return buffer;
      }
    }
    if (bytes > kMaxBufferBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a staged call needs ", bytes, " bytes of host staging memory"));
    }
    Buffer buffer;
    buffer.bytes = kMinBufferBytes;
    while (buffer.bytes < bytes) buffer.bytes *= 2;
    buffer.data = static_cast<uint8_t*>(std::aligned_alloc(kPageBytes, buffer.bytes));
    if (buffer.data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", buffer.bytes, " bytes of host staging memory"));
    }
    // One that cannot be kept is not worth pinning: the pin would be paid on every call.
    if (buffer.bytes <= kKeptBytes) {
      buffer.pinned = device_.PinHostMemory(buffer.data, buffer.bytes);
    }
    return buffer;
  }

  // Back for reuse, or unpinned and freed once kKeptBytes are kept.
  void Give(Buffer buffer) {
    if (buffer.data == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      if (kept_ + buffer.bytes <= kKeptBytes) {
        kept_ += buffer.bytes;
        free_.emplace(buffer.bytes, buffer);
        return;
      }
    }
    Release(buffer);
  }

 private:
  static constexpr uint64_t kPageBytes = 4096;
  static constexpr uint64_t kMinBufferBytes = uint64_t{64} << 10;
  static constexpr uint64_t kMaxBufferBytes = uint64_t{1} << 40;
  static constexpr uint64_t kKeptBytes = uint64_t{256} << 20;

  void Release(Buffer& buffer) {
    if (buffer.pinned) device_.UnpinHostMemory(buffer.data);
    std::free(buffer.data);
  }

  Backend& device_;
  absl::Mutex mu_;
  std::multimap<uint64_t, Buffer> free_ ABSL_GUARDED_BY(mu_);  // by size
  uint64_t kept_ ABSL_GUARDED_BY(mu_) = 0;
};

// The staging plan of one call: which host arrays go up, which come back, and the device job
// fields to repoint at the staged copies. The device buffer is freed and the host buffers go
// back on destruction (the caller has synchronised the stream by then).
class Stager {
 public:
  // `stream` is the call's: QueuedStream() marks a call that may return without waiting (its
  // work then runs on the calling thread's stream, nullptr).
  Stager(DeviceMemory& memory, HostBuffers& host, Stream stream)
      : memory_(memory),
        host_(host),
        created_(TraceNow()),
        queued_(stream == QueuedStream()),
        stream_(queued_ ? nullptr : stream) {}
  ~Stager() { Release(Detach()); }

  // The stream the call's device work and copies go on.
  Stream stream() const { return stream_; }
  bool queued() const { return queued_; }
  void Unqueue() { queued_ = false; }
  // A host buffer the call's device work reads or writes (a bounce buffer), given back with the
  // stager's own.
  void Adopt(HostBuffers::Buffer buffer) { adopted_.push_back(buffer); }

  // What the call holds until its device work is done: the device staging buffer and the host
  // buffers. Detach hands them over (the stager then holds nothing); Release gives them back.
  struct Held {
    void* device = nullptr;
    std::vector<HostBuffers::Buffer> host;
  };
  Held Detach() {
    Held held;
    held.device = device_;
    device_ = nullptr;
    for (HostBuffers::Buffer* buffer : {&in_host_, &out_host_}) {
      if (buffer->data != nullptr) held.host.push_back(*buffer);
      *buffer = HostBuffers::Buffer();
    }
    for (const HostBuffers::Buffer& buffer : adopted_) held.host.push_back(buffer);
    adopted_.clear();
    return held;
  }
  void Release(const Held& held) {
    memory_.Free(held.device);
    for (const HostBuffers::Buffer& buffer : held.host) host_.Give(buffer);
  }

  uint64_t in_bytes() const { return in_bytes_; }
  uint64_t out_bytes() const { return out_bytes_; }
  // When the call began building its plan (validation and staging decisions come after); a zero
  // time point unless tracing.
  TraceClock::time_point created() const { return created_; }

  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // `*field` (a member of a device job, currently equal to `host`) will point at a device copy
  // of the `elements` T at `host`. Device-accessible, null or empty arrays stay as they are.
  template <typename T>
  absl::Status Input(const T** field, const T* host, uint64_t elements) {
    if (host == nullptr || elements == 0 || memory_.IsDeviceAccessible(host)) {
      return absl::OkStatus();
    }
    KVS_ASSIGN_OR_RETURN(const uint64_t offset, Reserve(in_bytes_, elements, sizeof(T)));
    inputs_.push_back(Piece{field, &SetPointer<const T*>, offset, host, elements * sizeof(T)});
    return absl::OkStatus();
  }

  // The same for a field the device only reads but whose type is not const (DecodeEvictJob's
  // `evicted`, an output of one stage and an input of the next).
  template <typename T>
  absl::Status Input(T** field, const T* host, uint64_t elements) {
    if (host == nullptr || elements == 0 || memory_.IsDeviceAccessible(host)) {
      return absl::OkStatus();
    }
    KVS_ASSIGN_OR_RETURN(const uint64_t offset, Reserve(in_bytes_, elements, sizeof(T)));
    inputs_.push_back(Piece{field, &SetPointer<T*>, offset, host, elements * sizeof(T)});
    return absl::OkStatus();
  }

  // `*field` will point at device space for `elements` T, copied back to `host` by Download.
  template <typename T>
  absl::Status Output(T** field, T* host, uint64_t elements) {
    if (host == nullptr || elements == 0 || memory_.IsDeviceAccessible(host)) {
      return absl::OkStatus();
    }
    // Outputs are packed at their own alignment: the region comes back as one copy, and a call's
    // outputs are often a few bytes a job (a decode step's evicted slots).
    KVS_ASSIGN_OR_RETURN(const uint64_t offset,
                         Reserve(out_bytes_, elements, sizeof(T), alignof(T)));
    outputs_.push_back(Piece{field, &SetPointer<T*>, offset, host, elements * sizeof(T)});
    return absl::OkStatus();
  }

  // One Allocate and one CopyToDevice of every input; repoints the job fields. Nothing when
  // every array passed through.
  absl::Status Upload(Stream stream) {
    const uint64_t out_base = AlignUp(in_bytes_);
    const auto total = CheckedAdd(out_base, out_bytes_);
    if (!total || out_base < in_bytes_) {
      return absl::ResourceExhaustedError("staging buffer size overflows");
    }
    if (*total == 0) return absl::OkStatus();
    KVS_ASSIGN_OR_RETURN(void* device, memory_.Allocate(*total));
    device_ = static_cast<uint8_t*>(device);
    out_base_ = out_base;
    if (in_bytes_ > 0) {
      KVS_ASSIGN_OR_RETURN(in_host_, host_.Take(in_bytes_));
      for (const Piece& piece : inputs_) {
        std::memcpy(in_host_.data + piece.offset, piece.host, piece.bytes);
      }
      // From a page-locked buffer the copy is queued ahead of the call's work and covered by the
      // call's one wait; from pageable memory the driver would bounce it anyway, so it waits.
      KVS_RETURN_IF_ERROR(in_host_.pinned
                              ? memory_.CopyToDeviceAsync(device_, in_host_.data, in_bytes_, stream)
                              : memory_.CopyToDevice(device_, in_host_.data, in_bytes_, stream));
    }
    for (const Piece& piece : inputs_) piece.set(piece.field, device_ + piece.offset);
    for (const Piece& piece : outputs_) piece.set(piece.field, device_ + out_base_ + piece.offset);
    return absl::OkStatus();
  }

  // One CopyToHost of the output region, scattered to the callers' arrays.
  absl::Status Download(Stream stream) {
    if (out_bytes_ == 0) return absl::OkStatus();
    KVS_ASSIGN_OR_RETURN(out_host_, host_.Take(out_bytes_));
    KVS_RETURN_IF_ERROR(
        memory_.CopyToHost(out_host_.data, device_ + out_base_, out_bytes_, stream));
    for (const Piece& piece : outputs_) {
      std::memcpy(const_cast<void*>(piece.host), out_host_.data + piece.offset, piece.bytes);
    }
    return absl::OkStatus();
  }

 private:
  struct Piece {
    void* field;                   // the device job's pointer member
    void (*set)(void*, uint8_t*);  // assigns a device address to it with its own type
    uint64_t offset;               // in its region (inputs, or outputs)
    const void* host;              // the caller's array
    uint64_t bytes;
  };

  static absl::StatusOr<uint64_t> Reserve(uint64_t& region, uint64_t elements, uint64_t size,
                                          uint64_t alignment = kStagingAlignment) {
    const auto bytes = CheckedProduct({static_cast<int64_t>(elements), static_cast<int64_t>(size)});
    const uint64_t offset = (region + alignment - 1) / alignment * alignment;
    const auto end = bytes ? CheckedAdd(offset, *bytes) : std::nullopt;
    if (static_cast<int64_t>(elements) < 0 || !end || offset < region) {
      return absl::ResourceExhaustedError("staging buffer size overflows");
    }
    region = *end;
    return offset;
  }

  DeviceMemory& memory_;
  HostBuffers& host_;
  HostBuffers::Buffer in_host_, out_host_;
  std::vector<Piece> inputs_, outputs_;
  uint64_t in_bytes_ = 0, out_bytes_ = 0, out_base_ = 0;
  const TraceClock::time_point created_;
  bool queued_;
  const Stream stream_;
  uint8_t* device_ = nullptr;
  std::vector<HostBuffers::Buffer> adopted_;
};

class StagingBackend final : public Backend {
 public:
  StagingBackend(std::unique_ptr<Backend> device, std::unique_ptr<DeviceMemory> memory)
      : device_(std::move(device)), memory_(std::move(memory)), host_buffers_(*device_) {}

  std::string_view name() const override { return device_->name(); }
  bool healthy() const override { return device_->healthy(); }
  bool batches_calls() const override { return true; }

  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    return device_->CreateArena(bytes, options);
  }

  // A staged call has waited for its own work before it returned unless it was queued
  // (QueuedStream): only then is there anything to wait for, and one wait covers every call this
  // thread queued. Otherwise a wait here would be a round trip per call for nothing.
  absl::Status Synchronize(Stream) override {
    if (!HoldsQueued()) return absl::OkStatus();
    const absl::Status waited = device_->Synchronize(nullptr);
    ReleaseHeld();
    return waited;
  }
  bool PinHostMemory(void* p, uint64_t bytes) override { return device_->PinHostMemory(p, bytes); }
  void UnpinHostMemory(void* p) override { device_->UnpinHostMemory(p); }

  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<KeyDiffScoreJob> device_jobs;
    device_jobs.reserve(jobs.size());  // the stager holds pointers into it
    for (size_t i = 0; i < jobs.size(); ++i) {
      const KeyDiffScoreJob& job = jobs[i];
      const std::string context = absl::StrCat("keydiff job ", i);
      KeyDiffScoreJob host = job;
      std::vector<int32_t> table;
      KVS_ASSIGN_OR_RETURN(host.keys.block_table,
                           HostTable(job.keys, table, context, "keys", stream));
      KVS_RETURN_IF_ERROR(ValidateKeyDiffJob(host, i));
      if (job.keys.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.keys.arena, context, "keys.arena"));
      KeyDiffScoreJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(const uint64_t scores,
                           Elements({job.keys.num_kv_heads, job.keys.count}, context, "scores"));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.keys.block_table, job.keys.block_table, TableEntries(job.keys)));
      KVS_RETURN_IF_ERROR(stager.Output(&d.scores, job.scores, scores));
    }
    return Run(stager, device_jobs, stream, &Backend::KeyDiffScores);
  }

  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<TopKJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const TopKJob& job = jobs[i];
      const std::string context = absl::StrCat("top-k job ", i);
      TopKJob host = job;
      std::vector<uint8_t> forced;
      if (job.rows > 0 && job.n > 0) {
        KVS_ASSIGN_OR_RETURN(host.forced, HostReadable(job.forced, int64_t{job.rows} * job.n,
                                                       forced, context, "forced", stream));
      }
      KVS_RETURN_IF_ERROR(ValidateTopKJob(host, i));
      if (job.rows == 0 || job.k == 0) continue;  // nothing is written
      TopKJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(const uint64_t slots, Elements({job.rows, job.n}, context, "scores"));
      KVS_ASSIGN_OR_RETURN(const uint64_t kept, Elements({job.rows, job.k}, context, "kept"));
      KVS_RETURN_IF_ERROR(stager.Input(&d.scores, job.scores, slots));
      KVS_RETURN_IF_ERROR(stager.Input(&d.positions, job.positions, slots));
      KVS_RETURN_IF_ERROR(stager.Input(&d.forced, job.forced, slots));
      KVS_RETURN_IF_ERROR(stager.Output(&d.kept, job.kept, kept));
    }
    return Run(stager, device_jobs, stream, &Backend::TopK);
  }

  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<RowCopyJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const RowCopyJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateRowCopyJob(job, i));
      if (job.count == 0 || job.row_bytes == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.arena, absl::StrCat("row copy job ", i), "arena"));
      RowCopyJob& d = device_jobs.emplace_back(job);
      KVS_RETURN_IF_ERROR(stager.Input(&d.src_offsets, job.src_offsets, job.count));
      KVS_RETURN_IF_ERROR(stager.Input(&d.dst_offsets, job.dst_offsets, job.count));
    }
    return Run(stager, device_jobs, stream, &Backend::CopyRows);
  }

  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return Attention(jobs, stream, &Backend::AttentionProbs);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return Attention(jobs, stream, &Backend::AttentionLogits);
  }

  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<PoolJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const PoolJob& job = jobs[i];
      const std::string context = absl::StrCat("pool job ", i);
      PoolJob host = job;
      std::vector<int32_t> lengths, order;
      if (job.count > 0 && job.num_kv_heads > 0) {
        KVS_ASSIGN_OR_RETURN(host.lengths, HostReadable(job.lengths, job.num_kv_heads, lengths,
                                                        context, "lengths", stream));
        KVS_ASSIGN_OR_RETURN(host.order,
                             HostReadable(job.order, int64_t{job.num_kv_heads} * job.count, order,
                                          context, "order", stream));
      }
      KVS_RETURN_IF_ERROR(ValidatePoolJob(host, i));
      if (job.count == 0) continue;  // nothing is read or written
      PoolJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(const uint64_t values, Elements({job.rows, job.count}, context, "in"));
      KVS_ASSIGN_OR_RETURN(const uint64_t slots,
                           Elements({job.num_kv_heads, job.count}, context, "order"));
      KVS_RETURN_IF_ERROR(stager.Input(&d.in, job.in, values));
      KVS_RETURN_IF_ERROR(stager.Input(&d.order, job.order, slots));
      KVS_RETURN_IF_ERROR(stager.Input(&d.lengths, job.lengths, job.num_kv_heads));
      KVS_RETURN_IF_ERROR(stager.Output(&d.out, job.out, values));
    }
    return Run(stager, device_jobs, stream, &Backend::PoolScores);
  }

  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs,
                                    Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<WindowVarianceJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const WindowVarianceJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateWindowVarianceJob(job, i));
      if (job.count == 0) continue;  // nothing is read or written
      const std::string context = absl::StrCat("window variance job ", i);
      WindowVarianceJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(
          const uint64_t probs,
          Elements({job.num_q_heads, job.num_queries, job.count}, context, "probs"));
      KVS_ASSIGN_OR_RETURN(const uint64_t scores,
                           Elements({job.num_q_heads, job.count}, context, "scores"));
      KVS_RETURN_IF_ERROR(stager.Input(&d.probs, job.probs, probs));
      KVS_RETURN_IF_ERROR(stager.Output(&d.scores, job.scores, scores));
    }
    return Run(stager, device_jobs, stream, &Backend::WindowVarianceScores);
  }

  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<WindowEntropyJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const WindowEntropyJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateWindowEntropyJob(job, i));
      // Every job writes its two outputs (zeros without slots), so every job goes to the device.
      const std::string context = absl::StrCat("window entropy job ", i);
      WindowEntropyJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(
          const uint64_t probs,
          Elements({job.num_q_heads, job.num_queries, job.count}, context, "probs"));
      KVS_ASSIGN_OR_RETURN(const uint64_t positions,
                           Elements({job.num_kv_heads, job.count}, context, "key_positions"));
      KVS_RETURN_IF_ERROR(stager.Input(&d.probs, job.probs, probs));
      KVS_RETURN_IF_ERROR(stager.Input(&d.key_positions, job.key_positions, positions));
      KVS_RETURN_IF_ERROR(stager.Output(&d.entropy, job.entropy, 1));
      KVS_RETURN_IF_ERROR(stager.Output(&d.shift, job.shift, 1));
    }
    return Run(stager, device_jobs, stream, &Backend::WindowEntropyShift);
  }

  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs,
                                   Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<AttentionSumsJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const AttentionSumsJob& job = jobs[i];
      const AttentionJob& a = job.attention;
      const std::string context = absl::StrCat("attention job ", i);
      AttentionSumsJob host = job;
      std::vector<int32_t> table;
      KVS_ASSIGN_OR_RETURN(host.attention.keys.block_table,
                           HostTable(a.keys, table, context, "keys", stream));
      KVS_RETURN_IF_ERROR(ValidateAttentionSumsJob(host, i));
      if (a.keys.count == 0) continue;  // nothing is read or written
      KVS_RETURN_IF_ERROR(CheckArena(a.keys.arena, context, "keys.arena"));
      AttentionSumsJob& d = device_jobs.emplace_back(job);
      d.attention.probs = nullptr;
      const PagedLayerView& v = a.keys;
      KVS_ASSIGN_OR_RETURN(
          const uint64_t key_positions,
          Elements({v.num_kv_heads, KeyPositionsOffset(a, 1)}, context, "key_positions"));
      KVS_ASSIGN_OR_RETURN(
          const uint64_t queries,
          Elements({a.num_q_heads, a.num_queries, v.head_dim}, context, "queries"));
      KVS_ASSIGN_OR_RETURN(const uint64_t sums,
                           Elements({a.num_q_heads, v.count}, context, "sums"));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.attention.keys.block_table, v.block_table, TableEntries(v)));
      KVS_RETURN_IF_ERROR(stager.Input(&d.attention.key_positions, a.key_positions, key_positions));
      KVS_RETURN_IF_ERROR(stager.Input(&d.attention.queries, a.queries, queries));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.attention.query_positions, a.query_positions, a.num_queries));
      KVS_RETURN_IF_ERROR(stager.Output(&d.sums, job.sums, sums));
    }
    return Run(stager, device_jobs, stream, &Backend::AttentionColumnSums);
  }

  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<HostRowCopyJob> device_jobs;
    device_jobs.reserve(jobs.size());
    // Jobs whose host side is pageable go through one page-locked bounce buffer for the call:
    // their rows packed into it before the device copies them into the arena, or unpacked from it
    // after the device copied them out, so a call of thousands of scattered rows (every inline
    // token of a decode step) is one transfer and one device call, not a copy per run of rows.
    std::vector<Bounce> bounces;
    std::vector<std::vector<uint64_t>> packed;  // per bounce: its rows' offsets in the buffer
    packed.reserve(jobs.size());
    uint64_t bounce_bytes = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const HostRowCopyJob& job = jobs[i];
      const std::string context = absl::StrCat("host row copy job ", i);
      KVS_RETURN_IF_ERROR(ValidateHostRowCopyJob(job, i));
      if (job.count == 0 || job.row_bytes == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.arena, context, "arena"));
      HostRowCopyJob& d = device_jobs.emplace_back(job);
      KVS_RETURN_IF_ERROR(stager.Input(&d.arena_offsets, job.arena_offsets, job.count));
      if (memory_->IsDeviceAccessible(job.host)) {  // page-locked: the device copies directly
        KVS_RETURN_IF_ERROR(stager.Input(&d.host_offsets, job.host_offsets, job.count));
        continue;
      }
      std::vector<uint64_t> host_mirror;
      KVS_ASSIGN_OR_RETURN(
          const uint64_t* host_offsets,
          HostReadable(job.host_offsets, job.count, host_mirror, context, "host_offsets", stream));
      std::vector<uint64_t>& offsets = packed.emplace_back(static_cast<size_t>(job.count));
      for (int64_t r = 0; r < job.count; ++r) {
        if (!CheckedAdd(host_offsets[r], job.row_bytes)) {
          return absl::InvalidArgumentError(
              absl::StrCat(context, ": host_offsets[", r, "] + row_bytes overflows"));
        }
        offsets[r] = bounce_bytes + static_cast<uint64_t>(r) * job.row_bytes;
      }
      const auto bytes = CheckedProduct({job.count, static_cast<int64_t>(job.row_bytes)});
      const auto end = bytes ? CheckedAdd(bounce_bytes, *bytes) : std::nullopt;
      if (!end) return absl::InvalidArgumentError(absl::StrCat(context, ": rows overflow"));
      bounces.push_back(Bounce{device_jobs.size() - 1, job.host, host_offsets, job.count,
                               job.row_bytes, job.to_host, bounce_bytes, std::move(host_mirror)});
      bounces.back().host_offsets =
          bounces.back().mirror.empty() ? host_offsets : bounces.back().mirror.data();
      bounce_bytes = *end;
      d.host_offsets = offsets.data();
      KVS_RETURN_IF_ERROR(stager.Input(&d.host_offsets, offsets.data(), job.count));
    }
    HostBuffers::Buffer buffer;
    bool to_host = false;
    if (bounce_bytes > 0) {
      KVS_ASSIGN_OR_RETURN(buffer, host_buffers_.Take(bounce_bytes));
      if (!buffer.pinned) {  // the device cannot reach it: copy run by run instead
        host_buffers_.Give(buffer);
        return CopyHostRowsByRuns(jobs, stager.queued() ? QueuedStream() : stream);
      }
      stager.Adopt(buffer);
      for (const Bounce& bounce : bounces) {
        device_jobs[bounce.job].host = buffer.data;
        to_host = to_host || bounce.to_host;
        if (bounce.to_host) continue;
        for (int64_t r = 0; r < bounce.count; ++r) {
          std::memcpy(buffer.data + bounce.offset + r * bounce.row_bytes,
                      bounce.host + bounce.host_offsets[r], bounce.row_bytes);
        }
      }
    }
    // Rows that come back to pageable memory are unpacked after the wait, so such a call waits.
    if (to_host) stager.Unqueue();
    KVS_RETURN_IF_ERROR(Run(stager, device_jobs, stream, &Backend::CopyHostRows));
    for (const Bounce& bounce : bounces) {
      if (!bounce.to_host) continue;
      for (int64_t r = 0; r < bounce.count; ++r) {
        std::memcpy(bounce.host + bounce.host_offsets[r],
                    buffer.data + bounce.offset + r * bounce.row_bytes, bounce.row_bytes);
      }
    }
    return absl::OkStatus();
  }

  // CopyHostRows where no page-locked buffer can be had: each run of rows whose arena and host
  // offsets both advance by row_bytes is one DeviceMemory copy.
  absl::Status CopyHostRowsByRuns(absl::Span<const HostRowCopyJob> jobs, Stream stream) {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<HostRowCopyJob> device_jobs;
    device_jobs.reserve(jobs.size());
    std::vector<CopyRun> runs;  // of the jobs copied here, every job validated before any copy
    for (size_t i = 0; i < jobs.size(); ++i) {
      const HostRowCopyJob& job = jobs[i];
      const std::string context = absl::StrCat("host row copy job ", i);
      KVS_RETURN_IF_ERROR(ValidateHostRowCopyJob(job, i));
      if (job.count == 0 || job.row_bytes == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.arena, context, "arena"));
      if (memory_->IsDeviceAccessible(job.host)) {  // page-locked: the device copies
        HostRowCopyJob& d = device_jobs.emplace_back(job);
        KVS_RETURN_IF_ERROR(stager.Input(&d.arena_offsets, job.arena_offsets, job.count));
        KVS_RETURN_IF_ERROR(stager.Input(&d.host_offsets, job.host_offsets, job.count));
        continue;
      }
      std::vector<uint64_t> arena_mirror, host_mirror;
      KVS_ASSIGN_OR_RETURN(const uint64_t* arena_offsets,
                           HostReadable(job.arena_offsets, job.count, arena_mirror, context,
                                        "arena_offsets", stream));
      KVS_ASSIGN_OR_RETURN(
          const uint64_t* host_offsets,
          HostReadable(job.host_offsets, job.count, host_mirror, context, "host_offsets", stream));
      KVS_RETURN_IF_ERROR(PlanRuns(job, arena_offsets, host_offsets, context, runs));
    }
    if (!device_jobs.empty() || runs.empty()) {
      KVS_RETURN_IF_ERROR(Run(stager, device_jobs, stream, &Backend::CopyHostRows));
    }
    for (const CopyRun& run : runs) {
      if (run.to_host) {
        KVS_RETURN_IF_ERROR(memory_->CopyToHost(run.host, run.arena, run.bytes, stream));
      } else {
        KVS_RETURN_IF_ERROR(memory_->CopyToDevice(run.arena, run.host, run.bytes, stream));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<CaoteJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const CaoteJob& job = jobs[i];
      const std::string context = absl::StrCat("caote job ", i);
      CaoteJob host = job;
      std::vector<int32_t> table;
      KVS_ASSIGN_OR_RETURN(host.values.block_table,
                           HostTable(job.values, table, context, "values", stream));
      KVS_RETURN_IF_ERROR(ValidateCaoteJob(host, i));
      if (job.values.count == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.values.arena, context, "values.arena"));
      CaoteJob& d = device_jobs.emplace_back(job);
      KVS_ASSIGN_OR_RETURN(const uint64_t elements,
                           Elements({job.rows, job.values.count}, context, "alpha"));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.values.block_table, job.values.block_table, TableEntries(job.values)));
      KVS_RETURN_IF_ERROR(stager.Input(&d.alpha, job.alpha, elements));
      KVS_RETURN_IF_ERROR(stager.Output(&d.scores, job.scores, elements));
    }
    return Run(stager, device_jobs, stream, &Backend::CaoteScores);
  }

  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<NearestKeyJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const NearestKeyJob& job = jobs[i];
      const std::string context = absl::StrCat("nearest key job ", i);
      NearestKeyJob host = job;
      std::vector<int32_t> table, queries, candidates;
      KVS_ASSIGN_OR_RETURN(host.keys.block_table,
                           HostTable(job.keys, table, context, "keys", stream));
      if (job.num_queries > 0) {
        KVS_ASSIGN_OR_RETURN(host.query_slots,
                             HostReadable(job.query_slots, job.num_queries, queries, context,
                                          "query_slots", stream));
        if (job.num_candidates > 0) {
          KVS_ASSIGN_OR_RETURN(host.candidate_slots,
                               HostReadable(job.candidate_slots, job.num_candidates, candidates,
                                            context, "candidate_slots", stream));
        }
      }
      KVS_RETURN_IF_ERROR(ValidateNearestKeyJob(host, i));
      if (job.num_queries == 0) continue;
      KVS_RETURN_IF_ERROR(CheckArena(job.keys.arena, context, "keys.arena"));
      NearestKeyJob& d = device_jobs.emplace_back(job);
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.keys.block_table, job.keys.block_table, TableEntries(job.keys)));
      KVS_RETURN_IF_ERROR(stager.Input(&d.query_slots, job.query_slots, job.num_queries));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.candidate_slots, job.candidate_slots, job.num_candidates));
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.candidate_positions, job.candidate_positions, job.num_candidates));
      KVS_RETURN_IF_ERROR(stager.Output(&d.similarity, job.similarity, job.num_queries));
      KVS_RETURN_IF_ERROR(stager.Output(&d.target, job.target, job.num_queries));
    }
    return Run(stager, device_jobs, stream, &Backend::NearestKeys);
  }

  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<RowMergeJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const RowMergeJob& job = jobs[i];
      const std::string context = absl::StrCat("row merge job ", i);
      RowMergeJob host = job;
      std::vector<int64_t> starts;
      std::vector<uint64_t> dst, src;
      int64_t sources = 0;
      if (job.rows > 0 && job.rows <= kMaxRowMergeRows) {  // else the validator refuses it
        KVS_ASSIGN_OR_RETURN(host.source_starts,
                             HostReadable(job.source_starts, job.rows + 1, starts, context,
                                          "source_starts", stream));
        KVS_ASSIGN_OR_RETURN(host.dst_offsets, HostReadable(job.dst_offsets, job.rows, dst, context,
                                                            "dst_offsets", stream));
        // The validator checks that the starts rise from 0; the count it implies is read here
        // only to mirror the sources for it.
        sources =
            host.source_starts == nullptr ? 0 : std::max<int64_t>(host.source_starts[job.rows], 0);
        KVS_ASSIGN_OR_RETURN(host.src_offsets, HostReadable(job.src_offsets, sources, src, context,
                                                            "src_offsets", stream));
      }
      KVS_RETURN_IF_ERROR(ValidateRowMergeJob(host, i));
      if (job.rows == 0) continue;  // nothing is read or written
      KVS_RETURN_IF_ERROR(CheckArena(job.arena, context, "arena"));
      RowMergeJob& d = device_jobs.emplace_back(job);
      KVS_RETURN_IF_ERROR(stager.Input(&d.dst_offsets, job.dst_offsets, job.rows));
      KVS_RETURN_IF_ERROR(stager.Input(&d.source_starts, job.source_starts, job.rows + 1));
      KVS_RETURN_IF_ERROR(stager.Input(&d.src_offsets, job.src_offsets, sources));
      KVS_RETURN_IF_ERROR(stager.Input(&d.weights, job.weights, sources));
    }
    return Run(stager, device_jobs, stream, &Backend::MergeRows);
  }

  absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                           Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<DecodeEvictJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const DecodeEvictJob& job = jobs[i];
      const std::string context = absl::StrCat("decode evict job ", i);
      DecodeEvictJob host = job;
      std::vector<int32_t> table;
      KVS_ASSIGN_OR_RETURN(host.keys.block_table,
                           HostTable(job.keys, table, context, "keys", stream));
      KVS_RETURN_IF_ERROR(ValidateDecodeEvictJob(host, i));
      KVS_RETURN_IF_ERROR(CheckArena(job.keys.arena, context, "keys.arena"));
      // The tables a job updates in place stay on the device between steps (a device path keeps
      // them there); only what one step reads or returns is staged.
      KVS_RETURN_IF_ERROR(CheckArena(job.positions, context, "positions"));
      if (job.accumulated != nullptr) {
        KVS_RETURN_IF_ERROR(CheckArena(job.accumulated, context, "accumulated"));
      }
      DecodeEvictJob& d = device_jobs.emplace_back(job);
      const int64_t heads = job.keys.num_kv_heads;
      const int64_t count = job.keys.count;
      KVS_RETURN_IF_ERROR(
          stager.Input(&d.keys.block_table, job.keys.block_table, TableEntries(job.keys)));
      if (job.sums != nullptr) {
        KVS_ASSIGN_OR_RETURN(const uint64_t sums,
                             Elements({job.num_q_heads, count}, context, "sums"));
        KVS_RETURN_IF_ERROR(stager.Input(&d.sums, job.sums, sums));
      }
      if (job.scores == DecodeScores::kRows) {
        KVS_ASSIGN_OR_RETURN(const uint64_t rows,
                             Elements({job.rows_count, count}, context, "rows"));
        KVS_RETURN_IF_ERROR(stager.Input(&d.rows, job.rows, rows));
      }
      KVS_RETURN_IF_ERROR(stager.Input(&d.queries, job.queries, job.query_values));
      if (stage == DecodeStage::kChoose) {
        KVS_RETURN_IF_ERROR(stager.Output(&d.evicted, job.evicted, heads));
      } else {
        KVS_RETURN_IF_ERROR(stager.Input(&d.evicted, job.evicted, heads));
      }
    }
    return Launch(stager, device_jobs, stream,
                  [&](absl::Span<const DecodeEvictJob> some, Stream s) {
                    return device_->DecodeEvict(some, stage, s);
                  });
  }

  // Device memory from DeviceMemory, kept until the buffer is destroyed.
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(uint64_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("AllocateBuffer of 0 bytes");
    KVS_ASSIGN_OR_RETURN(void* p, memory_->Allocate(bytes));
    return std::unique_ptr<DeviceBuffer>(
        new StagedBuffer(*memory_, static_cast<uint8_t*>(p), bytes));
  }
  absl::Status WriteBuffer(DeviceBuffer& buffer, uint64_t offset, const void* source,
                           uint64_t bytes) override {
    KVS_RETURN_IF_ERROR(CheckBuffer(buffer, offset, bytes, source, "write"));
    if (bytes == 0) return absl::OkStatus();
    return memory_->CopyToDevice(buffer.data() + offset, source, bytes, nullptr);
  }
  absl::Status ReadBuffer(const DeviceBuffer& buffer, uint64_t offset, void* destination,
                          uint64_t bytes) override {
    KVS_RETURN_IF_ERROR(CheckBuffer(buffer, offset, bytes, destination, "read"));
    if (bytes == 0) return absl::OkStatus();
    const absl::Status read =
        memory_->CopyToHost(destination, buffer.data() + offset, bytes, nullptr);
    ReleaseHeld();  // the copy waited for this thread's queued calls
    return read;
  }

  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream stream) override {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<FiniteCheckJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const FiniteCheckJob& job = jobs[i];
      KVS_RETURN_IF_ERROR(ValidateFiniteCheckJob(job, i));
      if (job.count == 0 || job.row_elements == 0) {
        *job.first_non_finite = -1;  // nothing to read: answered here
        continue;
      }
      KVS_RETURN_IF_ERROR(CheckArena(job.arena, absl::StrCat("finite check job ", i), "arena"));
      FiniteCheckJob& d = device_jobs.emplace_back(job);
      KVS_RETURN_IF_ERROR(stager.Input(&d.row_offsets, job.row_offsets, job.count));
      KVS_RETURN_IF_ERROR(stager.Output(&d.first_non_finite, job.first_non_finite, 1));
      if (job.row_norms != nullptr) {
        KVS_RETURN_IF_ERROR(stager.Output(&d.row_norms, job.row_norms, job.count));
      }
    }
    return Run(stager, device_jobs, stream, &Backend::FindNonFinite);
  }

 private:
  // A DeviceBuffer in DeviceMemory.
  class StagedBuffer final : public DeviceBuffer {
   public:
    StagedBuffer(DeviceMemory& memory, uint8_t* data, uint64_t size)
        : memory_(memory), data_(data), size_(size) {}
    ~StagedBuffer() override { memory_.Free(data_); }
    uint8_t* data() const override { return data_; }
    uint64_t size() const override { return size_; }

   private:
    DeviceMemory& memory_;
    uint8_t* const data_;
    const uint64_t size_;
  };

  static absl::Status CheckBuffer(const DeviceBuffer& buffer, uint64_t offset, uint64_t bytes,
                                  const void* host, const char* op) {
    if (offset > buffer.size() || bytes > buffer.size() - offset) {
      return absl::OutOfRangeError(absl::StrCat("buffer ", op, " of ", bytes, " bytes at offset ",
                                                offset, " leaves the buffer of ", buffer.size(),
                                                " bytes"));
    }
    if (bytes > 0 && host == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", op, ": null host pointer"));
    }
    return absl::OkStatus();
  }

  // A host row copy job whose pageable host rows go through the call's bounce buffer.
  struct Bounce {
    size_t job;                    // index into the device jobs
    uint8_t* host;                 // the caller's buffer
    const uint64_t* host_offsets;  // its rows (the caller's array, or `mirror`)
    int64_t count;
    uint64_t row_bytes;
    bool to_host;
    uint64_t offset;  // of its first row in the bounce buffer
    std::vector<uint64_t> mirror;
  };

  // One run of rows of a host row copy done here: `bytes` between `arena` and `host`.
  struct CopyRun {
    uint8_t* arena;
    uint8_t* host;
    uint64_t bytes;
    bool to_host;
  };

  template <typename Job>
  using Method = absl::Status (Backend::*)(absl::Span<const Job>, Stream);

  // Uploads, runs the device on `device_jobs` and waits once: the download of the outputs (a
  // synchronous copy, ordered after the call's work), or a synchronisation when the call has no
  // outputs. With no jobs the device is still asked (an unhealthy device refuses even an empty
  // call) but nothing is staged.
  // With the trace on (TraceOn) one line per staged call goes to stderr: the job type (its
  // mangled name), the job count, the bytes up and down, and the microseconds spent planning
  // (validation included), uploading, launching, and waiting for the device and the download. It
  // is how a device run tells the staging layer's cost from the kernels' (no profiler is needed).
  template <typename Job>
  absl::Status Run(Stager& stager, const std::vector<Job>& device_jobs, Stream stream,
                   Method<Job> method) {
    return Launch(stager, device_jobs, stream, [&](absl::Span<const Job> jobs, Stream s) {
      return (device_.get()->*method)(jobs, s);
    });
  }
  template <typename Job, typename Call>
  absl::Status Launch(Stager& stager, const std::vector<Job>& device_jobs, Stream stream,
                      const Call& call) {
    if (device_jobs.empty()) return call({}, stream);
    const TraceClock::time_point planned = TraceNow();
    KVS_RETURN_IF_ERROR(stager.Upload(stream));
    const TraceClock::time_point uploaded = TraceNow();
    const absl::Status status = call(device_jobs, stream);
    const TraceClock::time_point launched = TraceNow();
    if (status.ok() && stager.queued() && stager.out_bytes() == 0) {
      // Nothing comes back: the buffers stay until this thread's next wait, which covers the call.
      Trace<Job>(stager, device_jobs.size(), planned, uploaded, launched, /*queued=*/true);
      Hold(stager.Detach());
      return absl::OkStatus();
    }
    // Always wait before the staging buffers go back: a call that failed midway may have queued
    // work reading them.
    const absl::Status waited = status.ok() && stager.out_bytes() > 0
                                    ? stager.Download(stream)
                                    : device_->Synchronize(stream);
    ReleaseHeld();  // this thread's queued calls ran before the wait
    Trace<Job>(stager, device_jobs.size(), planned, uploaded, launched, /*queued=*/false);
    KVS_RETURN_IF_ERROR(status);
    return waited;
  }

  // One trace line for a staged call (TraceOn): a queued call's wait is a later call's.
  template <typename Job>
  static void Trace(const Stager& stager, size_t jobs, TraceClock::time_point planned,
                    TraceClock::time_point uploaded, TraceClock::time_point launched, bool queued) {
    if (!TraceOn()) return;
    const auto us = [](TraceClock::time_point a, TraceClock::time_point b) {
      return static_cast<long long>(
          std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
    };
    std::fprintf(stderr,
                 "staging %s jobs=%zu up=%llu down=%llu plan_us=%lld upload_us=%lld "
                 "launch_us=%lld wait_download_us=%lld queued=%d\n",
                 typeid(Job).name(), jobs, static_cast<unsigned long long>(stager.in_bytes()),
                 static_cast<unsigned long long>(stager.out_bytes()), us(stager.created(), planned),
                 us(planned, uploaded), us(uploaded, launched),
                 queued ? 0LL : us(launched, TraceClock::now()), queued ? 1 : 0);
  }

  absl::Status Attention(absl::Span<const AttentionJob> jobs, Stream stream,
                         Method<AttentionJob> method) {
    Stager stager(*memory_, host_buffers_, stream);
    stream = stager.stream();
    std::vector<AttentionJob> device_jobs;
    device_jobs.reserve(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const AttentionJob& job = jobs[i];
      const std::string context = absl::StrCat("attention job ", i);
      AttentionJob host = job;
      std::vector<int32_t> table;
      KVS_ASSIGN_OR_RETURN(host.keys.block_table,
                           HostTable(job.keys, table, context, "keys", stream));
      KVS_RETURN_IF_ERROR(ValidateAttentionJob(host, i));
      if (job.keys.count == 0) continue;  // nothing is read or written
      KVS_RETURN_IF_ERROR(CheckArena(job.keys.arena, context, "keys.arena"));
      AttentionJob& d = device_jobs.emplace_back(job);
      const PagedLayerView& v = job.keys;
      KVS_ASSIGN_OR_RETURN(
          const uint64_t key_positions,
          Elements({v.num_kv_heads, KeyPositionsOffset(job, 1)}, context, "key_positions"));
      KVS_ASSIGN_OR_RETURN(
          const uint64_t queries,
          Elements({job.num_q_heads, job.num_queries, v.head_dim}, context, "queries"));
      KVS_ASSIGN_OR_RETURN(const uint64_t probs,
                           Elements({job.num_q_heads, job.num_queries, v.count}, context, "probs"));
      KVS_RETURN_IF_ERROR(stager.Input(&d.keys.block_table, v.block_table, TableEntries(v)));
      KVS_RETURN_IF_ERROR(stager.Input(&d.key_positions, job.key_positions, key_positions));
      KVS_RETURN_IF_ERROR(stager.Input(&d.queries, job.queries, queries));
      KVS_RETURN_IF_ERROR(stager.Input(&d.query_positions, job.query_positions, job.num_queries));
      KVS_RETURN_IF_ERROR(stager.Output(&d.probs, job.probs, probs));
    }
    return Run(stager, device_jobs, stream, method);
  }

  absl::Status CheckArena(const void* arena, absl::string_view context,
                          absl::string_view field) const {
    if (memory_->IsDeviceAccessible(arena)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", field, " is not device memory"));
  }

  // `p` itself when the host can read it (host memory, null, nothing to read); otherwise a
  // mirror of its `n` elements in `storage`, so that a validator can read device-resident arrays.
  template <typename T>
  absl::StatusOr<const T*> HostReadable(const T* p, int64_t n, std::vector<T>& storage,
                                        absl::string_view context, absl::string_view field,
                                        Stream stream) const {
    if (p == nullptr || n <= 0 || !memory_->IsDeviceAccessible(p)) return p;
    if (static_cast<uint64_t>(n) > kMaxMirrorBytes / sizeof(T)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": ", field, " of ", n, " elements is too large to validate"));
    }
    storage.resize(static_cast<size_t>(n));
    KVS_RETURN_IF_ERROR(memory_->CopyToHost(storage.data(), p, n * sizeof(T), stream));
    return static_cast<const T*>(storage.data());
  }

  absl::StatusOr<const int32_t*> HostTable(const PagedLayerView& view,
                                           std::vector<int32_t>& storage, absl::string_view context,
                                           absl::string_view field, Stream stream) const {
    return HostReadable(view.block_table, TableEntries(view), storage, context,
                        absl::StrCat(field, ".block_table"), stream);
  }

  // Appends the runs of a validated host row copy job, coalescing rows whose arena and host
  // offsets both advance by row_bytes. INVALID_ARGUMENT when an offset + length overflows.
  static absl::Status PlanRuns(const HostRowCopyJob& job, const uint64_t* arena_offsets,
                               const uint64_t* host_offsets, absl::string_view context,
                               std::vector<CopyRun>& runs) {
    for (int64_t r = 0; r < job.count; ++r) {
      if (!CheckedAdd(arena_offsets[r], job.row_bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": arena_offsets[", r, "] + row_bytes overflows"));
      }
      if (!CheckedAdd(host_offsets[r], job.row_bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": host_offsets[", r, "] + row_bytes overflows"));
      }
      if (r > 0 && arena_offsets[r] == arena_offsets[r - 1] + job.row_bytes &&
          host_offsets[r] == host_offsets[r - 1] + job.row_bytes) {
        runs.back().bytes += job.row_bytes;  // contiguous in both: cannot overflow either side
        continue;
      }
      runs.push_back(CopyRun{job.arena + arena_offsets[r], job.host + host_offsets[r],
                             job.row_bytes, job.to_host});
    }
    return absl::OkStatus();
  }

  // The resources of this thread's queued calls, released after its next wait.
  void Hold(Stager::Held held) {
    absl::MutexLock lock(&held_mu_);
    held_[std::this_thread::get_id()].push_back(std::move(held));
  }
  bool HoldsQueued() {
    absl::MutexLock lock(&held_mu_);
    const auto it = held_.find(std::this_thread::get_id());
    return it != held_.end() && !it->second.empty();
  }
  void ReleaseHeld() {
    std::vector<Stager::Held> held;
    {
      absl::MutexLock lock(&held_mu_);
      const auto it = held_.find(std::this_thread::get_id());
      if (it == held_.end()) return;
      held = std::move(it->second);
      held_.erase(it);
    }
    for (const Stager::Held& h : held) {
      memory_->Free(h.device);
      for (const HostBuffers::Buffer& buffer : h.host) host_buffers_.Give(buffer);
    }
  }

  const std::unique_ptr<Backend> device_;
  const std::unique_ptr<DeviceMemory> memory_;
  HostBuffers host_buffers_;  // after device_: unpinned before the device goes
  absl::Mutex held_mu_;
  std::unordered_map<std::thread::id, std::vector<Stager::Held>> held_ ABSL_GUARDED_BY(held_mu_);
};

}  // namespace

std::unique_ptr<Backend> MakeStagingBackend(std::unique_ptr<Backend> device,
                                            std::unique_ptr<DeviceMemory> memory) {
  return std::make_unique<StagingBackend>(std::move(device), std::move(memory));
}

}  // namespace kvs
