#include "service/sidecar_service.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "service/arena_fd_server.h"
#include "service/convert.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

namespace {

// A write stream that fails before it starts.
template <typename Response>
class FailedWriteReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit FailedWriteReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// A read stream that fails before it starts.
template <typename Request>
class FailedReadReactor final : public grpc::ServerReadReactor<Request> {
 public:
  explicit FailedReadReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// ---- Response size estimates --------------------------------------------------------------------
// Responses whose bulk is positions ([H][count] per layer) can exceed the message limit for long
// sequences. They are sized from the counts alone (a pool GetLayout without positions) so that
// an oversized request is refused before anything is built, copied or evicted. Every figure is an
// upper bound: each value is counted at the varint size of the largest value it can hold.

// Bytes of the varint encoding of `value`.
uint64_t VarintBytes(uint64_t value) {
  uint64_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

// A packed repeated int32 field of `n` values, each at most `value_bytes` long: tag, length,
// payload.
uint64_t PackedBytes(uint64_t n, uint64_t value_bytes) {
  if (n == 0) return 0;
  const uint64_t payload = n * value_bytes;
  return 1 + VarintBytes(payload) + payload;
}

// A length-delimited sub-message (tag, length, body).
uint64_t EmbeddedBytes(uint64_t body) { return 1 + VarintBytes(body) + body; }

// `fields` int32 scalar fields (tag + varint), none above `max_value`.
uint64_t ScalarBytes(int fields, int64_t max_value) {
  return static_cast<uint64_t>(fields) *
         (1 + VarintBytes(static_cast<uint64_t>(std::max<int64_t>(max_value, 0))));
}

// Everything outside the per-layer entries of a GetLayoutResponse or an ExportHeader (next
// position, counts, tier, policy, budget, layout): far below this.
constexpr uint64_t kResponseFixedBytes = 4096;

// Bytes one position costs at most: positions are below the sequence's next position.
uint64_t PositionBytes(const SequenceLayout& layout) {
  return VarintBytes(static_cast<uint64_t>(std::max<int64_t>(layout.next_position, 0)));
}

// The repeated LayerLayout entries of a GetLayoutResponse or an ExportHeader built from
// `layout` (counts and block tables as loaded without positions), with positions if asked.
uint64_t LayerLayoutsBytes(const SequenceLayout& layout, const SessionView& session,
                           bool with_positions) {
  const uint64_t block_bytes =
      VarintBytes(static_cast<uint64_t>(std::max<int64_t>(session.num_blocks, 0)));
  const uint64_t position_bytes = PositionBytes(layout);
  uint64_t total = 0;
  for (const LayerLayoutView& layer : layout.layers) {
    // layer, count, budget
    uint64_t body = ScalarBytes(3, std::max({layer.layer, layer.count, layer.budget})) +
                    PackedBytes(layer.block_table.size(), block_bytes);
    if (with_positions) {
      body += PackedBytes(static_cast<uint64_t>(session.layout.num_kv_heads) *
                              static_cast<uint64_t>(std::max(layer.count, 0)),
                          position_bytes);
    }
    total += EmbeddedBytes(body);
  }
  return total;
}

// RESOURCE_EXHAUSTED "<what> would be about N bytes, above the 64 MiB message limit; <advice>".
absl::Status TooLarge(absl::string_view what, uint64_t bytes, uint64_t limit,
                      absl::string_view advice) {
  return absl::ResourceExhaustedError(absl::StrCat(what, " would be about ", bytes,
                                                   " bytes, above the ", limit >> 20,
                                                   " MiB message limit; ", advice));
}

constexpr absl::string_view kGetLayoutAdvice = "ask for fewer layers or set omit_positions";
constexpr absl::string_view kScoreAdvice = "ask for fewer layers (layers)";

// Whether `policy` splits the budget evenly (every layer keeps at most the budget).
bool UniformSplit(const PolicyConfig& policy) {
  switch (policy.allocator.kind) {
    case LayerAllocatorKind::kUniform:
      return true;
    case LayerAllocatorKind::kDefault:
      return AllocatorDefaultsOf(policy).kind == LayerAllocatorKind::kUniform &&
             !CapabilitiesOf(policy).never_evicts;
    default:
      return false;
  }
}

// Upper bound of a ScoreResponse for the layers of `counts` (loaded without positions): per
// layer and head, `count` fp32 scores, at most `count` kept slots and `count` positions.
uint64_t EstimateScoreResponseBytes(const SequenceLayout& counts, const SessionView& session) {
  const uint64_t position_bytes = PositionBytes(counts);
  uint64_t total = 0;
  for (const LayerLayoutView& layer : counts.layers) {
    const uint64_t n = static_cast<uint64_t>(session.layout.num_kv_heads) *
                       static_cast<uint64_t>(std::max(layer.count, 0));
    const uint64_t slot_bytes =
        VarintBytes(static_cast<uint64_t>(std::max<int64_t>(layer.count, 0)));
    uint64_t body = ScalarBytes(2, std::max(layer.layer, layer.count));  // layer, kept
    if (n > 0) body += 1 + VarintBytes(4 * n) + 4 * n;                   // scores, fixed32
    body += PackedBytes(n, slot_bytes) + PackedBytes(n, position_bytes);
    total += EmbeddedBytes(body);
  }
  return total;
}
constexpr absl::string_view kCompressAdvice =
    "set return_positions=false (and read positions with GetLayout, a few layers at a time)";

}  // namespace

// ---- Watch -------------------------------------------------------------------------------------

// One open Watch stream. Kept alive by `self_` until gRPC calls OnDone (and by the service's map
// while registered). Writes are queued: gRPC allows one outstanding write per stream.
class WatchReactor final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  WatchReactor(SidecarService* service, std::string session_id)
      : service_(service), session_id_(std::move(session_id)) {}

  const std::string& session_id() const { return session_id_; }

  // Binds the reactor's lifetime to the RPC and sends KIND_WATCHING.
  void Begin(std::shared_ptr<WatchReactor> self) {
    self_ = std::move(self);
    Send(v1::SessionEvent::KIND_WATCHING);
  }

  void Send(v1::SessionEvent::Kind kind) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (finish_requested_ || finished_) return;
    v1::SessionEvent event;
    event.set_kind(kind);
    queue_.push_back(std::move(event));
    if (!writing_) WriteNextLocked();
  }

  // Ends the stream from the server side once queued events are out. The session is not
  // reclaimed for it.
  void End(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (finish_requested_ || finished_) return;
    finish_requested_ = true;
    finish_status_ = status;
    if (!writing_) WriteNextLocked();
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {  // the stream is broken (cancelled, connection gone): nothing more can be sent
      queue_.clear();
      FinishLocked(finish_requested_ ? finish_status_ : grpc::Status::CANCELLED);
      return;
    }
    WriteNextLocked();
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    bool reclaim = false;
    {
      absl::MutexLock lock(&mu_);
      // A stream the server ended itself (Detach, drain, shutdown) releases nothing more.
      reclaim = !finish_requested_;
      queue_.clear();
      if (!writing_) FinishLocked(grpc::Status::CANCELLED);  // else OnWriteDone(false) does it
    }
    if (!reclaim) return;
    // The worker is gone (or gave up the session): reclaim without waiting for the lease.
    absl::Status status = Guarded("Watch", [&]() -> absl::Status {
      auto released = service_->pool()->Reclaim(session_id_);
      if (released.ok()) {
        KVS_LOG(kInfo, "session_reclaimed")
        ("session", session_id_)("reason", "watch_ended")("sequences", released->sequences)(
            "blocks", released->blocks);
      } else if (released.status().code() != absl::StatusCode::kNotFound) {
        return released.status();
      }
      return absl::OkStatus();
    });
    (void)status;
  }

  void OnDone() override {
    service_->Unregister(session_id_, this);
    // Dropping the last reference destroys `this`: nothing may touch members after this line.
    std::shared_ptr<WatchReactor> keep_alive_until_return = std::move(self_);
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (queue_.empty()) {
      if (finish_requested_) FinishLocked(finish_status_);
      return;
    }
    current_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);  // OnDone is never run inline from Finish for these reactors
  }

  SidecarService* const service_;
  const std::string session_id_;
  std::shared_ptr<WatchReactor> self_;

  absl::Mutex mu_;
  std::deque<v1::SessionEvent> queue_ ABSL_GUARDED_BY(mu_);
  v1::SessionEvent current_ ABSL_GUARDED_BY(mu_);  // the event being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

// ---- Append ------------------------------------------------------------------------------------

// A client stream of segments (header + exactly header.payload_bytes of data). Each segment is
// reserved at its header, written chunk by chunk, and committed when its last byte arrives, so a
// failure in segment k leaves segments < k committed (the error message says so). An open
// segment whose stream fails or is cancelled has its reservation cancelled.
class AppendReactor final : public grpc::ServerReadReactor<v1::AppendChunk> {
 public:
  AppendReactor(KvPool* pool, grpc::CallbackServerContext* context, v1::AppendResponse* response,
                std::optional<std::string> caller_tenant = std::nullopt)
      : pool_(pool), context_(context), response_(response), caller_(std::move(caller_tenant)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    bool finished = false;
    const absl::Status status = Guarded("Append", [&]() -> absl::Status {
      absl::Status step = Step(ok, &finished);
      if (step.ok() || committed_ == 0 || step.code() == absl::StatusCode::kCancelled) {
        return step;
      }
      return absl::Status(
          step.code(), absl::StrCat("segment ", committed_, ": ", step.message(), " (segments 0..",
                                    committed_ - 1, " were committed)"));
    });
    if (!status.ok()) {
      AbandonSegment();
      Finish(ToGrpcStatus(status));
    } else if (finished) {
      Finish(grpc::Status::OK);
    } else {
      StartRead(&chunk_);
    }
  }

  void OnDone() override {
    AbandonSegment();
    delete this;
  }

 private:
  struct Segment {
    std::string session_id;
    std::string sequence_id;
    uint64_t reservation_id = 0;
    uint64_t payload_bytes = 0;
    uint64_t received = 0;
    bool compress_if_over_budget = false;
  };

  absl::Status Step(bool ok, bool* finished) {
    if (!ok) {
      if (context_->IsCancelled()) return absl::CancelledError("Append cancelled by the client");
      if (segment_.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("data: the stream ended inside a segment after ", segment_->received,
                         " of ", segment_->payload_bytes, " payload bytes (header.payload_bytes)"));
      }
      *finished = true;
      return absl::OkStatus();
    }
    switch (chunk_.kind_case()) {
      case v1::AppendChunk::kHeader:
        return BeginSegment(chunk_.header());
      case v1::AppendChunk::kData:
        return AddData(chunk_.data());
      default:
        return absl::InvalidArgumentError("chunk has neither header nor data");
    }
  }

  absl::Status BeginSegment(const v1::AppendHeader& header) {
    if (segment_.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("header: a new header arrived inside a segment after ", segment_->received,
                       " of ", segment_->payload_bytes, " payload bytes"));
    }
    if (committed_ >= kMaxAppendSegments) {
      return absl::InvalidArgumentError(
          absl::StrCat("header: at most ", kMaxAppendSegments,
                       " segments per Append stream; send the rest on a new stream"));
    }
    KVS_RETURN_IF_ERROR(ValidateName(header.session_id(), "header.session_id", true));
    if (caller_.has_value()) {  // tenant isolation (service/auth.h)
      absl::StatusOr<SessionView> owner = pool_->GetSession(header.session_id());
      KVS_RETURN_IF_ERROR(Authenticator::CheckOwner(
          caller_, owner.ok() ? absl::StatusOr<std::string>(owner->tenant) : owner.status(),
          header.session_id()));
    }
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(header.session_id()));
    KVS_RETURN_IF_ERROR(ValidateAppendHeader(header, session.layout,
                                             pool_->options().max_tokens_per_call, "header."));
    KVS_ASSIGN_OR_RETURN(Reservation reservation,
                         pool_->Reserve(header.session_id(), header.sequence_id(),
                                        header.num_tokens(), header.positions(), header.layers()));
    segment_ = Segment{header.session_id(),
                       header.sequence_id(),
                       reservation.reservation_id,
                       reservation.payload_bytes,
                       0,
                       header.compress_if_over_budget()};
    if (reservation.payload_bytes != header.payload_bytes()) {  // the pool disagrees: refuse
      return absl::InvalidArgumentError(absl::StrCat("header.payload_bytes must be ",
                                                     reservation.payload_bytes, ", got ",
                                                     header.payload_bytes()));
    }
    return absl::OkStatus();
  }

  absl::Status AddData(const std::string& data) {
    if (!segment_.has_value()) {
      return absl::InvalidArgumentError(
          committed_ == 0 ? "data: a data chunk arrived before any header"
                          : "data: a data chunk arrived after the segment was complete; start "
                            "the next segment with a header");
    }
    Segment& segment = *segment_;
    const uint64_t left = segment.payload_bytes - segment.received;
    if (data.size() > left) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: a chunk of ", data.size(), " bytes exceeds the ", left,
          " bytes left in the segment (header.payload_bytes = ", segment.payload_bytes, ")"));
    }
    if (!data.empty()) {
      KVS_RETURN_IF_ERROR(pool_->WriteReserved(
          segment.session_id, segment.sequence_id, segment.reservation_id, segment.received,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.data()), data.size())));
      segment.received += data.size();
      response_->set_bytes_received(response_->bytes_received() + data.size());
    }
    if (segment.received < segment.payload_bytes) return absl::OkStatus();
    KVS_ASSIGN_OR_RETURN(CommitResult result,
                         pool_->Commit(segment.session_id, segment.sequence_id,
                                       segment.reservation_id, segment.compress_if_over_budget));
    v1::AppendResponse::Item* item = response_->add_items();
    item->set_sequence_id(segment.sequence_id);
    item->mutable_counts()->Add(result.counts.begin(), result.counts.end());
    item->set_evicted(result.evicted);
    segment_.reset();
    ++committed_;
    return absl::OkStatus();
  }

  // Cancels the open segment's reservation, if any. Never throws.
  void AbandonSegment() noexcept {
    if (!segment_.has_value()) return;
    try {
      absl::Status status = pool_->CancelReservation(segment_->session_id, segment_->sequence_id,
                                                     segment_->reservation_id);
      if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
        LogRpcFailure("Append(cancel reservation)", status);
      }
    } catch (...) {
    }
    segment_.reset();
  }

  KvPool* const pool_;
  grpc::CallbackServerContext* const context_;
  v1::AppendResponse* const response_;
  const std::optional<std::string> caller_;  // tenant of the caller's token; nullopt = open
  v1::AppendChunk chunk_;
  std::optional<Segment> segment_;
  int committed_ = 0;
};

// ---- Export ------------------------------------------------------------------------------------

// Header (layout, per-layer counts and positions, payload size), then the payload in chunks, each
// read at the layout's version so that a sequence changed mid-stream ends it with ABORTED.
class ExportReactor final : public grpc::ServerWriteReactor<v1::ExportChunk> {
 public:
  ExportReactor(KvPool* pool, const v1::ExportRequest& request) : pool_(pool), request_(request) {}

  void Start() {
    const absl::Status status = Guarded("Export", [&] { return Prepare(); });
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartWrite(&message_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "Export stream broken"));
      return;
    }
    if (offset_ == total_) {
      Finish(grpc::Status::OK);
      return;
    }
    const absl::Status status = Guarded("Export", [&] { return NextChunk(); });
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartWrite(&message_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Prepare() {
    KVS_RETURN_IF_ERROR(ValidateName(request_.session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request_.sequence_id(), "sequence_id", true));
    chunk_bytes_ = ClampExportChunkBytes(request_.chunk_bytes());
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request_.session_id()));
    KVS_RETURN_IF_ERROR(ValidateLayers(request_.layers(), session.layout.num_layers, "layers"));
    layers_ = LayersOrAll(request_.layers(), session.layout.num_layers);
    // Size the header from the counts before loading (and copying) every position.
    constexpr uint64_t kHeaderLimit = static_cast<uint64_t>(kMaxMessageBytes) - 4096;
    {
      KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                           pool_->GetLayout(request_.session_id(), request_.sequence_id(), layers_,
                                            /*with_positions=*/false));
      const uint64_t estimate =
          kResponseFixedBytes + LayerLayoutsBytes(counts, session, /*with_positions=*/true);
      if (estimate > kHeaderLimit) {
        return TooLarge("the export header (layout and positions)", estimate, kMaxMessageBytes,
                        "export fewer layers per call (layers)");
      }
    }
    KVS_ASSIGN_OR_RETURN(SequenceLayout layout,
                         pool_->GetLayout(request_.session_id(), request_.sequence_id(), layers_,
                                          /*with_positions=*/true));
    version_ = layout.version;
    v1::ExportHeader* header = message_.mutable_header();
    LayoutToProto(session.layout, header->mutable_layout());
    uint64_t total = 0;
    for (const LayerLayoutView& layer : layout.layers) {
      LayerLayoutToProto(layer, header->add_layers());
      KVS_ASSIGN_OR_RETURN(uint64_t bytes,
                           InlinePayloadBytes(session.layout, 1, layer.count, "payload_bytes"));
      auto sum = CheckedAdd(total, bytes);
      if (!sum) return absl::InternalError("export payload size overflows");
      total = *sum;
    }
    header->set_payload_bytes(total);
    total_ = total;
    const size_t header_bytes = message_.ByteSizeLong();
    if (header_bytes > kHeaderLimit) {  // the sequence grew between the estimate and the read
      return absl::ResourceExhaustedError(absl::StrCat("the export header (", header_bytes,
                                                       " bytes of layout and positions) ",
                                                       "exceeds the ", kMaxMessageBytes,
                                                       "-byte message limit; export fewer "
                                                       "layers per call (layers)"));
    }
    return absl::OkStatus();
  }

  absl::Status NextChunk() {
    const uint64_t n = std::min<uint64_t>(chunk_bytes_, total_ - offset_);
    std::string* data = message_.mutable_data();
    data->resize(n);
    KVS_RETURN_IF_ERROR(
        pool_->ReadExport(request_.session_id(), request_.sequence_id(), layers_, version_, offset_,
                          absl::MakeSpan(reinterpret_cast<uint8_t*>(data->data()), data->size())));
    offset_ += n;
    return absl::OkStatus();
  }

  KvPool* const pool_;
  const v1::ExportRequest request_;
  std::vector<int32_t> layers_;
  uint32_t chunk_bytes_ = kDefaultExportChunkBytes;
  uint64_t version_ = 0;
  uint64_t total_ = 0;
  uint64_t offset_ = 0;
  v1::ExportChunk message_;
};

// ---- SidecarService ----------------------------------------------------------------------------

SidecarService::SidecarService(KvPool* pool, std::string backend_name)
    : pool_(pool), backend_name_(std::move(backend_name)) {}

SidecarService::~SidecarService() = default;

void SidecarService::StartDraining() {
  if (draining_.exchange(true)) return;
  KVS_LOG(kInfo, "draining")("watchers", active_watches());
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) reactor->Send(v1::SessionEvent::KIND_DRAINING);
}

void SidecarService::EndWatch(absl::string_view session_id, const grpc::Status& status) {
  std::shared_ptr<WatchReactor> reactor;
  {
    absl::MutexLock lock(&mu_);
    auto it = watchers_.find(session_id);
    if (it == watchers_.end()) return;
    reactor = it->second;
  }
  reactor->End(status);
}

void SidecarService::EndOrphanWatches() {
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) {
    if (pool_->GetSession(reactor->session_id()).status().code() == absl::StatusCode::kNotFound) {
      reactor->End(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                absl::StrCat("session '", reactor->session_id(),
                                             "' ended: its lease expired or it was released")));
    }
  }
}

void SidecarService::Shutdown() {
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) reactor->End(grpc::Status::OK);
}

int SidecarService::active_watches() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watchers_.size());
}

void SidecarService::Unregister(const std::string& session_id, const WatchReactor* reactor) {
  absl::MutexLock lock(&mu_);
  auto it = watchers_.find(session_id);
  if (it != watchers_.end() && it->second.get() == reactor) watchers_.erase(it);
}

absl::Status SidecarService::CheckSequenceExists(const std::string& session_id,
                                                 const std::string& sequence_id) const {
  const int32_t first_layer[] = {0};
  return pool_->GetLayout(session_id, sequence_id, first_layer, /*with_positions=*/false).status();
}

absl::StatusOr<uint64_t> SidecarService::EstimateCompressResponseBytes(
    const v1::CompressRequest& request, const CompressParams& params) const {
  KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                       pool_->GetLayout(request.session_id(), request.sequence_id(), {},
                                        /*with_positions=*/false));
  KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request.session_id()));
  const uint64_t position_bytes = PositionBytes(counts);
  // Only a uniform split keeps at most the budget in every layer; other allocators (and
  // explicit per-layer budgets, and CAKE's window on top) may keep more in some layers, so
  // there the count is the bound.
  const bool uniform =
      UniformSplit(params.policy.value_or(counts.policy)) && counts.budget.per_layer_tokens.empty();
  uint64_t total = 3 * 11;  // blocks_freed, floor_applied_layers, bytes_copied
  for (const LayerLayoutView& layer : counts.layers) {
    // layer, kept, evicted, merged: none above the count (or the layer index)
    uint64_t body = ScalarBytes(4, std::max(layer.layer, layer.count));
    if (request.return_positions()) {
      // Compression keeps min(count, budget) tokens per head; an unbounded budget keeps all.
      const int32_t budget = request.budget_tokens() > 0 ? request.budget_tokens() : layer.budget;
      const int32_t kept = budget > 0 && uniform ? std::min(layer.count, budget) : layer.count;
      body += PackedBytes(static_cast<uint64_t>(session.layout.num_kv_heads) *
                              static_cast<uint64_t>(std::max(kept, 0)),
                          position_bytes);
    }
    total += EmbeddedBytes(body);
  }
  return total;
}

grpc::ServerUnaryReactor* SidecarService::Attach(grpc::CallbackServerContext* context,
                                                 const v1::AttachRequest* request,
                                                 v1::AttachResponse* response) {
  return RunUnary(context, "Attach", [&]() -> absl::Status {
    std::optional<std::string> caller;  // the token's tenant; nullopt = data plane open
    if (auth_ != nullptr) {
      KVS_ASSIGN_OR_RETURN(caller, auth_->DataTenant(*context));
    }
    if (draining()) {
      return absl::UnavailableError(
          "the sidecar is draining and accepts no new sessions; attach to another instance");
    }
    KVS_ASSIGN_OR_RETURN(AttachParams params, AttachFromProto(*request, pool_->options()));
    // The tenant of the token wins over the request's tenant field.
    if (caller.has_value()) params.tenant = *caller;
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->Attach(params));
    if (session.arena.kind == ArenaHandle::Kind::kMemfd && arena_fd_server_ == nullptr) {
      (void)pool_->Detach(session.session_id);  // a failed Attach leaves no session behind
      return absl::FailedPreconditionError(
          "this sidecar's arenas are memfds but it has no arena socket to hand them out");
    }
    response->set_session_id(session.session_id);
    ArenaHandleToProto(session, response->mutable_arena());
    if (session.arena.kind == ArenaHandle::Kind::kMemfd) {
      // Only this answer, sent to the caller the token authenticated, can fetch the arena.
      response->mutable_arena()->set_fd_socket_path(arena_fd_server_->socket_path());
      response->mutable_arena()->set_fd_nonce(arena_fd_server_->IssueNonce(session.session_id));
    }
    LayoutToProto(session.layout, response->mutable_layout());
    response->set_lease_ms(static_cast<int32_t>(
        std::min<int64_t>(absl::ToInt64Milliseconds(session.lease), INT32_MAX)));
    response->set_backend(backend_name_);
    KVS_LOG(kInfo, "attach")
    ("session", session.session_id)("tenant", params.tenant)("worker", params.worker_name)(
        "blocks", session.num_blocks)("block_bytes", session.block_bytes)("peer", context->peer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Heartbeat(grpc::CallbackServerContext* context,
                                                    const v1::HeartbeatRequest* request,
                                                    v1::HeartbeatResponse* response) {
  return RunUnary(context, "Heartbeat", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_ASSIGN_OR_RETURN(HeartbeatResult beat, pool_->Heartbeat(request->session_id()));
    response->set_lease_expires_unix_ms(UnixMillisOf(beat.lease_expires));
    response->set_free_blocks(beat.free_blocks);
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::SessionEvent>* SidecarService::Watch(
    grpc::CallbackServerContext* context, const v1::WatchRequest* request) {
  std::shared_ptr<WatchReactor> reactor;
  const absl::Status status = Guarded("Watch", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(pool_->GetSession(request->session_id()).status());
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("the sidecar is shutting down");
    if (watchers_.contains(request->session_id())) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", request->session_id(),
                       "' already has a Watch stream; a session has at most one"));
    }
    reactor = std::make_shared<WatchReactor>(this, request->session_id());
    watchers_[request->session_id()] = reactor;
    return absl::OkStatus();
  });
  if (!status.ok()) return new FailedWriteReactor<v1::SessionEvent>(status);
  reactor->Begin(reactor);
  KVS_LOG(kDebug, "watch_started")("session", request->session_id())("peer", context->peer());
  // The session may have been reclaimed between the check and the registration.
  if (!pool_->GetSession(request->session_id()).ok()) {
    reactor->End(grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("session '", request->session_id(), "' ended")));
  }
  return reactor.get();
}

grpc::ServerUnaryReactor* SidecarService::Detach(grpc::CallbackServerContext* context,
                                                 const v1::DetachRequest* request,
                                                 v1::DetachResponse* response) {
  return RunUnary(context, "Detach", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_ASSIGN_OR_RETURN(ReleaseCounts released, pool_->Detach(request->session_id()));
    response->set_sequences_released(released.sequences);
    response->set_blocks_released(released.blocks);
    EndWatch(request->session_id(), grpc::Status::OK);
    KVS_LOG(kInfo, "detach")
    ("session", request->session_id())("sequences", released.sequences)("blocks", released.blocks);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::CreateSequence(grpc::CallbackServerContext* context,
                                                         const v1::CreateSequenceRequest* request,
                                                         v1::CreateSequenceResponse* response) {
  return RunUnary(context, "CreateSequence", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    // budget.per_layer_tokens must give one budget per layer of the session.
    int32_t num_layers = -1;
    if (request->budget().per_layer_tokens_size() > 0) {
      KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
      KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
      num_layers = session.layout.num_layers;
    }
    KVS_ASSIGN_OR_RETURN(
        SequenceParams params,
        SequenceParamsFromProto(*request, pool_->options().max_tokens_per_call, num_layers));
    KVS_ASSIGN_OR_RETURN(SequenceCreated created,
                         pool_->CreateSequence(request->session_id(), params));
    response->set_sequence_id(created.sequence_id);
    PolicyToProto(created.policy, response->mutable_policy());
    BudgetToProto(created.budget, response->mutable_budget());
    if (budget_observer_) budget_observer_(created.policy.name, created.budget.tokens_per_layer);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::ReleaseSequence(grpc::CallbackServerContext* context,
                                                          const v1::ReleaseSequenceRequest* request,
                                                          v1::ReleaseSequenceResponse* response) {
  return RunUnary(context, "ReleaseSequence", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", true));
    KVS_ASSIGN_OR_RETURN(ReleaseCounts released,
                         pool_->ReleaseSequence(request->session_id(), request->sequence_id()));
    response->set_blocks_released(released.blocks);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Reserve(grpc::CallbackServerContext* context,
                                                  const v1::ReserveRequest* request,
                                                  v1::ReserveResponse* response) {
  return RunUnary(context, "Reserve", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateReserveRequest(*request, pool_->options().max_tokens_per_call));
    if (!request->layers().empty()) {
      KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
      KVS_RETURN_IF_ERROR(ValidateLayers(request->layers(), session.layout.num_layers, "layers"));
    }
    KVS_ASSIGN_OR_RETURN(
        Reservation reservation,
        pool_->Reserve(request->session_id(), request->sequence_id(), request->num_tokens(),
                       request->positions(), request->layers()));
    ReservationToProto(reservation, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Commit(grpc::CallbackServerContext* context,
                                                 const v1::CommitRequest* request,
                                                 v1::CommitResponse* response) {
  return RunUnary(context, "Commit", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateCommitRequest(*request));
    std::optional<AttentionInput> attention;
    if (request->has_attention()) {
      KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
      KVS_ASSIGN_OR_RETURN(attention, AttentionFromProto(request->attention(), session.layout));
    }
    KVS_ASSIGN_OR_RETURN(
        CommitResult result,
        pool_->Commit(request->session_id(), request->sequence_id(), request->reservation_id(),
                      request->compress_if_over_budget(),
                      attention.has_value() ? &*attention : nullptr));
    CommitResultToProto(result, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::CancelReservation(
    grpc::CallbackServerContext* context, const v1::CancelReservationRequest* request,
    v1::CancelReservationResponse* response) {
  return RunUnary(context, "CancelReservation", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateCancelReservationRequest(*request));
    return pool_->CancelReservation(request->session_id(), request->sequence_id(),
                                    request->reservation_id());
  });
}

namespace {

absl::Status CheckBatchSize(int size) {
  if (size > kMaxBatchItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("requests has ", size, " items; at most ", kMaxBatchItems, " per call"));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT if (session, sequence) of item `index` already appeared in the batch.
absl::Status CheckNoRepeat(absl::flat_hash_map<std::pair<std::string, std::string>, int>* seen,
                           const std::string& session_id, const std::string& sequence_id, int index,
                           absl::string_view list = "requests") {
  auto [it, inserted] = seen->try_emplace(std::make_pair(session_id, sequence_id), index);
  if (!inserted) {
    return absl::InvalidArgumentError(absl::StrCat(list, "[", index, "].sequence_id '", sequence_id,
                                                   "' repeats ", list, "[", it->second,
                                                   "] (one item per sequence per "
                                                   "batch)"));
  }
  return absl::OkStatus();
}

std::string Item(int index) { return absl::StrCat("requests[", index, "]"); }

}  // namespace

grpc::ServerUnaryReactor* SidecarService::BatchReserve(grpc::CallbackServerContext* context,
                                                       const v1::BatchReserveRequest* request,
                                                       v1::BatchReserveResponse* response) {
  return RunUnary(context, "BatchReserve", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    for (int i = 0; i < n; ++i) {
      const v1::ReserveRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateReserveRequest(item, pool_->options().max_tokens_per_call,
                                                 absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "),
                                     CheckSequenceExists(item.session_id(), item.sequence_id())));
      if (!item.layers().empty()) {
        KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(item.session_id()));
        KVS_RETURN_IF_ERROR(ValidateLayers(item.layers(), session.layout.num_layers,
                                           absl::StrCat(Item(i), ".layers")));
      }
    }
    std::vector<Reservation> made;
    made.reserve(n);
    for (int i = 0; i < n; ++i) {
      const v1::ReserveRequest& item = request->requests(i);
      auto reservation = pool_->Reserve(item.session_id(), item.sequence_id(), item.num_tokens(),
                                        item.positions(), item.layers());
      if (!reservation.ok()) {
        for (int j = 0; j < i; ++j) {
          const v1::ReserveRequest& done = request->requests(j);
          absl::Status undo = pool_->CancelReservation(done.session_id(), done.sequence_id(),
                                                       made[j].reservation_id);
          if (!undo.ok()) LogRpcFailure("BatchReserve(rollback)", undo);
        }
        return WithPrefix(absl::StrCat(Item(i), ": "), reservation.status());
      }
      made.push_back(*std::move(reservation));
    }
    for (const Reservation& reservation : made) {
      ReservationToProto(reservation, response->add_responses());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchCommit(grpc::CallbackServerContext* context,
                                                      const v1::BatchCommitRequest* request,
                                                      v1::BatchCommitResponse* response) {
  return RunUnary(context, "BatchCommit", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    // One validation pass over the request here; the pool then looks each session up once and
    // checks every reservation before committing any (KvPool::CommitBatch).
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    absl::flat_hash_map<std::string, SessionView> layouts;  // of the sessions sending attention
    std::vector<std::optional<AttentionInput>> attention(n);
    std::vector<CommitItem> items(n);
    for (int i = 0; i < n; ++i) {
      const v1::CommitRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateCommitRequest(item, absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      if (item.has_attention()) {
        auto known = layouts.find(item.session_id());
        if (known == layouts.end()) {
          absl::StatusOr<SessionView> session = pool_->GetSession(item.session_id());
          KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
          known = layouts.emplace(item.session_id(), *std::move(session)).first;
        }
        KVS_ASSIGN_OR_RETURN(attention[i],
                             AttentionFromProto(item.attention(), known->second.layout,
                                                absl::StrCat(Item(i), ".attention.")));
      }
      items[i] = CommitItem{item.session_id(), item.sequence_id(), item.reservation_id(),
                            item.compress_if_over_budget(),
                            attention[i].has_value() ? &*attention[i] : nullptr};
    }
    CommitBatchResult done = pool_->CommitBatch(items);
    for (const CommitResult& result : done.results) {
      CommitResultToProto(result, response->add_responses());
    }
    if (done.status.ok()) return absl::OkStatus();
    const int i = done.failed;
    const std::string note =
        done.results.empty()
            ? std::string(" (nothing was committed)")
            : absl::StrCat(" (requests[0..", i - 1, "] were committed; requests[", i, "..", n - 1,
                           "] were not)");
    return absl::Status(done.status.code(),
                        absl::StrCat(Item(i), ": ", done.status.message(), note));
  });
}

grpc::ServerReadReactor<v1::AppendChunk>* SidecarService::Append(
    grpc::CallbackServerContext* context, v1::AppendResponse* response) {
  std::optional<std::string> caller;  // the caller's tenant when the data plane needs tokens
  if (auth_ != nullptr && auth_->data_auth()) {
    absl::StatusOr<std::optional<std::string>> tenant = auth_->DataTenant(*context);
    if (!tenant.ok()) {
      LogRpcFailure("Append", tenant.status());
      return new FailedReadReactor<v1::AppendChunk>(tenant.status());
    }
    caller = *std::move(tenant);
  }
  try {
    return new AppendReactor(pool_, context, response, std::move(caller));
  } catch (...) {  // allocation failure: refuse the call rather than let it escape
    return new FailedReadReactor<v1::AppendChunk>(absl::InternalError("Append: out of memory"));
  }
}

grpc::ServerWriteReactor<v1::ExportChunk>* SidecarService::Export(
    grpc::CallbackServerContext* context, const v1::ExportRequest* request) {
  if (absl::Status auth = Authorize(*context, *request); !auth.ok()) {
    LogRpcFailure("Export", auth);
    return new FailedWriteReactor<v1::ExportChunk>(auth);
  }
  ExportReactor* reactor = nullptr;
  try {
    reactor = new ExportReactor(pool_, *request);
  } catch (...) {  // allocation failure: refuse the call rather than let it escape
    return new FailedWriteReactor<v1::ExportChunk>(absl::InternalError("Export: out of memory"));
  }
  reactor->Start();
  return reactor;
}

grpc::ServerUnaryReactor* SidecarService::GetLayout(grpc::CallbackServerContext* context,
                                                    const v1::GetLayoutRequest* request,
                                                    v1::GetLayoutResponse* response) {
  return RunUnary(context, "GetLayout", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", true));
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
    KVS_RETURN_IF_ERROR(ValidateLayers(request->layers(), session.layout.num_layers, "layers"));
    // Counts and block tables first (cheap); positions only once they are known to fit.
    KVS_ASSIGN_OR_RETURN(SequenceLayout layout,
                         pool_->GetLayout(request->session_id(), request->sequence_id(),
                                          request->layers(), /*with_positions=*/false));
    const bool with_positions = !request->omit_positions();
    const uint64_t estimate =
        kResponseFixedBytes + LayerLayoutsBytes(layout, session, with_positions);
    if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
      return TooLarge("the response", estimate, kMaxMessageBytes, kGetLayoutAdvice);
    }
    if (with_positions) {
      KVS_ASSIGN_OR_RETURN(layout, pool_->GetLayout(request->session_id(), request->sequence_id(),
                                                    request->layers(), /*with_positions=*/true));
    }
    SequenceLayoutToProto(layout, response);
    const size_t bytes = response->ByteSizeLong();
    if (bytes > static_cast<size_t>(kMaxMessageBytes)) {  // grew since the estimate
      response->Clear();
      return TooLarge("the response", bytes, kMaxMessageBytes, kGetLayoutAdvice);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Compress(grpc::CallbackServerContext* context,
                                                   const v1::CompressRequest* request,
                                                   v1::CompressResponse* response) {
  return RunUnary(context, "Compress", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
    KVS_ASSIGN_OR_RETURN(CompressParams params, CompressParamsFromProto(*request, session.layout));
    if (request->return_positions()) {  // refuse before evicting anything
      KVS_ASSIGN_OR_RETURN(uint64_t estimate, EstimateCompressResponseBytes(*request, params));
      if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
        return TooLarge("the response", estimate, kMaxMessageBytes, kCompressAdvice);
      }
    }
    KVS_ASSIGN_OR_RETURN(CompressResult result,
                         pool_->Compress(request->session_id(), request->sequence_id(), params));
    CompressResultToProto(result, response);
    const size_t bytes = response->ByteSizeLong();
    if (bytes > static_cast<size_t>(kMaxMessageBytes)) {  // only if the estimate was wrong
      response->Clear();
      const absl::Status too_large =
          TooLarge("the response", bytes, kMaxMessageBytes, kCompressAdvice);
      return absl::Status(too_large.code(),
                          absl::StrCat(too_large.message(), " (the compression was applied)"));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchCompress(grpc::CallbackServerContext* context,
                                                        const v1::BatchCompressRequest* request,
                                                        v1::BatchCompressResponse* response) {
  return RunUnary(context, "BatchCompress", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    std::vector<CompressParams> params;
    params.reserve(n);
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    uint64_t estimate = 0;  // of the whole response: one message carries every item
    for (int i = 0; i < n; ++i) {
      const v1::CompressRequest& item = request->requests(i);
      const std::string prefix = absl::StrCat(Item(i), ".");
      KVS_RETURN_IF_ERROR(
          ValidateName(item.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
      KVS_RETURN_IF_ERROR(ValidateName(item.sequence_id(), absl::StrCat(prefix, "sequence_id"),
                                       /*required=*/true));
      absl::StatusOr<SessionView> session = pool_->GetSession(item.session_id());
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
      KVS_ASSIGN_OR_RETURN(CompressParams p,
                           CompressParamsFromProto(item, session->layout, prefix));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      // An override policy is resolved now, so that a bad one fails the batch before any item
      // is compressed (the pool would only find out when it reaches the item).
      if (p.policy.has_value()) {
        KVS_RETURN_IF_ERROR(
            WithPrefix(absl::StrCat(Item(i), ": "), ResolvePolicyConfig(*p.policy).status()));
      }
      // Also answers NOT_FOUND for a missing session or sequence.
      absl::StatusOr<uint64_t> item_bytes = EstimateCompressResponseBytes(item, p);
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), item_bytes.status()));
      estimate += EmbeddedBytes(*item_bytes);
      if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
        return TooLarge(absl::StrCat("the response (through ", Item(i), ")"), estimate,
                        kMaxMessageBytes,
                        "split the batch, or set return_positions=false in its items (nothing "
                        "was compressed)");
      }
      params.push_back(std::move(p));
    }
    for (int i = 0; i < n; ++i) {
      const v1::CompressRequest& item = request->requests(i);
      auto result = pool_->Compress(item.session_id(), item.sequence_id(), params[i]);
      if (!result.ok()) {
        std::string note = i == 0 ? std::string(" (nothing was compressed)")
                                  : absl::StrCat(" (requests[0..", i - 1, "] were compressed)");
        return absl::Status(result.status().code(),
                            absl::StrCat(Item(i), ": ", result.status().message(), note));
      }
      CompressResultToProto(*result, response->add_responses());
    }
    const size_t bytes = response->ByteSizeLong();
    if (bytes > static_cast<size_t>(kMaxMessageBytes)) {  // only if the estimate was wrong
      response->Clear();
      const absl::Status too_large =
          TooLarge("the response", bytes, kMaxMessageBytes,
                   "split the batch, or set return_positions=false in its items");
      return absl::Status(too_large.code(),
                          absl::StrCat(too_large.message(), " (every item was compressed)"));
    }
    return absl::OkStatus();
  });
}

namespace {

// The items of a batched per-sequence call (DecodeStep, Select), converted in order with
// `convert` against their session's layout (one GetSession per session): at most
// kMaxBatchItems, each naming a session and a sequence no other item names.
template <typename Item, typename Converted>
absl::StatusOr<std::vector<Converted>> ItemsFromProto(
    const google::protobuf::RepeatedPtrField<Item>& proto_items, const KvPool& pool,
    absl::StatusOr<Converted> (*convert)(const Item&, const ModelLayout&, absl::string_view)) {
  const int n = proto_items.size();
  if (n > kMaxBatchItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("items has ", n, " items; at most ", kMaxBatchItems, " per call"));
  }
  std::vector<Converted> items;
  items.reserve(n);
  absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
  absl::flat_hash_map<std::string, ModelLayout> layouts;
  for (int i = 0; i < n; ++i) {
    const Item& item = proto_items[i];
    const std::string prefix = absl::StrCat("items[", i, "].");
    KVS_RETURN_IF_ERROR(
        ValidateName(item.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
    auto it = layouts.find(item.session_id());
    if (it == layouts.end()) {
      absl::StatusOr<SessionView> session = pool.GetSession(item.session_id());
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat("items[", i, "]: "), session.status()));
      it = layouts.emplace(item.session_id(), session->layout).first;
    }
    KVS_ASSIGN_OR_RETURN(Converted converted, convert(item, it->second, prefix));
    KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i, "items"));
    items.push_back(std::move(converted));
  }
  return items;
}

}  // namespace

grpc::ServerUnaryReactor* SidecarService::DecodeStep(grpc::CallbackServerContext* context,
                                                     const v1::DecodeStepRequest* request,
                                                     v1::DecodeStepResponse* response) {
  return RunUnary(context, "DecodeStep", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_ASSIGN_OR_RETURN(std::vector<DecodeItem> items,
                         ItemsFromProto(request->items(), *pool_, &DecodeItemFromProto));
    // The pool validates every item again (reservations, positions, attention sizes) before it
    // changes anything, and prefixes its errors with "items[i]: ".
    KVS_ASSIGN_OR_RETURN(std::vector<DecodeResult> results, pool_->DecodeStep(items));
    if (results.size() != items.size()) {
      return absl::InternalError(absl::StrCat("DecodeStep: the pool returned ", results.size(),
                                              " results for ", items.size(), " items"));
    }
    for (const DecodeResult& result : results) DecodeResultToProto(result, response->add_items());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Score(grpc::CallbackServerContext* context,
                                                const v1::ScoreRequest* request,
                                                v1::ScoreResponse* response) {
  return RunUnary(context, "Score", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(request->session_id()));
    KVS_ASSIGN_OR_RETURN(ScoreParams params, ScoreParamsFromProto(*request, session.layout));
    // Refuse before scoring: the response holds scores and positions for every held slot.
    KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                         pool_->GetLayout(request->session_id(), request->sequence_id(),
                                          params.layers, /*with_positions=*/false));
    const uint64_t estimate = EstimateScoreResponseBytes(counts, session);
    if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
      return TooLarge("the response", estimate, kMaxMessageBytes, kScoreAdvice);
    }
    KVS_ASSIGN_OR_RETURN(std::vector<LayerScores> layers,
                         pool_->Score(request->session_id(), request->sequence_id(), params));
    for (const LayerScores& layer : layers) LayerScoresToProto(layer, response->add_layers());
    const size_t bytes = response->ByteSizeLong();
    if (bytes > static_cast<size_t>(kMaxMessageBytes)) {  // the sequence grew since the estimate
      response->Clear();
      return TooLarge("the response", bytes, kMaxMessageBytes, kScoreAdvice);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Select(grpc::CallbackServerContext* context,
                                                 const v1::SelectRequest* request,
                                                 v1::SelectResponse* response) {
  return RunUnary(context, "Select", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_ASSIGN_OR_RETURN(std::vector<SelectItem> items,
                         ItemsFromProto(request->items(), *pool_, &SelectItemFromProto));
    KVS_ASSIGN_OR_RETURN(std::vector<SelectResult> results, pool_->Select(items));
    for (const SelectResult& result : results) SelectResultToProto(result, response->add_items());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::GetRetained(grpc::CallbackServerContext* context,
                                                      const v1::GetRetainedRequest* request,
                                                      v1::GetRetainedResponse* response) {
  return RunUnary(context, "GetRetained", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    const std::vector<int32_t> layers(request->layers().begin(), request->layers().end());
    KVS_ASSIGN_OR_RETURN(std::vector<RetainedHead> heads,
                         pool_->GetRetained(request->session_id(), request->sequence_id(), layers));
    uint64_t bytes = 0;
    for (const RetainedHead& head : heads) {
      bytes += 64 + head.keys.size() + head.values.size() + 10 * head.positions.size();
    }
    if (bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
      return TooLarge("the response", bytes, kMaxMessageBytes, "ask for fewer layers");
    }
    for (RetainedHead& head : heads) {
      v1::GetRetainedResponse::Head* out = response->add_heads();
      out->set_layer(head.layer);
      out->set_head(head.head);
      out->mutable_positions()->Add(head.positions.begin(), head.positions.end());
      out->mutable_scores()->Add(head.scores.begin(), head.scores.end());
      out->set_keys(std::move(head.keys));
      out->set_values(std::move(head.values));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Spill(grpc::CallbackServerContext* context,
                                                const v1::SpillRequest* request,
                                                v1::SpillResponse* response) {
  return RunUnary(context, "Spill", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    if (request->target() != v1::TIER_HOST && request->target() != v1::TIER_DISK &&
        request->target() != v1::TIER_REMOTE) {
      return absl::InvalidArgumentError(absl::StrCat("target must be TIER_HOST, TIER_DISK or "
                                                     "TIER_REMOTE, got ",
                                                     v1::Tier_Name(request->target()).empty()
                                                         ? absl::StrCat(request->target())
                                                         : v1::Tier_Name(request->target())));
    }
    KVS_ASSIGN_OR_RETURN(
        SpillResult result,
        pool_->Spill(request->session_id(), request->sequence_id(),
                     static_cast<StorageTier>(request->target())));  // values match v1::Tier
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Restore(grpc::CallbackServerContext* context,
                                                  const v1::RestoreRequest* request,
                                                  v1::RestoreResponse* response) {
  return RunUnary(context, "Restore", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(
        ValidateName(request->from_session_id(), "from_session_id", /*required=*/false));
    std::string from = request->from_session_id();
    if (request->adopt_any_session()) {
      if (!from.empty()) {
        return absl::InvalidArgumentError(
            "adopt_any_session: set either from_session_id or adopt_any_session, not both");
      }
      KVS_ASSIGN_OR_RETURN(from, FindOrphanCopy(request->session_id(), request->sequence_id()));
    }
    KVS_ASSIGN_OR_RETURN(SpillResult result,
                         pool_->Restore(request->session_id(), request->sequence_id(), from));
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    if (!from.empty() && from != request->session_id()) {
      response->set_adopted_from_session_id(from);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Publish(grpc::CallbackServerContext* context,
                                                  const v1::PublishRequest* request,
                                                  v1::PublishResponse* response) {
  return RunUnary(context, "Publish", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_ASSIGN_OR_RETURN(SpillResult result,
                         pool_->Publish(request->session_id(), request->sequence_id(),
                                        request->prefix_key(), request->query_window()));
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Unpublish(grpc::CallbackServerContext* context,
                                                    const v1::UnpublishRequest* request,
                                                    v1::UnpublishResponse* response) {
  (void)response;
  return RunUnary(context, "Unpublish", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    return pool_->Unpublish(request->session_id(), request->prefix_key());
  });
}

absl::StatusOr<std::string> SidecarService::FindOrphanCopy(const std::string& session_id,
                                                           const std::string& sequence_id) const {
  KVS_ASSIGN_OR_RETURN(SessionView session, pool_->GetSession(session_id));
  const SpilledInfo* best = nullptr;
  const std::vector<SpilledInfo> copies = pool_->ListSpilled();
  for (const SpilledInfo& copy : copies) {
    if (copy.key.tenant != session.tenant || copy.key.sequence_id != sequence_id) continue;
    // A copy of an attached session is that session's sequence, not an orphan.
    if (pool_->GetSession(copy.key.session_id).ok()) continue;
    // Intact copies first, then the newest; a lost one is still chosen when it is the only one
    // (Restore then answers DATA_LOSS rather than NOT_FOUND).
    const bool better =
        best == nullptr || (best->lost.empty() != copy.lost.empty() ? copy.lost.empty()
                                                                    : copy.spilled > best->spilled);
    if (better) best = &copy;
  }
  if (best == nullptr) {
    return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ", sequence_id,
                                            " left by an ended session of tenant ",
                                            session.tenant));
  }
  return best->key.session_id;
}

namespace {

// Every session a request names: string fields session_id, at the top level and in repeated
// message fields (batch requests, decode items).
void CollectSessionIds(const google::protobuf::Message& message, int depth,
                       std::vector<std::string>* out) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING && !field->is_repeated() &&
        field->name() == "session_id") {
      std::string value = reflection->GetString(message, field);
      if (!value.empty()) out->push_back(std::move(value));
    } else if (depth == 0 && field->is_repeated() &&
               field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
        CollectSessionIds(reflection->GetRepeatedMessage(message, field, j), depth + 1, out);
      }
    }
  }
}

}  // namespace

absl::Status SidecarService::Authorize(const grpc::CallbackServerContext& context,
                                       const google::protobuf::Message& request) const {
  if (auth_ == nullptr || !auth_->data_auth()) return absl::OkStatus();
  KVS_ASSIGN_OR_RETURN(std::optional<std::string> caller, auth_->DataTenant(context));
  std::vector<std::string> ids;
  CollectSessionIds(request, 0, &ids);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (const std::string& id : ids) {
    absl::StatusOr<SessionView> session = pool_->GetSession(id);
    KVS_RETURN_IF_ERROR(Authenticator::CheckOwner(
        caller, session.ok() ? absl::StatusOr<std::string>(session->tenant) : session.status(),
        id));
  }
  // Restore's from_session_id names an ended session of the caller's tenant (the pool looks the
  // copies up under the caller's tenant). Another tenant's live session gets the answer a
  // missing copy gets, so that it cannot be told apart.
  const google::protobuf::FieldDescriptor* from =
      request.GetDescriptor()->FindFieldByName("from_session_id");
  const google::protobuf::FieldDescriptor* sequence =
      request.GetDescriptor()->FindFieldByName("sequence_id");
  if (from != nullptr && sequence != nullptr &&
      from->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
      sequence->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
    const std::string from_id = request.GetReflection()->GetString(request, from);
    absl::StatusOr<SessionView> source = pool_->GetSession(from_id);
    if (!from_id.empty() && source.ok() && source->tenant != *caller) {
      return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ",
                                              request.GetReflection()->GetString(request, sequence),
                                              " of session ", from_id, " for tenant ", *caller));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvs
