# The allowed include directions between the project's source folders: the one table that both the
# build (each folder's target sees only these folders' headers, cmake/KvsLayers.cmake) and the test
# suite (layering_check, cmake/check_layers.cmake) read. ARCHITECTURE.md explains the picture.
#
# KVS_LAYERS: every source folder that is a layer, in dependency order. A file belongs to the
# longest layer folder that contains it (gpu/cpu/x.cc is in gpu/cpu, gpu/x.cc in gpu). "proto" is
# the generated contract: its headers are included as kvsidecar/v1/*.pb.h and grpc/*/v1/*.pb.h.
set(KVS_LAYERS
  gpu/base
  gpu
  gpu/cpu
  gpu/sim
  gpu/cuda
  cache/policy
  cache
  storage
  proto
  service
  clients/cpp)

# KVS_LAYER_DEPS_<folder>: the other folders whose headers <folder> may include (its own always).
# Not transitive: a folder that includes a header which includes another folder's header must be
# allowed that folder too (service includes cache/pool.h, which includes gpu/backend.h).
set(KVS_LAYER_DEPS_gpu/base     "")
# gpu/ holds the Backend interface (arena.h, backend.h, device_memory.h) that the implementations
# include, and the factory and staging backend that compose the implementations.
set(KVS_LAYER_DEPS_gpu          gpu/base gpu/cpu gpu/sim gpu/cuda)
set(KVS_LAYER_DEPS_gpu/cpu      gpu gpu/base)
# The simulated device runs its kernels on the CPU backend (MakeCpuBackend, gpu/backend.h).
set(KVS_LAYER_DEPS_gpu/sim      gpu gpu/base gpu/cpu)
# The CUDA backend validates jobs with the CPU backend's validators (one definition of "valid").
set(KVS_LAYER_DEPS_gpu/cuda     gpu gpu/base gpu/cpu)
set(KVS_LAYER_DEPS_cache/policy gpu gpu/base gpu/cpu)
set(KVS_LAYER_DEPS_cache        cache/policy gpu gpu/base gpu/cpu)
# storage implements cache/tier.h (the tier interface the core talks to) and links no cache code.
set(KVS_LAYER_DEPS_storage      cache gpu/base)
set(KVS_LAYER_DEPS_proto        "")
set(KVS_LAYER_DEPS_service      cache cache/policy gpu gpu/base gpu/cpu storage proto)
set(KVS_LAYER_DEPS_clients/cpp  proto gpu/base)

# Directions the design forbids, as <from>><to> folder prefixes ("gpu" covers gpu/cpu, ...), plus
# gpu>storage (gpu is the bottom of both chains) and clients>storage (clients speak the contract).
# The check fails if the table above allows one of them, so a forbidden include cannot be made to
# pass by widening the table.
set(KVS_LAYER_FORBIDDEN
  cache>service
  cache>proto
  gpu>cache
  gpu>service
  gpu>proto
  gpu>storage
  storage>service
  clients>service
  clients>cache
  clients>storage)
