// rpc_counts: the shape of a decode step and of a prefill compress on the real kvsidecar binary,
// one line per measured call (bench/rpc_shape.h):
//   rpc=DecodeStep policy=h2o n=64 layers=32 calls=... syncs=... uploads=... downloads=...
//   up_bytes=... down_bytes=... arena_writes=... (then arena_reads, jobs, launches,
//   response_bytes and the backend methods called)
// for DecodeStep at n in {1, 8, 64} sequences x L in {4, 32} layers and Compress at n = 1, for
// every evicting policy. The counts are the compute backend's (gpu/device_counters.h): on
// --backend=device-sim they are what the same calls cost on a GPU in round trips and bytes, so
// the shape is read on any machine; on a GPU, --backend=cuda.
//
//   build/bench/rpc_counts [--backend=device-sim] [--policies=h2o,keydiff] [--kv_heads=8]
//                          [--head_dim=128] [--prefill=48] [--reservations] [--staged_queries]
// (--reservations: the new K/V written into reservations through the mapped arena instead of
// inline; --staged_queries: the queries in the session's staging area; both: requests without
// tensor bytes)
// Exits non-zero if any call fails.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/rpc_shape.h"
#include "kvsidecar/client.h"

namespace {

// "--name=value" -> value, or nullptr.
const char* Flag(int argc, char** argv, const char* name) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(prefix, 0) == 0) return argv[i] + prefix.size();
  }
  return nullptr;
}

bool Has(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == std::string("--") + name) return true;
  }
  return false;
}

int IntFlag(int argc, char** argv, const char* name, int fallback) {
  const char* value = Flag(argc, argv, name);
  int parsed = 0;
  if (value == nullptr) return fallback;
  if (!absl::SimpleAtoi(value, &parsed) || parsed <= 0) {
    std::fprintf(stderr, "rpc_counts: --%s must be a positive integer, got '%s'\n", name, value);
    std::exit(2);
  }
  return parsed;
}

}  // namespace

int main(int argc, char** argv) {
  const char* backend = Flag(argc, argv, "backend");
  const std::string backend_name = backend != nullptr ? backend : "device-sim";
  kvs::bench::ShapeOptions options;
  options.kv_heads = IntFlag(argc, argv, "kv_heads", options.kv_heads);
  options.q_heads = IntFlag(argc, argv, "q_heads", 4 * options.kv_heads);
  options.head_dim = IntFlag(argc, argv, "head_dim", options.head_dim);
  options.prefill = IntFlag(argc, argv, "prefill", options.prefill);
  options.inline_kv = !Has(argc, argv, "reservations");
  options.staged_queries = Has(argc, argv, "staged_queries");
  std::vector<std::string> policies = kvs::bench::EvictingPolicies();
  if (const char* list = Flag(argc, argv, "policies")) {
    policies = absl::StrSplit(list, ',', absl::SkipEmpty());
  }
  // Room for the largest case: 64 sequences x 32 layers of prefill + 2 tokens.
  const uint64_t token_bytes = uint64_t{2} * options.kv_heads * options.head_dim * 2;
  const uint64_t blocks = 64ull * 32 * ((options.prefill + 2) / 16 + 2);
  const uint64_t capacity = blocks * 16 * token_bytes + (uint64_t{64} << 20);
  kvs::bench::ServerProcess server(
      {"--backend=" + backend_name, "--arena_capacity_bytes=" + std::to_string(capacity)});
  kvsidecar::ClientOptions client_options;
  client_options.max_receive_message_bytes = 256 << 20;
  auto client = kvsidecar::Client::Connect(server.data_target(), client_options);
  auto admin = kvsidecar::AdminClient::Connect(server.admin_target());
  if (!client.ok() || !admin.ok()) {
    std::fprintf(stderr, "rpc_counts: cannot connect: %s %s\n", client.status().ToString().c_str(),
                 admin.status().ToString().c_str());
    return 1;
  }
  std::printf("# backend=%s kv_heads=%d q_heads=%d head_dim=%d fp16 prefill=%d kv=%s queries=%s\n",
              backend_name.c_str(), options.kv_heads, options.q_heads, options.head_dim,
              options.prefill, options.inline_kv ? "inline" : "reservation",
              options.staged_queries ? "staged" : "inline");
  int failures = 0;
  for (const std::string& policy : policies) {
    for (int layers : {4, 32}) {
      for (int n : {1, 8, 64}) {
        auto shape = kvs::bench::MeasureDecodeStep(**client, **admin, policy, n, layers, options);
        if (!shape.ok()) {
          std::printf("rpc=DecodeStep policy=%s n=%d layers=%d error=\"%s\"\n", policy.c_str(), n,
                      layers, shape.status().ToString().c_str());
          ++failures;
          continue;
        }
        std::printf("%s\n", kvs::bench::FormatShape(*shape).c_str());
      }
      auto shape = kvs::bench::MeasureCompress(**client, **admin, policy, layers, options);
      if (!shape.ok()) {
        std::printf("rpc=Compress policy=%s n=1 layers=%d error=\"%s\"\n", policy.c_str(), layers,
                    shape.status().ToString().c_str());
        ++failures;
        continue;
      }
      std::printf("%s\n", kvs::bench::FormatShape(*shape).c_str());
      std::fflush(stdout);
    }
  }
  return failures == 0 ? 0 : 1;
}
