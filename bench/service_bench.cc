// Service-level benchmarks against the real kvsidecar binary on loopback, through the generated
// gRPC stubs and a shared-memory mapping of the arena (what a worker does):
// - BM_DecodeCommit: one decode token for 64 sequences x 32 layers — BatchReserve, K/V written
//   into the mapped arena, BatchCommit — with p50/p99 of the BatchCommit call and of the step,
//   and of an empty call (gRPC health Check) on the same channel in the same run: the floor a
//   unary call costs on this machine, which BatchCommit's figure is read against; and, on every
//   other step, a plain read of the rows the worker just wrote by two threads of the bench
//   (`read_floor`): the least any check of those rows can cost here, since BatchCommit must read
//   them (the server refuses non-finite K/V).
// - BM_DecodeStep: one DecodeStep of 64 sequences x 32 layers (K/V and the query inline, H2O at
//   its budget, so every step scores and evicts in every layer), p50/p99, on the backend named by
//   $KVS_BENCH_BACKEND (default cpu; cuda on a GPU machine, deploy/gpu/check.sh).
// - BM_Append / BM_Export: inline K/V throughput in GB/s for 1, 2 and 4 MiB chunks, next to
//   memcpy bandwidth measured in the same run.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"

namespace kvs::bench {
namespace {

namespace pb = ::kvsidecar::v1;
using Clock = std::chrono::steady_clock;

constexpr int kLayers = 32, kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kBlockTokens = 16;
constexpr int kDtypeBytes = 2;

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %d %s\n", what, status.error_code(), status.error_message().c_str());
    std::abort();
  }
}

pb::ModelLayout BenchLayout() {
  pb::ModelLayout layout;
  layout.set_num_layers(kLayers);
  layout.set_num_kv_heads(kKvHeads);
  layout.set_num_q_heads(kQHeads);
  layout.set_head_dim(kHeadDim);
  layout.set_dtype(pb::DTYPE_FLOAT16);
  layout.set_block_tokens(kBlockTokens);
  return layout;
}

struct Connection {
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<pb::Sidecar::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;  // same channel
  pb::AttachResponse attach;
  uint8_t* arena = nullptr;

  // `backend`: the server's --backend (empty = its default, cpu); a device backend exports no
  // shared-memory arena, so nothing is mapped then (`arena` stays null).
  explicit Connection(int num_blocks, const std::string& backend = "") {
    const uint64_t arena_bytes =
        static_cast<uint64_t>(num_blocks) * 2 * kKvHeads * kBlockTokens * kHeadDim * 2;
    // At least the server's default session size (256 MiB), which it checks against this.
    const uint64_t capacity = std::max<uint64_t>(arena_bytes + (64 << 20), uint64_t{320} << 20);
    std::vector<std::string> server_args = {"--arena_capacity_bytes=" + std::to_string(capacity)};
    if (!backend.empty()) server_args.push_back("--backend=" + backend);
    server = std::make_unique<ServerProcess>(server_args);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateCustomChannel(server->data_target(), grpc::InsecureChannelCredentials(), args);
    stub = pb::Sidecar::NewStub(channel);
    health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    pb::AttachRequest request;
    *request.mutable_layout() = BenchLayout();
    request.set_num_blocks(num_blocks);
    request.set_lease_ms(600000);
    Check(stub->Attach(&context, request, &attach), "Attach");
    if (attach.arena().kind() != pb::ArenaHandle::KIND_MEMFD &&
        attach.arena().shm_path().empty()) {
      return;  // a device arena: nothing to map on the host
    }
    // The arena is a memfd handed over the arena socket (or, with --arena_shm_names, a file).
    const int fd = attach.arena().kind() == pb::ArenaHandle::KIND_MEMFD
                       ? kvsidecar::FetchArenaFd(attach.arena().fd_socket_path(),
                                                 attach.session_id(), attach.arena().fd_nonce())
                             .value_or(-1)
                       : open(attach.arena().shm_path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) std::abort();
    void* base =
        mmap(nullptr, attach.arena().size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) std::abort();
    arena = static_cast<uint8_t*>(base);
  }
  ~Connection() {
    if (arena != nullptr) munmap(arena, attach.arena().size_bytes());
  }

  void CreateSequence(const std::string& id, const std::string& policy = "streaming_llm",
                      int budget_tokens = 0) {
    grpc::ClientContext context;
    pb::CreateSequenceRequest request;
    request.set_session_id(attach.session_id());
    request.set_sequence_id(id);
    request.mutable_policy()->set_name(policy);
    if (budget_tokens > 0) request.mutable_budget()->set_tokens_per_layer(budget_tokens);
    pb::CreateSequenceResponse response;
    Check(stub->CreateSequence(&context, request, &response), "CreateSequence");
  }
  void ReleaseSequence(const std::string& id) {
    grpc::ClientContext context;
    pb::ReleaseSequenceRequest request;
    request.set_session_id(attach.session_id());
    request.set_sequence_id(id);
    pb::ReleaseSequenceResponse response;
    Check(stub->ReleaseSequence(&context, request, &response), "ReleaseSequence");
  }
};

// Reads rows of the arena on two threads, the calling one and one kept for the run: what the
// server's finiteness check of the same rows would cost if it did nothing but load them (each
// row's words are OR-ed together so that the loads cannot be dropped). The rows are read in the
// order the worker wrote them, the first half on the calling thread. The helper sleeps between
// reads (a spinning one would take a core from the server); the clock starts once it is awake.
class RowReader {
 public:
  explicit RowReader(uint64_t row_bytes) : row_bytes_(row_bytes), helper_([this] { Help(); }) {}
  ~RowReader() {
    stop_.store(true);
    Wake();
    helper_.join();
  }

  // Microseconds to read every row of `rows` (byte offsets into `arena`) once.
  double Read(const uint8_t* arena, const std::vector<uint64_t>& rows) {
    arena_ = arena;
    rows_ = &rows;
    Wake();
    while (!awake_.load(std::memory_order_acquire)) {
    }
    const auto start = Clock::now();
    go_.store(true, std::memory_order_release);
    const uint64_t sink = ReadRange(0, rows.size() / 2);
    while (!done_.load(std::memory_order_acquire)) {
    }
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    benchmark::DoNotOptimize(sink);
    awake_.store(false);
    go_.store(false);
    done_.store(false);
    return us;
  }

 private:
  void Wake() {
    epoch_.fetch_add(1);
    epoch_.notify_one();
  }

  uint64_t ReadRange(size_t begin, size_t end) const {
    // Rows 8 ahead are asked for while one is read, as the server's check does: one cache miss
    // and page walk at a time would measure the latency, not what reading the rows costs.
    constexpr size_t kAhead = 8;
    uint64_t any = 0;
    for (size_t r = begin; r < end; ++r) {
      if (r + kAhead < end) {
        const uint8_t* next = arena_ + (*rows_)[r + kAhead];
        for (uint64_t at = 0; at < row_bytes_; at += 64) __builtin_prefetch(next + at, 0, 3);
      }
      const uint8_t* row = arena_ + (*rows_)[r];
      for (uint64_t at = 0; at < row_bytes_; at += sizeof(uint64_t)) {
        uint64_t word;
        std::memcpy(&word, row + at, sizeof(word));
        any |= word;
      }
    }
    return any;
  }

  void Help() {
    uint64_t seen = 0;
    while (true) {
      epoch_.wait(seen);
      seen = epoch_.load();
      if (stop_.load()) return;
      awake_.store(true, std::memory_order_release);
      while (!go_.load(std::memory_order_acquire)) {
      }
      const uint64_t sink = ReadRange(rows_->size() / 2, rows_->size());
      benchmark::DoNotOptimize(sink);
      done_.store(true, std::memory_order_release);
    }
  }

  const uint64_t row_bytes_;
  const uint8_t* arena_ = nullptr;
  const std::vector<uint64_t>* rows_ = nullptr;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> awake_{false}, go_{false}, done_{false}, stop_{false};
  std::thread helper_;  // last: it reads the members above
};

void BM_DecodeCommit(benchmark::State& state) {
  const int sequences = static_cast<int>(state.range(0));
  constexpr int kTokensPerRound = 64;  // sequences are recreated (untimed) every 64 tokens
  const int blocks = sequences * kLayers * (kTokensPerRound / kBlockTokens + 1);
  Connection connection(blocks);
  const uint64_t block_bytes = connection.attach.arena().block_bytes();
  const uint64_t row_bytes = uint64_t{kHeadDim} * kDtypeBytes;
  std::vector<uint8_t> row(row_bytes, 0x3c);

  std::vector<double> reserve_us, commit_us, step_us, empty_us, floor_us;
  RowReader reader(row_bytes);
  std::vector<uint64_t> written;  // the rows of this step, in the order the worker wrote them
  int round_tokens = kTokensPerRound;
  bool floor_step = false;  // every other step times the read floor instead of the call
  for (auto _ : state) {
    if (round_tokens == kTokensPerRound) {
      state.PauseTiming();
      for (int s = 0; s < sequences; ++s) {
        if (commit_us.size() > 0) connection.ReleaseSequence("s" + std::to_string(s));
        connection.CreateSequence("s" + std::to_string(s));
      }
      round_tokens = 0;
      state.ResumeTiming();
    }
    const auto step_start = Clock::now();
    pb::BatchReserveRequest reserve;
    for (int s = 0; s < sequences; ++s) {
      auto* r = reserve.add_requests();
      r->set_session_id(connection.attach.session_id());
      r->set_sequence_id("s" + std::to_string(s));
      r->set_num_tokens(1);
    }
    pb::BatchReserveResponse reserved;
    const auto reserve_start = Clock::now();
    {
      grpc::ClientContext context;
      Check(connection.stub->BatchReserve(&context, reserve, &reserved), "BatchReserve");
    }
    reserve_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - reserve_start).count());
    // The worker's own write of the new token's K and V rows, every layer and head.
    written.clear();
    for (const auto& response : reserved.responses()) {
      for (const auto& layer : response.layers()) {
        const int slot = layer.first_slot();
        const uint64_t block = layer.blocks(0);
        for (int kv = 0; kv < 2; ++kv) {
          for (int h = 0; h < kKvHeads; ++h) {
            const uint64_t offset =
                block * block_bytes +
                ((static_cast<uint64_t>(kv) * kKvHeads + h) * kBlockTokens + slot % kBlockTokens) *
                    row_bytes;
            std::memcpy(connection.arena + offset, row.data(), row_bytes);
            written.push_back(offset);
          }
        }
      }
    }
    pb::BatchCommitRequest commit;
    for (int s = 0; s < sequences; ++s) {
      auto* c = commit.add_requests();
      c->set_session_id(connection.attach.session_id());
      c->set_sequence_id("s" + std::to_string(s));
      c->set_reservation_id(reserved.responses(s).reservation_id());
    }
    pb::BatchCommitResponse committed;
    // A floor step reads the rows first, which brings them to this process's cores: its call
    // and step are not timed.
    floor_step = !floor_step;
    if (floor_step) floor_us.push_back(reader.Read(connection.arena, written));
    const auto commit_start = Clock::now();
    {
      grpc::ClientContext context;
      Check(connection.stub->BatchCommit(&context, commit, &committed), "BatchCommit");
    }
    const auto end = Clock::now();
    if (!floor_step) {
      commit_us.push_back(std::chrono::duration<double, std::micro>(end - commit_start).count());
      step_us.push_back(std::chrono::duration<double, std::micro>(end - step_start).count());
    }
    {
      grpc::ClientContext context;
      grpc::health::v1::HealthCheckRequest request;  // empty service name: the whole server
      grpc::health::v1::HealthCheckResponse response;
      const auto empty_start = Clock::now();
      Check(connection.health->Check(&context, request, &response), "Health.Check");
      empty_us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - empty_start).count());
    }
    ++round_tokens;
  }
  state.counters["reserve_p50_us"] = Percentile(reserve_us, 0.50);
  state.counters["reserve_p99_us"] = Percentile(reserve_us, 0.99);
  state.counters["commit_p50_us"] = Percentile(commit_us, 0.50);
  state.counters["commit_p99_us"] = Percentile(commit_us, 0.99);
  state.counters["step_p50_us"] = Percentile(step_us, 0.50);
  state.counters["step_p99_us"] = Percentile(step_us, 0.99);
  state.counters["empty_call_p50_us"] = Percentile(empty_us, 0.50);
  state.counters["empty_call_p99_us"] = Percentile(empty_us, 0.99);
  state.counters["read_floor_p50_us"] = Percentile(floor_us, 0.50);
  state.counters["read_MiB"] = written.size() * row_bytes / double(1 << 20);
}
// 1024 steps: 512 timed calls, 512 read floors.
BENCHMARK(BM_DecodeCommit)
    ->ArgName("sequences")
    ->Arg(64)
    ->Iterations(1024)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

int EnvInt(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' ? std::atoi(value) : fallback;
}

// One decode step of a batch as a worker on any backend sends it: per sequence the new token's
// K/V ([L][2][H][1][D]) and its query ([L][Hq][1][D]) inline in one DecodeStep. H2O at its budget:
// the step commits the token, scores it and every kept key with the query in every layer and
// evicts one token per (layer, head). $KVS_BENCH_DECODE_SEQUENCES / _PREFILL / _STEPS shrink it
// (smoke and device runs); the request size is reported, as loopback gRPC moves it at the BM_Append rate.
void BM_DecodeStep(benchmark::State& state) {
  const char* backend_env = std::getenv("KVS_BENCH_BACKEND");
  const std::string backend = backend_env != nullptr ? backend_env : "cpu";
  const int sequences = EnvInt("KVS_BENCH_DECODE_SEQUENCES", static_cast<int>(state.range(0)));
  const int prefill = EnvInt("KVS_BENCH_DECODE_PREFILL", 512);  // = the budget
  const int blocks = sequences * kLayers * (prefill / kBlockTokens + 2);
  Connection connection(blocks, backend);
  const uint64_t row_bytes = uint64_t{kHeadDim} * kDtypeBytes;
  // Prefill: every sequence gets `prefill` tokens in one Append (H2O needs no attention until
  // it is over budget).
  std::vector<uint8_t> payload(uint64_t{kLayers} * 2 * kKvHeads * prefill * row_bytes);
  for (size_t i = 0; i < payload.size(); i += 2) {
    payload[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
    payload[i + 1] = 0x3c;  // fp16 values of magnitude ~1
  }
  for (int s = 0; s < sequences; ++s) {
    const std::string id = "d" + std::to_string(s);
    connection.CreateSequence(id, "h2o", prefill);
    grpc::ClientContext context;
    pb::AppendResponse response;
    auto writer = connection.stub->Append(&context, &response);
    pb::AppendChunk chunk;
    chunk.mutable_header()->set_session_id(connection.attach.session_id());
    chunk.mutable_header()->set_sequence_id(id);
    chunk.mutable_header()->set_num_tokens(prefill);
    chunk.mutable_header()->set_payload_bytes(payload.size());
    writer->Write(chunk);
    for (uint64_t offset = 0; offset < payload.size(); offset += 4 << 20) {
      chunk.set_data(payload.data() + offset,
                     std::min<uint64_t>(4 << 20, payload.size() - offset));
      writer->Write(chunk);
    }
    writer->WritesDone();
    Check(writer->Finish(), "Append (prefill)");
  }
  const std::string kv(uint64_t{kLayers} * 2 * kKvHeads * row_bytes, '\x3c');
  std::string queries(uint64_t{kLayers} * kQHeads * row_bytes, '\0');
  for (size_t i = 1; i < queries.size(); i += 2) queries[i] = static_cast<char>(0x30 + i % 7);
  pb::DecodeStepRequest request;
  for (int s = 0; s < sequences; ++s) {
    auto* item = request.add_items();
    item->set_session_id(connection.attach.session_id());
    item->set_sequence_id("d" + std::to_string(s));
    item->set_inline_kv(kv);
    item->mutable_attention()->set_num_queries(1);
    item->mutable_attention()->set_softmax_scale(0.08838834764f);
    item->mutable_attention()->set_inline_queries(queries);
  }
  std::vector<double> step_us;
  for (auto _ : state) {
    grpc::ClientContext context;
    pb::DecodeStepResponse response;
    const auto start = Clock::now();
    Check(connection.stub->DecodeStep(&context, request, &response), "DecodeStep");
    step_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    if (response.items_size() != sequences) std::abort();
  }
  state.SetLabel(backend);
  state.counters["sequences"] = sequences;
  state.counters["request_MiB"] = request.ByteSizeLong() / double(1 << 20);
  state.counters["step_p50_us"] = Percentile(step_us, 0.50);
  state.counters["step_p99_us"] = Percentile(step_us, 0.99);
}
// $KVS_BENCH_DECODE_STEPS: the steps timed (a device run with little time left times fewer).
BENCHMARK(BM_DecodeStep)
    ->ArgName("sequences")
    ->Arg(64)
    ->Iterations(EnvInt("KVS_BENCH_DECODE_STEPS", 200))
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

constexpr int kStreamTokens = 2048;  // x 32 layers x 4 KiB per token-layer = 256 MiB payload
uint64_t StreamPayloadBytes() {
  return uint64_t{kLayers} * 2 * kKvHeads * kStreamTokens * kHeadDim * kDtypeBytes;
}

int StreamBlocks() { return kLayers * (kStreamTokens / kBlockTokens) + kLayers; }

void AppendSequence(Connection& connection, const std::string& id,
                    const std::vector<uint8_t>& payload, uint64_t chunk_bytes) {
  grpc::ClientContext context;
  pb::AppendResponse response;
  auto writer = connection.stub->Append(&context, &response);
  pb::AppendChunk header;
  header.mutable_header()->set_session_id(connection.attach.session_id());
  header.mutable_header()->set_sequence_id(id);
  header.mutable_header()->set_num_tokens(kStreamTokens);
  header.mutable_header()->set_payload_bytes(payload.size());
  writer->Write(header);
  pb::AppendChunk chunk;
  for (uint64_t offset = 0; offset < payload.size(); offset += chunk_bytes) {
    const uint64_t size = std::min<uint64_t>(chunk_bytes, payload.size() - offset);
    chunk.set_data(payload.data() + offset, size);
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  Check(writer->Finish(), "Append");
}

void BM_Append(benchmark::State& state) {
  const uint64_t chunk_bytes = uint64_t(state.range(0)) << 20;
  Connection connection(StreamBlocks());
  const std::vector<uint8_t> payload(StreamPayloadBytes(), 0x42);
  double seconds = 0;
  for (auto _ : state) {
    connection.CreateSequence("a");
    const auto start = Clock::now();
    AppendSequence(connection, "a", payload, chunk_bytes);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    connection.ReleaseSequence("a");
  }
  const double rate = payload.size() * state.iterations() / seconds;
  state.counters["GBps"] = rate / 1e9;
  state.counters["memcpy_GBps"] = MemcpyBytesPerSecond(256ull << 20) / 1e9;
}
BENCHMARK(BM_Append)
    ->ArgName("chunk_MiB")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Iterations(4)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Export(benchmark::State& state) {
  const uint64_t chunk_bytes = uint64_t(state.range(0)) << 20;
  Connection connection(StreamBlocks());
  const std::vector<uint8_t> payload(StreamPayloadBytes(), 0x42);
  connection.CreateSequence("e");
  AppendSequence(connection, "e", payload, 4 << 20);
  double seconds = 0;
  uint64_t received = 0;
  std::vector<uint8_t> sink(payload.size(), 0);  // the worker's destination, touched beforehand
  for (auto _ : state) {
    grpc::ClientContext context;
    pb::ExportRequest request;
    request.set_session_id(connection.attach.session_id());
    request.set_sequence_id("e");
    request.set_chunk_bytes(chunk_bytes);
    const auto start = Clock::now();
    auto reader = connection.stub->Export(&context, request);
    pb::ExportChunk chunk;
    uint64_t offset = 0;
    while (reader->Read(&chunk)) {
      if (chunk.has_data()) {
        std::memcpy(sink.data() + offset, chunk.data().data(), chunk.data().size());
        offset += chunk.data().size();
      }
    }
    Check(reader->Finish(), "Export");
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    received += offset;
    if (offset != payload.size()) std::abort();
  }
  state.counters["GBps"] = received / seconds / 1e9;
  state.counters["memcpy_GBps"] = MemcpyBytesPerSecond(256ull << 20) / 1e9;
}
BENCHMARK(BM_Export)
    ->ArgName("chunk_MiB")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Iterations(4)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
