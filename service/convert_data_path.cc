#include "service/convert_data_path.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "service/convert_attention.h"
#include "service/convert_fields.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

absl::Status ValidateReserveRequest(const v1::ReserveRequest& request, int32_t max_tokens_per_call,
                                    absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(request.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(request.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateNumTokens(request.num_tokens(), max_tokens_per_call,
                                        absl::StrCat(prefix, "num_tokens")));
  return ValidatePositions(request.positions(), request.num_tokens(),
                           absl::StrCat(prefix, "positions"));
}

namespace {

absl::Status ValidateReservationRef(absl::string_view session_id, absl::string_view sequence_id,
                                    uint64_t reservation_id, absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(session_id, absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(sequence_id, absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  if (reservation_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "reservation_id must be set (the id Reserve returned)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCommitRequest(const v1::CommitRequest& request, absl::string_view prefix) {
  return ValidateReservationRef(request.session_id(), request.sequence_id(),
                                request.reservation_id(), prefix);
}

absl::Status ValidateCancelReservationRequest(const v1::CancelReservationRequest& request) {
  return ValidateReservationRef(request.session_id(), request.sequence_id(),
                                request.reservation_id(), "");
}

absl::Status ValidateAppendHeader(const v1::AppendHeader& header, const ModelLayout& layout,
                                  int32_t max_tokens_per_call, absl::string_view prefix) {
  KVS_RETURN_IF_ERROR(
      ValidateName(header.session_id(), absl::StrCat(prefix, "session_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(
      ValidateName(header.sequence_id(), absl::StrCat(prefix, "sequence_id"), /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateNumTokens(header.num_tokens(), max_tokens_per_call,
                                        absl::StrCat(prefix, "num_tokens")));
  KVS_RETURN_IF_ERROR(ValidatePositions(header.positions(), header.num_tokens(),
                                        absl::StrCat(prefix, "positions")));
  KVS_RETURN_IF_ERROR(
      ValidateLayers(header.layers(), layout.num_layers, absl::StrCat(prefix, "layers")));
  const int64_t num_layers = header.layers().empty() ? layout.num_layers : header.layers_size();
  const std::string field = absl::StrCat(prefix, "payload_bytes");
  KVS_ASSIGN_OR_RETURN(uint64_t expected,
                       InlinePayloadBytes(layout, num_layers, header.num_tokens(), field));
  if (header.payload_bytes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be ", expected, " (", num_layers, " layers * 2 * ", layout.num_kv_heads,
        " kv heads * ", header.num_tokens(), " tokens * ", layout.head_dim, " head_dim * ",
        layout.dtype_bytes(), " bytes), got ", header.payload_bytes()));
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeItem> DecodeItemFromProto(const v1::DecodeStepRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix) {
  DecodeItem out;
  out.session_id = item.session_id();
  out.sequence_id = item.sequence_id();
  if (item.has_attention()) {
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(item.attention(), layout,
                                                           absl::StrCat(prefix, "attention.")));
    if (out.attention.num_queries != 1) {
      return Invalid(prefix, "attention.num_queries",
                     absl::StrCat("must be 1 in a decode step (the new token's query), got ",
                                  out.attention.num_queries));
    }
  }
  if (item.reservation_id() != 0 && !item.inline_kv().empty()) {
    return Invalid(prefix, "inline_kv",
                   absl::StrCat("is set together with ", prefix,
                                "reservation_id; give the new token's K/V one way (or neither "
                                "if it is already committed)"));
  }
  out.reservation_id = item.reservation_id();
  if (!item.inline_kv().empty()) {
    const std::string field = absl::StrCat(prefix, "inline_kv");
    KVS_ASSIGN_OR_RETURN(uint64_t expected,
                         InlinePayloadBytes(layout, layout.num_layers, 1, field));
    if (item.inline_kv().size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has ", item.inline_kv().size(), " bytes, expected ", expected, " = ",
          layout.num_layers, " layers * 2 * ", layout.num_kv_heads, " kv heads * 1 token * ",
          layout.head_dim, " head_dim * ", layout.dtype_bytes(), " bytes"));
    }
    const auto* bytes = reinterpret_cast<const uint8_t*>(item.inline_kv().data());
    out.inline_kv.assign(bytes, bytes + item.inline_kv().size());
  }
  return out;
}

void ReservationToProto(const Reservation& reservation, v1::ReserveResponse* out) {
  out->set_reservation_id(reservation.reservation_id);
  for (const LayerSlots& layer : reservation.layers) {
    v1::LayerSlots* slots = out->add_layers();
    slots->set_layer(layer.layer);
    slots->set_first_slot(layer.first_slot);
    slots->mutable_blocks()->Add(layer.blocks.begin(), layer.blocks.end());
  }
  out->mutable_positions()->Add(reservation.positions.begin(), reservation.positions.end());
  out->set_evicted_before(reservation.evicted_before);
}

void CommitResultToProto(const CommitResult& result, v1::CommitResponse* out) {
  out->mutable_counts()->Add(result.counts.begin(), result.counts.end());
  out->set_evicted(result.evicted);
}

void DecodeResultToProto(const DecodeResult& result, v1::DecodeStepResponse::Item* out) {
  out->mutable_counts()->Add(result.counts.begin(), result.counts.end());
  out->mutable_evicted_positions()->Add(result.evicted_positions.begin(),
                                        result.evicted_positions.end());
  out->set_merged(result.merged);
  out->set_position(result.position);
}

}  // namespace kvs
