// Protobuf <-> cache-core conversions and request validation for the service edge.
//
// Every check that can be made without the pool lives here, as pure functions, so the handlers in
// sidecar_*.cc only sequence pool calls. INVALID_ARGUMENT messages name the proto field by
// its path in the request ("layout.head_dim", "requests[3].num_tokens", "positions[2]"); callers
// of batch forms pass a `prefix` such as "requests[3]." that is put in front of every field name.
// Policies are only MAPPED here (names, enums, values; zero = the spec's default): range checks
// and defaults belong to the policies' Resolve functions on the cache side (ResolvePolicyConfig),
// which the pool runs when it builds a policy. Parts of the contract this build does not serve
// (retain_evicted, the query staging area) are refused with UNIMPLEMENTED naming what is
// missing. Sizes are computed with overflow-checked arithmetic before anything is
// allocated.
//
// Threading: pure functions, no state.
//
// This header gathers the conversions of every service area; include the area's own header
// (convert_fields.h, convert_policy.h, convert_attention.h, convert_session.h,
// convert_sequence.h, convert_data_path.h, convert_policy_calls.h) where only one is needed.
#ifndef KVSIDECAR_SERVICE_CONVERT_H_
#define KVSIDECAR_SERVICE_CONVERT_H_

#include "service/convert_attention.h"
#include "service/convert_data_path.h"
#include "service/convert_fields.h"
#include "service/convert_policy.h"
#include "service/convert_policy_calls.h"
#include "service/convert_sequence.h"
#include "service/convert_session.h"

#endif  // KVSIDECAR_SERVICE_CONVERT_H_
