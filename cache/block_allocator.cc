#include "cache/block_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvs {

BlockAllocator::BlockAllocator(int32_t num_blocks) : num_blocks_(std::max<int32_t>(num_blocks, 0)) {
  absl::MutexLock lock(&mu_);
  used_.assign(num_blocks_, 0);
  free_.reserve(num_blocks_);
  for (int32_t id = num_blocks_ - 1; id >= 0; --id) free_.push_back(id);
}

int32_t BlockAllocator::free_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(free_.size());
}

bool BlockAllocator::IsUsed(int32_t id) const {
  absl::MutexLock lock(&mu_);
  return id >= 0 && id < num_blocks_ && used_[id] != 0;
}

absl::Status BlockAllocator::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", n, " blocks"));
  absl::MutexLock lock(&mu_);
  const int32_t free_count = static_cast<int32_t>(free_.size());
  if (n > free_count) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", n, " blocks, ", free_count, " of ", num_blocks_, " are free"));
  }
  out->reserve(out->size() + n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = free_.back();
    free_.pop_back();
    used_[id] = 1;
    out->push_back(id);
  }
  return absl::OkStatus();
}

absl::Status BlockAllocator::Free(absl::Span<const int32_t> ids) {
  // Validate everything first so a bad list frees nothing. Marking as we go detects duplicates
  // within `ids`; the marks are undone before returning an error.
  absl::MutexLock lock(&mu_);
  size_t checked = 0;
  absl::Status status;
  for (; checked < ids.size(); ++checked) {
    const int32_t id = ids[checked];
    if (id < 0 || id >= num_blocks_) {
      status = absl::InternalError(
          absl::StrCat("free of block ", id, " outside the arena's ", num_blocks_, " blocks"));
      break;
    }
    if (used_[id] != 1) {
      status = absl::InternalError(absl::StrCat("double free of block ", id));
      break;
    }
    used_[id] = 2;  // provisionally freed
  }
  if (!status.ok()) {
    for (size_t i = 0; i < checked; ++i) used_[ids[i]] = 1;
    return status;
  }
  for (int32_t id : ids) {
    used_[id] = 0;
    free_.push_back(id);
  }
  return absl::OkStatus();
}

}  // namespace kvs
