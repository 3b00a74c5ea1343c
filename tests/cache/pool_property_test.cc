// Property test of the pool: random reserve / write / commit / cancel / compress / release on
// many sequences in several sessions (different layouts and dtypes), both policies, strict and
// non-strict budgets. After every step:
//   - every kept token's K and V rows equal what was written for its (layer, head, position);
//   - every head of a layer holds the same count, of distinct positions, all of them appended;
//   - an eviction kept exactly min(keep, candidates) tokens per head, out of the candidates, with
//     the policy's guarantee (StreamingLLM: exactly sinks + newest; KeyDiff: the r newest);
//   - counts stay within budget after a compression or strict reserve (budget + N_b at most);
//   - a failed call changed nothing, and no block leaks: held + free == num_blocks, and after
//     releasing everything the allocator is full again.
// Bounded iterations, fixed seeds.
#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/pool.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using testing_util::BuildPayload;
using testing_util::ContentsMatch;
using testing_util::HashValue;
using testing_util::MakeLayout;
using testing_util::ReservedLayers;
using testing_util::TestPool;

using HeadSets = std::vector<std::vector<std::set<int32_t>>>;  // [layer][head]

struct SeqModel {
  std::string id;
  PolicyConfig policy;
  BudgetConfig budget;
  std::vector<std::set<int32_t>> appended;  // [layer]
  HeadSets held;                            // what the sequence holds, as last verified
  int32_t next_position = 0;
  std::optional<Reservation> pending;
};

struct SessionModel {
  std::string id;
  ModelLayout layout;
  int32_t num_blocks = 0;
  std::vector<SeqModel> seqs;
};

class PoolPropertyTest : public ::testing::TestWithParam<uint32_t> {
 protected:
  std::mt19937 rng_{GetParam()};
  TestPool pool_;
  std::vector<SessionModel> sessions_;
  int64_t evictions_checked_ = 0;

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  PolicyConfig RandomPolicy() {
    PolicyConfig policy;
    if (Chance(0.5)) {
      policy.name = kPolicyStreamingLlm;
      policy.streaming_llm.n_sink = Uniform(1, 4);
    } else {
      policy.name = kPolicyKeyDiff;
      const KeyDiffAnchor anchors[] = {KeyDiffAnchor::kMeanNormalized, KeyDiffAnchor::kMeanRaw,
                                       KeyDiffAnchor::kMedianNormalized};
      const KeyDiffMetric metrics[] = {KeyDiffMetric::kCosine, KeyDiffMetric::kPairwise,
                                       KeyDiffMetric::kDot, KeyDiffMetric::kEuclidean};
      policy.keydiff.anchor = anchors[Uniform(0, 2)];
      policy.keydiff.metric = metrics[Uniform(0, 3)];
      const float fractions[] = {0.0f, 0.0f, 0.25f, 0.5f};
      policy.keydiff.recent_fraction = fractions[Uniform(0, 3)];
    }
    return policy;
  }

  void CreateSequence(SessionModel& session) {
    SeqModel seq;
    seq.policy = RandomPolicy();
    seq.budget.strict = Chance(0.5);
    seq.budget.tokens_per_layer = Chance(0.1) && !seq.budget.strict ? 0 : Uniform(1, 16);
    seq.budget.prefill_block_tokens = Uniform(1, 6);
    SequenceParams params;
    params.policy = seq.policy;
    params.budget = seq.budget;
    auto created = pool_.pool.CreateSequence(session.id, params);
    ASSERT_TRUE(created.ok()) << created.status();
    seq.id = created->sequence_id;
    seq.budget = created->budget;
    seq.appended.resize(session.layout.num_layers);
    seq.held.assign(session.layout.num_layers,
                    std::vector<std::set<int32_t>>(session.layout.num_kv_heads));
    session.seqs.push_back(std::move(seq));
  }

  HeadSets Observe(const SessionModel& session, const SeqModel& seq) {
    auto view = pool_.pool.GetLayout(session.id, seq.id, {}, true);
    EXPECT_TRUE(view.ok()) << view.status();
    HeadSets sets(session.layout.num_layers,
                  std::vector<std::set<int32_t>>(session.layout.num_kv_heads));
    if (!view.ok()) return sets;
    for (const LayerLayoutView& layer : view->layers) {
      for (int h = 0; h < session.layout.num_kv_heads; ++h) {
        sets[layer.layer][h].insert(layer.positions.begin() + h * layer.count,
                                    layer.positions.begin() + (h + 1) * layer.count);
      }
    }
    return sets;
  }

  // `after` is what one eviction with `policy` to `keep` left of `before`, per head of `layer`.
  void CheckEviction(const PolicyConfig& policy, const std::vector<std::set<int32_t>>& before,
                     const std::vector<std::set<int32_t>>& after, int32_t keep,
                     const std::string& what) {
    for (size_t h = 0; h < before.size(); ++h) {
      const std::set<int32_t>& candidates = before[h];
      const std::set<int32_t>& kept = after[h];
      SCOPED_TRACE(what + " head " + std::to_string(h));
      if (static_cast<int32_t>(candidates.size()) <= keep) {
        EXPECT_EQ(kept, candidates);
        continue;
      }
      ++evictions_checked_;
      ASSERT_EQ(static_cast<int32_t>(kept.size()), keep);
      EXPECT_TRUE(std::includes(candidates.begin(), candidates.end(), kept.begin(), kept.end()));
      const std::vector<int32_t> ordered(candidates.begin(), candidates.end());
      if (policy.name == kPolicyStreamingLlm) {
        const int32_t sinks = std::min(policy.streaming_llm.n_sink, keep);
        std::set<int32_t> expected(ordered.begin(), ordered.begin() + sinks);
        expected.insert(ordered.end() - (keep - sinks), ordered.end());
        EXPECT_EQ(kept, expected);
      } else {
        const int32_t recent =
            static_cast<int32_t>(std::floor(policy.keydiff.recent_fraction * keep));
        for (int32_t i = 0; i < recent; ++i) {
          EXPECT_TRUE(kept.count(ordered[ordered.size() - 1 - i]))
              << "recent position " << ordered[ordered.size() - 1 - i] << " evicted";
        }
      }
    }
  }

  // Layers of `session` where `now` differs from `before` must be evictions to `keep`; all other
  // layers must be unchanged.
  void CheckLayers(const SessionModel& session, const PolicyConfig& policy, const HeadSets& before,
                   const HeadSets& now, int32_t keep, const std::vector<bool>& may_evict,
                   const std::string& what) {
    for (int32_t l = 0; l < session.layout.num_layers; ++l) {
      if (may_evict[l] && keep > 0) {
        CheckEviction(policy, before[l], now[l], keep, what + " layer " + std::to_string(l));
      } else {
        EXPECT_EQ(now[l], before[l]) << what << " changed layer " << l;
      }
    }
  }

  void CheckInvariants(const SessionModel& session, const SeqModel& seq) {
    ASSERT_TRUE(ContentsMatch(pool_.pool, session.id, seq.id, session.layout, HashValue));
    for (int32_t l = 0; l < session.layout.num_layers; ++l) {
      for (const std::set<int32_t>& head : seq.held[l]) {
        EXPECT_EQ(head.size(), seq.held[l][0].size());
        EXPECT_TRUE(std::includes(seq.appended[l].begin(), seq.appended[l].end(), head.begin(),
                                  head.end()));
        if (seq.budget.strict) {
          EXPECT_LE(static_cast<int32_t>(head.size()),
                    seq.budget.tokens_per_layer + seq.budget.prefill_block_tokens);
        }
      }
    }
  }

  void CheckBlocks(const SessionModel& session) {
    int64_t held = 0;
    for (const SequenceInfo& info : pool_.pool.ListSequences(session.id)) {
      held += static_cast<int64_t>(info.arena_bytes / session.layout.block_bytes());
    }
    EXPECT_EQ(held + pool_.FreeBlocks(session.id), session.num_blocks);
  }

  void DoReserve(SessionModel& session, SeqModel& seq) {
    const ModelLayout& layout = session.layout;
    const int32_t max_tokens = seq.budget.strict ? seq.budget.prefill_block_tokens : 8;
    const int32_t tokens = Uniform(1, max_tokens);
    std::vector<int32_t> layers;
    if (Chance(0.3)) {
      for (int32_t l = 0; l < layout.num_layers; ++l) {
        if (Chance(0.5)) layers.push_back(l);
      }
      std::shuffle(layers.begin(), layers.end(), rng_);
    }
    std::vector<int32_t> positions;
    if (Chance(0.3)) {
      int32_t p = seq.next_position + Uniform(0, 3);
      for (int32_t i = 0; i < tokens; ++i, p += Uniform(1, 3)) positions.push_back(p);
    }
    const HeadSets before = seq.held;
    auto reservation = pool_.pool.Reserve(session.id, seq.id, tokens, positions, layers);
    HeadSets now = Observe(session, seq);
    if (!reservation.ok()) {
      ASSERT_EQ(reservation.status().code(), absl::StatusCode::kResourceExhausted)
          << reservation.status();
      EXPECT_EQ(now, before);
      return;
    }
    const std::vector<int32_t> reserved = ReservedLayers(*reservation);
    if (!layers.empty()) {
      EXPECT_EQ(reserved, layers);
    }
    if (!positions.empty()) {
      EXPECT_EQ(reservation->positions, positions);
    }
    std::vector<bool> may_evict(layout.num_layers, false);
    for (int32_t l : reserved) may_evict[l] = seq.budget.strict;
    CheckLayers(session, seq.policy, before, now, seq.budget.tokens_per_layer, may_evict,
                "strict reserve");
    for (const LayerSlots& slots : reservation->layers) {
      EXPECT_EQ(slots.first_slot, static_cast<int32_t>(now[slots.layer][0].size()));
      if (seq.budget.strict) {
        EXPECT_LE(slots.first_slot, seq.budget.tokens_per_layer);
      }
    }
    seq.held = now;
    const std::vector<uint8_t> payload =
        BuildPayload(layout, reserved, reservation->positions, HashValue);
    ASSERT_EQ(payload.size(), reservation->payload_bytes);
    const uint64_t chunk = Chance(0.5) ? Uniform(1, 97) : payload.size();
    for (uint64_t offset = 0; offset < payload.size(); offset += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, payload.size() - offset);
      ASSERT_TRUE(pool_.pool
                      .WriteReserved(session.id, seq.id, reservation->reservation_id, offset,
                                     absl::MakeConstSpan(payload.data() + offset, n))
                      .ok());
    }
    seq.pending = *reservation;
    if (Chance(0.8)) DoCommit(session, seq);
  }

  void DoCommit(SessionModel& session, SeqModel& seq) {
    const Reservation reservation = *seq.pending;
    const bool compress = Chance(0.5);
    auto commit = pool_.pool.Commit(session.id, seq.id, reservation.reservation_id, compress);
    ASSERT_TRUE(commit.ok()) << commit.status();
    seq.pending.reset();
    HeadSets candidates = seq.held;
    for (const LayerSlots& slots : reservation.layers) {
      for (std::set<int32_t>& head : candidates[slots.layer]) {
        head.insert(reservation.positions.begin(), reservation.positions.end());
      }
      seq.appended[slots.layer].insert(reservation.positions.begin(), reservation.positions.end());
    }
    seq.next_position = reservation.positions.back() + 1;
    const HeadSets now = Observe(session, seq);
    const int32_t budget = seq.budget.tokens_per_layer;
    CheckLayers(session, seq.policy, candidates, now, budget,
                std::vector<bool>(session.layout.num_layers, compress && budget > 0), "commit");
    for (int32_t l = 0; l < session.layout.num_layers; ++l) {
      EXPECT_EQ(commit->counts[l], static_cast<int32_t>(now[l][0].size()));
      if (compress && budget > 0) {
        EXPECT_LE(commit->counts[l], budget);
      }
    }
    seq.held = now;
  }

  void DoCompress(SessionModel& session, SeqModel& seq) {
    CompressParams params;
    params.budget_tokens = Chance(0.5) ? 0 : Uniform(1, 12);
    if (Chance(0.25)) params.policy = RandomPolicy();
    params.return_positions = Chance(0.5);
    const HeadSets before = seq.held;
    auto result = pool_.pool.Compress(session.id, seq.id, params);
    const HeadSets now = Observe(session, seq);
    if (seq.pending.has_value()) {
      EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(now, before);
      return;
    }
    ASSERT_TRUE(result.ok()) << result.status();
    const int32_t budget =
        params.budget_tokens > 0 ? params.budget_tokens : seq.budget.tokens_per_layer;
    // The pool resolves defaults; n_sink etc. are already explicit here.
    const PolicyConfig& policy = params.policy.has_value() ? *params.policy : seq.policy;
    CheckLayers(session, policy, before, now, budget,
                std::vector<bool>(session.layout.num_layers, budget > 0), "compress");
    for (const LayerCompressResult& layer : result->layers) {
      EXPECT_EQ(layer.kept, static_cast<int32_t>(now[layer.layer][0].size()));
      EXPECT_EQ(layer.kept + layer.evicted, static_cast<int32_t>(before[layer.layer][0].size()));
      if (budget > 0) {
        EXPECT_LE(layer.kept, budget);
      }
    }
    seq.held = now;
  }

  void Step() {
    SessionModel& session = sessions_[Uniform(0, static_cast<int>(sessions_.size()) - 1)];
    if (session.seqs.empty() || Chance(0.03)) {
      if (session.seqs.size() < 6) CreateSequence(session);
      return;
    }
    const size_t index = Uniform(0, static_cast<int>(session.seqs.size()) - 1);
    SeqModel& seq = session.seqs[index];
    const int op = Uniform(0, 99);
    if (seq.pending.has_value()) {
      if (op < 15) {
        // A second reservation is refused and changes nothing.
        EXPECT_EQ(pool_.pool.Reserve(session.id, seq.id, 1, {}, {}).status().code(),
                  absl::StatusCode::kFailedPrecondition);
      } else if (op < 30) {
        DoCompress(session, seq);  // refused while pending
      } else if (op < 50) {
        ASSERT_TRUE(
            pool_.pool.CancelReservation(session.id, seq.id, seq.pending->reservation_id).ok());
        seq.pending.reset();
        EXPECT_EQ(Observe(session, seq), seq.held);
      } else {
        DoCommit(session, seq);
      }
    } else if (op < 65) {
      DoReserve(session, seq);
    } else if (op < 90) {
      DoCompress(session, seq);
    } else if (op < 96) {
      auto released = pool_.pool.ReleaseSequence(session.id, seq.id);
      ASSERT_TRUE(released.ok()) << released.status();
      session.seqs.erase(session.seqs.begin() + index);
      CheckBlocks(session);
      return;
    } else {
      CheckBlocks(session);
    }
    if (::testing::Test::HasFatalFailure()) return;
    CheckInvariants(session, seq);
  }
};

TEST_P(PoolPropertyTest, RandomOperationsKeepEveryInvariant) {
  struct Shape {
    ModelLayout layout;
    int32_t blocks;
  };
  const Shape shapes[] = {
      {MakeLayout(2, 2, 4, DType::kFloat16, 4), 160},
      {MakeLayout(3, 1, 3, DType::kBFloat16, 2), 240},
      {MakeLayout(1, 3, 5, DType::kFloat32, 3), 120},
  };
  for (const Shape& shape : shapes) {
    SessionModel session;
    session.id = pool_.Attach(shape.layout, shape.blocks);
    session.layout = shape.layout;
    session.num_blocks = shape.blocks;
    sessions_.push_back(std::move(session));
  }
  for (SessionModel& session : sessions_) {
    for (int i = 0; i < 3; ++i) CreateSequence(session);
  }
  for (int step = 0; step < 4000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Step();
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(evictions_checked_, 100);

  // Release everything: every block comes back.
  const PoolStats stats = pool_.pool.GetStats();
  EXPECT_GT(stats.tokens_appended, 0);
  EXPECT_GT(stats.tokens_evicted, 0);
  for (SessionModel& session : sessions_) {
    for (SeqModel& seq : session.seqs) {
      ASSERT_TRUE(pool_.pool.ReleaseSequence(session.id, seq.id).ok());
    }
    EXPECT_EQ(pool_.FreeBlocks(session.id), session.num_blocks);
  }
  EXPECT_EQ(pool_.pool.GetStats().arena_bytes_used, 0u);
  for (SessionModel& session : sessions_) ASSERT_TRUE(pool_.pool.Detach(session.id).ok());
  EXPECT_EQ(pool_.pool.GetStats().arena_bytes_reserved, 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PoolPropertyTest, ::testing::Values(1u, 2u, 3u));

}  // namespace
}  // namespace kvs
