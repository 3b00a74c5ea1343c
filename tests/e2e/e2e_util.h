// Helpers of the end-to-end tests: start the real kvsidecar binary (and helper processes) as
// children, poll with deadlines, generate deterministic K/V, and verify a sequence's kept tokens
// bit for bit in place and through Export. Not thread-safe; one test thread uses them.
#ifndef KVSIDECAR_TESTS_E2E_E2E_UTIL_H_
#define KVSIDECAR_TESTS_E2E_E2E_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"

namespace kvs_e2e {

namespace v1 = kvsidecar::v1;

// Generous: the suite runs on small, loaded machines.
inline constexpr absl::Duration kStartTimeout = absl::Seconds(60);
inline constexpr absl::Duration kReclaimTimeout = absl::Seconds(15);

// KVS_BUILD_DIR (set by ctest) or the directory two levels above this test binary.
std::string BuildDir();
// A fresh directory under TEST_TMPDIR or /tmp.
std::string MakeTempDir(const std::string& prefix);

// A child process with stdout and stderr captured in files. Killed (SIGKILL) when the object
// dies or when the test process dies (PR_SET_PDEATHSIG).
class ChildProcess {
 public:
  // `run_as_uid` >= 0 (only as root): the child drops to that uid and gid (and no supplementary
  // groups) before exec. `env`: "NAME=value" entries set in the child on top of (replacing) the
  // environment it inherits.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      const std::vector<std::string>& argv, const std::string& log_dir, const std::string& name,
      int run_as_uid = -1, const std::vector<std::string>& env = {});
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  std::string Stdout() const;
  std::string Stderr() const;
  // True while the process has not exited (reaps it if it has).
  bool Running();
  // Sends `signal` and waits up to `timeout` for exit; returns the wait status, or -1 on timeout.
  int Stop(int signal, absl::Duration timeout);
  // Waits for exit; returns the wait status or -1 on timeout.
  int Wait(absl::Duration timeout);

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int wait_status_ = 0;
  std::string stdout_path_;
  std::string stderr_path_;
};

// The real server: <build>/service/kvsidecar --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0
// --data_dir=<tmp> --lease_ms=<lease_ms>, ports parsed from its "kvsidecar listening" line.
class ServerProcess {
 public:
  struct Options {
    int lease_ms = 10000;
    std::vector<std::string> extra_args;
    // >= 0 (only as root): run the server as this uid/gid; its directory is chowned to it.
    int run_as_uid = -1;
    // "NAME=value" entries of the server's environment, on top of this process's.
    std::vector<std::string> env;
  };
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const Options& options);
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start() { return Start(Options()); }
  ~ServerProcess();

  const std::string& data_target() const { return data_target_; }
  const std::string& admin_target() const { return admin_target_; }
  // host:port of the /metrics endpoint ("" unless started with --metrics_listen).
  const std::string& metrics_target() const { return metrics_target_; }
  // The server's temporary directory (removed with it): a place for helper processes' logs.
  const std::string& dir() const { return dir_; }
  ChildProcess& process() { return *process_; }
  std::string Logs() const;

  // Connected clients with generous timeouts.
  absl::StatusOr<std::unique_ptr<kvsidecar::Client>> Connect() const;
  absl::StatusOr<std::unique_ptr<kvsidecar::AdminClient>> ConnectAdmin() const;

 private:
  ServerProcess() = default;
  std::unique_ptr<ChildProcess> process_;
  std::string dir_;
  std::string data_target_;
  std::string admin_target_;
  std::string metrics_target_;
};

kvsidecar::ClientOptions TestClientOptions();

// A suite whose tests share one real server process, started before the suite's first test and
// stopped after its last. `Derived` gives every suite its own server.
template <typename Derived>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static inline ServerProcess* server_ = nullptr;
};

// How many memfd arenas (descriptors whose /proc link reads "/memfd:kvsidecar...") process `pid`
// holds open; -1 when its /proc/<pid>/fd cannot be read (the sidecar is not dumpable: only root
// can read it).
int CountArenaMemfds(pid_t pid);

// Polls `condition` every `interval` until it holds (true) or `timeout` passes (false).
bool PollUntil(const std::function<bool()>& condition, absl::Duration timeout,
               absl::Duration interval = absl::Milliseconds(20));

v1::ModelLayout MakeLayout(int layers, int kv_heads, int q_heads, int head_dim, v1::DType dtype,
                           int block_tokens = 16);
v1::PolicySpec KeyDiffPolicy();
v1::PolicySpec StreamingPolicy(int n_sink);
v1::Budget MakeBudget(int tokens_per_layer);

// The bytes written for the (layer, kv, head) row of the token at `position` under `seed`: a
// deterministic pseudo-random value in [-2, 2) per element, in the layout's dtype.
std::vector<uint8_t> PatternRow(const v1::ModelLayout& layout, uint64_t seed, int layer, int kv,
                                int head, int position);
// The inline payload [layers][2][H][positions][D] (layers empty = all) of PatternRow values.
std::string PatternPayload(const v1::ModelLayout& layout, uint64_t seed,
                           const std::vector<int>& layers, const std::vector<int>& positions);
// Writes PatternRow values for every token of `reservation` through the mapped arena.
absl::Status WritePattern(kvsidecar::Session& session, const kvsidecar::Reservation& reservation,
                          uint64_t seed);
// Reserve(num_tokens) + WritePattern + Commit.
absl::StatusOr<v1::CommitResponse> WriteTokens(kvsidecar::Session& session, const std::string& seq,
                                               int num_tokens, uint64_t seed,
                                               bool compress_if_over_budget = false);

struct Verified {
  int rows = 0;             // (layer, head, slot) entries checked, K and V
  std::vector<int> counts;  // per layer
  std::vector<std::vector<std::vector<int>>> positions;  // [layer][head] kept positions, slot order
};
// Checks every held (layer, head, slot) of `seq`: the K and V rows read in place through the
// GetLayout block table and the rows in the Export payload are both exactly PatternRow of the
// position the position table gives; Export's header agrees with GetLayout; positions are unique
// per (layer, head).
absl::StatusOr<Verified> VerifySequence(kvsidecar::Session& session, const std::string& seq,
                                        uint64_t seed);

// Message of a failed status, for EXPECT_THAT(..., HasSubstr(...)).
std::string MessageOf(const absl::Status& status);

}  // namespace kvs_e2e

#endif  // KVSIDECAR_TESTS_E2E_E2E_UTIL_H_
