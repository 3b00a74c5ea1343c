// Protobuf <-> core conversions of the data path: Reserve, Commit, CancelReservation, the
// Append header and DecodeStep items, and their results. `prefix` (e.g. "requests[3].") is put
// in front of every field name of a batch item.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_DATA_PATH_H_
#define KVSIDECAR_SERVICE_CONVERT_DATA_PATH_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "gpu/base/layout.h"
#include "kvsidecar/v1/sidecar.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// ---- Requests --------------------------------------------------------------------------------
// Ids, num_tokens, positions. `layers` needs the session layout: ValidateLayers.
absl::Status ValidateReserveRequest(const v1::ReserveRequest& request, int32_t max_tokens_per_call,
                                    absl::string_view prefix = "");
absl::Status ValidateCommitRequest(const v1::CommitRequest& request, absl::string_view prefix = "");
// Ids and reservation_id (non-zero).
absl::Status ValidateCancelReservationRequest(const v1::CancelReservationRequest& request);
// Everything about a header that the session layout decides, payload_bytes included.
absl::Status ValidateAppendHeader(const v1::AppendHeader& header, const ModelLayout& layout,
                                  int32_t max_tokens_per_call,
                                  absl::string_view prefix = "header.");
// One DecodeStep item (`prefix` e.g. "items[3]."), its ids already checked (ValidateSequenceIds,
// before the session whose layout this needs was looked up): attention (absent = none: num_queries
// 0, no queries or scores), whose num_queries must be 1; reservation_id or inline_kv, not both;
// inline_kv exactly [L][2][H][1][D] in the session dtype.
absl::StatusOr<DecodeItem> DecodeItemFromProto(const v1::DecodeStepRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix = "");

// ---- Responses -------------------------------------------------------------------------------
void ReservationToProto(const Reservation& reservation, v1::ReserveResponse* out);
void CommitResultToProto(const CommitResult& result, v1::CommitResponse* out);
void DecodeResultToProto(const DecodeResult& result, v1::DecodeStepResponse::Item* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_DATA_PATH_H_
