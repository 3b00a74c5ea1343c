// The simulated device: a Backend + DeviceMemory pair that behaves like a discrete GPU without
// one, so that tests (and --backend=device-sim) prove the cache core never dereferences device
// memory on the host. Every "device" allocation (an arena, a scratch buffer) is an address range
// reserved with PROT_NONE (MAP_NORESERVE): a host read or write of it faults. Real backing memory
// lives elsewhere (the CPU backend's shm arena for arenas, the heap for scratch) and is reached
// only through the translation table, inside the simulated kernels (which translate every
// pointer of every job and run the CPU backend's kernels) and the DeviceMemory copies.
//
// Pointer rules, as on CUDA: a job pointer must lie inside a simulated allocation (INVALID_ARGUMENT
// "<job> <i>: <field> is not device memory" otherwise; with the array's extent checked when its
// shape is sane), except HostRowCopyJob::host, which must be host memory registered as page-locked
// (RegisterPageLocked, or the backend's PinHostMemory: the analogues of cudaHostRegister);
// registered host memory is also device-accessible for every other field. Arena handles are the
// CPU backend's shm files, so workers map and Arena::Read/Write work as on the CPU backend.
// name() is "device-sim".
// Health: healthy() is false while the file named by the environment variable
// KVS_DEVICE_SIM_FAULT_FILE exists (read when the device is made), as a CUDA backend's is after
// a sticky device error, so that health reporting can be tested through the real server.
//
// Threading: the backend, the memory and the control are safe to use concurrently; they share one
// mutex-guarded translation table. Arenas and scratch keep the shared state alive.
#ifndef KVSIDECAR_GPU_SIM_SIMULATED_DEVICE_H_
#define KVSIDECAR_GPU_SIM_SIMULATED_DEVICE_H_

#include <cstdint>
#include <memory>

#include "gpu/backend.h"
#include "gpu/device_memory.h"

namespace kvs {

// Counters of the DeviceMemory side (monotonic since creation), for tests.
struct SimulatedDeviceStats {
  uint64_t allocate_calls = 0;  // Allocate calls that succeeded
  uint64_t reservations = 0;    // of those, the ones that reserved a new range (not cached)
  uint64_t free_calls = 0;
  uint64_t copies_to_device = 0;
  uint64_t copies_to_host = 0;
  uint64_t bytes_to_device = 0;
  uint64_t bytes_to_host = 0;
  uint64_t live_scratch = 0;  // scratch allocations handed out and not yet freed
};

class SimulatedDeviceControl {
 public:
  virtual ~SimulatedDeviceControl() = default;
  virtual SimulatedDeviceStats stats() const = 0;
  // Marks [p, p + bytes) of host memory page-locked (device-accessible, valid as
  // HostRowCopyJob::host) until UnregisterPageLocked(p).
  virtual void RegisterPageLocked(const void* p, uint64_t bytes) = 0;
  virtual void UnregisterPageLocked(const void* p) = 0;
};

struct SimulatedDevice {
  std::unique_ptr<Backend> backend;      // the device backend: jobs over device pointers
  std::unique_ptr<DeviceMemory> memory;  // its memory
  std::shared_ptr<SimulatedDeviceControl> control;
};

// `num_threads` as MakeCpuBackend. Wrap with MakeStagingBackend(backend, memory) for a backend
// that takes host job arrays (gpu/backend_factory.h BackendKind::kDeviceSim does).
SimulatedDevice MakeSimulatedDevice(int num_threads = 0);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_SIM_SIMULATED_DEVICE_H_
