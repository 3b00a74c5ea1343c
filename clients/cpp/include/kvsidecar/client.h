// kvsidecar C++ client: attach a worker to a kvsidecar, map its arena, write and read KV in place
// (Reserve -> write -> Commit), stream KV inline (Append / Export), compress sequences to their
// budget, and read the compacted cache back in place by block table.
//
// Ownership: a Client owns one gRPC channel. A Session (from Client::Attach) owns one attached
// server session: the arena mapping (mapped once, at Attach), the Watch stream that ties the
// session's life to this process (if the process dies the server reclaims the session at once),
// and a heartbeat thread that renews the lease every lease/3. Detach() or the destructor ends the
// session, stops both and unmaps the arena. A Session keeps the channel alive on its own, so it
// may outlive the Client it came from.
//
// Threading: Client and Session are thread-safe: any number of threads may call any method of
// one Session concurrently (each call is one independent RPC; the server serialises work on a
// session). The exceptions are Detach() and the destructor: they unmap the arena, so no other
// call on the session, and no use of a pointer or span into the arena (Reservation row pointers,
// ReadRow results), may overlap or follow them. Reservation and ExportResult are plain values
// (not synchronised). Row pointers of a Reservation are writable until its Commit; rows read in
// place stay valid until the sequence is next changed (commit, compress, release).
//
// Errors: every call returns absl::Status / absl::StatusOr. gRPC errors become absl::Status with
// the same code and message; the client adds its own errors only where it checks something
// locally (a handle kind it cannot map, a row outside the arena, a bad chunk size, a malformed
// server stream).
//
// Host arenas: KIND_MEMFD (the default) is fetched by Attach as a descriptor from the sidecar's
// arena socket with the Attach response's single-use nonce (FetchArenaFd), mapped, and the
// descriptor closed; KIND_SHARED_MEMORY_FILE (a sidecar run with --arena_shm_names) is opened
// by path. Either way the mapping lives until Detach.
//
// CUDA arenas (ArenaHandle.KIND_CUDA_IPC, a --backend=cuda sidecar): when the library is built
// with CUDA, Attach opens the handle once with cudaIpcOpenMemHandle on the local device whose UUID
// is arena.cuda_device_uuid (ordinals differ between processes), caches the mapping process-wide
// by (session, generation) and closes it on Detach; a handle of another session, or of another
// generation while one is mapped, is refused (FAILED_PRECONDITION). geometry().base is then a
// device pointer (geometry().memory == kDevice, geometry().cuda_device its local ordinal):
// Reservation row pointers are device addresses for the worker's own kernels / cudaMemcpyAsync;
// WriteReserved and ReadRowInto copy with cudaMemcpy; ReadRow (a host span) is refused. Built
// without CUDA, Attach of a CUDA arena answers FAILED_PRECONDITION saying so.
//
// Synchronisation with the sidecar (the rule of common.proto ArenaHandle, no IPC events):
// (a) worker -> sidecar: every write into reserved slots must be complete on the device before
//     the call that hands them over (Commit, BatchCommit, DecodeStep, Compress): synchronise the
//     stream(s) that wrote (cudaStreamSynchronize, or record an event and cudaEventSynchronize)
//     before calling. The sidecar reads nothing of those slots before that call arrives.
// (b) sidecar -> worker: every call that changes the arena (Commit, Compress, DecodeStep, Select,
//     Restore, ...) has finished its device work before its response is sent, so the worker may
//     read (and launch kernels reading) the arena as soon as the response arrives. Do not read or
//     write a sequence's slots while a call that changes that sequence is in flight.
#ifndef KVSIDECAR_CLIENT_H_
#define KVSIDECAR_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "kvsidecar/v1/common.pb.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"

namespace kvsidecar {

namespace internal {
class CudaIpcDriver;  // clients/cpp/cuda_ipc.h
}  // namespace internal

// The gRPC status as an absl::Status: same code, same message.
absl::Status ToStatus(const grpc::Status& status);

// Bytes of one element of `dtype`, or 0 for DTYPE_UNSPECIFIED / unknown values.
int DTypeBytes(v1::DType dtype);

// Fetches a KIND_MEMFD arena's descriptor from the sidecar's arena socket (ArenaHandle
// fd_socket_path / fd_nonce; protocol in common.proto). Returns the descriptor (close-on-exec;
// the caller closes it). UNAVAILABLE when the socket cannot be reached, PERMISSION_DENIED with
// the sidecar's reason when it refuses, INTERNAL for a malformed answer. Attach calls it.
absl::StatusOr<int> FetchArenaFd(const std::string& socket_path, const std::string& session_id,
                                 const std::string& nonce,
                                 absl::Duration timeout = absl::Seconds(10));

struct ClientOptions {
  // Channel credentials; null = insecure (loopback / same pod).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Connect() waits this long for the channel to become ready; zero = connect lazily.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Deadline of each unary call and of each Append/Export stream; zero or infinite = none.
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Largest message the client accepts (Export chunks are up to 4 MiB).
  int max_receive_message_bytes = 64 << 20;
  // Shown in Admin ListSessions.
  std::string worker_name;
  // Sent as "authorization: Bearer <token>" on every call when not empty (the server's
  // tenant_tokens_file / admin_token_file). Over plaintext it travels in the clear: use TLS
  // credentials beyond loopback.
  std::string bearer_token;
  // TLS: expect this name in the server certificate instead of the target's host (e.g. when
  // connecting by IP address to a certificate issued for a DNS name); empty = the target's.
  std::string tls_server_name;
};

// The geometry of a mapped arena: everything needed to turn (block, kv, head, in-block slot)
// into an address in the mapping (host memory, or device memory for a CUDA arena), with every
// access bounds-checked against the mapping.
struct ArenaGeometry {
  enum class Memory { kHost, kDevice };
  uint8_t* base = nullptr;  // start of the mapping (a device pointer when memory == kDevice)
  Memory memory = Memory::kHost;
  int cuda_device = -1;     // kDevice: this process's ordinal of the arena's GPU
  uint64_t generation = 0;  // ArenaHandle.generation of the mapping
  uint64_t size_bytes = 0;  // bytes mapped
  uint64_t block_bytes = 0;
  int32_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t block_tokens = 0;
  int32_t head_dim = 0;
  int32_t dtype_bytes = 0;
  uint64_t staging_offset = 0;  // the query staging area (AttachRequest.staging_bytes)
  uint64_t staging_bytes = 0;

  uint64_t row_bytes() const { return static_cast<uint64_t>(head_dim) * dtype_bytes; }
  // Address of `bytes` at `offset` of the query staging area, where a step's queries go for
  // AttentionInputs.staging_offset; OUT_OF_RANGE if they leave the area.
  absl::StatusOr<uint8_t*> Staging(uint64_t offset, uint64_t bytes) const;
  bool on_device() const { return memory == Memory::kDevice; }
  // Address of the row (kv, head, in_block) of block `block`: block * block_bytes +
  // ((kv * H + head) * B + in_block) * D * dtype_bytes. OUT_OF_RANGE if any index is outside the
  // layout or the row is outside the mapping.
  absl::StatusOr<uint8_t*> Row(int64_t block, int kv, int head, int in_block) const;
};

// A pending reservation: where the reserved tokens of every layer live in the mapped arena.
// Write K/V rows through RowPointer (or Session::WriteReserved), then Session::Commit it.
class Reservation {
 public:
  Reservation() = default;
  Reservation(std::string sequence_id, v1::ReserveResponse response, ArenaGeometry geometry);

  const std::string& sequence_id() const { return sequence_id_; }
  uint64_t id() const { return response_.reservation_id(); }
  int32_t num_tokens() const { return response_.positions_size(); }
  // Positions the reserved tokens get, token_i = 0 .. num_tokens() - 1.
  absl::Span<const int32_t> positions() const {
    return absl::MakeConstSpan(response_.positions().data(), response_.positions_size());
  }
  const v1::ReserveResponse& response() const { return response_; }
  const ArenaGeometry& geometry() const { return geometry_; }

  // Address (host, or device for a CUDA arena) of the K (kv = 0) or V (kv = 1) row of token
  // `token_i` of the reservation, for kv head `head` of `layer`: head_dim elements of the session
  // dtype. Slot first_slot + token_i sits in blocks[(first_slot + token_i) / B - first_slot / B] at
  // index (first_slot + token_i) % B.
  absl::StatusOr<uint8_t*> RowPointer(int layer, int kv, int head, int token_i) const;
  absl::StatusOr<uint8_t*> KeyRow(int layer, int head, int token_i) const {
    return RowPointer(layer, 0, head, token_i);
  }
  absl::StatusOr<uint8_t*> ValueRow(int layer, int head, int token_i) const {
    return RowPointer(layer, 1, head, token_i);
  }

 private:
  const v1::LayerSlots* FindLayer(int layer) const;

  std::string sequence_id_;
  v1::ReserveResponse response_;
  ArenaGeometry geometry_;
};

// An exported sequence: the header (layout, per-layer counts and positions) and the payload
// [layer][2][H][count][D] in the session dtype, tokens in slot order, layers in header order.
struct ExportResult {
  v1::ExportHeader header;
  std::string payload;

  // The row (kv, head, slot) of the `layer_index`-th layer of the header. OUT_OF_RANGE if outside.
  absl::StatusOr<absl::Span<const uint8_t>> Row(int layer_index, int kv, int head, int slot) const;
  // The header entry of model layer `layer`, or nullptr.
  const v1::LayerLayout* FindLayer(int layer) const;
};

// One segment of an inline Append: `num_tokens` new tokens of one sequence for `layers` (empty =
// all), payload [layers][2][H][num_tokens][D] in the session dtype.
struct AppendSegment {
  std::string sequence_id;
  int32_t num_tokens = 0;
  std::vector<int32_t> positions;  // empty = continue from the sequence's next position
  std::vector<int32_t> layers;     // empty = all layers in order
  absl::Span<const uint8_t> payload;
  bool compress_if_over_budget = false;
};

struct AppendOptions {
  // Payload bytes per data message; the server accepts 1-4 MiB comfortably.
  size_t chunk_bytes = size_t{1} << 20;
};

struct ReserveItem {
  std::string sequence_id;
  int32_t num_tokens = 0;
  std::vector<int32_t> positions;  // empty = continue from the sequence's next position
};

struct CompressOptions {
  // Tokens each layer keeps (>= 1); nullopt = the sequence's budget. 0 keeps nothing: refused
  // (INVALID_ARGUMENT naming budget_tokens) without a call, as every client refuses it.
  std::optional<int32_t> budget_tokens;
  std::optional<v1::PolicySpec> policy;  // nullopt = the sequence's policy
  bool return_positions = false;
};

class Client;

class Session {
 public:
  ~Session();  // Detaches if still attached (errors are ignored).
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& session_id() const { return attach_.session_id(); }
  // The layout as the server resolved it (block_tokens filled in).
  const v1::ModelLayout& layout() const { return attach_.layout(); }
  const v1::ArenaHandle& arena() const { return attach_.arena(); }
  const v1::AttachResponse& attach_response() const { return attach_; }
  int32_t lease_ms() const { return attach_.lease_ms(); }
  const ArenaGeometry& geometry() const { return geometry_; }
  // True once the server bound the session to this process's Watch stream.
  bool watching() const;
  // True after the server announced it is draining.
  bool draining() const { return draining_.load(); }
  // OK while the session looks alive; else the last heartbeat error or why the Watch stream ended.
  absl::Status health() const;

  // Ends the session on the server, stops the heartbeat and the Watch stream, unmaps the arena.
  // A second call answers FAILED_PRECONDITION.
  absl::StatusOr<v1::DetachResponse> Detach();
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat();

  // --- Sequences -------------------------------------------------------------------------------
  // `budget` nullopt = unbounded; `sequence_id` empty = server-generated.
  absl::StatusOr<v1::CreateSequenceResponse> CreateSequence(const v1::PolicySpec& policy,
                                                            const std::optional<v1::Budget>& budget,
                                                            const std::string& sequence_id = "");
  absl::StatusOr<v1::CreateSequenceResponse> CreateSequence(v1::CreateSequenceRequest request);
  absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseSequence(const std::string& sequence_id);

  // --- Zero-copy writes --------------------------------------------------------------------------
  // `layers`: the layers to reserve in (distinct, each in [0, L)); empty = all. Layers not listed
  // get no new tokens. A strict budget evicts before reserving, and that eviction stays even if
  // the reservation is cancelled.
  absl::StatusOr<Reservation> Reserve(const std::string& sequence_id, int32_t num_tokens,
                                      absl::Span<const int32_t> positions = {},
                                      absl::Span<const int32_t> layers = {});
  // Copies one row (exactly head_dim * dtype_bytes bytes, host memory) into the reserved slot
  // (memcpy, or a synchronous cudaMemcpy into a CUDA arena).
  absl::Status WriteReserved(const Reservation& reservation, int layer, int kv, int head,
                             int token_i, absl::Span<const uint8_t> row) const;
  absl::StatusOr<v1::CommitResponse> Commit(const Reservation& reservation,
                                            bool compress_if_over_budget = false);
  // Full control (attention inputs); session_id is filled in.
  absl::StatusOr<v1::CommitResponse> Commit(v1::CommitRequest request);
  // Drops a pending reservation without committing it; its row pointers must not be used after.
  absl::Status CancelReservation(const Reservation& reservation);
  // All or nothing on the server: if an item is bad nothing is reserved.
  absl::StatusOr<std::vector<Reservation>> BatchReserve(absl::Span<const ReserveItem> items);
  absl::StatusOr<v1::BatchCommitResponse> BatchCommit(absl::Span<const Reservation> reservations,
                                                      bool compress_if_over_budget = false);

  // --- Inline writes and reads -------------------------------------------------------------------
  // One client stream: a header per segment, then its payload in chunks of options.chunk_bytes.
  // Stops sending as soon as the server ends the stream and returns the server's status.
  absl::StatusOr<v1::AppendResponse> Append(const AppendSegment& segment,
                                            const AppendOptions& options = {});
  absl::StatusOr<v1::AppendResponse> BatchAppend(absl::Span<const AppendSegment> segments,
                                                 const AppendOptions& options = {});
  // Collects the Export stream: header + the whole payload. `chunk_bytes` 0 = server default.
  absl::StatusOr<ExportResult> Export(const std::string& sequence_id,
                                      absl::Span<const int32_t> layers = {},
                                      uint32_t chunk_bytes = 0);

  // --- Layout, compression, in-place reads ------------------------------------------------------
  absl::StatusOr<v1::GetLayoutResponse> GetLayout(const std::string& sequence_id,
                                                  absl::Span<const int32_t> layers = {},
                                                  bool omit_positions = false);
  absl::StatusOr<v1::CompressResponse> Compress(const std::string& sequence_id,
                                                const CompressOptions& options = {});
  // Full control; session_id is filled in.
  absl::StatusOr<v1::CompressResponse> Compress(v1::CompressRequest request);
  // The row (kv, head, slot) of `layer` read in place from the mapped arena through the block
  // table of `layout` (from GetLayout). OUT_OF_RANGE if the slot is not held or lies outside
  // the arena. Valid until the sequence next changes. FAILED_PRECONDITION on a CUDA arena (its
  // rows are device memory): use ReadRowInto, or RowAddress and the device pointer.
  absl::StatusOr<absl::Span<const uint8_t>> ReadRow(const v1::GetLayoutResponse& layout, int layer,
                                                    int kv, int head, int slot) const;
  absl::StatusOr<absl::Span<const uint8_t>> ReadRow(const v1::LayerLayout& layer_layout, int kv,
                                                    int head, int slot) const;
  // The same row copied into `out` (exactly head_dim * dtype_bytes bytes of host memory): memcpy,
  // or a synchronous cudaMemcpy from a CUDA arena. Works for both arena kinds.
  absl::Status ReadRowInto(const v1::GetLayoutResponse& layout, int layer, int kv, int head,
                           int slot, absl::Span<uint8_t> out) const;
  absl::Status ReadRowInto(const v1::LayerLayout& layer_layout, int kv, int head, int slot,
                           absl::Span<uint8_t> out) const;
  // The address of that row in the mapping (a device pointer on a CUDA arena), bounds-checked.
  absl::StatusOr<uint8_t*> RowAddress(const v1::LayerLayout& layer_layout, int kv, int head,
                                      int slot) const;

  // --- The rest of the contract, as raw requests (session_id filled in where the request has one).
  absl::StatusOr<v1::BatchCompressResponse> BatchCompress(v1::BatchCompressRequest request);
  absl::StatusOr<v1::DecodeStepResponse> DecodeStep(v1::DecodeStepRequest request);
  absl::StatusOr<v1::ScoreResponse> Score(v1::ScoreRequest request);
  absl::StatusOr<v1::SelectResponse> Select(v1::SelectRequest request);
  absl::StatusOr<v1::GetRetainedResponse> GetRetained(v1::GetRetainedRequest request);
  absl::StatusOr<v1::SpillResponse> Spill(v1::SpillRequest request);
  absl::StatusOr<v1::RestoreResponse> Restore(v1::RestoreRequest request);
  absl::StatusOr<v1::PublishResponse> Publish(v1::PublishRequest request);
  absl::StatusOr<v1::UnpublishResponse> Unpublish(v1::UnpublishRequest request);
  absl::StatusOr<v1::LookupPrefixesResponse> LookupPrefixes(v1::LookupPrefixesRequest request);

  v1::Sidecar::Stub* stub() const { return stub_.get(); }

 private:
  friend class Client;
  Session(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<v1::Sidecar::Stub> stub,
          ClientOptions options, v1::AttachResponse attach);

  // Maps the arena and starts the Watch stream and the heartbeat; on failure the caller detaches.
  absl::Status Start();
  void WatchLoop();
  void HeartbeatLoop();
  void StopHeartbeats();  // wakes the heartbeat thread and joins it
  void StopBackground();
  void Unmap();
  void PrepareContext(grpc::ClientContext* context) const;
  absl::Status CheckAttached() const;
  absl::Status MapSharedMemory();
  absl::Status MapCudaIpc();

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Sidecar::Stub> stub_;
  const ClientOptions options_;
  const v1::AttachResponse attach_;
  ArenaGeometry geometry_;  // set once by Start(), read-only afterwards
  // The CUDA runtime (or a test's fake) that mapped a device arena; null for a host arena. Set
  // once by Start(), read-only afterwards.
  internal::CudaIpcDriver* cuda_driver_ = nullptr;

  std::atomic<bool> detached_{false};
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool watch_started_ ABSL_GUARDED_BY(mu_) = false;  // first event seen or stream ended
  bool watching_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientContext> watch_context_;  // created before the watch thread starts
  std::thread watch_thread_;
  std::thread heartbeat_thread_;
  // The heartbeat thread sleeps on these: std::condition_variable waits on the monotonic clock,
  // where absl::Mutex's timed waits take a system-clock deadline that a step of the clock back
  // would push out, and heartbeats would stop until the lease lapsed.
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;  // guarded by heartbeat_mu_
  absl::Mutex detach_mu_;  // serialises Detach() with itself and the destructor
};

class Client {
 public:
  // Opens a channel to `target` (host:port, unix:path, ...) and, unless connect_timeout is zero,
  // waits until it is ready: UNAVAILABLE if it is not within the timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ClientOptions& options = {});

  // Attaches, maps the arena, opens the Watch stream and starts the heartbeat. `num_blocks` and
  // `lease_ms` 0 = server defaults. If the arena cannot be mapped (FAILED_PRECONDITION for a
  // handle this process cannot map: a CUDA IPC arena in a build without CUDA, a device UUID no
  // local GPU has, a stale or foreign handle) the server session is detached again.
  absl::StatusOr<std::unique_ptr<Session>> Attach(const v1::ModelLayout& layout,
                                                  const std::string& tenant = "default",
                                                  int32_t num_blocks = 0, int32_t lease_ms = 0);
  absl::StatusOr<std::unique_ptr<Session>> Attach(v1::AttachRequest request);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::Sidecar::Stub* stub() const { return stub_.get(); }
  const ClientOptions& options() const { return options_; }

 private:
  Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Sidecar::Stub> stub_;
  ClientOptions options_;
};

// The operator API (normally on its own port), every call as absl::StatusOr.
class AdminClient {
 public:
  static absl::StatusOr<std::unique_ptr<AdminClient>> Connect(const std::string& target,
                                                              const ClientOptions& options = {});

  absl::StatusOr<v1::GetConfigResponse> GetConfig();
  absl::StatusOr<v1::SetDefaultsResponse> SetDefaults(const v1::SetDefaultsRequest& request);
  absl::StatusOr<v1::SetQuotaResponse> SetQuota(const v1::SetQuotaRequest& request);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const std::string& tenant = "");
  absl::StatusOr<v1::ListSequencesResponse> ListSequences(const std::string& session_id = "",
                                                          const std::string& tenant = "");
  // Spilled copies (those of ended sessions and earlier runs, and lost ones, included).
  absl::StatusOr<v1::ListSpilledResponse> ListSpilled(const std::string& tenant = "",
                                                      const std::string& session_id = "");
  // Tenants with a quota or sessions: the quota in force and the usage ("" = all).
  absl::StatusOr<v1::GetQuotasResponse> GetQuotas(const std::string& tenant = "");
  absl::StatusOr<v1::GetStatsResponse> GetStats();
  absl::StatusOr<v1::DrainResponse> Drain();
  // Drain with a target tier and grace (admin.proto DrainRequest); the call takes up to the
  // grace period, so the deadline is the grace plus the client's default.
  absl::StatusOr<v1::DrainResponse> Drain(const v1::DrainRequest& request);
  absl::StatusOr<v1::ForceReleaseResponse> ForceRelease(const std::string& session_id,
                                                        const std::string& sequence_id = "");

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  AdminClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> stub_;
  ClientOptions options_;
};

}  // namespace kvsidecar

#endif  // KVSIDECAR_CLIENT_H_
