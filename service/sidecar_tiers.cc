// SidecarService, tier movement: Spill and Restore (with adoption of an ended session's copy).
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

grpc::ServerUnaryReactor* SidecarService::Spill(grpc::CallbackServerContext* context,
                                                const v1::SpillRequest* request,
                                                v1::SpillResponse* response) {
  return RunUnary(context, "Spill", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    if (request->target() != v1::TIER_HOST && request->target() != v1::TIER_DISK &&
        request->target() != v1::TIER_REMOTE) {
      return absl::InvalidArgumentError(absl::StrCat("target must be TIER_HOST, TIER_DISK or "
                                                     "TIER_REMOTE, got ",
                                                     v1::Tier_Name(request->target()).empty()
                                                         ? absl::StrCat(request->target())
                                                         : v1::Tier_Name(request->target())));
    }
    // The lookup the tenant check made (or made now); the pool answers its error after its own
    // checks of the tiers and the target, as by id.
    KVS_ASSIGN_OR_RETURN(
        SpillResult result,
        pool_->Spill(sessions.Find(request->session_id()), request->sequence_id(),
                     static_cast<StorageTier>(request->target())));  // values match v1::Tier
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Restore(grpc::CallbackServerContext* context,
                                                  const v1::RestoreRequest* request,
                                                  v1::RestoreResponse* response) {
  return RunUnary(context, "Restore", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", /*required=*/true));
    KVS_RETURN_IF_ERROR(
        ValidateName(request->from_session_id(), "from_session_id", /*required=*/false));
    std::string from = request->from_session_id();
    // One lookup serves the tenant check, the search for an orphan copy and the restore.
    const absl::StatusOr<SessionRef> session = sessions.Find(request->session_id());
    if (request->adopt_any_session()) {
      if (!from.empty()) {
        return absl::InvalidArgumentError(
            "adopt_any_session: set either from_session_id or adopt_any_session, not both");
      }
      KVS_RETURN_IF_ERROR(session.status());
      KVS_ASSIGN_OR_RETURN(from, FindOrphanCopy(*session, request->sequence_id()));
    }
    KVS_ASSIGN_OR_RETURN(SpillResult result, pool_->Restore(session, request->sequence_id(), from));
    response->set_tier(static_cast<v1::Tier>(result.tier));
    response->set_bytes(result.bytes);
    if (!from.empty() && from != request->session_id()) {
      response->set_adopted_from_session_id(from);
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::string> SidecarService::FindOrphanCopy(const SessionRef& session,
                                                           const std::string& sequence_id) const {
  const SpilledInfo* best = nullptr;
  const std::vector<SpilledInfo> copies = pool_->ListSpilled();
  for (const SpilledInfo& copy : copies) {
    if (copy.key.tenant != session.tenant() || copy.key.sequence_id != sequence_id) continue;
    // A copy of an attached session is that session's sequence, not an orphan.
    if (pool_->GetSession(copy.key.session_id).ok()) continue;
    // Intact copies first, then the newest; a lost one is still chosen when it is the only one
    // (Restore then answers DATA_LOSS rather than NOT_FOUND).
    const bool better =
        best == nullptr || (best->lost.empty() != copy.lost.empty() ? copy.lost.empty()
                                                                    : copy.spilled > best->spilled);
    if (better) best = &copy;
  }
  if (best == nullptr) {
    return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ", sequence_id,
                                            " left by an ended session of tenant ",
                                            session.tenant()));
  }
  return best->key.session_id;
}

}  // namespace kvs
