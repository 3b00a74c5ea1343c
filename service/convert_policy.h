// Protobuf <-> core conversions of policy specs and budgets. Policies are only MAPPED here
// (names, enums, values; zero = the spec's default): range checks and defaults belong to the
// policies' Resolve functions on the cache side (ResolvePolicyConfig), which the pool runs when
// it builds a policy. `prefix` is put in front of every field name ("requests[3].policy.").
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_POLICY_H_
#define KVSIDECAR_SERVICE_CONVERT_POLICY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/policy/policy_config.h"
#include "cache/pool.h"
#include "kvsidecar/v1/common.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// Largest budget (tokens per layer) a request may ask for: far beyond any model's context, and
// small enough that budget + prefill block can never overflow int32 slot arithmetic.
inline constexpr int32_t kMaxBudgetTokens = 1 << 24;
inline constexpr int32_t kDefaultPrefillBlockTokens = 128;

// Whether this build converts the named policy (every policy of the registry,
// cache/policy/registry.h, which owns the list of names).
bool IsImplementedPolicy(absl::string_view name);

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

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_POLICY_H_
