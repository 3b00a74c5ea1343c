// CountingBackend: a Backend decorator that counts every call the cache core makes and its jobs
// (DeviceCounters, gpu/device_counters.h) and forwards it unchanged. The backend factory puts it
// at the top of every backend it makes, so the counts are those of the core's calls, whatever
// the staging layer and the device do below (they count their own synchronisations, transfers
// and launches).
//
// Threading: as the wrapped backend; the counters are atomics.
#ifndef KVSIDECAR_GPU_COUNTING_BACKEND_H_
#define KVSIDECAR_GPU_COUNTING_BACKEND_H_

#include <memory>

#include "gpu/backend.h"

namespace kvs {

std::unique_ptr<Backend> MakeCountingBackend(std::unique_ptr<Backend> inner);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_COUNTING_BACKEND_H_
