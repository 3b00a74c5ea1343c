// The one place where absl::Status becomes grpc::Status (and back, for in-process callers such
// as tests). Codes map 1:1: both follow google.rpc.Code. Header-only, pure, thread-safe.
#ifndef KVSIDECAR_SERVICE_STATUS_CONVERT_H_
#define KVSIDECAR_SERVICE_STATUS_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvs {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_STATUS_CONVERT_H_
