// Streams that fail before they start: what a streaming handler of SidecarService returns when
// the call is refused up front. Internal to service/.
#ifndef KVSIDECAR_SERVICE_INTERNAL_FAILED_REACTORS_H_
#define KVSIDECAR_SERVICE_INTERNAL_FAILED_REACTORS_H_

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "service/status_convert.h"

namespace kvs {
namespace service_internal {

// A write stream that fails before it starts.
template <typename Response>
class FailedWriteReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit FailedWriteReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// A read stream that fails before it starts.
template <typename Request>
class FailedReadReactor final : public grpc::ServerReadReactor<Request> {
 public:
  explicit FailedReadReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace service_internal
}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_INTERNAL_FAILED_REACTORS_H_
