// Unit tests of the client's CUDA IPC logic (clients/cpp/cuda_ipc.cc) that need no GPU: UUID text,
// the process-wide mapping cache (open once per session and generation, refuse stale and foreign
// handles and unknown devices, close on the last release) over a fake driver, and the answer of
// the default driver in a build without CUDA. The real cudaIpcOpenMemHandle path is exercised by
// tests/clients/cpp/cuda_ipc_e2e_test.cc on a GPU.
#include "clients/cpp/cuda_ipc.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/clients/cpp/fake_cuda_ipc_driver.h"

namespace kvsidecar::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kUuidA[] = "GPU-0123abcd-4567-89ef-0011-2233445566ff";
constexpr char kUuidB[] = "GPU-ffeeddcc-bbaa-9988-7766-554433221100";

CudaUuid Uuid(const char* text) {
  auto uuid = ParseCudaUuid(text);
  EXPECT_TRUE(uuid.ok()) << uuid.status();
  return uuid.ok() ? *uuid : CudaUuid{};
}

TEST(CudaUuidTest, ParsesTheSidecarsFormatAndFormatsItBack) {
  auto a = ParseCudaUuid(kUuidA);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)[0], 0x01);
  EXPECT_EQ((*a)[1], 0x23);
  EXPECT_EQ((*a)[15], 0xff);
  EXPECT_EQ(FormatCudaUuid(*a), kUuidA);
  // Upper case, no prefix and a MIG prefix name the same bytes.
  EXPECT_EQ(Uuid("GPU-0123ABCD-4567-89EF-0011-2233445566FF"), *a);
  EXPECT_EQ(Uuid("0123abcd-4567-89ef-0011-2233445566ff"), *a);
  EXPECT_EQ(Uuid("MIG-0123abcd-4567-89ef-0011-2233445566ff"), *a);
  EXPECT_NE(Uuid(kUuidB), *a);
}

TEST(CudaUuidTest, RefusesMalformedText) {
  for (const char* bad : {"", "GPU-", "GPU-0123abcd-4567-89ef-0011-2233445566f",  // short
                          "GPU-0123abcd-4567-89ef-0011-2233445566fff",            // long
                          "GPU-0123abcd4567-89ef-0011-2233445566ff-",             // dash moved
                          "GPU-0123abcg-4567-89ef-0011-2233445566ff",             // not hex
                          "XPU-0123abcd-4567-89ef-0011-2233445566ff", "0"}) {
    auto uuid = ParseCudaUuid(bad);
    EXPECT_EQ(uuid.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    if (!uuid.ok()) {
      EXPECT_THAT(uuid.status().message(), HasSubstr("not a CUDA device UUID"));
    }
  }
}

v1::ArenaHandle Handle(char fill, uint64_t generation, const char* uuid = kUuidB) {
  v1::ArenaHandle handle;
  handle.set_kind(v1::ArenaHandle::KIND_CUDA_IPC);
  handle.set_cuda_ipc_handle(std::string(kCudaIpcHandleBytes, fill));
  handle.set_cuda_device(3);
  handle.set_cuda_device_uuid(uuid);
  handle.set_size_bytes(1024);
  handle.set_generation(generation);
  return handle;
}

// The arena's device is ordinal 1 here (B), whatever the sidecar's ordinal (3) was.
class CudaIpcMappingsTest : public ::testing::Test {
 protected:
  FakeCudaIpcDriver driver_{{Uuid(kUuidA), Uuid(kUuidB)}};
  CudaIpcMappings mappings_;
};

TEST_F(CudaIpcMappingsTest, OpensOnTheDeviceWithTheHandlesUuidOnceAndClosesOnLastRelease) {
  auto first = mappings_.Acquire(&driver_, "s1", Handle('x', 7));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->device, 1);
  EXPECT_EQ(first->generation, 7u);
  EXPECT_EQ(first->size_bytes, 1024u);
  ASSERT_EQ(driver_.opens().size(), 1u);
  EXPECT_EQ(driver_.opens()[0].device, 1);
  EXPECT_EQ(driver_.opens()[0].handle, std::string(kCudaIpcHandleBytes, 'x'));
  // The same handle of the same session and generation: the cached mapping, not a second open.
  auto again = mappings_.Acquire(&driver_, "s1", Handle('x', 7));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->base, first->base);
  EXPECT_EQ(driver_.opens().size(), 1u);
  EXPECT_EQ(mappings_.open_mappings(), 1);

  ASSERT_TRUE(mappings_.Release("s1", 7).ok());
  EXPECT_TRUE(driver_.closes().empty());  // still referenced
  ASSERT_TRUE(mappings_.Release("s1", 7).ok());
  EXPECT_THAT(driver_.closes(), ElementsAre(1));
  EXPECT_EQ(mappings_.open_mappings(), 0);
  EXPECT_EQ(mappings_.Release("s1", 7).code(), absl::StatusCode::kNotFound);
}

TEST_F(CudaIpcMappingsTest, RefusesAnotherGenerationForAMappedSession) {
  ASSERT_TRUE(mappings_.Acquire(&driver_, "s1", Handle('x', 7)).ok());
  for (uint64_t generation : {6u, 8u}) {
    auto stale = mappings_.Acquire(&driver_, "s1", Handle('y', generation));
    EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(stale.status().message(), HasSubstr("generation 7 mapped"));
    EXPECT_THAT(stale.status().message(), HasSubstr(absl::StrCat("generation ", generation)));
  }
  // Other bytes under the same generation are refused too.
  auto other = mappings_.Acquire(&driver_, "s1", Handle('y', 7));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(driver_.opens().size(), 1u);
  // A release of the wrong generation releases nothing.
  EXPECT_EQ(mappings_.Release("s1", 8).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(mappings_.open_mappings(), 1);
  // Once released, a new generation of the session maps normally.
  ASSERT_TRUE(mappings_.Release("s1", 7).ok());
  auto fresh = mappings_.Acquire(&driver_, "s1", Handle('y', 8));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(driver_.opens().size(), 2u);
  ASSERT_TRUE(mappings_.Release("s1", 8).ok());
}

TEST_F(CudaIpcMappingsTest, RefusesTheHandleOfAnotherSession) {
  ASSERT_TRUE(mappings_.Acquire(&driver_, "s1", Handle('x', 7)).ok());
  auto foreign = mappings_.Acquire(&driver_, "s2", Handle('x', 7));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(foreign.status().message(), HasSubstr("arena of session s1"));
  // A different handle for the other session is fine.
  auto own = mappings_.Acquire(&driver_, "s2", Handle('z', 9));
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_NE(own->base, nullptr);
  EXPECT_EQ(mappings_.open_mappings(), 2);
  ASSERT_TRUE(mappings_.Release("s1", 7).ok());
  ASSERT_TRUE(mappings_.Release("s2", 9).ok());
}

TEST_F(CudaIpcMappingsTest, RefusesADeviceThisProcessDoesNotSee) {
  auto missing =
      mappings_.Acquire(&driver_, "s1", Handle('x', 7, "GPU-99999999-9999-9999-9999-999999999999"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(),
              HasSubstr("arena.cuda_device_uuid GPU-99999999-9999-9999-9999-999999999999"));
  EXPECT_THAT(missing.status().message(), HasSubstr(kUuidA));  // what the process does see
  EXPECT_THAT(missing.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES"));
  EXPECT_TRUE(driver_.opens().empty());

  FakeCudaIpcDriver no_devices({});
  auto none = mappings_.Acquire(&no_devices, "s1", Handle('x', 7));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("no CUDA device"));
  EXPECT_EQ(mappings_.open_mappings(), 0);
}

TEST_F(CudaIpcMappingsTest, MalformedHandlesAreInternalErrors) {
  v1::ArenaHandle short_handle = Handle('x', 7);
  short_handle.set_cuda_ipc_handle("abc");
  auto status = mappings_.Acquire(&driver_, "s1", short_handle).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("arena.cuda_ipc_handle has 3 bytes, expected 64"));
  status = mappings_.Acquire(&driver_, "s1", Handle('x', 7, "GPU-nope")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("arena.cuda_device_uuid"));
  v1::ArenaHandle shm = Handle('x', 7);
  shm.set_kind(v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
  EXPECT_EQ(mappings_.Acquire(&driver_, "s1", shm).status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(driver_.opens().empty());
}

TEST(CudaIpcDefaultDriverTest, SaysWhetherTheBuildHasCuda) {
  CudaIpcDriver* driver = CurrentCudaIpcDriver();
  ASSERT_NE(driver, nullptr);
  EXPECT_EQ(driver->available(), ClientBuiltWithCuda());
  if (!ClientBuiltWithCuda()) {
    CudaIpcMappings mappings;
    auto status = mappings.Acquire(driver, "s1", Handle('x', 7)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(status.message(), HasSubstr("built without CUDA"));
    EXPECT_THAT(status.message(), HasSubstr("KIND_CUDA_IPC"));
  }
  // The test hook replaces and restores the driver.
  FakeCudaIpcDriver fake({Uuid(kUuidA)});
  {
    ScopedCudaIpcDriver scoped(&fake);
    EXPECT_EQ(CurrentCudaIpcDriver(), &fake);
  }
  EXPECT_EQ(CurrentCudaIpcDriver(), driver);
}

}  // namespace
}  // namespace kvsidecar::internal
