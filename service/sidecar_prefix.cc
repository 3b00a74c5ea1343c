// SidecarService, compressed prefix reuse: Publish, Unpublish and LookupPrefixes.
#include <algorithm>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "service/arena_fd_server.h"
#include "service/convert.h"
#include "service/internal/session_lookups.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::SessionLookups;

namespace {

// LookupPrefixesRequest's bound on the keys of one call.
constexpr int kMaxLookupKeys = 4096;

// PublishRequest.tier: nullopt for TIER_UNSPECIFIED (the default target).
absl::StatusOr<std::optional<StorageTier>> PublishTarget(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_UNSPECIFIED:
      return std::nullopt;
    case v1::TIER_HOST:
    case v1::TIER_DISK:
    case v1::TIER_REMOTE:
      return static_cast<StorageTier>(tier);  // values match v1::Tier
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "tier must be TIER_UNSPECIFIED, TIER_HOST, TIER_DISK or TIER_REMOTE, got ",
          v1::Tier_Name(tier).empty() ? absl::StrCat(static_cast<int>(tier)) : v1::Tier_Name(tier)));
  }
}

}  // namespace

grpc::ServerUnaryReactor* SidecarService::Publish(grpc::CallbackServerContext* context,
                                                  const v1::PublishRequest* request,
                                                  v1::PublishResponse* response) {
  return RunUnary(context, "Publish", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_ASSIGN_OR_RETURN(std::optional<StorageTier> target, PublishTarget(request->tier()));
    // The pool answers the lookup's error after checking the prefix key and the window, as by
    // id.
    KVS_ASSIGN_OR_RETURN(
        SpillResult result,
        pool_->Publish(sessions.Find(request->session_id()), request->sequence_id(),
                       request->prefix_key(), request->query_window(), target));
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Unpublish(grpc::CallbackServerContext* context,
                                                    const v1::UnpublishRequest* request,
                                                    v1::UnpublishResponse* response) {
  (void)response;
  return RunUnary(context, "Unpublish", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    // The pool answers the lookup's error after checking the prefix key, as by id.
    return pool_->Unpublish(sessions.Find(request->session_id()), request->prefix_key());
  });
}

grpc::ServerUnaryReactor* SidecarService::LookupPrefixes(
    grpc::CallbackServerContext* context, const v1::LookupPrefixesRequest* request,
    v1::LookupPrefixesResponse* response) {
  return RunUnary(context, "LookupPrefixes", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    if (request->prefix_keys_size() > kMaxLookupKeys) {
      return absl::InvalidArgumentError(absl::StrCat("prefix_keys: at most ", kMaxLookupKeys,
                                                     " keys per call, got ",
                                                     request->prefix_keys_size()));
    }
    const std::vector<std::string> keys(request->prefix_keys().begin(),
                                        request->prefix_keys().end());
    KVS_ASSIGN_OR_RETURN(std::vector<std::optional<SpilledInfo>> found,
                         pool_->LookupPrefixes(sessions.Find(request->session_id()), keys));
    for (size_t i = 0; i < found.size(); ++i) {
      if (!found[i]) continue;
      v1::LookupPrefixesResponse::Found* entry = response->add_found();
      entry->set_index(static_cast<int32_t>(i));
      entry->set_tier(static_cast<v1::Tier>(found[i]->tier));
      entry->set_bytes(found[i]->bytes);
    }
    return absl::OkStatus();
  });
}

}  // namespace kvs
