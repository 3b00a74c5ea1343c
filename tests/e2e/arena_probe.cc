// kvs_e2e_arena_probe: the "other process of the same uid" of the arena isolation tests. It tries
// every way such a process has to reach a session's arena memory in a running sidecar and prints
// one line per way, "<way>=<count or outcome>", then exits 0:
//   shm_names=N            arena files of this sidecar in the shm directory (name has -<pid>-)
//   shm_opened=N           of those, opened read/write
//   proc_fd_opened=N       /proc/<pid>/fd/* entries opened (memfds and files alike)
//   map_files_opened=N     /proc/<pid>/map_files/* entries opened
//   proc_mem_opened=0|1    /proc/<pid>/mem opened for reading
//   fetch_<label>=GOT|REFUSED <reason>   FETCH <session> <nonce> on the arena socket
// Usage: kvs_e2e_arena_probe <sidecar pid> <shm dir> <socket path> <session id> [label=nonce ...]
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvsidecar/client.h"

namespace {

// Opens every entry of `directory` (read/write, else read-only); returns how many opened, or -1
// if the directory cannot be listed.
int OpenEntries(const std::string& directory) {
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return -1;
  int opened = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const std::string path = absl::StrCat(directory, "/", entry->d_name);
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
      ++opened;
      close(fd);
    }
  }
  closedir(dir);
  return opened;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s <pid> <shm dir> <socket> <session> [label=nonce ...]\n",
                 argv[0]);
    return 2;
  }
  const std::string pid = argv[1];
  const std::string shm_dir = argv[2];
  const std::string socket_path = argv[3];
  const std::string session_id = argv[4];

  int names = 0;
  int shm_opened = 0;
  if (DIR* dir = opendir(shm_dir.c_str()); dir != nullptr) {
    const std::string marker = absl::StrCat("-", pid, "-");
    while (const dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.rfind("kvsidecar", 0) != 0 || name.find(marker) == std::string::npos) continue;
      ++names;
      const int fd = open(absl::StrCat(shm_dir, "/", name).c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        ++shm_opened;
        close(fd);
      }
    }
    closedir(dir);
  }
  std::printf("shm_names=%d\nshm_opened=%d\n", names, shm_opened);
  std::printf("proc_fd_opened=%d\n", std::max(0, OpenEntries(absl::StrCat("/proc/", pid, "/fd"))));
  std::printf("map_files_opened=%d\n",
              std::max(0, OpenEntries(absl::StrCat("/proc/", pid, "/map_files"))));
  const int mem = open(absl::StrCat("/proc/", pid, "/mem").c_str(), O_RDONLY | O_CLOEXEC);
  std::printf("proc_mem_opened=%d\n", mem >= 0 ? 1 : 0);
  if (mem >= 0) close(mem);

  for (int i = 5; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string label = arg.substr(0, eq);
    const std::string nonce = eq == std::string::npos ? "" : arg.substr(eq + 1);
    auto fd = kvsidecar::FetchArenaFd(socket_path, session_id, nonce, absl::Seconds(5));
    if (fd.ok()) {
      std::printf("fetch_%s=GOT\n", label.c_str());
      close(*fd);
    } else {
      std::printf("fetch_%s=REFUSED %s\n", label.c_str(), std::string(fd.status().message()).c_str());
    }
  }
  std::fflush(stdout);
  return 0;
}
