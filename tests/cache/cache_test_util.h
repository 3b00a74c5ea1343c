// Shared helpers of the cache tests: a pool on the CPU backend with a fake clock, payloads whose
// every element is a pure function of (layer, kv, head, position, d) so that any kept token can
// be checked bit for bit after any number of compactions, and an append helper (reserve, write in
// row-splitting chunks, commit).
#ifndef KVSIDECAR_TESTS_CACHE_CACHE_TEST_UTIL_H_
#define KVSIDECAR_TESTS_CACHE_CACHE_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/base/layout.h"
#include "gtest/gtest.h"
#include "tests/test_backend.h"

namespace kvs::testing_util {

inline ModelLayout MakeLayout(int32_t layers, int32_t heads, int32_t dim, DType dtype,
                              int32_t block_tokens) {
  ModelLayout layout;
  layout.num_layers = layers;
  layout.num_kv_heads = heads;
  layout.num_q_heads = heads;
  layout.head_dim = dim;
  layout.dtype = dtype;
  layout.block_tokens = block_tokens;
  return layout;
}

// Element d of the (layer, kv, head) row of the token at `position`.
using ValueFn = std::function<float(int layer, int kv, int head, int32_t position, int d)>;

inline float HashValue(int layer, int kv, int head, int32_t position, int d) {
  uint32_t x = static_cast<uint32_t>(layer) * 0x9E3779B1u;
  x ^= static_cast<uint32_t>(kv + 1) * 0x85EBCA77u;
  x = (x ^ (x >> 15)) * 0x2C1B3C6Du;
  x ^= static_cast<uint32_t>(head + 7) * 0xC2B2AE3Du;
  x = (x ^ (x >> 13)) * 0x297A2D39u;
  x ^= static_cast<uint32_t>(position + 13) * 0x27D4EB2Fu;
  x = (x ^ (x >> 16)) * 0x165667B1u;
  x ^= static_cast<uint32_t>(d + 3) * 0xD3A2646Cu;
  x ^= x >> 15;
  return static_cast<float>(static_cast<int32_t>(x % 4001) - 2000) / 256.0f;
}

// The bytes of one row as stored in `layout.dtype`.
inline std::vector<uint8_t> RowBytes(const ModelLayout& layout, const ValueFn& fn, int layer,
                                     int kv, int head, int32_t position) {
  std::vector<uint8_t> row(layout.row_bytes());
  for (int d = 0; d < layout.head_dim; ++d) {
    StoreFromFloat(row.data(), layout.dtype, d, fn(layer, kv, head, position, d));
  }
  return row;
}

// Inline payload [layers][2][H][T][D] for tokens at `positions`.
inline std::vector<uint8_t> BuildPayload(const ModelLayout& layout,
                                         absl::Span<const int32_t> layers,
                                         absl::Span<const int32_t> positions, const ValueFn& fn) {
  std::vector<uint8_t> payload;
  payload.reserve(layers.size() * positions.size() * layout.token_bytes());
  for (int32_t layer : layers) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        for (int32_t p : positions) {
          const std::vector<uint8_t> row = RowBytes(layout, fn, layer, kv, h, p);
          payload.insert(payload.end(), row.begin(), row.end());
        }
      }
    }
  }
  return payload;
}

inline std::vector<int32_t> ReservedLayers(const Reservation& reservation) {
  std::vector<int32_t> layers;
  for (const LayerSlots& slots : reservation.layers) layers.push_back(slots.layer);
  return layers;
}

// Reserve + write (in chunks of `chunk` bytes, which split rows) + commit.
struct AppendOptions {
  std::vector<int32_t> positions;  // empty = next
  std::vector<int32_t> layers;     // empty = all
  bool compress = false;
  uint64_t chunk = 1000;
};

inline absl::StatusOr<CommitResult> Append(KvPool& pool, const std::string& session,
                                           const std::string& sequence, int32_t num_tokens,
                                           const ModelLayout& layout, const ValueFn& fn,
                                           const AppendOptions& options = {},
                                           Reservation* reserved = nullptr) {
  absl::StatusOr<Reservation> reservation =
      pool.Reserve(session, sequence, num_tokens, options.positions, options.layers);
  if (!reservation.ok()) return reservation.status();
  if (reserved != nullptr) *reserved = *reservation;
  const std::vector<uint8_t> payload =
      BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, fn);
  if (payload.size() != reservation->payload_bytes) {
    return absl::InternalError(absl::StrCat("payload ", payload.size(), " bytes, reservation ",
                                            reservation->payload_bytes));
  }
  for (uint64_t offset = 0; offset < payload.size(); offset += options.chunk) {
    const uint64_t n = std::min<uint64_t>(options.chunk, payload.size() - offset);
    absl::Status status = pool.WriteReserved(session, sequence, reservation->reservation_id, offset,
                                             absl::MakeConstSpan(payload.data() + offset, n));
    if (!status.ok()) return status;
  }
  return pool.Commit(session, sequence, reservation->reservation_id, options.compress);
}

// Checks every kept row of `sequence` (read through ReadExport, in odd-sized pieces) against
// `fn` at the row's position, and that heads hold distinct positions.
inline ::testing::AssertionResult ContentsMatch(const KvPool& pool, const std::string& session,
                                                const std::string& sequence,
                                                const ModelLayout& layout, const ValueFn& fn) {
  absl::StatusOr<SequenceLayout> view = pool.GetLayout(session, sequence, {}, true);
  if (!view.ok()) return ::testing::AssertionFailure() << view.status();
  uint64_t total = 0;
  for (const LayerLayoutView& l : view->layers) {
    total += 2ull * layout.num_kv_heads * l.count * layout.row_bytes();
  }
  std::vector<uint8_t> exported(total);
  for (uint64_t offset = 0; offset < total; offset += 777) {
    const uint64_t n = std::min<uint64_t>(777, total - offset);
    absl::Status status = pool.ReadExport(session, sequence, {}, view->version, offset,
                                          absl::MakeSpan(exported.data() + offset, n));
    if (!status.ok()) return ::testing::AssertionFailure() << status;
  }
  uint64_t cursor = 0;
  const uint64_t row_bytes = layout.row_bytes();
  for (const LayerLayoutView& l : view->layers) {
    if (l.positions.size() != static_cast<size_t>(layout.num_kv_heads) * l.count) {
      return ::testing::AssertionFailure() << "layer " << l.layer << " has " << l.positions.size()
                                           << " positions for count " << l.count;
    }
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      std::vector<int32_t> head(l.positions.begin() + h * l.count,
                                l.positions.begin() + (h + 1) * l.count);
      std::sort(head.begin(), head.end());
      if (std::adjacent_find(head.begin(), head.end()) != head.end()) {
        return ::testing::AssertionFailure()
               << "layer " << l.layer << " head " << h << " holds a position twice";
      }
    }
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        for (int32_t s = 0; s < l.count; ++s) {
          const int32_t position = l.positions[h * l.count + s];
          const std::vector<uint8_t> expected = RowBytes(layout, fn, l.layer, kv, h, position);
          if (std::memcmp(exported.data() + cursor, expected.data(), row_bytes) != 0) {
            return ::testing::AssertionFailure()
                   << "layer " << l.layer << " kv " << kv << " head " << h << " slot " << s
                   << " (position " << position << ") differs from what was written";
          }
          cursor += row_bytes;
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Sorted positions of one head of one layer.
inline std::vector<int32_t> HeadPositions(const LayerLayoutView& layer, int head) {
  std::vector<int32_t> out(layer.positions.begin() + head * layer.count,
                           layer.positions.begin() + (head + 1) * layer.count);
  std::sort(out.begin(), out.end());
  return out;
}

// A pool with a fake clock and a small capacity on MakeTestBackend, for tests.
struct TestPool {
  explicit TestPool(PoolOptions options = DefaultOptions())
      : backend(MakeTestBackend(2)), pool(backend.get(), &clock, std::move(options)) {}

  static PoolOptions DefaultOptions() {
    PoolOptions options;
    options.arena_capacity_bytes = uint64_t{64} << 20;
    options.default_session_bytes = uint64_t{1} << 20;
    options.arena_options.name_prefix = "kvs-cache-test";
    return options;
  }

  // Attaches a session with `num_blocks` blocks; fails the test on error.
  std::string Attach(const ModelLayout& layout, int32_t num_blocks) {
    AttachParams params;
    params.layout = layout;
    params.num_blocks = num_blocks;
    absl::StatusOr<SessionView> view = pool.Attach(params);
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? view->session_id : std::string();
  }

  std::string Create(const std::string& session, const PolicyConfig& policy,
                     const BudgetConfig& budget, const std::string& id = "") {
    SequenceParams params;
    params.policy = policy;
    params.budget = budget;
    params.sequence_id = id;
    absl::StatusOr<SequenceCreated> created = pool.CreateSequence(session, params);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->sequence_id : std::string();
  }

  int32_t FreeBlocks(const std::string& session) const {
    for (const SessionInfo& info : pool.ListSessions()) {
      if (info.session_id == session) return info.free_blocks;
    }
    return -1;
  }

  std::unique_ptr<Backend> backend;
  FakeClock clock;
  KvPool pool;
};

inline PolicyConfig KeyDiff(KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized,
                            KeyDiffMetric metric = KeyDiffMetric::kCosine,
                            float recent_fraction = 0.0f) {
  PolicyConfig config;
  config.name = kPolicyKeyDiff;
  config.keydiff.anchor = anchor;
  config.keydiff.metric = metric;
  config.keydiff.recent_fraction = recent_fraction;
  return config;
}

inline PolicyConfig StreamingLlm(int32_t n_sink) {
  PolicyConfig config;
  config.name = kPolicyStreamingLlm;
  config.streaming_llm.n_sink = n_sink;
  return config;
}

inline BudgetConfig Budget(int32_t tokens, bool strict = false, int32_t block = 128) {
  BudgetConfig budget;
  budget.tokens_per_layer = tokens;
  budget.strict = strict;
  budget.prefill_block_tokens = block;
  return budget;
}

struct BlockRun {
  std::vector<std::vector<int32_t>> kept;  // head 0's kept positions after each block (layer 0)
  int32_t peak = 0;                        // most tokens layer 0 held after any commit
  std::vector<int32_t> evicted_before;     // per block
};

// Strict-budget block-wise stream (keydiff.md §3.3 with §9's evict-then-append) on a new
// sequence: each block is reserved (which first evicts the previous candidates down to the
// budget), written and committed. The kept set after block b is what the sequence holds once
// block b + 1 is reserved; after the last block, what an explicit Compress keeps.
inline BlockRun RunBlocks(TestPool& pool, const std::string& session, const ModelLayout& layout,
                          const PolicyConfig& policy, const ValueFn& fn, int32_t budget,
                          int32_t block_tokens, const std::vector<int32_t>& blocks) {
  BlockRun run;
  const std::string seq = pool.Create(session, policy, Budget(budget, true, block_tokens));
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto reservation = pool.pool.Reserve(session, seq, blocks[b], {}, {});
    EXPECT_TRUE(reservation.ok()) << reservation.status();
    if (!reservation.ok()) return run;
    run.evicted_before.push_back(reservation->evicted_before);
    if (b > 0) {
      auto view = pool.pool.GetLayout(session, seq, {}, true);
      run.kept.push_back(HeadPositions(view->layers[0], 0));
    }
    const auto payload =
        BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, fn);
    EXPECT_TRUE(
        pool.pool.WriteReserved(session, seq, reservation->reservation_id, 0, payload).ok());
    auto commit = pool.pool.Commit(session, seq, reservation->reservation_id, false);
    EXPECT_TRUE(commit.ok()) << commit.status();
    if (!commit.ok()) return run;
    run.peak = std::max(run.peak, commit->counts[0]);
  }
  auto result = pool.pool.Compress(session, seq, CompressParams{});
  EXPECT_TRUE(result.ok()) << result.status();
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  run.kept.push_back(HeadPositions(view->layers[0], 0));
  EXPECT_TRUE(ContentsMatch(pool.pool, session, seq, layout, fn));
  return run;
}

}  // namespace kvs::testing_util

#endif  // KVSIDECAR_TESTS_CACHE_CACHE_TEST_UTIL_H_
