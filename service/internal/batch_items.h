// Checks shared by the batched handlers of SidecarService (BatchReserve, BatchCommit,
// BatchCompress, DecodeStep, Select): the item count, one item per sequence, and the conversion
// of per-sequence items against their session's layout. Internal to service/.
#ifndef KVSIDECAR_SERVICE_INTERNAL_BATCH_ITEMS_H_
#define KVSIDECAR_SERVICE_INTERNAL_BATCH_ITEMS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "gpu/base/status_macros.h"
#include "service/convert_fields.h"
#include "service/internal/session_lookups.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"

namespace kvs {
namespace service_internal {

inline absl::Status CheckBatchSize(int size) {
  if (size > kMaxBatchItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("requests has ", size, " items; at most ", kMaxBatchItems, " per call"));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT if (session, sequence) of item `index` already appeared in the batch.
inline absl::Status CheckNoRepeat(
    absl::flat_hash_map<std::pair<std::string, std::string>, int>* seen,
    const std::string& session_id, const std::string& sequence_id, int index,
    absl::string_view list = "requests") {
  auto [it, inserted] = seen->try_emplace(std::make_pair(session_id, sequence_id), index);
  if (!inserted) {
    return absl::InvalidArgumentError(absl::StrCat(list, "[", index, "].sequence_id '", sequence_id,
                                                   "' repeats ", list, "[", it->second,
                                                   "] (one item per sequence per "
                                                   "batch)"));
  }
  return absl::OkStatus();
}

inline std::string Item(int index) { return absl::StrCat("requests[", index, "]"); }

// The items of a batched per-sequence call (DecodeStep, Select), converted in order with
// `convert` against their session's layout (each session looked up once, through `sessions`,
// where the pool's call then finds them): at most kMaxBatchItems, each naming a session and a
// sequence no other item names.
template <typename Item, typename Converted>
absl::StatusOr<std::vector<Converted>> ItemsFromProto(
    const google::protobuf::RepeatedPtrField<Item>& proto_items, SessionLookups& sessions,
    absl::StatusOr<Converted> (*convert)(const Item&, const ModelLayout&, absl::string_view)) {
  const int n = proto_items.size();
  if (n > kMaxBatchItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("items has ", n, " items; at most ", kMaxBatchItems, " per call"));
  }
  std::vector<Converted> items;
  items.reserve(n);
  absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
  for (int i = 0; i < n; ++i) {
    const Item& item = proto_items[i];
    const std::string prefix = absl::StrCat("items[", i, "].");
    // Both ids before the lookup, so that a bad one is INVALID_ARGUMENT naming it; `convert`
    // does not check them again.
    KVS_RETURN_IF_ERROR(ValidateSequenceIds(item.session_id(), item.sequence_id(), prefix));
    absl::StatusOr<SessionRef> session = sessions.Find(item.session_id());
    KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat("items[", i, "]: "), session.status()));
    KVS_ASSIGN_OR_RETURN(Converted converted, convert(item, session->layout(), prefix));
    KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i, "items"));
    items.push_back(std::move(converted));
  }
  return items;
}

}  // namespace service_internal
}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_INTERNAL_BATCH_ITEMS_H_
