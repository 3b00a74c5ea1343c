#include "service/arena_fd_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "cache/clock.h"
#include "service/log.h"

namespace kvs {
namespace {

// Longer requests are refused; a real one is "FETCH " + a session id + " " + 64 hex digits.
constexpr size_t kMaxRequestBytes = 512;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

sockaddr_un AddressOf(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  return address;
}

// Makes `directory` ready to hold the socket: created 0700 when missing. An existing directory
// is left as it is (it may be a volume shared with the worker's container, or a system directory)
// but one that others may write is reported: whoever can write it could replace the socket.
absl::Status PrepareSocketDirectory(const std::string& directory, const std::string& socket_path) {
  struct stat st;
  if (stat(directory.c_str(), &st) != 0) {
    if (errno != ENOENT) return Errno(absl::StrCat("--arena_socket: cannot stat ", directory));
    if (mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--arena_socket: cannot create directory ", directory, ": ", std::strerror(errno)));
    }
    // The umask may have cleared bits but never adds any; pin exactly 0700.
    if (chmod(directory.c_str(), 0700) != 0) {
      return Errno(absl::StrCat("--arena_socket: cannot chmod ", directory));
    }
    return absl::OkStatus();
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--arena_socket: ", directory, " is not a directory"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    KVS_LOG(kWarning, "arena_socket_directory_not_private")
    ("directory", directory)("mode", absl::StrCat(absl::Hex(st.st_mode & 07777)))(
        "owner_uid", st.st_uid)("socket", socket_path)(
        "msg",
        "others may write this directory and could replace the socket; prefer a directory of "
        "mode 0700 owned by the sidecar's user");
  }
  return absl::OkStatus();
}

// A socket file left at `path`: removed when nothing answers on it (its sidecar died);
// UNAVAILABLE when a live process does, FAILED_PRECONDITION when it is not a socket.
absl::Status RemoveStaleSocket(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return Errno(absl::StrCat("--arena_socket: cannot stat ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--arena_socket: ", path, " exists and is not a socket"));
  }
  const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return Errno("socket");
  const sockaddr_un address = AddressOf(path);
  const bool live =
      connect(probe, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  const int connect_errno = errno;
  close(probe);
  if (live) {
    return absl::UnavailableError(
        absl::StrCat("--arena_socket: another process serves ", path, " (another sidecar?)"));
  }
  if (connect_errno != ECONNREFUSED && connect_errno != ENOENT) {
    return absl::FailedPreconditionError(absl::StrCat("--arena_socket: cannot probe ", path, ": ",
                                                      std::strerror(connect_errno)));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("--arena_socket: cannot remove the stale socket ", path));
  }
  KVS_LOG(kInfo, "arena_socket_stale_removed")("socket", path);
  return absl::OkStatus();
}

std::string RandomNonce() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    // Blocks only until the kernel's pool is initialised once after boot.
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

void SetTimeout(int fd, int option, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

// One reply, with `fd` attached as SCM_RIGHTS when >= 0. False if it could not be sent whole.
bool SendReply(int connection, const std::string& line, int fd) {
  iovec iov{const_cast<char*>(line.data()), line.size()};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
  }
  ssize_t sent;
  do {
    sent = sendmsg(connection, &message, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent == static_cast<ssize_t>(line.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<ArenaFdServer>> ArenaFdServer::Start(const Options& options,
                                                                     FdSource source) {
  if (options.socket_path.empty()) {
    return absl::InvalidArgumentError("--arena_socket must not be empty");
  }
  std::string path = options.socket_path;
  if (path[0] != '/') {
    // Workers resolve the path from their own working directory: hand them an absolute one.
    char cwd[4096];
    if (getcwd(cwd, sizeof(cwd)) == nullptr) return Errno("getcwd");
    path = absl::StrCat(cwd, "/", path);
  }
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--arena_socket: the path ", path, " is ", path.size(),
        " bytes; a Unix socket path must be shorter than ", sizeof(sockaddr_un{}.sun_path),
        " (set --arena_socket to a shorter path)"));
  }
  const size_t slash = path.rfind('/');
  const std::string directory = slash == 0 ? "/" : path.substr(0, slash);
  if (absl::Status status = PrepareSocketDirectory(directory, path); !status.ok()) return status;
  if (absl::Status status = RemoveStaleSocket(path); !status.ok()) return status;

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  const sockaddr_un address = AddressOf(path);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const absl::Status status = absl::FailedPreconditionError(
        absl::StrCat("--arena_socket: cannot bind ", path, ": ", std::strerror(errno)));
    close(fd);
    return status;
  }
  // Connecting needs write permission on the socket file: only the sidecar's user (and root).
  // Until this chmod the umask's mode applies; a client that slipped in still needs a nonce.
  if (chmod(path.c_str(), 0600) != 0 || listen(fd, 64) != 0) {
    const absl::Status status = Errno(absl::StrCat("--arena_socket: cannot set up ", path));
    close(fd);
    unlink(path.c_str());
    return status;
  }
  std::unique_ptr<ArenaFdServer> server(
      new ArenaFdServer(options, std::move(source), std::move(path), fd));
  server->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (server->stop_fd_ < 0) return Errno("eventfd");
  server->accept_thread_ = std::thread([raw = server.get()] { raw->AcceptLoop(); });
  KVS_LOG(kInfo, "arena_socket")
  ("socket", server->socket_path_)("nonce_ttl_ms", absl::ToInt64Milliseconds(options.nonce_ttl));
  return server;
}

ArenaFdServer::ArenaFdServer(Options options, FdSource source, std::string socket_path,
                             int listen_fd)
    : options_(std::move(options)),
      source_(std::move(source)),
      socket_path_(std::move(socket_path)),
      listen_fd_(listen_fd) {}

ArenaFdServer::~ArenaFdServer() {
  if (accept_thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof(one));
    accept_thread_.join();
  }
  if (stop_fd_ >= 0) close(stop_fd_);
  close(listen_fd_);
  unlink(socket_path_.c_str());
}

std::string ArenaFdServer::IssueNonce(absl::string_view session_id) {
  std::string nonce = RandomNonce();
  const absl::Time now = MonotonicNow();
  absl::MutexLock lock(&mu_);
  absl::erase_if(nonces_, [now](const auto& entry) { return entry.second.expires <= now; });
  nonces_[nonce] = Nonce{std::string(session_id), now + options_.nonce_ttl};
  return nonce;
}

void ArenaFdServer::AcceptLoop() {
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Worker> workers;
  auto reap = [&workers](bool all) {
    for (auto it = workers.begin(); it != workers.end();) {
      if (all || it->done->load()) {
        it->thread.join();
        it = workers.erase(it);
      } else {
        ++it;
      }
    }
  };
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int ready = poll(fds, 2, 1000);
    if (ready < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) break;
    reap(false);
    if (ready <= 0 || (fds[0].revents & POLLIN) == 0) continue;
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    if (workers.size() >= kMaxConnections) {
      KVS_LOG(kWarning, "arena_fd_refused")("reason", "too many connections at once");
      SendReply(connection, "ERROR busy: too many connections at once, retry\n", -1);
      close(connection);
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    workers.push_back({std::thread([this, connection, done] {
                         Serve(connection);
                         done->store(true);
                       }),
                       done});
  }
  reap(true);
}

void ArenaFdServer::Serve(int connection) {
  SetTimeout(connection, SO_RCVTIMEO, options_.io_timeout);
  SetTimeout(connection, SO_SNDTIMEO, options_.io_timeout);
  std::string peer = "unknown";
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0) {
    peer = absl::StrCat("pid=", credentials.pid, ",uid=", credentials.uid,
                        ",gid=", credentials.gid);
  }
  std::string request;
  bool complete = false;
  char buffer[256];
  // One deadline for the whole request line, not one per read: a client trickling a byte at a
  // time must not hold one of the few connection slots (and with them every other worker's
  // arena hand-out) for longer than io_timeout.
  const absl::Time deadline = MonotonicNow() + options_.io_timeout;
  while (request.size() <= kMaxRequestBytes) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - MonotonicNow());
    if (left_ms <= 0) break;
    pollfd readable = {connection, POLLIN, 0};
    const int ready = poll(&readable, 1, static_cast<int>(std::min<int64_t>(left_ms, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    const ssize_t n = recv(connection, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    request.append(buffer, static_cast<size_t>(n));
    if (const size_t end = request.find('\n'); end != std::string::npos) {
      request.resize(end);
      complete = true;
      break;
    }
  }
  int fd = -1;
  std::string reply;
  if (!complete) {
    KVS_LOG(kWarning, "arena_fd_refused")
    ("peer", peer)("reason", "no complete request line (timeout, too long or closed)");
    reply = "ERROR expected one line \"FETCH <session_id> <nonce>\"\n";
  } else {
    reply = Handle(request, peer, &fd);
  }
  if (!SendReply(connection, reply, fd) && fd >= 0) {
    KVS_LOG(kWarning, "arena_fd_send_failed")("peer", peer)("error", std::strerror(errno));
  }
  if (fd >= 0) close(fd);
  close(connection);
}

std::string ArenaFdServer::Handle(absl::string_view request, const std::string& peer,
                                  int* fd_out) {
  *fd_out = -1;
  request = absl::StripSuffix(request, "\r");
  const std::vector<absl::string_view> parts = absl::StrSplit(request, ' ');
  auto refuse = [&](absl::string_view session, absl::string_view reason) {
    KVS_LOG(kWarning, "arena_fd_refused")("peer", peer)("session", session)("reason", reason);
    return absl::StrCat("ERROR ", reason, "\n");
  };
  if (parts.size() != 3 || parts[0] != "FETCH" || parts[1].empty() || parts[2].empty()) {
    return refuse("", "malformed request: expected \"FETCH <session_id> <nonce>\"");
  }
  const absl::string_view session_id = parts[1];
  Nonce nonce;
  {
    absl::MutexLock lock(&mu_);
    auto it = nonces_.find(parts[2]);
    if (it == nonces_.end()) {
      return refuse(session_id, "unknown or already used nonce");
    }
    // Single use: whatever happens next, this nonce fetches nothing again.
    nonce = std::move(it->second);
    nonces_.erase(it);
  }
  if (nonce.expires <= MonotonicNow()) return refuse(session_id, "nonce expired; attach again");
  if (nonce.session_id != session_id) {
    return refuse(session_id, "nonce was issued for another session");
  }
  absl::StatusOr<int> fd = source_(session_id);
  if (!fd.ok()) return refuse(session_id, fd.status().message());
  struct stat st;
  if (fstat(*fd, &st) != 0) {
    close(*fd);
    return refuse(session_id, "cannot stat the arena");
  }
  *fd_out = *fd;
  KVS_LOG(kInfo, "arena_fd_sent")("peer", peer)("session", session_id)("bytes", st.st_size);
  return absl::StrCat("OK ", st.st_size, "\n");
}

}  // namespace kvs
