// Helpers every gRPC handler of the service uses so that (1) no exception ever crosses a gRPC
// callback: handler bodies run inside Guarded(), which turns std::exception and anything else
// into INTERNAL; and (2) every failed RPC is logged once, in one format. Header-only, stateless.
#ifndef KVSIDECAR_SERVICE_RPC_GUARD_H_
#define KVSIDECAR_SERVICE_RPC_GUARD_H_

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "service/log.h"
#include "service/status_convert.h"

namespace kvs {

// Client mistakes are logged at debug; what the operator should see (resources, internal
// errors, refusals while draining) at info or above.
inline void LogRpcFailure(absl::string_view rpc, const absl::Status& status) {
  LogLevel level = LogLevel::kInfo;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnimplemented:
      level = LogLevel::kDebug;
      break;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      level = LogLevel::kError;
      break;
    default:
      break;
  }
  LogLine(level, "rpc_failed")("rpc", rpc)("code", absl::StatusCodeToString(status.code()))(
      "msg", status.message());
}

// Runs `fn` (returning absl::Status) and converts escaping exceptions into INTERNAL. Logs a
// failure.
template <typename Fn>
absl::Status Guarded(absl::string_view rpc, Fn&& fn) {
  absl::Status status;
  try {
    status = std::forward<Fn>(fn)();
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(rpc, ": internal error: ", e.what()));
  } catch (...) {
    status = absl::InternalError(absl::StrCat(rpc, ": internal error (unknown exception)"));
  }
  if (!status.ok()) LogRpcFailure(rpc, status);
  return status;
}

// The client's `x-request-id` metadata (at most 128 bytes kept), or "".
inline std::string RequestIdOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("x-request-id");
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), std::min<size_t>(it->second.size(), 128));
}

// A unary handler: runs `fn` guarded (log lines carry the call's request id) and finishes the
// call with its status.
template <typename Fn>
grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* context, absl::string_view rpc,
                                   Fn&& fn) {
  ScopedRequestId request_id(RequestIdOf(*context));
  const absl::Status status = Guarded(rpc, std::forward<Fn>(fn));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// "requests[3]: " + message, same code.
inline absl::Status WithPrefix(absl::string_view prefix, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_RPC_GUARD_H_
