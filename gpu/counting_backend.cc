// CountingBackend (gpu/counting_backend.h).
#include "gpu/counting_backend.h"

#include <memory>
#include <string_view>
#include <utility>

#include "gpu/device_counters.h"

namespace kvs {
namespace {

class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  bool healthy() const override { return inner_->healthy(); }
  bool batches_calls() const override { return inner_->batches_calls(); }
  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    return inner_->CreateArena(bytes, options);
  }
  absl::Status Synchronize(Stream stream) override { return inner_->Synchronize(stream); }
  bool PinHostMemory(void* p, uint64_t bytes) override { return inner_->PinHostMemory(p, bytes); }
  void UnpinHostMemory(void* p) override { inner_->UnpinHostMemory(p); }

  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream s) override {
    return Forward(BackendMethod::kKeyDiffScores, jobs, s, &Backend::KeyDiffScores);
  }
  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream s) override {
    return Forward(BackendMethod::kTopK, jobs, s, &Backend::TopK);
  }
  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream s) override {
    return Forward(BackendMethod::kCopyRows, jobs, s, &Backend::CopyRows);
  }
  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream s) override {
    return Forward(BackendMethod::kAttentionProbs, jobs, s, &Backend::AttentionProbs);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream s) override {
    return Forward(BackendMethod::kAttentionLogits, jobs, s, &Backend::AttentionLogits);
  }
  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, Stream s) override {
    return Forward(BackendMethod::kAttentionColumnSums, jobs, s, &Backend::AttentionColumnSums);
  }
  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream s) override {
    return Forward(BackendMethod::kPoolScores, jobs, s, &Backend::PoolScores);
  }
  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, Stream s) override {
    return Forward(BackendMethod::kWindowVarianceScores, jobs, s, &Backend::WindowVarianceScores);
  }
  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream s) override {
    return Forward(BackendMethod::kWindowEntropyShift, jobs, s, &Backend::WindowEntropyShift);
  }
  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream s) override {
    return Forward(BackendMethod::kCopyHostRows, jobs, s, &Backend::CopyHostRows);
  }
  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream s) override {
    return Forward(BackendMethod::kCaoteScores, jobs, s, &Backend::CaoteScores);
  }
  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream s) override {
    return Forward(BackendMethod::kNearestKeys, jobs, s, &Backend::NearestKeys);
  }
  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream s) override {
    return Forward(BackendMethod::kMergeRows, jobs, s, &Backend::MergeRows);
  }
  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream s) override {
    return Forward(BackendMethod::kFindNonFinite, jobs, s, &Backend::FindNonFinite);
  }
  absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                           Stream s) override {
    DeviceCounters::Call(BackendMethod::kDecodeEvict, jobs.size());
    return inner_->DecodeEvict(jobs, stage, s);
  }
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(uint64_t bytes) override {
    return inner_->AllocateBuffer(bytes);
  }
  absl::Status WriteBuffer(DeviceBuffer& buffer, uint64_t offset, const void* source,
                           uint64_t bytes) override {
    return inner_->WriteBuffer(buffer, offset, source, bytes);
  }
  absl::Status ReadBuffer(const DeviceBuffer& buffer, uint64_t offset, void* destination,
                          uint64_t bytes) override {
    return inner_->ReadBuffer(buffer, offset, destination, bytes);
  }

 private:
  template <typename Job>
  using Method = absl::Status (Backend::*)(absl::Span<const Job>, Stream);

  template <typename Job>
  absl::Status Forward(BackendMethod method, absl::Span<const Job> jobs, Stream stream,
                       Method<Job> call) {
    DeviceCounters::Call(method, jobs.size());
    return (inner_.get()->*call)(jobs, stream);
  }

  const std::unique_ptr<Backend> inner_;
};

}  // namespace

std::unique_ptr<Backend> MakeCountingBackend(std::unique_ptr<Backend> inner) {
  return std::make_unique<CountingBackend>(std::move(inner));
}

}  // namespace kvs
