#include "service/convert_attention.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/base/status_macros.h"
#include "service/convert_fields.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

// ---- Attention inputs ------------------------------------------------------------------------

absl::StatusOr<AttentionInput> AttentionFromProto(const v1::AttentionInputs& attention,
                                                  const ModelLayout& layout,
                                                  absl::string_view prefix) {
  AttentionInput out;
  KVS_RETURN_IF_ERROR(
      ValidateLayers(attention.layers(), layout.num_layers, absl::StrCat(prefix, "layers")));
  out.layers.assign(attention.layers().begin(), attention.layers().end());
  if (attention.num_queries() < 1) {
    return Invalid(
        prefix, "num_queries",
        absl::StrCat("must be >= 1 (the queries of this step), got ", attention.num_queries()));
  }
  out.num_queries = attention.num_queries();
  if (!attention.query_positions().empty() &&
      attention.query_positions_size() != attention.num_queries()) {
    return Invalid(
        prefix, "query_positions",
        absl::StrCat("has ", attention.query_positions_size(), " entries but num_queries is ",
                     attention.num_queries(), " (give one per query, or none)"));
  }
  out.query_positions.assign(attention.query_positions().begin(),
                             attention.query_positions().end());
  out.softmax_scale = attention.softmax_scale();

  DType dtype = layout.dtype;
  if (attention.queries_dtype() != v1::DTYPE_UNSPECIFIED) {
    KVS_ASSIGN_OR_RETURN(
        dtype, DTypeFromProto(attention.queries_dtype(), absl::StrCat(prefix, "queries_dtype")));
  }
  switch (attention.source_case()) {
    case v1::AttentionInputs::kStagingOffset:
      // fp32 [layers][Hq][w][D] in the session's staging area, where the worker wrote them; the
      // sequence checks the range against the area (Sequence::ValidateAttention).
      if (dtype != DType::kFloat32 && attention.queries_dtype() != v1::DTYPE_UNSPECIFIED) {
        return Invalid(prefix, "queries_dtype",
                       "must be DTYPE_FLOAT32 (or unset) for queries in the staging area");
      }
      if (!attention.attention_scores().empty()) {
        return Invalid(prefix, "attention_scores",
                       "and staging_offset are exclusive: give the queries or the scores");
      }
      out.staging_offset = attention.staging_offset();
      return out;
    case v1::AttentionInputs::kInlineQueries: {
      const std::string& bytes = attention.inline_queries();
      const int64_t layers =
          out.layers.empty() ? layout.num_layers : static_cast<int64_t>(out.layers.size());
      const int64_t dtype_bytes = DTypeBytes(dtype);
      const std::optional<uint64_t> expected = CheckedProduct(
          {layers, layout.num_q_heads, out.num_queries, layout.head_dim, dtype_bytes});
      if (!expected || bytes.size() != static_cast<uint64_t>(*expected)) {
        return Invalid(
            prefix, "inline_queries",
            absl::StrCat("has ", bytes.size(), " bytes, expected ",
                         expected ? absl::StrCat(*expected) : std::string("more than 2^63"), " = ",
                         layers, " layers * ", layout.num_q_heads, " q heads * ", out.num_queries,
                         " queries * ", layout.head_dim, " head_dim * ", dtype_bytes, " bytes (",
                         std::string(DTypeName(dtype)), ")"));
      }
      out.queries.resize(static_cast<size_t>(*expected / dtype_bytes));
      if (dtype == DType::kFloat32) {
        std::memcpy(out.queries.data(), bytes.data(), bytes.size());  // little-endian host
      } else {
        for (size_t i = 0; i < out.queries.size(); ++i) {
          uint16_t bits;
          std::memcpy(&bits, bytes.data() + 2 * i, sizeof(bits));
          out.queries[i] = dtype == DType::kFloat16 ? Float16ToFloat(bits) : BFloat16ToFloat(bits);
        }
      }
      break;
    }
    default:
      break;
  }
  const std::string& scores = attention.attention_scores();
  if (scores.size() % sizeof(float) != 0) {
    return Invalid(prefix, "attention_scores",
                   absl::StrCat("has ", scores.size(),
                                " bytes, not a whole number of fp32 values (4 bytes each)"));
  }
  out.scores.resize(scores.size() / sizeof(float));
  if (!scores.empty()) std::memcpy(out.scores.data(), scores.data(), scores.size());
  return out;
}

}  // namespace kvs
