#include "service/convert_session.h"

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "service/convert_fields.h"
#include "service/internal/convert_util.h"

namespace kvs {

using convert_internal::Invalid;

absl::StatusOr<AttachParams> AttachFromProto(const v1::AttachRequest& request,
                                             const PoolOptions& options) {
  if (!request.has_layout()) return absl::InvalidArgumentError("layout is required");
  AttachParams out;
  KVS_ASSIGN_OR_RETURN(out.layout, LayoutFromProto(request.layout(), "layout."));
  KVS_RETURN_IF_ERROR(ValidateName(request.tenant(), "tenant", /*required=*/false));
  KVS_RETURN_IF_ERROR(ValidateName(request.worker_name(), "worker_name", /*required=*/false));
  if (!request.tenant().empty()) out.tenant = request.tenant();
  out.worker_name = request.worker_name();
  if (request.num_blocks() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be >= 0 (0 = server default), got ", request.num_blocks()));
  }
  out.num_blocks = request.num_blocks();
  if (request.lease_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must be >= 0 (0 = server default), got ", request.lease_ms()));
  }
  if (request.lease_ms() > 0) {
    const absl::Duration lease = absl::Milliseconds(request.lease_ms());
    if (lease < options.min_lease || lease > options.max_lease) {
      return absl::InvalidArgumentError(
          absl::StrCat("lease_ms must be in [", absl::ToInt64Milliseconds(options.min_lease), ", ",
                       absl::ToInt64Milliseconds(options.max_lease),
                       "] (or 0 = server default), got ", request.lease_ms()));
    }
    out.lease = lease;
  }
  out.staging_bytes = request.staging_bytes();  // bounded by the session table (Plan)
  return out;
}

void ArenaHandleToProto(const SessionView& session, v1::ArenaHandle* out) {
  const ArenaHandle& handle = session.arena;
  switch (handle.kind) {
    case ArenaHandle::Kind::kSharedMemoryFile:
      out->set_kind(v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
      out->set_shm_path(handle.shm_path);
      break;
    case ArenaHandle::Kind::kMemfd:
      // fd_socket_path and fd_nonce are the Attach handler's: they belong to that one answer.
      out->set_kind(v1::ArenaHandle::KIND_MEMFD);
      break;
    case ArenaHandle::Kind::kCudaIpc:
      out->set_kind(v1::ArenaHandle::KIND_CUDA_IPC);
      out->set_cuda_ipc_handle(handle.cuda_ipc_handle);
      out->set_cuda_device(handle.cuda_device);
      out->set_cuda_device_uuid(handle.cuda_device_uuid);
      break;
  }
  out->set_size_bytes(handle.size_bytes);
  out->set_generation(handle.generation);
  out->set_block_bytes(session.block_bytes);
  out->set_num_blocks(session.num_blocks);
  out->set_staging_offset(session.staging_offset);
  out->set_staging_bytes(session.staging_bytes);
}

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out) {
  out->set_session_id(info.session_id);
  out->set_tenant(info.tenant);
  out->set_worker_name(info.worker_name);
  LayoutToProto(info.layout, out->mutable_layout());
  out->set_num_blocks(info.num_blocks);
  out->set_free_blocks(info.free_blocks);
  out->set_sequences(info.sequences);
  out->set_sequences_spilled(info.sequences_spilled);
  out->set_attached_unix_ms(UnixMillisOf(info.attached));
  out->set_last_heartbeat_unix_ms(UnixMillisOf(info.last_heartbeat));
  out->set_lease_expires_unix_ms(UnixMillisOf(info.lease_expires));
}

}  // namespace kvs
