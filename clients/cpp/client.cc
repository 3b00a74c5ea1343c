#include "kvsidecar/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/cuda_ipc.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"

namespace kvsidecar {
namespace {

// Caps the up-front reservation of an Export buffer so that a bogus header cannot make the client
// allocate more than it will actually receive; the buffer still grows to the real size.
constexpr uint64_t kMaxExportReserve = uint64_t{256} << 20;

std::shared_ptr<grpc::Channel> OpenChannel(const std::string& target,
                                           const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  args.SetMaxSendMessageSize(-1);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  auto credentials = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(target, credentials, args);
}

absl::Status WaitReady(const std::shared_ptr<grpc::Channel>& channel, const std::string& target,
                       absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return absl::OkStatus();
  if (timeout == absl::InfiniteDuration()) timeout = absl::Hours(24 * 365);
  if (channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      absl::StrCat("could not connect to ", target, " within ", absl::FormatDuration(timeout)));
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) return;
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

// The bearer token of `options`, if any, as the call's authorization metadata.
void AddToken(grpc::ClientContext* context, const ClientOptions& options) {
  if (!options.bearer_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options.bearer_token));
  }
}

// One unary call with the client's deadline (or `timeout`) and token, the gRPC status converted
// at this edge.
template <typename StubT, typename Request, typename Response>
absl::StatusOr<Response> Unary(StubT* stub,
                               grpc::Status (StubT::*method)(grpc::ClientContext*, const Request&,
                                                             Response*),
                               const Request& request, const ClientOptions& options,
                               std::optional<absl::Duration> timeout = std::nullopt) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout.value_or(options.rpc_timeout));
  AddToken(&context, options);
  Response response;
  grpc::Status status = (stub->*method)(&context, request, &response);
  if (!status.ok()) return ToStatus(status);
  return response;
}

}  // namespace

absl::Status ToStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

int DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
    case v1::DTYPE_BFLOAT16:
      return 2;
    case v1::DTYPE_FLOAT32:
      return 4;
    default:
      return 0;
  }
}

absl::StatusOr<int> FetchArenaFd(const std::string& socket_path, const std::string& session_id,
                                 const std::string& nonce, absl::Duration timeout) {
  sockaddr_un address{};
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena socket path '", socket_path, "' is empty or too long"));
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    timeout = absl::Seconds(10);
  }
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto fail = [&](absl::StatusCode code, const std::string& message) {
    close(sock);
    return absl::Status(code, absl::StrCat("arena socket ", socket_path, ": ", message));
  };
  if (connect(sock, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return fail(absl::StatusCode::kUnavailable, std::strerror(errno));
  }
  const std::string request = absl::StrCat("FETCH ", session_id, " ", nonce, "\n");
  if (send(sock, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return fail(absl::StatusCode::kUnavailable, absl::StrCat("send: ", std::strerror(errno)));
  }
  // The descriptor travels with the first bytes of the reply; read up to the end of its line.
  std::string reply;
  int fd = -1;
  while (reply.find('\n') == std::string::npos && reply.size() < 4096) {
    char buffer[512];
    iovec iov{buffer, sizeof(buffer)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &message, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
         header = CMSG_NXTHDR(&message, header)) {
      if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS &&
          header->cmsg_len >= CMSG_LEN(sizeof(int))) {
        int received;
        std::memcpy(&received, CMSG_DATA(header), sizeof(int));
        if (fd >= 0) close(fd);
        fd = received;
      }
    }
    reply.append(buffer, static_cast<size_t>(n));
  }
  close(sock);
  const size_t end = reply.find('\n');
  const std::string line = reply.substr(0, end);
  if (end != std::string::npos && line.rfind("OK ", 0) == 0 && fd >= 0) return fd;
  if (fd >= 0) close(fd);
  if (line.rfind("ERROR ", 0) == 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("arena socket ", socket_path, " refused: ", line.substr(6)));
  }
  return absl::InternalError(
      absl::StrCat("arena socket ", socket_path, ": malformed answer '", line, "'"));
}

// ---------------------------------------------------------------------------------------------
// ArenaGeometry, Reservation, ExportResult

absl::StatusOr<uint8_t*> ArenaGeometry::Staging(uint64_t offset, uint64_t bytes) const {
  if (base == nullptr) return absl::FailedPreconditionError("the arena is not mapped");
  const auto end = kvs::CheckedAdd(offset, bytes);
  const auto area_end = kvs::CheckedAdd(staging_offset, staging_bytes);
  if (!end || !area_end || *end > staging_bytes || *area_end > size_bytes) {
    return absl::OutOfRangeError(absl::StrCat(bytes, " bytes at offset ", offset,
                                              " leave the staging area of ", staging_bytes,
                                              " bytes"));
  }
  return base + staging_offset + offset;
}

absl::StatusOr<uint8_t*> ArenaGeometry::Row(int64_t block, int kv, int head, int in_block) const {
  if (base == nullptr) return absl::FailedPreconditionError("the arena is not mapped");
  if (block < 0 || block >= num_blocks) {
    return absl::OutOfRangeError(
        absl::StrCat("block ", block, " is outside the arena of ", num_blocks, " blocks"));
  }
  if (kv != 0 && kv != 1) return absl::OutOfRangeError(absl::StrCat("kv must be 0 or 1, got ", kv));
  if (head < 0 || head >= num_kv_heads) {
    return absl::OutOfRangeError(
        absl::StrCat("head must be in [0, ", num_kv_heads, "), got ", head));
  }
  if (in_block < 0 || in_block >= block_tokens) {
    return absl::OutOfRangeError(
        absl::StrCat("in-block slot must be in [0, ", block_tokens, "), got ", in_block));
  }
  const auto block_start = kvs::CheckedProduct({block, static_cast<int64_t>(block_bytes)});
  const auto row_index =
      kvs::CheckedProduct({(int64_t{kv} * num_kv_heads + head) * block_tokens + in_block,
                           static_cast<int64_t>(row_bytes())});
  if (!block_start || !row_index) return absl::OutOfRangeError("row offset overflows");
  const auto offset = kvs::CheckedAdd(*block_start, *row_index);
  const auto end = offset ? kvs::CheckedAdd(*offset, row_bytes()) : std::nullopt;
  if (!end || *end > size_bytes) {
    return absl::OutOfRangeError(absl::StrCat("row of block ", block, " lies outside the ",
                                              size_bytes, "-byte arena mapping"));
  }
  return base + *offset;
}

Reservation::Reservation(std::string sequence_id, v1::ReserveResponse response,
                         ArenaGeometry geometry)
    : sequence_id_(std::move(sequence_id)), response_(std::move(response)), geometry_(geometry) {}

const v1::LayerSlots* Reservation::FindLayer(int layer) const {
  // The server lists layers in layer order, so the index usually matches.
  if (layer >= 0 && layer < response_.layers_size() && response_.layers(layer).layer() == layer) {
    return &response_.layers(layer);
  }
  for (const v1::LayerSlots& slots : response_.layers()) {
    if (slots.layer() == layer) return &slots;
  }
  return nullptr;
}

absl::StatusOr<uint8_t*> Reservation::RowPointer(int layer, int kv, int head, int token_i) const {
  if (token_i < 0 || token_i >= num_tokens()) {
    return absl::OutOfRangeError(
        absl::StrCat("token_i must be in [0, ", num_tokens(), "), got ", token_i));
  }
  const v1::LayerSlots* slots = FindLayer(layer);
  if (slots == nullptr) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " is not in the reservation"));
  }
  const int64_t bt = geometry_.block_tokens;
  if (bt <= 0) return absl::FailedPreconditionError("the arena is not mapped");
  const int64_t slot = int64_t{slots->first_slot()} + token_i;
  const int64_t index = slot / bt - int64_t{slots->first_slot()} / bt;
  if (slots->first_slot() < 0 || index < 0 || index >= slots->blocks_size()) {
    return absl::OutOfRangeError(
        absl::StrCat("the reservation has no block for slot ", slot, " of layer ", layer));
  }
  return geometry_.Row(slots->blocks(static_cast<int>(index)), kv, head,
                       static_cast<int>(slot % bt));
}

const v1::LayerLayout* ExportResult::FindLayer(int layer) const {
  for (const v1::LayerLayout& entry : header.layers()) {
    if (entry.layer() == layer) return &entry;
  }
  return nullptr;
}

absl::StatusOr<absl::Span<const uint8_t>> ExportResult::Row(int layer_index, int kv, int head,
                                                            int slot) const {
  if (layer_index < 0 || layer_index >= header.layers_size()) {
    return absl::OutOfRangeError(
        absl::StrCat("layer_index must be in [0, ", header.layers_size(), "), got ", layer_index));
  }
  const v1::ModelLayout& layout = header.layout();
  const int64_t heads = layout.num_kv_heads();
  const uint64_t row_bytes =
      static_cast<uint64_t>(std::max(layout.head_dim(), 0)) * DTypeBytes(layout.dtype());
  if (kv != 0 && kv != 1) return absl::OutOfRangeError(absl::StrCat("kv must be 0 or 1, got ", kv));
  if (head < 0 || head >= heads) {
    return absl::OutOfRangeError(absl::StrCat("head must be in [0, ", heads, "), got ", head));
  }
  const int64_t count = header.layers(layer_index).count();
  if (slot < 0 || slot >= count) {
    return absl::OutOfRangeError(absl::StrCat("slot must be in [0, ", count, "), got ", slot));
  }
  uint64_t offset = 0;
  for (int i = 0; i < layer_index; ++i) {
    const auto layer_bytes = kvs::CheckedProduct(
        {2, heads, int64_t{header.layers(i).count()}, static_cast<int64_t>(row_bytes)});
    const auto next = layer_bytes ? kvs::CheckedAdd(offset, *layer_bytes) : std::nullopt;
    if (!next) return absl::OutOfRangeError("export payload offset overflows");
    offset = *next;
  }
  const auto in_layer = kvs::CheckedProduct(
      {(int64_t{kv} * heads + head) * count + slot, static_cast<int64_t>(row_bytes)});
  const auto start = in_layer ? kvs::CheckedAdd(offset, *in_layer) : std::nullopt;
  const auto end = start ? kvs::CheckedAdd(*start, row_bytes) : std::nullopt;
  if (!end || *end > payload.size()) {
    return absl::OutOfRangeError("row lies outside the export payload");
  }
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()) + *start, row_bytes);
}

// ---------------------------------------------------------------------------------------------
// Session

Session::Session(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<v1::Sidecar::Stub> stub,
                 ClientOptions options, v1::AttachResponse attach)
    : channel_(std::move(channel)),
      stub_(std::move(stub)),
      options_(std::move(options)),
      attach_(std::move(attach)) {}

Session::~Session() {
  if (!detached_.load()) (void)Detach();
}

void Session::PrepareContext(grpc::ClientContext* context) const {
  SetDeadline(context, options_.rpc_timeout);
  AddToken(context, options_);
}

absl::Status Session::CheckAttached() const {
  if (detached_.load()) {
    return absl::FailedPreconditionError(absl::StrCat("session ", session_id(), " is detached"));
  }
  return absl::OkStatus();
}

absl::Status Session::Start() {
  const v1::ArenaHandle& handle = attach_.arena();
  if (handle.kind() != v1::ArenaHandle::KIND_SHARED_MEMORY_FILE &&
      handle.kind() != v1::ArenaHandle::KIND_MEMFD &&
      handle.kind() != v1::ArenaHandle::KIND_CUDA_IPC) {
    return absl::FailedPreconditionError(
        absl::StrCat("arena.kind ", v1::ArenaHandle::Kind_Name(handle.kind()),
                     " cannot be mapped by this client: it maps KIND_MEMFD, "
                     "KIND_SHARED_MEMORY_FILE and KIND_CUDA_IPC arenas"));
  }
  const v1::ModelLayout& layout = attach_.layout();
  const int dtype_bytes = DTypeBytes(layout.dtype());
  if (layout.num_kv_heads() <= 0 || layout.block_tokens() <= 0 || layout.head_dim() <= 0 ||
      dtype_bytes == 0) {
    return absl::InternalError("the server resolved an invalid layout: " +
                               layout.ShortDebugString());
  }
  const auto block_bytes = kvs::CheckedProduct(
      {2, layout.num_kv_heads(), layout.block_tokens(), layout.head_dim(), dtype_bytes});
  if (!block_bytes || *block_bytes != handle.block_bytes()) {
    return absl::InternalError(
        absl::StrCat("arena.block_bytes ", handle.block_bytes(), " does not match the layout"));
  }
  const auto blocks_bytes =
      kvs::CheckedProduct({handle.num_blocks(), static_cast<int64_t>(handle.block_bytes())});
  if (handle.num_blocks() < 0 || !blocks_bytes || *blocks_bytes > handle.size_bytes() ||
      handle.size_bytes() == 0) {
    return absl::InternalError(absl::StrCat("arena of ", handle.num_blocks(),
                                            " blocks does not fit ", "arena.size_bytes ",
                                            handle.size_bytes()));
  }
  geometry_.size_bytes = handle.size_bytes();
  geometry_.block_bytes = handle.block_bytes();
  geometry_.num_blocks = handle.num_blocks();
  geometry_.num_kv_heads = layout.num_kv_heads();
  geometry_.block_tokens = layout.block_tokens();
  geometry_.head_dim = layout.head_dim();
  geometry_.dtype_bytes = dtype_bytes;
  geometry_.generation = handle.generation();
  geometry_.staging_offset = handle.staging_offset();
  geometry_.staging_bytes = handle.staging_bytes();
  KVS_RETURN_IF_ERROR(handle.kind() == v1::ArenaHandle::KIND_CUDA_IPC ? MapCudaIpc()
                                                                      : MapSharedMemory());

  // The Watch stream ties the session to this process: when it dies, the stream breaks and the
  // server reclaims the session without waiting for the lease. Wait for the server to bind it so
  // that a caller that dies right after Attach is still reclaimed promptly.
  watch_context_ = std::make_unique<grpc::ClientContext>();
  AddToken(watch_context_.get(), options_);
  watch_thread_ = std::thread([this] { WatchLoop(); });
  {
    absl::MutexLock lock(&mu_);
    absl::Duration wait = options_.connect_timeout > absl::ZeroDuration() ? options_.connect_timeout
                                                                          : absl::Seconds(10);
    if (wait == absl::InfiniteDuration()) wait = absl::Seconds(60);
    mu_.AwaitWithTimeout(absl::Condition(&watch_started_), wait);
  }
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

absl::Status Session::MapCudaIpc() {
  internal::CudaIpcDriver* driver = internal::CurrentCudaIpcDriver();
  KVS_ASSIGN_OR_RETURN(
      internal::CudaIpcMapping mapping,
      internal::CudaIpcMappings::Global().Acquire(driver, session_id(), attach_.arena()));
  cuda_driver_ = driver;
  geometry_.base = mapping.base;
  geometry_.memory = ArenaGeometry::Memory::kDevice;
  geometry_.cuda_device = mapping.device;
  return absl::OkStatus();
}

absl::Status Session::MapSharedMemory() {
  const v1::ArenaHandle& handle = attach_.arena();
  std::string what;  // names the arena in messages
  int fd = -1;
  if (handle.kind() == v1::ArenaHandle::KIND_MEMFD) {
    if (handle.fd_socket_path().empty() || handle.fd_nonce().empty()) {
      return absl::InternalError("arena.fd_socket_path or arena.fd_nonce is empty");
    }
    what = absl::StrCat("of session ", session_id(), " (from ", handle.fd_socket_path(), ")");
    KVS_ASSIGN_OR_RETURN(fd, FetchArenaFd(handle.fd_socket_path(), session_id(),
                                          handle.fd_nonce(), options_.connect_timeout));
  } else {
    if (handle.shm_path().empty()) return absl::InternalError("arena.shm_path is empty");
    what = handle.shm_path();
    fd = open(handle.shm_path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open arena ", what, ": ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < handle.size_bytes()) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("arena ", what, " is smaller than arena.size_bytes ", handle.size_bytes()));
  }
  void* base = mmap(nullptr, handle.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);  // the mapping keeps the memory; the fd is not needed any more
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map arena ", what, ": ", std::strerror(mmap_errno)));
  }
  geometry_.base = static_cast<uint8_t*>(base);
  geometry_.memory = ArenaGeometry::Memory::kHost;
  return absl::OkStatus();
}

void Session::WatchLoop() {
  v1::WatchRequest request;
  request.set_session_id(session_id());
  std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> reader =
      stub_->Watch(watch_context_.get(), request);
  v1::SessionEvent event;
  while (reader->Read(&event)) {
    absl::MutexLock lock(&mu_);
    if (event.kind() == v1::SessionEvent::KIND_WATCHING) watching_ = true;
    if (event.kind() == v1::SessionEvent::KIND_DRAINING) draining_.store(true);
    watch_started_ = true;
  }
  const grpc::Status status = reader->Finish();
  absl::MutexLock lock(&mu_);
  watch_started_ = true;
  watching_ = false;
  // A server without Watch still keeps the session alive through heartbeats.
  if (!stopping_ && status.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
    health_ = status.ok() ? absl::UnavailableError("the server ended the Watch stream")
                          : ToStatus(status);
  }
}

void Session::HeartbeatLoop() {
  const int32_t lease_ms = attach_.lease_ms() > 0 ? attach_.lease_ms() : 10000;
  const absl::Duration interval =
      std::max(absl::Milliseconds(lease_ms) / 3, absl::Milliseconds(10));
  while (true) {
    {
      std::unique_lock<std::mutex> lock(heartbeat_mu_);
      if (heartbeat_cv_.wait_for(lock, absl::ToChronoNanoseconds(interval),
                                 [this] { return heartbeat_stop_; })) {
        return;
      }
    }
    // A heartbeat that arrives after the lease is useless, so its deadline is the lease.
    v1::HeartbeatRequest request;
    request.set_session_id(session_id());
    auto response = Unary(stub_.get(), &v1::Sidecar::Stub::Heartbeat, request, options_,
                          std::min(options_.rpc_timeout, absl::Milliseconds(lease_ms)));
    absl::MutexLock lock(&mu_);
    if (!response.ok() && !stopping_) health_ = response.status();
  }
}

void Session::StopHeartbeats() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void Session::StopBackground() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  StopHeartbeats();
  if (watch_context_) watch_context_->TryCancel();
  if (watch_thread_.joinable()) watch_thread_.join();
}

void Session::Unmap() {
  if (geometry_.base == nullptr) return;
  if (geometry_.on_device()) {
    // cudaIpcCloseMemHandle through the registry; an error here (e.g. the context is already
    // gone at process exit) has nowhere useful to go.
    (void)internal::CudaIpcMappings::Global().Release(session_id(), geometry_.generation);
  } else {
    munmap(geometry_.base, geometry_.size_bytes);
  }
  geometry_.base = nullptr;
}

bool Session::watching() const {
  absl::MutexLock lock(&mu_);
  return watching_;
}

absl::Status Session::health() const {
  absl::MutexLock lock(&mu_);
  return health_;
}

absl::StatusOr<v1::DetachResponse> Session::Detach() {
  absl::MutexLock detach_lock(&detach_mu_);
  if (detached_.load()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session_id(), " is already detached"));
  }
  {
    // Stop renewing first; the Watch stream stays open until the server has detached so that
    // the server does not see a lost worker and reclaim the session under the Detach call.
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  StopHeartbeats();
  v1::DetachRequest request;
  request.set_session_id(session_id());
  auto response = Unary(stub_.get(), &v1::Sidecar::Stub::Detach, request, options_);
  StopBackground();
  detached_.store(true);
  Unmap();
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Session::Heartbeat() {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::HeartbeatRequest request;
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Heartbeat, request, options_);
}

absl::StatusOr<v1::CreateSequenceResponse> Session::CreateSequence(
    const v1::PolicySpec& policy, const std::optional<v1::Budget>& budget,
    const std::string& sequence_id) {
  v1::CreateSequenceRequest request;
  *request.mutable_policy() = policy;
  if (budget.has_value()) *request.mutable_budget() = *budget;
  request.set_sequence_id(sequence_id);
  return CreateSequence(std::move(request));
}

absl::StatusOr<v1::CreateSequenceResponse> Session::CreateSequence(
    v1::CreateSequenceRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::CreateSequence, request, options_);
}

absl::StatusOr<v1::ReleaseSequenceResponse> Session::ReleaseSequence(
    const std::string& sequence_id) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::ReleaseSequenceRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(sequence_id);
  return Unary(stub_.get(), &v1::Sidecar::Stub::ReleaseSequence, request, options_);
}

absl::StatusOr<Reservation> Session::Reserve(const std::string& sequence_id, int32_t num_tokens,
                                             absl::Span<const int32_t> positions,
                                             absl::Span<const int32_t> layers) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::ReserveRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(sequence_id);
  request.set_num_tokens(num_tokens);
  request.mutable_positions()->Add(positions.begin(), positions.end());
  request.mutable_layers()->Add(layers.begin(), layers.end());
  KVS_ASSIGN_OR_RETURN(v1::ReserveResponse response, Unary(stub_.get(), &v1::Sidecar::Stub::Reserve,
                                                           request, options_));
  return Reservation(sequence_id, std::move(response), geometry_);
}

absl::Status Session::WriteReserved(const Reservation& reservation, int layer, int kv, int head,
                                    int token_i, absl::Span<const uint8_t> row) const {
  KVS_RETURN_IF_ERROR(CheckAttached());
  if (row.size() != geometry_.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("row has ", row.size(), " bytes, expected ",
                                                   geometry_.row_bytes(),
                                                   " (head_dim * dtype bytes)"));
  }
  KVS_ASSIGN_OR_RETURN(uint8_t * destination, reservation.RowPointer(layer, kv, head, token_i));
  if (reservation.geometry().on_device()) {
    if (cuda_driver_ == nullptr || reservation.geometry().base != geometry_.base) {
      return absl::FailedPreconditionError("the reservation is not of this session's CUDA arena");
    }
    return cuda_driver_->CopyToDevice(geometry_.cuda_device, destination, row.data(), row.size());
  }
  std::memcpy(destination, row.data(), row.size());
  return absl::OkStatus();
}

absl::StatusOr<v1::CommitResponse> Session::Commit(const Reservation& reservation,
                                                   bool compress_if_over_budget) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::CommitRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(reservation.sequence_id());
  request.set_reservation_id(reservation.id());
  request.set_compress_if_over_budget(compress_if_over_budget);
  return Unary(stub_.get(), &v1::Sidecar::Stub::Commit, request, options_);
}

absl::StatusOr<v1::CommitResponse> Session::Commit(v1::CommitRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Commit, request, options_);
}

absl::Status Session::CancelReservation(const Reservation& reservation) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::CancelReservationRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(reservation.sequence_id());
  request.set_reservation_id(reservation.id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::CancelReservation, request, options_)
      .status();
}

absl::StatusOr<std::vector<Reservation>> Session::BatchReserve(
    absl::Span<const ReserveItem> items) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::BatchReserveRequest request;
  for (const ReserveItem& item : items) {
    v1::ReserveRequest* entry = request.add_requests();
    entry->set_session_id(session_id());
    entry->set_sequence_id(item.sequence_id);
    entry->set_num_tokens(item.num_tokens);
    entry->mutable_positions()->Add(item.positions.begin(), item.positions.end());
  }
  KVS_ASSIGN_OR_RETURN(
      v1::BatchReserveResponse response,
      Unary(stub_.get(), &v1::Sidecar::Stub::BatchReserve, request, options_));
  if (response.responses_size() != static_cast<int>(items.size())) {
    return absl::InternalError(absl::StrCat("BatchReserve answered ", response.responses_size(),
                                            " reservations for ", items.size(), " requests"));
  }
  std::vector<Reservation> reservations;
  reservations.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    reservations.emplace_back(items[i].sequence_id,
                              std::move(*response.mutable_responses(static_cast<int>(i))),
                              geometry_);
  }
  return reservations;
}

absl::StatusOr<v1::BatchCommitResponse> Session::BatchCommit(
    absl::Span<const Reservation> reservations, bool compress_if_over_budget) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::BatchCommitRequest request;
  for (const Reservation& reservation : reservations) {
    v1::CommitRequest* entry = request.add_requests();
    entry->set_session_id(session_id());
    entry->set_sequence_id(reservation.sequence_id());
    entry->set_reservation_id(reservation.id());
    entry->set_compress_if_over_budget(compress_if_over_budget);
  }
  return Unary(stub_.get(), &v1::Sidecar::Stub::BatchCommit, request, options_);
}

absl::StatusOr<v1::AppendResponse> Session::Append(const AppendSegment& segment,
                                                   const AppendOptions& options) {
  return BatchAppend(absl::MakeConstSpan(&segment, 1), options);
}

absl::StatusOr<v1::AppendResponse> Session::BatchAppend(absl::Span<const AppendSegment> segments,
                                                        const AppendOptions& options) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes must be > 0");
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendChunk>> writer = stub_->Append(&context, &response);
  bool open = true;
  v1::AppendChunk chunk;
  for (const AppendSegment& segment : segments) {
    if (!open) break;
    // `chunk` still holds the previous message: after an empty-payload segment that is its header,
    // whose repeated fields would otherwise accumulate into this one.
    chunk.Clear();
    v1::AppendHeader* header = chunk.mutable_header();
    header->set_session_id(session_id());
    header->set_sequence_id(segment.sequence_id);
    header->set_num_tokens(segment.num_tokens);
    header->mutable_positions()->Add(segment.positions.begin(), segment.positions.end());
    header->mutable_layers()->Add(segment.layers.begin(), segment.layers.end());
    header->set_payload_bytes(segment.payload.size());
    header->set_compress_if_over_budget(segment.compress_if_over_budget);
    open = writer->Write(chunk);
    // A write fails once the server has ended the stream (e.g. it refused the header): stop
    // sending and let Finish() report why.
    for (size_t offset = 0; open && offset < segment.payload.size();
         offset += options.chunk_bytes) {
      const size_t n = std::min(options.chunk_bytes, segment.payload.size() - offset);
      chunk.mutable_data()->assign(reinterpret_cast<const char*>(segment.payload.data()) + offset,
                                   n);
      open = writer->Write(chunk);
    }
  }
  if (open) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return ToStatus(status);
  return response;
}

absl::StatusOr<ExportResult> Session::Export(const std::string& sequence_id,
                                             absl::Span<const int32_t> layers,
                                             uint32_t chunk_bytes) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::ExportRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(sequence_id);
  request.mutable_layers()->Add(layers.begin(), layers.end());
  request.set_chunk_bytes(chunk_bytes);
  grpc::ClientContext context;
  PrepareContext(&context);
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = stub_->Export(&context, request);
  ExportResult result;
  bool have_header = false;
  absl::Status local;  // a malformed stream: stop reading, cancel, report it
  v1::ExportChunk chunk;
  while (local.ok() && reader->Read(&chunk)) {
    if (chunk.has_header()) {
      if (have_header) {
        local = absl::InternalError("Export stream sent a second header");
        break;
      }
      have_header = true;
      result.header = std::move(*chunk.mutable_header());
      result.payload.reserve(std::min(result.header.payload_bytes(), kMaxExportReserve));
    } else {
      if (!have_header) {
        local = absl::InternalError("Export stream sent data before its header");
      } else if (result.payload.size() + chunk.data().size() > result.header.payload_bytes()) {
        local = absl::InternalError(absl::StrCat("Export stream sent more than the ",
                                                 result.header.payload_bytes(),
                                                 " payload bytes its header announced"));
      } else {
        result.payload.append(chunk.data());
      }
    }
  }
  if (!local.ok()) {
    context.TryCancel();
    (void)reader->Finish();
    return local;
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return ToStatus(status);
  if (!have_header) return absl::InternalError("Export stream ended without a header");
  if (result.payload.size() != result.header.payload_bytes()) {
    return absl::DataLossError(absl::StrCat("Export stream ended after ", result.payload.size(),
                                            " of ", result.header.payload_bytes(),
                                            " payload bytes"));
  }
  return result;
}

absl::StatusOr<v1::GetLayoutResponse> Session::GetLayout(const std::string& sequence_id,
                                                         absl::Span<const int32_t> layers,
                                                         bool omit_positions) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  v1::GetLayoutRequest request;
  request.set_session_id(session_id());
  request.set_sequence_id(sequence_id);
  request.mutable_layers()->Add(layers.begin(), layers.end());
  request.set_omit_positions(omit_positions);
  return Unary(stub_.get(), &v1::Sidecar::Stub::GetLayout, request, options_);
}

absl::StatusOr<v1::CompressResponse> Session::Compress(const std::string& sequence_id,
                                                       const CompressOptions& options) {
  if (options.budget_tokens == 0) {
    return absl::InvalidArgumentError(
        "budget_tokens=0 keeps no token: a budget is the tokens each layer keeps (>= 1); leave "
        "it unset (nullopt) for the sequence's budget");
  }
  v1::CompressRequest request;
  request.set_sequence_id(sequence_id);
  request.set_budget_tokens(options.budget_tokens.value_or(0));
  if (options.policy.has_value()) *request.mutable_policy() = *options.policy;
  request.set_return_positions(options.return_positions);
  return Compress(std::move(request));
}

absl::StatusOr<v1::CompressResponse> Session::Compress(v1::CompressRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Compress, request, options_);
}

absl::StatusOr<absl::Span<const uint8_t>> Session::ReadRow(const v1::GetLayoutResponse& layout,
                                                           int layer, int kv, int head,
                                                           int slot) const {
  for (const v1::LayerLayout& entry : layout.layers()) {
    if (entry.layer() == layer) return ReadRow(entry, kv, head, slot);
  }
  return absl::OutOfRangeError(absl::StrCat("layer ", layer, " is not in the layout"));
}

absl::StatusOr<absl::Span<const uint8_t>> Session::ReadRow(const v1::LayerLayout& layer_layout,
                                                           int kv, int head, int slot) const {
  // Bounds first, so that a bad slot is OUT_OF_RANGE on either arena kind.
  KVS_ASSIGN_OR_RETURN(const uint8_t* row, RowAddress(layer_layout, kv, head, slot));
  if (geometry_.on_device()) {
    return absl::FailedPreconditionError(
        "ReadRow returns host memory but this session's arena is device memory (KIND_CUDA_IPC): "
        "use ReadRowInto, or RowAddress for the device pointer");
  }
  return absl::MakeConstSpan(row, geometry_.row_bytes());
}

absl::Status Session::ReadRowInto(const v1::GetLayoutResponse& layout, int layer, int kv, int head,
                                  int slot, absl::Span<uint8_t> out) const {
  for (const v1::LayerLayout& entry : layout.layers()) {
    if (entry.layer() == layer) return ReadRowInto(entry, kv, head, slot, out);
  }
  return absl::OutOfRangeError(absl::StrCat("layer ", layer, " is not in the layout"));
}

absl::Status Session::ReadRowInto(const v1::LayerLayout& layer_layout, int kv, int head, int slot,
                                  absl::Span<uint8_t> out) const {
  if (out.size() != geometry_.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("out has ", out.size(), " bytes, expected ",
                                                   geometry_.row_bytes(),
                                                   " (head_dim * dtype bytes)"));
  }
  KVS_ASSIGN_OR_RETURN(const uint8_t* row, RowAddress(layer_layout, kv, head, slot));
  if (geometry_.on_device()) {
    return cuda_driver_->CopyFromDevice(geometry_.cuda_device, out.data(), row, out.size());
  }
  std::memcpy(out.data(), row, out.size());
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> Session::RowAddress(const v1::LayerLayout& layer_layout, int kv, int head,
                                             int slot) const {
  KVS_RETURN_IF_ERROR(CheckAttached());
  if (slot < 0 || slot >= layer_layout.count()) {
    return absl::OutOfRangeError(absl::StrCat("slot must be in [0, ", layer_layout.count(),
                                              ") for layer ", layer_layout.layer(), ", got ",
                                              slot));
  }
  const int index = slot / geometry_.block_tokens;
  if (index >= layer_layout.block_table_size()) {
    return absl::OutOfRangeError(absl::StrCat("the block table of layer ", layer_layout.layer(),
                                              " has no block for slot ", slot));
  }
  return geometry_.Row(layer_layout.block_table(index), kv, head, slot % geometry_.block_tokens);
}

absl::StatusOr<v1::BatchCompressResponse> Session::BatchCompress(v1::BatchCompressRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  for (v1::CompressRequest& item : *request.mutable_requests()) {
    if (item.session_id().empty()) item.set_session_id(session_id());
  }
  return Unary(stub_.get(), &v1::Sidecar::Stub::BatchCompress, request, options_);
}

absl::StatusOr<v1::DecodeStepResponse> Session::DecodeStep(v1::DecodeStepRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  for (v1::DecodeStepRequest::Item& item : *request.mutable_items()) {
    if (item.session_id().empty()) item.set_session_id(session_id());
  }
  return Unary(stub_.get(), &v1::Sidecar::Stub::DecodeStep, request, options_);
}

absl::StatusOr<v1::ScoreResponse> Session::Score(v1::ScoreRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Score, request, options_);
}

absl::StatusOr<v1::SelectResponse> Session::Select(v1::SelectRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  for (v1::SelectRequest::Item& item : *request.mutable_items()) {
    if (item.session_id().empty()) item.set_session_id(session_id());
  }
  return Unary(stub_.get(), &v1::Sidecar::Stub::Select, request, options_);
}

absl::StatusOr<v1::GetRetainedResponse> Session::GetRetained(v1::GetRetainedRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::GetRetained, request, options_);
}

absl::StatusOr<v1::SpillResponse> Session::Spill(v1::SpillRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Spill, request, options_);
}

absl::StatusOr<v1::RestoreResponse> Session::Restore(v1::RestoreRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Restore, request, options_);
}

absl::StatusOr<v1::PublishResponse> Session::Publish(v1::PublishRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Publish, request, options_);
}

absl::StatusOr<v1::UnpublishResponse> Session::Unpublish(v1::UnpublishRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::Unpublish, request, options_);
}

absl::StatusOr<v1::LookupPrefixesResponse> Session::LookupPrefixes(
    v1::LookupPrefixesRequest request) {
  KVS_RETURN_IF_ERROR(CheckAttached());
  request.set_session_id(session_id());
  return Unary(stub_.get(), &v1::Sidecar::Stub::LookupPrefixes, request, options_);
}

// ---------------------------------------------------------------------------------------------
// Client

Client::Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      stub_(std::shared_ptr<v1::Sidecar::Stub>(v1::Sidecar::NewStub(channel_))),
      options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ClientOptions& options) {
  std::shared_ptr<grpc::Channel> channel = OpenChannel(target, options);
  KVS_RETURN_IF_ERROR(WaitReady(channel, target, options.connect_timeout));
  return std::unique_ptr<Client>(new Client(std::move(channel), options));
}

absl::StatusOr<std::unique_ptr<Session>> Client::Attach(const v1::ModelLayout& layout,
                                                        const std::string& tenant,
                                                        int32_t num_blocks, int32_t lease_ms) {
  v1::AttachRequest request;
  *request.mutable_layout() = layout;
  request.set_tenant(tenant);
  request.set_num_blocks(num_blocks);
  request.set_lease_ms(lease_ms);
  return Attach(std::move(request));
}

absl::StatusOr<std::unique_ptr<Session>> Client::Attach(v1::AttachRequest request) {
  if (request.worker_name().empty()) request.set_worker_name(options_.worker_name);
  KVS_ASSIGN_OR_RETURN(v1::AttachResponse response, Unary(stub_.get(), &v1::Sidecar::Stub::Attach,
                                                          request, options_));
  std::unique_ptr<Session> session(new Session(channel_, stub_, options_, std::move(response)));
  absl::Status started = session->Start();
  if (!started.ok()) {
    (void)session->Detach();  // do not leave an unusable session behind on the server
    return started;
  }
  return session;
}

// ---------------------------------------------------------------------------------------------
// AdminClient

AdminClient::AdminClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      stub_(v1::Admin::NewStub(channel_)),
      options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(const std::string& target,
                                                                  const ClientOptions& options) {
  std::shared_ptr<grpc::Channel> channel = OpenChannel(target, options);
  KVS_RETURN_IF_ERROR(WaitReady(channel, target, options.connect_timeout));
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(channel), options));
}

absl::StatusOr<v1::GetConfigResponse> AdminClient::GetConfig() {
  return Unary(stub_.get(), &v1::Admin::Stub::GetConfig, v1::GetConfigRequest(),
               options_);
}

absl::StatusOr<v1::SetDefaultsResponse> AdminClient::SetDefaults(
    const v1::SetDefaultsRequest& request) {
  return Unary(stub_.get(), &v1::Admin::Stub::SetDefaults, request, options_);
}

absl::StatusOr<v1::SetQuotaResponse> AdminClient::SetQuota(const v1::SetQuotaRequest& request) {
  return Unary(stub_.get(), &v1::Admin::Stub::SetQuota, request, options_);
}

absl::StatusOr<v1::ListSessionsResponse> AdminClient::ListSessions(const std::string& tenant) {
  v1::ListSessionsRequest request;
  request.set_tenant(tenant);
  return Unary(stub_.get(), &v1::Admin::Stub::ListSessions, request, options_);
}

absl::StatusOr<v1::ListSequencesResponse> AdminClient::ListSequences(const std::string& session_id,
                                                                     const std::string& tenant) {
  v1::ListSequencesRequest request;
  request.set_session_id(session_id);
  request.set_tenant(tenant);
  return Unary(stub_.get(), &v1::Admin::Stub::ListSequences, request, options_);
}

absl::StatusOr<v1::ListSpilledResponse> AdminClient::ListSpilled(const std::string& tenant,
                                                                 const std::string& session_id) {
  v1::ListSpilledRequest request;
  request.set_tenant(tenant);
  request.set_session_id(session_id);
  return Unary(stub_.get(), &v1::Admin::Stub::ListSpilled, request, options_);
}

absl::StatusOr<v1::GetQuotasResponse> AdminClient::GetQuotas(const std::string& tenant) {
  v1::GetQuotasRequest request;
  request.set_tenant(tenant);
  return Unary(stub_.get(), &v1::Admin::Stub::GetQuotas, request, options_);
}

absl::StatusOr<v1::GetStatsResponse> AdminClient::GetStats() {
  return Unary(stub_.get(), &v1::Admin::Stub::GetStats, v1::GetStatsRequest(),
               options_);
}

absl::StatusOr<v1::DrainResponse> AdminClient::Drain() {
  return Unary(stub_.get(), &v1::Admin::Stub::Drain, v1::DrainRequest(), options_);
}

absl::StatusOr<v1::DrainResponse> AdminClient::Drain(const v1::DrainRequest& request) {
  // The moves take up to the grace period (the server's --drain_grace when grace_ms is 0, at
  // most an hour).
  const absl::Duration grace = request.to() == v1::TIER_UNSPECIFIED ? absl::ZeroDuration()
                               : request.grace_ms() > 0 ? absl::Milliseconds(request.grace_ms())
                                                        : absl::Hours(1);
  return Unary(stub_.get(), &v1::Admin::Stub::Drain, request, options_,
               options_.rpc_timeout + grace);
}

absl::StatusOr<v1::ForceReleaseResponse> AdminClient::ForceRelease(const std::string& session_id,
                                                                   const std::string& sequence_id) {
  v1::ForceReleaseRequest request;
  request.set_session_id(session_id);
  request.set_sequence_id(sequence_id);
  return Unary(stub_.get(), &v1::Admin::Stub::ForceRelease, request, options_);
}

}  // namespace kvsidecar
