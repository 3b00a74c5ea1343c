// In-process tests of the data plane and Admin services: a real KvPool on the CPU backend behind
// a SidecarServer on ephemeral loopback ports, driven through generated gRPC stubs.
#include "service/sidecar_service.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "service/server.h"

namespace kvs {
namespace {

namespace v1 = ::kvsidecar::v1;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

#define ASSERT_GRPC_OK(expr)                                                          \
  do {                                                                                \
    const grpc::Status s_ = (expr);                                                   \
    ASSERT_TRUE(s_.ok()) << "code " << s_.error_code() << ": " << s_.error_message(); \
  } while (0)

#define EXPECT_GRPC_ERROR(expr, expected_code, text)                                   \
  do {                                                                                 \
    const grpc::Status s_ = (expr);                                                    \
    EXPECT_EQ(s_.error_code(), grpc::StatusCode::expected_code) << s_.error_message(); \
    EXPECT_THAT(s_.error_message(), HasSubstr(text));                                  \
  } while (0)

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kHeadDim = 8;
constexpr int kBlockTokens = 4;
constexpr uint64_t kTokenBytes = 2ull * kHeads * kHeadDim * 4;  // one layer, K and V, fp32

v1::ModelLayout SmallLayout() {
  v1::ModelLayout layout;
  layout.set_num_layers(kLayers);
  layout.set_num_kv_heads(kHeads);
  layout.set_num_q_heads(2 * kHeads);
  layout.set_head_dim(kHeadDim);
  layout.set_dtype(v1::DTYPE_FLOAT32);
  layout.set_block_tokens(kBlockTokens);
  return layout;
}

// A payload of `bytes` bytes with a recognisable pattern that differs per `seed`.
std::string Pattern(uint64_t bytes, uint32_t seed) {
  std::string out(bytes, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<char>(x >> 24);
    // K/V must be finite: bit 6 of every odd byte cleared keeps an exponent bit of every fp16,
    // bf16 and fp32 value zero.
    if (i % 2 == 1) out[i] = static_cast<char>(out[i] & ~0x40);
  }
  return out;
}

// A loopback port that was free a moment ago.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

std::unique_ptr<grpc::ClientContext> Context(int seconds = 20) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

class SidecarServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend(2);
    PoolOptions options;
    options.arena_capacity_bytes = uint64_t{256} << 20;
    options.default_session_bytes = uint64_t{4} << 20;
    options.arena_options.name_prefix = "kvsidecar-service-test";
    // These in-process tests map the arena by path; the memfd hand-over is tested end to end
    // (tests/e2e/arena_isolation_test.cc).
    options.arena_options.shm_names = true;
    pool_ = std::make_unique<KvPool>(backend_.get(), &clock_, options);
    ServerOptions server_options;
    server_options.listen = "127.0.0.1:0";
    server_options.admin_listen = "127.0.0.1:0";
    server_options.reap_interval = absl::Milliseconds(20);
    server_options.admin_info.effective_config_yaml = "listen: \"127.0.0.1:0\"\n";
    server_options.admin_info.backend = "cpu";
    server_options.admin_info.backend_reason = "test backend";
    auto server = SidecarServer::Start(pool_.get(), server_options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    channel_ = grpc::CreateCustomChannel(server_->data_address(),
                                         grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Sidecar::NewStub(channel_);
    admin_channel_ =
        grpc::CreateChannel(server_->admin_address(), grpc::InsecureChannelCredentials());
    admin_ = v1::Admin::NewStub(admin_channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(2));
    server_.reset();
    pool_.reset();
  }

  // ---- helpers ----
  // A Watch stream on `session_id` that has already received its first event (KIND_WATCHING).
  struct WatchStream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> reader;
  };
  WatchStream WatchOk(const std::string& session_id) {
    v1::WatchRequest request;
    request.set_session_id(session_id);
    WatchStream stream;
    stream.context = Context();
    stream.reader = stub_->Watch(stream.context.get(), request);
    v1::SessionEvent first;
    EXPECT_TRUE(stream.reader->Read(&first));
    EXPECT_EQ(first.kind(), v1::SessionEvent::KIND_WATCHING);
    return stream;
  }

  v1::AttachResponse AttachOk(v1::ModelLayout layout = SmallLayout(), int num_blocks = 0,
                              const std::string& tenant = "") {
    v1::AttachRequest request;
    *request.mutable_layout() = layout;
    request.set_num_blocks(num_blocks);
    request.set_tenant(tenant);
    request.set_worker_name("test-worker");
    v1::AttachResponse response;
    const grpc::Status status = stub_->Attach(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  grpc::Status Create(const std::string& session, v1::CreateSequenceResponse* response,
                      const std::string& sequence_id = "", const v1::PolicySpec* policy = nullptr,
                      const v1::Budget* budget = nullptr) {
    v1::CreateSequenceRequest request;
    request.set_session_id(session);
    request.set_sequence_id(sequence_id);
    if (policy != nullptr) *request.mutable_policy() = *policy;
    if (budget != nullptr) *request.mutable_budget() = *budget;
    return stub_->CreateSequence(Context().get(), request, response);
  }

  std::string CreateOk(const std::string& session, const std::string& sequence_id = "") {
    v1::CreateSequenceResponse response;
    const grpc::Status status = Create(session, &response, sequence_id);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.sequence_id();
  }

  grpc::Status Reserve(const std::string& session, const std::string& sequence, int num_tokens,
                       v1::ReserveResponse* response) {
    v1::ReserveRequest request;
    request.set_session_id(session);
    request.set_sequence_id(sequence);
    request.set_num_tokens(num_tokens);
    return stub_->Reserve(Context().get(), request, response);
  }

  v1::AppendHeader Header(const std::string& session, const std::string& sequence, int tokens,
                          int layers = kLayers) {
    v1::AppendHeader header;
    header.set_session_id(session);
    header.set_sequence_id(sequence);
    header.set_num_tokens(tokens);
    header.set_payload_bytes(static_cast<uint64_t>(layers) * tokens * kTokenBytes);
    return header;
  }

  // Messages of one segment: the header, then `payload` cut into chunks whose sizes cycle
  // through `chunk_sizes`.
  static void AddSegment(std::vector<v1::AppendChunk>* messages, const v1::AppendHeader& header,
                         const std::string& payload, const std::vector<size_t>& chunk_sizes) {
    v1::AppendChunk first;
    *first.mutable_header() = header;
    messages->push_back(first);
    size_t offset = 0;
    for (size_t i = 0; offset < payload.size(); ++i) {
      const size_t n = std::min(chunk_sizes[i % chunk_sizes.size()], payload.size() - offset);
      v1::AppendChunk chunk;
      chunk.set_data(payload.substr(offset, n));
      messages->push_back(std::move(chunk));
      offset += n;
    }
  }

  grpc::Status Append(const std::vector<v1::AppendChunk>& messages, v1::AppendResponse* response) {
    auto context = Context();
    auto writer = stub_->Append(context.get(), response);
    for (const v1::AppendChunk& message : messages) {
      if (!writer->Write(message)) break;  // the server finished early (an error)
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status AppendOk(const std::string& session, const std::string& sequence,
                        const std::string& payload, int tokens) {
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, Header(session, sequence, tokens), payload, {1 << 20});
    v1::AppendResponse response;
    return Append(messages, &response);
  }

  grpc::Status Export(const v1::ExportRequest& request, v1::ExportHeader* header,
                      std::string* payload, int* data_messages = nullptr) {
    auto context = Context();
    auto reader = stub_->Export(context.get(), request);
    v1::ExportChunk chunk;
    int messages = 0;
    bool saw_header = false;
    while (reader->Read(&chunk)) {
      if (chunk.has_header()) {
        EXPECT_FALSE(saw_header) << "two headers";
        EXPECT_EQ(messages, 0) << "header after data";
        *header = chunk.header();
        saw_header = true;
      } else {
        EXPECT_TRUE(saw_header) << "data before the header";
        payload->append(chunk.data());
        ++messages;
      }
    }
    if (data_messages != nullptr) *data_messages = messages;
    return reader->Finish();
  }

  v1::GetLayoutResponse LayoutOf(const std::string& session, const std::string& sequence) {
    v1::GetLayoutRequest request;
    request.set_session_id(session);
    request.set_sequence_id(sequence);
    v1::GetLayoutResponse response;
    const grpc::Status status = stub_->GetLayout(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // Polls until `session` is gone from the pool (the reclaim runs on a gRPC thread).
  bool WaitSessionGone(const std::string& session) {
    for (int i = 0; i < 1000; ++i) {
      if (pool_->GetSession(session).status().code() == absl::StatusCode::kNotFound) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  // grpc.health.v1.Health/Check through the generic stub; returns the serving status enum
  // (1 SERVING, 2 NOT_SERVING) or -1 with the call failing.
  int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
    grpc::GenericStub generic(channel);
    std::string request_bytes;
    if (!service.empty()) {
      request_bytes.push_back(0x0a);
      request_bytes.push_back(static_cast<char>(service.size()));
      request_bytes += service;
    }
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    absl::Mutex mu;
    bool done = false;
    grpc::Status result;
    generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status status) {
                        absl::MutexLock lock(&mu);
                        result = std::move(status);
                        done = true;
                      });
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&done));
    }
    if (!result.ok()) return -1;
    std::vector<grpc::Slice> slices;
    response.Dump(&slices);
    std::string bytes;
    for (const grpc::Slice& s : slices)
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    if (bytes.size() == 2 && bytes[0] == 0x08) return bytes[1];
    return bytes.empty() ? 0 : -2;
  }

  FakeClock clock_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<SidecarServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<grpc::Channel> admin_channel_;
  std::unique_ptr<v1::Sidecar::Stub> stub_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

// ---- Server -------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, BindsEphemeralPortsAndPrintsThem) {
  EXPECT_GT(server_->data_port(), 0);
  EXPECT_GT(server_->admin_port(), 0);
  EXPECT_NE(server_->data_port(), server_->admin_port());
  EXPECT_EQ(server_->ListeningLine(),
            absl::StrCat("kvsidecar listening data=127.0.0.1:", server_->data_port(),
                         " admin=127.0.0.1:", server_->admin_port()));
}

TEST_F(SidecarServiceTest, HealthServiceReportsServing) {
  EXPECT_EQ(HealthStatus(channel_, ""), 1);
  EXPECT_EQ(HealthStatus(channel_, "kvsidecar.v1.Sidecar"), 1);
  EXPECT_EQ(HealthStatus(admin_channel_, "kvsidecar.v1.Admin"), 1);
}

TEST_F(SidecarServiceTest, ReflectionListsTheServices) {
  grpc::GenericStub generic(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto call = generic.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](int id) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(tag, reinterpret_cast<void*>(id));
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(step(1));
  // ServerReflectionRequest { list_services = "" } (field 7, length-delimited).
  const std::string request_bytes("\x3a\x00", 2);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(step(2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  ASSERT_TRUE(step(3));
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_THAT(bytes, HasSubstr("kvsidecar.v1.Sidecar"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
}

TEST_F(SidecarServiceTest, SharedAddressServesBothServicesOnOnePort) {
  ServerOptions options;
  options.listen = absl::StrCat("127.0.0.1:", FreePort());
  options.admin_listen = options.listen;  // equal addresses: one server
  options.admin_info.backend = "cpu";
  auto server = SidecarServer::Start(pool_.get(), options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->data_port(), (*server)->admin_port());
  auto channel = grpc::CreateChannel((*server)->data_address(), grpc::InsecureChannelCredentials());
  v1::GetStatsResponse stats;
  ASSERT_GRPC_OK(v1::Admin::NewStub(channel)->GetStats(Context().get(), {}, &stats));
  v1::AttachRequest attach;
  *attach.mutable_layout() = SmallLayout();
  v1::AttachResponse attached;
  ASSERT_GRPC_OK(v1::Sidecar::NewStub(channel)->Attach(Context().get(), attach, &attached));
  (*server)->Shutdown();
}

TEST_F(SidecarServiceTest, BusyAddressIsUnavailable) {
  ServerOptions options;
  options.listen = server_->data_address();  // already bound by the fixture's server
  options.admin_listen = "127.0.0.1:0";
  auto server = SidecarServer::Start(pool_.get(), options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr(server_->data_address()));
}

// ---- Sessions -----------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, AttachReturnsAMappableArena) {
  v1::ModelLayout layout = SmallLayout();
  layout.set_block_tokens(0);  // server default
  const v1::AttachResponse attached = AttachOk(layout, 32, "team-a");
  EXPECT_FALSE(attached.session_id().empty());
  EXPECT_EQ(attached.backend(), "cpu");
  EXPECT_EQ(attached.lease_ms(), 10000);
  EXPECT_EQ(attached.layout().block_tokens(), 16);
  EXPECT_EQ(attached.layout().dtype(), v1::DTYPE_FLOAT32);
  const v1::ArenaHandle& arena = attached.arena();
  EXPECT_EQ(arena.kind(), v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
  EXPECT_EQ(arena.block_bytes(), 2u * kHeads * 16 * kHeadDim * 4);
  EXPECT_EQ(arena.num_blocks(), 32);
  EXPECT_GE(arena.size_bytes(), 32 * arena.block_bytes());
  const int fd = open(arena.shm_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << arena.shm_path();
  void* mapped = mmap(nullptr, arena.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_NE(mapped, MAP_FAILED);
  if (mapped != MAP_FAILED) munmap(mapped, arena.size_bytes());
  close(fd);
}

TEST_F(SidecarServiceTest, AttachRefusesBadInput) {
  v1::AttachRequest request;
  v1::AttachResponse response;
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), INVALID_ARGUMENT,
                    "layout is required");
  *request.mutable_layout() = SmallLayout();
  request.mutable_layout()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), INVALID_ARGUMENT,
                    "layout.dtype");
  *request.mutable_layout() = SmallLayout();
  request.mutable_layout()->set_head_dim(-4);
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), INVALID_ARGUMENT,
                    "layout.head_dim");
  *request.mutable_layout() = SmallLayout();
  request.set_staging_bytes((uint64_t{1} << 30) + 1);  // above the largest staging area
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), INVALID_ARGUMENT,
                    "staging_bytes");
  request.set_staging_bytes(0);
  request.set_num_blocks(INT32_MAX);
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), RESOURCE_EXHAUSTED, "");
  request.set_num_blocks(0);
  request.set_lease_ms(1);
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &response), INVALID_ARGUMENT,
                    "lease_ms");
  EXPECT_EQ(pool_->GetStats().sessions, 0);
}

TEST_F(SidecarServiceTest, HeartbeatAndDetach) {
  const v1::AttachResponse attached = AttachOk(SmallLayout(), 40);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_session_id(attached.session_id());
  v1::HeartbeatResponse beat;
  clock_.Advance(absl::Seconds(1));
  ASSERT_GRPC_OK(stub_->Heartbeat(Context().get(), heartbeat, &beat));
  EXPECT_EQ(beat.lease_expires_unix_ms(), absl::ToUnixMillis(clock_.Now() + absl::Seconds(10)));
  EXPECT_EQ(beat.free_blocks(), 40);

  const std::string sequence = CreateOk(attached.session_id());
  ASSERT_GRPC_OK(
      AppendOk(attached.session_id(), sequence, Pattern(5 * kLayers * kTokenBytes, 1), 5));
  ASSERT_GRPC_OK(stub_->Heartbeat(Context().get(), heartbeat, &beat));
  EXPECT_EQ(beat.free_blocks(), 40 - 2 * kLayers);  // 5 tokens = 2 blocks per layer

  v1::DetachRequest detach;
  detach.set_session_id(attached.session_id());
  v1::DetachResponse detached;
  ASSERT_GRPC_OK(stub_->Detach(Context().get(), detach, &detached));
  EXPECT_EQ(detached.sequences_released(), 1);
  EXPECT_EQ(detached.blocks_released(), 2 * kLayers);
  EXPECT_GRPC_ERROR(stub_->Heartbeat(Context().get(), heartbeat, &beat), NOT_FOUND, "");
  EXPECT_GRPC_ERROR(stub_->Detach(Context().get(), detach, &detached), NOT_FOUND, "");
  heartbeat.clear_session_id();
  EXPECT_GRPC_ERROR(stub_->Heartbeat(Context().get(), heartbeat, &beat), INVALID_ARGUMENT,
                    "session_id must not be empty");
}

// ---- Watch --------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, WatchCancelReclaimsTheSession) {
  const v1::AttachResponse attached = AttachOk();
  const std::string sequence = CreateOk(attached.session_id());
  ASSERT_GRPC_OK(
      AppendOk(attached.session_id(), sequence, Pattern(3 * kLayers * kTokenBytes, 2), 3));
  auto [context, reader] = WatchOk(attached.session_id());
  v1::SessionEvent event;

  // At most one watcher per session.
  {
    v1::WatchRequest request;
    request.set_session_id(attached.session_id());
    auto second_context = Context();
    auto second = stub_->Watch(second_context.get(), request);
    EXPECT_FALSE(second->Read(&event));
    EXPECT_GRPC_ERROR(second->Finish(), FAILED_PRECONDITION, "already has a Watch stream");
  }
  ASSERT_TRUE(pool_->GetSession(attached.session_id()).ok());

  context->TryCancel();  // the worker "dies"
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(WaitSessionGone(attached.session_id()));
  EXPECT_EQ(pool_->GetStats().sessions_reclaimed, 1);
  EXPECT_EQ(pool_->GetStats().arena_bytes_used, 0u);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_session_id(attached.session_id());
  v1::HeartbeatResponse beat;
  EXPECT_GRPC_ERROR(stub_->Heartbeat(Context().get(), heartbeat, &beat), NOT_FOUND, "");
}

TEST_F(SidecarServiceTest, WatchClosedConnectionReclaimsTheSession) {
  const v1::AttachResponse attached = AttachOk();
  {
    // A channel of its own, dropped with the stream open: the connection ends.
    auto channel = grpc::CreateChannel(server_->data_address(), grpc::InsecureChannelCredentials());
    auto stub = v1::Sidecar::NewStub(channel);
    v1::WatchRequest request;
    request.set_session_id(attached.session_id());
    auto context = Context();
    auto reader = stub->Watch(context.get(), request);
    v1::SessionEvent event;
    ASSERT_TRUE(reader->Read(&event));
    context->TryCancel();
    reader->Finish();
  }
  EXPECT_TRUE(WaitSessionGone(attached.session_id()));
}

TEST_F(SidecarServiceTest, WatchRefusesUnknownOrEmptySessions) {
  v1::WatchRequest request;
  request.set_session_id("no-such-session");
  auto context = Context();
  auto reader = stub_->Watch(context.get(), request);
  v1::SessionEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_GRPC_ERROR(reader->Finish(), NOT_FOUND, "no-such-session");
  request.clear_session_id();
  auto context2 = Context();
  auto reader2 = stub_->Watch(context2.get(), request);
  EXPECT_FALSE(reader2->Read(&event));
  EXPECT_GRPC_ERROR(reader2->Finish(), INVALID_ARGUMENT, "session_id");
}

TEST_F(SidecarServiceTest, DetachEndsTheWatchStreamCleanly) {
  const v1::AttachResponse attached = AttachOk();
  auto [context, reader] = WatchOk(attached.session_id());
  v1::SessionEvent event;
  v1::DetachRequest detach;
  detach.set_session_id(attached.session_id());
  v1::DetachResponse detached;
  ASSERT_GRPC_OK(stub_->Detach(Context().get(), detach, &detached));
  EXPECT_FALSE(reader->Read(&event));
  ASSERT_GRPC_OK(reader->Finish());
  EXPECT_EQ(pool_->GetStats().sessions_reclaimed, 0);  // detached, not reclaimed
}

TEST_F(SidecarServiceTest, LeaseExpiryEndsTheWatchStream) {
  const v1::AttachResponse attached = AttachOk();
  auto [context, reader] = WatchOk(attached.session_id());
  v1::SessionEvent event;
  clock_.Advance(absl::Seconds(11));  // past the 10 s lease: the reaper reclaims it
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_GRPC_ERROR(reader->Finish(), NOT_FOUND, "lease expired");
  EXPECT_EQ(pool_->GetStats().sessions, 0);
  EXPECT_EQ(pool_->GetStats().sessions_reclaimed, 1);
}

TEST_F(SidecarServiceTest, ShutdownFinishesWatchStreamsWithoutReclaiming) {
  const v1::AttachResponse attached = AttachOk();
  auto [context, reader] = WatchOk(attached.session_id());
  v1::SessionEvent event;
  server_->Shutdown(absl::Seconds(5));
  EXPECT_FALSE(reader->Read(&event));
  ASSERT_GRPC_OK(reader->Finish());
  EXPECT_TRUE(pool_->GetSession(attached.session_id()).ok());
}

// ---- Sequences, Reserve / Commit ----------------------------------------------------------------

TEST_F(SidecarServiceTest, CreateSequenceResolvesPolicyAndBudget) {
  const v1::AttachResponse attached = AttachOk();
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(attached.session_id(), &created, "req-1"));
  EXPECT_EQ(created.sequence_id(), "req-1");
  EXPECT_EQ(created.policy().name(), "keydiff");  // pool default
  EXPECT_EQ(created.budget().tokens_per_layer(), 0);

  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::Budget budget;
  budget.set_tokens_per_layer(64);
  ASSERT_GRPC_OK(Create(attached.session_id(), &created, "", &policy, &budget));
  EXPECT_FALSE(created.sequence_id().empty());
  EXPECT_EQ(created.policy().name(), "streaming_llm");
  EXPECT_EQ(created.policy().streaming_llm().n_sink(), 4);
  EXPECT_EQ(created.budget().tokens_per_layer(), 64);
  EXPECT_EQ(created.budget().prefill_block_tokens(), 128);

  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "req-1"), ALREADY_EXISTS, "req-1");
  policy.set_name("omnikv");
  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "", &policy), INVALID_ARGUMENT,
                    "policy.omnikv.filter_layers is required");
  policy.set_name("magic");
  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "", &policy), INVALID_ARGUMENT,
                    "policy.name 'magic'");
  budget.set_tokens_per_layer(0);
  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "", nullptr, &budget), INVALID_ARGUMENT,
                    "budget.tokens_per_layer");
  budget.set_tokens_per_layer(10);
  budget.add_per_layer_tokens(5);  // the session has kLayers = 2 layers
  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "", nullptr, &budget), INVALID_ARGUMENT,
                    "budget.per_layer_tokens has 1 entries; give one per layer (2) or none");
  budget.add_per_layer_tokens(0);
  EXPECT_GRPC_ERROR(Create(attached.session_id(), &created, "", nullptr, &budget), INVALID_ARGUMENT,
                    "budget.per_layer_tokens[1] must be > 0, got 0");
  EXPECT_GRPC_ERROR(Create("nope", &created), NOT_FOUND, "");
  v1::CreateSequenceRequest retain;
  retain.set_session_id(attached.session_id());
  retain.set_retain_evicted(true);
  EXPECT_GRPC_ERROR(stub_->CreateSequence(Context().get(), retain, &created), FAILED_PRECONDITION,
                    "retain_evicted needs the host tier");
  EXPECT_EQ(pool_->GetStats().sequences, 2);
}

TEST_F(SidecarServiceTest, ReserveWriteThroughArenaCommitExport) {
  const v1::AttachResponse attached = AttachOk(SmallLayout(), 64);
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  constexpr int kTokens = 6;
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, sequence, kTokens, &reserved));
  ASSERT_EQ(reserved.layers_size(), kLayers);
  EXPECT_THAT(reserved.positions(), ElementsAre(0, 1, 2, 3, 4, 5));

  // Write the K/V of every reserved slot through the mapped arena, as a worker would.
  const v1::ArenaHandle& arena = attached.arena();
  const int fd = open(arena.shm_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto* base = static_cast<uint8_t*>(
      mmap(nullptr, arena.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(base, MAP_FAILED);
  auto value = [](int layer, int kv, int head, int token, int d) {
    return static_cast<float>(layer * 10000 + kv * 1000 + head * 100 + token * 10 + d);
  };
  std::string expected;  // the export payload: [layer][2][H][T][D]
  for (const v1::LayerSlots& slots : reserved.layers()) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < kHeads; ++head) {
        for (int i = 0; i < kTokens; ++i) {
          const int slot = slots.first_slot() + i;
          const int block = slots.blocks(slot / kBlockTokens - slots.first_slot() / kBlockTokens);
          const uint64_t row = block * arena.block_bytes() +
                               ((kv * kHeads + head) * kBlockTokens + slot % kBlockTokens) *
                                   kHeadDim * sizeof(float);
          for (int d = 0; d < kHeadDim; ++d) {
            const float v = value(slots.layer(), kv, head, i, d);
            std::memcpy(base + row + d * sizeof(float), &v, sizeof(float));
            expected.append(reinterpret_cast<const char*>(&v), sizeof(float));
          }
        }
      }
    }
  }
  munmap(base, arena.size_bytes());
  close(fd);

  v1::CommitRequest commit;
  commit.set_session_id(session);
  commit.set_sequence_id(sequence);
  commit.set_reservation_id(reserved.reservation_id());
  v1::CommitResponse committed;
  ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &committed));
  EXPECT_THAT(committed.counts(), ElementsAre(kTokens, kTokens));
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &committed), FAILED_PRECONDITION,
                    "already committed");

  const v1::GetLayoutResponse layout = LayoutOf(session, sequence);
  ASSERT_EQ(layout.layers_size(), kLayers);
  EXPECT_EQ(layout.layers(0).count(), kTokens);
  EXPECT_EQ(layout.layers(0).block_table_size(), 2);
  EXPECT_THAT(layout.layers(1).positions(), ElementsAre(0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5));
  EXPECT_EQ(layout.next_position(), kTokens);
  EXPECT_EQ(layout.tier(), v1::TIER_ARENA);

  v1::ExportRequest request;
  request.set_session_id(session);
  request.set_sequence_id(sequence);
  v1::ExportHeader header;
  std::string payload;
  ASSERT_GRPC_OK(Export(request, &header, &payload));
  EXPECT_EQ(header.payload_bytes(), expected.size());
  EXPECT_EQ(header.layout().num_layers(), kLayers);
  EXPECT_EQ(payload, expected);
}

TEST_F(SidecarServiceTest, ReserveAndCommitRefuseBadInput) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  v1::ReserveResponse reserved;
  EXPECT_GRPC_ERROR(Reserve(session, sequence, 0, &reserved), INVALID_ARGUMENT,
                    "num_tokens must be in [1, 1048576], got 0");
  EXPECT_GRPC_ERROR(Reserve(session, sequence, (1 << 20) + 1, &reserved), INVALID_ARGUMENT,
                    "num_tokens");
  EXPECT_GRPC_ERROR(Reserve(session, "missing", 1, &reserved), NOT_FOUND, "missing");
  EXPECT_GRPC_ERROR(Reserve("missing", sequence, 1, &reserved), NOT_FOUND, "");
  EXPECT_GRPC_ERROR(Reserve(session, "", 1, &reserved), INVALID_ARGUMENT, "sequence_id");
  v1::ReserveRequest positions;
  positions.set_session_id(session);
  positions.set_sequence_id(sequence);
  positions.set_num_tokens(3);
  positions.add_positions(5);
  positions.add_positions(9);
  positions.add_positions(7);
  EXPECT_GRPC_ERROR(stub_->Reserve(Context().get(), positions, &reserved), INVALID_ARGUMENT,
                    "positions[2] (7) must be greater than positions[1] (9)");
  // The arena holds 8192 blocks of 4 tokens; a single reservation past that is refused.
  EXPECT_GRPC_ERROR(Reserve(session, sequence, 1 << 20, &reserved), RESOURCE_EXHAUSTED, "");

  ASSERT_GRPC_OK(Reserve(session, sequence, 2, &reserved));
  EXPECT_GRPC_ERROR(Reserve(session, sequence, 2, &reserved), FAILED_PRECONDITION,
                    "pending reservation");
  v1::CommitRequest commit;
  commit.set_session_id(session);
  commit.set_sequence_id(sequence);
  v1::CommitResponse committed;
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &committed), INVALID_ARGUMENT,
                    "reservation_id must be set");
  commit.set_reservation_id(reserved.reservation_id() + 100);
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &committed), NOT_FOUND, "");
}

TEST_F(SidecarServiceTest, ReleaseSequenceReturnsItsBlocks) {
  const v1::AttachResponse attached = AttachOk();
  const std::string sequence = CreateOk(attached.session_id());
  ASSERT_GRPC_OK(
      AppendOk(attached.session_id(), sequence, Pattern(9 * kLayers * kTokenBytes, 3), 9));
  v1::ReleaseSequenceRequest release;
  release.set_session_id(attached.session_id());
  release.set_sequence_id(sequence);
  v1::ReleaseSequenceResponse released;
  ASSERT_GRPC_OK(stub_->ReleaseSequence(Context().get(), release, &released));
  EXPECT_EQ(released.blocks_released(), 3 * kLayers);
  EXPECT_GRPC_ERROR(stub_->ReleaseSequence(Context().get(), release, &released), NOT_FOUND, "");
  EXPECT_EQ(pool_->GetStats().arena_bytes_used, 0u);
}

// ---- Batches ------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, BatchReserveAndBatchCommit) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  std::vector<std::string> sequences;
  for (int i = 0; i < 4; ++i) sequences.push_back(CreateOk(session));
  v1::BatchReserveRequest batch;
  for (const std::string& sequence : sequences) {
    v1::ReserveRequest* item = batch.add_requests();
    item->set_session_id(session);
    item->set_sequence_id(sequence);
    item->set_num_tokens(1);
  }
  v1::BatchReserveResponse reserved;
  ASSERT_GRPC_OK(stub_->BatchReserve(Context().get(), batch, &reserved));
  ASSERT_EQ(reserved.responses_size(), 4);
  v1::BatchCommitRequest commits;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(reserved.responses(i).layers_size(), kLayers);
    v1::CommitRequest* item = commits.add_requests();
    item->set_session_id(session);
    item->set_sequence_id(sequences[i]);
    item->set_reservation_id(reserved.responses(i).reservation_id());
  }
  v1::BatchCommitResponse committed;
  ASSERT_GRPC_OK(stub_->BatchCommit(Context().get(), commits, &committed));
  ASSERT_EQ(committed.responses_size(), 4);
  for (const v1::CommitResponse& response : committed.responses()) {
    EXPECT_THAT(response.counts(), ElementsAre(1, 1));
  }
  // Committing the same batch again fails on the first item: nothing changes.
  EXPECT_GRPC_ERROR(stub_->BatchCommit(Context().get(), commits, &committed), FAILED_PRECONDITION,
                    "requests[0]: ");
}

TEST_F(SidecarServiceTest, BatchReserveRollsBackOnFailure) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string a = CreateOk(session, "a");
  const std::string b = CreateOk(session, "b");
  const std::string c = CreateOk(session, "c");
  v1::ReserveResponse pending;
  ASSERT_GRPC_OK(Reserve(session, c, 1, &pending));  // c cannot take another reservation

  v1::BatchReserveRequest batch;
  for (const std::string& sequence : {a, b, c}) {
    v1::ReserveRequest* item = batch.add_requests();
    item->set_session_id(session);
    item->set_sequence_id(sequence);
    item->set_num_tokens(2);
  }
  v1::BatchReserveResponse reserved;
  EXPECT_GRPC_ERROR(stub_->BatchReserve(Context().get(), batch, &reserved), FAILED_PRECONDITION,
                    "requests[2]: ");
  // a and b hold no reservation any more: reserving them again works.
  v1::ReserveResponse again;
  ASSERT_GRPC_OK(Reserve(session, a, 1, &again));
  ASSERT_GRPC_OK(Reserve(session, b, 1, &again));
  EXPECT_EQ(again.layers(0).first_slot(), 0);
}

TEST_F(SidecarServiceTest, BatchReserveValidatesEveryItemFirst) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string a = CreateOk(session, "a");
  v1::BatchReserveRequest batch;
  v1::ReserveRequest* first = batch.add_requests();
  first->set_session_id(session);
  first->set_sequence_id(a);
  first->set_num_tokens(1);
  v1::ReserveRequest* second = batch.add_requests();
  *second = *first;
  second->set_num_tokens(0);
  v1::BatchReserveResponse reserved;
  EXPECT_GRPC_ERROR(stub_->BatchReserve(Context().get(), batch, &reserved), INVALID_ARGUMENT,
                    "requests[1].num_tokens must be in [1, 1048576], got 0");
  second->set_num_tokens(1);
  EXPECT_GRPC_ERROR(stub_->BatchReserve(Context().get(), batch, &reserved), INVALID_ARGUMENT,
                    "requests[1].sequence_id 'a' repeats requests[0]");
  second->set_sequence_id("ghost");
  EXPECT_GRPC_ERROR(stub_->BatchReserve(Context().get(), batch, &reserved), NOT_FOUND,
                    "requests[1]: ");
  // Nothing was reserved by any of the failed batches.
  v1::ReserveResponse again;
  ASSERT_GRPC_OK(Reserve(session, a, 1, &again));
}

TEST_F(SidecarServiceTest, BatchCommitReportsAMidBatchFailure) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string a = CreateOk(session, "a");
  const std::string b = CreateOk(session, "b");
  v1::ReserveResponse ra;
  ASSERT_GRPC_OK(Reserve(session, a, 1, &ra));
  v1::BatchCommitRequest commits;
  v1::CommitRequest* first = commits.add_requests();
  first->set_session_id(session);
  first->set_sequence_id(a);
  first->set_reservation_id(ra.reservation_id());
  v1::CommitRequest* second = commits.add_requests();
  second->set_session_id(session);
  second->set_sequence_id(b);
  second->set_reservation_id(0);
  v1::BatchCommitResponse committed;
  EXPECT_GRPC_ERROR(stub_->BatchCommit(Context().get(), commits, &committed), INVALID_ARGUMENT,
                    "requests[1].reservation_id must be set");
  EXPECT_EQ(LayoutOf(session, a).layers(0).count(), 0);  // validation failed: nothing committed
  // A stale reservation id in item 1 is caught before item 0 commits.
  second->set_reservation_id(12345);
  EXPECT_GRPC_ERROR(
      stub_->BatchCommit(Context().get(), commits, &committed), NOT_FOUND,
      "requests[1]: reservation 12345 not found in sequence b (nothing was committed)");
  EXPECT_EQ(LayoutOf(session, a).layers(0).count(), 0);
  v1::ReserveResponse rb;
  ASSERT_GRPC_OK(Reserve(session, b, 2, &rb));
  second->set_reservation_id(rb.reservation_id());
  ASSERT_GRPC_OK(stub_->BatchCommit(Context().get(), commits, &committed));
  ASSERT_EQ(committed.responses_size(), 2);
  EXPECT_THAT(committed.responses(1).counts(), ElementsAre(2, 2));
  // An id that was already committed is FAILED_PRECONDITION, again before anything commits.
  v1::ReserveResponse ra2;
  ASSERT_GRPC_OK(Reserve(session, a, 1, &ra2));
  first->set_reservation_id(ra2.reservation_id());
  EXPECT_GRPC_ERROR(stub_->BatchCommit(Context().get(), commits, &committed), FAILED_PRECONDITION,
                    "requests[1]: reservation");
  EXPECT_EQ(LayoutOf(session, a).layers(0).count(), 1);
}

// ---- CancelReservation and per-layer reservations -----------------------------------------------

TEST_F(SidecarServiceTest, CancelReservationReturnsTheSlots) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session, "s");
  ASSERT_GRPC_OK(AppendOk(session, sequence, Pattern(3 * kLayers * kTokenBytes, 20), 3));
  const uint64_t used = pool_->GetStats().arena_bytes_used;
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, sequence, 6, &reserved));
  EXPECT_GT(pool_->GetStats().arena_bytes_used, used);

  v1::CancelReservationRequest cancel;
  cancel.set_session_id(session);
  cancel.set_sequence_id(sequence);
  cancel.set_reservation_id(reserved.reservation_id());
  v1::CancelReservationResponse cancelled;
  ASSERT_GRPC_OK(stub_->CancelReservation(Context().get(), cancel, &cancelled));
  EXPECT_EQ(pool_->GetStats().arena_bytes_used, used);
  EXPECT_EQ(LayoutOf(session, sequence).layers(0).count(), 3);
  EXPECT_GRPC_ERROR(stub_->CancelReservation(Context().get(), cancel, &cancelled),
                    FAILED_PRECONDITION, "was cancelled");
  v1::CommitRequest commit;
  commit.set_session_id(session);
  commit.set_sequence_id(sequence);
  commit.set_reservation_id(reserved.reservation_id());
  v1::CommitResponse committed;
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &committed), FAILED_PRECONDITION,
                    "was cancelled");
  // The sequence takes a new reservation at the same slots.
  v1::ReserveResponse again;
  ASSERT_GRPC_OK(Reserve(session, sequence, 1, &again));
  EXPECT_EQ(again.layers(0).first_slot(), 3);

  cancel.set_reservation_id(987654);
  EXPECT_GRPC_ERROR(stub_->CancelReservation(Context().get(), cancel, &cancelled), NOT_FOUND,
                    "reservation 987654");
  cancel.set_reservation_id(0);
  EXPECT_GRPC_ERROR(stub_->CancelReservation(Context().get(), cancel, &cancelled), INVALID_ARGUMENT,
                    "reservation_id must be set");
  cancel.set_reservation_id(again.reservation_id());
  cancel.set_sequence_id("ghost");
  EXPECT_GRPC_ERROR(stub_->CancelReservation(Context().get(), cancel, &cancelled), NOT_FOUND,
                    "ghost");
  cancel.set_sequence_id(sequence);
  cancel.set_session_id("");
  EXPECT_GRPC_ERROR(stub_->CancelReservation(Context().get(), cancel, &cancelled), INVALID_ARGUMENT,
                    "session_id must not be empty");
  // None of the refused calls touched the pending reservation.
  commit.set_reservation_id(again.reservation_id());
  ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &committed));
  EXPECT_THAT(committed.counts(), ElementsAre(4, 4));
}

TEST_F(SidecarServiceTest, StrictBudgetEvictionStaysWhenTheReservationIsCancelled) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::Budget budget;
  budget.set_tokens_per_layer(4);
  budget.set_strict(true);
  budget.set_prefill_block_tokens(4);
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "s", &policy, &budget));
  ASSERT_GRPC_OK(AppendOk(session, "s", Pattern(4 * kLayers * kTokenBytes, 21), 4));
  ASSERT_GRPC_OK(AppendOk(session, "s", Pattern(4 * kLayers * kTokenBytes, 22), 4));
  EXPECT_EQ(LayoutOf(session, "s").layers(0).count(), 8);
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, "s", 4, &reserved));
  EXPECT_EQ(reserved.evicted_before(), 4);
  v1::CancelReservationRequest cancel;
  cancel.set_session_id(session);
  cancel.set_sequence_id("s");
  cancel.set_reservation_id(reserved.reservation_id());
  v1::CancelReservationResponse cancelled;
  ASSERT_GRPC_OK(stub_->CancelReservation(Context().get(), cancel, &cancelled));
  // As documented in the proto: the tokens evicted to respect the budget stay evicted.
  const v1::GetLayoutResponse layout = LayoutOf(session, "s");
  EXPECT_EQ(layout.layers(0).count(), 4);
  EXPECT_EQ(layout.layers(1).count(), 4);
}

TEST_F(SidecarServiceTest, ReserveInALayerSubset) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session, "s");
  v1::ReserveRequest request;
  request.set_session_id(session);
  request.set_sequence_id(sequence);
  request.set_num_tokens(5);
  request.add_layers(1);
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(stub_->Reserve(Context().get(), request, &reserved));
  ASSERT_EQ(reserved.layers_size(), 1);
  EXPECT_EQ(reserved.layers(0).layer(), 1);
  EXPECT_EQ(reserved.layers(0).blocks_size(), 2);
  v1::CommitRequest commit;
  commit.set_session_id(session);
  commit.set_sequence_id(sequence);
  commit.set_reservation_id(reserved.reservation_id());
  v1::CommitResponse committed;
  ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &committed));
  EXPECT_THAT(committed.counts(), ElementsAre(0, 5));

  // Both layers, listed in reverse: the response follows the order asked.
  request.clear_layers();
  request.add_layers(1);
  request.add_layers(0);
  request.set_num_tokens(1);
  ASSERT_GRPC_OK(stub_->Reserve(Context().get(), request, &reserved));
  ASSERT_EQ(reserved.layers_size(), 2);
  EXPECT_EQ(reserved.layers(0).layer(), 1);
  EXPECT_EQ(reserved.layers(0).first_slot(), 5);
  EXPECT_EQ(reserved.layers(1).layer(), 0);
  EXPECT_EQ(reserved.layers(1).first_slot(), 0);
  commit.set_reservation_id(reserved.reservation_id());
  ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &committed));
  EXPECT_THAT(committed.counts(), ElementsAre(1, 6));

  request.clear_layers();
  request.add_layers(2);
  EXPECT_GRPC_ERROR(stub_->Reserve(Context().get(), request, &reserved), INVALID_ARGUMENT,
                    "layers[0] = 2 is out of range [0, 2)");
  request.clear_layers();
  request.add_layers(0);
  request.add_layers(0);
  EXPECT_GRPC_ERROR(stub_->Reserve(Context().get(), request, &reserved), INVALID_ARGUMENT,
                    "layers[1] repeats layer 0");
  v1::BatchReserveRequest batch;
  v1::ReserveRequest* good = batch.add_requests();
  *good = request;
  good->clear_layers();
  v1::ReserveRequest* bad = batch.add_requests();
  *bad = request;
  bad->set_sequence_id(CreateOk(session, "t"));
  bad->clear_layers();
  bad->add_layers(-1);
  v1::BatchReserveResponse batch_reserved;
  EXPECT_GRPC_ERROR(stub_->BatchReserve(Context().get(), batch, &batch_reserved), INVALID_ARGUMENT,
                    "requests[1].layers[0] = -1 is out of range");
  // The refused calls left nothing pending (else this batch would be FAILED_PRECONDITION).
  bad->set_layers(0, 1);
  ASSERT_GRPC_OK(stub_->BatchReserve(Context().get(), batch, &batch_reserved));
  ASSERT_EQ(batch_reserved.responses_size(), 2);
  EXPECT_EQ(batch_reserved.responses(0).layers_size(), kLayers);
  ASSERT_EQ(batch_reserved.responses(1).layers_size(), 1);
  EXPECT_EQ(batch_reserved.responses(1).layers(0).layer(), 1);
}

// ---- Append -------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, AppendExportRoundTripWithOddChunks) {
  const v1::AttachResponse attached = AttachOk(SmallLayout(), 1024);
  const std::string session = attached.session_id();
  const std::string a = CreateOk(session, "a");
  const std::string b = CreateOk(session, "b");
  constexpr int kTokensA = 600;  // 153600 bytes: three 64 KiB export chunks
  constexpr int kTokensB = 37;
  const std::string payload_a = Pattern(kLayers * kTokensA * kTokenBytes, 10);
  const std::string payload_b = Pattern(kLayers * kTokensB * kTokenBytes, 11);
  std::vector<v1::AppendChunk> messages;
  AddSegment(&messages, Header(session, a, kTokensA), payload_a, {1, 7, 1000, 65537, 3});
  AddSegment(&messages, Header(session, b, kTokensB), payload_b, {4096});
  v1::AppendChunk empty;
  empty.set_data("");
  messages.insert(messages.begin() + 1, empty);  // an empty chunk is harmless
  v1::AppendResponse response;
  ASSERT_GRPC_OK(Append(messages, &response));
  ASSERT_EQ(response.items_size(), 2);
  EXPECT_EQ(response.items(0).sequence_id(), "a");
  EXPECT_THAT(response.items(0).counts(), ElementsAre(kTokensA, kTokensA));
  EXPECT_EQ(response.items(1).sequence_id(), "b");
  EXPECT_THAT(response.items(1).counts(), ElementsAre(kTokensB, kTokensB));
  EXPECT_EQ(response.bytes_received(), payload_a.size() + payload_b.size());

  v1::ExportRequest request;
  request.set_session_id(session);
  request.set_sequence_id(a);
  request.set_chunk_bytes(1);  // clamped up to 64 KiB
  v1::ExportHeader header;
  std::string exported;
  int data_messages = 0;
  ASSERT_GRPC_OK(Export(request, &header, &exported, &data_messages));
  EXPECT_EQ(header.payload_bytes(), payload_a.size());
  EXPECT_EQ(data_messages, 3);
  EXPECT_TRUE(exported == payload_a);
  ASSERT_EQ(header.layers_size(), kLayers);
  EXPECT_EQ(header.layers(1).count(), kTokensA);
  EXPECT_EQ(header.layers(1).positions_size(), kHeads * kTokensA);

  // One layer, default chunk size: a single data message with that layer's part.
  request.set_sequence_id(b);
  request.set_chunk_bytes(0);
  request.add_layers(1);
  exported.clear();
  ASSERT_GRPC_OK(Export(request, &header, &exported, &data_messages));
  EXPECT_EQ(data_messages, 1);
  ASSERT_EQ(header.layers_size(), 1);
  EXPECT_EQ(header.layers(0).layer(), 1);
  EXPECT_TRUE(exported == payload_b.substr(kTokensB * kTokenBytes));
}

TEST_F(SidecarServiceTest, AppendWithLayerSubset) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  v1::AppendHeader header = Header(session, sequence, 5, 1);
  header.add_layers(1);
  std::vector<v1::AppendChunk> messages;
  AddSegment(&messages, header, Pattern(5 * kTokenBytes, 4), {100});
  v1::AppendResponse response;
  ASSERT_GRPC_OK(Append(messages, &response));
  EXPECT_THAT(response.items(0).counts(), ElementsAre(0, 5));
}

TEST_F(SidecarServiceTest, AppendRefusesBadStreams) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session, "s1");
  const std::string payload = Pattern(4 * kLayers * kTokenBytes, 5);
  v1::AppendResponse response;

  {  // data before a header
    std::vector<v1::AppendChunk> messages(1);
    messages[0].set_data("xyz");
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "data: a data chunk arrived before any header");
  }
  {  // neither header nor data
    std::vector<v1::AppendChunk> messages(1);
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT, "neither header nor data");
  }
  {  // payload_bytes that does not match the shape
    v1::AppendHeader header = Header(session, sequence, 4);
    header.set_payload_bytes(header.payload_bytes() + 1);
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, header, payload, {payload.size()});
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "header.payload_bytes must be 1024 (2 layers * 2 * 2 kv heads * 4 tokens * "
                      "8 head_dim * 4 bytes), got 1025");
  }
  {  // bad header fields
    v1::AppendHeader header = Header(session, sequence, 4);
    header.add_layers(7);
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, header, "", {1});
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "header.layers[0] = 7 is out of range [0, 2)");
    header = Header("ghost", sequence, 4);
    messages.clear();
    AddSegment(&messages, header, "", {1});
    EXPECT_GRPC_ERROR(Append(messages, &response), NOT_FOUND, "ghost");
    header = Header(session, "ghost", 4);
    messages.clear();
    AddSegment(&messages, header, payload, {1});
    EXPECT_GRPC_ERROR(Append(messages, &response), NOT_FOUND, "ghost");
  }
  {  // a chunk larger than what is left of the segment
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, Header(session, sequence, 4), payload.substr(0, 1012), {1012});
    v1::AppendChunk extra;
    extra.set_data(std::string(13, 'x'));
    messages.push_back(extra);
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "a chunk of 13 bytes exceeds the 12 bytes left in the segment");
  }
  {  // the stream ends mid-segment
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, Header(session, sequence, 4), payload.substr(0, 100), {100});
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "the stream ended inside a segment after 100 of 1024 payload bytes");
  }
  {  // a header inside a segment
    std::vector<v1::AppendChunk> messages;
    AddSegment(&messages, Header(session, sequence, 4), payload.substr(0, 100), {100});
    AddSegment(&messages, Header(session, sequence, 4), payload, {1024});
    EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                      "header: a new header arrived inside a segment");
  }
  // Every failure above cancelled its reservation: the sequence is empty and reservable.
  EXPECT_EQ(LayoutOf(session, sequence).layers(0).count(), 0);
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, sequence, 1, &reserved));
  EXPECT_EQ(reserved.layers(0).first_slot(), 0);
}

TEST_F(SidecarServiceTest, AppendFailureInALaterSegmentKeepsEarlierOnes) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string a = CreateOk(session, "a");
  const std::string payload = Pattern(2 * kLayers * kTokenBytes, 6);
  std::vector<v1::AppendChunk> messages;
  AddSegment(&messages, Header(session, a, 2), payload, {333});
  v1::AppendHeader bad = Header(session, a, 2);
  bad.set_num_tokens(0);
  AddSegment(&messages, bad, "", {1});
  v1::AppendResponse response;
  EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                    "segment 1: header.num_tokens must be in [1, 1048576], got 0 (segments 0..0 "
                    "were committed)");
  EXPECT_EQ(LayoutOf(session, a).layers(0).count(), 2);
}

TEST_F(SidecarServiceTest, AppendStreamCarriesAtMost4096Segments) {
  ASSERT_EQ(kMaxAppendSegments, 4096);
  const int blocks_per_layer = 2 * kMaxAppendSegments / kBlockTokens + 1;  // two streams
  const v1::AttachResponse attached = AttachOk(SmallLayout(), kLayers * blocks_per_layer + 8);
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session, "s");
  const std::string payload = Pattern(kLayers * kTokenBytes, 13);  // one token per segment
  std::vector<v1::AppendChunk> messages;
  for (int i = 0; i <= kMaxAppendSegments; ++i) {
    AddSegment(&messages, Header(session, sequence, 1), payload, {payload.size()});
  }
  v1::AppendResponse response;
  EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                    "segment 4096: header: at most 4096 segments per Append stream");
  EXPECT_GRPC_ERROR(Append(messages, &response), INVALID_ARGUMENT,
                    "(segments 0..4095 were committed)");
  // Both streams committed their first 4096 segments, and nothing of the refused one is pending.
  v1::GetLayoutRequest request;
  request.set_session_id(session);
  request.set_sequence_id(sequence);
  request.set_omit_positions(true);
  v1::GetLayoutResponse layout;
  ASSERT_GRPC_OK(stub_->GetLayout(Context().get(), request, &layout));
  EXPECT_EQ(layout.layers(0).count(), 2 * kMaxAppendSegments);
  EXPECT_EQ(layout.layers(1).count(), 2 * kMaxAppendSegments);
}

TEST_F(SidecarServiceTest, AppendCancelledMidSegmentCancelsTheReservation) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  v1::AppendResponse response;
  auto context = Context();
  auto writer = stub_->Append(context.get(), &response);
  v1::AppendChunk header;
  *header.mutable_header() = Header(session, sequence, 4);
  ASSERT_TRUE(writer->Write(header));
  v1::AppendChunk data;
  data.set_data(std::string(64, 'k'));
  ASSERT_TRUE(writer->Write(data));
  // The header has been processed once its reservation holds blocks; then cancel.
  bool reserved = false;
  for (int i = 0; i < 1000 && !reserved; ++i) {
    reserved = pool_->GetStats().arena_bytes_used > 0;
    if (!reserved) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(reserved);
  context->TryCancel();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  bool freed = false;
  for (int i = 0; i < 1000 && !freed; ++i) {
    freed = pool_->GetStats().arena_bytes_used == 0;
    if (!freed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(freed);
  v1::ReserveResponse probe;
  ASSERT_GRPC_OK(Reserve(session, sequence, 1, &probe));  // no reservation left pending
  EXPECT_EQ(LayoutOf(session, sequence).layers(0).count(), 0);
}

// ---- Export -------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, ExportRefusesBadInput) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  v1::ExportRequest request;
  request.set_session_id(session);
  request.set_sequence_id("ghost");
  v1::ExportHeader header;
  std::string payload;
  EXPECT_GRPC_ERROR(Export(request, &header, &payload), NOT_FOUND, "ghost");
  request.set_sequence_id(sequence);
  request.add_layers(0);
  request.add_layers(0);
  EXPECT_GRPC_ERROR(Export(request, &header, &payload), INVALID_ARGUMENT,
                    "layers[1] repeats layer 0");
  request.clear_layers();
  request.add_layers(-1);
  EXPECT_GRPC_ERROR(Export(request, &header, &payload), INVALID_ARGUMENT, "layers[0] = -1");
  request.clear_layers();
  request.set_session_id("");
  EXPECT_GRPC_ERROR(Export(request, &header, &payload), INVALID_ARGUMENT, "session_id");
  // An empty sequence exports a header and no data.
  request.set_session_id(session);
  int data_messages = -1;
  ASSERT_GRPC_OK(Export(request, &header, &payload, &data_messages));
  EXPECT_EQ(header.payload_bytes(), 0u);
  EXPECT_EQ(data_messages, 0);
}

TEST_F(SidecarServiceTest, ExportOfASequenceChangedMidStreamIsAborted) {
  v1::ModelLayout layout = SmallLayout();
  layout.set_head_dim(64);
  layout.set_block_tokens(16);
  const uint64_t token_bytes = 2ull * kHeads * 64 * 4;
  const v1::AttachResponse attached = AttachOk(layout, 1100);
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session);
  constexpr int kTokens = 4096;  // 8 MiB: far more than the transport buffers unread
  v1::AppendHeader header;
  header.set_session_id(session);
  header.set_sequence_id(sequence);
  header.set_num_tokens(kTokens);
  header.set_payload_bytes(kLayers * kTokens * token_bytes);
  std::vector<v1::AppendChunk> messages;
  AddSegment(&messages, header, Pattern(header.payload_bytes(), 7), {1 << 20});
  v1::AppendResponse appended;
  ASSERT_GRPC_OK(Append(messages, &appended));

  v1::ExportRequest request;
  request.set_session_id(session);
  request.set_sequence_id(sequence);
  request.set_chunk_bytes(64 << 10);
  // A channel whose receive window stays small, so the server cannot run ahead of the reader.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto slow_stub = v1::Sidecar::NewStub(
      grpc::CreateCustomChannel(server_->data_address(), grpc::InsecureChannelCredentials(), args));
  auto context = Context();
  auto reader = slow_stub->Export(context.get(), request);
  v1::ExportChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_TRUE(chunk.has_header());
  ASSERT_TRUE(reader->Read(&chunk));  // the first data chunk
  // Change the sequence while the export is in flight.
  v1::AppendHeader more = header;
  more.set_num_tokens(1);
  more.set_payload_bytes(kLayers * token_bytes);
  messages.clear();
  AddSegment(&messages, more, Pattern(more.payload_bytes(), 8), {1 << 20});
  ASSERT_GRPC_OK(Append(messages, &appended));
  while (reader->Read(&chunk)) {
  }
  EXPECT_GRPC_ERROR(reader->Finish(), ABORTED, "");
}

// ---- Compress -----------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, CompressStreamingLlmKeepsSinksAndRecent) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "s", &policy));
  ASSERT_GRPC_OK(AppendOk(session, "s", Pattern(40 * kLayers * kTokenBytes, 9), 40));

  v1::CompressRequest request;
  request.set_session_id(session);
  request.set_sequence_id("s");
  request.set_budget_tokens(16);
  request.set_return_positions(true);
  v1::CompressResponse response;
  ASSERT_GRPC_OK(stub_->Compress(Context().get(), request, &response));
  ASSERT_EQ(response.layers_size(), kLayers);
  std::set<int> expected = {0, 1, 2, 3};
  for (int p = 28; p < 40; ++p) expected.insert(p);
  for (const auto& layer : response.layers()) {
    EXPECT_EQ(layer.kept(), 16);
    EXPECT_EQ(layer.evicted(), 24);
    ASSERT_EQ(layer.positions_size(), kHeads * 16);
    for (int h = 0; h < kHeads; ++h) {
      std::set<int> kept(layer.positions().begin() + h * 16,
                         layer.positions().begin() + (h + 1) * 16);
      EXPECT_EQ(kept, expected);
    }
  }
  EXPECT_EQ(response.blocks_freed(), kLayers * (10 - 4));
  EXPECT_EQ(LayoutOf(session, "s").layers(0).count(), 16);

  request.mutable_attention()->set_num_queries(1);
  request.mutable_attention()->set_staging_offset(64);  // the session has no staging area
  EXPECT_GRPC_ERROR(stub_->Compress(Context().get(), request, &response), INVALID_ARGUMENT,
                    "attention.staging_offset: the session has no query staging area");
  request.mutable_attention()->clear_staging_offset();
  request.mutable_attention()->set_attention_scores("abc");
  EXPECT_GRPC_ERROR(stub_->Compress(Context().get(), request, &response), INVALID_ARGUMENT,
                    "attention.attention_scores has 3 bytes");
  request.clear_attention();
  request.set_budget_tokens(-1);
  EXPECT_GRPC_ERROR(stub_->Compress(Context().get(), request, &response), INVALID_ARGUMENT,
                    "budget_tokens");
  request.set_budget_tokens(8);
  request.mutable_policy()->set_name("omnikv");
  EXPECT_GRPC_ERROR(stub_->Compress(Context().get(), request, &response), INVALID_ARGUMENT,
                    "omnikv is chosen when a sequence is created");
  request.clear_policy();
  request.set_sequence_id("ghost");
  EXPECT_GRPC_ERROR(stub_->Compress(Context().get(), request, &response), NOT_FOUND, "ghost");
}

TEST_F(SidecarServiceTest, BatchCompress) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::CreateSequenceResponse created;
  for (const char* id : {"x", "y"}) {
    ASSERT_GRPC_OK(Create(session, &created, id, &policy));
    ASSERT_GRPC_OK(AppendOk(session, id, Pattern(20 * kLayers * kTokenBytes, 12), 20));
  }
  v1::BatchCompressRequest batch;
  for (const char* id : {"x", "y"}) {
    v1::CompressRequest* item = batch.add_requests();
    item->set_session_id(session);
    item->set_sequence_id(id);
    item->set_budget_tokens(8);
  }
  v1::BatchCompressResponse response;
  ASSERT_GRPC_OK(stub_->BatchCompress(Context().get(), batch, &response));
  ASSERT_EQ(response.responses_size(), 2);
  EXPECT_EQ(response.responses(1).layers(0).kept(), 8);
  EXPECT_EQ(LayoutOf(session, "y").layers(1).count(), 8);

  batch.mutable_requests(1)->mutable_policy()->set_name("keydiff");
  batch.mutable_requests(1)->mutable_policy()->mutable_keydiff()->set_recent_fraction(2.0f);
  EXPECT_GRPC_ERROR(stub_->BatchCompress(Context().get(), batch, &response), INVALID_ARGUMENT,
                    "requests[1]: policy.keydiff.recent_fraction");
  batch.mutable_requests(1)->clear_policy();
  batch.mutable_requests(1)->set_sequence_id("x");
  EXPECT_GRPC_ERROR(stub_->BatchCompress(Context().get(), batch, &response), INVALID_ARGUMENT,
                    "requests[1].sequence_id 'x' repeats requests[0]");
}

// ---- Response size limits ----------------------------------------------------------------------

// The number N in "... would be about N bytes ...", or -1.
int64_t AboutBytes(const std::string& message) {
  const size_t at = message.find("would be about ");
  if (at == std::string::npos) return -1;
  return std::stoll(message.substr(at + 15));
}

// A sequence whose positions alone exceed the 64 MiB message limit: 16 kv heads of head_dim 1
// (64 bytes of K/V per token and layer) and positions from 2^28 (5-byte varints), so 430000 tokens
// carry 2 layers * 16 heads * 430000 * 5 = 68.8 MB of positions in 55 MB of arena. Filled through
// the pool directly: the K/V bytes do not matter here.
TEST_F(SidecarServiceTest, OversizedResponsesAreRefusedBeforeTheyAreBuilt) {
  v1::ModelLayout layout = SmallLayout();
  layout.set_num_kv_heads(16);
  layout.set_num_q_heads(16);
  layout.set_head_dim(1);
  layout.set_dtype(v1::DTYPE_FLOAT16);
  layout.set_block_tokens(16);
  constexpr int kHeads16 = 16;
  constexpr int kTokens = 430000;
  constexpr int64_t kPositionBytes = int64_t{kLayers} * kHeads16 * kTokens * 5;
  const v1::AttachResponse attached = AttachOk(layout, kLayers * (kTokens / 16 + 1) + 16);
  const std::string session = attached.session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "big", &policy));
  std::vector<int32_t> positions(kTokens);
  for (int i = 0; i < kTokens; ++i) positions[i] = (1 << 28) + i;
  auto reservation = pool_->Reserve(session, "big", kTokens, positions, {});
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  ASSERT_TRUE(pool_->Commit(session, "big", reservation->reservation_id, false).ok());
  positions = {};
  auto count_of_layer0 = [&]() -> int {
    v1::GetLayoutRequest request;
    request.set_session_id(session);
    request.set_sequence_id("big");
    request.set_omit_positions(true);
    v1::GetLayoutResponse response;
    const grpc::Status status = stub_->GetLayout(Context().get(), request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() ? response.layers(0).count() : -1;
  };

  // GetLayout of every layer with positions: refused, with the estimate and what to do.
  v1::GetLayoutRequest get;
  get.set_session_id(session);
  get.set_sequence_id("big");
  v1::GetLayoutResponse got;
  grpc::Status status = stub_->GetLayout(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("bytes, above the 64 MiB message limit; ask for fewer layers or set "
                        "omit_positions"));
  EXPECT_GE(AboutBytes(status.error_message()), kPositionBytes);
  EXPECT_LE(AboutBytes(status.error_message()), kPositionBytes + 300000);
  // One layer (34 MB) is served: the estimate is not so loose that it refuses what fits.
  get.add_layers(1);
  ASSERT_GRPC_OK(stub_->GetLayout(Context().get(), get, &got));
  ASSERT_EQ(got.layers_size(), 1);
  EXPECT_EQ(got.layers(0).count(), kTokens);
  ASSERT_EQ(got.layers(0).positions_size(), kHeads16 * kTokens);
  EXPECT_EQ(got.layers(0).positions(kHeads16 * kTokens - 1), (1 << 28) + kTokens - 1);
  got.Clear();
  // Every layer without positions is served too.
  EXPECT_EQ(count_of_layer0(), kTokens);

  // The export header carries every position: refused up front, naming what to do.
  v1::ExportRequest export_request;
  export_request.set_session_id(session);
  export_request.set_sequence_id("big");
  v1::ExportHeader header;
  std::string payload;
  status = Export(export_request, &header, &payload);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("the export header (layout and positions) would be "
                                                "about "));
  EXPECT_THAT(status.error_message(), HasSubstr("export fewer layers per call (layers)"));
  EXPECT_TRUE(payload.empty());

  // Compress asking for every kept position: refused before anything is evicted.
  v1::CompressRequest compress;
  compress.set_session_id(session);
  compress.set_sequence_id("big");
  compress.set_budget_tokens(kTokens - 100);
  compress.set_return_positions(true);
  v1::CompressResponse compressed;
  status = stub_->Compress(Context().get(), compress, &compressed);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("above the 64 MiB message limit; set return_positions=false"));
  EXPECT_EQ(count_of_layer0(), kTokens);
  // The same item in a batch: refused, naming it, nothing compressed.
  v1::BatchCompressRequest batch;
  *batch.add_requests() = compress;
  v1::BatchCompressResponse batch_compressed;
  status = stub_->BatchCompress(Context().get(), batch, &batch_compressed);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("the response (through requests[0]) would be"));
  EXPECT_THAT(status.error_message(), HasSubstr("return_positions=false"));
  EXPECT_EQ(count_of_layer0(), kTokens);
  // A budget whose kept positions fit is served, positions included.
  compress.set_budget_tokens(1000);
  ASSERT_GRPC_OK(stub_->Compress(Context().get(), compress, &compressed));
  ASSERT_EQ(compressed.layers_size(), kLayers);
  EXPECT_EQ(compressed.layers(0).kept(), 1000);
  EXPECT_EQ(compressed.layers(0).positions_size(), kHeads16 * 1000);
  EXPECT_EQ(count_of_layer0(), 1000);
}

// ---- Not in this build --------------------------------------------------------------------------

TEST_F(SidecarServiceTest, LaterCallsAreUnimplemented) {
  // Select is served (tests/e2e/omnikv_test.cc); here only its request checks.
  v1::SelectResponse select;
  v1::SelectRequest select_request;
  select_request.add_items()->set_sequence_id("s");
  EXPECT_GRPC_ERROR(stub_->Select(Context().get(), select_request, &select), INVALID_ARGUMENT,
                    "items[0].session_id");
  // This pool has no storage tiers (PoolOptions::tiers); the binary has them (e2e spill_test).
  v1::SpillRequest spill_request;
  spill_request.set_session_id("s");
  spill_request.set_sequence_id("q");
  spill_request.set_target(v1::TIER_HOST);
  v1::SpillResponse spill;
  EXPECT_GRPC_ERROR(stub_->Spill(Context().get(), spill_request, &spill), UNIMPLEMENTED, "tiers");
  v1::RestoreRequest restore_request;
  restore_request.set_session_id("s");
  restore_request.set_sequence_id("q");
  v1::RestoreResponse restore;
  EXPECT_GRPC_ERROR(stub_->Restore(Context().get(), restore_request, &restore), UNIMPLEMENTED,
                    "tiers");
  EXPECT_GRPC_ERROR(stub_->Spill(Context().get(), {}, &spill), INVALID_ARGUMENT, "session_id");
}

// Admin's live changes are covered end to end in tests/e2e/admin_test.cc; here: an empty change
// is refused, naming what is missing.
TEST_F(SidecarServiceTest, AdminRefusesEmptyChanges) {
  v1::SetDefaultsResponse defaults;
  EXPECT_GRPC_ERROR(admin_->SetDefaults(Context().get(), {}, &defaults), INVALID_ARGUMENT,
                    "default_policy, default_budget, unbounded_budget or rebudget_tenant");
  v1::SetQuotaResponse quota;
  EXPECT_GRPC_ERROR(admin_->SetQuota(Context().get(), {}, &quota), INVALID_ARGUMENT, "tenant");
}

// ---- Attention inputs, DecodeStep, Score
// ---------------------------------------------------------

// One decode token's inline K/V for every layer: [L][2][H][1][D] fp32.
std::string DecodeKv(uint32_t seed) { return Pattern(kLayers * kTokenBytes, seed); }

v1::DecodeStepRequest::Item DecodeItem(const std::string& session, const std::string& sequence,
                                       uint32_t seed) {
  v1::DecodeStepRequest::Item item;
  item.set_session_id(session);
  item.set_sequence_id(sequence);
  item.set_inline_kv(DecodeKv(seed));
  return item;
}

TEST_F(SidecarServiceTest, CommitConvertsAttentionBeforeCommitting) {
  const std::string session = AttachOk().session_id();
  const std::string sequence = CreateOk(session, "a");
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, sequence, 3, &reserved));
  v1::CommitRequest commit;
  commit.set_session_id(session);
  commit.set_sequence_id(sequence);
  commit.set_reservation_id(reserved.reservation_id());
  v1::CommitResponse response;
  // Refused before the pool sees them: the reservation stays pending.
  commit.mutable_attention()->set_num_queries(3);
  commit.mutable_attention()->set_staging_offset(0);
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &response), INVALID_ARGUMENT,
                    "attention.staging_offset: the session has no query staging area");
  // SmallLayout: 2 layers, 4 q heads, head_dim 8, fp32 -> 2 * 4 * 3 * 8 * 4 = 768 bytes.
  commit.mutable_attention()->set_inline_queries(std::string(767, '\0'));
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &response), INVALID_ARGUMENT,
                    "attention.inline_queries has 767 bytes, expected 768");
  commit.mutable_attention()->add_layers(2);
  EXPECT_GRPC_ERROR(stub_->Commit(Context().get(), commit, &response), INVALID_ARGUMENT,
                    "attention.layers[0] = 2 is out of range");
  EXPECT_EQ(LayoutOf(session, sequence).layers(0).count(), 0);
  EXPECT_TRUE(pool_->CheckReservation(session, sequence, reserved.reservation_id()).ok());

  // A well-formed attention input reaches the pool (keydiff ignores it).
  commit.mutable_attention()->clear_layers();
  commit.mutable_attention()->set_inline_queries(std::string(768, '\0'));
  commit.mutable_attention()->set_softmax_scale(0.35f);
  ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &response));
  EXPECT_THAT(response.counts(), ElementsAre(3, 3));
}

TEST_F(SidecarServiceTest, BatchCommitChecksEveryItemsAttentionFirst) {
  const std::string session = AttachOk().session_id();
  v1::BatchCommitRequest batch;
  for (const char* id : {"a", "b"}) {
    const std::string sequence = CreateOk(session, id);
    v1::ReserveResponse reserved;
    ASSERT_GRPC_OK(Reserve(session, sequence, 2, &reserved));
    v1::CommitRequest* item = batch.add_requests();
    item->set_session_id(session);
    item->set_sequence_id(sequence);
    item->set_reservation_id(reserved.reservation_id());
  }
  batch.mutable_requests(1)->mutable_attention()->set_num_queries(2);
  batch.mutable_requests(1)->mutable_attention()->set_attention_scores(std::string(5, '\0'));
  v1::BatchCommitResponse response;
  EXPECT_GRPC_ERROR(stub_->BatchCommit(Context().get(), batch, &response), INVALID_ARGUMENT,
                    "requests[1].attention.attention_scores has 5 bytes");
  EXPECT_EQ(LayoutOf(session, "a").layers(0).count(), 0);  // nothing committed

  // Without the attention the commit goes through (the sequence has no budget to evict to).
  batch.mutable_requests(1)->clear_attention();
  ASSERT_GRPC_OK(stub_->BatchCommit(Context().get(), batch, &response));
  ASSERT_EQ(response.responses_size(), 2);
  EXPECT_THAT(response.responses(1).counts(), ElementsAre(2, 2));
}

TEST_F(SidecarServiceTest, CreateSequenceWithPerLayerBudgets) {
  const std::string session = AttachOk().session_id();
  v1::Budget budget;
  budget.set_tokens_per_layer(8);
  budget.add_per_layer_tokens(6);
  budget.add_per_layer_tokens(10);
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "p", nullptr, &budget));
  EXPECT_THAT(created.budget().per_layer_tokens(), ElementsAre(6, 10));
}

// Keydiff keeps every layer at its budget through a decode loop of inline tokens.
TEST_F(SidecarServiceTest, DecodeStepInlineKeepsEveryLayerAtBudget) {
  const std::string session = AttachOk().session_id();
  v1::PolicySpec policy;
  policy.set_name("keydiff");
  v1::Budget budget;
  budget.set_tokens_per_layer(8);
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "d", &policy, &budget));
  ASSERT_GRPC_OK(AppendOk(session, "d", Pattern(8 * kLayers * kTokenBytes, 1), 8));
  for (int step = 0; step < 6; ++step) {
    v1::DecodeStepRequest request;
    *request.add_items() = DecodeItem(session, "d", 100 + step);
    v1::DecodeStepResponse response;
    ASSERT_GRPC_OK(stub_->DecodeStep(Context().get(), request, &response));
    ASSERT_EQ(response.items_size(), 1);
    const v1::DecodeStepResponse::Item& item = response.items(0);
    EXPECT_THAT(item.counts(), ElementsAre(8, 8)) << "step " << step;
    EXPECT_EQ(item.position(), 8 + step);
    ASSERT_EQ(item.evicted_positions_size(), kLayers * kHeads);
    for (int32_t evicted : item.evicted_positions()) {
      EXPECT_GE(evicted, 0);  // over budget by one: every (layer, head) evicted one token
      EXPECT_LE(evicted, 8 + step);
    }
  }
  const v1::GetLayoutResponse layout = LayoutOf(session, "d");
  EXPECT_EQ(layout.next_position(), 14);
  for (const v1::LayerLayout& layer : layout.layers()) EXPECT_EQ(layer.count(), 8);
}

TEST_F(SidecarServiceTest, DecodeStepWithAReservationOrNeither) {
  const std::string session = AttachOk().session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  policy.mutable_streaming_llm()->set_n_sink(2);
  v1::Budget budget;
  budget.set_tokens_per_layer(6);
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "r", &policy, &budget));
  ASSERT_GRPC_OK(AppendOk(session, "r", Pattern(6 * kLayers * kTokenBytes, 2), 6));
  v1::ReserveResponse reserved;
  ASSERT_GRPC_OK(Reserve(session, "r", 1, &reserved));
  v1::DecodeStepRequest request;
  v1::DecodeStepRequest::Item* item = request.add_items();
  item->set_session_id(session);
  item->set_sequence_id("r");
  item->set_reservation_id(reserved.reservation_id());
  v1::DecodeStepResponse response;
  ASSERT_GRPC_OK(stub_->DecodeStep(Context().get(), request, &response));
  ASSERT_EQ(response.items_size(), 1);
  EXPECT_THAT(response.items(0).counts(), ElementsAre(6, 6));
  EXPECT_EQ(response.items(0).position(), -1);  // not an inline token
  // StreamingLLM evicts the oldest position after the sinks: position 2 in every (layer, head).
  EXPECT_THAT(response.items(0).evicted_positions(), ElementsAre(2, 2, 2, 2));
  // Neither: the token was committed already; nothing over budget, nothing evicted.
  item->set_reservation_id(0);
  ASSERT_GRPC_OK(stub_->DecodeStep(Context().get(), request, &response));
  EXPECT_THAT(response.items(0).counts(), ElementsAre(6, 6));
  EXPECT_THAT(response.items(0).evicted_positions(), ElementsAre(-1, -1, -1, -1));
}

TEST_F(SidecarServiceTest, DecodeStepBadItemChangesNothing) {
  const std::string session = AttachOk().session_id();
  for (const char* id : {"a", "b"}) {
    v1::CreateSequenceResponse created;
    v1::Budget budget;
    budget.set_tokens_per_layer(4);
    ASSERT_GRPC_OK(Create(session, &created, id, nullptr, &budget));
    ASSERT_GRPC_OK(AppendOk(session, id, Pattern(4 * kLayers * kTokenBytes, 3), 4));
  }
  const v1::GetLayoutResponse before_a = LayoutOf(session, "a");
  const v1::GetLayoutResponse before_b = LayoutOf(session, "b");
  auto expect_unchanged = [&] {
    EXPECT_EQ(LayoutOf(session, "a").SerializeAsString(), before_a.SerializeAsString());
    EXPECT_EQ(LayoutOf(session, "b").SerializeAsString(), before_b.SerializeAsString());
  };
  v1::DecodeStepResponse response;
  {
    v1::DecodeStepRequest request;
    *request.add_items() = DecodeItem(session, "a", 1);
    *request.add_items() = DecodeItem(session, "b", 2);
    request.mutable_items(1)->mutable_inline_kv()->pop_back();
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), INVALID_ARGUMENT,
                      "items[1].inline_kv has " + std::to_string(kLayers * kTokenBytes - 1) +
                          " bytes, expected " + std::to_string(kLayers * kTokenBytes));
  }
  {
    v1::DecodeStepRequest request;
    *request.add_items() = DecodeItem(session, "a", 1);
    *request.add_items() = DecodeItem(session, "a", 2);
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), INVALID_ARGUMENT,
                      "items[1].sequence_id 'a' repeats items[0]");
  }
  {
    v1::DecodeStepRequest request;
    *request.add_items() = DecodeItem(session, "a", 1);
    *request.add_items() = DecodeItem("no-such-session", "b", 2);
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), NOT_FOUND,
                      "items[1]: ");
  }
  {
    v1::DecodeStepRequest request;
    *request.add_items() = DecodeItem(session, "a", 1);
    *request.add_items() = DecodeItem(session, "b", 2);
    request.mutable_items(0)->mutable_attention()->set_num_queries(2);
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), INVALID_ARGUMENT,
                      "items[0].attention.num_queries must be 1");
    request.mutable_items(0)->clear_attention();
    request.mutable_items(1)->set_reservation_id(5);
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), INVALID_ARGUMENT,
                      "items[1].inline_kv is set together with items[1].reservation_id");
    request.mutable_items(1)->clear_inline_kv();  // a reservation that does not exist
    EXPECT_GRPC_ERROR(stub_->DecodeStep(Context().get(), request, &response), NOT_FOUND,
                      "items[1]");
  }
  expect_unchanged();
}

TEST_F(SidecarServiceTest, ScoreIsADryRunOfCompress) {
  const std::string session = AttachOk().session_id();
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  v1::Budget budget;
  budget.set_tokens_per_layer(16);
  v1::CreateSequenceResponse created;
  ASSERT_GRPC_OK(Create(session, &created, "s", &policy, &budget));
  ASSERT_GRPC_OK(AppendOk(session, "s", Pattern(40 * kLayers * kTokenBytes, 4), 40));
  const v1::GetLayoutResponse before = LayoutOf(session, "s");

  v1::ScoreRequest request;
  request.set_session_id(session);
  request.set_sequence_id("s");
  v1::ScoreResponse scored;
  ASSERT_GRPC_OK(stub_->Score(Context().get(), request, &scored));
  EXPECT_EQ(LayoutOf(session, "s").SerializeAsString(), before.SerializeAsString());
  ASSERT_EQ(scored.layers_size(), kLayers);
  std::vector<std::set<int>> would_keep;  // [layer * kHeads + head]
  for (const auto& layer : scored.layers()) {
    EXPECT_EQ(layer.kept(), 16);
    ASSERT_EQ(layer.scores_size(), kHeads * 40);
    ASSERT_EQ(layer.positions_size(), kHeads * 40);
    ASSERT_EQ(layer.kept_slots_size(), kHeads * 16);
    for (int h = 0; h < kHeads; ++h) {
      std::set<int> kept;
      for (int i = 0; i < 16; ++i) {
        const int slot = layer.kept_slots(h * 16 + i);
        if (i > 0) {
          EXPECT_LT(layer.kept_slots(h * 16 + i - 1), slot);  // ascending
        }
        kept.insert(layer.positions(h * 40 + slot));
      }
      would_keep.push_back(kept);
    }
  }
  std::set<int> expected = {0, 1, 2, 3};  // sinks (default 4) and the 12 newest
  for (int p = 28; p < 40; ++p) expected.insert(p);
  EXPECT_EQ(would_keep.front(), expected);

  v1::CompressRequest compress;
  compress.set_session_id(session);
  compress.set_sequence_id("s");
  compress.set_return_positions(true);
  v1::CompressResponse compressed;
  ASSERT_GRPC_OK(stub_->Compress(Context().get(), compress, &compressed));
  ASSERT_EQ(compressed.layers_size(), kLayers);
  for (int l = 0; l < kLayers; ++l) {
    const auto& layer = compressed.layers(l);
    ASSERT_EQ(layer.positions_size(), kHeads * 16);
    for (int h = 0; h < kHeads; ++h) {
      std::set<int> kept(layer.positions().begin() + h * 16,
                         layer.positions().begin() + (h + 1) * 16);
      EXPECT_EQ(kept, would_keep[l * kHeads + h]) << "layer " << l << " head " << h;
    }
  }
}

TEST_F(SidecarServiceTest, ScoreRefusesBadInput) {
  const std::string session = AttachOk().session_id();
  CreateOk(session, "s");
  v1::ScoreRequest request;
  request.set_session_id(session);
  request.set_sequence_id("s");
  v1::ScoreResponse response;
  request.add_layers(kLayers);
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), INVALID_ARGUMENT,
                    "layers[0] = 2 is out of range");
  request.clear_layers();
  request.set_budget_tokens(-2);
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), INVALID_ARGUMENT,
                    "budget_tokens");
  request.set_budget_tokens(4);
  request.mutable_policy()->set_name("omnikv");
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), INVALID_ARGUMENT,
                    "omnikv is chosen when a sequence is created");
  request.clear_policy();
  request.mutable_attention()->set_num_queries(1);
  request.mutable_attention()->set_queries_dtype(static_cast<v1::DType>(6));
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), INVALID_ARGUMENT,
                    "attention.queries_dtype has unknown value 6");
  request.clear_attention();
  request.set_sequence_id("ghost");
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), NOT_FOUND, "ghost");
  request.set_sequence_id("");
  EXPECT_GRPC_ERROR(stub_->Score(Context().get(), request, &response), INVALID_ARGUMENT,
                    "sequence_id must not be empty");
}

// ---- Admin --------------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, AdminIntrospection) {
  const v1::AttachResponse a = AttachOk(SmallLayout(), 64, "team-a");
  const v1::AttachResponse b = AttachOk(SmallLayout(), 64, "team-b");
  CreateOk(a.session_id(), "a1");
  CreateOk(a.session_id(), "a2");
  CreateOk(b.session_id(), "b1");
  ASSERT_GRPC_OK(AppendOk(a.session_id(), "a1", Pattern(5 * kLayers * kTokenBytes, 13), 5));

  v1::GetConfigResponse config;
  ASSERT_GRPC_OK(admin_->GetConfig(Context().get(), {}, &config));
  EXPECT_THAT(config.effective_config_yaml(), HasSubstr("listen:"));
  EXPECT_EQ(config.backend(), "cpu");
  EXPECT_EQ(config.backend_reason(), "test backend");
  EXPECT_EQ(config.default_policy().name(), "keydiff");

  v1::ListSessionsRequest sessions_request;
  v1::ListSessionsResponse sessions;
  ASSERT_GRPC_OK(admin_->ListSessions(Context().get(), sessions_request, &sessions));
  EXPECT_EQ(sessions.sessions_size(), 2);
  sessions_request.set_tenant("team-b");
  ASSERT_GRPC_OK(admin_->ListSessions(Context().get(), sessions_request, &sessions));
  ASSERT_EQ(sessions.sessions_size(), 1);
  EXPECT_EQ(sessions.sessions(0).session_id(), b.session_id());
  EXPECT_EQ(sessions.sessions(0).worker_name(), "test-worker");
  EXPECT_EQ(sessions.sessions(0).sequences(), 1);
  EXPECT_EQ(sessions.sessions(0).num_blocks(), 64);

  v1::ListSequencesRequest sequences_request;
  v1::ListSequencesResponse sequences;
  ASSERT_GRPC_OK(admin_->ListSequences(Context().get(), sequences_request, &sequences));
  EXPECT_EQ(sequences.sequences_size(), 3);
  sequences_request.set_session_id(a.session_id());
  ASSERT_GRPC_OK(admin_->ListSequences(Context().get(), sequences_request, &sequences));
  ASSERT_EQ(sequences.sequences_size(), 2);
  EXPECT_EQ(sequences.sequences(0).sequence_id(), "a1");
  EXPECT_THAT(sequences.sequences(0).tokens_per_layer(), ElementsAre(5, 5));
  EXPECT_EQ(sequences.sequences(0).tenant(), "team-a");
  sequences_request.clear_session_id();
  sequences_request.set_tenant("team-b");
  ASSERT_GRPC_OK(admin_->ListSequences(Context().get(), sequences_request, &sequences));
  ASSERT_EQ(sequences.sequences_size(), 1);
  EXPECT_EQ(sequences.sequences(0).sequence_id(), "b1");

  v1::GetStatsResponse stats;
  ASSERT_GRPC_OK(admin_->GetStats(Context().get(), {}, &stats));
  EXPECT_EQ(stats.sessions(), 2);
  EXPECT_EQ(stats.sequences(), 3);
  EXPECT_EQ(stats.tokens_appended(), 5 * kLayers);  // counted per layer
  EXPECT_EQ(stats.arena_bytes_used(), 2u * kLayers * a.arena().block_bytes());
  EXPECT_FALSE(stats.draining());
  EXPECT_EQ(stats.backend(), "cpu");
}

TEST_F(SidecarServiceTest, AdminForceRelease) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  CreateOk(session, "s1");
  CreateOk(session, "s2");
  ASSERT_GRPC_OK(AppendOk(session, "s1", Pattern(5 * kLayers * kTokenBytes, 14), 5));
  v1::ForceReleaseRequest request;
  request.set_session_id(session);
  request.set_sequence_id("s1");
  v1::ForceReleaseResponse response;
  ASSERT_GRPC_OK(admin_->ForceRelease(Context().get(), request, &response));
  EXPECT_EQ(response.sequences_released(), 1);
  EXPECT_EQ(response.blocks_released(), 2 * kLayers);
  EXPECT_GRPC_ERROR(admin_->ForceRelease(Context().get(), request, &response), NOT_FOUND, "s1");

  auto [context, reader] = WatchOk(session);
  v1::SessionEvent event;
  request.clear_sequence_id();
  ASSERT_GRPC_OK(admin_->ForceRelease(Context().get(), request, &response));
  EXPECT_EQ(response.sequences_released(), 1);
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_GRPC_ERROR(reader->Finish(), ABORTED, "force-released");
  EXPECT_EQ(pool_->GetStats().sessions, 0);
  request.clear_session_id();
  EXPECT_GRPC_ERROR(admin_->ForceRelease(Context().get(), request, &response), INVALID_ARGUMENT,
                    "session_id");
}

TEST_F(SidecarServiceTest, DrainStopsAttachesAndTellsWatchers) {
  const v1::AttachResponse attached = AttachOk();
  auto [context, reader] = WatchOk(attached.session_id());
  v1::SessionEvent event;

  v1::DrainResponse drained;
  ASSERT_GRPC_OK(admin_->Drain(Context().get(), {}, &drained));
  EXPECT_EQ(drained.sessions_remaining(), 1);
  EXPECT_FALSE(drained.empty());
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::SessionEvent::KIND_DRAINING);
  EXPECT_EQ(HealthStatus(channel_, "kvsidecar.v1.Sidecar"), 2);

  v1::AttachRequest request;
  *request.mutable_layout() = SmallLayout();
  v1::AttachResponse refused;
  EXPECT_GRPC_ERROR(stub_->Attach(Context().get(), request, &refused), UNAVAILABLE, "draining");
  v1::GetStatsResponse stats;
  ASSERT_GRPC_OK(admin_->GetStats(Context().get(), {}, &stats));
  EXPECT_TRUE(stats.draining());

  // Existing sessions keep working; once they detach the drain reports empty.
  const std::string sequence = CreateOk(attached.session_id());
  EXPECT_FALSE(sequence.empty());
  v1::DetachRequest detach;
  detach.set_session_id(attached.session_id());
  v1::DetachResponse detached;
  ASSERT_GRPC_OK(stub_->Detach(Context().get(), detach, &detached));
  ASSERT_GRPC_OK(admin_->Drain(Context().get(), {}, &drained));
  EXPECT_EQ(drained.sessions_remaining(), 0);
  EXPECT_TRUE(drained.empty());
  EXPECT_FALSE(reader->Read(&event));
  ASSERT_GRPC_OK(reader->Finish());
}

// ---- Robustness ---------------------------------------------------------------------------------

TEST_F(SidecarServiceTest, RandomBadInputNeverBreaksTheServer) {
  const v1::AttachResponse attached = AttachOk();
  const std::string session = attached.session_id();
  const std::string sequence = CreateOk(session, "r");
  std::mt19937 rng(1234);
  auto pick = [&](std::initializer_list<int64_t> values) {
    std::vector<int64_t> v(values);
    return v[rng() % v.size()];
  };
  for (int round = 0; round < 60; ++round) {
    v1::ReserveRequest reserve;
    reserve.set_session_id(rng() % 4 == 0 ? "ghost" : session);
    reserve.set_sequence_id(rng() % 4 == 0 ? "" : sequence);
    reserve.set_num_tokens(static_cast<int32_t>(pick({-1, 0, 1, 3, INT32_MAX, INT32_MIN})));
    for (int i = 0; i < static_cast<int>(rng() % 4); ++i) {
      reserve.add_positions(static_cast<int32_t>(pick({-5, 0, 7, INT32_MAX})));
    }
    v1::ReserveResponse reserved;
    const grpc::Status status = stub_->Reserve(Context().get(), reserve, &reserved);
    if (status.ok()) {  // commit it, so that the next round can reserve
      v1::CommitRequest commit;
      commit.set_session_id(session);
      commit.set_sequence_id(sequence);
      commit.set_reservation_id(reserved.reservation_id());
      v1::CommitResponse committed;
      ASSERT_GRPC_OK(stub_->Commit(Context().get(), commit, &committed));
    }

    std::vector<v1::AppendChunk> messages;
    v1::AppendHeader header = Header(session, sequence, static_cast<int>(pick({1, 2, 0, -3})));
    header.set_payload_bytes(static_cast<uint64_t>(pick({0, 1, 256, 512, 1024, INT64_MAX, -1})));
    if (rng() % 3 == 0) header.add_layers(static_cast<int32_t>(pick({0, 1, 2, -1})));
    const int chunks = static_cast<int>(rng() % 4);
    if (rng() % 2 == 0) {
      v1::AppendChunk h;
      *h.mutable_header() = header;
      messages.push_back(h);
    }
    for (int i = 0; i < chunks; ++i) {
      v1::AppendChunk chunk;
      chunk.set_data(std::string(static_cast<size_t>(pick({0, 1, 100, 256, 600})), 'z'));
      messages.push_back(chunk);
    }
    v1::AppendResponse response;
    Append(messages, &response);  // any status; the server must keep serving
  }
  v1::GetStatsResponse stats;
  ASSERT_GRPC_OK(admin_->GetStats(Context().get(), {}, &stats));
  EXPECT_EQ(LayoutOf(session, sequence).layers_size(), kLayers);
  // The server still serves normal work.
  const std::string fresh = CreateOk(session, "fresh");
  ASSERT_GRPC_OK(AppendOk(session, fresh, Pattern(3 * kLayers * kTokenBytes, 15), 3));
  EXPECT_EQ(LayoutOf(session, fresh).layers(1).count(), 3);
}

}  // namespace
}  // namespace kvs
