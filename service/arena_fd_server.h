// ArenaFdServer: hands each session's arena descriptor (an anonymous memfd) to the worker that
// attached it, and to nobody else, over a Unix-domain socket.
//
// Attach (authenticated by gRPC) asks IssueNonce for a single-use secret bound to the session;
// the worker connects to the socket, sends "FETCH <session_id> <nonce>\n" and receives either
// "OK <size_bytes>\n" with the descriptor attached (SCM_RIGHTS) or "ERROR <reason>\n". A nonce is
// consumed by its first use, whatever the outcome, and expires after `nonce_ttl`; one presented
// with another session's id is refused. Every request is logged with the peer's pid/uid/gid
// (SO_PEERCRED); refusals at WARNING. The socket file is mode 0600; its directory is created 0700
// when missing. Protocol and fields: kvsidecar.v1.ArenaHandle (proto/kvsidecar/v1/common.proto).
//
// Threading: IssueNonce may be called from any thread. One thread accepts connections; each
// connection is served on its own short-lived thread (at most kMaxConnections at once, each bounded
// by a read/write timeout) so a stalled client cannot hold up the others. The destructor stops
// accepting, waits for connections in progress and removes the socket file.
#ifndef KVSIDECAR_SERVICE_ARENA_FD_SERVER_H_
#define KVSIDECAR_SERVICE_ARENA_FD_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvs {

class ArenaFdServer {
 public:
  struct Options {
    std::string socket_path;                    // absolute or relative; at most 107 bytes
    absl::Duration nonce_ttl = absl::Seconds(30);
    absl::Duration io_timeout = absl::Seconds(2);  // reading the request line; each write
  };
  // Returns a new descriptor of the session's arena (the server closes it after sending), or the
  // reason it cannot (unknown session, not a memfd arena).
  using FdSource = std::function<absl::StatusOr<int>(absl::string_view session_id)>;

  static constexpr int kMaxConnections = 32;

  // Prepares the directory, removes a stale socket a dead sidecar left (a live one answering on
  // it is UNAVAILABLE), binds, listens and starts serving. FAILED_PRECONDITION for a path that
  // is too long or is taken by something that is not a socket; INTERNAL for other system errors.
  static absl::StatusOr<std::unique_ptr<ArenaFdServer>> Start(const Options& options,
                                                              FdSource source);
  ~ArenaFdServer();
  ArenaFdServer(const ArenaFdServer&) = delete;
  ArenaFdServer& operator=(const ArenaFdServer&) = delete;

  // The socket path as the worker must connect to it (absolute).
  const std::string& socket_path() const { return socket_path_; }
  // A fresh 256-bit random secret (64 hex digits) that fetches `session_id`'s descriptor once,
  // within nonce_ttl from now. Expired nonces are dropped here too.
  std::string IssueNonce(absl::string_view session_id);

 private:
  struct Nonce {
    std::string session_id;
    absl::Time expires;
  };

  ArenaFdServer(Options options, FdSource source, std::string socket_path, int listen_fd);
  void AcceptLoop();
  void Serve(int fd);
  // The reply for one request line: the descriptor to send (-1 = none) and the line itself.
  std::string Handle(absl::string_view request, const std::string& peer, int* fd_out);

  const Options options_;
  const FdSource source_;
  const std::string socket_path_;
  const int listen_fd_;
  int stop_fd_ = -1;  // eventfd: wakes the accept loop on shutdown
  std::thread accept_thread_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Nonce> nonces_ ABSL_GUARDED_BY(mu_);
  int connections_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_ARENA_FD_SERVER_H_
