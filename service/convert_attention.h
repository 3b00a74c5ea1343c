// Protobuf -> core conversion of the attention inputs a worker sends with Commit, Compress,
// Score, DecodeStep and Select (queries, query positions, precomputed attention scores).
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_ATTENTION_H_
#define KVSIDECAR_SERVICE_CONVERT_ATTENTION_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "gpu/base/layout.h"
#include "kvsidecar/v1/common.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// ---- Attention inputs ------------------------------------------------------------------------
// A present AttentionInputs message of a session with `layout`; `prefix` e.g. "attention." or
// "items[2].attention.". layers: ValidateLayers; num_queries >= 1; query_positions empty or
// num_queries entries. inline_queries are decoded from queries_dtype (UNSPECIFIED = the session
// dtype) into fp32 after an exact size check (listed layers, or all, * Hq * num_queries * D *
// dtype bytes); staging_offset is UNIMPLEMENTED (CUDA backend only); attention_scores (fp32 little
// endian) must be a whole number of floats; their exact size, the scale and the positions' values
// are checked by the pool, which knows the counts.
absl::StatusOr<AttentionInput> AttentionFromProto(const v1::AttentionInputs& attention,
                                                  const ModelLayout& layout,
                                                  absl::string_view prefix = "attention.");

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_ATTENTION_H_
