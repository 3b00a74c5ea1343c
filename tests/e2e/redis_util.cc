#include "tests/e2e/redis_util.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace kvs_e2e {

bool RedisInstalled() {
  return std::system("command -v redis-server >/dev/null 2>&1 && "
                     "command -v redis-cli >/dev/null 2>&1") == 0;
}

namespace {
bool PortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}
}  // namespace

int FreePort(bool with_bus) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    int port = 0;
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
    close(fd);
    if (port == 0) continue;
    if (with_bus && (port + 10000 > 65535 || !PortFree(port + 10000))) continue;
    return port;
  }
  return 0;
}

absl::StatusOr<std::string> Shell(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed");
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  const int status = pclose(pipe);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("`", command, "` failed (", status, "): ", out));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RedisNode>> RedisNode::Start(const Options& options) {
  std::unique_ptr<RedisNode> node(new RedisNode());
  node->options_ = options;
  node->port_ = options.port != 0 ? options.port : FreePort(options.cluster);
  node->dir_ = MakeTempDir("kvs-redis-");
  if (absl::Status status = node->Launch(); !status.ok()) return status;
  return node;
}

absl::Status RedisNode::Launch() {
  // Spawn takes a path (no PATH lookup).
  static const std::string server = [] {
    absl::StatusOr<std::string> path = Shell("command -v redis-server");
    return path.ok() ? std::string(absl::StripAsciiWhitespace(*path)) : "redis-server";
  }();
  std::vector<std::string> argv = {server, "--port", std::to_string(port_),
                                   "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                   "--dir", dir_, "--protected-mode", "no"};
  if (options_.cluster) {
    argv.insert(argv.end(), {"--cluster-enabled", "yes", "--cluster-config-file",
                             dir_ + "/nodes.conf", "--cluster-node-timeout", "2000"});
  }
  if (!options_.requirepass.empty()) argv.insert(argv.end(), {"--requirepass", options_.requirepass});
  if (!options_.maxmemory.empty()) {
    argv.insert(argv.end(),
                {"--maxmemory", options_.maxmemory, "--maxmemory-policy", "noeviction"});
  }
  auto process = ChildProcess::Spawn(argv, dir_, absl::StrCat("redis-", port_));
  if (!process.ok()) return process.status();
  process_ = *std::move(process);
  const bool up = PollUntil(
      [&] {
        absl::StatusOr<std::string> pong = Cli("PING");
        return pong.ok() && absl::StrContains(*pong, "PONG");
      },
      absl::Seconds(20), absl::Milliseconds(50));
  if (!up) {
    return absl::UnavailableError(absl::StrCat("redis-server on port ", port_,
                                               " did not answer PING: ", process_->Stdout(),
                                               process_->Stderr()));
  }
  return absl::OkStatus();
}

RedisNode::~RedisNode() {
  Kill();
  if (!dir_.empty()) {
    std::error_code error;
    std::filesystem::remove_all(dir_, error);
  }
}

absl::StatusOr<std::string> RedisNode::Cli(const std::string& args) const {
  std::string auth;
  if (!options_.requirepass.empty()) {
    auth = absl::StrCat(" --no-auth-warning -a '", options_.requirepass, "'");
  }
  return Shell(absl::StrCat("redis-cli -p ", port_, auth, " ", args));
}

void RedisNode::Kill() {
  if (process_ != nullptr) process_->Stop(SIGKILL, absl::Seconds(10));
  process_.reset();
}

absl::Status RedisNode::Restart() {
  Kill();
  return Launch();
}

absl::StatusOr<std::unique_ptr<RedisCluster>> RedisCluster::Start() {
  auto cluster = std::make_unique<RedisCluster>();
  std::string addresses;
  for (int i = 0; i < 3; ++i) {
    RedisNode::Options options;
    options.cluster = true;
    auto node = RedisNode::Start(options);
    if (!node.ok()) return node.status();
    absl::StrAppend(&addresses, " ", (*node)->address());
    cluster->nodes_.push_back(*std::move(node));
  }
  auto created = Shell(absl::StrCat("redis-cli --cluster create", addresses,
                                    " --cluster-replicas 0 --cluster-yes"));
  if (!created.ok()) return created.status();
  const bool ok = PollUntil(
      [&] {
        for (auto& node : cluster->nodes_) {
          auto info = node->Cli("CLUSTER INFO");
          if (!info.ok() || !absl::StrContains(*info, "cluster_state:ok")) return false;
        }
        return true;
      },
      absl::Seconds(30), absl::Milliseconds(100));
  if (!ok) return absl::UnavailableError("the Redis cluster did not reach cluster_state:ok");
  return cluster;
}

std::string RedisCluster::url() const {
  std::string out = "redis://";
  for (size_t i = 0; i < nodes_.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", nodes_[i]->address());
  }
  return out;
}

absl::StatusOr<RedisNode*> RedisCluster::NodeFor(const std::string& key) {
  for (auto& node : nodes_) {
    // A node answers a key it does not serve with MOVED; the one that serves it does not.
    auto reply = node->Cli(absl::StrCat("EXISTS '", key, "'"));
    if (reply.ok() && !absl::StrContains(*reply, "MOVED")) return node.get();
  }
  return absl::NotFoundError(absl::StrCat("no node serves ", key));
}

}  // namespace kvs_e2e
