#include "gpu/base/layout.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"

namespace kvs {
namespace {

absl::Status OutOfRange(const char* prefix, const char* field, int64_t value, int64_t lo,
                        int64_t hi) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, field, " must be in [", lo, ", ", hi,
                                                 "], got ", value));
}

}  // namespace

absl::Status ModelLayout::Validate(const char* prefix) const {
  if (num_layers < 1 || num_layers > kMaxLayers) {
    return OutOfRange(prefix, "num_layers", num_layers, 1, kMaxLayers);
  }
  if (num_kv_heads < 1 || num_kv_heads > kMaxHeads) {
    return OutOfRange(prefix, "num_kv_heads", num_kv_heads, 1, kMaxHeads);
  }
  if (num_q_heads < 1 || num_q_heads > kMaxHeads) {
    return OutOfRange(prefix, "num_q_heads", num_q_heads, 1, kMaxHeads);
  }
  if (num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "num_q_heads (", num_q_heads,
                                                   ") must be a multiple of num_kv_heads (",
                                                   num_kv_heads, ")"));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    return OutOfRange(prefix, "head_dim", head_dim, 1, kMaxHeadDim);
  }
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16 && dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "dtype is not a supported dtype"));
  }
  if (block_tokens < 1 || block_tokens > kMaxBlockTokens) {
    return OutOfRange(prefix, "block_tokens", block_tokens, 1, kMaxBlockTokens);
  }
  auto bytes = CheckedProduct({2, num_kv_heads, block_tokens, head_dim, dtype_bytes()});
  if (!bytes || *bytes > kMaxBlockBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "block too large: 2 * num_kv_heads * block_tokens * head_dim * ",
                     "dtype_bytes exceeds ", kMaxBlockBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace kvs
