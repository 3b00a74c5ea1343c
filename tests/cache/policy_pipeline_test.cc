// The sequence's policy pipeline (cache/sequence.h): attention validation, Observe (the given
// scores sliced per layer and to the trailing rows), allocation (explicit per-layer budgets),
// Select, Merge, compaction of rows AND policy state, DecodeStep and the Score dry run. Test-only
// policies stand in for the attention-based ones, so the pipeline is exercised on its own.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "cache/block_allocator.h"
#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"
#include "cache/sequence.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing_util::BuildPayload;
using testing_util::HashValue;
using testing_util::ReservedLayers;

// What the aligned policy stores for the token at `position` in kv head `head`: >= 1, so 0 is
// "a token the policy has not seen", and scattered, so evictions leave holes everywhere.
float TokenValue(int head, int32_t position) {
  uint32_t x = static_cast<uint32_t>(position) * 0x9E3779B1u + static_cast<uint32_t>(head) * 7919u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 13;
  return 1.0f + static_cast<float>(x % 997);
}

struct RecordedStep {
  Phase phase = Phase::kPrefill;
  int32_t layer = 0;
  int32_t num_queries = 0;
  int32_t step_queries = 0;
  std::vector<float> probs;
  std::vector<int32_t> query_positions;
};

struct PolicyLog {
  std::vector<RecordedStep> steps;
  int misaligned = 0;       // a state value that does not belong to the slot's token
  int stale = 0;            // step_scores left over from an earlier call
  int merges = 0;           // Merge calls
  int selects_without = 0;  // Select saw no step scores although this call observed
};

// TEST-ONLY policies over the shared selector (no protection, uniform allocator):
//   kAligned:    Observe checks that accumulated[q][s] is 0 (a new token) or TokenValue of the
//                slot's token, then sets it; Score reads it back (and checks it again). Any
//                misalignment of the state against the positions is counted.
//   kAccumulate: H2O-like: accumulated += the column sums of this step's probabilities; the
//                score is their GQA mean.
// Both need attention, report Merge as "every evicted token merged", and record every step.
class TestPolicy final : public ScoredPolicy {
 public:
  enum class Mode { kAligned, kAccumulate };
  TestPolicy(Mode mode, int32_t trailing, PolicyLog* log)
      : ScoredPolicy(Config(), MakeLayerAllocator(Config())),
        mode_(mode),
        trailing_(trailing),
        log_(log) {}

  static PolicyConfig Config() {
    PolicyConfig config;
    config.name = "test_pipeline";
    return config;
  }

  absl::Status Merge(Backend&, Phase, absl::Span<const LayerSelection> layers,
                     absl::Span<int32_t> merged) const override {
    ++log_->merges;
    for (size_t i = 0; i < layers.size(); ++i) merged[i] = layers[i].keys.count - layers[i].keep;
    return absl::OkStatus();
  }

 protected:
  AttentionRequirement ScorerAttention(Phase) const override {
    return AttentionRequirement{true, trailing_};
  }
  // It writes `accumulated` itself (a value per token, or its own sums), so the base class must
  // not add the column sums it keeps for H2O and D2O; the sequence still aligns the array.
  bool ScorerNeedsAccumulated() const override { return false; }

  absl::Status ObserveLayers(Backend&, Phase phase,
                             absl::Span<const LayerStep> layers) const override {
    for (const LayerStep& step : layers) {
      RecordedStep record;
      record.phase = phase;
      record.layer = step.layer;
      record.num_queries = step.num_queries;
      record.step_queries = step.step_queries;
      record.probs.assign(step.probs.begin(), step.probs.end());
      record.query_positions.assign(step.query_positions.begin(), step.query_positions.end());
      log_->steps.push_back(std::move(record));

      LayerPolicyState& state = *step.state;
      const int32_t count = step.keys.count;
      const int32_t hq = step.num_q_heads;
      const int32_t group = hq / step.keys.num_kv_heads;
      if (!state.step_scores.empty()) ++log_->stale;
      if (state.accumulated.empty()) {
        state.accumulated.assign(static_cast<size_t>(hq) * count, 0.0f);
      } else if (state.accumulated.size() != static_cast<size_t>(hq) * count) {
        ++log_->misaligned;
        state.accumulated.assign(static_cast<size_t>(hq) * count, 0.0f);
      }
      for (int32_t q = 0; q < hq; ++q) {
        const int32_t head = q / group;
        for (int32_t s = 0; s < count; ++s) {
          float& value = state.accumulated[static_cast<size_t>(q) * count + s];
          if (mode_ == Mode::kAligned) {
            const float want = TokenValue(head, step.positions[head * count + s]);
            if (value != 0.0f && value != want) ++log_->misaligned;
            value = want;
          } else {
            for (int32_t i = 0; i < step.num_queries; ++i) {
              value += step.probs[(static_cast<size_t>(q) * step.num_queries + i) * count + s];
            }
          }
        }
      }
      state.step_scores = state.accumulated;
    }
    return absl::OkStatus();
  }

  Protection Protect(Phase, const LayerSelection&) const override { return {}; }

  absl::Status Score(Backend&, Phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override {
    for (size_t i = 0; i < layers.size(); ++i) {
      const LayerSelection& layer = layers[i];
      const LayerPolicyState& state = *layer.state;
      const int32_t count = layer.keys.count;
      const int32_t heads = layer.keys.num_kv_heads;
      const int32_t group = layer.num_q_heads / heads;
      if (state.accumulated.size() != static_cast<size_t>(layer.num_q_heads) * count) {
        ++log_->misaligned;
        continue;
      }
      if (state.step_scores.empty()) ++log_->selects_without;
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t s = 0; s < count; ++s) {
          double sum = 0.0;
          for (int32_t q = h * group; q < (h + 1) * group; ++q) {
            const float value = state.accumulated[static_cast<size_t>(q) * count + s];
            if (mode_ == Mode::kAligned && value != 0.0f &&
                value != TokenValue(h, layer.positions[h * count + s])) {
              ++log_->misaligned;
            }
            sum += value;
          }
          scores[i][h * count + s] = static_cast<float>(sum / group);
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  const Mode mode_;
  const int32_t trailing_;
  PolicyLog* const log_;
};

ModelLayout GqaLayout(int32_t layers = 2) {
  ModelLayout layout = testing_util::MakeLayout(layers, 2, 4, DType::kFloat32, 4);
  layout.num_q_heads = 4;  // two query heads per kv head
  return layout;
}

// A sequence with any policy on a CPU-backend arena.
class Harness {
 public:
  Harness(const ModelLayout& layout, std::unique_ptr<Policy> policy, BudgetConfig budget,
          int32_t num_blocks = 256)
      : layout_(layout), backend_(testing_util::MakeTestBackend(1)), allocator_(num_blocks) {
    ArenaOptions options;
    options.name_prefix = "kvs-pipeline-test";
    auto arena = backend_->CreateArena(num_blocks * layout.block_bytes(), options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    arena_ = *std::move(arena);
    sequence_ = std::make_unique<Sequence>("seq", layout, std::move(policy), std::move(budget),
                                           absl::UnixEpoch());
  }

  SequenceEnv env() { return SequenceEnv{layout_, *arena_, allocator_, *backend_, "s", 1 << 20}; }
  Sequence& seq() { return *sequence_; }
  Backend& backend() { return *backend_; }

  // Reserves and writes `n` tokens (HashValue payload); returns the reservation id.
  uint64_t Stage(int32_t n) {
    const uint64_t id = next_id_++;
    auto reservation = sequence_->Reserve(env(), id, n, {}, {});
    EXPECT_TRUE(reservation.ok()) << reservation.status();
    if (!reservation.ok()) return 0;
    const auto payload =
        BuildPayload(layout_, ReservedLayers(*reservation), reservation->positions, HashValue);
    EXPECT_TRUE(sequence_->WriteReserved(env(), id, 0, payload).ok());
    return id;
  }

  SequenceLayout Layout() {
    auto view = sequence_->GetLayout(env(), {}, true);
    EXPECT_TRUE(view.ok()) << view.status();
    return *view;
  }

  // Scores [layers][Hq][w][count] for the layout after `added` more tokens per listed layer,
  // every value fn(layer, q, i, slot).
  template <typename Fn>
  AttentionInput Scores(const std::vector<int32_t>& layers, int32_t w, int32_t added, Fn fn) {
    AttentionInput input;
    input.layers = layers;
    input.num_queries = w;
    const SequenceLayout view = Layout();
    for (int32_t l : layers) {
      const int32_t count = view.layers[l].count + added;
      for (int32_t q = 0; q < layout_.num_q_heads; ++q) {
        for (int32_t i = 0; i < w; ++i) {
          for (int32_t s = 0; s < count; ++s) input.scores.push_back(fn(l, q, i, s));
        }
      }
    }
    return input;
  }

  // Every kept row holds what was written for its position.
  ::testing::AssertionResult ContentsMatch() {
    const SequenceLayout view = Layout();
    uint64_t total = 0;
    for (const auto& l : view.layers)
      total += 2ull * layout_.num_kv_heads * l.count * layout_.row_bytes();
    std::vector<uint8_t> out(total);
    absl::Status status = sequence_->ReadExport(env(), {}, view.version, 0, absl::MakeSpan(out));
    if (!status.ok()) return ::testing::AssertionFailure() << status;
    uint64_t cursor = 0;
    for (const auto& l : view.layers) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < layout_.num_kv_heads; ++h) {
          for (int32_t s = 0; s < l.count; ++s) {
            const auto want = testing_util::RowBytes(layout_, HashValue, l.layer, kv, h,
                                                     l.positions[h * l.count + s]);
            if (std::memcmp(out.data() + cursor, want.data(), want.size()) != 0) {
              return ::testing::AssertionFailure() << "layer " << l.layer << " slot " << s;
            }
            cursor += want.size();
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  ModelLayout layout_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Arena> arena_;
  BlockAllocator allocator_;
  std::unique_ptr<Sequence> sequence_;
  uint64_t next_id_ = 1;
};

CompressParams Attended(const AttentionInput& attention) {
  CompressParams params;
  params.attention = attention;
  return params;
}

CompressParams Budgeted(int32_t tokens) {
  CompressParams params;
  params.budget_tokens = tokens;
  return params;
}

BudgetConfig Budget(int32_t tokens, bool strict = false, int32_t block = 128) {
  return testing_util::Budget(tokens, strict, block);
}

std::vector<int32_t> HeadSet(const LayerLayoutView& layer, int head) {
  return testing_util::HeadPositions(layer, head);
}

// The top `keep` positions of `candidates` by TokenValue(head, .), ties to the lower position;
// sorted.
std::vector<int32_t> TopByValue(std::vector<int32_t> candidates, int head, int32_t keep) {
  std::sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) {
    const float va = TokenValue(head, a), vb = TokenValue(head, b);
    return va != vb ? va > vb : a < b;
  });
  candidates.resize(std::min<size_t>(candidates.size(), keep));
  std::sort(candidates.begin(), candidates.end());
  return candidates;
}

TEST(PolicyPipelineTest, StateStaysAlignedWithPositionsThroughCommitsAndCompactions) {
  const ModelLayout layout = GqaLayout();
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAligned, 0, &log), Budget(10));
  std::mt19937 rng(7);
  std::vector<std::vector<std::vector<int32_t>>> expected(
      layout.num_layers, std::vector<std::vector<int32_t>>(layout.num_kv_heads));
  int32_t next = 0;
  for (int round = 0; round < 12; ++round) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % 7);
    const uint64_t id = h.Stage(n);
    const AttentionInput attention =
        h.Scores({0, 1}, 1, n, [](int32_t, int32_t, int32_t, int32_t) { return 0.25f; });
    auto commit = h.seq().Commit(h.env(), id, /*compress=*/true, &attention);
    ASSERT_TRUE(commit.ok()) << commit.status();
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      for (int head = 0; head < layout.num_kv_heads; ++head) {
        std::vector<int32_t>& want = expected[l][head];
        for (int32_t p = next; p < next + n; ++p) want.push_back(p);
        want = TopByValue(want, head, 10);
      }
    }
    next += n;
    const SequenceLayout view = h.Layout();
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      EXPECT_LE(view.layers[l].count, 10);
      for (int head = 0; head < layout.num_kv_heads; ++head) {
        EXPECT_EQ(HeadSet(view.layers[l], head), expected[l][head])
            << "round " << round << " layer " << l << " head " << head;
      }
    }
  }
  EXPECT_EQ(log.misaligned, 0);
  EXPECT_EQ(log.stale, 0);
  EXPECT_EQ(log.selects_without, 0);
  EXPECT_GT(log.merges, 0);
  EXPECT_TRUE(h.ContentsMatch());
  // The two heads chose differently (the scrambling really moved rows around).
  const SequenceLayout view = h.Layout();
  EXPECT_NE(HeadSet(view.layers[0], 0), HeadSet(view.layers[0], 1));
}

TEST(PolicyPipelineTest, ObserveSeesTheLayersScoresSlicedToTheTrailingRows) {
  const ModelLayout layout = GqaLayout(3);
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 2, &log),
            BudgetConfig{});
  ASSERT_TRUE(h.seq().Commit(h.env(), h.Stage(4), false).ok());
  const uint64_t id = h.Stage(3);  // 7 tokens after the commit
  auto encode = [](int32_t l, int32_t q, int32_t i, int32_t s) {
    return static_cast<float>(l * 100000 + q * 1000 + i * 100 + s);
  };
  const AttentionInput attention = h.Scores({2, 0}, 5, 3, encode);
  ASSERT_TRUE(h.seq().Commit(h.env(), id, false, &attention).ok());
  ASSERT_EQ(log.steps.size(), 2u);
  const std::vector<int32_t> order = {2, 0};
  for (size_t k = 0; k < 2; ++k) {
    const RecordedStep& step = log.steps[k];
    EXPECT_EQ(step.layer, order[k]);
    EXPECT_EQ(step.phase, Phase::kPrefill);
    EXPECT_EQ(step.num_queries, 2);  // trailing_queries
    EXPECT_EQ(step.step_queries, 5);
    EXPECT_THAT(step.query_positions, ElementsAreArray({5, 6}));  // newest of 0..6
    ASSERT_EQ(step.probs.size(), 4u * 2 * 7);
    for (int32_t q = 0; q < 4; ++q) {
      for (int32_t r = 0; r < 2; ++r) {
        for (int32_t s = 0; s < 7; ++s) {
          ASSERT_EQ(step.probs[(q * 2 + r) * 7 + s], encode(order[k], q, 3 + r, s))
              << "layer " << order[k] << " q " << q << " row " << r << " slot " << s;
        }
      }
    }
  }
  EXPECT_EQ(log.stale, 0);

  // Explicit query positions pass through (sliced the same way).
  log.steps.clear();
  AttentionInput explicit_positions = h.Scores({1}, 3, 0, encode);
  explicit_positions.query_positions = {10, 20, 30};
  ASSERT_TRUE(h.seq().Compress(h.env(), Attended(explicit_positions)).ok());
  ASSERT_EQ(log.steps.size(), 1u);
  EXPECT_THAT(log.steps[0].query_positions, ElementsAreArray({20, 30}));
  EXPECT_EQ(log.stale, 0);
}

TEST(PolicyPipelineTest, ObserveComputesTrailingRowsFromQueries) {
  const ModelLayout layout = GqaLayout(1);
  // Two identical sequences: one policy reads the last query only, the other all three.
  PolicyLog trailing_log, full_log;
  Harness trailing(layout,
                   std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 1, &trailing_log),
                   BudgetConfig{});
  Harness full(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 0, &full_log),
               BudgetConfig{});
  ASSERT_TRUE(trailing.seq().Commit(trailing.env(), trailing.Stage(6), false).ok());
  ASSERT_TRUE(full.seq().Commit(full.env(), full.Stage(6), false).ok());
  AttentionInput attention;
  attention.num_queries = 3;
  attention.softmax_scale = 0.5f;
  for (int32_t i = 0; i < layout.num_q_heads * 3 * layout.head_dim; ++i) {
    attention.queries.push_back(static_cast<float>((i * 37) % 11) / 8.0f - 0.6f);
  }
  absl::Status status = trailing.seq().Compress(trailing.env(), Attended(attention)).status();
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_TRUE(full.seq().Compress(full.env(), Attended(attention)).ok());
  ASSERT_EQ(trailing_log.steps.size(), 1u);
  ASSERT_EQ(full_log.steps.size(), 1u);
  const RecordedStep& last = trailing_log.steps[0];
  const RecordedStep& all = full_log.steps[0];
  EXPECT_EQ(last.num_queries, 1);
  EXPECT_EQ(last.step_queries, 3);
  EXPECT_THAT(last.query_positions, ElementsAreArray({5}));
  EXPECT_EQ(all.num_queries, 3);
  EXPECT_THAT(all.query_positions, ElementsAreArray({3, 4, 5}));
  ASSERT_EQ(last.probs.size(), 4u * 1 * 6);
  ASSERT_EQ(all.probs.size(), 4u * 3 * 6);
  for (int32_t q = 0; q < 4; ++q) {
    double sum = 0.0;
    for (int32_t s = 0; s < 6; ++s) {
      // Row q of the trailing run is row (q, 2) of the full one.
      EXPECT_FLOAT_EQ(last.probs[q * 6 + s], all.probs[(q * 3 + 2) * 6 + s]);
      sum += last.probs[q * 6 + s];
      // Query 0 (position 3) sees keys 0..3 only: causal.
      EXPECT_EQ(all.probs[(q * 3 + 0) * 6 + 4], 0.0f);
    }
    EXPECT_NEAR(sum, 1.0, 1e-5) << "query head " << q;
  }
}

TEST(PolicyPipelineTest, AttentionValidationNamesFieldsAndChangesNothing) {
  const ModelLayout layout = GqaLayout();
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 0, &log),
            Budget(100));
  ASSERT_TRUE(h.seq().Commit(h.env(), h.Stage(3), false).ok());
  const uint64_t id = h.Stage(2);
  auto good = [&] {
    return h.Scores({0, 1}, 2, 2, [](int32_t, int32_t, int32_t, int32_t) { return 0.1f; });
  };
  struct Case {
    const char* field;
    std::function<void(AttentionInput&)> spoil;
  };
  const std::vector<Case> cases = {
      {"attention.layers[1]",
       [](AttentionInput& a) {
         a.layers = {0, 0};
       }},
      {"attention.layers[0]",
       [](AttentionInput& a) {
         a.layers = {5, 0};
       }},
      {"attention.num_queries", [](AttentionInput& a) { a.num_queries = 0; }},
      {"attention.num_queries", [](AttentionInput& a) { a.num_queries = 5000; }},
      {"attention.num_queries", [](AttentionInput& a) { a.num_queries = 6; }},  // > 5 positions
      {"attention.query_positions", [](AttentionInput& a) { a.query_positions = {1}; }},
      {"attention.query_positions",
       [](AttentionInput& a) {
         a.query_positions = {3, 3};
       }},
      {"attention.query_positions[0]",
       [](AttentionInput& a) {
         a.query_positions = {-1, 3};
       }},
      {"exactly one", [](AttentionInput& a) { a.scores.clear(); }},
      {"exactly one", [](AttentionInput& a) { a.queries = {1.0f}; }},
      {"attention.attention_scores", [](AttentionInput& a) { a.scores.pop_back(); }},
      {"attention.attention_scores[3]",
       [](AttentionInput& a) { a.scores[3] = std::numeric_limits<float>::quiet_NaN(); }},
      {"attention.attention_scores[0]", [](AttentionInput& a) { a.scores[0] = -1.0f; }},
      {"attention.softmax_scale",
       [](AttentionInput& a) {
         a.scores.clear();
         a.queries.assign(2 * 4 * 2 * 4, 0.5f);
         a.softmax_scale = 0.0f;
       }},
      {"attention.inline_queries",
       [](AttentionInput& a) {
         a.scores.clear();
         a.queries.assign(7, 0.5f);
         a.softmax_scale = 1.0f;
       }},
      {"attention.inline_queries: non-finite value at layer 0 q head 0 query 0 dim 2",
       [](AttentionInput& a) {
         a.scores.clear();
         a.queries.assign(2 * 4 * 2 * 4, 0.5f);
         a.queries[2] = std::numeric_limits<float>::infinity();
         a.softmax_scale = 1.0f;
       }},
  };
  const uint64_t version = h.seq().version();
  for (const Case& c : cases) {
    AttentionInput input = good();
    c.spoil(input);
    auto result = h.seq().Commit(h.env(), id, true, &input);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(result.status().message(), HasSubstr(c.field));
    EXPECT_TRUE(h.seq().CheckPending(id).ok()) << c.field;  // still pending: nothing changed
    EXPECT_EQ(h.seq().version(), version) << c.field;
  }
  EXPECT_TRUE(log.steps.empty());
  const AttentionInput input = good();
  ASSERT_TRUE(h.seq().Commit(h.env(), id, true, &input).ok());
  EXPECT_EQ(log.steps.size(), 2u);
}

TEST(PolicyPipelineTest, EvictingWithoutTheNeededAttentionIsRefusedUnchanged) {
  const ModelLayout layout = GqaLayout();
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 0, &log),
            Budget(4));
  const uint64_t id = h.Stage(6);
  const uint64_t version = h.seq().version();
  auto missing = h.seq().Commit(h.env(), id, true, nullptr);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(),
              HasSubstr("policy test_pipeline needs attention (queries or attention_scores) for "
                        "layer 0: field attention"));
  const AttentionInput only_layer_1 =
      h.Scores({1}, 1, 6, [](int32_t, int32_t, int32_t, int32_t) { return 0.5f; });
  auto partial = h.seq().Commit(h.env(), id, true, &only_layer_1);
  EXPECT_THAT(partial.status().message(), HasSubstr("for layer 0"));
  EXPECT_EQ(h.seq().version(), version);
  EXPECT_TRUE(h.seq().CheckPending(id).ok());
  EXPECT_TRUE(log.steps.empty());
  // Not compressing needs none.
  ASSERT_TRUE(h.seq().Commit(h.env(), id, false, nullptr).ok());
  EXPECT_EQ(h.seq().counts(), (std::vector<int32_t>{6, 6}));
  // Compress needs it too; with it, both layers shrink and report the merges.
  EXPECT_EQ(h.seq().Compress(h.env(), CompressParams{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const AttentionInput all =
      h.Scores({0, 1}, 1, 0, [](int32_t, int32_t, int32_t s, int32_t) { return 0.5f; });
  auto compressed = h.seq().Compress(h.env(), Attended(all));
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_EQ(h.seq().counts(), (std::vector<int32_t>{4, 4}));
  for (const LayerCompressResult& layer : compressed->layers) {
    EXPECT_EQ(layer.evicted, 2);
    EXPECT_EQ(layer.merged, 2);
  }
}

TEST(PolicyPipelineTest, StrictBudgetOfAnAttentionPolicyEvictsAtCommit) {
  const ModelLayout layout = GqaLayout();
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAligned, 0, &log),
            Budget(8, /*strict=*/true, /*block=*/4));
  int32_t peak = 0;
  for (int block = 0; block < 6; ++block) {
    auto reservation = h.seq().Reserve(h.env(), 100 + block, 4, {}, {});
    ASSERT_TRUE(reservation.ok()) << reservation.status();
    EXPECT_EQ(reservation->evicted_before, 0);  // Reserve has no attention to choose with
    const auto payload =
        BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, HashValue);
    ASSERT_TRUE(h.seq().WriteReserved(h.env(), 100 + block, 0, payload).ok());
    const int32_t before = h.seq().counts()[0];
    if (before + 4 > 8) {
      // Over the budget after this commit: attention is required even without compress.
      EXPECT_EQ(h.seq().Commit(h.env(), 100 + block, false, nullptr).status().code(),
                absl::StatusCode::kInvalidArgument);
    }
    peak = std::max(peak, before + 4);
    const AttentionInput attention =
        h.Scores({0, 1}, 1, 4, [](int32_t, int32_t, int32_t, int32_t) { return 1.0f; });
    auto commit = h.seq().Commit(h.env(), 100 + block, false, &attention);
    ASSERT_TRUE(commit.ok()) << commit.status();
    for (int32_t count : commit->counts) EXPECT_LE(count, 8);
  }
  EXPECT_LE(peak, 8 + 4);
  EXPECT_EQ(log.misaligned, 0);
  EXPECT_TRUE(h.ContentsMatch());
}

TEST(PolicyPipelineTest, ScoreIsADryRunThatCompressAgreesWith) {
  const ModelLayout layout = GqaLayout();
  PolicyLog log;
  Harness h(layout, std::make_unique<TestPolicy>(TestPolicy::Mode::kAccumulate, 0, &log),
            BudgetConfig{});
  ASSERT_TRUE(h.seq().Commit(h.env(), h.Stage(9), false).ok());
  auto probs = [](int32_t l, int32_t q, int32_t i, int32_t s) {
    return static_cast<float>(((s * 7 + q * 3 + l) % 5) + i) / 10.0f;
  };
  const AttentionInput attention = h.Scores({0, 1}, 2, 0, probs);
  ScoreParams params;
  params.budget_tokens = 5;
  params.attention = attention;
  const SequenceLayout before = h.Layout();
  auto first = h.seq().Score(h.env(), params);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = h.seq().Score(h.env(), params);
  ASSERT_TRUE(second.ok()) << second.status();
  const SequenceLayout after = h.Layout();
  EXPECT_EQ(after.version, before.version);
  for (int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(after.layers[l].positions, before.layers[l].positions);
    EXPECT_EQ(after.layers[l].block_table, before.layers[l].block_table);
  }
  ASSERT_EQ(first->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const LayerScores& a = (*first)[i];
    const LayerScores& b = (*second)[i];
    // Identical twice: the first dry run did not accumulate into the sequence's state.
    EXPECT_EQ(a.scores, b.scores);
    EXPECT_EQ(a.kept_slots, b.kept_slots);
    EXPECT_EQ(a.kept, 5);
    EXPECT_EQ(a.positions, before.layers[a.layer].positions);
    // The score of a slot is the GQA mean of its column sums over the 2 queries.
    for (int32_t head = 0; head < 2; ++head) {
      for (int32_t s = 0; s < 9; ++s) {
        double want = 0.0;
        for (int32_t q = 2 * head; q < 2 * head + 2; ++q) {
          for (int32_t r = 0; r < 2; ++r) want += probs(a.layer, q, r, s);
        }
        EXPECT_NEAR(a.scores[head * 9 + s], want / 2, 1e-5);
      }
    }
  }
  EXPECT_EQ(log.merges, 0);
  // Compress with the same inputs keeps exactly the dry run's set.
  CompressParams compress;
  compress.budget_tokens = 5;
  compress.attention = attention;
  ASSERT_TRUE(h.seq().Compress(h.env(), compress).ok());
  const SequenceLayout kept = h.Layout();
  for (const LayerScores& scores : *first) {
    for (int32_t head = 0; head < 2; ++head) {
      std::vector<int32_t> want;
      for (int32_t t = 0; t < 5; ++t) {
        want.push_back(scores.positions[head * 9 + scores.kept_slots[head * 5 + t]]);
      }
      std::sort(want.begin(), want.end());
      EXPECT_EQ(HeadSet(kept.layers[scores.layer], head), want);
    }
  }
  // No budget anywhere: the dry run has nothing to score against.
  params.budget_tokens = 0;
  auto no_budget = h.seq().Score(h.env(), params);
  EXPECT_EQ(no_budget.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_budget.status().message(), HasSubstr("budget_tokens"));
}

TEST(PolicyPipelineTest, PerLayerBudgetsOverrideTheAllocator) {
  const ModelLayout layout = GqaLayout(3);
  BudgetConfig budget = Budget(6);
  budget.per_layer_tokens = {2, 6, 4};
  auto policy = MakePolicy(testing_util::KeyDiff());
  ASSERT_TRUE(policy.ok());
  Harness h(layout, *std::move(policy), budget);
  ASSERT_TRUE(h.seq().Commit(h.env(), h.Stage(5), false).ok());
  auto result = h.seq().Compress(h.env(), CompressParams{});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(h.seq().counts(), (std::vector<int32_t>{2, 5, 4}));
  EXPECT_EQ(result->layers[0].evicted, 3);
  EXPECT_EQ(result->layers[1].evicted, 0);
  EXPECT_EQ(result->layers[2].evicted, 1);
  // An explicit budget_tokens is a uniform budget instead.
  ASSERT_TRUE(h.seq().Compress(h.env(), Budgeted(3)).ok());
  EXPECT_EQ(h.seq().counts(), (std::vector<int32_t>{2, 3, 3}));
  EXPECT_TRUE(h.ContentsMatch());
}

// ---- Through the pool: DecodeStep, Score, per-layer budgets (registry policies). ----

using testing_util::TestPool;

testing_util::AppendOptions Compressing() {
  testing_util::AppendOptions options;
  options.compress = true;
  return options;
}

std::set<int32_t> Set(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

DecodeItem InlineItem(const ModelLayout& layout, const std::string& session,
                      const std::string& sequence, int32_t position) {
  DecodeItem item;
  item.session_id = session;
  item.sequence_id = sequence;
  std::vector<int32_t> layers(layout.num_layers);
  std::iota(layers.begin(), layers.end(), 0);
  item.inline_kv = BuildPayload(layout, layers, {position}, HashValue);
  return item;
}

// Checks result.evicted_positions against the layouts around the step.
void ExpectEvicted(const ModelLayout& layout, const SequenceLayout& before,
                   const SequenceLayout& after, int32_t new_position, const DecodeResult& result) {
  ASSERT_EQ(result.evicted_positions.size(),
            static_cast<size_t>(layout.num_layers) * layout.num_kv_heads);
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      std::set<int32_t> gone = Set(HeadSet(before.layers[l], h));
      gone.insert(new_position);
      for (int32_t p : HeadSet(after.layers[l], h)) gone.erase(p);
      const int32_t want = gone.empty() ? -1 : *gone.begin();
      EXPECT_EQ(result.evicted_positions[l * layout.num_kv_heads + h], want)
          << "layer " << l << " head " << h;
    }
  }
}

TEST(PoolPipelineTest, DecodeStepWithInlineKvAndReservationsKeepsEveryLayerAtBudget) {
  const ModelLayout layout = testing_util::MakeLayout(2, 2, 4, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string sink = pool.Create(session, testing_util::StreamingLlm(2), Budget(6));
  const std::string diff = pool.Create(session, testing_util::KeyDiff(), Budget(5));
  ASSERT_TRUE(testing_util::Append(pool.pool, session, sink, 6, layout, HashValue).ok());
  ASSERT_TRUE(
      testing_util::Append(pool.pool, session, diff, 9, layout, HashValue, Compressing()).ok());
  for (int32_t step = 0; step < 6; ++step) {
    const SequenceLayout sink_before = *pool.pool.GetLayout(session, sink, {}, true);
    const SequenceLayout diff_before = *pool.pool.GetLayout(session, diff, {}, true);
    std::vector<DecodeItem> items;
    items.push_back(InlineItem(layout, session, sink, 6 + step));
    // The keydiff sequence alternates: a reservation made (and written) before the step, or
    // its token inline.
    const int32_t diff_position = 9 + step;
    if (step % 2 == 0) {
      auto reservation = pool.pool.Reserve(session, diff, 1, {}, {});
      ASSERT_TRUE(reservation.ok()) << reservation.status();
      ASSERT_EQ(reservation->positions[0], diff_position);
      const auto payload =
          BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, HashValue);
      ASSERT_TRUE(
          pool.pool.WriteReserved(session, diff, reservation->reservation_id, 0, payload).ok());
      DecodeItem item;
      item.session_id = session;
      item.sequence_id = diff;
      item.reservation_id = reservation->reservation_id;
      items.push_back(item);
    } else {
      items.push_back(InlineItem(layout, session, diff, diff_position));
    }
    auto results = pool.pool.DecodeStep(items);
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 2u);
    EXPECT_EQ((*results)[0].counts, (std::vector<int32_t>{6, 6}));
    EXPECT_EQ((*results)[1].counts, (std::vector<int32_t>{5, 5}));
    EXPECT_EQ((*results)[0].position, 6 + step);
    // The inline token's position; a reserved token was placed by the worker: -1.
    EXPECT_EQ((*results)[1].position, step % 2 == 0 ? -1 : diff_position);
    const SequenceLayout sink_after = *pool.pool.GetLayout(session, sink, {}, true);
    const SequenceLayout diff_after = *pool.pool.GetLayout(session, diff, {}, true);
    ExpectEvicted(layout, sink_before, sink_after, 6 + step, (*results)[0]);
    ExpectEvicted(layout, diff_before, diff_after, diff_position, (*results)[1]);
    // StreamingLLM: sinks 0, 1 stay; the oldest non-sink goes.
    EXPECT_EQ((*results)[0].evicted_positions[0], 2 + step);
  }
  EXPECT_TRUE(testing_util::ContentsMatch(pool.pool, session, sink, layout, HashValue));
  EXPECT_TRUE(testing_util::ContentsMatch(pool.pool, session, diff, layout, HashValue));
}

TEST(PoolPipelineTest, DecodeStepReportsTheLowestOfSeveralEvictedPositions) {
  const ModelLayout layout = testing_util::MakeLayout(2, 2, 4, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string seq = pool.Create(session, testing_util::StreamingLlm(1), Budget(3));
  ASSERT_TRUE(testing_util::Append(pool.pool, session, seq, 8, layout, HashValue).ok());
  const SequenceLayout before = *pool.pool.GetLayout(session, seq, {}, true);
  auto results = pool.pool.DecodeStep({InlineItem(layout, session, seq, 8)});
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].counts, (std::vector<int32_t>{3, 3}));
  // Keeps the sink 0 and positions 7, 8: 1..6 go, the lowest is reported.
  EXPECT_EQ((*results)[0].evicted_positions, (std::vector<int32_t>{1, 1, 1, 1}));
  ExpectEvicted(layout, before, *pool.pool.GetLayout(session, seq, {}, true), 8, (*results)[0]);
}

TEST(PoolPipelineTest, BadDecodeItemsChangeNothing) {
  const ModelLayout layout = testing_util::MakeLayout(2, 2, 4, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string a = pool.Create(session, testing_util::StreamingLlm(1), Budget(4));
  const std::string b = pool.Create(session, testing_util::StreamingLlm(1), Budget(4));
  ASSERT_TRUE(testing_util::Append(pool.pool, session, a, 4, layout, HashValue).ok());
  ASSERT_TRUE(testing_util::Append(pool.pool, session, b, 4, layout, HashValue).ok());
  const SequenceLayout a_before = *pool.pool.GetLayout(session, a, {}, true);
  const int32_t free_before = pool.FreeBlocks(session);

  struct Case {
    std::vector<DecodeItem> items;
    absl::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  {
    DecodeItem bad = InlineItem(layout, session, b, 4);
    bad.inline_kv.pop_back();
    cases.push_back({{InlineItem(layout, session, a, 4), bad},
                     absl::StatusCode::kInvalidArgument,
                     "items[1]: inline_kv"});
  }
  cases.push_back({{InlineItem(layout, session, a, 4), InlineItem(layout, session, a, 5)},
                   absl::StatusCode::kInvalidArgument,
                   "items[1]: sequence"});
  cases.push_back({{InlineItem(layout, session, a, 4), InlineItem(layout, session, "nope", 4)},
                   absl::StatusCode::kNotFound,
                   "items[1]: sequence nope not found"});
  cases.push_back(
      {{InlineItem(layout, "no-session", a, 4)}, absl::StatusCode::kNotFound, "items[0]: session"});
  {
    DecodeItem item = InlineItem(layout, session, a, 4);
    item.attention.num_queries = 2;
    item.attention.scores.assign(2 * 2 * 2 * 5, 0.1f);
    cases.push_back({{InlineItem(layout, session, b, 4), item},
                     absl::StatusCode::kInvalidArgument,
                     "items[1]: attention.num_queries must be 1"});
  }
  {
    DecodeItem item = InlineItem(layout, session, a, 4);
    item.attention.num_queries = 1;
    item.attention.scores.assign(2 * 2 * 1 * 4, 0.1f);  // counts before the token: one short
    cases.push_back(
        {{item}, absl::StatusCode::kInvalidArgument, "items[0]: attention.attention_scores"});
  }
  {
    DecodeItem item;
    item.session_id = session;
    item.sequence_id = a;
    item.reservation_id = 77;
    cases.push_back({{item}, absl::StatusCode::kNotFound, "items[0]: reservation 77"});
  }
  for (const Case& c : cases) {
    auto result = pool.pool.DecodeStep(c.items);
    EXPECT_EQ(result.status().code(), c.code) << c.message << ": " << result.status();
    EXPECT_THAT(result.status().message(), HasSubstr(c.message));
    const SequenceLayout a_after = *pool.pool.GetLayout(session, a, {}, true);
    EXPECT_EQ(a_after.version, a_before.version) << c.message;
    EXPECT_EQ(a_after.layers[0].positions, a_before.layers[0].positions) << c.message;
    EXPECT_EQ(pool.FreeBlocks(session), free_before) << c.message;
  }

  // A reservation of two tokens is not a decode step's; a pending one blocks inline tokens.
  auto two = pool.pool.Reserve(session, a, 2, {}, {});
  ASSERT_TRUE(two.ok());
  DecodeItem item;
  item.session_id = session;
  item.sequence_id = a;
  item.reservation_id = two->reservation_id;
  auto result = pool.pool.DecodeStep({item});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("items[0]: reservation_id"));
  result = pool.pool.DecodeStep({InlineItem(layout, session, a, 4)});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(pool.pool.CancelReservation(session, a, two->reservation_id).ok());

  // With valid attention scores (ignored by StreamingLLM) the step runs.
  DecodeItem good = InlineItem(layout, session, a, 4);
  good.attention.num_queries = 1;
  good.attention.scores.assign(2 * 2 * 1 * 5, 0.1f);
  auto ok = pool.pool.DecodeStep({good});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].counts, (std::vector<int32_t>{4, 4}));
  EXPECT_EQ((*ok)[0].evicted_positions[0], 1);
}

TEST(PoolPipelineTest, ScoreChangesNothingAndAgreesWithCompress) {
  const ModelLayout layout = testing_util::MakeLayout(2, 2, 8, DType::kFloat16, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string seq = pool.Create(session, testing_util::KeyDiff(), BudgetConfig{});
  ASSERT_TRUE(testing_util::Append(pool.pool, session, seq, 11, layout, HashValue).ok());
  ScoreParams params;
  auto none = pool.pool.Score(session, seq, params);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("budget_tokens"));
  params.budget_tokens = -1;
  EXPECT_EQ(pool.pool.Score(session, seq, params).status().code(),
            absl::StatusCode::kInvalidArgument);

  params.budget_tokens = 6;
  params.layers = {1};
  const SequenceLayout before = *pool.pool.GetLayout(session, seq, {}, true);
  auto scores = pool.pool.Score(session, seq, params);
  ASSERT_TRUE(scores.ok()) << scores.status();
  const SequenceLayout after = *pool.pool.GetLayout(session, seq, {}, true);
  EXPECT_EQ(after.version, before.version);
  EXPECT_EQ(after.layers[1].positions, before.layers[1].positions);
  EXPECT_TRUE(testing_util::ContentsMatch(pool.pool, session, seq, layout, HashValue));
  ASSERT_EQ(scores->size(), 1u);
  const LayerScores& layer = (*scores)[0];
  EXPECT_EQ(layer.layer, 1);
  EXPECT_EQ(layer.kept, 6);
  EXPECT_EQ(layer.scores.size(), 2u * 11);
  EXPECT_EQ(layer.positions, before.layers[1].positions);
  ASSERT_EQ(layer.kept_slots.size(), 2u * 6);

  CompressParams compress;
  compress.budget_tokens = 6;
  ASSERT_TRUE(pool.pool.Compress(session, seq, compress).ok());
  const SequenceLayout kept = *pool.pool.GetLayout(session, seq, {}, true);
  for (int h = 0; h < 2; ++h) {
    std::vector<int32_t> want;
    for (int32_t t = 0; t < 6; ++t) {
      want.push_back(layer.positions[h * 11 + layer.kept_slots[h * 6 + t]]);
    }
    std::sort(want.begin(), want.end());
    EXPECT_EQ(HeadSet(kept.layers[1], h), want) << "head " << h;
  }
}

TEST(PoolPipelineTest, PerLayerBudgetsAreValidatedAndUsed) {
  const ModelLayout layout = testing_util::MakeLayout(2, 2, 4, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  SequenceParams params;
  params.policy = testing_util::StreamingLlm(1);
  params.budget = Budget(8);
  params.budget->per_layer_tokens = {3};
  auto bad = pool.pool.CreateSequence(session, params);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("budget.per_layer_tokens"));
  params.budget->per_layer_tokens = {3, 0};
  bad = pool.pool.CreateSequence(session, params);
  EXPECT_THAT(bad.status().message(), HasSubstr("budget.per_layer_tokens[1]"));
  params.budget->per_layer_tokens = {3, 5};
  auto created = pool.pool.CreateSequence(session, params);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(testing_util::Append(pool.pool, session, created->sequence_id, 7, layout, HashValue,
                                   Compressing())
                  .ok());
  auto results = pool.pool.DecodeStep({InlineItem(layout, session, created->sequence_id, 7)});
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].counts, (std::vector<int32_t>{3, 5}));
}

// `w` queries per layer and query head, uniform in [-1, 1), drawn from `rng`.
AttentionInput RandomQueries(const ModelLayout& layout, int32_t w, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  AttentionInput input;
  input.num_queries = w;
  input.softmax_scale = 0.35f;
  input.queries.resize(static_cast<size_t>(layout.num_layers) * layout.num_q_heads * w *
                       layout.head_dim);
  for (float& q : input.queries) q = uniform(rng);
  return input;
}

// Every registered policy through the pool: prompt commits with their queries, compression, then
// decode steps with inline K/V and the new token's query. A smoke test of the seams (the policies
// have their own tests): every call succeeds, every layer ends at or under the budget, rows intact.
TEST(PoolPipelineTest, EveryPolicyRunsThePipelineEndToEnd) {
  ModelLayout layout = testing_util::MakeLayout(3, 2, 8, DType::kFloat16, 4);
  layout.num_q_heads = 4;
  std::mt19937 rng(11);
  auto queries = [&](int32_t w) { return RandomQueries(layout, w, rng); };
  for (const std::string& name : KnownPolicyNames()) {
    PolicyConfig config;
    config.name = name;
    if (!ResolvePolicyConfig(config).ok()) continue;  // not in this build
    if (name == kPolicyOmniKv) continue;              // never evicts: tests/cache/omnikv_test.cc
    SCOPED_TRACE(name);
    TestPool pool;
    const std::string session = pool.Attach(layout, 256);
    const std::string seq = pool.Create(session, config, Budget(12));
    for (int32_t chunk : {10, 14}) {
      auto reservation = pool.pool.Reserve(session, seq, chunk, {}, {});
      ASSERT_TRUE(reservation.ok()) << reservation.status();
      const auto payload =
          BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, HashValue);
      ASSERT_TRUE(
          pool.pool.WriteReserved(session, seq, reservation->reservation_id, 0, payload).ok());
      const AttentionInput attention = queries(chunk);
      auto commit = pool.pool.Commit(session, seq, reservation->reservation_id, true, &attention);
      ASSERT_TRUE(commit.ok()) << commit.status();
    }
    const auto prompt = pool.pool.GetLayout(session, seq, {}, false);
    ASSERT_TRUE(prompt.ok()) << prompt.status();
    for (const LayerLayoutView& layer : prompt->layers) EXPECT_LE(layer.count, 24);
    for (int32_t step = 0; step < 5; ++step) {
      DecodeItem item = InlineItem(layout, session, seq, 24 + step);
      item.attention = queries(1);
      auto results = pool.pool.DecodeStep({item});
      ASSERT_TRUE(results.ok()) << results.status();
      for (int32_t count : (*results)[0].counts) EXPECT_LE(count, 12 + 4) << "step " << step;
    }
    ScoreParams score;
    score.budget_tokens = 6;
    score.attention = queries(1);
    auto scores = pool.pool.Score(session, seq, score);
    ASSERT_TRUE(scores.ok()) << scores.status();
    // D2O merges evicted rows into kept ones: its rows legitimately differ from the payload.
    if (name != kPolicyD2o) {
      EXPECT_TRUE(testing_util::ContentsMatch(pool.pool, session, seq, layout, HashValue));
    }
  }
}

// DecodeStep runs the sequences of a batch side by side: every policy must give, on any number of
// threads, exactly what one thread gives (results, slots, positions and bytes), with several
// sequences of one session allocating and freeing blocks at once.
TEST(PoolPipelineTest, DecodeStepOnManyThreadsEqualsOneThread) {
  ModelLayout layout = testing_util::MakeLayout(3, 2, 8, DType::kFloat16, 4);
  layout.num_q_heads = 4;
  constexpr int kSequences = 6;
  for (const std::string& name : KnownPolicyNames()) {
    PolicyConfig config;
    config.name = name;
    if (!ResolvePolicyConfig(config).ok()) continue;  // not in this build
    if (name == kPolicyOmniKv) continue;              // never evicts: tests/cache/omnikv_test.cc
    SCOPED_TRACE(name);
    struct Run {
      std::vector<std::vector<DecodeResult>> steps;
      std::vector<SequenceLayout> layouts;
      std::vector<std::vector<uint8_t>> exports;
    };
    auto run = [&](int32_t threads) {
      Run out;
      PoolOptions options = TestPool::DefaultOptions();
      options.decode_threads = threads;
      TestPool pool(options);
      std::mt19937 rng(17);
      auto queries = [&](int32_t w) { return RandomQueries(layout, w, rng); };
      const std::string session = pool.Attach(layout, 512);
      std::vector<std::string> ids;
      for (int b = 0; b < kSequences; ++b) {
        ids.push_back(pool.Create(session, config, Budget(10 + b)));
        auto reservation = pool.pool.Reserve(session, ids[b], 20 + b, {}, {});
        EXPECT_TRUE(reservation.ok()) << reservation.status();
        if (!reservation.ok()) return out;
        // Each sequence its own values, so that their choices differ.
        auto values = [b](int layer, int kv, int head, int32_t position, int d) {
          return HashValue(layer, kv, head, position + 37 * b, d);
        };
        const auto payload =
            BuildPayload(layout, ReservedLayers(*reservation), reservation->positions, values);
        EXPECT_TRUE(
            pool.pool.WriteReserved(session, ids[b], reservation->reservation_id, 0, payload).ok());
        const AttentionInput attention = queries(20 + b);
        auto commit =
            pool.pool.Commit(session, ids[b], reservation->reservation_id, true, &attention);
        EXPECT_TRUE(commit.ok()) << commit.status();
      }
      for (int32_t step = 0; step < 4; ++step) {
        std::vector<DecodeItem> items;
        for (int b = 0; b < kSequences; ++b) {
          DecodeItem item = InlineItem(layout, session, ids[b], 20 + b + step);
          item.attention = queries(1);
          items.push_back(std::move(item));
        }
        auto results = pool.pool.DecodeStep(items);
        EXPECT_TRUE(results.ok()) << results.status();
        if (!results.ok()) return out;
        out.steps.push_back(*std::move(results));
      }
      for (int b = 0; b < kSequences; ++b) {
        auto view = pool.pool.GetLayout(session, ids[b], {}, true);
        EXPECT_TRUE(view.ok()) << view.status();
        if (!view.ok()) return out;
        uint64_t total = 0;
        for (const LayerLayoutView& l : view->layers) {
          total += 2ull * layout.num_kv_heads * l.count * layout.row_bytes();
        }
        std::vector<uint8_t> bytes(total);
        EXPECT_TRUE(
            pool.pool.ReadExport(session, ids[b], {}, view->version, 0, absl::MakeSpan(bytes))
                .ok());
        for (LayerLayoutView& l : view->layers) l.block_table.clear();  // ids depend on timing
        out.layouts.push_back(*std::move(view));
        out.exports.push_back(std::move(bytes));
      }
      return out;
    };
    const Run one = run(1);
    const Run many = run(4);
    ASSERT_EQ(one.steps.size(), 4u);
    ASSERT_EQ(many.steps.size(), one.steps.size());
    for (size_t step = 0; step < one.steps.size(); ++step) {
      for (int b = 0; b < kSequences; ++b) {
        const DecodeResult& a = one.steps[step][b];
        const DecodeResult& c = many.steps[step][b];
        EXPECT_EQ(a.counts, c.counts) << "step " << step << " item " << b;
        EXPECT_EQ(a.evicted_positions, c.evicted_positions) << "step " << step << " item " << b;
        EXPECT_EQ(a.position, c.position) << "step " << step << " item " << b;
        EXPECT_EQ(a.merged, c.merged) << "step " << step << " item " << b;
      }
    }
    ASSERT_EQ(many.layouts.size(), one.layouts.size());
    for (int b = 0; b < kSequences; ++b) {
      ASSERT_EQ(one.layouts[b].layers.size(), many.layouts[b].layers.size());
      for (size_t l = 0; l < one.layouts[b].layers.size(); ++l) {
        EXPECT_EQ(one.layouts[b].layers[l].count, many.layouts[b].layers[l].count);
        EXPECT_EQ(one.layouts[b].layers[l].positions, many.layouts[b].layers[l].positions)
            << "sequence " << b << " layer " << l;
      }
      EXPECT_TRUE(one.exports[b] == many.exports[b]) << "sequence " << b << " bytes differ";
    }
  }
}

}  // namespace
}  // namespace kvs
