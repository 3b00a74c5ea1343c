// The shape of one RPC (bench/rpc_shape.h).
#include "bench/rpc_shape.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gpu/base/dtype.h"
#include "gpu/base/status_macros.h"

namespace kvs::bench {
namespace {

namespace v1 = ::kvsidecar::v1;

v1::ModelLayout Layout(int layers, const ShapeOptions& o) {
  v1::ModelLayout layout;
  layout.set_num_layers(layers);
  layout.set_num_kv_heads(o.kv_heads);
  layout.set_num_q_heads(o.q_heads);
  layout.set_head_dim(o.head_dim);
  layout.set_dtype(v1::DTYPE_FLOAT16);
  layout.set_block_tokens(o.block_tokens);
  return layout;
}

// fp16 values of magnitude below 1, different for every (seed, element).
std::vector<uint8_t> Payload(uint64_t elements, uint64_t seed) {
  std::vector<uint8_t> bytes(elements * 2);
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = 0; i < elements; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float value = static_cast<float>(static_cast<int64_t>(state >> 40) % 2000 - 1000) / 1000;
    const uint16_t half = FloatToFloat16(value);
    std::memcpy(bytes.data() + 2 * i, &half, 2);
  }
  return bytes;
}

// Queries for every layer ([L][Hq][w][D] fp32) of a window of `w` at `positions`.
v1::AttentionInputs Queries(int layers, const ShapeOptions& o, int w,
                            const std::vector<int32_t>& positions) {
  v1::AttentionInputs attention;
  attention.set_num_queries(w);
  for (int32_t p : positions) attention.add_query_positions(p);
  attention.set_softmax_scale(1.0f / std::sqrt(static_cast<float>(o.head_dim)));
  attention.set_queries_dtype(v1::DTYPE_FLOAT32);
  const uint64_t values = uint64_t{static_cast<uint64_t>(layers)} * o.q_heads * w * o.head_dim;
  std::string bytes(values * sizeof(float), '\0');
  for (uint64_t i = 0; i < values; ++i) {
    const float value = 0.5f * std::sin(static_cast<float>(i % 9973) * 0.37f);
    std::memcpy(bytes.data() + i * sizeof(float), &value, sizeof(float));
  }
  attention.set_inline_queries(std::move(bytes));
  return attention;
}

absl::StatusOr<v1::DeviceCounters> ReadCounters(kvsidecar::AdminClient& admin) {
  KVS_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, admin.GetStats());
  return stats.device();
}

// The difference of two readings, into `shape`.
void Difference(const v1::DeviceCounters& before, const v1::DeviceCounters& after,
                RpcShape& shape) {
  shape.calls = after.calls() - before.calls();
  shape.syncs = after.syncs() - before.syncs();
  shape.uploads = after.uploads() - before.uploads();
  shape.downloads = after.downloads() - before.downloads();
  shape.up_bytes = after.up_bytes() - before.up_bytes();
  shape.down_bytes = after.down_bytes() - before.down_bytes();
  shape.arena_writes = after.arena_writes() - before.arena_writes();
  shape.arena_reads = after.arena_reads() - before.arena_reads();
  shape.launches = after.launches() - before.launches();
  shape.jobs = 0;
  for (int i = 0; i < after.methods_size() && i < before.methods_size(); ++i) {
    const uint64_t calls = after.methods(i).calls() - before.methods(i).calls();
    shape.jobs += after.methods(i).jobs() - before.methods(i).jobs();
    if (calls > 0) shape.calls_by_method.emplace_back(after.methods(i).name(), calls);
  }
}

// Appends `tokens` tokens to every layer of each of `ids`, inline.
absl::Status Prefill(kvsidecar::Session& session, const std::vector<std::string>& ids, int layers,
                     int tokens, const ShapeOptions& o) {
  for (size_t s = 0; s < ids.size(); ++s) {
    const std::vector<uint8_t> payload = Payload(
        uint64_t{static_cast<uint64_t>(layers)} * 2 * o.kv_heads * tokens * o.head_dim, s + 1);
    kvsidecar::AppendSegment segment;
    segment.sequence_id = ids[s];
    segment.num_tokens = tokens;
    segment.payload = payload;
    KVS_RETURN_IF_ERROR(session.Append(segment).status());
  }
  return absl::OkStatus();
}

// One decode step of every sequence: the token at `position`, inline or through a reservation
// the caller's worker wrote; its queries inline or in the staging area. `request_bytes` gets the
// request's size.
absl::StatusOr<v1::DecodeStepResponse> Step(kvsidecar::Session& session,
                                            const std::vector<std::string>& ids, int layers,
                                            int32_t position, const ShapeOptions& o,
                                            uint64_t* request_bytes = nullptr) {
  v1::AttentionInputs attention = Queries(layers, o, 1, {position});
  const uint64_t token_elements =
      uint64_t{static_cast<uint64_t>(layers)} * 2 * o.kv_heads * o.head_dim;
  v1::DecodeStepRequest request;
  std::vector<kvsidecar::Reservation> reservations;
  if (!o.inline_kv) {
    std::vector<kvsidecar::ReserveItem> items;
    for (const std::string& id : ids) items.push_back({id, 1, {}});
    KVS_ASSIGN_OR_RETURN(reservations, session.BatchReserve(items));
    for (size_t s = 0; s < ids.size(); ++s) {
      const std::vector<uint8_t> kv = Payload(token_elements, position * 131 + s);
      const uint64_t row = uint64_t{static_cast<uint64_t>(o.head_dim)} * 2;
      for (int l = 0; l < layers; ++l) {
        for (int kvi = 0; kvi < 2; ++kvi) {
          for (int h = 0; h < o.kv_heads; ++h) {
            KVS_ASSIGN_OR_RETURN(uint8_t * dst, reservations[s].RowPointer(l, kvi, h, 0));
            std::memcpy(
                dst,
                kv.data() + ((uint64_t{static_cast<uint64_t>(l)} * 2 + kvi) * o.kv_heads + h) * row,
                row);
          }
        }
      }
    }
  }
  for (size_t s = 0; s < ids.size(); ++s) {
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_sequence_id(ids[s]);
    if (o.inline_kv) {
      const std::vector<uint8_t> kv = Payload(token_elements, position * 131 + s);
      item->set_inline_kv(kv.data(), kv.size());
    } else {
      item->set_reservation_id(reservations[s].id());
    }
    *item->mutable_attention() = attention;
    if (o.staged_queries) {
      // Every item's queries in the one staging area of the session, one after the other.
      const std::string& bytes = attention.inline_queries();
      const uint64_t offset = static_cast<uint64_t>(s) * bytes.size();
      KVS_ASSIGN_OR_RETURN(uint8_t * area, session.geometry().Staging(offset, bytes.size()));
      std::memcpy(area, bytes.data(), bytes.size());
      item->mutable_attention()->set_staging_offset(offset);  // clears inline_queries
      item->mutable_attention()->clear_queries_dtype();
    }
  }
  if (request_bytes != nullptr) *request_bytes = request.ByteSizeLong();
  return session.DecodeStep(std::move(request));
}

}  // namespace

kvsidecar::v1::PolicySpec ShapePolicy(const std::string& name) {
  v1::PolicySpec policy;
  policy.set_name(name);
  return policy;
}

std::vector<std::string> EvictingPolicies() {
  return {"streaming_llm", "keydiff", "h2o", "tova", "snapkv", "cake", "d2o", "caote", "knorm"};
}

absl::StatusOr<RpcShape> MeasureDecodeStep(kvsidecar::Client& client, kvsidecar::AdminClient& admin,
                                           const std::string& policy, int sequences, int layers,
                                           const ShapeOptions& o) {
  const int steps = o.warmup_steps + 1;
  const int blocks_per_layer = (o.prefill + steps + o.block_tokens - 1) / o.block_tokens + 1;
  v1::AttachRequest attach;
  *attach.mutable_layout() = Layout(layers, o);
  attach.set_num_blocks(sequences * layers * blocks_per_layer);
  if (o.staged_queries) {
    attach.set_staging_bytes(sizeof(float) * static_cast<uint64_t>(sequences) * layers * o.q_heads *
                             o.head_dim);
  }
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<kvsidecar::Session> session, client.Attach(attach));
  std::vector<std::string> ids;
  v1::Budget budget;
  budget.set_tokens_per_layer(o.prefill);
  for (int s = 0; s < sequences; ++s) {
    ids.push_back(absl::StrCat("seq-", s));
    KVS_RETURN_IF_ERROR(session->CreateSequence(ShapePolicy(policy), budget, ids.back()).status());
  }
  KVS_RETURN_IF_ERROR(Prefill(*session, ids, layers, o.prefill, o));
  for (int step = 0; step < o.warmup_steps; ++step) {
    KVS_RETURN_IF_ERROR(Step(*session, ids, layers, o.prefill + step, o).status());
  }
  KVS_ASSIGN_OR_RETURN(const v1::DeviceCounters before, ReadCounters(admin));
  uint64_t request_bytes = 0;
  KVS_ASSIGN_OR_RETURN(const v1::DecodeStepResponse response,
                       Step(*session, ids, layers, o.prefill + o.warmup_steps, o, &request_bytes));
  KVS_ASSIGN_OR_RETURN(const v1::DeviceCounters after, ReadCounters(admin));
  RpcShape shape;
  shape.rpc = "DecodeStep";
  shape.request_bytes = request_bytes;
  shape.policy = policy;
  shape.sequences = sequences;
  shape.layers = layers;
  shape.kv_heads = o.kv_heads;
  shape.response_bytes = response.ByteSizeLong();
  Difference(before, after, shape);
  KVS_RETURN_IF_ERROR(session->Detach().status());
  return shape;
}

absl::StatusOr<RpcShape> MeasureCompress(kvsidecar::Client& client, kvsidecar::AdminClient& admin,
                                         const std::string& policy, int layers,
                                         const ShapeOptions& o) {
  const int prompt = 2 * o.prefill;
  const int blocks_per_layer = (prompt + o.block_tokens - 1) / o.block_tokens + 1;
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<kvsidecar::Session> session,
                       client.Attach(Layout(layers, o), "default", layers * blocks_per_layer, 0));
  const std::vector<std::string> ids = {"prompt"};
  KVS_RETURN_IF_ERROR(session->CreateSequence(ShapePolicy(policy), std::nullopt, ids[0]).status());
  KVS_RETURN_IF_ERROR(Prefill(*session, ids, layers, prompt, o));
  const int w = std::min(o.window, prompt);
  std::vector<int32_t> positions;
  for (int i = prompt - w; i < prompt; ++i) positions.push_back(i);
  v1::CompressRequest request;
  request.set_sequence_id(ids[0]);
  request.set_budget_tokens(o.prefill);
  *request.mutable_attention() = Queries(layers, o, w, positions);
  KVS_ASSIGN_OR_RETURN(const v1::DeviceCounters before, ReadCounters(admin));
  KVS_ASSIGN_OR_RETURN(const v1::CompressResponse response, session->Compress(request));
  KVS_ASSIGN_OR_RETURN(const v1::DeviceCounters after, ReadCounters(admin));
  RpcShape shape;
  shape.rpc = "Compress";
  shape.policy = policy;
  shape.sequences = 1;
  shape.layers = layers;
  shape.kv_heads = o.kv_heads;
  shape.response_bytes = response.ByteSizeLong();
  Difference(before, after, shape);
  KVS_RETURN_IF_ERROR(session->Detach().status());
  return shape;
}

std::string FormatShape(const RpcShape& s) {
  std::string line = absl::StrCat(
      "rpc=", s.rpc, " policy=", s.policy, " n=", s.sequences, " layers=", s.layers,
      " calls=", s.calls, " syncs=", s.syncs, " uploads=", s.uploads, " downloads=", s.downloads,
      " up_bytes=", s.up_bytes, " down_bytes=", s.down_bytes, " arena_writes=", s.arena_writes,
      " arena_reads=", s.arena_reads, " jobs=", s.jobs, " launches=", s.launches,
      " request_bytes=", s.request_bytes, " response_bytes=", s.response_bytes, " methods=");
  for (size_t i = 0; i < s.calls_by_method.size(); ++i) {
    absl::StrAppend(&line, i == 0 ? "" : ",", s.calls_by_method[i].first, ":",
                    s.calls_by_method[i].second);
  }
  if (s.calls_by_method.empty()) absl::StrAppend(&line, "-");
  return line;
}

}  // namespace kvs::bench
