// gpu/backend_factory: the build flag, the cached CUDA probe and the constructor answer with
// values and statuses on every build and host (with or without CUDA, with or without a device).
#include "gpu/backend_factory.h"

#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

TEST(BackendFactoryTest, CudaBuiltFollowsTheBuildFlag) {
#ifdef KVS_WITH_CUDA
  EXPECT_TRUE(CudaBuilt());
#else
  EXPECT_FALSE(CudaBuilt());
  EXPECT_EQ(ProbeCuda().devices, 0);
  EXPECT_EQ(ProbeCuda().detail, "this build has no CUDA backend");
#endif
}

TEST(BackendFactoryTest, ProbeIsCachedAndExplainsAnAbsentDevice) {
  const CudaProbe& first = ProbeCuda();
  EXPECT_EQ(&first, &ProbeCuda());
  EXPECT_GE(first.devices, 0);
  EXPECT_FALSE(first.detail.empty());  // the device's name, or why there is none
}

TEST(BackendFactoryTest, MakesTheCpuBackendAlways) {
  auto backend = MakeBackend(BackendKind::kCpu, 1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_TRUE((*backend)->healthy());
}

TEST(BackendFactoryTest, MakesTheSimulatedDeviceAlways) {
  auto backend = MakeBackend(BackendKind::kDeviceSim, 1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "device-sim");
  EXPECT_TRUE((*backend)->healthy());
  ArenaOptions options;
  options.name_prefix = "kvs-factory-test";
  auto arena = (*backend)->CreateArena(4096, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_FALSE((*arena)->host_mapped());  // reached through Read/Write and the kernels only
  EXPECT_EQ((*arena)->handle().kind, ArenaHandle::Kind::kMemfd);
  // The worker maps the host memory behind it, handed over as a descriptor.
  auto fd = (*arena)->DuplicateFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  close(*fd);
  // Host job arrays are staged: a KeyDiff job over host block table and scores runs.
  const float keys[4] = {1.0f, 0.0f, 0.0f, 1.0f};  // 2 slots of head_dim 2, one kv head
  ASSERT_TRUE((*arena)->Write(0, keys, sizeof(keys)).ok());
  const int32_t table[1] = {0};
  float scores[2] = {-5.0f, -5.0f};
  KeyDiffScoreJob job;
  job.keys.arena = (*arena)->data();
  job.keys.block_table = table;
  job.keys.count = 2;
  job.keys.num_kv_heads = 1;
  job.keys.head_dim = 2;
  job.keys.block_tokens = 2;
  job.keys.dtype = DType::kFloat32;
  job.keys.block_bytes = 32;
  job.scores = scores;
  ASSERT_TRUE((*backend)->KeyDiffScores({job}, nullptr).ok());
  EXPECT_NE(scores[0], -5.0f);
  EXPECT_NE(scores[1], -5.0f);
}

TEST(BackendFactoryTest, CudaBackendOnlyWithABuildAndADevice) {
  auto backend = MakeBackend(BackendKind::kCuda);
  if (CudaBuilt() && ProbeCuda().devices > 0) {
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->name(), "cuda");
    return;
  }
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(backend.status().message()),
              HasSubstr(CudaBuilt() ? "no CUDA device" : "this build has no CUDA backend"));
}

}  // namespace
}  // namespace kvs
