// Protobuf <-> core conversions of the session calls: Attach's parameters, the arena handle,
// and the session listing of the Admin service.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_SERVICE_CONVERT_SESSION_H_
#define KVSIDECAR_SERVICE_CONVERT_SESSION_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "kvsidecar/v1/admin.pb.h"
#include "kvsidecar/v1/sidecar.pb.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

// ---- Requests --------------------------------------------------------------------------------
absl::StatusOr<AttachParams> AttachFromProto(const v1::AttachRequest& request,
                                             const PoolOptions& options);

// ---- Responses -------------------------------------------------------------------------------
void ArenaHandleToProto(const SessionView& session, v1::ArenaHandle* out);
void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONVERT_SESSION_H_
