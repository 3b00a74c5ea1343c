// CUDA runtime errors as absl statuses, shared by the CUDA backend and its device memory.
// Header-only, pure (cudaGetErrorName/String are thread-safe).
#ifndef KVSIDECAR_GPU_CUDA_CUDA_STATUS_H_
#define KVSIDECAR_GPU_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gpu/base/status_macros.h"

namespace kvs {

// A CUDA call's error as a status naming the call and the CUDA error: RESOURCE_EXHAUSTED for an
// out-of-memory answer, INTERNAL otherwise.
inline absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = error == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                         cudaGetErrorString(error), ")"));
}

}  // namespace kvs

#define KVS_CUDA_RETURN_IF_ERROR(expr, what) KVS_RETURN_IF_ERROR(::kvs::CudaStatus((expr), (what)))

#endif  // KVSIDECAR_GPU_CUDA_CUDA_STATUS_H_
