// Spill and restore of one 256 MiB sequence (L=32, H=8, D=128, fp16, 2048 tokens) through KvPool
// to the remote tier on Redis, a single node and a 3-master Redis Cluster that this program
// starts on loopback ports (redis-server, no persistence), next to redis-benchmark's SET and GET
// throughput for the value size the tier writes (its chunk size, 8 MiB), measured in the same run
// against the same servers. Figures: MB/s of each and the ratios (spill / SET, restore / GET);
// bench/README.md records them. Not part of ctest. Run: build/bench/remote_tier_bench
// [iterations, default 3].
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "storage/tier_manager.h"

namespace kvs {
namespace {

constexpr uint64_t kBytes = uint64_t{256} << 20;
constexpr uint64_t kChunk = uint64_t{8} << 20;

std::string Run(const std::string& command) {
  std::string out;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  pclose(pipe);
  return out;
}

int FreePort() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    close(fd);
    const int port = ntohs(addr.sin_port);
    if (port > 0 && port + 10000 <= 65535) return port;
  }
  return 0;
}

struct Redis {
  pid_t pid = -1;
  int port = 0;
  std::string dir;
  ~Redis() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
  }
};

std::unique_ptr<Redis> StartRedis(bool cluster) {
  auto redis = std::make_unique<Redis>();
  redis->port = FreePort();
  std::string pattern = std::filesystem::temp_directory_path() / "kvs-redis-bench-XXXXXX";
  redis->dir = mkdtemp(pattern.data());
  std::vector<std::string> args = {"redis-server", "--port", std::to_string(redis->port),
                                   "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                   "--dir", redis->dir, "--logfile", redis->dir + "/log"};
  if (cluster) {
    args.insert(args.end(), {"--cluster-enabled", "yes", "--cluster-config-file",
                             redis->dir + "/nodes.conf"});
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  redis->pid = fork();
  if (redis->pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the benchmark
    execvp("redis-server", argv.data());
    _exit(127);
  }
  if (redis->pid < 0) return nullptr;
  for (int i = 0; i < 200; ++i) {
    if (absl::StrContains(Run(absl::StrCat("redis-cli -p ", redis->port, " PING")), "PONG")) {
      return redis;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return nullptr;
}

// redis-benchmark SET and GET MB/s for kChunk-sized values (one connection, 8 in flight: the
// remote tier pipelines 64 MiB, 8 chunks, per round trip).
std::pair<double, double> RedisBenchmark(int port, bool cluster) {
  const std::string out = Run(absl::StrCat("redis-benchmark -p ", port, cluster ? " --cluster" : "",
                                           " -t set,get -d ", kChunk,
                                           " -n 64 -c 1 -P 8 -r 64 --csv"));
  double set = 0, get = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> cells = absl::StrSplit(line, ',');
    if (cells.size() < 2) continue;
    std::string name(absl::StripAsciiWhitespace(cells[0]));
    std::string rps(absl::StripAsciiWhitespace(cells[1]));
    absl::StripAsciiWhitespace(&name);
    name.erase(std::remove(name.begin(), name.end(), '"'), name.end());
    rps.erase(std::remove(rps.begin(), rps.end(), '"'), rps.end());
    double value = 0;
    if (!absl::SimpleAtod(rps, &value)) continue;
    const double mbps = value * static_cast<double>(kChunk) / 1e6;
    if (name == "SET") set = mbps;
    if (name == "GET") get = mbps;
  }
  if (set == 0 || get == 0) std::fprintf(stderr, "redis-benchmark output:\n%s\n", out.c_str());
  return {set, get};
}

struct Result {
  double spill_mbps = 0, restore_mbps = 0;
};

Result SpillRestore(const std::string& seed, int iterations) {
  storage::TierOptions tier_options;
  tier_options.host_capacity_bytes = uint64_t{1} << 30;
  tier_options.remote.client.seeds = {seed};
  tier_options.remote.chunk_bytes = kChunk;
  std::unique_ptr<storage::TierManager> tiers = storage::TierManager::Open(tier_options);
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  FakeClock clock;
  PoolOptions options;
  options.arena_capacity_bytes = uint64_t{1} << 30;
  options.arena_options.name_prefix = "kvs-remote-bench";
  options.tiers = tiers.get();
  KvPool pool(backend.get(), &clock, options);
  AttachParams attach;
  attach.layout.num_layers = 32;
  attach.layout.num_kv_heads = 8;
  attach.layout.num_q_heads = 8;
  attach.layout.head_dim = 128;
  attach.layout.dtype = DType::kFloat16;
  attach.layout.block_tokens = 16;
  attach.num_blocks = static_cast<int32_t>(kBytes / attach.layout.block_bytes() + 64);
  const std::string session = pool.Attach(attach)->session_id;
  SequenceParams params;
  PolicyConfig policy;
  policy.name = kPolicyStreamingLlm;
  params.policy = policy;
  params.sequence_id = "big";
  const std::string sequence = pool.CreateSequence(session, params)->sequence_id;
  const int32_t tokens = static_cast<int32_t>(kBytes / (attach.layout.token_bytes() * 32));
  for (int32_t done = 0; done < tokens; done += 256) {
    Reservation r = *pool.Reserve(session, sequence, 256, {}, {});
    std::vector<uint8_t> payload(r.payload_bytes);
    // Finite fp16 values (the sidecar refuses NaN/inf): the high byte keeps the exponent small.
    for (size_t i = 0; i < payload.size(); ++i) {
      const uint8_t byte = static_cast<uint8_t>(i * 131 + done);
      payload[i] = (i % 2 == 1) ? (byte & 0x3B) : byte;
    }
    absl::Status written = pool.WriteReserved(session, sequence, r.reservation_id, 0, payload);
    absl::Status committed =
        written.ok() ? pool.Commit(session, sequence, r.reservation_id, false).status() : written;
    if (!committed.ok()) {
      std::fprintf(stderr, "filling the sequence failed: %s\n", committed.ToString().c_str());
      return {};
    }
  }
  Result result;
  absl::Duration spill_total, restore_total;
  for (int i = 0; i <= iterations; ++i) {  // the first round is a warm-up
    absl::Time start = absl::Now();
    absl::StatusOr<SpillResult> spilled = pool.Spill(session, sequence, StorageTier::kRemote);
    const absl::Duration spill = absl::Now() - start;
    if (!spilled.ok()) {
      std::fprintf(stderr, "spill failed: %s\n", spilled.status().ToString().c_str());
      return result;
    }
    start = absl::Now();
    absl::StatusOr<SpillResult> restored = pool.Restore(session, sequence);
    const absl::Duration restore = absl::Now() - start;
    if (!restored.ok()) {
      std::fprintf(stderr, "restore failed: %s\n", restored.status().ToString().c_str());
      return result;
    }
    std::printf("  round %d: spill %.0f ms, restore %.0f ms%s\n", i,
                absl::ToDoubleMilliseconds(spill), absl::ToDoubleMilliseconds(restore),
                i == 0 ? " (warm-up)" : "");
    if (i == 0) continue;
    spill_total += spill;
    restore_total += restore;
  }
  result.spill_mbps = kBytes * iterations / 1e6 / absl::ToDoubleSeconds(spill_total);
  result.restore_mbps = kBytes * iterations / 1e6 / absl::ToDoubleSeconds(restore_total);
  return result;
}

void Report(const char* what, const std::string& seed, int port, bool cluster, int iterations) {
  std::printf("%s (%s)\n", what, seed.c_str());
  const Result ours = SpillRestore(seed, iterations);
  const auto [set, get] = RedisBenchmark(port, cluster);
  std::printf("  redis-benchmark %llu-byte values: SET %.0f MB/s, GET %.0f MB/s\n",
              static_cast<unsigned long long>(kChunk), set, get);
  std::printf("  spill   %.0f MB/s = %.2f of SET\n", ours.spill_mbps,
              set > 0 ? ours.spill_mbps / set : 0);
  std::printf("  restore %.0f MB/s = %.2f of GET\n", ours.restore_mbps,
              get > 0 ? ours.restore_mbps / get : 0);
}

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) {
  int iterations = 3;
  if (argc > 1) iterations = std::max(1, std::atoi(argv[1]));
  if (std::system("command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null") !=
      0) {
    std::fprintf(stderr, "remote_tier_bench needs redis-server and redis-benchmark (redis-tools)\n");
    return 1;
  }
  {
    auto single = kvs::StartRedis(false);
    if (!single) return 1;
    kvs::Report("single node", absl::StrCat("127.0.0.1:", single->port), single->port, false,
                iterations);
  }
  {
    std::vector<std::unique_ptr<kvs::Redis>> nodes;
    std::string addresses;
    for (int i = 0; i < 3; ++i) {
      nodes.push_back(kvs::StartRedis(true));
      if (!nodes.back()) return 1;
      absl::StrAppend(&addresses, " 127.0.0.1:", nodes.back()->port);
    }
    kvs::Run(absl::StrCat("redis-cli --cluster create", addresses,
                          " --cluster-replicas 0 --cluster-yes"));
    for (int i = 0; i < 100; ++i) {
      if (absl::StrContains(kvs::Run(absl::StrCat("redis-cli -p ", nodes[0]->port,
                                                  " CLUSTER INFO")),
                            "cluster_state:ok")) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    kvs::Report("3-master cluster", absl::StrCat("127.0.0.1:", nodes[0]->port), nodes[0]->port,
                true, iterations);
  }
  return 0;
}
