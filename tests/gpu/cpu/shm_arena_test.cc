#include "gpu/cpu/shm_arena.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// A scratch directory so the tests neither depend on nor litter /dev/shm.
class ShmArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/kvs_arena_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    options_.shm_directory = dir_;
    options_.name_prefix = "unit";
    options_.shm_names = true;  // the named files; MemfdArena* tests clear it
  }
  void TearDown() override { rmdir(dir_.c_str()); }

  std::string dir_;
  ArenaOptions options_;
};

TEST_F(ShmArenaTest, MemfdArenaIsSealedAnonymousAndLeavesNoFile) {
  options_.shm_names = false;
  auto arena = CreateShmArena(8192, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaHandle& handle = (*arena)->handle();
  EXPECT_EQ(handle.kind, ArenaHandle::Kind::kMemfd);
  EXPECT_EQ(handle.shm_path, "");
  EXPECT_TRUE((*arena)->host_mapped());
  // Nothing appears in the shared-memory directory.
  EXPECT_EQ(rmdir(dir_.c_str()), 0) << "the directory is not empty";
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);

  auto fd = (*arena)->DuplicateFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_NE(fcntl(*fd, F_GETFD) & FD_CLOEXEC, 0);
  const int seals = fcntl(*fd, F_GET_SEALS);
  EXPECT_EQ(seals, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(ftruncate(*fd, 4096), 0);
  EXPECT_NE(ftruncate(*fd, 1 << 20), 0);
  EXPECT_NE(fcntl(*fd, F_ADD_SEALS, F_SEAL_WRITE), 0) << "a worker must not freeze the arena";
  struct stat st;
  ASSERT_EQ(fstat(*fd, &st), 0);
  EXPECT_EQ(st.st_size, 8192);
  // The worker's mapping of the descriptor is the sidecar's memory.
  void* mapped = mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  close(*fd);
  const uint32_t value = 0xfeedbeef;
  ASSERT_TRUE((*arena)->Write(4096, &value, sizeof(value)).ok());
  uint32_t seen = 0;
  std::memcpy(&seen, static_cast<uint8_t*>(mapped) + 4096, sizeof(seen));
  EXPECT_EQ(seen, value);
  munmap(mapped, 8192);
}

TEST_F(ShmArenaTest, NamedArenaHasNoDescriptorToHandOut) {
  auto arena = CreateShmArena(4096, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->DuplicateFd().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShmArenaTest, CreatesPrivateFileNamedByPrefixPidAndGeneration) {
  const mode_t old_umask = umask(0);  // a permissive umask must not widen the mode
  auto arena = CreateShmArena(4096, options_);
  umask(old_umask);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaHandle& handle = (*arena)->handle();
  EXPECT_EQ(handle.kind, ArenaHandle::Kind::kSharedMemoryFile);
  EXPECT_EQ(handle.size_bytes, 4096u);
  EXPECT_EQ((*arena)->size_bytes(), 4096u);
  EXPECT_THAT(handle.shm_path, StartsWith(dir_ + "/unit-" + std::to_string(getpid()) + "-" +
                                          std::to_string(handle.generation) + "-"));
  EXPECT_EQ(handle.shm_path.size(), (dir_ + "/unit-" + std::to_string(getpid()) + "-" +
                                     std::to_string(handle.generation) + "-")
                                            .size() +
                                        8);
  struct stat st;
  ASSERT_EQ(stat(handle.shm_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4096u);
}

TEST_F(ShmArenaTest, GenerationsAndPathsAreUnique) {
  std::set<uint64_t> generations;
  std::set<std::string> paths;
  std::vector<std::unique_ptr<Arena>> arenas;
  for (int i = 0; i < 5; ++i) {
    auto arena = CreateShmArena(100, options_);
    ASSERT_TRUE(arena.ok()) << arena.status();
    generations.insert((*arena)->handle().generation);
    paths.insert((*arena)->handle().shm_path);
    arenas.push_back(*std::move(arena));
  }
  EXPECT_EQ(generations.size(), 5u);
  EXPECT_EQ(paths.size(), 5u);
}

TEST_F(ShmArenaTest, SecondMappingSharesBytesBothWays) {
  auto arena = CreateShmArena(8192, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const int fd = open((*arena)->handle().shm_path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* mapped = mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* other = static_cast<uint8_t*>(mapped);

  const char hello[] = "written by the sidecar";
  ASSERT_TRUE((*arena)->Write(5000, hello, sizeof(hello)).ok());
  EXPECT_EQ(std::memcmp(other + 5000, hello, sizeof(hello)), 0);
  EXPECT_EQ(std::memcmp((*arena)->data() + 5000, hello, sizeof(hello)), 0);

  const char reply[] = "written by the worker";
  std::memcpy(other + 8192 - sizeof(reply), reply, sizeof(reply));
  char read_back[sizeof(reply)] = {};
  ASSERT_TRUE((*arena)->Read(8192 - sizeof(reply), read_back, sizeof(reply)).ok());
  EXPECT_STREQ(read_back, reply);
  munmap(mapped, 8192);
}

TEST_F(ShmArenaTest, FileIsUnlinkedOnDestruction) {
  auto arena = CreateShmArena(4096, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const std::string path = (*arena)->handle().shm_path;
  EXPECT_TRUE(FileExists(path));
  arena->reset();
  EXPECT_FALSE(FileExists(path));
}

TEST_F(ShmArenaTest, OutOfRangeAccessIsRefusedAndCopiesNothing) {
  auto arena = CreateShmArena(1024, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  std::vector<uint8_t> buffer(2048, 0xab);
  EXPECT_EQ((*arena)->Write(1000, buffer.data(), 25).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*arena)->data()[1000], 0) << "a refused write must copy nothing";
  EXPECT_EQ((*arena)->Write(0, buffer.data(), 1025).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*arena)->Write(1025, buffer.data(), 0).code(), absl::StatusCode::kOutOfRange);
  // offset + bytes wraps around 2^64: must be caught, not treated as a small range.
  EXPECT_EQ((*arena)->Write(std::numeric_limits<uint64_t>::max() - 10, buffer.data(), 20).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*arena)->Read(8, buffer.data(), std::numeric_limits<uint64_t>::max()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(buffer[0], 0xab);
  EXPECT_EQ((*arena)->Read(1024, buffer.data(), 1).code(), absl::StatusCode::kOutOfRange);

  EXPECT_TRUE((*arena)->Write(1000, buffer.data(), 24).ok());
  EXPECT_TRUE((*arena)->Read(1024, buffer.data(), 0).ok());
  EXPECT_TRUE((*arena)->Read(0, buffer.data(), 1024).ok());
}

// The default block copies (runs of adjacent blocks as one Read or Write): every block lands at
// its place in the host buffer and back, and a block outside the arena refuses the whole call
// before anything is copied.
TEST_F(ShmArenaTest, BlockCopiesMoveEveryBlockAndRefuseOneOutsideBeforeCopying) {
  constexpr uint64_t kBlock = 64;
  auto arena = CreateShmArena(16 * kBlock, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  for (uint64_t i = 0; i < 16 * kBlock; ++i) (*arena)->data()[i] = static_cast<uint8_t>(i * 7);
  // Runs: {3,4,5}, {9}, {1,2}, {15}.
  const std::vector<uint64_t> blocks = {3, 4, 5, 9, 1, 2, 15};
  std::vector<uint64_t> offsets;
  for (uint64_t b : blocks) offsets.push_back(b * kBlock);
  std::vector<uint8_t> host(blocks.size() * kBlock, 0);
  ASSERT_TRUE((*arena)->ReadBlocks(offsets, kBlock, host.data()).ok());
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (uint64_t j = 0; j < kBlock; ++j) {
      ASSERT_EQ(host[i * kBlock + j], static_cast<uint8_t>((blocks[i] * kBlock + j) * 7))
          << "block " << i << " byte " << j;
    }
  }
  // Written back reversed: block i of the host buffer goes to blocks[n - 1 - i].
  std::vector<uint64_t> reversed(offsets.rbegin(), offsets.rend());
  ASSERT_TRUE((*arena)->WriteBlocks(reversed, kBlock, host.data()).ok());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const uint64_t at = reversed[i];
    EXPECT_EQ(std::vector<uint8_t>((*arena)->data() + at, (*arena)->data() + at + kBlock),
              std::vector<uint8_t>(host.begin() + i * kBlock, host.begin() + (i + 1) * kBlock))
        << "block " << i;
  }
  const std::vector<uint8_t> before((*arena)->data(), (*arena)->data() + 16 * kBlock);
  std::vector<uint8_t> ones(3 * kBlock, 1);
  EXPECT_EQ((*arena)->WriteBlocks({0, 16 * kBlock - 8, kBlock}, kBlock, ones.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*arena)->WriteBlocks({0, std::numeric_limits<uint64_t>::max() - 8}, kBlock,
                                  ones.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(std::vector<uint8_t>((*arena)->data(), (*arena)->data() + 16 * kBlock), before)
      << "a refused block write must copy nothing, not even the blocks before the bad one";
  std::vector<uint8_t> untouched(3 * kBlock, 0xcd);
  EXPECT_EQ((*arena)->ReadBlocks({0, 17 * kBlock}, kBlock, untouched.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(untouched, std::vector<uint8_t>(3 * kBlock, 0xcd));
  EXPECT_EQ((*arena)->ReadBlocks({0}, kBlock, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*arena)->ReadBlocks({}, kBlock, nullptr).ok());
}

TEST_F(ShmArenaTest, ZeroBytesIsInvalid) {
  auto arena = CreateShmArena(0, options_);
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmArenaTest, PrefixWithASlashIsInvalid) {
  options_.name_prefix = "../escape";
  EXPECT_EQ(CreateShmArena(4096, options_).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmArenaTest, MissingDirectoryIsAnInternalErrorNamingIt) {
  options_.shm_directory = dir_ + "/does-not-exist";
  auto arena = CreateShmArena(4096, options_);
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(arena.status().message(), HasSubstr("does-not-exist"));
}

TEST_F(ShmArenaTest, ImpossibleSizeIsResourceExhaustedAndLeavesNoFile) {
  // Far beyond any tmpfs or disk: the reservation fails up front instead of a later SIGBUS.
  auto arena = CreateShmArena(uint64_t{1} << 60, options_);
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kResourceExhausted) << arena.status();
  EXPECT_THAT(arena.status().message(), HasSubstr(dir_));
  EXPECT_EQ(rmdir(dir_.c_str()), 0) << "the failed arena left a file behind";
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
}

TEST_F(ShmArenaTest, BackendCreatesArenasThroughTheSameCode) {
  auto backend = MakeCpuBackend(1);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_TRUE(backend->healthy());
  auto arena = backend->CreateArena(4096, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_THAT((*arena)->handle().shm_path, StartsWith(dir_ + "/unit-"));
}

// A pid that no live process has: a child that exited and was reaped.
pid_t DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

std::string MakeFile(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  EXPECT_GE(fd, 0) << path;
  if (fd >= 0) close(fd);
  return path;
}

TEST_F(ShmArenaTest, ArenaOfAKilledProcessIsRemovedByTheNextSweep) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    // Creates an arena, reports its path and dies without running any destructor.
    auto arena = CreateShmArena(1 << 16, options_);
    const std::string path = arena.ok() ? (*arena)->handle().shm_path : "";
    if (write(pipe_fds[1], path.data(), path.size()) < 0) _exit(2);
    close(pipe_fds[1]);
    raise(SIGKILL);
    _exit(1);
  }
  close(pipe_fds[1]);
  char buffer[PATH_MAX] = {};
  const ssize_t got = read(pipe_fds[0], buffer, sizeof(buffer) - 1);
  close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_GT(got, 0);
  const std::string path(buffer, static_cast<size_t>(got));
  ASSERT_TRUE(FileExists(path)) << "the killed child's arena should be left behind";

  // Look-alike names stay.
  const std::string other = MakeFile(dir_, "unit-x1-2-0000abcd");
  const std::string foreign = MakeFile(dir_, "other-" + std::to_string(DeadPid()) + "-1-0000abcd");
  EXPECT_EQ(RemoveStaleShmArenas(options_), 1);
  EXPECT_FALSE(FileExists(path));
  EXPECT_TRUE(FileExists(other));
  EXPECT_TRUE(FileExists(foreign));
  // So does a live arena of this process.
  auto live = CreateShmArena(1 << 16, options_);
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(RemoveStaleShmArenas(options_), 0);
  EXPECT_TRUE(FileExists((*live)->handle().shm_path));
  unlink(other.c_str());
  unlink(foreign.c_str());
}

TEST_F(ShmArenaTest, ALockedArenaIsKeptEvenWhenItsPidIsUnknown) {
  // What a sidecar in another PID namespace looks like: a pid that is not ours, the lock held.
  const std::string path = MakeFile(dir_, "unit-" + std::to_string(DeadPid()) + "-7-0123abcd");
  const int holder = open(path.c_str(), O_RDONLY);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(flock(holder, LOCK_EX | LOCK_NB), 0);
  EXPECT_EQ(RemoveStaleShmArenas(options_), 0);
  EXPECT_TRUE(FileExists(path));
  close(holder);  // the "sidecar" dies: its lock goes with it
  EXPECT_EQ(RemoveStaleShmArenas(options_), 1);
  EXPECT_FALSE(FileExists(path));
}

TEST_F(ShmArenaTest, FirstArenaInADirectorySweepsIt) {
  const std::string stale = MakeFile(dir_, "unit-" + std::to_string(DeadPid()) + "-3-00c0ffee");
  auto arena = CreateShmArena(1 << 16, options_);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_FALSE(FileExists(stale));
}

}  // namespace
}  // namespace kvs
