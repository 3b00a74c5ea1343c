// retain_evicted (cache/retained.cc) on real pools with the real host tier: what every eviction
// path evicts comes back through GetRetained bit for bit with its position and score, in
// eviction order; a host tier too small fails the evicting call without evicting; release
// returns the host bytes.
#include <string>
#include <vector>

#include "cache/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/tier_manager.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::Append;
using testing_util::AppendOptions;
using testing_util::Budget;
using testing_util::HashValue;
using testing_util::KeyDiff;
using testing_util::MakeLayout;
using testing_util::RowBytes;
using testing_util::StreamingLlm;
using testing_util::TestPool;

MATCHER_P2(StatusIs, code, substring, "") {
  return arg.code() == code && std::string(arg.message()).find(substring) != std::string::npos;
}

struct Fixture {
  explicit Fixture(uint64_t host_bytes = uint64_t{1} << 20)
      : layout(MakeLayout(3, 2, 8, DType::kFloat16, 4)),
        tiers(storage::TierManager::Open({host_bytes, "", 0})),
        pool(Options(tiers.get())) {
    session = pool.Attach(layout, 128);
  }
  static PoolOptions Options(SequenceTiers* tiers) {
    PoolOptions options = TestPool::DefaultOptions();
    options.tiers = tiers;
    return options;
  }
  std::string Create(const PolicyConfig& policy, int32_t budget, const std::string& id,
                     bool retain = true) {
    SequenceParams params;
    params.policy = policy;
    params.budget = Budget(budget);
    params.sequence_id = id;
    params.retain_evicted = retain;
    absl::StatusOr<SequenceCreated> created = pool.pool.CreateSequence(session, params);
    EXPECT_TRUE(created.ok()) << created.status();
    return id;
  }
  ModelLayout layout;
  std::unique_ptr<storage::TierManager> tiers;
  TestPool pool;
  std::string session;
};

std::string Rows(const ModelLayout& layout, int layer, int kv, int head,
                 const std::vector<int32_t>& positions) {
  std::string rows;
  for (int32_t p : positions) {
    const std::vector<uint8_t> row = RowBytes(layout, HashValue, layer, kv, head, p);
    rows.append(row.begin(), row.end());
  }
  return rows;
}

TEST(RetainEvicted, CompressKeepsWhatItEvictsInOrder) {
  Fixture f;
  const std::string seq = f.Create(StreamingLlm(1), 4, "s");
  AppendOptions compress;
  compress.compress = true;
  ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 10, f.layout, HashValue, compress).ok());
  // StreamingLLM keeps the sink (0) and the newest three: 1..6 were evicted.
  ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 2, f.layout, HashValue, compress).ok());
  // Then 7 and 8.
  absl::StatusOr<std::vector<RetainedHead>> retained = f.pool.pool.GetRetained(f.session, seq, {});
  ASSERT_TRUE(retained.ok()) << retained.status();
  ASSERT_EQ(retained->size(), 3u * 2);
  for (const RetainedHead& head : *retained) {
    EXPECT_THAT(head.positions, ElementsAre(1, 2, 3, 4, 5, 6, 7, 8))
        << "layer " << head.layer << " head " << head.head;
    EXPECT_EQ(head.scores.size(), 8u);
    EXPECT_EQ(head.keys, Rows(f.layout, head.layer, 0, head.head, head.positions));
    EXPECT_EQ(head.values, Rows(f.layout, head.layer, 1, head.head, head.positions));
  }
  // Only layer 2, and the host tier holds exactly what GetRetained can return plus the index.
  retained = f.pool.pool.GetRetained(f.session, seq, {2});
  ASSERT_TRUE(retained.ok());
  ASSERT_EQ(retained->size(), 2u);
  EXPECT_EQ((*retained)[0].layer, 2);
  const uint64_t entries = 3 * 2 * 8;
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, entries * (16 + 2 * f.layout.row_bytes()));
  std::vector<SequenceInfo> listed = f.pool.pool.ListSequences(f.session);
  EXPECT_EQ(listed[0].host_bytes, f.tiers->GetStats().host_bytes_used);

  // Not spillable; release gives the host bytes back.
  EXPECT_THAT(f.pool.pool.Spill(f.session, seq, StorageTier::kHost).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "cannot be spilled"));
  ASSERT_TRUE(f.pool.pool.ReleaseSequence(f.session, seq).ok());
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, 0u);
}

TEST(RetainEvicted, DecodeStepEvictionsAreRetainedWithTheirScores) {
  Fixture f;
  const std::string a = f.Create(KeyDiff(), 6, "a");
  const std::string b = f.Create(KeyDiff(), 6, "b");
  for (const std::string& seq : {a, b}) {
    ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 6, f.layout, HashValue).ok());
  }
  std::vector<DecodeItem> items(2);
  for (int i = 0; i < 2; ++i) {
    items[i].session_id = f.session;
    items[i].sequence_id = i == 0 ? a : b;
    items[i].inline_kv.resize(f.layout.token_bytes() * f.layout.num_layers);
    for (int l = 0; l < f.layout.num_layers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < 2; ++h) {
          const std::vector<uint8_t> row = RowBytes(f.layout, HashValue, l, kv, h, 6);
          std::copy(row.begin(), row.end(),
                    items[i].inline_kv.begin() + ((l * 2 + kv) * 2 + h) * f.layout.row_bytes());
        }
      }
    }
  }
  absl::StatusOr<std::vector<DecodeResult>> results = f.pool.pool.DecodeStep(items);
  ASSERT_TRUE(results.ok()) << results.status();
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::vector<RetainedHead>> retained =
        f.pool.pool.GetRetained(f.session, items[i].sequence_id, {});
    ASSERT_TRUE(retained.ok());
    for (const RetainedHead& head : *retained) {
      // One token per (layer, head): the one DecodeStep reports as evicted.
      ASSERT_EQ(head.positions.size(), 1u);
      EXPECT_EQ(head.positions[0], (*results)[i].evicted_positions[head.layer * 2 + head.head]);
      EXPECT_TRUE(std::isfinite(head.scores[0]));
      EXPECT_EQ(head.keys, Rows(f.layout, head.layer, 0, head.head, head.positions));
    }
  }
}

TEST(RetainEvicted, HostTierTooSmallEvictsNothing) {
  Fixture f(/*host_bytes=*/100);
  const std::string seq = f.Create(StreamingLlm(1), 4, "s");
  ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 10, f.layout, HashValue).ok());
  const int32_t free_before = f.pool.FreeBlocks(f.session);
  CompressParams params;
  EXPECT_THAT(f.pool.pool.Compress(f.session, seq, params).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "nothing was evicted"));
  absl::StatusOr<SequenceLayout> layout = f.pool.pool.GetLayout(f.session, seq, {}, false);
  ASSERT_TRUE(layout.ok());
  for (const LayerLayoutView& layer : layout->layers) EXPECT_EQ(layer.count, 10);
  EXPECT_EQ(f.pool.FreeBlocks(f.session), free_before);
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, 0u);
}

// A decode step whose evictions cannot be retained (host tier full) fails without a trace: the
// token it brought is not appended, so the worker may retry the same step.
TEST(RetainEvicted, DecodeStepThatCannotRetainLeavesTheSequenceAsItWas) {
  Fixture f(/*host_bytes=*/100);
  const std::string seq = f.Create(StreamingLlm(1), 4, "s");
  ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 4, f.layout, HashValue).ok());
  const int32_t free_before = f.pool.FreeBlocks(f.session);
  std::vector<DecodeItem> items(1);
  items[0].session_id = f.session;
  items[0].sequence_id = seq;
  items[0].inline_kv.resize(f.layout.token_bytes() * f.layout.num_layers);
  for (int l = 0; l < f.layout.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < 2; ++h) {
        const std::vector<uint8_t> row = RowBytes(f.layout, HashValue, l, kv, h, 4);
        std::copy(row.begin(), row.end(),
                  items[0].inline_kv.begin() + ((l * 2 + kv) * 2 + h) * f.layout.row_bytes());
      }
    }
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THAT(f.pool.pool.DecodeStep(items).status(),
                StatusIs(absl::StatusCode::kResourceExhausted, "nothing was evicted"));
    absl::StatusOr<SequenceLayout> layout = f.pool.pool.GetLayout(f.session, seq, {}, true);
    ASSERT_TRUE(layout.ok());
    for (const LayerLayoutView& layer : layout->layers) {
      EXPECT_EQ(layer.count, 4) << "attempt " << attempt;
    }
    EXPECT_EQ(f.pool.FreeBlocks(f.session), free_before) << "attempt " << attempt;
  }
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, 0u);
}

TEST(RetainEvicted, RefusedWhereItCannotApply) {
  Fixture f;
  const std::string plain = f.Create(StreamingLlm(1), 4, "plain", /*retain=*/false);
  EXPECT_THAT(f.pool.pool.GetRetained(f.session, plain, {}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "not created with retain_evicted"));
  const std::string seq = f.Create(StreamingLlm(1), 4, "s");
  EXPECT_THAT(f.pool.pool.GetRetained(f.session, seq, {7}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "layers[0]"));
  SequenceParams omnikv;
  omnikv.policy = PolicyConfig{};
  omnikv.policy->name = kPolicyOmniKv;
  omnikv.policy->omnikv.filter_layers = {0};
  omnikv.retain_evicted = true;
  EXPECT_THAT(f.pool.pool.CreateSequence(f.session, omnikv).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "retain_evicted"));
  TestPool no_tiers;
  const std::string session = no_tiers.Attach(f.layout, 16);
  SequenceParams params;
  params.retain_evicted = true;
  EXPECT_THAT(no_tiers.pool.CreateSequence(session, params).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "host tier"));
}

// The calls on a session already looked up (SessionRef) behave as by id: they work on a live
// session; the tier calls answer a bad parameter before a failed lookup; and every call through
// a handle whose session ended after the lookup answers the NOT_FOUND of a call by id.
TEST(RetainEvicted, SessionRefCallsAnswerAsByIdAndASessionEndedAfterTheLookup) {
  Fixture f;
  absl::StatusOr<SessionRef> ref = f.pool.pool.FindSession(f.session);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::string plain = f.Create(KeyDiff(), 0, "plain", /*retain=*/false);
  const std::string kept = f.Create(StreamingLlm(1), 4, "kept");
  AppendOptions compress;
  compress.compress = true;
  ASSERT_TRUE(Append(f.pool.pool, f.session, kept, 10, f.layout, HashValue, compress).ok());
  ASSERT_TRUE(Append(f.pool.pool, f.session, plain, 3, f.layout, HashValue).ok());
  absl::StatusOr<std::vector<RetainedHead>> retained = f.pool.pool.GetRetained(*ref, kept, {});
  ASSERT_TRUE(retained.ok()) << retained.status();
  EXPECT_EQ(retained->size(), 3u * 2);
  EXPECT_TRUE(f.pool.pool.Heartbeat(*ref).ok());
  absl::StatusOr<SpillResult> spilled = f.pool.pool.Spill(*ref, plain, StorageTier::kHost);
  ASSERT_TRUE(spilled.ok()) << spilled.status();
  EXPECT_EQ(spilled->tier, StorageTier::kHost);
  absl::StatusOr<SpillResult> restored = f.pool.pool.Restore(*ref, plain);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->tier, StorageTier::kHost);

  // A bad parameter with a missing session: the parameter's INVALID_ARGUMENT, as by id.
  const absl::StatusOr<SessionRef> missing = f.pool.pool.FindSession("missing");
  const std::string bad_key = "not-a-key";
  const std::string key(64, 'a');
  for (const bool by_ref : {false, true}) {
    SCOPED_TRACE(by_ref ? "by handle" : "by id");
    EXPECT_THAT(by_ref ? f.pool.pool.Spill(missing, plain, static_cast<StorageTier>(9)).status()
                       : f.pool.pool.Spill("missing", plain, static_cast<StorageTier>(9)).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, "target must be"));
    EXPECT_THAT(by_ref ? f.pool.pool.Publish(missing, plain, bad_key, 0).status()
                       : f.pool.pool.Publish("missing", plain, bad_key, 0).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, "prefix_key"));
    EXPECT_THAT(by_ref ? f.pool.pool.Publish(missing, plain, key, -1).status()
                       : f.pool.pool.Publish("missing", plain, key, -1).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, "query_window"));
    EXPECT_THAT(by_ref ? f.pool.pool.Unpublish(missing, bad_key)
                       : f.pool.pool.Unpublish("missing", bad_key),
                StatusIs(absl::StatusCode::kInvalidArgument, "prefix_key"));
    EXPECT_THAT(by_ref ? f.pool.pool.Restore(missing, plain).status()
                       : f.pool.pool.Restore("missing", plain).status(),
                StatusIs(absl::StatusCode::kNotFound, "session missing not found"));
  }

  // A reservation written through the handle, then the session ends while the handle is held.
  absl::StatusOr<Reservation> pending = f.pool.pool.Reserve(*ref, plain, 1, {}, {});
  ASSERT_TRUE(pending.ok()) << pending.status();
  const std::vector<uint8_t> bytes(8, 1);
  ASSERT_TRUE(f.pool.pool.WriteReserved(*ref, plain, pending->reservation_id, 0, bytes).ok());
  ASSERT_TRUE(f.pool.pool.Detach(f.session).ok());
  const std::string gone = "session " + f.session + " not found";
  EXPECT_THAT(f.pool.pool.WriteReserved(*ref, plain, pending->reservation_id, 0, bytes),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.ReleaseSequence(*ref, plain).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.GetRetained(*ref, kept, {}).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Spill(*ref, plain, StorageTier::kHost).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Restore(*ref, plain).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Publish(*ref, kept, key, 4).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Unpublish(*ref, key), StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Heartbeat(*ref).status(), StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(f.pool.pool.Detach(*ref).status(), StatusIs(absl::StatusCode::kNotFound, gone));
}

}  // namespace
}  // namespace kvs
