// Backend selection at start-up: which backends this build has, whether a CUDA device is present,
// and one constructor for either kind, so that service/main.cc stays thin.
//
// Threading: all functions are safe to call from any thread; ProbeCuda probes once per process.
#ifndef KVSIDECAR_GPU_BACKEND_FACTORY_H_
#define KVSIDECAR_GPU_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu/backend.h"

namespace kvs {

// kDeviceSim: the simulated device (gpu/sim/simulated_device.h) behind the staging decorator
// (gpu/staging_backend.h): runs anywhere, faults on any host access to device memory.
enum class BackendKind { kCpu, kCuda, kDeviceSim };

// True when the binary was built with the CUDA backend (CMake KVS_WITH_CUDA, on when nvcc is
// found).
bool CudaBuilt();

struct CudaProbe {
  int devices = 0;     // usable CUDA devices; 0 when the build has no CUDA or none is present
  std::string detail;  // devices > 0: device 0 as "<name> (sm_XY, N MiB)"; else why there is none
};
// Probes once (cudaGetDeviceCount) and caches the answer; never aborts, even without a driver.
const CudaProbe& ProbeCuda();

// kCpu: MakeCpuBackend(num_threads). kCuda: the CUDA backend on device 0 behind the staging
// decorator (so that the cache core's host job arrays reach the device); FAILED_PRECONDITION when
// the build has no CUDA backend or no device can be used. kDeviceSim: the simulated device behind
// the staging decorator, with `num_threads` as the CPU backend's. The raw CUDA backend (jobs over
// device pointers only) stays available as MakeCudaBackend (gpu/cuda/cuda_backend.h).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(BackendKind kind, int num_threads = 0);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BACKEND_FACTORY_H_
