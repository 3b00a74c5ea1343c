#include "service/convert_fields.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/base/status_macros.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

// ---- Layout ----------------------------------------------------------------------------------

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be set (DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT32)"));
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", static_cast<int>(dtype),
                   " (expected DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT32)"));
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& layout,
                                            absl::string_view prefix) {
  ModelLayout out;
  out.num_layers = layout.num_layers();
  out.num_kv_heads = layout.num_kv_heads();
  out.num_q_heads = layout.num_q_heads();
  out.head_dim = layout.head_dim();
  out.block_tokens = layout.block_tokens() == 0 ? kDefaultBlockTokens : layout.block_tokens();
  // Shape first, so the message names the first bad field in declaration order; the dtype is
  // checked before Validate() because Validate() needs a real dtype.
  const std::string prefix_str(prefix);
  ModelLayout shape_only = out;
  shape_only.dtype = DType::kFloat16;
  KVS_RETURN_IF_ERROR(shape_only.Validate(prefix_str.c_str()));
  KVS_ASSIGN_OR_RETURN(out.dtype, DTypeFromProto(layout.dtype(), absl::StrCat(prefix, "dtype")));
  KVS_RETURN_IF_ERROR(out.Validate(prefix_str.c_str()));
  return out;
}

void LayoutToProto(const ModelLayout& layout, v1::ModelLayout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_num_q_heads(layout.num_q_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(DTypeToProto(layout.dtype));
  out->set_block_tokens(layout.block_tokens);
}

// ---- Field checks ----------------------------------------------------------------------------

absl::Status ValidateName(absl::string_view value, absl::string_view field, bool required) {
  if (value.empty()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(field, " must not be empty"));
    return absl::OkStatus();
  }
  if (value.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value.size(), " bytes long; at most ", kMaxNameBytes));
  }
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " contains a control character (byte ", static_cast<int>(u), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSequenceIds(absl::string_view session_id, absl::string_view sequence_id,
                                 absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(session_id, absl::StrCat(prefix, "session_id"), /*required=*/true));
  return ValidateName(sequence_id, absl::StrCat(prefix, "sequence_id"), /*required=*/true);
}

absl::Status ValidateNumTokens(int32_t num_tokens, int32_t max_tokens, absl::string_view field) {
  if (num_tokens < 1 || num_tokens > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [1, ", max_tokens, "], got ", num_tokens));
  }
  return absl::OkStatus();
}

absl::Status ValidatePositions(absl::Span<const int32_t> positions, int32_t num_tokens,
                               absl::string_view field) {
  if (positions.empty()) return absl::OkStatus();
  if (positions.size() != static_cast<size_t>(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", positions.size(),
                                                   " entries but num_tokens is ", num_tokens,
                                                   " (give one per token, or none)"));
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] must be >= 0, got ", positions[i]));
    }
    if (i > 0 && positions[i] <= positions[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] (", positions[i],
                                                     ") must be greater than ", field, "[", i - 1,
                                                     "] (", positions[i - 1], ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayers(absl::Span<const int32_t> layers, int32_t num_layers,
                            absl::string_view field) {
  std::vector<int32_t> seen_at(static_cast<size_t>(std::max(num_layers, 0)), -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int32_t layer = layers[i];
    if (layer < 0 || layer >= num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] = ", layer, " is out of range [0, ", num_layers, ")"));
    }
    if (seen_at[layer] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] repeats layer ", layer,
                                                     " (already ", field, "[", seen_at[layer],
                                                     "])"));
    }
    seen_at[layer] = static_cast<int32_t>(i);
  }
  return absl::OkStatus();
}

std::vector<int32_t> LayersOrAll(absl::Span<const int32_t> layers, int32_t num_layers) {
  if (!layers.empty()) return std::vector<int32_t>(layers.begin(), layers.end());
  std::vector<int32_t> all(static_cast<size_t>(std::max(num_layers, 0)));
  for (int32_t i = 0; i < num_layers; ++i) all[i] = i;
  return all;
}

absl::StatusOr<uint64_t> InlinePayloadBytes(const ModelLayout& layout, int64_t num_layers,
                                            int64_t tokens, absl::string_view field) {
  auto bytes = CheckedProduct(
      {num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim, layout.dtype_bytes()});
  if (!bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": payload size overflows"));
  }
  return *bytes;
}

uint32_t ClampExportChunkBytes(uint32_t requested) {
  if (requested == 0) return kDefaultExportChunkBytes;
  return std::clamp(requested, kMinExportChunkBytes, kMaxExportChunkBytes);
}

// ---- Time --------------------------------------------------------------------------------------

int64_t UnixMillisOf(absl::Time time) {
  if (time == absl::InfiniteFuture()) return std::numeric_limits<int64_t>::max();
  if (time == absl::InfinitePast()) return std::numeric_limits<int64_t>::min();
  return absl::ToUnixMillis(time);
}

}  // namespace kvs
