// SidecarService, the policy calls: Compress, BatchCompress, Score, Select (OmniKV) and
// GetRetained.
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
#include "service/internal/batch_items.h"
#include "service/internal/response_size.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::CheckBatchSize;
using service_internal::CheckNoRepeat;
using service_internal::EmbeddedBytes;
using service_internal::EstimateScoreResponseBytes;
using service_internal::Item;
using service_internal::ItemsFromProto;
using service_internal::kCompressAdvice;
using service_internal::kScoreAdvice;
using service_internal::PackedBytes;
using service_internal::PositionBytes;
using service_internal::ScalarBytes;
using service_internal::SessionLookups;
using service_internal::TooLarge;
using service_internal::UniformSplit;

absl::StatusOr<uint64_t> SidecarService::EstimateCompressResponseBytes(
    const v1::CompressRequest& request, const CompressParams& params,
    const SessionRef& session) const {
  KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                       pool_->GetLayout(session, request.sequence_id(), {},
                                        /*with_positions=*/false));
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
      body += PackedBytes(static_cast<uint64_t>(session.layout().num_kv_heads) *
                              static_cast<uint64_t>(std::max(kept, 0)),
                          position_bytes);
    }
    total += EmbeddedBytes(body);
  }
  return total;
}

grpc::ServerUnaryReactor* SidecarService::Compress(grpc::CallbackServerContext* context,
                                                   const v1::CompressRequest* request,
                                                   v1::CompressResponse* response) {
  return RunUnary(context, "Compress", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateSequenceIds(request->session_id(), request->sequence_id()));
    // One lookup serves the tenant check, the parameters' validation, the size estimate and the
    // compression.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_ASSIGN_OR_RETURN(CompressParams params, CompressParamsFromProto(*request, session.layout()));
    if (request->return_positions()) {  // refuse before evicting anything
      KVS_ASSIGN_OR_RETURN(uint64_t estimate,
                           EstimateCompressResponseBytes(*request, params, session));
      if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
        return TooLarge("the response", estimate, kMaxMessageBytes, kCompressAdvice);
      }
    }
    KVS_ASSIGN_OR_RETURN(CompressResult result,
                         pool_->Compress(session, request->sequence_id(), params));
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
    SessionLookups lookups(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, lookups));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    std::vector<CompressParams> params;
    params.reserve(n);
    std::vector<SessionRef> sessions;  // per item, looked up once for its checks and its run
    sessions.reserve(n);
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    uint64_t estimate = 0;  // of the whole response: one message carries every item
    for (int i = 0; i < n; ++i) {
      const v1::CompressRequest& item = request->requests(i);
      const std::string prefix = absl::StrCat(Item(i), ".");
      KVS_RETURN_IF_ERROR(ValidateSequenceIds(item.session_id(), item.sequence_id(), prefix));
      absl::StatusOr<SessionRef> session = lookups.Find(item.session_id());
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
      KVS_ASSIGN_OR_RETURN(CompressParams p,
                           CompressParamsFromProto(item, session->layout(), prefix));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      // An override policy is resolved now, so that a bad one fails the batch before any item
      // is compressed (the pool would only find out when it reaches the item).
      if (p.policy.has_value()) {
        KVS_RETURN_IF_ERROR(
            WithPrefix(absl::StrCat(Item(i), ": "), ResolvePolicyConfig(*p.policy).status()));
      }
      // Also answers NOT_FOUND for a missing session or sequence.
      absl::StatusOr<uint64_t> item_bytes = EstimateCompressResponseBytes(item, p, *session);
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), item_bytes.status()));
      estimate += EmbeddedBytes(*item_bytes);
      if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
        return TooLarge(absl::StrCat("the response (through ", Item(i), ")"), estimate,
                        kMaxMessageBytes,
                        "split the batch, or set return_positions=false in its items (nothing "
                        "was compressed)");
      }
      params.push_back(std::move(p));
      sessions.push_back(*std::move(session));
    }
    for (int i = 0; i < n; ++i) {
      const v1::CompressRequest& item = request->requests(i);
      auto result = pool_->Compress(sessions[i], item.sequence_id(), params[i]);
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

grpc::ServerUnaryReactor* SidecarService::Score(grpc::CallbackServerContext* context,
                                                const v1::ScoreRequest* request,
                                                v1::ScoreResponse* response) {
  return RunUnary(context, "Score", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateSequenceIds(request->session_id(), request->sequence_id()));
    // One lookup serves the tenant check, the parameters' validation, the size estimate and the
    // scoring.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_ASSIGN_OR_RETURN(ScoreParams params, ScoreParamsFromProto(*request, session.layout()));
    // Refuse before scoring: the response holds scores and positions for every held slot.
    KVS_ASSIGN_OR_RETURN(SequenceLayout counts,
                         pool_->GetLayout(session, request->sequence_id(), params.layers,
                                          /*with_positions=*/false));
    const uint64_t estimate = EstimateScoreResponseBytes(counts, session.layout());
    if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
      return TooLarge("the response", estimate, kMaxMessageBytes, kScoreAdvice);
    }
    KVS_ASSIGN_OR_RETURN(std::vector<LayerScores> layers,
                         pool_->Score(session, request->sequence_id(), params));
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
    SessionLookups sessions(*pool_);  // looked up once here; the pool uses them as they are
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_ASSIGN_OR_RETURN(std::vector<SelectItem> items,
                         ItemsFromProto(request->items(), sessions, &SelectItemFromProto));
    KVS_ASSIGN_OR_RETURN(std::vector<SelectResult> results, pool_->Select(items, sessions.found()));
    for (const SelectResult& result : results) SelectResultToProto(result, response->add_items());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::GetRetained(grpc::CallbackServerContext* context,
                                                      const v1::GetRetainedRequest* request,
                                                      v1::GetRetainedResponse* response) {
  return RunUnary(context, "GetRetained", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    const std::vector<int32_t> layers(request->layers().begin(), request->layers().end());
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_ASSIGN_OR_RETURN(std::vector<RetainedHead> heads,
                         pool_->GetRetained(session, request->sequence_id(), layers));
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

}  // namespace kvs
