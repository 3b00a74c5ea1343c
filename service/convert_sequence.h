// Protobuf <-> core conversions of the sequence lifecycle: CreateSequence's parameters, a
// sequence's layout (GetLayout, the Export header) and the sequence listing of the Admin
// service.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_SEQUENCE_H_
#define KVSIDECAR_SERVICE_CONVERT_SEQUENCE_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "kvsidecar/v1/admin.pb.h"
#include "kvsidecar/v1/sidecar.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// ---- Requests --------------------------------------------------------------------------------
// `num_layers`: the session's, for budget.per_layer_tokens (< 0 = unknown, size not checked).
absl::StatusOr<SequenceParams> SequenceParamsFromProto(const v1::CreateSequenceRequest& request,
                                                       int32_t max_tokens_per_call,
                                                       int32_t num_layers = -1);

// ---- Responses -------------------------------------------------------------------------------
void LayerLayoutToProto(const LayerLayoutView& layer, v1::LayerLayout* out);
void SequenceLayoutToProto(const SequenceLayout& layout, v1::GetLayoutResponse* out);
void SequenceInfoToProto(const SequenceInfo& info, v1::SequenceInfo* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_SEQUENCE_H_
