#include "gpu/cpu/shm_arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/base/checked_math.h"
#include "gpu/device_counters.h"

namespace kvs {
namespace {

// glibc's memcpy of >= 4 KiB takes a slow path on some x86 parts (measured ~2.4 GB/s instead of
// 5-6 on this machine's AMD EPYC) when destination - source is 1..31 mod 64, which is the usual
// case between protobuf/malloc buffers and arena rows. Pieces of 2 KiB stay on the fast path
// whatever the alignment, at no cost when it is aligned.
void CopyInPieces(uint8_t* destination, const uint8_t* source, uint64_t bytes) {
  constexpr uint64_t kPiece = 2048;
  while (bytes > kPiece) {
    std::memcpy(destination, source, kPiece);
    destination += kPiece;
    source += kPiece;
    bytes -= kPiece;
  }
  if (bytes > 0) std::memcpy(destination, source, bytes);
}

std::atomic<uint64_t> g_next_generation{1};

uint32_t RandomSuffix() {
  uint32_t value = 0;
  if (getrandom(&value, sizeof(value), GRND_NONBLOCK) == static_cast<ssize_t>(sizeof(value))) {
    return value;
  }
  // No entropy available yet (early boot): uniqueness, not secrecy, is what matters here, and
  // O_EXCL catches collisions anyway.
  static std::atomic<uint64_t> counter{0};
  const uint64_t mix =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  return static_cast<uint32_t>(mix ^ (mix >> 32));
}

// Out of memory, disk, file size or file descriptors: the caller may retry later, nothing is
// broken.
bool IsSpaceError(int error) {
  return error == ENOSPC || error == ENOMEM || error == EFBIG || error == EMFILE || error == ENFILE;
}

absl::Status SystemError(int error, const std::string& what, const std::string& directory) {
  if (IsSpaceError(error)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " in ", directory, ": ", std::strerror(error)));
  }
  return absl::InternalError(absl::StrCat(what, " in ", directory, ": ", std::strerror(error)));
}

class ShmArena final : public Arena {
 public:
  ShmArena(int fd, uint8_t* base, ArenaHandle handle)
      : fd_(fd), base_(base), handle_(std::move(handle)) {}

  ~ShmArena() override {
    munmap(base_, handle_.size_bytes);
    close(fd_);
    if (!handle_.shm_path.empty()) unlink(handle_.shm_path.c_str());
  }

  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  uint8_t* data() override { return base_; }
  const uint8_t* data() const override { return base_; }
  uint64_t size_bytes() const override { return handle_.size_bytes; }
  const ArenaHandle& handle() const override { return handle_; }
  bool host_mapped() const override { return true; }

  absl::Status Write(uint64_t offset, const void* source, uint64_t bytes) override {
    if (auto status = CheckRange(offset, bytes, source, "Write"); !status.ok()) return status;
    DeviceCounters::ArenaWrite(bytes);
    CopyInPieces(base_ + offset, static_cast<const uint8_t*>(source), bytes);
    return absl::OkStatus();
  }

  absl::Status Read(uint64_t offset, void* destination, uint64_t bytes) const override {
    if (auto status = CheckRange(offset, bytes, destination, "Read"); !status.ok()) return status;
    DeviceCounters::ArenaRead(bytes);
    CopyInPieces(static_cast<uint8_t*>(destination), base_ + offset, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<int> DuplicateFd() const override {
    if (handle_.kind != ArenaHandle::Kind::kMemfd) return Arena::DuplicateFd();
    const int copy = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) {
      return SystemError(errno, "cannot duplicate the arena descriptor", "this process");
    }
    return copy;
  }

 private:
  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const void* buffer,
                          const char* op) const {
    const auto end = CheckedAdd(offset, bytes);
    if (!end || *end > handle_.size_bytes) {
      return absl::OutOfRangeError(absl::StrCat("arena ", op, " of ", bytes, " bytes at offset ",
                                                offset, " leaves the arena of ", handle_.size_bytes,
                                                " bytes"));
    }
    if (bytes > 0 && buffer == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("arena ", op, ": null buffer"));
    }
    return absl::OkStatus();
  }

  const int fd_;
  uint8_t* const base_;
  const ArenaHandle handle_;
};

// "<prefix>-<digits>-<digits>-<8 hex>": the names CreateShmArena gives, and nothing else.
bool IsArenaFileName(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() + 1 || name.compare(0, prefix.size(), prefix) != 0 ||
      name[prefix.size()] != '-') {
    return false;
  }
  const std::string rest = name.substr(prefix.size() + 1);
  size_t at = 0;
  for (int field = 0; field < 2; ++field) {
    const size_t begin = at;
    while (at < rest.size() && rest[at] >= '0' && rest[at] <= '9') ++at;
    if (at == begin || at >= rest.size() || rest[at] != '-') return false;
    ++at;
  }
  if (rest.size() - at != 8) return false;
  for (; at < rest.size(); ++at) {
    const char c = rest[at];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Reserves the file's storage. fallocate(2) is one call on tmpfs/ext4/xfs; posix_fallocate falls
// back to glibc's page-by-page emulation where the filesystem lacks it.
int ReserveStorage(int fd, uint64_t bytes) {
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) return EFBIG;
  const off_t length = static_cast<off_t>(bytes);
  if (fallocate(fd, 0, 0, length) == 0) return 0;
  if (errno != EOPNOTSUPP && errno != ENOSYS) return errno;
  return posix_fallocate(fd, 0, length);
}

// The default arena: anonymous memory no other process can open by name. The sidecar hands its
// descriptor to the one worker that attached (service/arena_fd_server.h). The seals keep the
// size fixed for the arena's life, so that neither side's mapping can be cut short under it (a
// shrink would turn the other side's accesses into SIGBUS); F_SEAL_SEAL stops the worker adding
// a write seal that would freeze the sidecar out of its own arena.
absl::StatusOr<std::unique_ptr<Arena>> CreateMemfdArena(uint64_t bytes,
                                                        const ArenaOptions& options) {
  const char* const where = "an anonymous memfd";
  const int fd = memfd_create(options.name_prefix.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return SystemError(errno, "cannot create the arena", where);
  auto fail = [&](int error, const char* what) {
    close(fd);
    return SystemError(error, absl::StrCat(what, " the arena memfd (", bytes, " bytes)"), where);
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail(errno, "cannot size");
  if (int error = ReserveStorage(fd, bytes); error != 0) return fail(error, "cannot reserve");
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail(errno, "cannot seal");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(errno, "cannot map");

  ArenaHandle handle;
  handle.kind = ArenaHandle::Kind::kMemfd;
  handle.size_bytes = bytes;
  handle.generation = g_next_generation.fetch_add(1, std::memory_order_relaxed);
  return std::unique_ptr<Arena>(new ShmArena(fd, static_cast<uint8_t*>(base), std::move(handle)));
}

}  // namespace

int RemoveStaleShmArenas(const ArenaOptions& options) {
  DIR* directory = opendir(options.shm_directory.c_str());
  if (directory == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = readdir(directory)) {
    const std::string name = entry->d_name;
    if (!IsArenaFileName(name, options.name_prefix)) continue;
    // Its creator must be gone from this PID namespace, and (below) hold no lock: the pid alone
    // could belong to another namespace sharing the directory, and the lock alone is not yet
    // taken in the instant between a live sidecar's open and its flock.
    const long pid = std::strtol(name.c_str() + options.name_prefix.size() + 1, nullptr, 10);
    if (pid <= 0 || pid > INT_MAX || kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) {
      continue;
    }
    const int fd = openat(dirfd(directory), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    struct stat st;
    // A live sidecar holds the lock; the kernel dropped a dead one's with its descriptors.
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
        flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (unlinkat(dirfd(directory), name.c_str(), 0) == 0) ++removed;
    }
    close(fd);
  }
  closedir(directory);
  return removed;
}

absl::StatusOr<std::unique_ptr<Arena>> CreateShmArena(uint64_t bytes, const ArenaOptions& options) {
  if (bytes == 0) return absl::InvalidArgumentError("arena size must be > 0 bytes");
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) ||
      bytes > std::numeric_limits<size_t>::max()) {
    return absl::ResourceExhaustedError(absl::StrCat("arena of ", bytes, " bytes is too large"));
  }
  if (options.name_prefix.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("arena name_prefix must not contain '/'");
  }
  if (!options.shm_names) return CreateMemfdArena(bytes, options);
  const std::string& directory = options.shm_directory;
  // The handle carries an absolute path: the worker resolves it from its own working directory.
  char resolved[PATH_MAX];
  if (realpath(directory.c_str(), resolved) == nullptr) {
    return SystemError(errno, "cannot resolve the shared-memory directory", directory);
  }

  {
    static std::mutex swept_mutex;
    static auto* swept = new std::set<std::pair<std::string, std::string>>;
    std::lock_guard<std::mutex> lock(swept_mutex);
    if (swept->emplace(resolved, options.name_prefix).second) {
      ArenaOptions sweep = options;
      sweep.shm_directory = resolved;
      RemoveStaleShmArenas(sweep);
    }
  }

  const uint64_t generation = g_next_generation.fetch_add(1, std::memory_order_relaxed);
  std::string path;
  int fd = -1;
  // O_EXCL makes a name collision (a leftover file, a random clash) visible; retry a few names.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    path = absl::StrFormat("%s/%s-%d-%d-%08x", resolved, options.name_prefix,
                           static_cast<int>(getpid()), generation, RandomSuffix());
    fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      return SystemError(errno, absl::StrCat("cannot create arena file ", path), directory);
    }
  }
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot find a free arena file name in ", directory));
  }
  auto fail = [&](int error, const char* what) {
    close(fd);
    unlink(path.c_str());
    return SystemError(error, absl::StrCat(what, " arena file ", path, " (", bytes, " bytes)"),
                       directory);
  };
  // Held until the arena is destroyed (the descriptor stays open): RemoveStaleShmArenas.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) return fail(errno, "cannot lock");
  // The process umask may have cleared bits but never adds any; fchmod pins exactly 0600.
  if (fchmod(fd, 0600) != 0) return fail(errno, "cannot chmod");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail(errno, "cannot size");
  if (int error = ReserveStorage(fd, bytes); error != 0) return fail(error, "cannot reserve");
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(errno, "cannot map");

  ArenaHandle handle;
  handle.kind = ArenaHandle::Kind::kSharedMemoryFile;
  handle.shm_path = path;
  handle.size_bytes = bytes;
  handle.generation = generation;
  return std::unique_ptr<Arena>(new ShmArena(fd, static_cast<uint8_t*>(base), std::move(handle)));
}

}  // namespace kvs
