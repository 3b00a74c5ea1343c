// SpillBuffers: a process-wide cache of the large host buffers that hold spilled layers (the
// `layers` of a SpilledSequence, cache/tier.h). A spill copies a sequence's blocks into host
// memory; into freshly allocated buffers that costs a page fault and a zero fill per page, which
// made a spill to the host tier several times slower than memcpy. Buffers freed by a restore (the
// host copy's last reference) or after a disk write come back here and serve the next spill with
// pages already mapped; like the pinned-memory pool of a CUDA host allocator.
//
// Bounded: at most max_idle_bytes() (512 MiB by default) are held idle; buffers beyond that, and
// buffers under 64 KiB, are freed at once. Header-only so that cache/ (which fills the buffers)
// and storage/ (which stores and frees them) share one instance without a link dependency.
//
// Page-locked on a device: with a pinner installed (SetPinner: the CUDA backend's
// Backend::PinHostMemory, by the server at start), every new buffer of at least kMinPinBytes is
// page-locked once when it is made, so that the device <-> host copies of a spill or restore run
// at the bus's speed (a pageable copy goes through the driver's own staging buffers), and stays
// so while it is recycled. A pinned buffer is unpinned before it is freed: every way a buffer
// leaves for good goes through Give (a SpilledSequence's destructor gives its layers back, see
// cache/tier.h), which unpins what it frees.
//
// Threading: thread-safe (one internal mutex around the idle list and the pinned set; no
// copying, pinning or unpinning under it).
#ifndef KVSIDECAR_CACHE_SPILL_BUFFERS_H_
#define KVSIDECAR_CACHE_SPILL_BUFFERS_H_

#include <sys/mman.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "cache/tier.h"

namespace kvs {

class SpillBuffers {
 public:
  static constexpr size_t kMinBytes = size_t{64} << 10;
  // Smaller buffers are not worth a registration with the driver (it costs about a page walk).
  static constexpr size_t kMinPinBytes = size_t{1} << 20;

  // Page-locks [p, p + bytes) for the device (false: not pinned, the buffer works anyway), and
  // undoes it.
  struct Pinner {
    std::function<bool(void* p, size_t bytes)> pin;
    std::function<void(void* p)> unpin;
  };

  // The one instance of the process (never destroyed: buffers may come back during exit).
  static SpillBuffers& Default() {
    static SpillBuffers* const instance = [] {
      auto* buffers = new SpillBuffers();
      SetSpilledLayersRecycler(
          [](std::vector<std::string>&& layers) { Default().Give(std::move(layers)); });
      return buffers;
    }();
    return *instance;
  }

  // Installs `pinner` for the buffers made from now on; each pinned buffer is unpinned by the
  // pinner that pinned it. Clearing it (null functions) also forgets every buffer pinned so far:
  // they stay page-locked until the process exits. The server clears it at shutdown, before its
  // backend goes, so that no buffer that comes back later reaches a destroyed backend.
  void SetPinner(Pinner pinner) {
    absl::MutexLock lock(&mu_);
    if (pinner.pin && pinner.unpin) {
      pinner_ = std::make_shared<const Pinner>(std::move(pinner));
    } else {
      pinner_ = nullptr;
      pinned_.clear();
    }
  }
  // Bytes of the buffers alive now that were page-locked when made.
  size_t pinned_bytes() const {
    absl::MutexLock lock(&mu_);
    size_t total = 0;
    for (const auto& [p, pinned] : pinned_) total += pinned.bytes;
    return total;
  }

  // A buffer of exactly `bytes` bytes whose contents are unspecified (the caller overwrites them
  // all): an idle buffer of at least that capacity (and at most a quarter more, so that the
  // tiers' byte accounting stays close to the memory held) when there is one, else a new one
  // (backed by transparent huge pages where the kernel allows it, so that its first touch costs
  // a fault per 2 MiB instead of per 4 KiB).
  std::string Take(size_t bytes) {
    std::string out;
    if (bytes >= kMinBytes) {
      absl::MutexLock lock(&mu_);
      auto it = idle_.lower_bound(bytes);
      if (it != idle_.end() && it->first - bytes <= bytes / 4) {
        out = std::move(it->second);
        idle_bytes_ -= it->first;
        idle_.erase(it);
      }
    }
    if (out.capacity() < bytes) {  // no idle buffer fits: a fresh one
      out.reserve(bytes);
      AdviseHugePages(out.data(), bytes);
      Pin(out);
    }
    // Shrinking writes nothing; growing zero-fills only the tail beyond the buffer's last size
    // (nothing when a buffer of the same size comes back, the steady state).
    out.resize(bytes);
    return out;
  }

  // Takes `buffer` back (kept when it is large enough and there is room, else freed).
  void Give(std::string buffer) {
    const size_t capacity = buffer.capacity();
    if (capacity < kMinBytes) return;
    {
      absl::MutexLock lock(&mu_);
      if (idle_bytes_ + capacity <= max_idle_bytes_) {
        idle_bytes_ += capacity;
        idle_.emplace(capacity, std::move(buffer));
        return;
      }
    }
    Unpin(buffer.data());  // then freed on return
  }
  void Give(std::vector<std::string> buffers) {
    for (std::string& buffer : buffers) Give(std::move(buffer));
  }

  // `data` as an immutable shared copy; its layer buffers come back here when its last
  // reference goes (the host tiers' copies), as every SpilledSequence's do when it is destroyed.
  std::shared_ptr<const SpilledSequence> Share(SpilledSequence data) {
    return std::make_shared<const SpilledSequence>(std::move(data));
  }

  size_t idle_bytes() const {
    absl::MutexLock lock(&mu_);
    return idle_bytes_;
  }
  size_t max_idle_bytes() const {
    absl::MutexLock lock(&mu_);
    return max_idle_bytes_;
  }
  // Frees idle buffers beyond the new bound.
  void SetMaxIdleBytes(size_t bytes) {
    std::multimap<size_t, std::string> freed;
    {
      absl::MutexLock lock(&mu_);
      max_idle_bytes_ = bytes;
      while (idle_bytes_ > max_idle_bytes_ && !idle_.empty()) {
        auto largest = std::prev(idle_.end());
        idle_bytes_ -= largest->first;
        freed.insert(idle_.extract(largest));
      }
    }
    for (auto& [capacity, buffer] : freed) Unpin(buffer.data());
  }

 private:
  SpillBuffers() = default;

  static void AdviseHugePages(char* data, size_t bytes) {
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    if (bytes < 2 * kHuge) return;
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
    // Advice only: where THP is off or the range is not eligible, pages stay 4 KiB.
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }

  // Page-locks a new buffer when a pinner is installed and the buffer is large enough.
  void Pin(std::string& buffer) {
    if (buffer.capacity() < kMinPinBytes) return;
    std::shared_ptr<const Pinner> pinner;
    {
      absl::MutexLock lock(&mu_);
      pinner = pinner_;
    }
    if (pinner == nullptr || !pinner->pin(buffer.data(), buffer.capacity())) return;
    absl::MutexLock lock(&mu_);
    pinned_[buffer.data()] = Pinned{buffer.capacity(), std::move(pinner)};
  }
  // Undoes Pin for the buffer at `data` (nothing if it was not pinned) before it is freed.
  void Unpin(const char* data) {
    std::shared_ptr<const Pinner> pinner;
    {
      absl::MutexLock lock(&mu_);
      auto it = pinned_.find(data);
      if (it == pinned_.end()) return;
      pinner = std::move(it->second.pinner);
      pinned_.erase(it);
    }
    pinner->unpin(const_cast<char*>(data));
  }

  struct Pinned {
    size_t bytes = 0;
    std::shared_ptr<const Pinner> pinner;  // the one that pinned it
  };

  mutable absl::Mutex mu_;
  std::shared_ptr<const Pinner> pinner_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<const char*, Pinned> pinned_ ABSL_GUARDED_BY(mu_);
  std::multimap<size_t, std::string> idle_ ABSL_GUARDED_BY(mu_);  // by capacity
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_idle_bytes_ ABSL_GUARDED_BY(mu_) = size_t{512} << 20;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SPILL_BUFFERS_H_
