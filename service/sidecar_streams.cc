// SidecarService, the streaming data path: Append (segments reserved, written and committed in
// turn) and Export (a header, then the payload in chunks read at the layout's version).
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
#include "service/internal/failed_reactors.h"
#include "service/internal/response_size.h"
#include "service/internal/session_lookups.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::FailedReadReactor;
using service_internal::FailedWriteReactor;
using service_internal::kResponseFixedBytes;
using service_internal::LayerLayoutsBytes;
using service_internal::TooLarge;

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
    // The session as the header's lookup found it; a weak handle, so that a session that ends
    // while a slow client is mid-segment frees its arena at once, and each chunk, the commit
    // and the cancel answer NOT_FOUND as a lookup by id would.
    WeakSessionRef session;
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
    // One lookup serves the owner check, the header's validation and the reservation.
    absl::StatusOr<SessionRef> session = pool_->FindSession(header.session_id());
    if (caller_.has_value()) {  // tenant isolation (service/auth.h)
      KVS_RETURN_IF_ERROR(Authenticator::CheckOwner(
          caller_, session.ok() ? absl::StatusOr<std::string>(session->tenant()) : session.status(),
          header.session_id()));
    }
    KVS_RETURN_IF_ERROR(session.status());
    KVS_RETURN_IF_ERROR(ValidateAppendHeader(header, session->layout(),
                                             pool_->options().max_tokens_per_call, "header."));
    KVS_ASSIGN_OR_RETURN(Reservation reservation,
                         pool_->Reserve(*session, header.sequence_id(), header.num_tokens(),
                                        header.positions(), header.layers()));
    segment_ = Segment{WeakSessionRef(*session),
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
      KVS_ASSIGN_OR_RETURN(SessionRef session, segment.session.Lock());
      KVS_RETURN_IF_ERROR(pool_->WriteReserved(
          session, segment.sequence_id, segment.reservation_id, segment.received,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.data()), data.size())));
      segment.received += data.size();
      response_->set_bytes_received(response_->bytes_received() + data.size());
    }
    if (segment.received < segment.payload_bytes) return absl::OkStatus();
    KVS_ASSIGN_OR_RETURN(SessionRef session, segment.session.Lock());
    KVS_ASSIGN_OR_RETURN(CommitResult result,
                         pool_->Commit(session, segment.sequence_id, segment.reservation_id,
                                       segment.compress_if_over_budget));
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
      absl::StatusOr<SessionRef> session = segment_->session.Lock();
      absl::Status status = session.ok() ? pool_->CancelReservation(*session, segment_->sequence_id,
                                                                    segment_->reservation_id)
                                         : session.status();
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

  // `sessions`: the export's session as the tenant check found it (or not yet looked up).
  void Start(service_internal::SessionLookups& sessions) {
    const absl::Status status = Guarded("Export", [&] { return Prepare(sessions); });
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
  absl::Status Prepare(service_internal::SessionLookups& sessions) {
    KVS_RETURN_IF_ERROR(ValidateName(request_.session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request_.sequence_id(), "sequence_id", true));
    chunk_bytes_ = ClampExportChunkBytes(request_.chunk_bytes());
    // One lookup serves the tenant check, the layer check, both layout reads and every chunk.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request_.session_id()));
    session_.emplace(session);
    const ModelLayout& model = session.layout();
    KVS_RETURN_IF_ERROR(ValidateLayers(request_.layers(), model.num_layers, "layers"));
    layers_ = LayersOrAll(request_.layers(), model.num_layers);
    // Size the header from the counts before loading (and copying) every position.
    constexpr uint64_t kHeaderLimit = static_cast<uint64_t>(kMaxMessageBytes) - 4096;
    {
      KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                           pool_->GetLayout(session, request_.sequence_id(), layers_,
                                            /*with_positions=*/false));
      const uint64_t estimate =
          kResponseFixedBytes + LayerLayoutsBytes(counts, session, /*with_positions=*/true);
      if (estimate > kHeaderLimit) {
        return TooLarge("the export header (layout and positions)", estimate, kMaxMessageBytes,
                        "export fewer layers per call (layers)");
      }
    }
    KVS_ASSIGN_OR_RETURN(SequenceLayout layout,
                         pool_->GetLayout(session, request_.sequence_id(), layers_,
                                          /*with_positions=*/true));
    version_ = layout.version;
    v1::ExportHeader* header = message_.mutable_header();
    LayoutToProto(model, header->mutable_layout());
    uint64_t total = 0;
    for (const LayerLayoutView& layer : layout.layers) {
      LayerLayoutToProto(layer, header->add_layers());
      KVS_ASSIGN_OR_RETURN(uint64_t bytes,
                           InlinePayloadBytes(model, 1, layer.count, "payload_bytes"));
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
    // Prepare succeeded, so the handle is set. A session that ended since answers NOT_FOUND.
    KVS_ASSIGN_OR_RETURN(SessionRef session, session_->Lock());
    KVS_RETURN_IF_ERROR(
        pool_->ReadExport(session, request_.sequence_id(), layers_, version_, offset_,
                          absl::MakeSpan(reinterpret_cast<uint8_t*>(data->data()), data->size())));
    offset_ += n;
    return absl::OkStatus();
  }

  KvPool* const pool_;
  const v1::ExportRequest request_;
  // Weak: a session that ends mid-stream frees its arena at once, whatever the client does.
  std::optional<WeakSessionRef> session_;
  std::vector<int32_t> layers_;
  uint32_t chunk_bytes_ = kDefaultExportChunkBytes;
  uint64_t version_ = 0;
  uint64_t total_ = 0;
  uint64_t offset_ = 0;
  v1::ExportChunk message_;
};

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
  service_internal::SessionLookups sessions(*pool_);
  if (absl::Status auth = Authorize(*context, *request, sessions); !auth.ok()) {
    LogRpcFailure("Export", auth);
    return new FailedWriteReactor<v1::ExportChunk>(auth);
  }
  ExportReactor* reactor = nullptr;
  try {
    reactor = new ExportReactor(pool_, *request);
  } catch (...) {  // allocation failure: refuse the call rather than let it escape
    return new FailedWriteReactor<v1::ExportChunk>(absl::InternalError("Export: out of memory"));
  }
  reactor->Start(sessions);
  return reactor;
}

}  // namespace kvs
