// BlockAllocator: which blocks of one session's arena are free. Block ids are indices into the
// arena (block b starts at b * block_bytes); the allocator hands them out and takes them back,
// nothing more: it never touches arena memory.
//
// Threading: thread-safe (one internal mutex), so that the sequences of one session can run a
// decode step on several threads at once; the owning session still serialises everything else.
#ifndef KVSIDECAR_CACHE_BLOCK_ALLOCATOR_H_
#define KVSIDECAR_CACHE_BLOCK_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace kvs {

class BlockAllocator {
 public:
  // Blocks [0, num_blocks) all start free; num_blocks < 0 is treated as 0.
  explicit BlockAllocator(int32_t num_blocks);

  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  // Appends `n` free block ids to `out`, or RESOURCE_EXHAUSTED (and `out` untouched) when fewer
  // than n are free. INVALID_ARGUMENT for n < 0. Low ids are handed out first on a fresh
  // allocator, which keeps tests readable; later order is LIFO (recently freed blocks are warm).
  absl::Status Allocate(int32_t n, std::vector<int32_t>* out) ABSL_LOCKS_EXCLUDED(mu_);

  // Returns `ids` to the free list. All-or-nothing: INTERNAL, with nothing freed, when an id is
  // out of range, already free, or listed twice (a double free is a bookkeeping bug upstream).
  absl::Status Free(absl::Span<const int32_t> ids) ABSL_LOCKS_EXCLUDED(mu_);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t free_blocks() const ABSL_LOCKS_EXCLUDED(mu_);
  int32_t used_blocks() const ABSL_LOCKS_EXCLUDED(mu_) { return num_blocks_ - free_blocks(); }
  bool IsUsed(int32_t id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int32_t num_blocks_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // stack: back() is handed out next
  std::vector<uint8_t> used_ ABSL_GUARDED_BY(mu_);  // used_[id] != 0 while id is allocated
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_BLOCK_ALLOCATOR_H_
