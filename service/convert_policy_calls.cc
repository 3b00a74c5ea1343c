#include "service/convert_policy_calls.h"

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "service/convert_attention.h"
#include "service/convert_fields.h"
#include "service/convert_policy.h"
#include "service/convert_sequence.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

absl::StatusOr<CompressParams> CompressParamsFromProto(const v1::CompressRequest& request,
                                                       const ModelLayout& layout,
                                                       absl::string_view prefix) {
  if (request.budget_tokens() < 0 || request.budget_tokens() > kMaxBudgetTokens) {
    return Invalid(prefix, "budget_tokens",
                   absl::StrCat("must be in [0, ", kMaxBudgetTokens,
                                "] (unset = the sequence's budget), got ", request.budget_tokens()));
  }
  CompressParams out;
  out.budget_tokens = request.budget_tokens();
  out.return_positions = request.return_positions();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy,
                         PolicyFromProto(request.policy(), absl::StrCat(prefix, "policy.")));
  }
  if (request.has_attention()) {
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(request.attention(), layout,
                                                           absl::StrCat(prefix, "attention.")));
  }
  return out;
}

absl::StatusOr<ScoreParams> ScoreParamsFromProto(const v1::ScoreRequest& request,
                                                 const ModelLayout& layout) {
  if (request.budget_tokens() < 0 || request.budget_tokens() > kMaxBudgetTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_tokens must be in [0, ", kMaxBudgetTokens,
                     "] (unset = the sequence's budget), got ", request.budget_tokens()));
  }
  KVS_RETURN_IF_ERROR(ValidateLayers(request.layers(), layout.num_layers, "layers"));
  ScoreParams out;
  out.budget_tokens = request.budget_tokens();
  if (request.has_policy()) {
    KVS_ASSIGN_OR_RETURN(out.policy, PolicyFromProto(request.policy(), "policy."));
  }
  if (request.has_attention()) {
    KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(request.attention(), layout));
  }
  out.layers.assign(request.layers().begin(), request.layers().end());
  return out;
}

void CompressResultToProto(const CompressResult& result, v1::CompressResponse* out) {
  for (const LayerCompressResult& layer : result.layers) {
    v1::CompressResponse::LayerResult* item = out->add_layers();
    item->set_layer(layer.layer);
    item->set_kept(layer.kept);
    item->set_evicted(layer.evicted);
    item->set_merged(layer.merged);
    item->mutable_positions()->Add(layer.positions.begin(), layer.positions.end());
  }
  out->set_blocks_freed(result.blocks_freed);
  out->set_floor_applied_layers(result.floor_applied_layers);
  out->set_bytes_copied(result.bytes_copied);
}

void LayerScoresToProto(const LayerScores& scores, v1::ScoreResponse::LayerScores* out) {
  out->set_layer(scores.layer);
  out->mutable_scores()->Add(scores.scores.begin(), scores.scores.end());
  out->mutable_kept_slots()->Add(scores.kept_slots.begin(), scores.kept_slots.end());
  out->set_kept(scores.kept);
  out->mutable_positions()->Add(scores.positions.begin(), scores.positions.end());
}

absl::StatusOr<SelectItem> SelectItemFromProto(const v1::SelectRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix) {
  SelectItem out;
  out.session_id = item.session_id();
  out.sequence_id = item.sequence_id();
  out.step_id = item.step_id();
  if (!item.has_attention()) {
    return Invalid(prefix, "attention",
                   "is required: the filter layers' queries of this decode step");
  }
  KVS_ASSIGN_OR_RETURN(out.attention, AttentionFromProto(item.attention(), layout,
                                                         absl::StrCat(prefix, "attention.")));
  if (item.prompt_tokens() < 0) {
    return Invalid(prefix, "prompt_tokens",
                   absl::StrCat("must be >= 0, got ", item.prompt_tokens()));
  }
  out.prompt_tokens = item.prompt_tokens();
  return out;
}

void SelectResultToProto(const SelectResult& result, v1::SelectResponse::Item* out) {
  for (const LayerLayoutView& layer : result.sparse_layers) {
    LayerLayoutToProto(layer, out->add_sparse_layers());
  }
  if (!result.filters.empty()) {
    out->mutable_selected_positions()->Add(result.filters[0].positions.begin(),
                                           result.filters[0].positions.end());
  }
  for (const FilterSelection& filter : result.filters) {
    v1::FilterSelection* selection = out->add_filters();
    selection->set_filter_layer(filter.filter_layer);
    selection->mutable_positions()->Add(filter.positions.begin(), filter.positions.end());
    selection->mutable_sparse_layers()->Add(filter.sparse_layers.begin(),
                                            filter.sparse_layers.end());
  }
  out->set_prompt_tokens(result.prompt_tokens);
  out->set_budget_tokens(result.budget_tokens);
  out->set_host_bytes(result.host_bytes);
}

}  // namespace kvs
