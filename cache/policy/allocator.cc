// Placeholder: uniform only. Replaced by the full allocators.
#include "cache/policy/allocator.h"

namespace kvs {
namespace {

class UniformAllocator final : public LayerAllocator {
 public:
  AttentionRequirement attention(Phase) const override { return {}; }
  absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const override {
    Allocation allocation;
    for (int32_t count : request.counts) {
      allocation.keep.push_back(std::min(request.budget, count));
    }
    return allocation;
  }
};

}  // namespace

std::unique_ptr<LayerAllocator> MakeLayerAllocator(const PolicyConfig&) {
  return std::make_unique<UniformAllocator>();
}

}  // namespace kvs
