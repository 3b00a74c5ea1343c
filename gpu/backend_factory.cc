#include "gpu/backend_factory.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gpu/counting_backend.h"
#include "gpu/sim/simulated_device.h"
#include "gpu/staging_backend.h"

#ifdef KVS_WITH_CUDA
#include "gpu/cuda/cuda_backend.h"
#include "gpu/cuda/cuda_device_memory.h"
#endif

namespace kvs {

bool CudaBuilt() {
#ifdef KVS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

const CudaProbe& ProbeCuda() {
  static const CudaProbe* const probe = [] {
    auto* result = new CudaProbe();
#ifdef KVS_WITH_CUDA
    std::string why;
    result->devices = CudaDeviceCount(&why);
    result->detail = result->devices > 0 ? CudaDeviceDescription(0) : std::move(why);
#else
    result->detail = "this build has no CUDA backend";
#endif
    return result;
  }();
  return *probe;
}

namespace {

absl::StatusOr<std::unique_ptr<Backend>> MakeUncounted(BackendKind kind, int num_threads) {
  if (kind == BackendKind::kCpu) return MakeCpuBackend(num_threads);
  if (kind == BackendKind::kDeviceSim) {
    SimulatedDevice device = MakeSimulatedDevice(num_threads);
    return MakeStagingBackend(std::move(device.backend), std::move(device.memory));
  }
#ifdef KVS_WITH_CUDA
  auto cuda = MakeCudaBackend(0, /*trusted=*/true);  // the staging layer validates every job
  if (!cuda.ok()) return cuda.status();
  return MakeStagingBackend(*std::move(cuda), MakeCudaDeviceMemory(0));
#else
  return absl::FailedPreconditionError("this build has no CUDA backend");
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(BackendKind kind, int num_threads) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeUncounted(kind, num_threads);
  if (!backend.ok()) return backend.status();
  return MakeCountingBackend(*std::move(backend));
}

}  // namespace kvs
