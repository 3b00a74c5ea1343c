// SidecarService: construction and the tenant check every handler runs first. The handlers live
// in one file per service area: sidecar_session.cc (Attach, Heartbeat, Watch, Detach),
// sidecar_sequence.cc (CreateSequence, ReleaseSequence, GetLayout), sidecar_data_path.cc
// (Reserve, Commit, their batch forms, DecodeStep), sidecar_streams.cc (Append, Export),
// sidecar_policy_calls.cc (Compress, BatchCompress, Score, Select, GetRetained), sidecar_tiers.cc
// (Spill, Restore) and sidecar_prefix.cc (Publish, Unpublish).
#include "service/sidecar_service.h"

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
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

SidecarService::SidecarService(KvPool* pool, std::string backend_name)
    : pool_(pool), backend_name_(std::move(backend_name)) {}

SidecarService::~SidecarService() = default;

namespace {

// Every session a request names: string fields session_id, at the top level and in repeated
// message fields (batch requests, decode items).
void CollectSessionIds(const google::protobuf::Message& message, int depth,
                       std::vector<std::string>* out) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING && !field->is_repeated() &&
        field->name() == "session_id") {
      std::string value = reflection->GetString(message, field);
      if (!value.empty()) out->push_back(std::move(value));
    } else if (depth == 0 && field->is_repeated() &&
               field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
        CollectSessionIds(reflection->GetRepeatedMessage(message, field, j), depth + 1, out);
      }
    }
  }
}

}  // namespace

absl::Status SidecarService::Authorize(const grpc::CallbackServerContext& context,
                                       const google::protobuf::Message& request) const {
  if (auth_ == nullptr || !auth_->data_auth()) return absl::OkStatus();
  service_internal::SessionLookups lookups(*pool_);
  return Authorize(context, request, lookups);
}

absl::Status SidecarService::Authorize(const grpc::CallbackServerContext& context,
                                       const google::protobuf::Message& request,
                                       service_internal::SessionLookups& lookups) const {
  if (auth_ == nullptr || !auth_->data_auth()) return absl::OkStatus();
  KVS_ASSIGN_OR_RETURN(std::optional<std::string> caller, auth_->DataTenant(context));
  std::vector<std::string> ids;
  CollectSessionIds(request, 0, &ids);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (const std::string& id : ids) {
    absl::StatusOr<SessionRef> session = lookups.Find(id);
    KVS_RETURN_IF_ERROR(Authenticator::CheckOwner(
        caller, session.ok() ? absl::StatusOr<std::string>(session->tenant()) : session.status(),
        id));
  }
  // Restore's from_session_id names an ended session of the caller's tenant (the pool looks the
  // copies up under the caller's tenant). Another tenant's live session gets the answer a
  // missing copy gets, so that it cannot be told apart.
  const google::protobuf::FieldDescriptor* from =
      request.GetDescriptor()->FindFieldByName("from_session_id");
  const google::protobuf::FieldDescriptor* sequence =
      request.GetDescriptor()->FindFieldByName("sequence_id");
  if (from != nullptr && sequence != nullptr &&
      from->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
      sequence->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
    const std::string from_id = request.GetReflection()->GetString(request, from);
    if (from_id.empty()) return absl::OkStatus();
    absl::StatusOr<SessionRef> source = lookups.Find(from_id);
    if (source.ok() && source->tenant() != *caller) {
      return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ",
                                              request.GetReflection()->GetString(request, sequence),
                                              " of session ", from_id, " for tenant ", *caller));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvs
