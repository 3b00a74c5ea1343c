#include "cache/tier_types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache/policy/registry.h"

namespace kvs {

absl::Status ValidatePrefixKey(std::string_view prefix_key, std::string_view field) {
  bool ok = prefix_key.size() == 64;
  for (size_t i = 0; ok && i < prefix_key.size(); ++i) {
    const char c = prefix_key[i];
    ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      absl::string_view(field.data(), field.size()),
      " must be 64 lowercase hex digits (a sha256 content key, as the client's "
      "prefix_key computes it), got ",
      prefix_key.size(), " bytes"));
}

bool PolicyIsQueryAware(const PolicyConfig& policy) {
  // The cake allocator sizes the layers' budgets from the attention the queries paid them.
  if (policy.allocator.kind == LayerAllocatorKind::kCake) return true;
  // The policy's unit says whether it scores keys alone (streaming_llm by position, keydiff and
  // knorm by the keys' geometry) or ranks tokens by the attention of queries.
  return !CapabilitiesOf(policy).query_agnostic;
}

}  // namespace kvs
