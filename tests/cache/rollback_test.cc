// A step that fails after validation (here: the backend's TopK fails while the policy selects,
// after the new token was appended and the step's attention observed) leaves the sequence as it
// was: counts, positions, next position, version, the pending reservation and the session's free
// blocks; the next call succeeds. For DecodeStep (inline and reserved tokens), Commit and
// Compress, for every evicting policy.
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cache/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using testing_util::BuildPayload;
using testing_util::HashValue;
using testing_util::MakeLayout;

// The CPU backend, with TopK failing while `fail_topk` is set.
class FailingBackend final : public Backend {
 public:
  FailingBackend() : cpu_(MakeCpuBackend(1)) {}
  std::string_view name() const override { return cpu_->name(); }
  bool healthy() const override { return true; }
  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    return cpu_->CreateArena(bytes, options);
  }
  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream s) override {
    keydiff_jobs += static_cast<int>(jobs.size());
    return cpu_->KeyDiffScores(jobs, s);
  }
  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream s) override {
    if (fail_topk) return absl::InternalError("injected TopK failure");
    return cpu_->TopK(jobs, s);
  }
  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream s) override {
    return cpu_->CopyRows(jobs, s);
  }
  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream s) override {
    probs_jobs += static_cast<int>(jobs.size());
    return cpu_->AttentionProbs(jobs, s);
  }
  absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, Stream s) override {
    sums_jobs += static_cast<int>(jobs.size());
    return cpu_->AttentionColumnSums(jobs, s);
  }
  absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream s) override {
    pool_jobs += static_cast<int>(jobs.size());
    return cpu_->PoolScores(jobs, s);
  }
  absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, Stream s) override {
    if (fail_window) return absl::InternalError("injected WindowVarianceScores failure");
    variance_jobs += static_cast<int>(jobs.size());
    return cpu_->WindowVarianceScores(jobs, s);
  }
  absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream s) override {
    if (fail_window) return absl::InternalError("injected WindowEntropyShift failure");
    entropy_jobs += static_cast<int>(jobs.size());
    return cpu_->WindowEntropyShift(jobs, s);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream s) override {
    return cpu_->AttentionLogits(jobs, s);
  }
  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream s) override {
    return cpu_->CopyHostRows(jobs, s);
  }
  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream s) override {
    return cpu_->CaoteScores(jobs, s);
  }
  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream s) override {
    return cpu_->NearestKeys(jobs, s);
  }
  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream s) override {
    return cpu_->MergeRows(jobs, s);
  }
  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream s) override {
    return cpu_->FindNonFinite(jobs, s);
  }
  absl::Status Synchronize(Stream s) override { return cpu_->Synchronize(s); }

  std::atomic<bool> fail_topk{false};
  std::atomic<bool> fail_window{false};
  // Jobs of the kernels the policies issued. Atomic: a policy scores the layers of a step side
  // by side on the pool's host threads, each layer's jobs in a call of its own.
  std::atomic<int> probs_jobs{0};
  std::atomic<int> sums_jobs{0};
  std::atomic<int> pool_jobs{0};
  std::atomic<int> variance_jobs{0};
  std::atomic<int> entropy_jobs{0};
  std::atomic<int> keydiff_jobs{0};  // KeyDiff and KNorm passes over the keys

 private:
  std::unique_ptr<Backend> cpu_;
};

constexpr int32_t kBudget = 8;

class RollbackTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    PoolOptions options = testing_util::TestPool::DefaultOptions();
    pool_ = std::make_unique<KvPool>(&backend_, &clock_, options);
    layout_ = MakeLayout(2, 2, 16, DType::kFloat16, 4);
    AttachParams attach;
    attach.layout = layout_;
    attach.num_blocks = 64;
    auto view = pool_->Attach(attach);
    ASSERT_TRUE(view.ok()) << view.status();
    session_ = view->session_id;
    SequenceParams params;
    params.policy = PolicyConfig{};
    params.policy->name = GetParam();
    params.budget = testing_util::Budget(kBudget);
    params.sequence_id = "seq";
    ASSERT_TRUE(pool_->CreateSequence(session_, params).ok());
    // kBudget + 2 tokens, over the budget: the next step evicts.
    Append(kBudget + 2);
  }

  void Append(int32_t tokens) {
    auto reservation = pool_->Reserve(session_, "seq", tokens, {}, {});
    ASSERT_TRUE(reservation.ok()) << reservation.status();
    const std::vector<int32_t> layers = {0, 1};
    const auto payload = BuildPayload(layout_, layers, reservation->positions, HashValue);
    ASSERT_TRUE(
        pool_->WriteReserved(session_, "seq", reservation->reservation_id, 0, payload).ok());
    ASSERT_TRUE(pool_->Commit(session_, "seq", reservation->reservation_id, false).ok());
  }

  AttentionInput Query(int32_t num_queries) const {
    AttentionInput attention;
    attention.num_queries = num_queries;
    attention.softmax_scale = 0.25f;
    attention.queries.resize(static_cast<size_t>(layout_.num_layers) * layout_.num_q_heads *
                             num_queries * layout_.head_dim);
    for (size_t i = 0; i < attention.queries.size(); ++i) {
      attention.queries[i] = 0.5f * std::sin(static_cast<float>(i));
    }
    return attention;
  }

  // Everything a failed call must leave as it was.
  struct State {
    std::vector<LayerLayoutView> layers;
    int32_t next_position;
    uint64_t version;
    int32_t free_blocks;
  };
  State Snapshot() const {
    auto layout = pool_->GetLayout(session_, "seq", {}, true);
    EXPECT_TRUE(layout.ok()) << layout.status();
    int32_t free_blocks = -1;
    for (const SessionInfo& info : pool_->ListSessions()) free_blocks = info.free_blocks;
    return State{layout->layers, layout->next_position, layout->version, free_blocks};
  }
  void ExpectSame(const State& a, const State& b) const {
    ASSERT_EQ(a.layers.size(), b.layers.size());
    for (size_t l = 0; l < a.layers.size(); ++l) {
      EXPECT_EQ(a.layers[l].count, b.layers[l].count) << "layer " << l;
      EXPECT_EQ(a.layers[l].block_table, b.layers[l].block_table) << "layer " << l;
      EXPECT_EQ(a.layers[l].positions, b.layers[l].positions) << "layer " << l;
    }
    EXPECT_EQ(a.next_position, b.next_position);
    EXPECT_EQ(a.version, b.version);
    EXPECT_EQ(a.free_blocks, b.free_blocks);
  }

  DecodeItem InlineToken(int32_t position) const {
    DecodeItem item;
    item.session_id = session_;
    item.sequence_id = "seq";
    item.attention = Query(1);
    item.inline_kv = BuildPayload(layout_, std::vector<int32_t>{0, 1}, {position}, HashValue);
    return item;
  }

  FailingBackend backend_;
  FakeClock clock_;
  std::unique_ptr<KvPool> pool_;
  ModelLayout layout_;
  std::string session_;
};

TEST_P(RollbackTest, FailedDecodeStepChangesNothing) {
  const State before = Snapshot();
  backend_.fail_topk = true;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto step = pool_->DecodeStep({InlineToken(before.next_position)});
    ASSERT_FALSE(step.ok()) << "attempt " << attempt;
    EXPECT_THAT(step.status().message(), ::testing::HasSubstr("injected TopK failure"));
    ExpectSame(before, Snapshot());
  }
  backend_.fail_topk = false;
  auto step = pool_->DecodeStep({InlineToken(before.next_position)});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_THAT(step->at(0).counts, ::testing::Each(kBudget));
  EXPECT_EQ(Snapshot().next_position, before.next_position + 1);
}

TEST_P(RollbackTest, FailedReservedDecodeStepKeepsTheReservationPending) {
  auto reservation = pool_->Reserve(session_, "seq", 1, {}, {});
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  const auto payload =
      BuildPayload(layout_, std::vector<int32_t>{0, 1}, reservation->positions, HashValue);
  ASSERT_TRUE(pool_->WriteReserved(session_, "seq", reservation->reservation_id, 0, payload).ok());
  const State before = Snapshot();
  DecodeItem item;
  item.session_id = session_;
  item.sequence_id = "seq";
  item.attention = Query(1);
  item.reservation_id = reservation->reservation_id;
  backend_.fail_topk = true;
  ASSERT_FALSE(pool_->DecodeStep({item}).ok());
  ExpectSame(before, Snapshot());
  EXPECT_TRUE(pool_->CheckReservation(session_, "seq", reservation->reservation_id).ok());
  backend_.fail_topk = false;
  auto step = pool_->DecodeStep({item});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_THAT(step->at(0).counts, ::testing::Each(kBudget));
}

TEST_P(RollbackTest, FailedCommitAndCompressChangeNothing) {
  auto reservation = pool_->Reserve(session_, "seq", 2, {}, {});
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  const auto payload =
      BuildPayload(layout_, std::vector<int32_t>{0, 1}, reservation->positions, HashValue);
  ASSERT_TRUE(pool_->WriteReserved(session_, "seq", reservation->reservation_id, 0, payload).ok());
  const AttentionInput attention = Query(2);
  const State before = Snapshot();
  backend_.fail_topk = true;
  ASSERT_FALSE(
      pool_->Commit(session_, "seq", reservation->reservation_id, true, &attention).ok());
  ExpectSame(before, Snapshot());
  EXPECT_TRUE(pool_->CheckReservation(session_, "seq", reservation->reservation_id).ok());
  backend_.fail_topk = false;
  ASSERT_TRUE(pool_->Commit(session_, "seq", reservation->reservation_id, false).ok());

  const State committed = Snapshot();
  CompressParams params;
  params.attention = Query(2);
  backend_.fail_topk = true;
  ASSERT_FALSE(pool_->Compress(session_, "seq", params).ok());
  ExpectSame(committed, Snapshot());
  backend_.fail_topk = false;
  auto compressed = pool_->Compress(session_, "seq", params);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  for (const LayerCompressResult& layer : compressed->layers) EXPECT_EQ(layer.kept, kBudget);
}

// SnapKV reads only the column sums of its window, H2O (and CAOTE over it) and D2O (its scorer
// and its layer allocator) only the column sums of every query it accumulates: the backend sums
// the probabilities as it computes them (never writing [Hq][w][count] out, or sending it back
// from a device), and pools SnapKV's.
// (Its own suite: D2O's allocator gives the layers budgets of their own, so the rollback tests'
// expectation of kBudget per layer does not hold for D2O.)
class AttentionJobsTest : public RollbackTest {};

TEST_P(AttentionJobsTest, WindowVoteIsSummedAndPooledInsideTheBackend) {
  CompressParams params;
  params.attention = Query(4);
  auto compressed = pool_->Compress(session_, "seq", params);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  int32_t kept = 0;
  for (const LayerCompressResult& layer : compressed->layers) kept += layer.kept;
  EXPECT_GT(kept, 0);
  // D2O floors each layer's share of the budget.
  EXPECT_LE(kept, kBudget * layout_.num_layers);
  if (GetParam() != "d2o") {
    EXPECT_EQ(kept, kBudget * layout_.num_layers);
  }
  if (GetParam() == "snapkv") {
    EXPECT_EQ(backend_.probs_jobs.load(), 0);
    EXPECT_EQ(backend_.sums_jobs.load(), layout_.num_layers);
    EXPECT_EQ(backend_.pool_jobs.load(), layout_.num_layers);
  }
  if (GetParam() == "h2o" || GetParam() == "caote" || GetParam() == "d2o") {
    EXPECT_EQ(backend_.probs_jobs.load(), 0);
    EXPECT_EQ(backend_.sums_jobs.load(), layout_.num_layers);
  }
  if (GetParam() == "tova") {  // one query row: nothing to sum
    EXPECT_EQ(backend_.probs_jobs.load(), layout_.num_layers);
    EXPECT_EQ(backend_.sums_jobs.load(), 0);
  }
}

// CAKE's window statistics (the scorer's mean + gamma * variance per slot, the allocator's
// entropy and shift per layer) are backend jobs, so a device backend runs them: one of each per
// layer of a prefill Compress, and a failing backend fails the call and changes nothing.
TEST_P(RollbackTest, CakeWindowStatisticsRunInsideTheBackend) {
  CompressParams params;
  params.attention = Query(4);
  if (GetParam() == "cake") {
    const State before = Snapshot();
    backend_.fail_window = true;
    const absl::Status failed = pool_->Compress(session_, "seq", params).status();
    EXPECT_THAT(failed.message(), ::testing::HasSubstr("injected Window"));
    ExpectSame(before, Snapshot());
    backend_.fail_window = false;
  }
  auto compressed = pool_->Compress(session_, "seq", params);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  for (const LayerCompressResult& layer : compressed->layers) EXPECT_EQ(layer.kept, kBudget);
  const int expected = GetParam() == "cake" ? layout_.num_layers : 0;
  EXPECT_EQ(backend_.variance_jobs.load(), expected);
  EXPECT_EQ(backend_.entropy_jobs.load(), expected);
}

// KNorm ranks by the norms the finiteness checks of its commits took as they read the keys
// (FiniteCheckJob::row_norms): its compress reads no keys and keeps exactly what a pass over the
// keys keeps (the same data under KeyDiff, compressed with a KNorm override, which has no norms
// and reads them); the norms follow the kept keys through the compaction, so the next commit,
// inline decode token and compress read none either. Where no norms were taken, the pass's are
// kept: the next compress reads the keys no more.
class KeyNormsTest : public RollbackTest {
 protected:
  void AppendTo(const std::string& seq, int32_t tokens) {
    auto reservation = pool_->Reserve(session_, seq, tokens, {}, {});
    ASSERT_TRUE(reservation.ok()) << reservation.status();
    const auto payload =
        BuildPayload(layout_, std::vector<int32_t>{0, 1}, reservation->positions, HashValue);
    ASSERT_TRUE(pool_->WriteReserved(session_, seq, reservation->reservation_id, 0, payload).ok());
    ASSERT_TRUE(pool_->Commit(session_, seq, reservation->reservation_id, false).ok());
  }
  // Compresses `seq` to `budget` (with `policy` when given); the KeyDiff jobs it issued.
  int CompressTo(const std::string& seq, int32_t budget, const char* policy = nullptr) {
    CompressParams params;
    params.budget_tokens = budget;
    if (policy != nullptr) {
      params.policy = PolicyConfig{};
      params.policy->name = policy;
    }
    backend_.keydiff_jobs = 0;
    auto compressed = pool_->Compress(session_, seq, params);
    EXPECT_TRUE(compressed.ok()) << compressed.status();
    return backend_.keydiff_jobs.load();
  }
  std::vector<std::vector<int32_t>> Positions(const std::string& seq) {
    auto layout = pool_->GetLayout(session_, seq, {}, true);
    EXPECT_TRUE(layout.ok()) << layout.status();
    std::vector<std::vector<int32_t>> out;
    for (const LayerLayoutView& layer : layout->layers) out.push_back(layer.positions);
    return out;
  }
};

TEST_P(KeyNormsTest, KnormRanksByTheNormsItsCommitsTook) {
  SequenceParams params;
  params.policy = PolicyConfig{};
  params.policy->name = "keydiff";
  params.sequence_id = "ref";
  ASSERT_TRUE(pool_->CreateSequence(session_, params).ok());
  AppendTo("ref", kBudget + 2);  // the same positions, so the same keys, as "seq"

  EXPECT_EQ(CompressTo("seq", 6), 0);
  EXPECT_EQ(CompressTo("ref", 6, "knorm"), 2);  // both layers' keys read
  EXPECT_EQ(Positions("seq"), Positions("ref"));

  AppendTo("seq", 5);
  AppendTo("ref", 5);
  EXPECT_EQ(CompressTo("seq", 4), 0);
  EXPECT_EQ(CompressTo("ref", 4, "knorm"), 2);
  EXPECT_EQ(Positions("seq"), Positions("ref"));

  // An inline decode token's rows are checked (and their norms taken) once written.
  DecodeItem token = InlineToken(/*position=*/15);
  token.attention = AttentionInput{};
  ASSERT_TRUE(pool_->DecodeStep(std::vector<DecodeItem>{token}).ok());
  EXPECT_EQ(CompressTo("seq", 3), 0);

  // Without norms (KeyDiff's commits take none) the pass's norms are kept for the next compress.
  AppendTo("ref", 2);
  EXPECT_EQ(CompressTo("ref", 5, "knorm"), 2);
  EXPECT_EQ(CompressTo("ref", 4, "knorm"), 0);
}

INSTANTIATE_TEST_SUITE_P(Knorm, KeyNormsTest, ::testing::Values("knorm"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

INSTANTIATE_TEST_SUITE_P(EvictingPolicies, RollbackTest,
                         ::testing::Values("keydiff", "h2o", "tova", "snapkv", "cake", "caote"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

INSTANTIATE_TEST_SUITE_P(AttentionPolicies, AttentionJobsTest,
                         ::testing::Values("h2o", "tova", "snapkv", "caote", "d2o"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace kvs
