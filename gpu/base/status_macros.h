// Project-wide status helpers. Debian's Abseil (20220623) ships no RETURN_IF_ERROR /
// ASSIGN_OR_RETURN, so the project defines its own once, here. Header-only, no state.
#ifndef KVSIDECAR_GPU_BASE_STATUS_MACROS_H_
#define KVSIDECAR_GPU_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVS_STATUS_CONCAT_INNER_(a, b) a##b
#define KVS_STATUS_CONCAT_(a, b) KVS_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define KVS_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::absl::Status kvs_status_ = (expr);               \
    if (!kvs_status_.ok()) return kvs_status_;         \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the enclosing
// function. `lhs` may be a declaration: KVS_ASSIGN_OR_RETURN(auto x, MakeX());
#define KVS_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVS_ASSIGN_OR_RETURN_IMPL_(KVS_STATUS_CONCAT_(kvs_statusor_, __LINE__), lhs, rexpr)

#define KVS_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                               \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // KVSIDECAR_GPU_BASE_STATUS_MACROS_H_
