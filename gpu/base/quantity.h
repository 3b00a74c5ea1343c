// Byte sizes as Kubernetes quantities: the one parser behind every size the sidecar takes (flags,
// the YAML file, quotas) and every size kvctl takes, so that "1G" means the same everywhere.
//
// Grammar (Kubernetes resource.Quantity, restricted to whole non-negative byte counts):
//   [+]<digits>[.<digits>] | [+].<digits>       the number; a fraction is allowed when the result
//                                                is a whole number of bytes ("1.5Gi", ".5G")
//   followed by at most one suffix:
//     Ki Mi Gi Ti Pi Ei       binary: powers of 1024
//     k M G T P E             decimal: powers of 1000
//     e<int> / E<int>         decimal exponent ("1e9")
//     KiB MiB GiB TiB PiB EiB aliases of Ki..Ei, and KB MB GB TB PB EB aliases of k..E, accepted
//                             for the configurations written before the sizes followed Kubernetes
//                             (Kubernetes itself does not take them)
// No suffix means bytes. Refused, with a message naming the field: negatives, fractions of a byte
// ("0.5", "1.5"), results above 2^64-1, unknown suffixes (among them "K", "m" and "B", which
// Kubernetes does not define as byte units here), empty text.
#ifndef KVSIDECAR_GPU_BASE_QUANTITY_H_
#define KVSIDECAR_GPU_BASE_QUANTITY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvs {

// The bytes `text` stands for. Surrounding ASCII whitespace is ignored. Errors are
// INVALID_ARGUMENT whose message starts with `field` (e.g. "--arena_capacity_bytes").
absl::StatusOr<uint64_t> ParseQuantityBytes(absl::string_view text, absl::string_view field);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_QUANTITY_H_
