// Protobuf <-> cache-core conversions and request validation for the service edge.
//
// Every check that can be made without the pool lives here, as pure functions, so the handlers in
// sidecar_service.cc only sequence pool calls. INVALID_ARGUMENT messages name the proto field by
// its path in the request ("layout.head_dim", "requests[3].num_tokens", "positions[2]"); callers
// of batch forms pass a `prefix` such as "requests[3]." that is put in front of every field name.
// Policies are only MAPPED here (names, enums, values; zero = the spec's default): range checks
// and defaults belong to the policies' Resolve functions on the cache side (ResolvePolicyConfig),
// which the pool runs when it builds a policy. Parts of the contract this build does not serve
// (retain_evicted, the query staging area) are refused with UNIMPLEMENTED naming what is
// missing. Sizes are computed with overflow-checked arithmetic before anything is
// allocated.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_H_
#define KVSIDECAR_SERVICE_CONVERT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/policy/policy_config.h"
#include "cache/pool.h"
#include "gpu/base/layout.h"
#include "kvsidecar/v1/admin.pb.h"
#include "kvsidecar/v1/common.pb.h"
#include "kvsidecar/v1/sidecar.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// Largest budget (tokens per layer) a request may ask for: far beyond any model's context, and
// small enough that budget + prefill block can never overflow int32 slot arithmetic.
inline constexpr int32_t kMaxBudgetTokens = 1 << 24;
inline constexpr int32_t kDefaultPrefillBlockTokens = 128;
// Longest session id, sequence id, tenant or worker name accepted.
inline constexpr size_t kMaxNameBytes = 256;
inline constexpr uint32_t kMinExportChunkBytes = 64u << 10;
inline constexpr uint32_t kMaxExportChunkBytes = 4u << 20;
inline constexpr uint32_t kDefaultExportChunkBytes = 1u << 20;

// Whether this build converts the named policy (every policy of the registry,
// cache/policy/registry.h, which owns the list of names).
bool IsImplementedPolicy(absl::string_view name);

// ---- Layout ----------------------------------------------------------------------------------
// `field` is the full field path, e.g. "layout.dtype".
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);
// block_tokens 0 becomes kDefaultBlockTokens; then ModelLayout::Validate with `prefix`.
absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& layout,
                                            absl::string_view prefix = "layout.");
void LayoutToProto(const ModelLayout& layout, v1::ModelLayout* out);

// ---- Policies and budgets --------------------------------------------------------------------
// An empty spec (no name, no params, no allocator) is nullopt: the server default applies.
// Every value is copied as given (zero stays zero: ResolvePolicyConfig fills in the spec's
// default); unknown names and enum values are INVALID_ARGUMENT naming the field
// ("policy.caote.base has unknown value 9").
absl::StatusOr<std::optional<PolicyConfig>> PolicyFromProto(const v1::PolicySpec& spec,
                                                            absl::string_view prefix = "policy.");
// A policy by name with every parameter at its default, resolved (ResolvePolicyConfig), for
// --default_policy. `field` names the source in errors.
absl::StatusOr<PolicyConfig> DefaultPolicyNamed(absl::string_view name, absl::string_view field);
// Every parameter of the named policy (as resolved: defaults shown) and the allocator.
void PolicyToProto(const PolicyConfig& policy, v1::PolicySpec* out);

// A present Budget message. prefill_block_tokens 0 becomes kDefaultPrefillBlockTokens.
// per_layer_tokens: empty, or `num_layers` entries (not checked when num_layers < 0, the layout
// being unknown), each in [1, kMaxBudgetTokens].
absl::StatusOr<BudgetConfig> BudgetFromProto(const v1::Budget& budget, int32_t max_tokens_per_call,
                                             absl::string_view prefix = "budget.",
                                             int32_t num_layers = -1);
void BudgetToProto(const BudgetConfig& budget, v1::Budget* out);

// ---- Field checks ----------------------------------------------------------------------------
// Non-empty (if `required`), at most kMaxNameBytes, no control characters.
absl::Status ValidateName(absl::string_view value, absl::string_view field, bool required);
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

// ---- Requests --------------------------------------------------------------------------------
absl::StatusOr<AttachParams> AttachFromProto(const v1::AttachRequest& request,
                                             const PoolOptions& options);
// `num_layers`: the session's, for budget.per_layer_tokens (< 0 = unknown, size not checked).
absl::StatusOr<SequenceParams> SequenceParamsFromProto(const v1::CreateSequenceRequest& request,
                                                       int32_t max_tokens_per_call,
                                                       int32_t num_layers = -1);
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
// Ids and every field; `layout` is the session's (for the attention inputs).
absl::StatusOr<CompressParams> CompressParamsFromProto(const v1::CompressRequest& request,
                                                       const ModelLayout& layout,
                                                       absl::string_view prefix = "");
// One DecodeStep item (`prefix` e.g. "items[3]."): ids; attention (absent = none: num_queries 0,
// no queries or scores), whose num_queries must be 1; reservation_id or inline_kv, not both;
// inline_kv exactly [L][2][H][1][D] in the session dtype.
absl::StatusOr<DecodeItem> DecodeItemFromProto(const v1::DecodeStepRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix = "");
// One Select item (`prefix` e.g. "items[3]."): ids; attention required (queries; the pool checks
// the layers against the policy's filter layers); prompt_tokens >= 0.
absl::StatusOr<SelectItem> SelectItemFromProto(const v1::SelectRequest::Item& item,
                                               const ModelLayout& layout,
                                               absl::string_view prefix = "");
void SelectResultToProto(const SelectResult& result, v1::SelectResponse::Item* out);
// Ids, budget_tokens in [0, kMaxBudgetTokens], policy, attention, layers (ValidateLayers).
absl::StatusOr<ScoreParams> ScoreParamsFromProto(const v1::ScoreRequest& request,
                                                 const ModelLayout& layout);

// ---- Responses -------------------------------------------------------------------------------
int64_t UnixMillisOf(absl::Time time);
void ArenaHandleToProto(const SessionView& session, v1::ArenaHandle* out);
void ReservationToProto(const Reservation& reservation, v1::ReserveResponse* out);
void CommitResultToProto(const CommitResult& result, v1::CommitResponse* out);
void CompressResultToProto(const CompressResult& result, v1::CompressResponse* out);
void DecodeResultToProto(const DecodeResult& result, v1::DecodeStepResponse::Item* out);
void LayerScoresToProto(const LayerScores& scores, v1::ScoreResponse::LayerScores* out);
void LayerLayoutToProto(const LayerLayoutView& layer, v1::LayerLayout* out);
void SequenceLayoutToProto(const SequenceLayout& layout, v1::GetLayoutResponse* out);
void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out);
void SequenceInfoToProto(const SequenceInfo& info, v1::SequenceInfo* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_H_
