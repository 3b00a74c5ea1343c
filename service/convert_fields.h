// Protobuf <-> core conversions of the service edge: the model layout, the field checks every
// request shares (names, token counts, positions, layers, inline payload sizes) and the limits
// they enforce. INVALID_ARGUMENT messages name the field by its full path in the request.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_FIELDS_H_
#define KVSIDECAR_SERVICE_CONVERT_FIELDS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpu/base/layout.h"
#include "kvsidecar/v1/common.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// Longest session id, sequence id, tenant or worker name accepted.
inline constexpr size_t kMaxNameBytes = 256;
inline constexpr uint32_t kMinExportChunkBytes = 64u << 10;
inline constexpr uint32_t kMaxExportChunkBytes = 4u << 20;
inline constexpr uint32_t kDefaultExportChunkBytes = 1u << 20;

// ---- Layout ----------------------------------------------------------------------------------
// `field` is the full field path, e.g. "layout.dtype".
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);
// block_tokens 0 becomes kDefaultBlockTokens; then ModelLayout::Validate with `prefix`.
absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& layout,
                                            absl::string_view prefix = "layout.");
void LayoutToProto(const ModelLayout& layout, v1::ModelLayout* out);

// ---- Field checks ----------------------------------------------------------------------------
// Non-empty (if `required`), at most kMaxNameBytes, no control characters.
absl::Status ValidateName(absl::string_view value, absl::string_view field, bool required);
// session_id and sequence_id, both required (ValidateName), named with `prefix` ("items[2].").
// A handler whose conversion needs the session's layout checks them with this before it looks
// the session up; the conversion then does not check them again.
absl::Status ValidateSequenceIds(absl::string_view session_id, absl::string_view sequence_id,
                                 absl::string_view prefix = "");
// num_tokens in [1, max_tokens].
absl::Status ValidateNumTokens(int32_t num_tokens, int32_t max_tokens, absl::string_view field);
// Empty, or num_tokens entries, each >= 0, strictly increasing. `field` e.g. "positions".
absl::Status ValidatePositions(absl::Span<const int32_t> positions, int32_t num_tokens,
                               absl::string_view field);
// Each in [0, num_layers), no repeats. `field` e.g. "layers".
absl::Status ValidateLayers(absl::Span<const int32_t> layers, int32_t num_layers,
                            absl::string_view field);
// `layers`, or 0..num_layers-1 when empty.
std::vector<int32_t> LayersOrAll(absl::Span<const int32_t> layers, int32_t num_layers);
// Inline payload bytes [layers][2][H][tokens][D] * dtype_bytes; INVALID_ARGUMENT naming `field`
// if it does not fit in 64 bits.
absl::StatusOr<uint64_t> InlinePayloadBytes(const ModelLayout& layout, int64_t num_layers,
                                            int64_t tokens, absl::string_view field);
// 0 -> default; else clamped to [kMinExportChunkBytes, kMaxExportChunkBytes].
uint32_t ClampExportChunkBytes(uint32_t requested);

// ---- Time --------------------------------------------------------------------------------------
int64_t UnixMillisOf(absl::Time time);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_FIELDS_H_
