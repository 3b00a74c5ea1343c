// Helpers shared by the service/convert_*.cc files; not part of the service's interface.
#ifndef KVSIDECAR_SERVICE_INTERNAL_CONVERT_UTIL_H_
#define KVSIDECAR_SERVICE_INTERNAL_CONVERT_UTIL_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvs {
namespace convert_internal {

inline absl::Status Invalid(absl::string_view prefix, absl::string_view field,
                            absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, field, " ", what));
}

}  // namespace convert_internal
}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_INTERNAL_CONVERT_UTIL_H_
