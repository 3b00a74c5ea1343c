// Real Redis for the remote tier's tests: redis-server processes on free loopback ports (a single
// node, or a 3-master Redis Cluster made with redis-cli --cluster create), each in a temporary
// directory without persistence, killed with the test; and redis-cli to inspect and damage what
// they hold. Not thread-safe; one test thread uses them.
#ifndef KVSIDECAR_TESTS_E2E_REDIS_UTIL_H_
#define KVSIDECAR_TESTS_E2E_REDIS_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {

// True when redis-server and redis-cli are on PATH (the tests skip, saying so, otherwise).
bool RedisInstalled();

// A loopback TCP port nothing listens on now (and, for a cluster node, port + 10000 too).
int FreePort(bool with_bus = false);

// Runs `command` with /bin/sh; its stdout, or an error naming the exit status and output.
absl::StatusOr<std::string> Shell(const std::string& command);

class RedisNode {
 public:
  struct Options {
    bool cluster = false;
    std::string requirepass;     // "" = none
    std::string maxmemory;       // "" = unlimited; with noeviction
    int port = 0;                // 0 = a free one
  };
  static absl::StatusOr<std::unique_ptr<RedisNode>> Start(const Options& options);
  ~RedisNode();

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // redis-cli -p <port> [-a password] <args> (args are passed through the shell as given).
  absl::StatusOr<std::string> Cli(const std::string& args) const;
  void Kill();                // SIGKILL, now
  // The same port and options (a cluster node keeps its identity and slots: nodes.conf).
  absl::Status Restart();
  bool running() { return process_ != nullptr && process_->Running(); }

 private:
  RedisNode() = default;
  absl::Status Launch();
  Options options_;
  int port_ = 0;
  std::string dir_;
  std::unique_ptr<ChildProcess> process_;
};

// Three masters, no replicas, every slot assigned; the cluster state is ok on every node.
class RedisCluster {
 public:
  static absl::StatusOr<std::unique_ptr<RedisCluster>> Start();
  // "redis://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
  std::string url() const;
  RedisNode& node(int i) { return *nodes_[i]; }
  // The node serving `key`'s slot (CLUSTER KEYSLOT + CLUSTER SLOTS).
  absl::StatusOr<RedisNode*> NodeFor(const std::string& key);

 private:
  std::vector<std::unique_ptr<RedisNode>> nodes_;
};

}  // namespace kvs_e2e

#endif  // KVSIDECAR_TESTS_E2E_REDIS_UTIL_H_
