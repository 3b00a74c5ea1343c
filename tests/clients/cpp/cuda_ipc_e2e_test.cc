// Two processes on one GPU (issue 5): the real `kvsidecar --backend=cuda` and this test as the
// worker. The worker maps the session's arena through CUDA IPC (clients/cpp/cuda_ipc.cc), writes
// K/V into reserved slots with its own stream (cudaMemcpyAsync), synchronises and commits (rule
// (a) of common.proto ArenaHandle); the sidecar compresses; the worker reads the compacted cache in
// place through the mapping right after the response (rule (b)), bit-identical for every kept
// token. A second worker process that is SIGKILLed while writing leaves no GPU memory behind once
// the sidecar has reclaimed its session.
//
// Without CUDA in the build or without a device every test reports itself SKIPPED ("no CUDA
// device ..."); nothing here can pass on a host without a GPU.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "clients/cpp/cuda_ipc.h"
#include "gmock/gmock.h"
#include "gpu/backend_factory.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

#ifdef KVS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

// The child worker of KilledWriterLeavesNoGpuMemoryBehind reads the server's address from here.
constexpr char kChildTargetEnv[] = "KVS_CUDA_IPC_CHILD_TARGET";

// Empty when this process can run the GPU tests, else why not (the skip reason).
std::string WhyNoCuda() {
  if (!kvs::CudaBuilt() || !kvsidecar::internal::ClientBuiltWithCuda()) {
    return "no CUDA device: this build has no CUDA (KVS_WITH_CUDA off)";
  }
  const kvs::CudaProbe& probe = kvs::ProbeCuda();
  if (probe.devices == 0) return "no CUDA device: " + probe.detail;
  return "";
}

#ifdef KVS_WITH_CUDA

#define ASSERT_CUDA(expr)                                                                          \
  do {                                                                                             \
    const cudaError_t kvs_cuda_error = (expr);                                                     \
    ASSERT_EQ(kvs_cuda_error, cudaSuccess) << #expr << ": " << cudaGetErrorString(kvs_cuda_error); \
  } while (0)

// H=8, D=128 fp16 blocks of B=16 tokens: 64 KiB each.
v1::ModelLayout GpuLayout() { return MakeLayout(2, 8, 32, 128, v1::DTYPE_FLOAT16, 16); }

// Page-locked host memory, so that cudaMemcpyAsync is truly asynchronous on the worker's stream.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMallocHost(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  ~PinnedBuffer() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

// Enqueues PatternRow(seed) of every (layer, kv, head, token) of `reservation` on `stream`, from
// `staging` (pinned) into the reserved slots through the mapping. Does not synchronise.
absl::Status EnqueuePatternWrites(const kvsidecar::Reservation& reservation,
                                  const v1::ModelLayout& layout, uint64_t seed,
                                  PinnedBuffer& staging, cudaStream_t stream) {
  const size_t row_bytes = reservation.geometry().row_bytes();
  size_t offset = 0;
  for (const v1::LayerSlots& slots : reservation.response().layers()) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < layout.num_kv_heads(); ++head) {
        for (int i = 0; i < reservation.num_tokens(); ++i) {
          if (offset + row_bytes > staging.size()) return absl::InternalError("staging too small");
          const std::vector<uint8_t> row =
              PatternRow(layout, seed, slots.layer(), kv, head, reservation.positions()[i]);
          std::memcpy(staging.data() + offset, row.data(), row_bytes);
          absl::StatusOr<uint8_t*> destination = reservation.RowPointer(slots.layer(), kv, head, i);
          if (!destination.ok()) return destination.status();
          const cudaError_t error = cudaMemcpyAsync(*destination, staging.data() + offset,
                                                    row_bytes, cudaMemcpyHostToDevice, stream);
          if (error != cudaSuccess) {
            return absl::InternalError(
                absl::StrCat("cudaMemcpyAsync: ", cudaGetErrorString(error)));
          }
          offset += row_bytes;
        }
      }
    }
  }
  return absl::OkStatus();
}

class CudaIpcE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = WhyNoCuda();
    if (!why.empty()) GTEST_SKIP() << why;
    ServerProcess::Options options;
    options.lease_ms = 2000;
    options.extra_args = {"--backend=cuda", "--arena_capacity_bytes=2G"};
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
};

TEST_F(CudaIpcE2eTest, WorkerStreamWritesSidecarCompressesWorkerReadsKeptTokensInPlace) {
  const v1::ModelLayout layout = GpuLayout();
  v1::AttachRequest attach;
  *attach.mutable_layout() = layout;
  attach.set_num_blocks(64);
  auto session = client_->Attach(attach);
  ASSERT_TRUE(session.ok()) << session.status() << "\n" << server_->Logs();
  kvsidecar::Session& s = **session;
  ASSERT_EQ(s.attach_response().backend(), "cuda");
  const v1::ArenaHandle& handle = s.arena();
  ASSERT_EQ(handle.kind(), v1::ArenaHandle::KIND_CUDA_IPC);
  EXPECT_TRUE(handle.cuda_ipc_event_handle().empty());  // the synchronous rule: no events
  const kvsidecar::ArenaGeometry& geometry = s.geometry();
  ASSERT_TRUE(geometry.on_device());
  // The mapping is on the local device with the handle's UUID.
  cudaDeviceProp props;
  ASSERT_CUDA(cudaGetDeviceProperties(&props, geometry.cuda_device));
  kvsidecar::internal::CudaUuid uuid;
  std::memcpy(uuid.data(), props.uuid.bytes, 16);
  EXPECT_EQ(kvsidecar::internal::FormatCudaUuid(uuid), handle.cuda_device_uuid());
  cudaPointerAttributes attributes;
  ASSERT_CUDA(cudaPointerGetAttributes(&attributes, geometry.base));
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);

  constexpr int kTokens = 160;
  constexpr int kBudget = 48;
  constexpr uint64_t kSeed = 77;
  ASSERT_TRUE(s.CreateSequence(KeyDiffPolicy(), MakeBudget(kBudget), "seq").ok());
  auto reservation = s.Reserve("seq", kTokens);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  cudaStream_t stream;
  ASSERT_CUDA(cudaSetDevice(geometry.cuda_device));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PinnedBuffer staging(static_cast<size_t>(layout.num_layers()) * 2 * layout.num_kv_heads() *
                       kTokens * geometry.row_bytes());
  ASSERT_NE(staging.data(), nullptr);
  ASSERT_TRUE(EnqueuePatternWrites(*reservation, layout, kSeed, staging, stream).ok());
  // Rule (a): the stream that wrote is synchronised before Commit is sent.
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  auto committed = s.Commit(*reservation);
  ASSERT_TRUE(committed.ok()) << committed.status();

  auto compressed = s.Compress("seq");
  ASSERT_TRUE(compressed.ok()) << compressed.status() << "\n" << server_->Logs();
  // Rule (b): read at once after the response, through the mapping, on the worker's stream.
  auto layout_response = s.GetLayout("seq");
  ASSERT_TRUE(layout_response.ok()) << layout_response.status();
  auto exported = s.Export("seq");
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(layout_response->layers_size(), layout.num_layers());
  const size_t row_bytes = geometry.row_bytes();
  int checked = 0;
  for (int li = 0; li < layout_response->layers_size(); ++li) {
    const v1::LayerLayout& entry = layout_response->layers(li);
    const int count = entry.count();
    EXPECT_EQ(count, kBudget) << "layer " << entry.layer();
    ASSERT_EQ(entry.positions_size(), layout.num_kv_heads() * count);
    PinnedBuffer read(static_cast<size_t>(2) * layout.num_kv_heads() * count * row_bytes);
    ASSERT_NE(read.data(), nullptr);
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < layout.num_kv_heads(); ++head) {
        for (int slot = 0; slot < count; ++slot) {
          auto source = s.RowAddress(entry, kv, head, slot);
          ASSERT_TRUE(source.ok()) << source.status();
          const size_t at = ((kv * layout.num_kv_heads() + head) * count + slot) * row_bytes;
          ASSERT_CUDA(cudaMemcpyAsync(read.data() + at, *source, row_bytes, cudaMemcpyDeviceToHost,
                                      stream));
        }
      }
    }
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    for (int head = 0; head < layout.num_kv_heads(); ++head) {
      std::set<int> seen;
      for (int slot = 0; slot < count; ++slot) {
        const int position = entry.positions(head * count + slot);
        EXPECT_TRUE(position >= 0 && position < kTokens) << position;
        EXPECT_TRUE(seen.insert(position).second) << "position " << position << " held twice";
        for (int kv = 0; kv < 2; ++kv) {
          const std::vector<uint8_t> expected =
              PatternRow(layout, kSeed, entry.layer(), kv, head, position);
          const size_t at = ((kv * layout.num_kv_heads() + head) * count + slot) * row_bytes;
          ASSERT_EQ(std::memcmp(read.data() + at, expected.data(), row_bytes), 0)
              << "layer " << entry.layer() << " head " << head << " slot " << slot << " position "
              << position << (kv == 0 ? " K" : " V");
          auto streamed = exported->Row(li, kv, head, slot);
          ASSERT_TRUE(streamed.ok()) << streamed.status();
          ASSERT_EQ(std::memcmp(streamed->data(), expected.data(), row_bytes), 0);
          ++checked;
        }
      }
    }
    // The client's own copy helper reads the same bytes; the host-span ReadRow is refused.
    std::vector<uint8_t> row(row_bytes);
    ASSERT_TRUE(s.ReadRowInto(entry, 1, 0, 0, absl::MakeSpan(row)).ok());
    EXPECT_EQ(
        std::memcmp(row.data(), read.data() + layout.num_kv_heads() * count * row_bytes, row_bytes),
        0);
    EXPECT_EQ(s.ReadRow(entry, 0, 0, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(checked, layout.num_layers() * 2 * layout.num_kv_heads() * kBudget);
  ASSERT_CUDA(cudaStreamDestroy(stream));
  ASSERT_TRUE(s.Detach().ok());
  EXPECT_EQ(kvsidecar::internal::CudaIpcMappings::Global().open_mappings(), 0);
}

TEST_F(CudaIpcE2eTest, KilledWriterLeavesNoGpuMemoryBehind) {
  // Warm-up: one full session cycle (write, commit, compress, detach) first, so that whatever the
  // server allocates once and keeps (scratch, staging) is in the baseline, not in the difference.
  {
    v1::AttachRequest attach;
    *attach.mutable_layout() = GpuLayout();
    attach.set_num_blocks(64);
    auto session = client_->Attach(attach);
    ASSERT_TRUE(session.ok()) << session.status() << "\n" << server_->Logs();
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(16), "warm").ok());
    auto written = WriteTokens(**session, "warm", 64, 1);
    ASSERT_TRUE(written.ok()) << written.status();
    ASSERT_TRUE((*session)->Compress("warm").ok());
    ASSERT_TRUE((*session)->Detach().ok());
  }
  auto before = admin_->GetStats();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_CUDA(cudaFree(nullptr));  // this process's context exists before the first measurement
  size_t free_before = 0, total = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));

  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(n, 0);
  self[n] = '\0';
  ASSERT_EQ(setenv(kChildTargetEnv, server_->data_target().c_str(), 1), 0);
  auto child =
      ChildProcess::Spawn({self, "--gtest_filter=CudaIpcWorkerChild.MapsAndWritesUntilKilled"},
                          server_->dir(), "cuda-worker");
  unsetenv(kChildTargetEnv);
  ASSERT_TRUE(child.ok()) << child.status();
  std::string out;
  ASSERT_TRUE(PollUntil(
      [&] {
        out = (*child)->Stdout();
        return out.find("WRITING") != std::string::npos || !(*child)->Running();
      },
      kStartTimeout));
  ASSERT_THAT(out, HasSubstr("WRITING")) << out << (*child)->Stderr() << server_->Logs();

  // The child's 256 MiB arena is held by the server while the child writes into it.
  constexpr uint64_t kArenaBytes = uint64_t{256} << 20;
  auto during = admin_->GetStats();
  ASSERT_TRUE(during.ok());
  EXPECT_EQ(during->sessions(), before->sessions() + 1);
  EXPECT_GE(during->arena_bytes_reserved(), before->arena_bytes_reserved() + kArenaBytes);
  size_t free_during = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_during, &total));
  EXPECT_LE(free_during + kArenaBytes, free_before);

  // Killed mid-write: its Watch stream breaks and its lease (2 s) lapses; either reclaims it.
  EXPECT_NE((*child)->Stop(SIGKILL, absl::Seconds(10)), -1);
  EXPECT_TRUE(PollUntil(
      [&] {
        auto stats = admin_->GetStats();
        return stats.ok() && stats->sessions() == before->sessions() &&
               stats->arena_bytes_reserved() == before->arena_bytes_reserved();
      },
      kReclaimTimeout))
      << server_->Logs();
  auto after = admin_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->sessions_reclaimed(), before->sessions_reclaimed() + 1);
  // The device memory comes back: the arena was freed (and the dead child's context with it).
  // 64 MiB of slack for allocator granularity, far below the 256 MiB a leaked arena would hold.
  constexpr size_t kSlack = size_t{64} << 20;
  size_t free_after = 0;
  EXPECT_TRUE(PollUntil(
      [&] {
        if (cudaMemGetInfo(&free_after, &total) != cudaSuccess) return false;
        return free_after + kSlack >= free_before;
      },
      kReclaimTimeout))
      << "free before " << free_before << ", after " << free_after;
  EXPECT_TRUE(server_->process().Running()) << server_->Logs();
}

// The worker process KilledWriterLeavesNoGpuMemoryBehind starts (this binary, filtered to this
// test, with the server's address in KVS_CUDA_IPC_CHILD_TARGET): attaches a 256 MiB CUDA arena,
// reserves, and keeps writing into the reserved slots on its own stream until it is killed.
TEST(CudaIpcWorkerChild, MapsAndWritesUntilKilled) {
  const char* target = getenv(kChildTargetEnv);
  if (target == nullptr) {
    GTEST_SKIP() << "runs only as the child process of "
                    "CudaIpcE2eTest.KilledWriterLeavesNoGpuMemoryBehind";
  }
  const std::string why = WhyNoCuda();
  if (!why.empty()) GTEST_SKIP() << why;
  auto client = kvsidecar::Client::Connect(target, TestClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = GpuLayout();
  v1::AttachRequest attach;
  *attach.mutable_layout() = layout;
  attach.set_num_blocks(4096);  // 4096 x 64 KiB = 256 MiB
  auto session = (*client)->Attach(attach);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->geometry().on_device());
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "seq").ok());
  auto reservation = (*session)->Reserve("seq", 512);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  std::printf("MAPPED session=%s\n", (*session)->session_id().c_str());
  std::fflush(stdout);
  ASSERT_CUDA(cudaSetDevice((*session)->geometry().cuda_device));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PinnedBuffer staging(static_cast<size_t>(layout.num_layers()) * 2 * layout.num_kv_heads() * 512 *
                       (*session)->geometry().row_bytes());
  ASSERT_NE(staging.data(), nullptr);
  for (uint64_t round = 0;; ++round) {
    ASSERT_TRUE(EnqueuePatternWrites(*reservation, layout, round, staging, stream).ok());
    if (round == 0) {
      std::printf("WRITING\n");
      std::fflush(stdout);
    }
    // Never synchronised and never committed: the process dies with writes in flight.
  }
}

#else  // !KVS_WITH_CUDA

TEST(CudaIpcE2eTest, WorkerStreamWritesSidecarCompressesWorkerReadsKeptTokensInPlace) {
  GTEST_SKIP() << WhyNoCuda();
}
TEST(CudaIpcE2eTest, KilledWriterLeavesNoGpuMemoryBehind) { GTEST_SKIP() << WhyNoCuda(); }

#endif  // KVS_WITH_CUDA

}  // namespace
}  // namespace kvs_e2e
