// Spill and restore of one 256 MiB sequence (L=32, H=8, D=128, fp16, 2048 tokens) through KvPool
// to the host tier and to the RocksDB tier, next to the raw limits measured in the same run and
// the same place: memcpy of 256 MiB (host), and a sequential write + fdatasync of 256 MiB in the
// RocksDB directory's file system (disk). Figures: bytes_per_second of each; the ratios (limit
// time / operation time, same run) go to bench/README.md. The spill/restore loops run after one
// untimed round (steady state: spill buffers mapped, cache/spill_buffers.h); BM_SpillHostCold
// spills with no idle buffer. Run: build/bench/storage_bench (fixed iterations).
//
// On a GPU (KVS_BENCH_BACKEND=cuda): the pool's arena is device memory and the spill buffers are
// page-locked as the server makes them (cache/spill_buffers.h, Backend::PinHostMemory); the limit
// is then the device copy itself, measured here too: BM_ArenaRead256MiB / BM_ArenaWrite256MiB
// copy 256 MiB between a device arena and page-locked host memory in one cudaMemcpy
// (Arena::Read/Write), and the _Pageable variants the same from plain host memory.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "cache/spill_buffers.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "storage/tier_manager.h"

namespace kvs {
namespace {

constexpr uint64_t kBytes = uint64_t{256} << 20;

std::string BenchDir() {
  static const std::string dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvs-storage-bench-XXXXXX");
    return std::string(mkdtemp(pattern.data()));
  }();
  return dir;
}

// The backend KVS_BENCH_BACKEND names (cpu when unset), with the spill buffers pinned for it as
// the server pins them.
std::unique_ptr<Backend> MakeBenchBackend() {
  const char* name = std::getenv("KVS_BENCH_BACKEND");
  const std::string chosen = name != nullptr ? name : "cpu";
  absl::StatusOr<std::unique_ptr<Backend>> made =
      MakeBackend(chosen == "cuda" ? BackendKind::kCuda : BackendKind::kCpu, 2);
  if (!made.ok()) {
    std::fprintf(stderr, "backend %s: %s\n", chosen.c_str(), made.status().ToString().c_str());
    std::exit(1);
  }
  Backend* b = made->get();
  SpillBuffers::Default().SetPinner(
      {[b](void* p, size_t bytes) { return b->PinHostMemory(p, bytes); },
       [b](void* p) { b->UnpinHostMemory(p); }});
  return *std::move(made);
}

// One pool with tiers and one 256 MiB sequence, built once.
struct Fixture {
  Fixture() {
    std::filesystem::remove_all(BenchDir() + "/rocksdb");
    tiers = storage::TierManager::Open({uint64_t{1} << 30, BenchDir() + "/rocksdb", 0});
    backend = MakeBenchBackend();
    PoolOptions options;
    options.arena_capacity_bytes = uint64_t{1} << 30;
    options.arena_options.name_prefix = "kvs-storage-bench";
    options.tiers = tiers.get();
    pool = std::make_unique<KvPool>(backend.get(), &clock, options);
    AttachParams attach;
    attach.layout.num_layers = 32;
    attach.layout.num_kv_heads = 8;
    attach.layout.num_q_heads = 8;
    attach.layout.head_dim = 128;
    attach.layout.dtype = DType::kFloat16;
    attach.layout.block_tokens = 16;
    const uint64_t block_bytes = attach.layout.block_bytes();
    attach.num_blocks = static_cast<int32_t>(kBytes / block_bytes + 64);
    session = pool->Attach(attach)->session_id;
    SequenceParams params;
    PolicyConfig policy;
    policy.name = kPolicyStreamingLlm;
    params.policy = policy;
    params.sequence_id = "big";
    sequence = pool->CreateSequence(session, params)->sequence_id;
    const int32_t tokens = static_cast<int32_t>(kBytes / (attach.layout.token_bytes() * 32));
    for (int32_t done = 0; done < tokens; done += 256) {
      Reservation r = *pool->Reserve(session, sequence, 256, {}, {});
      // Varied fp16 values that are all finite (a commit refuses NaN and inf): any low byte,
      // a high byte whose exponent bits are never all ones.
      std::vector<uint8_t> payload(r.payload_bytes);
      for (size_t i = 0; i < payload.size(); ++i) {
        payload[i] = i % 2 == 1 ? static_cast<uint8_t>(0x38 | (i >> 1 & 3))
                                : static_cast<uint8_t>(i * 131 + done);
      }
      absl::Status written = pool->WriteReserved(session, sequence, r.reservation_id, 0, payload);
      if (written.ok()) written = pool->Commit(session, sequence, r.reservation_id, false).status();
      if (!written.ok()) {
        std::fprintf(stderr, "filling the sequence failed: %s\n", written.ToString().c_str());
        std::exit(1);
      }
    }
  }
  // Buffers the pool and tiers give back while they go must not reach the backend that goes
  // before the tiers: forget the pinner first (the server does the same at shutdown).
  ~Fixture() { SpillBuffers::Default().SetPinner({}); }

  FakeClock clock;
  std::unique_ptr<storage::TierManager> tiers;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<KvPool> pool;
  std::string session, sequence;
};

std::unique_ptr<Fixture>& SharedSlot() {
  static std::unique_ptr<Fixture> fixture;
  return fixture;
}

Fixture& Shared() {
  if (!SharedSlot()) SharedSlot() = std::make_unique<Fixture>();
  return *SharedSlot();
}

void BM_Memcpy256MiB(benchmark::State& state) {
  std::vector<uint8_t> from(kBytes, 1), to(kBytes, 0);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), kBytes);
    benchmark::DoNotOptimize(to.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

// 256 MiB between the pool's backend's arena and host memory in one Arena::Read or Write: on the
// CUDA backend one cudaMemcpy, from page-locked memory (pinned) or plain memory.
void ArenaCopy(benchmark::State& state, bool to_host, bool pinned) {
  Fixture& f = Shared();
  absl::StatusOr<std::unique_ptr<Arena>> arena = f.backend->CreateArena(kBytes, {});
  if (!arena.ok()) {
    state.SkipWithError(arena.status().ToString().c_str());
    return;
  }
  std::vector<uint8_t> host(kBytes, 3);
  const bool locked = pinned && f.backend->PinHostMemory(host.data(), host.size());
  if (pinned && !locked) state.SetLabel("not pinned (this backend pins nothing)");
  for (auto _ : state) {
    const absl::Status copied = to_host ? (*arena)->Read(0, host.data(), kBytes)
                                        : (*arena)->Write(0, host.data(), kBytes);
    if (!copied.ok()) state.SkipWithError(copied.ToString().c_str());
  }
  if (locked) f.backend->UnpinHostMemory(host.data());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}
void BM_ArenaRead256MiB(benchmark::State& state) { ArenaCopy(state, true, true); }
void BM_ArenaWrite256MiB(benchmark::State& state) { ArenaCopy(state, false, true); }
void BM_ArenaRead256MiB_Pageable(benchmark::State& state) { ArenaCopy(state, true, false); }
void BM_ArenaWrite256MiB_Pageable(benchmark::State& state) { ArenaCopy(state, false, false); }

void BM_WriteFdatasync256MiB(benchmark::State& state) {
  std::vector<uint8_t> data(kBytes, 7);
  const std::string path = BenchDir() + "/raw.bin";
  for (auto _ : state) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    for (uint64_t off = 0; off < kBytes; off += 4 << 20) {
      if (write(fd, data.data() + off, 4 << 20) != (4 << 20)) state.SkipWithError("write failed");
    }
    fdatasync(fd);
    close(fd);
    state.PauseTiming();
    unlink(path.c_str());
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void SpillRestore(benchmark::State& state, StorageTier tier, bool measure_spill) {
  Fixture& f = Shared();
  // One untimed round first: the steady state of a sidecar that spills and restores, with the
  // host buffers already mapped (cache/spill_buffers.h), as memcpy's buffers are. The first spill
  // after start pays a page fault per page on top (BM_SpillHostCold measures it).
  if (!f.pool->Spill(f.session, f.sequence, tier).ok() ||
      !f.pool->Restore(f.session, f.sequence).ok()) {
    state.SkipWithError("warm-up spill/restore failed");
    return;
  }
  for (auto _ : state) {
    if (!measure_spill) state.PauseTiming();
    absl::StatusOr<SpillResult> spilled = f.pool->Spill(f.session, f.sequence, tier);
    if (!spilled.ok()) state.SkipWithError(std::string(spilled.status().message()).c_str());
    if (measure_spill)
      state.PauseTiming();
    else
      state.ResumeTiming();
    absl::StatusOr<SpillResult> restored = f.pool->Restore(f.session, f.sequence);
    if (!restored.ok()) state.SkipWithError(std::string(restored.status().message()).c_str());
    if (measure_spill) state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void BM_SpillHost(benchmark::State& state) { SpillRestore(state, StorageTier::kHost, true); }
// A spill to the host tier with no idle spill buffers: every page of the copy is new.
void BM_SpillHostCold(benchmark::State& state) {
  Fixture& f = Shared();
  for (auto _ : state) {
    const size_t idle = SpillBuffers::Default().max_idle_bytes();
    SpillBuffers::Default().SetMaxIdleBytes(0);  // frees the idle buffers
    SpillBuffers::Default().SetMaxIdleBytes(idle);
    absl::StatusOr<SpillResult> spilled = f.pool->Spill(f.session, f.sequence, StorageTier::kHost);
    if (!spilled.ok()) state.SkipWithError(std::string(spilled.status().message()).c_str());
    state.PauseTiming();
    absl::StatusOr<SpillResult> restored = f.pool->Restore(f.session, f.sequence);
    if (!restored.ok()) state.SkipWithError(std::string(restored.status().message()).c_str());
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}
void BM_RestoreHost(benchmark::State& state) { SpillRestore(state, StorageTier::kHost, false); }
void BM_SpillDisk(benchmark::State& state) { SpillRestore(state, StorageTier::kDisk, true); }
void BM_RestoreDisk(benchmark::State& state) { SpillRestore(state, StorageTier::kDisk, false); }

BENCHMARK(BM_Memcpy256MiB)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_ArenaRead256MiB)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_ArenaWrite256MiB)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_ArenaRead256MiB_Pageable)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_ArenaWrite256MiB_Pageable)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(5)
    ->UseRealTime();
BENCHMARK(BM_WriteFdatasync256MiB)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_SpillHost)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_RestoreHost)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_SpillHostCold)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_SpillDisk)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_RestoreDisk)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  kvs::SharedSlot().reset();  // the pool removes its shared-memory arena
  std::filesystem::remove_all(kvs::BenchDir());
  return 0;
}
