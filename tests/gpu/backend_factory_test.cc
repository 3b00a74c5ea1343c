// gpu/backend_factory: the build flag, the cached CUDA probe and the constructor answer with
// values and statuses on every build and host (with or without CUDA, with or without a device).
#include "gpu/backend_factory.h"

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
