// Backend: the compute seam. Kernels over raw pointers, shapes and a stream, with two
// implementations of identical semantics: gpu/cpu (always built; the reference) and gpu/cuda.
// Nothing here knows protobuf, sequences or policies: cache/ plans the work and calls in.
//
// Pointer spaces: every pointer in a job lives where the backend computes (host memory for the
// CPU backend, device memory for CUDA), except where a field says otherwise.
//
// Threading: a Backend is shared by all sessions; every method is safe to call concurrently.
// Jobs within one call are independent and may run in parallel.
#ifndef KVSIDECAR_GPU_BACKEND_H_
#define KVSIDECAR_GPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/arena.h"
#include "gpu/base/dtype.h"

namespace kvs {

// An execution stream. nullptr = the backend's default stream. The CPU backend runs every call
// to completion before returning.
using Stream = void*;

// The keys of one (sequence, layer) in paged form: slot s of kv head h is the row
//   arena + block_table[s / block_tokens] * block_bytes
//         + ((0 * num_kv_heads + h) * block_tokens + s % block_tokens) * head_dim * dtype_bytes.
// Values are the same with kv index 1.
struct PagedLayerView {
  const uint8_t* arena = nullptr;
  const int32_t* block_table = nullptr;  // at least ceil(count / block_tokens) entries
  int32_t count = 0;                     // slots [0, count) hold tokens, for every kv head
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_tokens = 0;
  DType dtype = DType::kFloat16;
  uint64_t block_bytes = 0;
};

enum class KeyDiffAnchor { kMeanNormalized, kMeanRaw, kMedianNormalized };
enum class KeyDiffMetric { kCosine, kPairwise, kDot, kEuclidean };

// KeyDiff scores (shared/design/policies/keydiff.md §3.1, §3.5) of every slot of every kv head
// of one layer. A higher score means more distinctive, i.e. kept first. fp32 accumulation.
struct KeyDiffScoreJob {
  PagedLayerView keys;
  KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized;
  KeyDiffMetric metric = KeyDiffMetric::kCosine;
  float* scores = nullptr;  // out: [num_kv_heads][keys.count]
};

// Per-row top-k: keeps the k slots with the highest score; equal scores keep the lower position
// (`positions`), never the lower slot. Slots with forced[row * n + s] != 0 are kept first and count
// toward k (the caller guarantees at most k are forced). NaN scores rank lowest.
struct TopKJob {
  const float* scores = nullptr;     // [rows][n]
  const int32_t* positions = nullptr;  // [rows][n], distinct within a row
  const uint8_t* forced = nullptr;   // optional [rows][n]
  int32_t rows = 0;
  int32_t n = 0;
  int32_t k = 0;                     // 0 <= k <= n
  int32_t* kept = nullptr;           // out: [rows][k] slot indices, ascending
};

// Copies `count` rows of `row_bytes` inside one arena: row i from arena + src_offsets[i] to
// arena + dst_offsets[i]. Rows must not overlap each other's destinations or a later source.
struct RowCopyJob {
  uint8_t* arena = nullptr;
  const uint64_t* src_offsets = nullptr;
  const uint64_t* dst_offsets = nullptr;
  int64_t count = 0;
  uint64_t row_bytes = 0;
};

struct ArenaOptions {
  std::string shm_directory = "/dev/shm";  // CPU backend: where the shm file is created
  std::string name_prefix = "kvsidecar";   // file name prefix (pid and generation are appended)
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;  // "cpu" or "cuda"
  // False after a device error; the sidecar then refuses new work and reports it.
  virtual bool healthy() const = 0;

  // RESOURCE_EXHAUSTED when the memory cannot be had, INTERNAL on other system errors.
  virtual absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                             const ArenaOptions& options) = 0;

  virtual absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) = 0;
  virtual absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) = 0;
  virtual absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) = 0;
  virtual absl::Status Synchronize(Stream stream) = 0;
};

// The always-available reference backend. `num_threads` <= 0 picks the hardware concurrency.
std::unique_ptr<Backend> MakeCpuBackend(int num_threads = 0);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BACKEND_H_
