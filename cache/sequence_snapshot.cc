#include "cache/sequence_snapshot.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/policy/registry.h"
#include "cache/sequence.h"
#include "cache/spill_buffers.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr char kMagic[] = "KVSSNAP1";
// The current format: the magic, then one field stream (cache/policy/registry.h).
constexpr char kMagicV2[] = "KVSSNAP2";
constexpr size_t kMagicBytes = 8;

// Tags of the snapshot's field stream. Never reuse a tag: a removed field's tag stays retired.
enum SnapshotTag : uint32_t {
  kTagId = 1,
  kTagLayout = 2,
  kTagPolicy = 3,  // EncodePolicyConfig, through the policy's registry unit
  kTagBudget = 4,
  kTagCreatedNs = 5,
  kTagLastUsedNs = 6,
  kTagNextPosition = 7,
  kTagVersion = 8,
  kTagLastCommitted = 9,
  kTagLastCancelled = 10,
  kTagLayer = 11,  // repeated, one per layer in order
  kTagLayerWindows = 12,  // per-layer sliding windows; absent = none
};
enum LayoutTag : uint32_t {
  kTagNumLayers = 1,
  kTagNumKvHeads = 2,
  kTagNumQHeads = 3,
  kTagHeadDim = 4,
  kTagDType = 5,
  kTagBlockTokens = 6,
};
enum BudgetTag : uint32_t {
  kTagTokensPerLayer = 1,
  kTagStrict = 2,
  kTagPrefillBlockTokens = 3,
  kTagPerLayerTokens = 4,
};
enum LayerTag : uint32_t {
  kTagCount = 1,
  kTagAppended = 2,
  kTagPositions = 3,  // repeated, one per kv head
  kTagAllocated = 4,
  kTagState = 5,      // the policy unit's state encoding
  kTagLayerNextPosition = 6,  // absent in snapshots written before layers tracked their own
};

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}

  template <typename T>
  bool Get(T* value) {
    if constexpr (std::is_enum_v<T>) {
      int32_t raw = 0;
      if (!Get(&raw)) return false;
      *value = static_cast<T>(raw);
      return true;
    } else if constexpr (std::is_same_v<T, bool>) {
      uint8_t raw = 0;
      if (!Get(&raw) || raw > 1) return false;
      *value = raw != 0;
      return true;
    } else {
      if (bytes_.size() - pos_ < sizeof(T)) return false;
      std::memcpy(value, bytes_.data() + pos_, sizeof(T));
      pos_ += sizeof(T);
      return true;
    }
  }
  bool GetString(std::string* s) {
    uint64_t n = 0;
    if (!Get(&n) || n > bytes_.size() - pos_) return false;
    s->assign(bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool GetVector(std::vector<T>* v) {
    uint64_t n = 0;
    if (!Get(&n) || n > (bytes_.size() - pos_) / sizeof(T)) return false;
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), bytes_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  bool done() const { return pos_ == bytes_.size(); }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

bool GetSnapKv(Reader& r, SnapKvConfig* c) {
  return r.Get(&c->window) && r.Get(&c->kernel_size) && r.Get(&c->pooling);
}
bool GetCake(Reader& r, CakeConfig* c) {
  return r.Get(&c->window) && r.Get(&c->tau1) && r.Get(&c->tau2) && r.Get(&c->gamma) &&
         r.Get(&c->kernel_size) && r.Get(&c->non_cascading);
}


bool GetPolicy(Reader& r, PolicyConfig* p) {
  D2oConfig& d = p->d2o;
  CaoteConfig& c = p->caote;
  return r.GetString(&p->name) && r.Get(&p->streaming_llm.n_sink) && r.Get(&p->keydiff.anchor) &&
         r.Get(&p->keydiff.metric) && r.Get(&p->keydiff.recent_fraction) && r.Get(&p->h2o.n_sink) &&
         r.Get(&p->h2o.n_recent) && r.Get(&p->tova.all_heads) && GetSnapKv(r, &p->snapkv) &&
         GetCake(r, &p->cake) && r.Get(&d.rho) && r.Get(&d.recent_frac) && r.Get(&d.n_sink) &&
         r.Get(&d.beta) && r.Get(&d.density_mode) && r.Get(&d.min_ratio) && r.Get(&d.max_ratio) &&
         r.GetVector(&d.full_cache_layers) && r.Get(&d.merge_weighting) &&
         r.Get(&d.threshold_scope) && r.Get(&c.base) && r.Get(&c.variant) && r.Get(&c.gqa_reduce) &&
         r.Get(&c.eps) && r.Get(&c.n_sink) && r.Get(&c.n_recent) && r.Get(&c.greedy) &&
         GetSnapKv(r, &c.snapkv) && GetCake(r, &c.cake) && r.Get(&p->allocator.kind) &&
         r.Get(&p->allocator.min_layer_tokens) && r.Get(&p->allocator.pyramid_beta);
}

absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// memcpy with non-temporal stores for the bulk (as glibc's memcpy does for very large copies,
// which a spill's runs of 64 KiB blocks are not): the destination is not pulled into the cache
// first, which halves the memory traffic of a copy much larger than the cache. Call
// StreamFence() before the bytes are handed to another thread.
void StreamCopy(char* destination, const uint8_t* source, uint64_t bytes) {
#if defined(__x86_64__)
  const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(destination) & 15)) & 15;
  if (bytes < head + 64) {
    std::memcpy(destination, source, bytes);
    return;
  }
  std::memcpy(destination, source, head);
  destination += head;
  source += head;
  bytes -= head;
  auto* to = reinterpret_cast<__m128i*>(destination);
  auto* from = reinterpret_cast<const __m128i*>(source);
  for (; bytes >= 64; bytes -= 64, to += 4, from += 4) {
    const __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, d);
  }
  std::memcpy(to, from, bytes);
#else
  std::memcpy(destination, source, bytes);
#endif
}

// The arena byte offsets of the first `count` blocks of a layer's table.
std::vector<uint64_t> BlockOffsets(const std::vector<int32_t>& blocks, int64_t count,
                                   uint64_t block_bytes) {
  std::vector<uint64_t> offsets(static_cast<size_t>(count));
  for (int64_t b = 0; b < count; ++b) offsets[b] = static_cast<uint64_t>(blocks[b]) * block_bytes;
  return offsets;
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

absl::Status Malformed(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("spilled sequence metadata is malformed: ", what));
}

// The first format: fixed-width fields in a fixed order (kMagic). Read, never written.
absl::StatusOr<SequenceSnapshot> DecodeSnapshotV1(std::string_view bytes) {
  Reader r(bytes.substr(kMagicBytes));
  SequenceSnapshot s;
  int32_t dtype = 0;
  int64_t created_ns = 0, last_used_ns = 0;
  uint64_t num_layers = 0;
  if (!(r.GetString(&s.id) && r.Get(&s.layout.num_layers) && r.Get(&s.layout.num_kv_heads) &&
        r.Get(&s.layout.num_q_heads) && r.Get(&s.layout.head_dim) && r.Get(&dtype) &&
        r.Get(&s.layout.block_tokens) && GetPolicy(r, &s.policy) &&
        r.Get(&s.budget.tokens_per_layer) && r.Get(&s.budget.strict) &&
        r.Get(&s.budget.prefill_block_tokens) && r.GetVector(&s.budget.per_layer_tokens) &&
        r.Get(&created_ns) && r.Get(&last_used_ns) && r.Get(&s.next_position) &&
        r.Get(&s.version) && r.Get(&s.last_committed) && r.Get(&s.last_cancelled) &&
        r.Get(&num_layers))) {
    return Malformed("truncated header");
  }
  if (dtype < 1 || dtype > 3) return Malformed(absl::StrCat("dtype ", dtype));
  s.layout.dtype = static_cast<DType>(dtype);
  if (absl::Status status = s.layout.Validate("layout."); !status.ok()) {
    return Malformed(status.message());
  }
  if (num_layers != static_cast<uint64_t>(s.layout.num_layers)) {
    return Malformed(
        absl::StrCat(num_layers, " layer records for ", s.layout.num_layers, " layers"));
  }
  s.created = absl::FromUnixNanos(created_ns);
  s.last_used = absl::FromUnixNanos(last_used_ns);
  s.layers.resize(num_layers);
  for (uint64_t l = 0; l < num_layers; ++l) {
    SequenceSnapshot::Layer& layer = s.layers[l];
    uint64_t heads = 0;
    if (!(r.Get(&layer.count) && r.Get(&layer.appended) && r.Get(&heads))) {
      return Malformed(absl::StrCat("truncated layer ", l));
    }
    if (layer.count < 0 || (heads != 0 && heads != static_cast<uint64_t>(s.layout.num_kv_heads))) {
      return Malformed(absl::StrCat("layer ", l, " count ", layer.count, " heads ", heads));
    }
    layer.positions.resize(heads);
    for (std::vector<int32_t>& head : layer.positions) {
      if (!r.GetVector(&head) || head.size() != static_cast<size_t>(layer.count)) {
        return Malformed(absl::StrCat("positions of layer ", l));
      }
    }
    if (heads == 0 && layer.count != 0) {
      return Malformed(absl::StrCat("layer ", l, " holds tokens without positions"));
    }
    LayerPolicyState& st = layer.state;
    if (!(r.Get(&layer.allocated) && r.GetVector(&st.accumulated) && r.GetVector(&st.indicator) &&
          r.GetVector(&st.threshold) && r.Get(&st.preference) && r.Get(&st.measured) &&
          r.Get(&st.frozen_budget) && r.Get(&st.frozen_for))) {
      return Malformed(absl::StrCat("policy state of layer ", l));
    }
    // Slot-aligned arrays must be whole rows of `count` slots.
    for (const std::vector<float>* v : {&st.accumulated, &st.indicator}) {
      if (!v->empty() && (layer.count == 0 || v->size() % layer.count != 0)) {
        return Malformed(absl::StrCat("policy state of layer ", l, " is not slot-aligned"));
      }
    }
  }
  if (!r.done()) {
    if (!r.GetVector(&s.layer_windows) ||
        s.layer_windows.size() != static_cast<size_t>(s.layout.num_layers) ||
        std::any_of(s.layer_windows.begin(), s.layer_windows.end(),
                    [](int32_t w) { return w < 0; })) {
      return Malformed("layer windows");
    }
  }
  if (!r.done()) return Malformed("trailing bytes");
  return s;
}

}  // namespace

std::string EncodeSnapshot(const SequenceSnapshot& s) {
  FieldWriter w;
  w.Bytes(kTagId, s.id);
  FieldWriter layout;
  layout.I32(kTagNumLayers, s.layout.num_layers);
  layout.I32(kTagNumKvHeads, s.layout.num_kv_heads);
  layout.I32(kTagNumQHeads, s.layout.num_q_heads);
  layout.I32(kTagHeadDim, s.layout.head_dim);
  layout.I32(kTagDType, static_cast<int32_t>(s.layout.dtype));
  layout.I32(kTagBlockTokens, s.layout.block_tokens);
  w.Bytes(kTagLayout, layout.bytes());
  FieldWriter policy;
  // A sequence's policy is always one of the registry's: its configuration was resolved by it.
  (void)EncodePolicyConfig(s.policy, policy);
  w.Bytes(kTagPolicy, policy.bytes());
  FieldWriter budget;
  budget.I32(kTagTokensPerLayer, s.budget.tokens_per_layer);
  budget.Bool(kTagStrict, s.budget.strict);
  budget.I32(kTagPrefillBlockTokens, s.budget.prefill_block_tokens);
  budget.I32s(kTagPerLayerTokens, s.budget.per_layer_tokens);
  w.Bytes(kTagBudget, budget.bytes());
  w.I64(kTagCreatedNs, absl::ToUnixNanos(s.created));
  w.I64(kTagLastUsedNs, absl::ToUnixNanos(s.last_used));
  w.I64(kTagNextPosition, s.next_position);
  w.U64(kTagVersion, s.version);
  w.U64(kTagLastCommitted, s.last_committed);
  w.U64(kTagLastCancelled, s.last_cancelled);
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit(s.policy.name);
  auto encode_state = unit.ok() && (*unit)->encode_state != nullptr ? (*unit)->encode_state
                                                                     : &EncodeLayerState;
  for (const SequenceSnapshot::Layer& layer : s.layers) {
    FieldWriter out;
    out.I32(kTagCount, layer.count);
    out.I64(kTagAppended, layer.appended);
    for (const std::vector<int32_t>& head : layer.positions) out.I32s(kTagPositions, head);
    out.I32(kTagAllocated, layer.allocated);
    if (layer.next_position >= 0) out.I64(kTagLayerNextPosition, layer.next_position);
    FieldWriter state;
    encode_state(layer.state, state);
    out.Bytes(kTagState, state.bytes());
    w.Bytes(kTagLayer, out.bytes());
  }
  if (!s.layer_windows.empty()) w.I32s(kTagLayerWindows, s.layer_windows);
  std::string bytes(kMagicV2, kMagicBytes);
  bytes += w.bytes();
  return bytes;
}

namespace {

absl::StatusOr<SequenceSnapshot> DecodeSnapshotV2(std::string_view bytes) {
  FieldReader r;
  if (!r.Parse(bytes)) return Malformed("truncated field stream");
  SequenceSnapshot s;
  FieldReader layout, budget, policy;
  std::string layout_bytes, budget_bytes, policy_bytes;
  int32_t dtype = 0;
  int64_t created_ns = 0, last_used_ns = 0;
  if (!(r.Bytes(kTagId, &s.id) && r.Bytes(kTagLayout, &layout_bytes) &&
        layout.Parse(layout_bytes) && layout.I32(kTagNumLayers, &s.layout.num_layers) &&
        layout.I32(kTagNumKvHeads, &s.layout.num_kv_heads) &&
        layout.I32(kTagNumQHeads, &s.layout.num_q_heads) &&
        layout.I32(kTagHeadDim, &s.layout.head_dim) && layout.I32(kTagDType, &dtype) &&
        layout.I32(kTagBlockTokens, &s.layout.block_tokens) &&
        r.Bytes(kTagBudget, &budget_bytes) && budget.Parse(budget_bytes) &&
        budget.I32(kTagTokensPerLayer, &s.budget.tokens_per_layer) &&
        budget.Bool(kTagStrict, &s.budget.strict) &&
        budget.I32(kTagPrefillBlockTokens, &s.budget.prefill_block_tokens) &&
        budget.I32s(kTagPerLayerTokens, &s.budget.per_layer_tokens) &&
        r.I64(kTagCreatedNs, &created_ns) && r.I64(kTagLastUsedNs, &last_used_ns) &&
        r.I64(kTagNextPosition, &s.next_position) && r.U64(kTagVersion, &s.version) &&
        r.U64(kTagLastCommitted, &s.last_committed) &&
        r.U64(kTagLastCancelled, &s.last_cancelled) && r.Bytes(kTagPolicy, &policy_bytes) &&
        policy.Parse(policy_bytes))) {
    return Malformed("truncated header");
  }
  if (!r.has(kTagLayout) || !r.has(kTagPolicy)) return Malformed("no layout or policy");
  if (absl::Status status = DecodePolicyConfig(policy, &s.policy); !status.ok()) {
    return Malformed(status.message());
  }
  if (dtype < 1 || dtype > 3) return Malformed(absl::StrCat("dtype ", dtype));
  s.layout.dtype = static_cast<DType>(dtype);
  if (absl::Status status = s.layout.Validate("layout."); !status.ok()) {
    return Malformed(status.message());
  }
  if (!r.I32s(kTagLayerWindows, &s.layer_windows) ||
      (!s.layer_windows.empty() &&
       (s.layer_windows.size() != static_cast<size_t>(s.layout.num_layers) ||
        std::any_of(s.layer_windows.begin(), s.layer_windows.end(),
                    [](int32_t w) { return w < 0; })))) {
    return Malformed("layer windows");
  }
  const std::vector<std::string_view> layers = r.All(kTagLayer);
  if (layers.size() != static_cast<size_t>(s.layout.num_layers)) {
    return Malformed(
        absl::StrCat(layers.size(), " layer records for ", s.layout.num_layers, " layers"));
  }
  s.created = absl::FromUnixNanos(created_ns);
  s.last_used = absl::FromUnixNanos(last_used_ns);
  s.layers.resize(layers.size());
  KVS_ASSIGN_OR_RETURN(const PolicyUnit* unit, FindPolicyUnit(s.policy.name));
  auto decode_state = unit->decode_state != nullptr ? unit->decode_state : &DecodeLayerState;
  for (size_t l = 0; l < layers.size(); ++l) {
    SequenceSnapshot::Layer& layer = s.layers[l];
    FieldReader in, state;
    std::string state_bytes;
    if (!(in.Parse(layers[l]) && in.I32(kTagCount, &layer.count) &&
          in.I64(kTagAppended, &layer.appended) && in.I32(kTagAllocated, &layer.allocated) &&
          in.I64(kTagLayerNextPosition, &layer.next_position))) {
      return Malformed(absl::StrCat("truncated layer ", l));
    }
    const std::vector<std::string_view> heads = in.All(kTagPositions);
    if (layer.count < 0 ||
        (!heads.empty() && heads.size() != static_cast<size_t>(s.layout.num_kv_heads))) {
      return Malformed(absl::StrCat("layer ", l, " count ", layer.count, " heads ", heads.size()));
    }
    layer.positions.resize(heads.size());
    for (size_t h = 0; h < heads.size(); ++h) {
      if (heads[h].size() != static_cast<size_t>(layer.count) * sizeof(int32_t)) {
        return Malformed(absl::StrCat("positions of layer ", l));
      }
      layer.positions[h].resize(layer.count);
      if (layer.count > 0) std::memcpy(layer.positions[h].data(), heads[h].data(), heads[h].size());
    }
    if (heads.empty() && layer.count != 0) {
      return Malformed(absl::StrCat("layer ", l, " holds tokens without positions"));
    }
    LayerPolicyState& st = layer.state;
    if (!(in.Bytes(kTagState, &state_bytes) && state.Parse(state_bytes) &&
          decode_state(state, &st))) {
      return Malformed(absl::StrCat("policy state of layer ", l));
    }
    for (const std::vector<float>* v : {&st.accumulated, &st.indicator}) {
      if (!v->empty() && (layer.count == 0 || v->size() % layer.count != 0)) {
        return Malformed(absl::StrCat("policy state of layer ", l, " is not slot-aligned"));
      }
    }
  }
  return s;
}

}  // namespace

absl::StatusOr<SequenceSnapshot> DecodeSnapshot(std::string_view bytes) {
  if (bytes.size() >= kMagicBytes && bytes.substr(0, kMagicBytes) == std::string_view(kMagicV2)) {
    return DecodeSnapshotV2(bytes.substr(kMagicBytes));
  }
  if (bytes.size() >= kMagicBytes && bytes.substr(0, kMagicBytes) == std::string_view(kMagic)) {
    return DecodeSnapshotV1(bytes);
  }
  return Malformed("bad magic");
}

absl::StatusOr<SpilledSequence> Sequence::Spill(const SequenceEnv& env) const {
  KVS_RETURN_IF_ERROR(SyncHostTables(env));  // the snapshot holds the policy state
  if (pending_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id_,
                                                      " has a pending reservation (", pending_->id,
                                                      "); commit or cancel it before spilling"));
  }
  SequenceSnapshot snapshot;
  snapshot.id = id_;
  snapshot.layout = layout_;
  snapshot.policy = policy_->config();
  snapshot.budget = budget_;
  snapshot.layer_windows = windows_;
  snapshot.created = created_;
  snapshot.last_used = last_used_;
  snapshot.next_position = next_position_;
  snapshot.version = version_;
  snapshot.last_committed = last_committed_;
  snapshot.last_cancelled = last_cancelled_;
  snapshot.layers.resize(layers_.size());
  SpilledSequence out;
  out.layers.resize(layers_.size());
  const uint64_t block_bytes = layout_.block_bytes();
  // A host-mapped arena: copy straight from it with streaming stores (the spilled bytes are not
  // read again soon; Arena::Read copies in small cached pieces). A device arena goes through Read.
  const bool host_arena = env.arena.host_mapped();
  for (size_t l = 0; l < layers_.size(); ++l) {
    SequenceSnapshot::Layer& layer = snapshot.layers[l];
    layer.count = layers_[l].count;
    layer.appended = layers_[l].appended;
    layer.positions = layers_[l].positions;
    layer.allocated = allocated_[l];
    layer.next_position = layers_[l].next_position;
    layer.state = states_[l];
    layer.state.step_scores.clear();
    layer.state.step_protected_recent = 0;
    const int64_t blocks = snapshot.LayerBlocks(l);
    if (blocks > static_cast<int64_t>(layers_[l].blocks.size())) {
      return absl::InternalError(absl::StrCat("sequence ", id_, " layer ", l, " holds ",
                                              layers_[l].count, " tokens in ",
                                              layers_[l].blocks.size(), " blocks"));
    }
    // A recycled buffer (cache/spill_buffers.h): a fresh one costs a fault and a zero fill per
    // page, more than the copy itself. Every byte is overwritten below.
    std::string& bytes = out.layers[l];
    bytes = SpillBuffers::Default().Take(static_cast<size_t>(blocks) * block_bytes);
    if (!host_arena) {
      // A device arena gathers the layer's blocks and crosses the bus in large pieces.
      KVS_RETURN_IF_ERROR(env.arena.ReadBlocks(BlockOffsets(layers_[l].blocks, blocks, block_bytes),
                                               block_bytes, bytes.data()));
      continue;
    }
    for (int64_t b = 0; b < blocks;) {
      // Runs of blocks adjacent in the arena move as one copy.
      const uint64_t offset = static_cast<uint64_t>(layers_[l].blocks[b]) * block_bytes;
      int64_t run = 1;
      while (b + run < blocks && layers_[l].blocks[b + run] == layers_[l].blocks[b] + run) ++run;
      const uint64_t run_bytes = static_cast<uint64_t>(run) * block_bytes;
      char* destination = bytes.data() + b * block_bytes;
      if (offset <= env.arena.size_bytes() && run_bytes <= env.arena.size_bytes() - offset) {
        StreamCopy(destination, env.arena.data() + offset, run_bytes);
      } else {
        KVS_RETURN_IF_ERROR(env.arena.Read(offset, destination, run_bytes));
      }
      b += run;
    }
  }
  if (host_arena) StreamFence();
  out.meta = EncodeSnapshot(snapshot);
  return out;
}

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Restore(const SequenceEnv& env,
                                                            const SpilledSequence& data,
                                                            std::string_view id) {
  KVS_ASSIGN_OR_RETURN(SequenceSnapshot snapshot, DecodeSnapshot(data.meta));
  if (!id.empty()) snapshot.id = std::string(id);
  const ModelLayout& have = snapshot.layout;
  const ModelLayout& want = env.layout;
  if (have.num_layers != want.num_layers || have.num_kv_heads != want.num_kv_heads ||
      have.num_q_heads != want.num_q_heads || have.head_dim != want.head_dim ||
      have.dtype != want.dtype || have.block_tokens != want.block_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", snapshot.id, " was spilled from a session with layout L=", have.num_layers,
        " H=", have.num_kv_heads, " Hq=", have.num_q_heads, " D=", have.head_dim, " dtype=",
        static_cast<int>(have.dtype), " B=", have.block_tokens, "; session ", Sv(env.session_id),
        " has L=", want.num_layers, " H=", want.num_kv_heads, " Hq=", want.num_q_heads,
        " D=", want.head_dim, " dtype=", static_cast<int>(want.dtype), " B=", want.block_tokens));
  }
  if (data.layers.size() != snapshot.layers.size()) {
    return absl::DataLossError(absl::StrCat("spilled sequence ", snapshot.id, " has ",
                                            data.layers.size(), " layer records for ",
                                            snapshot.layers.size(), " layers"));
  }
  const uint64_t block_bytes = want.block_bytes();
  int64_t total_blocks = 0;
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const int64_t blocks = snapshot.LayerBlocks(l);
    if (data.layers[l].size() != static_cast<uint64_t>(blocks) * block_bytes) {
      return absl::DataLossError(absl::StrCat("spilled sequence ", snapshot.id, " layer ", l,
                                              " has ", data.layers[l].size(), " bytes, expected ",
                                              static_cast<uint64_t>(blocks) * block_bytes));
    }
    total_blocks += blocks;
  }
  if (total_blocks > env.allocator.num_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", snapshot.id, " needs ", total_blocks, " blocks, the arena of ",
                     "session ", Sv(env.session_id), " has ", env.allocator.num_blocks()));
  }
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, MakePolicy(snapshot.policy));
  std::vector<int32_t> blocks;
  if (absl::Status status = env.allocator.Allocate(static_cast<int32_t>(total_blocks), &blocks);
      !status.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "restoring sequence ", snapshot.id, " needs ", total_blocks, " free blocks; session ",
        Sv(env.session_id), " has ", env.allocator.free_blocks(), " (", status.message(), ")"));
  }
  auto sequence = std::make_unique<Sequence>(snapshot.id, want, std::move(policy), snapshot.budget,
                                             snapshot.created);
  sequence->windows_ = std::move(snapshot.layer_windows);
  size_t next = 0;
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    SequenceSnapshot::Layer& from = snapshot.layers[l];
    LayerState& to = sequence->layers_[l];
    const int64_t n = snapshot.LayerBlocks(l);
    to.blocks.assign(blocks.begin() + next, blocks.begin() + next + n);
    next += n;
    to.count = from.count;
    to.appended = from.appended;
    to.next_position = from.next_position >= 0 ? from.next_position : snapshot.next_position;
    to.positions = std::move(from.positions);
    // Runs of adjacent blocks as one copy; a device arena scatters from large bus transfers.
    absl::Status status = env.arena.WriteBlocks(BlockOffsets(to.blocks, n, block_bytes),
                                                block_bytes, data.layers[l].data());
    if (!status.ok()) {
      (void)env.allocator.Free(blocks);
      return status;
    }
    sequence->states_[l] = std::move(from.state);
    sequence->allocated_[l] = from.allocated;
  }
  sequence->last_used_ = snapshot.last_used;
  sequence->next_position_ = snapshot.next_position;
  // The block tables changed: a worker holding the old layout must see a new version.
  sequence->version_ = snapshot.version + 1;
  sequence->last_committed_ = snapshot.last_committed;
  sequence->last_cancelled_ = snapshot.last_cancelled;
  return sequence;
}

}  // namespace kvs
