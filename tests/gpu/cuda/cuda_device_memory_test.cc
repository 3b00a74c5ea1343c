// CudaDeviceMemory (gpu/cuda/cuda_device_memory.h) and the staging decorator over the CUDA
// backend (MakeBackend(BackendKind::kCuda)): host job arrays reach the device and results come
// back. Built only with CUDA; without a device every test reports itself skipped by name.
#include "gpu/cuda/cuda_device_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "gpu/base/dtype.h"
#include "gpu/cuda/cuda_backend.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

class CudaStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    memory_ = MakeCudaDeviceMemory(0);
    auto backend = MakeBackend(BackendKind::kCuda);
    ASSERT_TRUE(backend.ok()) << backend.status();
    staged_ = *std::move(backend);
    cpu_ = MakeCpuBackend(2);
  }

  std::unique_ptr<DeviceMemory> memory_;
  std::unique_ptr<Backend> staged_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(CudaStagingTest, MemoryAllocatesCopiesAndKnowsDevicePointers) {
  auto p = memory_->Allocate(1000);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(memory_->IsDeviceAccessible(*p));
  std::vector<uint8_t> host(1000), back(1000);
  std::iota(host.begin(), host.end(), 0);
  EXPECT_FALSE(memory_->IsDeviceAccessible(host.data()));  // pageable
  ASSERT_TRUE(memory_->CopyToDevice(*p, host.data(), host.size(), nullptr).ok());
  ASSERT_TRUE(memory_->CopyToHost(back.data(), *p, back.size(), nullptr).ok());
  EXPECT_EQ(back, host);
  memory_->Free(*p);
  auto again = memory_->Allocate(800);  // from the pool the first went back to
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(memory_->IsDeviceAccessible(*again));
  memory_->Free(*again);
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, 4096, cudaHostAllocMapped), cudaSuccess);
  EXPECT_TRUE(memory_->IsDeviceAccessible(pinned));
  cudaFreeHost(pinned);
}

TEST_F(CudaStagingTest, HostJobArraysReachTheDevice) {
  EXPECT_EQ(staged_->name(), "cuda");
  // One fp32 layer: 2 kv heads, 40 slots, head_dim 16, blocks of 8 tokens, in both arenas.
  const int heads = 2, count = 40, dim = 16, block_tokens = 8;
  const uint64_t block_bytes = 2ull * heads * block_tokens * dim * 4;
  const uint64_t arena_bytes = 8 * block_bytes;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> init(arena_bytes / 4);
  for (float& x : init) x = normal(rng);
  auto cpu_arena = cpu_->CreateArena(arena_bytes, ArenaOptions());
  auto dev_arena = staged_->CreateArena(arena_bytes, ArenaOptions());
  ASSERT_TRUE(cpu_arena.ok() && dev_arena.ok());
  ASSERT_TRUE((*cpu_arena)->Write(0, init.data(), arena_bytes).ok());
  ASSERT_TRUE((*dev_arena)->Write(0, init.data(), arena_bytes).ok());
  std::vector<int32_t> table = {5, 1, 7, 0, 3};
  PagedLayerView view;
  view.block_table = table.data();
  view.count = count;
  view.num_kv_heads = heads;
  view.head_dim = dim;
  view.block_tokens = block_tokens;
  view.dtype = DType::kFloat32;
  view.block_bytes = block_bytes;
  std::vector<float> cpu_scores(heads * count), dev_scores(heads * count, -9.0f);
  KeyDiffScoreJob job;
  job.keys = view;
  job.keys.arena = (*cpu_arena)->data();
  job.scores = cpu_scores.data();
  ASSERT_TRUE(cpu_->KeyDiffScores({job}, nullptr).ok());
  job.keys.arena = (*dev_arena)->data();
  job.scores = dev_scores.data();
  ASSERT_TRUE(staged_->KeyDiffScores({job}, nullptr).ok());
  for (size_t i = 0; i < cpu_scores.size(); ++i) {
    EXPECT_NEAR(dev_scores[i], cpu_scores[i], std::max(1e-4f, 2e-5f * std::fabs(cpu_scores[i])))
        << i;
  }
  // Pageable host rows both ways, coalesced into runs: bit-exact.
  std::vector<uint64_t> arena_offsets = {0, 64, 128, 4096}, host_offsets = {0, 64, 128, 256};
  std::vector<uint8_t> host(512), back(512);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(
      staged_
          ->CopyHostRows({HostRowCopyJob{(*dev_arena)->data(), host.data(), arena_offsets.data(),
                                         host_offsets.data(), 4, 64, false}},
                         nullptr)
          .ok());
  ASSERT_TRUE(
      staged_
          ->CopyHostRows({HostRowCopyJob{(*dev_arena)->data(), back.data(), arena_offsets.data(),
                                         host_offsets.data(), 4, 64, true}},
                         nullptr)
          .ok());
  for (uint64_t h : host_offsets) {
    EXPECT_EQ(std::memcmp(back.data() + h, host.data() + h, 64), 0) << "host offset " << h;
  }
  // A host arena is refused before anything runs.
  job.keys.arena = (*cpu_arena)->data();
  EXPECT_EQ(staged_->KeyDiffScores({job}, nullptr).message(),
            "keydiff job 0: keys.arena is not device memory");
  EXPECT_TRUE(staged_->healthy());
}

}  // namespace
}  // namespace kvs
