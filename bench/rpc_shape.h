// The shape of one RPC on a running sidecar: what the compute backend was asked and what reaching
// its device cost for exactly that call (calls by method, synchronisations, transfers, arena host
// copies, launches: gpu/device_counters.h), read from Admin.GetStats before and after it. The
// scenarios are the ones a decoding worker runs: n sequences of one policy at their budget, each
// decode step adding one token to every layer and evicting one, and a prefill Compress.
//
// Used by bench/rpc_counts (prints one line per measured call) and by the device-counts test
// (tests/e2e/device_counts_test.cc), which asserts the bounds a device path must keep. Nothing
// else may run on the server while a call is measured: the counters are process-wide.
#ifndef KVSIDECAR_BENCH_RPC_SHAPE_H_
#define KVSIDECAR_BENCH_RPC_SHAPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvsidecar/client.h"

namespace kvs::bench {

// The model and the scenario's sizes.
struct ShapeOptions {
  int kv_heads = 8;
  int q_heads = 32;
  int head_dim = 128;
  int block_tokens = 16;
  // Decode: tokens every sequence holds before the measured step (= its budget, so each step
  // evicts one token per layer and head). Compress: the prompt is 2 x prefill tokens, compressed
  // to prefill with a window of `window` queries.
  int prefill = 48;
  int window = 32;
  // Decode: the new token's K/V inline in the request (true) or written into a reservation the
  // worker made (false; the step then checks the rows the worker wrote).
  bool inline_kv = true;
  // Decode: the step's queries written into the session's staging area and named by offset
  // (AttentionInputs.staging_offset) instead of inline: with reserved K/V, a request without tensor
  // bytes.
  bool staged_queries = false;
  // Decode steps run (unmeasured) before the measured one.
  int warmup_steps = 1;
};

// One measured call.
struct RpcShape {
  std::string rpc;     // "DecodeStep", "Compress"
  std::string policy;  // the policy's name
  int sequences = 0;
  int layers = 0;
  int kv_heads = 0;
  uint64_t request_bytes = 0;   // the request message's serialised size
  uint64_t response_bytes = 0;  // the response message's serialised size
  // The counters' difference around the call.
  uint64_t calls = 0, jobs = 0, syncs = 0, uploads = 0, downloads = 0, up_bytes = 0, down_bytes = 0,
           arena_writes = 0, arena_reads = 0, launches = 0;
  std::vector<std::pair<std::string, uint64_t>> calls_by_method;  // methods called, in order
};

// The parameters that make a policy's defaults runnable at the scenario's sizes ("caote" is CAOTE
// over H2O, its default base).
kvsidecar::v1::PolicySpec ShapePolicy(const std::string& name);

// Every evicting policy of the contract, in the order the proto lists them.
std::vector<std::string> EvictingPolicies();

// One DecodeStep of `sequences` sequences of `layers` layers under `policy`, on a new session of
// `client` (detached afterwards).
absl::StatusOr<RpcShape> MeasureDecodeStep(kvsidecar::Client& client, kvsidecar::AdminClient& admin,
                                           const std::string& policy, int sequences, int layers,
                                           const ShapeOptions& options);

// One Compress of a single sequence of `layers` layers (2 x prefill tokens -> prefill) under
// `policy`, with the window's queries inline.
absl::StatusOr<RpcShape> MeasureCompress(kvsidecar::Client& client, kvsidecar::AdminClient& admin,
                                         const std::string& policy, int layers,
                                         const ShapeOptions& options);

// "rpc=<Name> policy=<p> n=<sequences> layers=<L> calls=<c> syncs=<s> uploads=<u>
// downloads=<d> up_bytes=<b> down_bytes=<b> arena_writes=<w>" followed by the other fields.
std::string FormatShape(const RpcShape& shape);

}  // namespace kvs::bench

#endif  // KVSIDECAR_BENCH_RPC_SHAPE_H_
