// The simulated device (gpu/sim/simulated_device.h): PROT_NONE address ranges standing for
// device memory, translated to real memory inside the kernels and copies only.
#include "gpu/sim/simulated_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "gpu/device_counters.h"

namespace kvs {
namespace {

constexpr uint64_t kScratchAlignment = 256;
// The scratch cache: at most this many freed buffers of at most this size are kept for reuse.
constexpr size_t kMaxCachedScratch = 8;
constexpr uint64_t kMaxCachedScratchBytes = uint64_t{16} << 20;

uint64_t AlignUp(uint64_t n) { return (n + kScratchAlignment - 1) & ~(kScratchAlignment - 1); }

// Bytes of an array of `factors` elements of `element_bytes`, or 0 ("check the base address
// only") when the shape is not sane; the validators of the CPU kernels reject such shapes.
uint64_t Extent(std::initializer_list<int64_t> factors, uint64_t element_bytes) {
  const auto elements = CheckedProduct(factors);
  if (!elements) return 0;
  const auto bytes =
      CheckedProduct({static_cast<int64_t>(*elements), static_cast<int64_t>(element_bytes)});
  return bytes && static_cast<int64_t>(*elements) >= 0 ? *bytes : 0;
}

class SimState final : public SimulatedDeviceControl {
 public:
  ~SimState() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Cached& cached : cache_) ReleaseLocked(cached.fake);
  }

  // Reserves a PROT_NONE range of `bytes` standing for the real memory at `real`. `scratch`
  // ranges own their real memory (freed by Release).
  absl::StatusOr<uint8_t*> Map(uint8_t* real, uint64_t bytes, bool scratch) {
    void* fake =
        mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (fake == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("simulated device: cannot reserve ", bytes,
                       " bytes of address space: ", std::strerror(errno)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    regions_[reinterpret_cast<uintptr_t>(fake)] = Region{bytes, real, scratch};
    return static_cast<uint8_t*>(fake);
  }

  void Unmap(uint8_t* fake) {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseLocked(fake);
  }

  // The real address of [p, p + bytes) when it lies inside one simulated allocation.
  uint8_t* Real(const void* p, uint64_t bytes) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Region* region = nullptr;
    const uint64_t offset = FindLocked(p, &region);
    if (region == nullptr || bytes > region->size - offset) return nullptr;
    return region->real + offset;
  }

  bool InAllocation(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Region* region = nullptr;
    FindLocked(p, &region);
    return region != nullptr && p != nullptr;
  }

  // True when [p, p + bytes) lies inside one registered page-locked host range.
  bool Pinned(const void* p, uint64_t bytes) const {
    if (p == nullptr) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    auto it = pinned_.upper_bound(address);
    if (it == pinned_.begin()) return false;
    --it;
    const uint64_t offset = address - it->first;
    return offset < it->second && bytes <= it->second - offset;
  }

  // Scratch: reuses a cached range when one fits, else reserves a new one.
  absl::StatusOr<void*> AllocateScratch(uint64_t bytes) {
    if (bytes == 0) return absl::InvalidArgumentError("simulated device: Allocate of 0 bytes");
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = cache_.end();
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        if (it->size >= bytes && (best == cache_.end() || it->size < best->size)) best = it;
      }
      if (best != cache_.end()) {
        uint8_t* fake = best->fake;
        cache_.erase(best);
        allocate_calls_.fetch_add(1);
        live_scratch_.fetch_add(1);
        return static_cast<void*>(fake);
      }
    }
    const uint64_t size = AlignUp(bytes);
    if (size < bytes) return absl::ResourceExhaustedError("simulated device: size overflows");
    auto* real = static_cast<uint8_t*>(std::aligned_alloc(kScratchAlignment, size));
    if (real == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("simulated device: out of memory allocating ", bytes, " bytes"));
    }
    auto fake = Map(real, size, /*scratch=*/true);
    if (!fake.ok()) {
      std::free(real);
      return fake.status();
    }
    allocate_calls_.fetch_add(1);
    reservations_.fetch_add(1);
    live_scratch_.fetch_add(1);
    return static_cast<void*>(*fake);
  }

  void FreeScratch(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(p));
    if (it == regions_.end() || !it->second.scratch) return;  // not ours: nothing to do
    free_calls_.fetch_add(1);
    live_scratch_.fetch_sub(1);
    if (cache_.size() < kMaxCachedScratch && it->second.size <= kMaxCachedScratchBytes) {
      cache_.push_back(Cached{static_cast<uint8_t*>(p), it->second.size});
      return;
    }
    ReleaseLocked(static_cast<uint8_t*>(p));
  }

  void CountCopy(bool to_device, uint64_t bytes) {
    if (to_device) {
      copies_to_device_.fetch_add(1);
      bytes_to_device_.fetch_add(bytes);
    } else {
      copies_to_host_.fetch_add(1);
      bytes_to_host_.fetch_add(bytes);
    }
  }

  SimulatedDeviceStats stats() const override {
    SimulatedDeviceStats s;
    s.allocate_calls = allocate_calls_.load();
    s.reservations = reservations_.load();
    s.free_calls = free_calls_.load();
    s.copies_to_device = copies_to_device_.load();
    s.copies_to_host = copies_to_host_.load();
    s.bytes_to_device = bytes_to_device_.load();
    s.bytes_to_host = bytes_to_host_.load();
    s.live_scratch = live_scratch_.load();
    return s;
  }

  void RegisterPageLocked(const void* p, uint64_t bytes) override {
    if (p == nullptr || bytes == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[reinterpret_cast<uintptr_t>(p)] = bytes;
  }

  void UnregisterPageLocked(const void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    pinned_.erase(reinterpret_cast<uintptr_t>(p));
  }

 private:
  struct Region {
    uint64_t size;
    uint8_t* real;
    bool scratch;
  };
  struct Cached {
    uint8_t* fake;
    uint64_t size;
  };

  // Offset of `p` in its region (set in *region), or *region = nullptr.
  uint64_t FindLocked(const void* p, const Region** region) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *region = nullptr;
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    auto it = regions_.upper_bound(address);
    if (it == regions_.begin()) return 0;
    --it;
    const uint64_t offset = address - it->first;
    if (offset >= it->second.size) return 0;
    *region = &it->second;
    return offset;
  }

  void ReleaseLocked(uint8_t* fake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = regions_.find(reinterpret_cast<uintptr_t>(fake));
    if (it == regions_.end()) return;
    munmap(fake, it->second.size);
    if (it->second.scratch) std::free(it->second.real);
    regions_.erase(it);
  }

  // std::mutex rather than absl::Mutex: the distribution's Abseil is not built with TSan
  // instrumentation, so TSan would not see absl::Mutex's ordering.
  mutable std::mutex mu_;
  std::map<uintptr_t, Region> regions_ ABSL_GUARDED_BY(mu_);  // by fake base address
  std::map<uintptr_t, uint64_t> pinned_ ABSL_GUARDED_BY(mu_);
  std::vector<Cached> cache_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> allocate_calls_{0}, reservations_{0}, free_calls_{0};
  std::atomic<uint64_t> copies_to_device_{0}, copies_to_host_{0};
  std::atomic<uint64_t> bytes_to_device_{0}, bytes_to_host_{0}, live_scratch_{0};
};

// ---------------------------------------------------------------------------------------------

class SimMemory final : public DeviceMemory {
 public:
  explicit SimMemory(std::shared_ptr<SimState> state) : state_(std::move(state)) {}

  bool IsDeviceAccessible(const void* p) const override {
    return state_->InAllocation(p) || state_->Pinned(p, 0);
  }

  absl::StatusOr<void*> Allocate(uint64_t bytes) override { return state_->AllocateScratch(bytes); }
  void Free(void* p) override { state_->FreeScratch(p); }

  absl::Status CopyToDevice(void* dst, const void* host_src, uint64_t bytes, Stream) override {
    return Copy(dst, host_src, bytes, /*to_device=*/true);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, uint64_t bytes, Stream) override {
    return Copy(host_dst, src, bytes, /*to_device=*/false);
  }
  // Done at once, as every simulated copy is, but counted as CUDA's is: a transfer, no wait.
  absl::Status CopyToDeviceAsync(void* dst, const void* host_src, uint64_t bytes, Stream) override {
    return Copy(dst, host_src, bytes, /*to_device=*/true, /*waits=*/false);
  }

 private:
  // Like cudaMemcpyDefault: either side may be simulated memory (translated) or host memory;
  // the device side must be simulated or page-locked.
  absl::Status Copy(void* dst, const void* src, uint64_t bytes, bool to_device, bool waits = true) {
    if (bytes == 0) return absl::OkStatus();
    const char* op = to_device ? "CopyToDevice" : "CopyToHost";
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("simulated device ", op, ": null pointer"));
    }
    const void* device_side = to_device ? static_cast<const void*>(dst) : src;
    uint8_t* real_dst = state_->Real(dst, bytes);
    const uint8_t* real_src = state_->Real(src, bytes);
    const bool device_ok =
        (to_device ? real_dst : real_src) != nullptr || state_->Pinned(device_side, bytes);
    if (!device_ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "simulated device ", op, ": ", bytes, " bytes at ", to_device ? "destination" : "source",
          " are not inside one device allocation"));
    }
    // The host side must not be a partial or out-of-range simulated range either.
    if (real_dst == nullptr && state_->InAllocation(dst)) {
      return absl::InvalidArgumentError(absl::StrCat("simulated device ", op, ": ", bytes,
                                                     " bytes at destination leave its allocation"));
    }
    if (real_src == nullptr && state_->InAllocation(src)) {
      return absl::InvalidArgumentError(absl::StrCat("simulated device ", op, ": ", bytes,
                                                     " bytes at source leave its allocation"));
    }
    std::memmove(real_dst != nullptr ? real_dst : static_cast<uint8_t*>(dst),
                 real_src != nullptr ? real_src : static_cast<const uint8_t*>(src), bytes);
    state_->CountCopy(to_device, bytes);
    // Counted as CUDA's copies: a synchronous one is cudaMemcpyAsync + cudaStreamSynchronize.
    if (to_device) {
      DeviceCounters::Upload(bytes);
    } else {
      DeviceCounters::Download(bytes);
    }
    if (waits) DeviceCounters::Sync();
    return absl::OkStatus();
  }

  const std::shared_ptr<SimState> state_;
};

// ---------------------------------------------------------------------------------------------

// The CPU backend's shm arena seen through a PROT_NONE range: data() faults on the host.
class SimArena final : public Arena {
 public:
  SimArena(std::shared_ptr<SimState> state, std::unique_ptr<Arena> inner, uint8_t* fake)
      : state_(std::move(state)), inner_(std::move(inner)), fake_(fake) {}
  ~SimArena() override { state_->Unmap(fake_); }

  uint8_t* data() override { return fake_; }
  const uint8_t* data() const override { return fake_; }
  uint64_t size_bytes() const override { return inner_->size_bytes(); }
  const ArenaHandle& handle() const override { return inner_->handle(); }
  // Counted as the CUDA arena's copies are: a transfer and a wait each (the inner shm arena
  // counts the arena write or read itself).
  absl::Status Write(uint64_t offset, const void* source, uint64_t bytes) override {
    DeviceCounters::Upload(bytes);
    DeviceCounters::Sync();
    return inner_->Write(offset, source, bytes);
  }
  absl::Status Read(uint64_t offset, void* destination, uint64_t bytes) const override {
    DeviceCounters::Download(bytes);
    DeviceCounters::Sync();
    return inner_->Read(offset, destination, bytes);
  }
  // The worker maps the host arena behind the simulated device memory, as with the CPU backend.
  absl::StatusOr<int> DuplicateFd() const override { return inner_->DuplicateFd(); }

 private:
  const std::shared_ptr<SimState> state_;
  const std::unique_ptr<Arena> inner_;
  uint8_t* const fake_;
};

// Rewrites the pointers of one job to real addresses, naming the job and field on failure.
class Translator {
 public:
  Translator(const SimState& state, std::string context)
      : state_(state), context_(std::move(context)) {}

  // `p` (null stays null) must lie in a simulated allocation with `bytes` after it (0: the base
  // only), or in registered page-locked host memory.
  template <typename T>
  absl::Status operator()(T*& p, uint64_t bytes, absl::string_view field) const {
    if (p == nullptr) return absl::OkStatus();
    const void* address = static_cast<const void*>(p);
    if (uint8_t* real = state_.Real(address, bytes); real != nullptr) {
      p = reinterpret_cast<T*>(real);
      return absl::OkStatus();
    }
    if (!state_.InAllocation(address) && state_.Pinned(address, bytes)) return absl::OkStatus();
    if (state_.InAllocation(address)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context_, ": ", field, " (", bytes, " bytes) leaves its device allocation"));
    }
    return absl::InvalidArgumentError(absl::StrCat(context_, ": ", field, " is not device memory"));
  }

  absl::Status View(PagedLayerView& view, absl::string_view field) const {
    KVS_RETURN_IF_ERROR((*this)(view.arena, 0, absl::StrCat(field, ".arena")));
    const uint64_t blocks =
        view.count > 0 && view.block_tokens >= 1
            ? (static_cast<uint64_t>(view.count) + view.block_tokens - 1) / view.block_tokens
            : 0;
    return (*this)(view.block_table, blocks * sizeof(int32_t), absl::StrCat(field, ".block_table"));
  }

  // HostRowCopyJob::host: registered page-locked host memory, never a device range.
  absl::Status Host(uint8_t* p) const {
    if (p == nullptr || state_.Pinned(p, 0)) return absl::OkStatus();
    if (state_.InAllocation(p)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context_, ": host is device memory; it must be page-locked host memory"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(context_, ": host is not page-locked host memory"));
  }

 private:
  const SimState& state_;
  const std::string context_;
};

class SimBackend final : public Backend {
 public:
  SimBackend(std::shared_ptr<SimState> state, int num_threads)
      : state_(std::move(state)), cpu_(MakeCpuBackend(num_threads)) {
    if (const char* fault = std::getenv("KVS_DEVICE_SIM_FAULT_FILE")) fault_file_ = fault;
  }

  std::string_view name() const override { return "device-sim"; }
  // As cudaHostRegister on CUDA: the range becomes page-locked host memory (device-accessible,
  // valid as HostRowCopyJob::host), so the spill buffers and the staging buffers take the paths
  // they take on a GPU.
  bool PinHostMemory(void* p, uint64_t bytes) override {
    if (p == nullptr || bytes == 0) return false;
    state_->RegisterPageLocked(p, bytes);
    return true;
  }
  void UnpinHostMemory(void* p) override { state_->UnregisterPageLocked(p); }
  // A real device turns unhealthy after a sticky error; the simulated one while its fault file
  // exists, so that tests can watch health reporting through the real server.
  bool healthy() const override {
    return fault_file_.empty() || access(fault_file_.c_str(), F_OK) != 0;
  }

  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<Arena> inner, cpu_->CreateArena(bytes, options));
    KVS_ASSIGN_OR_RETURN(uint8_t * fake,
                         state_->Map(inner->data(), inner->size_bytes(), /*scratch=*/false));
    return std::unique_ptr<Arena>(new SimArena(state_, std::move(inner), fake));
  }

  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) override {
    std::vector<KeyDiffScoreJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      KeyDiffScoreJob& j = real[i];
      const Translator t(*state_, absl::StrCat("keydiff job ", i));
      KVS_RETURN_IF_ERROR(t.View(j.keys, "keys"));
      KVS_RETURN_IF_ERROR(t(j.scores, Extent({j.keys.num_kv_heads, j.keys.count}, 4), "scores"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->KeyDiffScores(real, stream);
  }

  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) override {
    std::vector<TopKJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      TopKJob& j = real[i];
      const Translator t(*state_, absl::StrCat("top-k job ", i));
      KVS_RETURN_IF_ERROR(t(j.scores, Extent({j.rows, j.n}, 4), "scores"));
      KVS_RETURN_IF_ERROR(t(j.positions, Extent({j.rows, j.n}, 4), "positions"));
      KVS_RETURN_IF_ERROR(t(j.forced, Extent({j.rows, j.n}, 1), "forced"));
      KVS_RETURN_IF_ERROR(t(j.kept, Extent({j.rows, j.k}, 4), "kept"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->TopK(real, stream);
  }

  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) override {
    std::vector<RowCopyJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      RowCopyJob& j = real[i];
      const Translator t(*state_, absl::StrCat("row copy job ", i));
      KVS_RETURN_IF_ERROR(t(j.arena, 0, "arena"));
      KVS_RETURN_IF_ERROR(t(j.src_offsets, Extent({j.count}, 8), "src_offsets"));
      KVS_RETURN_IF_ERROR(t(j.dst_offsets, Extent({j.count}, 8), "dst_offsets"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->CopyRows(real, stream);
  }

  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream stream) override {
    KVS_ASSIGN_OR_RETURN(std::vector<AttentionJob> real, TranslateAttention(jobs));
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->AttentionProbs(real, stream);
  }
  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream stream) override {
    std::vector<PoolJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      PoolJob& j = real[i];
      const Translator t(*state_, absl::StrCat("pool job ", i));
      KVS_RETURN_IF_ERROR(t(j.in, Extent({j.rows, j.count}, 4), "in"));
      KVS_RETURN_IF_ERROR(t(j.order, Extent({j.num_kv_heads, j.count}, 4), "order"));
      KVS_RETURN_IF_ERROR(t(j.lengths, Extent({j.num_kv_heads}, 4), "lengths"));
      KVS_RETURN_IF_ERROR(t(j.out, Extent({j.rows, j.count}, 4), "out"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->PoolScores(real, stream);
  }
  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs,
                                    Stream stream) override {
    std::vector<WindowVarianceJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      WindowVarianceJob& j = real[i];
      const Translator t(*state_, absl::StrCat("window variance job ", i));
      KVS_RETURN_IF_ERROR(t(j.probs, Extent({j.num_q_heads, j.num_queries, j.count}, 4), "probs"));
      KVS_RETURN_IF_ERROR(t(j.scores, Extent({j.num_q_heads, j.count}, 4), "scores"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->WindowVarianceScores(real, stream);
  }
  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream stream) override {
    std::vector<WindowEntropyJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      WindowEntropyJob& j = real[i];
      const Translator t(*state_, absl::StrCat("window entropy job ", i));
      KVS_RETURN_IF_ERROR(t(j.probs, Extent({j.num_q_heads, j.num_queries, j.count}, 4), "probs"));
      KVS_RETURN_IF_ERROR(
          t(j.key_positions, Extent({j.num_kv_heads, j.count}, 4), "key_positions"));
      KVS_RETURN_IF_ERROR(t(j.entropy, Extent({1}, 8), "entropy"));
      KVS_RETURN_IF_ERROR(t(j.shift, Extent({1}, 8), "shift"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->WindowEntropyShift(real, stream);
  }
  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs,
                                   Stream stream) override {
    std::vector<AttentionSumsJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      AttentionJob& a = real[i].attention;
      const PagedLayerView& v = a.keys;
      const Translator t(*state_, absl::StrCat("attention job ", i));
      KVS_RETURN_IF_ERROR(t(a.key_positions, Extent({v.num_kv_heads, KeyPositionsOffset(a, 1)}, 4),
                            "key_positions"));
      KVS_RETURN_IF_ERROR(
          t(a.queries, Extent({a.num_q_heads, a.num_queries, v.head_dim}, 4), "queries"));
      KVS_RETURN_IF_ERROR(t(a.query_positions, Extent({a.num_queries}, 4), "query_positions"));
      KVS_RETURN_IF_ERROR(t(real[i].sums, Extent({a.num_q_heads, v.count}, 4), "sums"));
      KVS_RETURN_IF_ERROR(t.View(a.keys, "keys"));
      a.probs = nullptr;  // not used by the sums
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->AttentionColumnSums(real, stream);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream stream) override {
    KVS_ASSIGN_OR_RETURN(std::vector<AttentionJob> real, TranslateAttention(jobs));
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->AttentionLogits(real, stream);
  }

  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream stream) override {
    std::vector<HostRowCopyJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      HostRowCopyJob& j = real[i];
      const Translator t(*state_, absl::StrCat("host row copy job ", i));
      KVS_RETURN_IF_ERROR(t(j.arena, 0, "arena"));
      KVS_RETURN_IF_ERROR(t.Host(j.host));  // page-locked host memory: used as it is
      KVS_RETURN_IF_ERROR(t(j.arena_offsets, Extent({j.count}, 8), "arena_offsets"));
      KVS_RETURN_IF_ERROR(t(j.host_offsets, Extent({j.count}, 8), "host_offsets"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->CopyHostRows(real, stream);
  }

  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream stream) override {
    std::vector<CaoteJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      CaoteJob& j = real[i];
      const Translator t(*state_, absl::StrCat("caote job ", i));
      KVS_RETURN_IF_ERROR(t.View(j.values, "values"));
      KVS_RETURN_IF_ERROR(t(j.alpha, Extent({j.rows, j.values.count}, 4), "alpha"));
      KVS_RETURN_IF_ERROR(t(j.scores, Extent({j.rows, j.values.count}, 4), "scores"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->CaoteScores(real, stream);
  }

  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream stream) override {
    std::vector<NearestKeyJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      NearestKeyJob& j = real[i];
      const Translator t(*state_, absl::StrCat("nearest key job ", i));
      KVS_RETURN_IF_ERROR(t.View(j.keys, "keys"));
      KVS_RETURN_IF_ERROR(t(j.query_slots, Extent({j.num_queries}, 4), "query_slots"));
      KVS_RETURN_IF_ERROR(t(j.candidate_slots, Extent({j.num_candidates}, 4), "candidate_slots"));
      KVS_RETURN_IF_ERROR(
          t(j.candidate_positions, Extent({j.num_candidates}, 4), "candidate_positions"));
      KVS_RETURN_IF_ERROR(t(j.similarity, Extent({j.num_queries}, 4), "similarity"));
      KVS_RETURN_IF_ERROR(t(j.target, Extent({j.num_queries}, 4), "target"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->NearestKeys(real, stream);
  }

  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream stream) override {
    std::vector<RowMergeJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      RowMergeJob& j = real[i];
      const Translator t(*state_, absl::StrCat("row merge job ", i));
      // A job the CPU backend's validator refuses before reading its arrays is passed on as is.
      if (j.rows <= 0 || j.rows > kMaxRowMergeRows) continue;
      KVS_RETURN_IF_ERROR(t(j.arena, 0, "arena"));
      KVS_RETURN_IF_ERROR(t(j.dst_offsets, Extent({j.rows}, 8), "dst_offsets"));
      KVS_RETURN_IF_ERROR(t(j.source_starts, Extent({j.rows + 1}, 8), "source_starts"));
      // The count the (now host-addressable) starts imply, only to translate the sources; the
      // validator checks the starts.
      const int64_t sources =
          j.source_starts == nullptr ? 0 : std::max<int64_t>(j.source_starts[j.rows], 0);
      KVS_RETURN_IF_ERROR(t(j.src_offsets, Extent({sources}, 8), "src_offsets"));
      KVS_RETURN_IF_ERROR(t(j.weights, Extent({sources}, 4), "weights"));
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->MergeRows(real, stream);
  }

  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream stream) override {
    std::vector<FiniteCheckJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      FiniteCheckJob& j = real[i];
      const Translator t(*state_, absl::StrCat("finite check job ", i));
      KVS_RETURN_IF_ERROR(t(j.arena, 0, "arena"));
      KVS_RETURN_IF_ERROR(t(j.row_offsets, Extent({j.count}, 8), "row_offsets"));
      KVS_RETURN_IF_ERROR(t(j.first_non_finite, Extent({1}, 8), "first_non_finite"));
      if (j.row_norms != nullptr) {
        KVS_RETURN_IF_ERROR(t(j.row_norms, Extent({j.count}, 4), "row_norms"));
      }
    }
    DeviceCounters::Launch(real.size());  // one kernel per job, as CUDA launches
    return cpu_->FindNonFinite(real, stream);
  }

  absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                           Stream stream) override {
    std::vector<DecodeEvictJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      DecodeEvictJob& j = real[i];
      const Translator t(*state_, absl::StrCat("decode evict job ", i));
      const int64_t heads = j.keys.num_kv_heads;
      KVS_RETURN_IF_ERROR(t.View(j.keys, "keys"));
      KVS_RETURN_IF_ERROR(t(j.positions, Extent({heads, j.stride}, 4), "positions"));
      KVS_RETURN_IF_ERROR(t(j.accumulated, Extent({j.num_q_heads, j.stride}, 4), "accumulated"));
      KVS_RETURN_IF_ERROR(t(j.sums, Extent({j.num_q_heads, j.keys.count}, 4), "sums"));
      KVS_RETURN_IF_ERROR(t(j.rows, Extent({j.rows_count, j.keys.count}, 4), "rows"));
      KVS_RETURN_IF_ERROR(t(j.evicted, Extent({heads}, 4), "evicted"));
      KVS_RETURN_IF_ERROR(t(j.queries, Extent({j.query_values}, 4), "queries"));
    }
    DeviceCounters::Launch(1);  // one kernel per stage, over every job
    return cpu_->DecodeEvict(real, stage, stream);
  }

  absl::Status Synchronize(Stream stream) override {
    DeviceCounters::Sync();
    return cpu_->Synchronize(stream);
  }

 private:
  absl::StatusOr<std::vector<AttentionJob>> TranslateAttention(
      absl::Span<const AttentionJob> jobs) const {
    std::vector<AttentionJob> real(jobs.begin(), jobs.end());
    for (size_t i = 0; i < real.size(); ++i) {
      AttentionJob& j = real[i];
      const PagedLayerView& v = j.keys;
      const Translator t(*state_, absl::StrCat("attention job ", i));
      KVS_RETURN_IF_ERROR(t(j.key_positions, Extent({v.num_kv_heads, KeyPositionsOffset(j, 1)}, 4),
                            "key_positions"));
      KVS_RETURN_IF_ERROR(
          t(j.queries, Extent({j.num_q_heads, j.num_queries, v.head_dim}, 4), "queries"));
      KVS_RETURN_IF_ERROR(t(j.query_positions, Extent({j.num_queries}, 4), "query_positions"));
      KVS_RETURN_IF_ERROR(t(j.probs, Extent({j.num_q_heads, j.num_queries, v.count}, 4), "probs"));
      KVS_RETURN_IF_ERROR(t.View(j.keys, "keys"));
    }
    return real;
  }

  const std::shared_ptr<SimState> state_;
  const std::unique_ptr<Backend> cpu_;
  std::string fault_file_;  // KVS_DEVICE_SIM_FAULT_FILE; "" = always healthy
};

}  // namespace

SimulatedDevice MakeSimulatedDevice(int num_threads) {
  auto state = std::make_shared<SimState>();
  SimulatedDevice device;
  device.backend = std::make_unique<SimBackend>(state, num_threads);
  device.memory = std::make_unique<SimMemory>(state);
  device.control = state;
  return device;
}

}  // namespace kvs
