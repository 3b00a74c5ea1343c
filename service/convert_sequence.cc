#include "service/convert_sequence.h"

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "service/convert_fields.h"
#include "service/convert_policy.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

absl::StatusOr<SequenceParams> SequenceParamsFromProto(const v1::CreateSequenceRequest& request,
                                                       int32_t max_tokens_per_call,
                                                       int32_t num_layers) {
  KVS_RETURN_IF_ERROR(ValidateName(request.session_id(), "session_id", /*required=*/true));
  KVS_RETURN_IF_ERROR(ValidateName(request.sequence_id(), "sequence_id", /*required=*/false));
  SequenceParams out;
  out.sequence_id = request.sequence_id();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy, PolicyFromProto(request.policy(), "policy."));
  }
  if (request.has_budget()) {
    KVS_ASSIGN_OR_RETURN(
        out.budget, BudgetFromProto(request.budget(), max_tokens_per_call, "budget.", num_layers));
  }
  out.retain_evicted = request.retain_evicted();
  out.layer_windows.assign(request.layer_windows().begin(), request.layer_windows().end());
  out.from_prefix = request.from_prefix();
  return out;
}

void LayerLayoutToProto(const LayerLayoutView& layer, v1::LayerLayout* out) {
  out->set_layer(layer.layer);
  out->set_count(layer.count);
  out->mutable_block_table()->Add(layer.block_table.begin(), layer.block_table.end());
  out->mutable_positions()->Add(layer.positions.begin(), layer.positions.end());
  out->set_budget(layer.budget);
  out->set_window(layer.window);
}

void SequenceLayoutToProto(const SequenceLayout& layout, v1::GetLayoutResponse* out) {
  for (const LayerLayoutView& layer : layout.layers) LayerLayoutToProto(layer, out->add_layers());
  out->set_next_position(layout.next_position);
  out->set_tokens_appended(layout.tokens_appended);
  out->set_tier(v1::TIER_ARENA);
  PolicyToProto(layout.policy, out->mutable_policy());
  BudgetToProto(layout.budget, out->mutable_budget());
}

void SequenceInfoToProto(const SequenceInfo& info, v1::SequenceInfo* out) {
  out->set_session_id(info.session_id);
  out->set_sequence_id(info.sequence_id);
  out->set_tenant(info.tenant);
  PolicyToProto(info.policy, out->mutable_policy());
  BudgetToProto(info.budget, out->mutable_budget());
  out->mutable_tokens_per_layer()->Add(info.tokens_per_layer.begin(), info.tokens_per_layer.end());
  out->set_arena_bytes(info.arena_bytes);
  out->set_host_bytes(info.host_bytes);
  out->set_disk_bytes(info.disk_bytes);
  out->set_tier(static_cast<v1::Tier>(info.tier));  // StorageTier values match v1::Tier
  out->set_created_unix_ms(UnixMillisOf(info.created));
  out->set_last_used_unix_ms(UnixMillisOf(info.last_used));
}

}  // namespace kvs
