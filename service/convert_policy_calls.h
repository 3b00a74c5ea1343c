// Protobuf <-> core conversions of the policy calls: Compress, Score and Select (OmniKV), and
// their results. `prefix` (e.g. "items[3].") is put in front of every field name of a batch
// item. The conversions need the session's layout, so the caller has checked the ids
// (ValidateSequenceIds) before it looked the session up; they are not checked again here.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_POLICY_CALLS_H_
#define KVSIDECAR_SERVICE_CONVERT_POLICY_CALLS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "gpu/base/layout.h"
#include "kvsidecar/v1/sidecar.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// ---- Requests --------------------------------------------------------------------------------
// Every field but the ids; `layout` is the session's (for the attention inputs).
absl::StatusOr<CompressParams> CompressParamsFromProto(const v1::CompressRequest& request,
                                                       const ModelLayout& layout,
                                                       absl::string_view prefix = "");
// One Select item (`prefix` e.g. "items[3]."): attention required (queries; the pool checks
// the layers against the policy's filter layers); prompt_tokens >= 0.
absl::StatusOr<SelectItem> SelectItemFromProto(const v1::SelectRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix = "");
void SelectResultToProto(const SelectResult& result, v1::SelectResponse::Item* out);
// budget_tokens in [0, kMaxBudgetTokens], policy, attention, layers (ValidateLayers).
absl::StatusOr<ScoreParams> ScoreParamsFromProto(const v1::ScoreRequest& request,
                                                 const ModelLayout& layout);

// ---- Responses -------------------------------------------------------------------------------
void CompressResultToProto(const CompressResult& result, v1::CompressResponse* out);
void LayerScoresToProto(const LayerScores& scores, v1::ScoreResponse::LayerScores* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_POLICY_CALLS_H_
