#include "cache/pool.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::Append;
using testing_util::Budget;
using testing_util::BuildPayload;
using testing_util::ContentsMatch;
using testing_util::HashValue;
using testing_util::KeyDiff;
using testing_util::MakeLayout;
using testing_util::ReservedLayers;
using testing_util::StreamingLlm;
using testing_util::TestPool;

MATCHER_P2(StatusIs, code, substring, "") {
  return arg.code() == code && std::string(arg.message()).find(substring) != std::string::npos;
}

// Everything observable about a sequence, to show that a failed call changed nothing.
struct Snapshot {
  std::vector<LayerLayoutView> layers;
  uint64_t version = 0;
  int32_t next_position = 0;
  int32_t free_blocks = 0;
  bool operator==(const Snapshot& other) const {
    if (version != other.version || next_position != other.next_position ||
        free_blocks != other.free_blocks || layers.size() != other.layers.size()) {
      return false;
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i].count != other.layers[i].count ||
          layers[i].block_table != other.layers[i].block_table ||
          layers[i].positions != other.layers[i].positions) {
        return false;
      }
    }
    return true;
  }
};

Snapshot Snap(TestPool& pool, const std::string& session, const std::string& seq) {
  Snapshot snap;
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  EXPECT_TRUE(view.ok()) << view.status();
  if (view.ok()) {
    snap.layers = view->layers;
    snap.version = view->version;
    snap.next_position = view->next_position;
  }
  snap.free_blocks = pool.FreeBlocks(session);
  return snap;
}

class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = MakeLayout(2, 2, 4, DType::kFloat16, 4);
    session_ = pool_.Attach(layout_, 40);
    seq_ = pool_.Create(session_, KeyDiff(), Budget(0), "seq-1");
  }
  ModelLayout layout_;
  TestPool pool_;
  std::string session_;
  std::string seq_;
};

TEST(PoolAttachTest, ResolvesDefaults) {
  TestPool pool;
  AttachParams params;
  params.layout = MakeLayout(2, 2, 8, DType::kBFloat16, 0);
  params.worker_name = "w1";
  auto view = pool.pool.Attach(params);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->session_id.size(), 32u);
  EXPECT_EQ(view->session_id.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(view->layout.block_tokens, kDefaultBlockTokens);
  EXPECT_EQ(view->block_bytes, 2u * 2 * 16 * 8 * 2);
  EXPECT_EQ(view->num_blocks, static_cast<int32_t>((1u << 20) / view->block_bytes));
  EXPECT_EQ(view->arena.size_bytes, static_cast<uint64_t>(view->num_blocks) * view->block_bytes);
  EXPECT_EQ(view->lease, absl::Seconds(10));
  EXPECT_EQ(view->lease_expires, pool.clock.Now() + absl::Seconds(10));
  auto sessions = pool.pool.ListSessions();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].tenant, "default");
  EXPECT_EQ(sessions[0].worker_name, "w1");
  EXPECT_EQ(sessions[0].free_blocks, view->num_blocks);
  auto again = pool.pool.GetSession(view->session_id);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->arena.generation, view->arena.generation);
  // A host arena is a memfd; the CUDA backend's is device memory shared through CUDA IPC.
  EXPECT_EQ(again->arena.kind, testing_util::TestBackendName() == "cuda"
                                   ? ArenaHandle::Kind::kCudaIpc
                                   : ArenaHandle::Kind::kMemfd);
}

TEST(PoolAttachTest, Validation) {
  TestPool pool;
  AttachParams params;
  params.layout = MakeLayout(2, 2, 0, DType::kFloat16, 4);
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "layout.head_dim"));
  params.layout = MakeLayout(2, 3, 8, DType::kFloat16, 4);
  params.layout.num_q_heads = 4;
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "layout.num_q_heads"));
  params.layout = MakeLayout(2, 2, 8, DType::kFloat16, 4);
  params.num_blocks = -1;
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "num_blocks"));
  params.num_blocks = 4;
  params.lease = absl::Milliseconds(50);
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "lease_ms must be in [100, 600000]"));
  params.lease = absl::Hours(1);
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "lease_ms"));
  params.lease = absl::ZeroDuration();
  params.tenant = std::string(300, 't');
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "tenant"));
  EXPECT_EQ(pool.pool.GetStats().sessions, 0);
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 0u);
}

TEST(PoolAttachTest, CapacityIsEnforcedInWholePagesAndReturned) {
  PoolOptions options = TestPool::DefaultOptions();
  const ModelLayout layout = MakeLayout(1, 1, 8, DType::kFloat32, 4);  // 256-byte blocks
  options.arena_capacity_bytes = 4096 * 7;
  TestPool pool(options);
  AttachParams params;
  params.layout = layout;
  params.num_blocks = 64;  // 4 pages
  auto first = pool.pool.Attach(params);
  ASSERT_TRUE(first.ok());
  auto second = pool.pool.Attach(params);
  EXPECT_THAT(second.status(), StatusIs(absl::StatusCode::kResourceExhausted, "arena bytes"));
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 4096u * 4);
  params.num_blocks = 33;  // 8448 bytes, charged as 3 pages
  auto third = pool.pool.Attach(params);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 4096u * 7);
  params.num_blocks = 1;  // 256 bytes still cost a page: nothing is left
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "in whole pages"));
  ASSERT_TRUE(pool.pool.Detach(first->session_id).ok());
  params.num_blocks = 64;
  EXPECT_TRUE(pool.pool.Attach(params).ok());
}

TEST(PoolAttachTest, SessionCountIsBounded) {
  PoolOptions options = TestPool::DefaultOptions();
  options.max_sessions = 3;
  TestPool pool(options);
  AttachParams params;
  params.layout = MakeLayout(1, 1, 4, DType::kFloat16, 4);
  params.num_blocks = 1;
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    auto session = pool.pool.Attach(params);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ(session->session_id.size(), 32u);
    ids.push_back(session->session_id);
  }
  EXPECT_THAT(pool.pool.Attach(params).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "3 sessions"));
  ASSERT_TRUE(pool.pool.Detach(ids[1]).ok());
  EXPECT_TRUE(pool.pool.Attach(params).ok());
}

TEST(PoolLeaseTest, HeartbeatReportsFreeBlocks) {
  TestPool pool;
  const ModelLayout layout = MakeLayout(2, 1, 4, DType::kFloat16, 4);
  const std::string session = pool.Attach(layout, 16);
  const std::string seq = pool.Create(session, KeyDiff(), Budget(0));
  ASSERT_TRUE(Append(pool.pool, session, seq, 5, layout, HashValue).ok());  // 2 blocks x 2 layers
  auto beat = pool.pool.Heartbeat(session);
  ASSERT_TRUE(beat.ok());
  EXPECT_EQ(beat->free_blocks, 12);
}

TEST(PoolLeaseTest, HeartbeatExpiryAndReap) {
  TestPool pool;
  AttachParams params;
  params.layout = MakeLayout(1, 1, 4, DType::kFloat16, 4);
  params.num_blocks = 8;
  params.lease = absl::Seconds(2);
  auto a = pool.pool.Attach(params);
  auto b = pool.pool.Attach(params);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string seq = pool.Create(a->session_id, KeyDiff(), Budget(0));
  ASSERT_TRUE(Append(pool.pool, a->session_id, seq, 5, params.layout, HashValue).ok());

  pool.clock.Advance(absl::Milliseconds(1500));
  auto expiry = pool.pool.Heartbeat(b->session_id);
  ASSERT_TRUE(expiry.ok());
  EXPECT_EQ(expiry->lease_expires, pool.clock.Now() + absl::Seconds(2));
  EXPECT_EQ(expiry->free_blocks, params.num_blocks);
  EXPECT_EQ(pool.pool.ReapExpired(), 0);

  pool.clock.Advance(absl::Milliseconds(500));  // a's lease ends exactly now
  EXPECT_EQ(pool.pool.Heartbeat(a->session_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.pool.GetLayout(a->session_id, seq, {}, false).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.pool.ReapExpired(), 1);
  EXPECT_EQ(pool.pool.GetStats().sessions, 1);
  EXPECT_EQ(pool.pool.GetStats().sessions_reclaimed, 1);
  EXPECT_EQ(pool.pool.GetStats().sequences, 0);
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 4096u);  // 8 blocks of 64 B: one page
  EXPECT_EQ(pool.pool.Detach(a->session_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pool.pool.GetSession(b->session_id).ok());

  pool.clock.Advance(absl::Seconds(2));
  EXPECT_EQ(pool.pool.ReapExpired(), 1);
  EXPECT_EQ(pool.pool.GetStats().sessions, 0);
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 0u);
}

TEST(PoolLeaseTest, ReclaimAndDetachReportWhatTheyFreed) {
  TestPool pool;
  const ModelLayout layout = MakeLayout(2, 1, 4, DType::kFloat16, 4);
  const std::string a = pool.Attach(layout, 32);
  const std::string b = pool.Attach(layout, 32);
  for (const std::string& session : {a, b}) {
    const std::string s1 = pool.Create(session, KeyDiff(), Budget(0));
    const std::string s2 = pool.Create(session, KeyDiff(), Budget(0));
    ASSERT_TRUE(Append(pool.pool, session, s1, 5, layout, HashValue).ok());  // 2 blocks x 2
    ASSERT_TRUE(pool.pool.Reserve(session, s2, 1, {}, {}).ok());             // pending: 1 x 2
  }
  auto reclaimed = pool.pool.Reclaim(a);
  ASSERT_TRUE(reclaimed.ok());
  EXPECT_EQ(reclaimed->sequences, 2);
  EXPECT_EQ(reclaimed->blocks, 6);
  EXPECT_EQ(pool.pool.Reclaim(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.pool.GetStats().sessions_reclaimed, 1);
  auto detached = pool.pool.Detach(b);
  ASSERT_TRUE(detached.ok());
  EXPECT_EQ(detached->sequences, 2);
  EXPECT_EQ(detached->blocks, 6);
  EXPECT_EQ(pool.pool.GetStats().sessions_reclaimed, 1);  // a detach is not a reclaim
  EXPECT_EQ(pool.pool.GetStats().sessions, 0);
}

TEST_F(PoolTest, CreateSequenceIds) {
  SequenceParams params;
  params.sequence_id = "seq-1";
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, "seq-1"));
  for (const std::string& bad :
       {std::string("has space"), std::string("a/b"), std::string(129, 'x'), std::string("\xff")}) {
    params.sequence_id = bad;
    EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, "sequence_id must match"));
  }
  params.sequence_id = std::string(128, 'x');
  EXPECT_TRUE(pool_.pool.CreateSequence(session_, params).ok());
  params.sequence_id = "A.b_c:d-9";
  EXPECT_TRUE(pool_.pool.CreateSequence(session_, params).ok());
  params.sequence_id = "";
  auto g1 = pool_.pool.CreateSequence(session_, params);
  auto g2 = pool_.pool.CreateSequence(session_, params);
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_NE(g1->sequence_id, g2->sequence_id);
  EXPECT_FALSE(g1->sequence_id.empty());
  EXPECT_EQ(pool_.pool.ListSequences(session_).size(), 5u);
  // Same id in another session is fine.
  const std::string other = pool_.Attach(layout_, 8);
  EXPECT_EQ(pool_.Create(other, KeyDiff(), Budget(0), "seq-1"), "seq-1");
  EXPECT_EQ(pool_.pool.ListSequences("").size(), 6u);
  EXPECT_EQ(pool_.pool.CreateSequence("nope", params).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PoolTest, CreateSequencePolicyAndBudgetValidation) {
  SequenceParams params;
  params.retain_evicted = true;  // this pool has no tiers
  EXPECT_THAT(
      pool_.pool.CreateSequence(session_, params).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, "retain_evicted needs the host tier"));
  params.retain_evicted = false;
  PolicyConfig unknown;
  unknown.name = "fifo";
  params.policy = unknown;
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "policy.name"));
  params.policy = PolicyConfig{};
  params.policy->name = "omnikv";  // no default filter layers for a 2-layer model
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "policy.omnikv.filter_layers"));
  params.policy = KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 2.0f);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "policy.keydiff.recent_fraction"));
  params.policy = StreamingLlm(-2);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "policy.streaming_llm.n_sink"));
  params.policy.reset();

  // 40 blocks / 2 layers * 4 tokens = 80 tokens per layer.
  params.budget = Budget(-1);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget.tokens_per_layer"));
  params.budget = Budget(81);
  EXPECT_THAT(
      pool_.pool.CreateSequence(session_, params).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, "budget.tokens_per_layer must be <= 80"));
  params.budget = Budget(10, false, -3);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget.prefill_block_tokens"));
  params.budget = Budget(0, true, 4);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget.tokens_per_layer"));
  params.budget = Budget(70, true, 11);
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget.prefill_block_tokens"));
  EXPECT_EQ(pool_.pool.ListSequences(session_).size(), 1u);

  // Resolved values come back.
  params.budget = Budget(80, false, 0);
  params.policy = StreamingLlm(0);
  auto created = pool_.pool.CreateSequence(session_, params);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->budget.prefill_block_tokens, 128);
  EXPECT_EQ(created->policy.streaming_llm.n_sink, 0);  // a zero the paper means is kept
  auto view = pool_.pool.GetLayout(session_, created->sequence_id, {}, false);
  EXPECT_EQ(view->policy.streaming_llm.n_sink, 0);
  EXPECT_EQ(view->layers[0].budget, 80);
}

TEST(PoolSequenceLimitTest, SmallArenasHoldFewSequences) {
  TestPool pool;  // max_sequences_per_session is large; a 1-block arena still gets only 16
  const std::string session = pool.Attach(MakeLayout(1, 1, 4, DType::kFloat16, 4), 1);
  for (int i = 0; i < 16; ++i) pool.Create(session, KeyDiff(), Budget(0));
  EXPECT_THAT(pool.pool.CreateSequence(session, SequenceParams{}).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "16 sequences"));
}

TEST(PoolSequenceLimitTest, MaxSequencesPerSession) {
  PoolOptions options = TestPool::DefaultOptions();
  options.max_sequences_per_session = 2;
  TestPool pool(options);
  const std::string session = pool.Attach(MakeLayout(1, 1, 4, DType::kFloat16, 4), 4);
  pool.Create(session, KeyDiff(), Budget(0));
  const std::string second = pool.Create(session, KeyDiff(), Budget(0));
  SequenceParams params;
  EXPECT_EQ(pool.pool.CreateSequence(session, params).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pool.pool.ReleaseSequence(session, second).ok());
  EXPECT_TRUE(pool.pool.CreateSequence(session, params).ok());
}

TEST_F(PoolTest, ReserveValidationChangesNothing) {
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 5, layout_, HashValue).ok());
  const Snapshot before = Snap(pool_, session_, seq_);
  EXPECT_THAT(
      pool_.pool.Reserve(session_, seq_, 0, {}, {}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, "num_tokens must be in [1, 1048576], got 0"));
  EXPECT_THAT(pool_.pool.Reserve(session_, seq_, (1 << 20) + 1, {}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "num_tokens"));
  EXPECT_THAT(pool_.pool.Reserve(session_, seq_, 1, {}, {0, 2}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "layers[1] must be in [0, 2), got 2"));
  EXPECT_THAT(pool_.pool.Reserve(session_, seq_, 1, {}, {1, 1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "layers[1]"));
  EXPECT_THAT(pool_.pool.Reserve(session_, seq_, 2, {5, 5}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "positions"));
  EXPECT_THAT(pool_.pool.Reserve(session_, seq_, 1, {4}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "positions[0]"));
  EXPECT_THAT(
      pool_.pool.Reserve(session_, seq_, 80, {}, {}).status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               "arena of session " + session_ + " has 36 free blocks, reservation needs 40"));
  EXPECT_EQ(pool_.pool.Reserve(session_, "nope", 1, {}, {}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_.pool.Reserve("nope", seq_, 1, {}, {}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(Snap(pool_, session_, seq_) == before);
}

TEST_F(PoolTest, ReservationStateErrorsChangeNothing) {
  auto r = pool_.pool.Reserve(session_, seq_, 3, {}, {});
  ASSERT_TRUE(r.ok());
  const Snapshot pending = Snap(pool_, session_, seq_);
  EXPECT_EQ(pool_.pool.Reserve(session_, seq_, 1, {}, {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_.pool.Compress(session_, seq_, CompressParams{}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_.pool.Commit(session_, seq_, r->reservation_id + 100, false).status().code(),
            absl::StatusCode::kNotFound);
  std::vector<uint8_t> bytes(16);
  EXPECT_EQ(
      pool_.pool.WriteReserved(session_, seq_, r->reservation_id, r->payload_bytes - 15, bytes)
          .code(),
      absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool_.pool.CancelReservation(session_, seq_, r->reservation_id + 1).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(pool_.pool.CheckReservation(session_, seq_, r->reservation_id).ok());
  EXPECT_EQ(pool_.pool.CheckReservation(session_, seq_, r->reservation_id + 1).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(Snap(pool_, session_, seq_) == pending);
  ASSERT_TRUE(pool_.pool.Commit(session_, seq_, r->reservation_id, false).ok());
  const Snapshot committed = Snap(pool_, session_, seq_);
  EXPECT_EQ(pool_.pool.CheckReservation(session_, seq_, r->reservation_id).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_.pool.Commit(session_, seq_, r->reservation_id, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Snap(pool_, session_, seq_) == committed);
  CompressParams negative;
  negative.budget_tokens = -1;
  EXPECT_THAT(pool_.pool.Compress(session_, seq_, negative).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget_tokens"));
  CompressParams bad_policy;
  bad_policy.policy = PolicyConfig{};
  bad_policy.policy->name = "omnikv";
  EXPECT_THAT(pool_.pool.Compress(session_, seq_, bad_policy).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "omnikv is chosen when a sequence"));
  EXPECT_TRUE(Snap(pool_, session_, seq_) == committed);
}

// The finiteness check reads each row where the worker wrote it: a NaN placed in any (layer, K or
// V, head, token) of a reservation that starts inside a block and spans three is found and named
// there, and every other row is read too (a commit with the NaN alone is refused each time).
TEST_F(PoolTest, CommitNamesTheRowOfEveryNonFiniteValueItChecks) {
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 3, layout_, HashValue).ok());  // slots 0..2
  constexpr int32_t kTokens = 7;  // slots 3..9: blocks 0, 1 and 2 of block_tokens 4
  auto reservation = pool_.pool.Reserve(session_, seq_, kTokens, {}, {});
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  const std::vector<int32_t> layers = ReservedLayers(*reservation);
  const std::vector<uint8_t> payload =
      BuildPayload(layout_, layers, reservation->positions, HashValue);
  const uint64_t row_bytes = layout_.row_bytes();
  const uint64_t id = reservation->reservation_id;
  const std::vector<uint8_t> nan = {0xff, 0x7f};
  uint64_t row = 0;  // the payload's rows are [layer][2][H][T]
  for (int32_t layer : layers) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < layout_.num_kv_heads; ++h) {
        for (int32_t t = 0; t < kTokens; ++t, ++row) {
          ASSERT_TRUE(pool_.pool.WriteReserved(session_, seq_, id, 0, payload).ok());
          const uint64_t at = row * row_bytes + 2 * sizeof(uint16_t);  // dim 2
          ASSERT_TRUE(pool_.pool.WriteReserved(session_, seq_, id, at, nan).ok());
          const std::string where =
              absl::StrCat("in ", kv == 0 ? "K" : "V", " at layer ", layer, " head ", h, " token ",
                           t, " (position ", 3 + t, ") dim 2 ");
          EXPECT_THAT(pool_.pool.Commit(session_, seq_, id, false).status(),
                      StatusIs(absl::StatusCode::kInvalidArgument, where));
        }
      }
    }
  }
  ASSERT_TRUE(pool_.pool.WriteReserved(session_, seq_, id, 0, payload).ok());
  auto committed = pool_.pool.Commit(session_, seq_, id, false);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_THAT(committed->counts, ElementsAre(10, 10));
}

// BatchCommit's pool half: every item is checked before any is committed, then the items commit
// in order and the first failing one stops the batch with the earlier ones committed.
TEST_F(PoolTest, CommitBatchChecksEveryItemThenCommitsInOrder) {
  const std::string seq2 = pool_.Create(session_, KeyDiff(), Budget(0), "seq-2");
  auto r1 = pool_.pool.Reserve(session_, seq_, 2, {}, {});
  auto r2 = pool_.pool.Reserve(session_, seq2, 2, {}, {});
  ASSERT_TRUE(r1.ok() && r2.ok());
  const Snapshot pending1 = Snap(pool_, session_, seq_);
  const Snapshot pending2 = Snap(pool_, session_, seq2);

  std::vector<CommitItem> items = {{session_, seq_, r1->reservation_id},
                                   {session_, seq2, r2->reservation_id + 100}};
  CommitBatchResult not_pending = pool_.pool.CommitBatch(items);
  EXPECT_EQ(not_pending.failed, 1);
  EXPECT_THAT(not_pending.status, StatusIs(absl::StatusCode::kNotFound, "reservation"));
  EXPECT_TRUE(not_pending.results.empty());
  items[1] = {session_, seq_, r1->reservation_id};
  CommitBatchResult twice = pool_.pool.CommitBatch(items);
  EXPECT_EQ(twice.failed, 1);
  EXPECT_THAT(twice.status, StatusIs(absl::StatusCode::kInvalidArgument, "already committed"));
  items[1] = {"no-such-session", seq2, r2->reservation_id};
  EXPECT_EQ(pool_.pool.CommitBatch(items).status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Snap(pool_, session_, seq_) == pending1);
  EXPECT_TRUE(Snap(pool_, session_, seq2) == pending2);

  // A NaN in seq-2's reserved rows: seq-1 commits, seq-2 fails and stays pending.
  const std::vector<uint8_t> nan = {0xff, 0x7f};
  ASSERT_TRUE(pool_.pool.WriteReserved(session_, seq2, r2->reservation_id, 0, nan).ok());
  items[1] = {session_, seq2, r2->reservation_id};
  CommitBatchResult partial = pool_.pool.CommitBatch(items);
  EXPECT_EQ(partial.failed, 1);
  EXPECT_THAT(partial.status, StatusIs(absl::StatusCode::kInvalidArgument, "non-finite"));
  ASSERT_EQ(partial.results.size(), 1u);
  EXPECT_THAT(partial.results[0].counts, ElementsAre(2, 2));
  EXPECT_TRUE(Snap(pool_, session_, seq2) == pending2);
  EXPECT_TRUE(pool_.pool.CheckReservation(session_, seq2, r2->reservation_id).ok());

  const std::vector<uint8_t> zero = {0, 0};
  ASSERT_TRUE(pool_.pool.WriteReserved(session_, seq2, r2->reservation_id, 0, zero).ok());
  CommitBatchResult done = pool_.pool.CommitBatch(absl::MakeConstSpan(items).subspan(1));
  ASSERT_TRUE(done.status.ok()) << done.status;
  EXPECT_EQ(done.failed, -1);
  ASSERT_EQ(done.results.size(), 1u);
  EXPECT_THAT(done.results[0].counts, ElementsAre(2, 2));
}

// A SessionRef serves the calls of one RPC with one lookup; a session that ends after the lookup
// answers every call through the handle as an unknown session does, and nothing changes.
TEST_F(PoolTest, SessionRefCallsAndASessionEndedAfterTheLookup) {
  absl::StatusOr<SessionRef> ref = pool_.pool.FindSession(session_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->id(), session_);
  EXPECT_EQ(ref->tenant(), "default");
  EXPECT_EQ(ref->layout().num_layers, layout_.num_layers);
  EXPECT_EQ(ref->num_blocks(), 40);
  EXPECT_THAT(pool_.pool.FindSession("no-such-session").status(),
              StatusIs(absl::StatusCode::kNotFound, "session no-such-session not found"));
  EXPECT_THAT(pool_.pool.Reserve(*ref, "no-such-seq", 1, {}, {}).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       "sequence no-such-seq not found in session " + session_));

  // Through the handle as by id: reserve, commit (alone and in a batch given the handle).
  auto r1 = pool_.pool.Reserve(*ref, seq_, 2, {}, {});
  ASSERT_TRUE(r1.ok()) << r1.status();
  auto c1 = pool_.pool.Commit(*ref, seq_, r1->reservation_id, false);
  ASSERT_TRUE(c1.ok()) << c1.status();
  EXPECT_THAT(c1->counts, ElementsAre(2, 2));
  auto r2 = pool_.pool.Reserve(*ref, seq_, 1, {}, {});
  ASSERT_TRUE(r2.ok()) << r2.status();
  const std::vector<CommitItem> items = {{session_, seq_, r2->reservation_id}};
  const std::vector<SessionRef> found = {*ref};
  CommitBatchResult batch = pool_.pool.CommitBatch(items, found);
  ASSERT_TRUE(batch.status.ok()) << batch.status;
  EXPECT_THAT(batch.results[0].counts, ElementsAre(3, 3));
  auto layout = pool_.pool.GetLayout(*ref, seq_, {}, false);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->next_position, 3);
  auto pending = pool_.pool.Reserve(*ref, seq_, 1, {}, {});
  ASSERT_TRUE(pending.ok()) << pending.status();

  // The session ends while the handle is held: every call answers NOT_FOUND for the session.
  ASSERT_TRUE(pool_.pool.Detach(session_).ok());
  const std::string gone = "session " + session_ + " not found";
  EXPECT_THAT(pool_.pool.FindSession(session_).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.Reserve(*ref, seq_, 1, {}, {}).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.Commit(*ref, seq_, pending->reservation_id, false).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  const std::vector<CommitItem> late = {{session_, seq_, pending->reservation_id}};
  CommitBatchResult late_batch = pool_.pool.CommitBatch(late, found);
  EXPECT_EQ(late_batch.failed, 0);
  EXPECT_THAT(late_batch.status, StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.GetLayout(*ref, seq_, {}, false).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.Compress(*ref, seq_, CompressParams{}).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.Score(*ref, seq_, ScoreParams{}).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  DecodeItem decode;
  decode.session_id = session_;
  decode.sequence_id = seq_;
  EXPECT_THAT(pool_.pool.DecodeStep({decode}, found).status(),
              StatusIs(absl::StatusCode::kNotFound, "items[0]: " + gone));
  SelectItem select;
  select.session_id = session_;
  select.sequence_id = seq_;
  EXPECT_THAT(pool_.pool.Select({select}, found).status(),
              StatusIs(absl::StatusCode::kNotFound, "items[0]: " + gone));
  EXPECT_EQ(pool_.pool.GetStats().sessions, 0);
}

// CreateSequence, CancelReservation, ReadExport and ReserveBatch through a handle answer as by
// id, and as an unknown session once the session ended after the lookup.
TEST_F(PoolTest, MoreSessionRefCallsAndASessionEndedAfterTheLookup) {
  absl::StatusOr<SessionRef> ref = pool_.pool.FindSession(session_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  WeakSessionRef weak(*ref);
  SequenceParams params;
  params.policy = KeyDiff();
  params.budget = Budget(0);
  params.sequence_id = "by-ref";
  auto created = pool_.pool.CreateSequence(*ref, params);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->sequence_id, "by-ref");
  EXPECT_THAT(pool_.pool.CreateSequence(*ref, params).status(),
              StatusIs(absl::StatusCode::kAlreadyExists, "sequence_id by-ref already exists"));

  // Reserve and cancel through the handle: the blocks come back.
  const int32_t free_before = pool_.FreeBlocks(session_);
  auto pending = pool_.pool.Reserve(*ref, "by-ref", 2, {}, {});
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_TRUE(pool_.pool.CancelReservation(*ref, "by-ref", pending->reservation_id).ok());
  EXPECT_EQ(pool_.FreeBlocks(session_), free_before);

  // Export reads through the handle equal those by id.
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 3, layout_, HashValue).ok());
  auto layout = pool_.pool.GetLayout(*ref, seq_, {}, false);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<uint8_t> by_ref(64), by_id(64);
  ASSERT_TRUE(
      pool_.pool.ReadExport(*ref, seq_, {}, layout->version, 0, absl::MakeSpan(by_ref)).ok());
  ASSERT_TRUE(
      pool_.pool.ReadExport(session_, seq_, {}, layout->version, 0, absl::MakeSpan(by_id)).ok());
  EXPECT_EQ(by_ref, by_id);

  // A batch with a missing sequence reserves nothing.
  const int32_t free_appended = pool_.FreeBlocks(session_);
  std::vector<ReserveItem> items = {{session_, seq_, 1, {}, {}}, {session_, "ghost", 1, {}, {}}};
  std::vector<SessionRef> found = {*ref};
  int32_t failed = -1;
  EXPECT_THAT(pool_.pool.ReserveBatch(items, found, &failed).status(),
              StatusIs(absl::StatusCode::kNotFound, "sequence ghost not found"));
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(pool_.FreeBlocks(session_), free_appended);
  // A batch whose last item cannot reserve (already pending) cancels the earlier items' ones.
  auto held = pool_.pool.Reserve(*ref, "by-ref", 1, {}, {});
  ASSERT_TRUE(held.ok()) << held.status();
  const int32_t free_held = pool_.FreeBlocks(session_);
  items = {{session_, seq_, 2, {}, {}}, {session_, "by-ref", 1, {}, {}}};
  EXPECT_THAT(pool_.pool.ReserveBatch(items, found, &failed).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ""));
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(pool_.FreeBlocks(session_), free_held);
  auto again = pool_.pool.Reserve(*ref, seq_, 1, {}, {});  // seq_ holds no reservation
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(pool_.pool.CancelReservation(*ref, seq_, again->reservation_id).ok());
  ASSERT_TRUE(pool_.pool.CancelReservation(*ref, "by-ref", held->reservation_id).ok());
  // A whole batch: in item order, as Reserve makes them.
  items = {{session_, seq_, 1, {}, {}}, {session_, "by-ref", 2, {}, {}}};
  auto both = pool_.pool.ReserveBatch(items, found);
  ASSERT_TRUE(both.ok()) << both.status();
  ASSERT_EQ(both->size(), 2u);
  EXPECT_LT((*both)[0].reservation_id, (*both)[1].reservation_id);

  // The session ends while the handle is held: NOT_FOUND for the session, before the parameters
  // are looked at (as by id).
  ASSERT_TRUE(pool_.pool.Detach(session_).ok());
  const std::string gone = "session " + session_ + " not found";
  params.sequence_id = "late";
  EXPECT_THAT(pool_.pool.CreateSequence(*ref, params).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  params.budget = Budget(1 << 30);  // over the arena: refused by id only after the lookup
  EXPECT_THAT(pool_.pool.CreateSequence(session_, params).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.CreateSequence(*ref, params).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.CancelReservation(*ref, seq_, (*both)[0].reservation_id),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.ReadExport(*ref, seq_, {}, layout->version, 0, absl::MakeSpan(by_ref)),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_THAT(pool_.pool.ReserveBatch(items, found, &failed).status(),
              StatusIs(absl::StatusCode::kNotFound, gone));
  EXPECT_EQ(failed, 0);
  // The weak handle gives the session back while a handle holds it, and NOT_FOUND once none
  // does: its memory (the arena) is gone.
  EXPECT_TRUE(weak.Lock().ok());
  found.clear();
  ref = absl::NotFoundError("dropped");
  EXPECT_THAT(weak.Lock().status(), StatusIs(absl::StatusCode::kNotFound, gone));
}

TEST_F(PoolTest, StrictReserveThatCannotFitEvictsNothing) {
  // 40 blocks of 4 tokens, 2 layers. A strict N = 6, N_b = 8 sequence holding 8 tokens per layer
  // (2 blocks each) must evict to 6 (still 2 blocks) and then needs 2 more blocks per layer; the
  // other sequence has taken every other block.
  const std::string strict = pool_.Create(session_, KeyDiff(), Budget(6, true, 8));
  ASSERT_TRUE(Append(pool_.pool, session_, strict, 8, layout_, HashValue).ok());
  ASSERT_TRUE(Append(pool_.pool, session_, strict, 2, layout_, HashValue).ok());
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 72, layout_, HashValue).ok());  // 18 x 2 blocks
  EXPECT_EQ(pool_.FreeBlocks(session_), 0);
  const Snapshot before = Snap(pool_, session_, strict);
  EXPECT_EQ(before.layers[0].count, 8);
  auto r = pool_.pool.Reserve(session_, strict, 8, {}, {});
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                   "has 0 free blocks, reservation needs 4"));
  EXPECT_TRUE(Snap(pool_, session_, strict) == before);
  // 9 tokens exceed N_b under a strict budget.
  EXPECT_THAT(pool_.pool.Reserve(session_, strict, 9, {}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget.prefill_block_tokens"));
  EXPECT_TRUE(Snap(pool_, session_, strict) == before);
  // Once the other sequence is gone the same reservation evicts 2 per layer first.
  ASSERT_TRUE(pool_.pool.ReleaseSequence(session_, seq_).ok());
  auto ok = pool_.pool.Reserve(session_, strict, 8, {}, {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->evicted_before, 2);
  EXPECT_EQ(ok->layers[0].first_slot, 6);
  EXPECT_EQ(pool_.pool.GetLayout(session_, strict, {}, false)->layers[1].count, 6);
}

TEST_F(PoolTest, CommitCompressesWhenAsked) {
  const std::string seq = pool_.Create(session_, StreamingLlm(1), Budget(6));
  testing_util::AppendOptions options;
  auto plain = Append(pool_.pool, session_, seq, 9, layout_, HashValue, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(plain->counts, ElementsAre(9, 9));
  EXPECT_EQ(plain->evicted, 0);
  options.compress = true;
  auto compressed = Append(pool_.pool, session_, seq, 2, layout_, HashValue, options);
  ASSERT_TRUE(compressed.ok());
  EXPECT_THAT(compressed->counts, ElementsAre(6, 6));
  EXPECT_EQ(compressed->evicted, 5);
  auto view = pool_.pool.GetLayout(session_, seq, {1}, true);
  ASSERT_EQ(view->layers.size(), 1u);
  EXPECT_EQ(view->layers[0].layer, 1);
  EXPECT_THAT(testing_util::HeadPositions(view->layers[0], 1), ElementsAre(0, 6, 7, 8, 9, 10));
  EXPECT_EQ(view->tokens_appended, 11);
  EXPECT_EQ(view->next_position, 11);
  EXPECT_TRUE(ContentsMatch(pool_.pool, session_, seq, layout_, HashValue));
}

TEST_F(PoolTest, CompressReportsPerLayerAndFreesBlocks) {
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 17, layout_, HashValue).ok());  // 5 blocks x 2
  EXPECT_EQ(pool_.FreeBlocks(session_), 30);
  CompressParams params;
  params.budget_tokens = 5;
  params.return_positions = true;
  auto result = pool_.pool.Compress(session_, seq_, params);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->blocks_freed, 6);
  EXPECT_EQ(pool_.FreeBlocks(session_), 36);
  ASSERT_EQ(result->layers.size(), 2u);
  for (const LayerCompressResult& layer : result->layers) {
    EXPECT_EQ(layer.kept, 5);
    EXPECT_EQ(layer.evicted, 12);
    EXPECT_EQ(layer.merged, 0);
    EXPECT_EQ(layer.positions.size(), 10u);
  }
  EXPECT_TRUE(ContentsMatch(pool_.pool, session_, seq_, layout_, HashValue));
  // Under budget: nothing happens, version unchanged.
  const uint64_t version = pool_.pool.GetLayout(session_, seq_, {}, false)->version;
  auto again = pool_.pool.Compress(session_, seq_, params);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blocks_freed, 0);
  EXPECT_EQ(again->layers[0].evicted, 0);
  EXPECT_EQ(pool_.pool.GetLayout(session_, seq_, {}, false)->version, version);
  // No budget at all (sequence unbounded, no override): nothing evicted.
  auto unbounded = pool_.pool.Compress(session_, seq_, CompressParams{});
  ASSERT_TRUE(unbounded.ok());
  EXPECT_EQ(unbounded->layers[1].kept, 5);
}

TEST_F(PoolTest, ExportIsAbortedByAConcurrentChange) {
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 3, layout_, HashValue).ok());
  auto view = pool_.pool.GetLayout(session_, seq_, {}, false);
  std::vector<uint8_t> out(64);
  ASSERT_TRUE(
      pool_.pool.ReadExport(session_, seq_, {}, view->version, 0, absl::MakeSpan(out)).ok());
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 1, layout_, HashValue).ok());
  EXPECT_EQ(
      pool_.pool.ReadExport(session_, seq_, {}, view->version, 64, absl::MakeSpan(out)).code(),
      absl::StatusCode::kAborted);
  auto fresh = pool_.pool.GetLayout(session_, seq_, {}, false);
  const uint64_t total = 2 * 2 * 2 * 4 * 2 * 4;  // layers x kv x heads x 4 tokens x dim x 2 bytes
  std::vector<uint8_t> all(total);
  EXPECT_TRUE(
      pool_.pool.ReadExport(session_, seq_, {}, fresh->version, 0, absl::MakeSpan(all)).ok());
  std::vector<uint8_t> one(1);
  EXPECT_EQ(
      pool_.pool.ReadExport(session_, seq_, {}, fresh->version, total, absl::MakeSpan(one)).code(),
      absl::StatusCode::kOutOfRange);
}

TEST_F(PoolTest, StatsAndListings) {
  PoolStats before = pool_.pool.GetStats();
  EXPECT_EQ(before.sessions, 1);
  EXPECT_EQ(before.sequences, 1);
  EXPECT_EQ(before.arena_bytes_used, 0u);
  ASSERT_TRUE(Append(pool_.pool, session_, seq_, 10, layout_, HashValue).ok());
  CompressParams params;
  params.budget_tokens = 4;
  ASSERT_TRUE(pool_.pool.Compress(session_, seq_, params).ok());
  PoolStats stats = pool_.pool.GetStats();
  EXPECT_EQ(stats.tokens_appended, 20);  // 10 tokens x 2 layers
  EXPECT_EQ(stats.tokens_evicted, 12);   // 6 x 2 layers
  EXPECT_EQ(stats.arena_bytes_used, 2u * layout_.block_bytes());
  EXPECT_EQ(stats.arena_bytes_reserved, 8192u);  // 40 blocks of 128 B, in whole pages
  auto sequences = pool_.pool.ListSequences(session_);
  ASSERT_EQ(sequences.size(), 1u);
  EXPECT_EQ(sequences[0].sequence_id, "seq-1");
  EXPECT_EQ(sequences[0].tenant, "default");
  EXPECT_THAT(sequences[0].tokens_per_layer, ElementsAre(4, 4));
  EXPECT_EQ(sequences[0].arena_bytes, 2u * layout_.block_bytes());
  EXPECT_TRUE(pool_.pool.ListSequences("unknown").empty());
  auto released = pool_.pool.ReleaseSequence(session_, seq_);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(released->blocks, 2);
  EXPECT_EQ(pool_.pool.ReleaseSequence(session_, seq_).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_.FreeBlocks(session_), 40);
  EXPECT_EQ(pool_.pool.GetStats().sequences, 0);
}

// Several threads on sequences of two sessions at once; checks the results, not timing.
TEST(PoolConcurrencyTest, ParallelSequencesStayConsistent) {
  TestPool pool;
  const ModelLayout layout = MakeLayout(2, 2, 8, DType::kFloat16, 4);
  const std::string sessions[2] = {pool.Attach(layout, 256), pool.Attach(layout, 256)};
  std::vector<std::thread> threads;
  std::vector<std::string> failures(6);
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      const std::string& session = sessions[t % 2];
      const std::string seq = "t" + std::to_string(t);
      SequenceParams params;
      params.sequence_id = seq;
      params.budget = Budget(12, t % 3 == 0, 4);
      params.policy = t % 2 ? KeyDiff() : StreamingLlm(2);
      if (!pool.pool.CreateSequence(session, params).ok()) {
        failures[t] = "create";
        return;
      }
      testing_util::AppendOptions options;
      options.compress = true;
      for (int step = 0; step < 30; ++step) {
        auto commit = Append(pool.pool, session, seq, 1 + step % 4, layout, HashValue, options);
        if (!commit.ok()) {
          failures[t] = commit.status().ToString();
          return;
        }
      }
      if (!ContentsMatch(pool.pool, session, seq, layout, HashValue)) failures[t] = "contents";
      pool.pool.GetStats();
      pool.pool.ListSessions();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 6; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  for (const std::string& session : sessions) ASSERT_TRUE(pool.pool.Detach(session).ok());
  EXPECT_EQ(pool.pool.GetStats().arena_bytes_reserved, 0u);
}

}  // namespace
}  // namespace kvs
