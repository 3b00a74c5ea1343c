// The decode-time eviction of Backend::DecodeEvict (gpu/backend.h) on the host: the CPU
// backend's kernel, the reference the device backends are tested against, and its validator,
// shared by every backend that validates on the host (the staging layer) so that their
// INVALID_ARGUMENT messages agree.
//
// Threading: pure functions of their arguments; different jobs may run concurrently.
#ifndef KVSIDECAR_GPU_CPU_DECODE_EVICT_CPU_H_
#define KVSIDECAR_GPU_CPU_DECODE_EVICT_CPU_H_

#include <cstddef>

#include "absl/status/status.h"
#include "gpu/backend.h"

namespace kvs {

// INVALID_ARGUMENT "decode evict job <index>: ..." for a shape the kernels cannot run safely: the
// view, count < 1, stride < count, the query heads, a missing positions or evicted array, the
// scores' inputs, negative or too many protected tokens, sums without accumulated. Reads no
// array.
absl::Status ValidateDecodeEvictJob(const DecodeEvictJob& job, size_t index);

// One job's stage on host memory (the job validated).
void DecodeEvictCpu(const DecodeEvictJob& job, DecodeStage stage);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_DECODE_EVICT_CPU_H_
