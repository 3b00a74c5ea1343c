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
// Threading: thread-safe (one internal mutex around the idle list; no copying under it).
#ifndef KVSIDECAR_CACHE_SPILL_BUFFERS_H_
#define KVSIDECAR_CACHE_SPILL_BUFFERS_H_

#include <sys/mman.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "cache/tier.h"

namespace kvs {

class SpillBuffers {
 public:
  static constexpr size_t kMinBytes = size_t{64} << 10;

  // The one instance of the process (never destroyed: buffers may come back during exit).
  static SpillBuffers& Default() {
    static SpillBuffers* const instance = new SpillBuffers();
    return *instance;
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
    if (out.capacity() < bytes) {
      out.reserve(bytes);
      AdviseHugePages(out.data(), bytes);
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
    absl::MutexLock lock(&mu_);
    if (idle_bytes_ + capacity > max_idle_bytes_) return;  // freed outside the lock, on return
    idle_bytes_ += capacity;
    idle_.emplace(capacity, std::move(buffer));
  }
  void Give(std::vector<std::string> buffers) {
    for (std::string& buffer : buffers) Give(std::move(buffer));
  }

  // `data` as an immutable shared copy whose layer buffers come back here when its last
  // reference goes (the host tier's copies).
  std::shared_ptr<const SpilledSequence> Share(SpilledSequence data) {
    return std::shared_ptr<const SpilledSequence>(
        new SpilledSequence(std::move(data)), [this](const SpilledSequence* sequence) {
          // The last owner: nothing else reads the buffers any more.
          Give(std::move(const_cast<SpilledSequence*>(sequence)->layers));
          delete sequence;
        });
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
    absl::MutexLock lock(&mu_);
    max_idle_bytes_ = bytes;
    while (idle_bytes_ > max_idle_bytes_ && !idle_.empty()) {
      auto largest = std::prev(idle_.end());
      idle_bytes_ -= largest->first;
      freed.insert(idle_.extract(largest));
    }
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

  mutable absl::Mutex mu_;
  std::multimap<size_t, std::string> idle_ ABSL_GUARDED_BY(mu_);  // by capacity
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_idle_bytes_ ABSL_GUARDED_BY(mu_) = size_t{512} << 20;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SPILL_BUFFERS_H_
