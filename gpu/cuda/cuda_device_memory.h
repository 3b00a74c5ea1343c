// CudaDeviceMemory: DeviceMemory (gpu/device_memory.h) on one CUDA device, for the staging
// decorator that runs the cache core on the CUDA backend (gpu/backend_factory.h kCuda).
// IsDeviceAccessible asks cudaPointerGetAttributes (device or managed memory, or page-locked host
// memory with a device mapping). Allocate keeps up to a few freed buffers for reuse so that small
// staged calls do not reach cudaMalloc/cudaFree (which also synchronise the device) every time.
// Copies are cudaMemcpyAsync(cudaMemcpyDefault) on the given stream followed by
// cudaStreamSynchronize: ordered after the stream's earlier work, complete on return.
//
// Threading: every method may be called from any thread (each selects the device first); the
// buffer cache is mutex-guarded. Built only with KVS_WITH_CUDA; never run without a GPU.
#ifndef KVSIDECAR_GPU_CUDA_CUDA_DEVICE_MEMORY_H_
#define KVSIDECAR_GPU_CUDA_CUDA_DEVICE_MEMORY_H_

#include <memory>

#include "gpu/device_memory.h"

namespace kvs {

std::unique_ptr<DeviceMemory> MakeCudaDeviceMemory(int device = 0);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CUDA_CUDA_DEVICE_MEMORY_H_
