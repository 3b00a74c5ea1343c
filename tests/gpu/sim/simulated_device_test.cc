// The simulated device (gpu/sim/simulated_device.h) on its own: its "device" memory faults when
// the host touches it, its kernels refuse host pointers naming the job and field, its copies
// stay inside allocations, its arena is the CPU backend's shm file behind a PROT_NONE range, and
// page-locked host memory takes the device path of the staging decorator.
#include "gpu/sim/simulated_device.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/staging_backend.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

class SimulatedDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = MakeSimulatedDevice(1);
    ArenaOptions options;
    options.name_prefix = "kvs-sim-test";
    auto arena = device_.backend->CreateArena(1 << 16, options);
    ASSERT_TRUE(arena.ok()) << arena.status();
    arena_ = *std::move(arena);
  }

  SimulatedDevice device_;
  std::unique_ptr<Arena> arena_;
};

using SimulatedDeviceDeathTest = SimulatedDeviceTest;

TEST_F(SimulatedDeviceDeathTest, HostAccessToArenaOrScratchFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        volatile const uint8_t* p = arena_->data();
        std::printf("%d\n", p[100]);
      },
      "");
  auto scratch = device_.memory->Allocate(64);
  ASSERT_TRUE(scratch.ok());
  EXPECT_DEATH(
      {
        volatile uint8_t* p = static_cast<uint8_t*>(*scratch);
        p[0] = 1;
      },
      "");
  device_.memory->Free(*scratch);
}

TEST_F(SimulatedDeviceTest, ArenaIsTheShmFileReachedThroughReadAndWrite) {
  EXPECT_EQ(device_.backend->name(), "device-sim");
  EXPECT_EQ(arena_->handle().kind, ArenaHandle::Kind::kMemfd);
  auto fd = arena_->DuplicateFd();  // what the worker maps
  ASSERT_TRUE(fd.ok()) << fd.status();
  close(*fd);
  EXPECT_EQ(arena_->size_bytes(), 1u << 16);
  EXPECT_FALSE(arena_->host_mapped());
  const char text[] = "kv bytes";
  ASSERT_TRUE(arena_->Write(1000, text, sizeof(text)).ok());
  char back[sizeof(text)] = {};
  ASSERT_TRUE(arena_->Read(1000, back, sizeof(back)).ok());
  EXPECT_STREQ(back, text);
  // The device copy sees the same bytes.
  ASSERT_TRUE(device_.memory->CopyToHost(back, arena_->data() + 1000, sizeof(back), nullptr).ok());
  EXPECT_STREQ(back, text);
  EXPECT_EQ(arena_->Write(1 << 16, text, 1).code(), absl::StatusCode::kOutOfRange);
}

TEST_F(SimulatedDeviceTest, KernelsRefuseHostPointersNamingJobAndField) {
  std::vector<int32_t> table = {0, 1};
  std::vector<float> scores(16);
  KeyDiffScoreJob job;
  job.keys.arena = arena_->data();
  job.keys.block_table = table.data();  // host memory: not device memory
  job.keys.count = 4;
  job.keys.num_kv_heads = 2;
  job.keys.head_dim = 8;
  job.keys.block_tokens = 4;
  job.keys.dtype = DType::kFloat32;
  job.keys.block_bytes = 2 * 2 * 4 * 8 * 4;
  job.scores = scores.data();
  absl::Status status = device_.backend->KeyDiffScores({job, job}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "keydiff job 0: keys.block_table is not device memory");

  // On the device, but shorter than the job says: the extent is checked.
  auto scratch = device_.memory->Allocate(256);
  ASSERT_TRUE(scratch.ok());
  ASSERT_TRUE(device_.memory->CopyToDevice(*scratch, table.data(), 8, nullptr).ok());
  job.keys.block_table = static_cast<const int32_t*>(*scratch);
  job.scores = reinterpret_cast<float*>(static_cast<uint8_t*>(*scratch) + 256 - 16);  // 4 floats
  status = device_.backend->KeyDiffScores({job}, nullptr);
  EXPECT_EQ(status.message(), "keydiff job 0: scores (32 bytes) leaves its device allocation");
  job.scores = reinterpret_cast<float*>(static_cast<uint8_t*>(*scratch) + 64);
  EXPECT_TRUE(device_.backend->KeyDiffScores({job}, nullptr).ok());
  device_.memory->Free(*scratch);

  // The host buffer of a host row copy must be page-locked host memory.
  std::vector<uint64_t> offsets = {0};
  auto device_offsets = device_.memory->Allocate(8);
  ASSERT_TRUE(device_offsets.ok());
  ASSERT_TRUE(device_.memory->CopyToDevice(*device_offsets, offsets.data(), 8, nullptr).ok());
  const auto* d_offsets = static_cast<const uint64_t*>(*device_offsets);
  uint8_t host[32] = {};
  HostRowCopyJob copy{arena_->data(), host, d_offsets, d_offsets, 1, 32, true};
  EXPECT_EQ(device_.backend->CopyHostRows({copy}, nullptr).message(),
            "host row copy job 0: host is not page-locked host memory");
  copy.host = arena_->data();
  EXPECT_EQ(device_.backend->CopyHostRows({copy}, nullptr).message(),
            "host row copy job 0: host is device memory; it must be page-locked host memory");
  device_.memory->Free(*device_offsets);
}

TEST_F(SimulatedDeviceTest, CopiesStayInsideOneAllocation) {
  std::vector<uint8_t> host(512, 7);
  auto scratch = device_.memory->Allocate(100);  // 256 bytes reserved
  ASSERT_TRUE(scratch.ok());
  auto* p = static_cast<uint8_t*>(*scratch);
  EXPECT_TRUE(device_.memory->CopyToDevice(p, host.data(), 256, nullptr).ok());
  EXPECT_EQ(device_.memory->CopyToDevice(p + 1, host.data(), 256, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_.memory->CopyToDevice(host.data(), host.data() + 256, 16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // destination is not device memory
  EXPECT_EQ(
      device_.memory->CopyToHost(host.data(), arena_->data() + (1 << 16) - 8, 16, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(device_.memory->IsDeviceAccessible(host.data()));
  EXPECT_FALSE(device_.memory->IsDeviceAccessible(nullptr));
  EXPECT_TRUE(device_.memory->IsDeviceAccessible(p + 255));
  device_.memory->Free(p);
}

TEST_F(SimulatedDeviceTest, FreedScratchIsReused) {
  const SimulatedDeviceStats before = device_.control->stats();
  auto first = device_.memory->Allocate(1000);
  ASSERT_TRUE(first.ok());
  device_.memory->Free(*first);
  auto second = device_.memory->Allocate(900);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first);
  auto third = device_.memory->Allocate(5000);  // larger than the cached one: a new range
  ASSERT_TRUE(third.ok());
  const SimulatedDeviceStats after = device_.control->stats();
  EXPECT_EQ(after.allocate_calls - before.allocate_calls, 3u);
  EXPECT_EQ(after.reservations - before.reservations, 2u);
  EXPECT_EQ(after.live_scratch, 2u);
  device_.memory->Free(*second);
  device_.memory->Free(*third);
  EXPECT_EQ(device_.control->stats().live_scratch, 0u);
  EXPECT_EQ(device_.memory->Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SimulatedDeviceTest, PageLockedHostTakesTheDevicePathThroughStaging) {
  // Registered host memory is device-accessible: the staging decorator stages only the offsets
  // (one upload) and the device kernel copies the rows, instead of one copy per run.
  std::shared_ptr<SimulatedDeviceControl> control = device_.control;
  std::unique_ptr<Arena> arena = std::move(arena_);
  std::unique_ptr<Backend> staged =
      MakeStagingBackend(std::move(device_.backend), std::move(device_.memory));
  std::vector<uint8_t> pinned(256);
  std::iota(pinned.begin(), pinned.end(), 0);
  control->RegisterPageLocked(pinned.data(), pinned.size());
  std::vector<uint64_t> arena_offsets = {0, 512, 64}, host_offsets = {0, 32, 64};
  const SimulatedDeviceStats before = control->stats();
  ASSERT_TRUE(staged
                  ->CopyHostRows({HostRowCopyJob{arena->data(), pinned.data(), arena_offsets.data(),
                                                 host_offsets.data(), 3, 32, false}},
                                 nullptr)
                  .ok());
  const SimulatedDeviceStats after = control->stats();
  EXPECT_EQ(after.copies_to_device - before.copies_to_device, 1u);  // the offsets
  EXPECT_EQ(after.allocate_calls - before.allocate_calls, 1u);
  std::vector<uint8_t> row(32);
  ASSERT_TRUE(arena->Read(512, row.data(), 32).ok());
  EXPECT_EQ(row[0], 32);
  EXPECT_EQ(row[31], 63);
  control->UnregisterPageLocked(pinned.data());
  // Unregistered, the rows are packed into the call's page-locked bounce buffer and the device
  // copies them from there: still one upload (the offsets) and no copy per run of rows.
  const SimulatedDeviceStats again = control->stats();
  ASSERT_TRUE(staged
                  ->CopyHostRows({HostRowCopyJob{arena->data(), pinned.data(), arena_offsets.data(),
                                                 host_offsets.data(), 3, 32, false}},
                                 nullptr)
                  .ok());
  EXPECT_EQ(control->stats().copies_to_device - again.copies_to_device, 1u);
  EXPECT_EQ(control->stats().allocate_calls - again.allocate_calls, 1u);
  ASSERT_TRUE(arena->Read(64, row.data(), 32).ok());
  EXPECT_EQ(row[0], 64);
  EXPECT_EQ(row[31], 95);
}

}  // namespace
}  // namespace kvs
