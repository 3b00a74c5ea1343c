// SidecarService, compressed prefix reuse: Publish and Unpublish.
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

grpc::ServerUnaryReactor* SidecarService::Publish(grpc::CallbackServerContext* context,
                                                  const v1::PublishRequest* request,
                                                  v1::PublishResponse* response) {
  return RunUnary(context, "Publish", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    // The pool answers the lookup's error after checking the prefix key and the window, as by
    // id.
    KVS_ASSIGN_OR_RETURN(
        SpillResult result,
        pool_->Publish(sessions.Find(request->session_id()), request->sequence_id(),
                       request->prefix_key(), request->query_window()));
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

}  // namespace kvs
