// The value types of KvPool's tier calls (Spill, Restore, Publish) and the naming of published
// prefixes in the tiers. The tiers themselves are behind cache/tier.h.
#ifndef KVSIDECAR_CACHE_TIER_TYPES_H_
#define KVSIDECAR_CACHE_TIER_TYPES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "cache/policy/policy_config.h"
#include "cache/tier.h"

namespace kvs {

// Spill / Restore: where the sequence is now (Spill) or came from (Restore), and the bytes moved.
struct SpillResult {
  StorageTier tier = StorageTier::kArena;
  uint64_t bytes = 0;
};

// Published prefixes live in the tiers under the publishing tenant, this pseudo session id (no
// session id has a '#') and the sequence id "prefix/<key>" (no sequence id has a '/', so a prefix
// never collides with a spilled sequence, the remote tier's (tenant, sequence id) names included).
inline constexpr char kPrefixSessionId[] = "#prefix";
inline SpillKey PrefixSpillKey(std::string tenant, std::string_view prefix_key) {
  return SpillKey{std::move(tenant), kPrefixSessionId, std::string("prefix/").append(prefix_key)};
}
// OK when `prefix_key` is a content key's shape: 64 lowercase hex digits (a sha256); else
// INVALID_ARGUMENT naming `field`.
absl::Status ValidatePrefixKey(std::string_view prefix_key, std::string_view field);
// Whether the tokens `policy` keeps depend on the prompt's queries (so a compressed prefix is
// reusable only together with the queries that drove it): every policy whose registry unit is not
// query-agnostic (streaming_llm, keydiff, knorm are), and any policy with the cake layer
// allocator. sidecar.proto PublishRequest says why.
bool PolicyIsQueryAware(const PolicyConfig& policy);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_TIER_TYPES_H_
