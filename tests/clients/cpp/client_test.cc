// Unit tests of the C++ client library (clients/cpp/client.cc): status conversion, the row
// arithmetic of arenas, reservations and exports, and the client's side of Attach (mapping,
// refusing handles it cannot map, Watch, heartbeats, Detach), Append chunking and Export stream
// checks against an in-process fake server. The real server is exercised in tests/e2e.
#include "kvsidecar/client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "clients/cpp/cuda_ipc.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/clients/cpp/fake_cuda_ipc_driver.h"

namespace kvsidecar {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

bool PollUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST(ToStatusTest, KeepsCodeAndMessage) {
  EXPECT_TRUE(ToStatus(grpc::Status::OK).ok());
  for (int code = 1; code <= 16; ++code) {
    const absl::Status status =
        ToStatus(grpc::Status(static_cast<grpc::StatusCode>(code), "field x is bad"));
    EXPECT_EQ(static_cast<int>(status.code()), code);
    EXPECT_EQ(status.message(), "field x is bad");
  }
}

TEST(DTypeBytesTest, KnownAndUnknown) {
  EXPECT_EQ(DTypeBytes(v1::DTYPE_FLOAT16), 2);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_BFLOAT16), 2);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_FLOAT32), 4);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_UNSPECIFIED), 0);
}

// H=2, B=4, D=3, fp16: rows of 6 bytes, blocks of 2*2*4*6 = 96 bytes.
ArenaGeometry SmallGeometry(std::vector<uint8_t>& memory, int blocks) {
  ArenaGeometry geometry;
  geometry.num_kv_heads = 2;
  geometry.block_tokens = 4;
  geometry.head_dim = 3;
  geometry.dtype_bytes = 2;
  geometry.block_bytes = 96;
  geometry.num_blocks = blocks;
  memory.assign(96 * blocks, 0);
  geometry.base = memory.data();
  geometry.size_bytes = memory.size();
  return geometry;
}

TEST(ArenaGeometryTest, RowOffsetFollowsTheBlockLayout) {
  std::vector<uint8_t> memory;
  const ArenaGeometry geometry = SmallGeometry(memory, 4);
  // block * block_bytes + ((kv * H + head) * B + in_block) * D * dtype_bytes
  auto row = geometry.Row(2, 1, 1, 3);
  ASSERT_TRUE(row.ok()) << row.status();
  EXPECT_EQ(*row - memory.data(), 2 * 96 + ((1 * 2 + 1) * 4 + 3) * 6);
  EXPECT_EQ(*geometry.Row(0, 0, 0, 0) - memory.data(), 0);
  EXPECT_EQ(*geometry.Row(3, 1, 1, 3) - memory.data(), 4 * 96 - 6);  // the very last row
  EXPECT_EQ(*geometry.Row(1, 0, 1, 0) - memory.data(), 96 + 4 * 6);
}

TEST(ArenaGeometryTest, RefusesEverythingOutside) {
  std::vector<uint8_t> memory;
  ArenaGeometry geometry = SmallGeometry(memory, 4);
  for (auto [block, kv, head, in_block] :
       std::vector<std::tuple<int64_t, int, int, int>>{{4, 0, 0, 0},
                                                       {-1, 0, 0, 0},
                                                       {0, 2, 0, 0},
                                                       {0, -1, 0, 0},
                                                       {0, 0, 2, 0},
                                                       {0, 0, -1, 0},
                                                       {0, 0, 0, 4},
                                                       {0, 0, 0, -1},
                                                       {int64_t{1} << 62, 0, 0, 0}}) {
    EXPECT_EQ(geometry.Row(block, kv, head, in_block).status().code(),
              absl::StatusCode::kOutOfRange)
        << block << " " << kv << " " << head << " " << in_block;
  }
  // A mapping shorter than num_blocks * block_bytes: rows past its end are refused.
  geometry.size_bytes = 96 * 3 + 10;
  EXPECT_TRUE(geometry.Row(3, 0, 0, 0).ok());
  EXPECT_EQ(geometry.Row(3, 0, 0, 2).status().code(), absl::StatusCode::kOutOfRange);
  geometry.base = nullptr;
  EXPECT_EQ(geometry.Row(0, 0, 0, 0).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ReservationTest, RowPointerWalksTheReservedBlocks) {
  std::vector<uint8_t> memory;
  const ArenaGeometry geometry = SmallGeometry(memory, 8);
  v1::ReserveResponse response;
  response.set_reservation_id(7);
  for (int p : {20, 21, 22, 23, 24}) response.add_positions(p);
  // Layer 1 is listed first: the lookup must go by the layer field, not the index.
  v1::LayerSlots* layer1 = response.add_layers();
  layer1->set_layer(1);
  layer1->set_first_slot(0);
  layer1->add_blocks(5);
  layer1->add_blocks(6);
  v1::LayerSlots* layer0 = response.add_layers();
  layer0->set_layer(0);
  layer0->set_first_slot(2);  // slots 2..6: block 7 holds slots 0-3, block 3 holds 4-7
  layer0->add_blocks(7);
  layer0->add_blocks(3);
  const Reservation reservation("seq", response, geometry);
  EXPECT_EQ(reservation.id(), 7u);
  EXPECT_EQ(reservation.num_tokens(), 5);
  EXPECT_THAT(reservation.positions(), ElementsAre(20, 21, 22, 23, 24));

  auto offset = [&](int layer, int kv, int head, int token) -> int64_t {
    auto row = reservation.RowPointer(layer, kv, head, token);
    EXPECT_TRUE(row.ok()) << row.status();
    return row.ok() ? *row - memory.data() : -1;
  };
  EXPECT_EQ(offset(0, 0, 0, 0), 7 * 96 + 2 * 6);                      // slot 2
  EXPECT_EQ(offset(0, 0, 0, 1), 7 * 96 + 3 * 6);                      // slot 3
  EXPECT_EQ(offset(0, 0, 0, 2), 3 * 96 + 0 * 6);                      // slot 4: next block
  EXPECT_EQ(offset(0, 1, 1, 4), 3 * 96 + ((1 * 2 + 1) * 4 + 2) * 6);  // slot 6, V, head 1
  EXPECT_EQ(offset(1, 0, 1, 4), 6 * 96 + (1 * 4 + 0) * 6);            // layer 1 slot 4
  EXPECT_EQ(*reservation.KeyRow(0, 1, 0), *reservation.RowPointer(0, 0, 1, 0));
  EXPECT_EQ(*reservation.ValueRow(0, 1, 0), *reservation.RowPointer(0, 1, 1, 0));

  EXPECT_EQ(reservation.RowPointer(0, 0, 0, 5).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reservation.RowPointer(0, 0, 0, -1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reservation.RowPointer(2, 0, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  // A server that sent too few blocks is caught, not followed.
  v1::ReserveResponse short_response = response;
  short_response.mutable_layers(1)->mutable_blocks()->RemoveLast();
  const Reservation truncated("seq", short_response, geometry);
  EXPECT_TRUE(truncated.RowPointer(0, 0, 0, 1).ok());
  EXPECT_EQ(truncated.RowPointer(0, 0, 0, 2).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(ExportResultTest, RowWalksLayersOfDifferentCounts) {
  ExportResult result;
  v1::ModelLayout* layout = result.header.mutable_layout();
  layout->set_num_kv_heads(2);
  layout->set_head_dim(2);
  layout->set_dtype(v1::DTYPE_FLOAT32);  // rows of 8 bytes
  v1::LayerLayout* first = result.header.add_layers();
  first->set_layer(2);
  first->set_count(3);
  v1::LayerLayout* second = result.header.add_layers();
  second->set_layer(0);
  second->set_count(1);
  // Every row holds its own index: [layer][2][H][count] rows in order.
  int rows = 0;
  for (int count : {3, 1}) {
    for (int r = 0; r < 2 * 2 * count; ++r) result.payload.append(8, static_cast<char>(rows++));
  }
  result.header.set_payload_bytes(result.payload.size());
  auto first_byte = [&](int layer_index, int kv, int head, int slot) {
    auto row = result.Row(layer_index, kv, head, slot);
    EXPECT_TRUE(row.ok()) << row.status();
    return row.ok() && row->size() == 8 ? static_cast<int>((*row)[0]) : -1;
  };
  EXPECT_EQ(first_byte(0, 0, 0, 0), 0);
  EXPECT_EQ(first_byte(0, 0, 1, 2), 5);
  EXPECT_EQ(first_byte(0, 1, 0, 1), 7);
  EXPECT_EQ(first_byte(1, 0, 0, 0), 12);
  EXPECT_EQ(first_byte(1, 1, 1, 0), 15);
  EXPECT_EQ(result.FindLayer(0), second);
  EXPECT_EQ(result.FindLayer(1), nullptr);
  EXPECT_EQ(result.Row(1, 0, 0, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(result.Row(2, 0, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(result.Row(0, 0, 2, 0).status().code(), absl::StatusCode::kOutOfRange);
  result.payload.resize(result.payload.size() - 1);  // a short payload is caught
  EXPECT_EQ(result.Row(1, 1, 1, 0).status().code(), absl::StatusCode::kOutOfRange);
}

// ---------------------------------------------------------------------------------------------
// Against an in-process fake server.

class FakeSidecar final : public v1::Sidecar::Service {
 public:
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest* request,
                      v1::AttachResponse* response) override {
    absl::MutexLock lock(&mu);
    last_attach = *request;
    *response = attach_response;
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest* request,
                      v1::DetachResponse*) override {
    absl::MutexLock lock(&mu);
    detached.push_back(request->session_id());
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu);
    ++heartbeats;
    return grpc::Status::OK;
  }
  grpc::Status Watch(grpc::ServerContext* context, const v1::WatchRequest*,
                     grpc::ServerWriter<v1::SessionEvent>* writer) override {
    v1::SessionEvent event;
    event.set_kind(v1::SessionEvent::KIND_WATCHING);
    writer->Write(event);
    {
      absl::MutexLock lock(&mu);
      ++watches;
    }
    while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    absl::MutexLock lock(&mu);
    ++watches_ended;
    return grpc::Status::OK;
  }
  grpc::Status Append(grpc::ServerContext*, grpc::ServerReader<v1::AppendChunk>* reader,
                      v1::AppendResponse* response) override {
    v1::AppendChunk chunk;
    std::vector<v1::AppendChunk> got;
    while (reader->Read(&chunk)) got.push_back(chunk);
    absl::MutexLock lock(&mu);
    chunks = got;
    response->set_bytes_received(12345);
    return append_status;
  }
  grpc::Status Reserve(grpc::ServerContext*, const v1::ReserveRequest* request,
                       v1::ReserveResponse* response) override {
    absl::MutexLock lock(&mu);
    last_reserve = *request;
    response->set_reservation_id(31);
    for (int32_t layer : request->layers()) {
      v1::LayerSlots* slots = response->add_layers();
      slots->set_layer(layer);
      slots->add_blocks(layer);
    }
    for (int i = 0; i < request->num_tokens(); ++i) response->add_positions(i);
    return grpc::Status::OK;
  }
  grpc::Status CancelReservation(grpc::ServerContext*, const v1::CancelReservationRequest* request,
                                 v1::CancelReservationResponse*) override {
    absl::MutexLock lock(&mu);
    cancelled.push_back(*request);
    return cancel_status;
  }
  grpc::Status Export(grpc::ServerContext*, const v1::ExportRequest* request,
                      grpc::ServerWriter<v1::ExportChunk>* writer) override {
    std::vector<v1::ExportChunk> to_send;
    {
      absl::MutexLock lock(&mu);
      last_export = *request;
      to_send = export_chunks;
    }
    for (const auto& chunk : to_send) writer->Write(chunk);
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  v1::AttachResponse attach_response;
  v1::AttachRequest last_attach;
  std::vector<std::string> detached;
  int heartbeats = 0;
  int watches = 0;
  int watches_ended = 0;
  std::vector<v1::AppendChunk> chunks;
  grpc::Status append_status;
  std::vector<v1::ExportChunk> export_chunks;
  v1::ExportRequest last_export;
  v1::ReserveRequest last_reserve;
  std::vector<v1::CancelReservationRequest> cancelled;
  grpc::Status cancel_status;
};

class ClientFakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
    ClientOptions options;
    options.worker_name = "unit";
    auto client = Client::Connect("127.0.0.1:" + std::to_string(port_), options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);

    // An arena file the fake hands out: 4 blocks of H=2, B=4, D=8, fp16 (256 bytes each).
    char path[] = "/tmp/kvs-client-test-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 4 * 256), 0);
    close(fd);
    shm_path_ = path;
    v1::AttachResponse& response = fake_.attach_response;
    response.set_session_id("s-1");
    response.set_lease_ms(150);
    response.set_backend("cpu");
    *response.mutable_layout() = Layout();
    v1::ArenaHandle* arena = response.mutable_arena();
    arena->set_kind(v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
    arena->set_shm_path(shm_path_);
    arena->set_size_bytes(4 * 256);
    arena->set_block_bytes(256);
    arena->set_num_blocks(4);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!shm_path_.empty()) unlink(shm_path_.c_str());
  }

  static v1::ModelLayout Layout() {
    v1::ModelLayout layout;
    layout.set_num_layers(2);
    layout.set_num_kv_heads(2);
    layout.set_num_q_heads(2);
    layout.set_head_dim(8);
    layout.set_dtype(v1::DTYPE_FLOAT16);
    layout.set_block_tokens(4);
    return layout;
  }

  std::vector<std::string> Detached() {
    absl::MutexLock lock(&fake_.mu);
    return fake_.detached;
  }

  FakeSidecar fake_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
  std::string shm_path_;
};

TEST_F(ClientFakeServerTest, AttachMapsTheArenaWatchesAndHeartbeats) {
  auto session = client_->Attach(Layout(), "t", 4, 150);
  ASSERT_TRUE(session.ok()) << session.status();
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_attach.tenant(), "t");
    EXPECT_EQ(fake_.last_attach.num_blocks(), 4);
    EXPECT_EQ(fake_.last_attach.lease_ms(), 150);
    EXPECT_EQ(fake_.last_attach.worker_name(), "unit");
  }
  EXPECT_EQ((*session)->session_id(), "s-1");
  EXPECT_TRUE((*session)->watching());
  // Heartbeats every lease/3 = 50 ms.
  EXPECT_TRUE(PollUntil(
      [&] {
        absl::MutexLock lock(&fake_.mu);
        return fake_.heartbeats >= 3;
      },
      absl::Seconds(30)));
  EXPECT_TRUE((*session)->health().ok());

  // A write through the mapping lands in the file at the block-layout offset.
  v1::ReserveResponse response;
  response.set_reservation_id(1);
  response.add_positions(0);
  v1::LayerSlots* slots = response.add_layers();
  slots->set_layer(1);
  slots->set_first_slot(3);
  slots->add_blocks(2);
  const Reservation reservation("seq", response, (*session)->geometry());
  std::vector<uint8_t> row(16);
  for (int i = 0; i < 16; ++i) row[i] = static_cast<uint8_t>(0xa0 + i);
  ASSERT_TRUE((*session)->WriteReserved(reservation, 1, 1, 1, 0, row).ok());
  const int fd = open(shm_path_.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> file(16);
  const off_t offset = 2 * 256 + ((1 * 2 + 1) * 4 + 3) * 16;
  ASSERT_EQ(pread(fd, file.data(), 16, offset), 16);
  close(fd);
  EXPECT_EQ(file, row);
  // Reading in place goes through the block table.
  v1::LayerLayout layer;
  layer.set_layer(1);
  layer.set_count(4);
  layer.add_block_table(2);
  auto read = (*session)->ReadRow(layer, 1, 1, 3);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::vector<uint8_t>(read->begin(), read->end()), row);
  EXPECT_EQ((*session)->ReadRow(layer, 1, 1, 4).status().code(), absl::StatusCode::kOutOfRange);
  layer.set_count(5);  // a block table too short for the count
  EXPECT_EQ((*session)->ReadRow(layer, 1, 1, 4).status().code(), absl::StatusCode::kOutOfRange);

  auto detached = (*session)->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  EXPECT_THAT(Detached(), ElementsAre("s-1"));
  EXPECT_TRUE(PollUntil(  // the client cancelled its Watch stream
      [&] {
        absl::MutexLock lock(&fake_.mu);
        return fake_.watches_ended == 1;
      },
      absl::Seconds(30)));
  const int heartbeats_after_detach = [&] {
    absl::MutexLock lock(&fake_.mu);
    return fake_.heartbeats;
  }();
  absl::SleepFor(absl::Milliseconds(200));
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.heartbeats, heartbeats_after_detach);
  }
  EXPECT_EQ((*session)->Detach().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*session)->GetLayout("x").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientFakeServerTest, DestructorDetaches) {
  {
    auto session = client_->Attach(Layout());
    ASSERT_TRUE(session.ok()) << session.status();
  }
  EXPECT_THAT(Detached(), ElementsAre("s-1"));
}

TEST_F(ClientFakeServerTest, RefusesHandlesItCannotMapAndDetaches) {
  // A CUDA arena on a device this process cannot map: built without CUDA, no device here, or no
  // local device with that UUID (whichever holds on this host) - each is FAILED_PRECONDITION.
  v1::ArenaHandle* handle = fake_.attach_response.mutable_arena();
  handle->set_kind(v1::ArenaHandle::KIND_CUDA_IPC);
  handle->set_cuda_ipc_handle(std::string(internal::kCudaIpcHandleBytes, 'h'));
  handle->set_cuda_device_uuid("GPU-99999999-9999-9999-9999-999999999999");
  auto cuda = client_->Attach(Layout());
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition) << cuda.status();
  EXPECT_THAT(cuda.status().message(), HasSubstr("KIND_CUDA_IPC"));
  EXPECT_THAT(Detached(), ElementsAre("s-1"));
  handle->set_kind(v1::ArenaHandle::KIND_UNSPECIFIED);
  auto unspecified = client_->Attach(Layout());
  EXPECT_EQ(unspecified.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unspecified.status().message(), HasSubstr("KIND_UNSPECIFIED"));
  EXPECT_EQ(Detached().size(), 2u);

  fake_.attach_response.mutable_arena()->set_kind(v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
  fake_.attach_response.mutable_arena()->set_size_bytes(8 * 256);  // larger than the file
  fake_.attach_response.mutable_arena()->set_num_blocks(8);
  auto too_big = client_->Attach(Layout());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kFailedPrecondition) << too_big.status();
  EXPECT_EQ(Detached().size(), 3u);

  fake_.attach_response.mutable_arena()->set_size_bytes(4 * 256);
  fake_.attach_response.mutable_arena()->set_num_blocks(4);
  fake_.attach_response.mutable_arena()->set_block_bytes(100);  // does not match the layout
  EXPECT_FALSE(client_->Attach(Layout()).ok());
  fake_.attach_response.mutable_arena()->set_block_bytes(256);
  fake_.attach_response.mutable_arena()->set_shm_path("/nonexistent/arena");
  EXPECT_EQ(client_->Attach(Layout()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Detached().size(), 5u);
}

// A CUDA arena through a fake driver: Attach maps it on the device with the handle's UUID, the
// geometry is device memory, rows are copied through the driver (cudaMemcpy in the real one),
// ReadRow (a host span) is refused, and Detach closes the mapping after the server detached.
TEST_F(ClientFakeServerTest, MapsACudaArenaThroughTheDriverAndClosesItOnDetach) {
  constexpr char kUuid[] = "GPU-00000000-1111-2222-3333-444455556666";
  internal::FakeCudaIpcDriver driver(
      {*internal::ParseCudaUuid("GPU-aaaaaaaa-1111-2222-3333-444455556666"),
       *internal::ParseCudaUuid(kUuid)},
      /*bytes_per_open=*/4 * 256);
  internal::ScopedCudaIpcDriver scoped(&driver);
  v1::ArenaHandle* handle = fake_.attach_response.mutable_arena();
  handle->set_kind(v1::ArenaHandle::KIND_CUDA_IPC);
  handle->clear_shm_path();
  handle->set_cuda_ipc_handle(std::string(internal::kCudaIpcHandleBytes, 'q'));
  handle->set_cuda_device(0);
  handle->set_cuda_device_uuid(kUuid);
  handle->set_generation(42);

  auto session = client_->Attach(Layout());
  ASSERT_TRUE(session.ok()) << session.status();
  const ArenaGeometry& geometry = (*session)->geometry();
  EXPECT_TRUE(geometry.on_device());
  EXPECT_EQ(geometry.cuda_device, 1);  // the local ordinal of the UUID, not the sidecar's 0
  EXPECT_EQ(geometry.generation, 42u);
  ASSERT_EQ(driver.opens().size(), 1u);
  EXPECT_EQ(driver.opens()[0].device, 1);
  EXPECT_EQ(internal::CudaIpcMappings::Global().open_mappings(), 1);

  // A second attach answering the same handle for another session is refused (and detached).
  fake_.attach_response.set_session_id("s-2");
  auto foreign = client_->Attach(Layout());
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(foreign.status().message(), HasSubstr("arena of session s-1"));
  EXPECT_THAT(Detached(), ElementsAre("s-2"));
  EXPECT_EQ(driver.opens().size(), 1u);

  // Write a row through the driver; the reservation's row pointer is a device address.
  v1::ReserveResponse response;
  response.set_reservation_id(1);
  response.add_positions(0);
  v1::LayerSlots* slots = response.add_layers();
  slots->set_layer(1);
  slots->set_first_slot(3);
  slots->add_blocks(2);
  const Reservation reservation("seq", response, geometry);
  std::vector<uint8_t> row(16);
  for (int i = 0; i < 16; ++i) row[i] = static_cast<uint8_t>(0x30 + i);
  ASSERT_TRUE((*session)->WriteReserved(reservation, 1, 1, 1, 0, row).ok());
  EXPECT_EQ(driver.copies_to_device(), 1);
  auto pointer = reservation.RowPointer(1, 1, 1, 0);
  ASSERT_TRUE(pointer.ok());
  EXPECT_EQ(*pointer - geometry.base, 2 * 256 + ((1 * 2 + 1) * 4 + 3) * 16);
  EXPECT_EQ(std::vector<uint8_t>(*pointer, *pointer + 16), row);  // the fake's "device" memory

  v1::LayerLayout layer;
  layer.set_layer(1);
  layer.set_count(4);
  layer.add_block_table(2);
  std::vector<uint8_t> out(16);
  ASSERT_TRUE((*session)->ReadRowInto(layer, 1, 1, 3, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, row);
  EXPECT_EQ(driver.copies_from_device(), 1);
  auto address = (*session)->RowAddress(layer, 1, 1, 3);
  ASSERT_TRUE(address.ok());
  EXPECT_EQ(*address, *pointer);
  auto span = (*session)->ReadRow(layer, 1, 1, 3);
  EXPECT_EQ(span.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(span.status().message(), HasSubstr("ReadRowInto"));
  // A bad slot is OUT_OF_RANGE on a device arena too (bounds are checked first).
  EXPECT_EQ((*session)->ReadRow(layer, 1, 1, 4).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*session)->ReadRowInto(layer, 1, 1, 4, absl::MakeSpan(out)).code(),
            absl::StatusCode::kOutOfRange);
  std::vector<uint8_t> small(15);
  EXPECT_EQ((*session)->ReadRowInto(layer, 1, 1, 3, absl::MakeSpan(small)).code(),
            absl::StatusCode::kInvalidArgument);

  ASSERT_TRUE((*session)->Detach().ok());
  EXPECT_THAT(driver.closes(), ElementsAre(1));
  EXPECT_EQ(internal::CudaIpcMappings::Global().open_mappings(), 0);
  EXPECT_EQ((*session)->ReadRowInto(layer, 1, 1, 3, absl::MakeSpan(out)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientFakeServerTest, AppendSplitsEachSegmentIntoChunks) {
  auto session = client_->Attach(Layout());
  ASSERT_TRUE(session.ok()) << session.status();
  std::string first(2 * 1024 * 1024 + 512 * 1024, '\0');
  for (size_t i = 0; i < first.size(); ++i) first[i] = static_cast<char>(i * 7);
  const std::string second = "tiny";
  AppendSegment a;
  a.sequence_id = "a";
  a.num_tokens = 3;
  a.positions = {4, 5, 6};
  a.layers = {1};
  a.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(first.data()), first.size());
  a.compress_if_over_budget = true;
  AppendSegment b;
  b.sequence_id = "b";
  b.num_tokens = 1;
  b.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(second.data()), second.size());
  auto response = (*session)->BatchAppend({a, b});
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->bytes_received(), 12345u);
  std::vector<v1::AppendChunk> chunks;
  {
    absl::MutexLock lock(&fake_.mu);
    chunks = fake_.chunks;
  }
  ASSERT_EQ(chunks.size(), 6u);  // header, 1 MiB, 1 MiB, 0.5 MiB, header, 4 bytes
  ASSERT_TRUE(chunks[0].has_header());
  EXPECT_EQ(chunks[0].header().session_id(), "s-1");
  EXPECT_EQ(chunks[0].header().sequence_id(), "a");
  EXPECT_EQ(chunks[0].header().num_tokens(), 3);
  EXPECT_THAT(chunks[0].header().positions(), ElementsAre(4, 5, 6));
  EXPECT_THAT(chunks[0].header().layers(), ElementsAre(1));
  EXPECT_EQ(chunks[0].header().payload_bytes(), first.size());
  EXPECT_TRUE(chunks[0].header().compress_if_over_budget());
  EXPECT_EQ(chunks[1].data().size(), 1u << 20);
  EXPECT_EQ(chunks[2].data().size(), 1u << 20);
  EXPECT_EQ(chunks[3].data().size(), 512u << 10);
  EXPECT_TRUE(chunks[1].data() + chunks[2].data() + chunks[3].data() == first);
  ASSERT_TRUE(chunks[4].has_header());
  EXPECT_EQ(chunks[4].header().sequence_id(), "b");
  EXPECT_EQ(chunks[4].header().payload_bytes(), 4u);
  EXPECT_TRUE(chunks[4].header().positions().empty());
  EXPECT_FALSE(chunks[4].header().compress_if_over_budget());
  EXPECT_EQ(chunks[5].data(), "tiny");

  AppendOptions options;
  options.chunk_bytes = 4 << 20;
  ASSERT_TRUE((*session)->Append(a, options).ok());
  {
    absl::MutexLock lock(&fake_.mu);
    ASSERT_EQ(fake_.chunks.size(), 2u);
    EXPECT_EQ(fake_.chunks[1].data(), first);
  }
  options.chunk_bytes = 0;
  EXPECT_EQ((*session)->Append(a, options).status().code(), absl::StatusCode::kInvalidArgument);

  fake_.append_status =
      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "header.payload_bytes must be 5, got 4");
  auto refused = (*session)->Append(b);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(), "header.payload_bytes must be 5, got 4");
}

// BatchAppend reuses one message for every chunk: a segment with no payload leaves its header in
// it, and the next segment's header must not inherit its positions, layers or flags.
TEST_F(ClientFakeServerTest, AppendHeadersDoNotLeakAcrossSegments) {
  auto session = client_->Attach(Layout());
  ASSERT_TRUE(session.ok()) << session.status();
  AppendSegment empty;
  empty.sequence_id = "a";
  empty.num_tokens = 2;
  empty.positions = {7, 8};
  empty.layers = {1};
  empty.compress_if_over_budget = true;
  const std::string bytes = "xyz";
  AppendSegment next;
  next.sequence_id = "b";
  next.num_tokens = 1;
  next.positions = {3};
  next.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ASSERT_TRUE((*session)->BatchAppend({empty, next, empty}).ok());
  std::vector<v1::AppendChunk> chunks;
  {
    absl::MutexLock lock(&fake_.mu);
    chunks = fake_.chunks;
  }
  ASSERT_EQ(chunks.size(), 4u);  // header, header, data, header
  ASSERT_TRUE(chunks[0].has_header());
  EXPECT_THAT(chunks[0].header().positions(), ElementsAre(7, 8));
  EXPECT_THAT(chunks[0].header().layers(), ElementsAre(1));
  EXPECT_EQ(chunks[0].header().payload_bytes(), 0u);
  ASSERT_TRUE(chunks[1].has_header());
  EXPECT_EQ(chunks[1].header().sequence_id(), "b");
  EXPECT_EQ(chunks[1].header().num_tokens(), 1);
  EXPECT_THAT(chunks[1].header().positions(), ElementsAre(3));
  EXPECT_TRUE(chunks[1].header().layers().empty());
  EXPECT_FALSE(chunks[1].header().compress_if_over_budget());
  EXPECT_EQ(chunks[1].header().payload_bytes(), 3u);
  EXPECT_EQ(chunks[2].data(), "xyz");
  ASSERT_TRUE(chunks[3].has_header());
  EXPECT_THAT(chunks[3].header().positions(), ElementsAre(7, 8));
  EXPECT_THAT(chunks[3].header().layers(), ElementsAre(1));
  EXPECT_TRUE(chunks[3].header().compress_if_over_budget());
}

TEST_F(ClientFakeServerTest, ReserveInLayersAndCancelReservation) {
  auto session = client_->Attach(Layout());
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<int32_t> positions = {10, 11};
  const std::vector<int32_t> layers = {1};
  auto reservation = (*session)->Reserve("q", 2, positions, layers);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_reserve.session_id(), "s-1");
    EXPECT_EQ(fake_.last_reserve.sequence_id(), "q");
    EXPECT_EQ(fake_.last_reserve.num_tokens(), 2);
    EXPECT_THAT(fake_.last_reserve.positions(), ElementsAre(10, 11));
    EXPECT_THAT(fake_.last_reserve.layers(), ElementsAre(1));
  }
  EXPECT_EQ(reservation->id(), 31u);
  EXPECT_TRUE(reservation->KeyRow(1, 0, 0).ok());
  EXPECT_EQ(reservation->KeyRow(0, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  // The default is every layer: no layers on the wire.
  ASSERT_TRUE((*session)->Reserve("q", 1).ok());
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_TRUE(fake_.last_reserve.layers().empty());
  }
  ASSERT_TRUE((*session)->CancelReservation(*reservation).ok());
  {
    absl::MutexLock lock(&fake_.mu);
    ASSERT_EQ(fake_.cancelled.size(), 1u);
    EXPECT_EQ(fake_.cancelled[0].session_id(), "s-1");
    EXPECT_EQ(fake_.cancelled[0].sequence_id(), "q");
    EXPECT_EQ(fake_.cancelled[0].reservation_id(), 31u);
  }
  fake_.cancel_status = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                     "reservation 31 of sequence q was cancelled");
  const absl::Status refused = (*session)->CancelReservation(*reservation);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(), "reservation 31 of sequence q was cancelled");
  ASSERT_TRUE((*session)->Detach().ok());
  EXPECT_EQ((*session)->CancelReservation(*reservation).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientFakeServerTest, ExportCollectsTheStreamAndChecksIt) {
  auto session = client_->Attach(Layout());
  ASSERT_TRUE(session.ok()) << session.status();
  v1::ExportChunk header;
  header.mutable_header()->set_payload_bytes(10);
  header.mutable_header()->add_layers()->set_layer(1);
  v1::ExportChunk first, second;
  first.set_data("01234");
  second.set_data("56789");
  fake_.export_chunks = {header, first, second};
  const std::vector<int32_t> layers = {1};
  auto exported = (*session)->Export("seq", layers, 1 << 16);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->payload, "0123456789");
  EXPECT_EQ(exported->header.layers(0).layer(), 1);
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_export.session_id(), "s-1");
    EXPECT_EQ(fake_.last_export.sequence_id(), "seq");
    EXPECT_THAT(fake_.last_export.layers(), ElementsAre(1));
    EXPECT_EQ(fake_.last_export.chunk_bytes(), 1u << 16);
  }
  fake_.export_chunks = {header, first};
  EXPECT_EQ((*session)->Export("seq").status().code(), absl::StatusCode::kDataLoss);
  fake_.export_chunks = {first, header, second};
  EXPECT_EQ((*session)->Export("seq").status().code(), absl::StatusCode::kInternal);
  fake_.export_chunks = {header, first, second, first};
  EXPECT_EQ((*session)->Export("seq").status().code(), absl::StatusCode::kInternal);
  fake_.export_chunks = {header, header};
  EXPECT_EQ((*session)->Export("seq").status().code(), absl::StatusCode::kInternal);
  fake_.export_chunks = {};
  EXPECT_EQ((*session)->Export("seq").status().code(), absl::StatusCode::kInternal);
  // The fake leaves every other call unimplemented: the code comes through unchanged.
  EXPECT_EQ((*session)->Commit(Reservation()).status().code(), absl::StatusCode::kUnimplemented);
}

TEST(ClientConnectTest, UnavailableWhenNothingListens) {
  // A port that was just free: nothing listens on it.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  close(fd);
  ClientOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  auto client = Client::Connect("127.0.0.1:" + std::to_string(ntohs(address.sin_port)), options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  options.connect_timeout = absl::ZeroDuration();  // lazy: no wait, no error
  EXPECT_TRUE(Client::Connect("127.0.0.1:1", options).ok());
}

}  // namespace
}  // namespace kvsidecar
