// Properties of every policy x every layer allocator over random inputs, through KvPool on the CPU
// backend with the sidecar computing attention from random queries (issue 3):
//   - every layer respects its budget after the prefill compression (uniform: min(budget, P);
//     PyramidKV: its per-layer budget; CAKE: the non-window total) and a decode step returns every
//     layer to the count it had before the step;
//   - every kv head of a layer holds the same count of distinct positions, all of them appended;
//   - determinism: two sequences fed the same inputs hold the same positions in the same slots and
//     the same bytes;
//   - kept K/V rows are exactly what was written (policies that do not merge); D2O's merge of
//     constant values leaves them unchanged (its weights sum to 1);
//   - the tie rule: with equal attention everywhere and constant values, every attention policy
//     keeps its protected tokens plus the LOWEST other positions.
#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/pool.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using testing_util::BuildPayload;
using testing_util::ContentsMatch;
using testing_util::HashValue;
using testing_util::TestPool;

constexpr int32_t kWindow = 4;

struct Case {
  std::string label;
  PolicyConfig policy;
  bool merges = false;
};

std::vector<Case> PolicyCases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& label, const char* name) -> PolicyConfig& {
    Case c;
    c.label = label;
    c.policy.name = name;
    c.policy.snapkv = {kWindow, 3, Pooling::kAvg};
    c.policy.cake.window = kWindow;
    c.policy.cake.kernel_size = 3;
    c.policy.caote.snapkv = {kWindow, 3, Pooling::kAvg};
    c.policy.caote.cake.window = kWindow;
    c.policy.allocator.min_layer_tokens = 1;
    cases.push_back(c);
    return cases.back().policy;
  };
  add("streaming_llm", kPolicyStreamingLlm);
  add("keydiff", kPolicyKeyDiff).keydiff.recent_fraction = 0.25f;
  add("h2o", kPolicyH2o);
  PolicyConfig& h2o_protected = add("h2o_sink_recent", kPolicyH2o);
  h2o_protected.h2o.n_sink = 1;
  h2o_protected.h2o.n_recent = 2;
  add("tova", kPolicyTova);
  add("tova_all_heads", kPolicyTova).tova.all_heads = true;
  add("snapkv", kPolicySnapKv);
  add("snapkv_max", kPolicySnapKv).snapkv.pooling = Pooling::kMax;
  add("cake", kPolicyCake);
  add("d2o", kPolicyD2o);
  cases.back().merges = true;
  PolicyConfig& d2o_code = add("d2o_code_layer", kPolicyD2o);
  d2o_code.d2o.merge_weighting = D2oMergeWeighting::kCode;
  d2o_code.d2o.threshold_scope = D2oThresholdScope::kLayer;
  cases.back().merges = true;
  add("caote_h2o_exact", kPolicyCaote);
  PolicyConfig& tova_fast = add("caote_tova_fast_rss", kPolicyCaote);
  tova_fast.caote.base = CaoteBase::kTova;
  tova_fast.caote.variant = CaoteVariant::kFast;
  tova_fast.caote.gqa_reduce = GqaReduce::kRss;
  add("caote_snapkv_exact", kPolicyCaote).caote.base = CaoteBase::kSnapKv;
  PolicyConfig& cake_fast = add("caote_cake_fast", kPolicyCaote);
  cake_fast.caote.base = CaoteBase::kCake;
  cake_fast.caote.variant = CaoteVariant::kFast;
  return cases;
}

const LayerAllocatorKind kAllocators[] = {
    LayerAllocatorKind::kDefault, LayerAllocatorKind::kUniform, LayerAllocatorKind::kPyramidKv,
    LayerAllocatorKind::kD2o, LayerAllocatorKind::kCake};

LayerAllocatorKind Effective(const PolicyConfig& policy) {
  if (policy.allocator.kind != LayerAllocatorKind::kDefault) return policy.allocator.kind;
  if (policy.name == kPolicyD2o) return LayerAllocatorKind::kD2o;
  if (policy.name == kPolicyCake ||
      (policy.name == kPolicyCaote && policy.caote.base == CaoteBase::kCake)) {
    return LayerAllocatorKind::kCake;
  }
  return LayerAllocatorKind::kUniform;
}

class PolicyPropertyTest : public ::testing::TestWithParam<uint32_t> {
 protected:
  std::mt19937 rng_{GetParam()};
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  AttentionInput Queries(const ModelLayout& layout, int32_t w) {
    AttentionInput attention;
    attention.num_queries = w;
    attention.softmax_scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
    attention.queries.resize(static_cast<size_t>(layout.num_layers) * layout.num_q_heads * w *
                             layout.head_dim);
    std::normal_distribution<float> normal(0.0f, 1.5f);
    for (float& q : attention.queries) q = normal(rng_);
    return attention;
  }
};

// Positions per (layer, head) in slot order.
std::vector<std::vector<std::vector<int32_t>>> Slots(const SequenceLayout& view, int heads) {
  std::vector<std::vector<std::vector<int32_t>>> out;
  for (const LayerLayoutView& l : view.layers) {
    out.emplace_back();
    for (int h = 0; h < heads; ++h) {
      out.back().emplace_back(l.positions.begin() + h * l.count,
                              l.positions.begin() + (h + 1) * l.count);
    }
  }
  return out;
}

TEST_P(PolicyPropertyTest, EveryPolicyTimesEveryAllocator) {
  int64_t checked = 0;
  for (const Case& base_case : PolicyCases()) {
    for (LayerAllocatorKind allocator : kAllocators) {
      SCOPED_TRACE(absl::StrCat(base_case.label, " allocator ", static_cast<int>(allocator),
                                " seed ", GetParam()));
      PolicyConfig policy = base_case.policy;
      policy.allocator.kind = allocator;
      const int32_t group = Uniform(1, 2);
      ModelLayout layout = testing_util::MakeLayout(
          Uniform(2, 3), Uniform(1, 2), 4 * Uniform(1, 2),
          Uniform(0, 1) ? DType::kFloat32 : DType::kFloat16, 4 * Uniform(1, 2));
      layout.num_q_heads = layout.num_kv_heads * group;
      const int32_t budget = Uniform(kWindow + 3, 12);
      const int32_t prompt = Uniform(20, 36);
      TestPool pool;
      const std::string session = pool.Attach(layout, 2 * layout.num_layers * (prompt + 16));
      ASSERT_FALSE(session.empty());
      const BudgetConfig budget_config = testing_util::Budget(budget);
      const std::string a = pool.Create(session, policy, budget_config, "a");
      const std::string b = pool.Create(session, policy, budget_config, "b");
      ASSERT_FALSE(a.empty());

      // Prefill: the whole prompt in one commit with every prompt query, then compress.
      const AttentionInput prompt_queries = Queries(layout, prompt);
      std::vector<int32_t> all_layers(layout.num_layers);
      for (int32_t l = 0; l < layout.num_layers; ++l) all_layers[l] = l;
      std::vector<int32_t> positions(prompt);
      for (int32_t p = 0; p < prompt; ++p) positions[p] = p;
      for (const std::string& id : {a, b}) {
        auto reservation = pool.pool.Reserve(session, id, prompt, {}, {});
        ASSERT_TRUE(reservation.ok()) << reservation.status();
        const std::vector<uint8_t> payload = BuildPayload(layout, all_layers, positions, HashValue);
        ASSERT_TRUE(
            pool.pool.WriteReserved(session, id, reservation->reservation_id, 0, payload).ok());
        auto commit =
            pool.pool.Commit(session, id, reservation->reservation_id, true, &prompt_queries);
        ASSERT_TRUE(commit.ok()) << commit.status();
      }
      auto view = pool.pool.GetLayout(session, a, {}, true);
      ASSERT_TRUE(view.ok());
      std::vector<int32_t> counts;
      for (const LayerLayoutView& l : view->layers) counts.push_back(l.count);
      const LayerAllocatorKind kind = Effective(policy);
      // What each layer may grow back to in decode: the uniform budget, its PyramidKV budget, or
      // the budget D2O / CAKE froze at prefill (what it holds now).
      std::vector<int32_t> caps = counts;
      if (kind == LayerAllocatorKind::kUniform) {
        for (int32_t c : counts) EXPECT_EQ(c, std::min(budget, prompt));
        caps.assign(counts.size(), budget);
      } else if (kind == LayerAllocatorKind::kPyramidKv) {
        const std::vector<int32_t> pyramid =
            PyramidBudgets(budget, layout.num_layers, policy.allocator.pyramid_beta);
        for (int32_t l = 0; l < layout.num_layers; ++l) {
          EXPECT_EQ(counts[l], std::clamp(pyramid[l], 1, prompt)) << "layer " << l;
          caps[l] = std::max(pyramid[l], 1);
        }
      } else if (kind == LayerAllocatorKind::kCake) {
        const int32_t window = CakeWindowFor(policy);
        int64_t shares = 0;
        for (int32_t c : counts) {
          EXPECT_GE(c, std::min(window, prompt));
          shares += c - window;
        }
        EXPECT_EQ(shares, std::min<int64_t>(int64_t{budget - window} * layout.num_layers,
                                            int64_t{prompt - window} * layout.num_layers));
      } else {  // D2O: each layer a share of the prompt, at least the floor
        for (int32_t c : counts) {
          EXPECT_GE(c, 1);
          EXPECT_LE(c, prompt);
        }
      }

      // Decode: every step brings a token and its query; every layer grows back to its cap at
      // most, and never past it.
      std::set<int32_t> appended(positions.begin(), positions.end());
      for (int step = 0; step < 4; ++step) {
        const int32_t position = prompt + step;
        const AttentionInput query = Queries(layout, 1);
        std::vector<DecodeItem> items(2);
        for (int i = 0; i < 2; ++i) {
          items[i].session_id = session;
          items[i].sequence_id = i == 0 ? a : b;
          items[i].attention = query;
          items[i].inline_kv = BuildPayload(layout, all_layers, {&position, 1}, HashValue);
        }
        auto results = pool.pool.DecodeStep(items);
        ASSERT_TRUE(results.ok()) << results.status();
        appended.insert(position);
        for (const DecodeResult& result : *results) {
          EXPECT_EQ(result.position, position);
          for (int32_t l = 0; l < layout.num_layers; ++l) {
            EXPECT_EQ(result.counts[l], std::min(caps[l], counts[l] + 1))
                << "layer " << l << " step " << step;
          }
        }
        for (int32_t l = 0; l < layout.num_layers; ++l) {
          counts[l] = std::min(caps[l], counts[l] + 1);
        }
      }

      // Structure, determinism and contents.
      auto view_a = pool.pool.GetLayout(session, a, {}, true);
      auto view_b = pool.pool.GetLayout(session, b, {}, true);
      ASSERT_TRUE(view_a.ok() && view_b.ok());
      const auto slots_a = Slots(*view_a, layout.num_kv_heads);
      EXPECT_EQ(slots_a, Slots(*view_b, layout.num_kv_heads));
      for (const auto& layer : slots_a) {
        for (const auto& head : layer) {
          std::set<int32_t> distinct(head.begin(), head.end());
          EXPECT_EQ(distinct.size(), head.size());
          for (int32_t p : head) EXPECT_TRUE(appended.count(p)) << p;
          ++checked;
        }
      }
      if (!base_case.merges) {
        EXPECT_TRUE(ContentsMatch(pool.pool, session, a, layout, HashValue));
        EXPECT_TRUE(ContentsMatch(pool.pool, session, b, layout, HashValue));
      } else {
        // Same bytes in both sequences even after merges.
        std::vector<uint8_t> bytes_a(1 << 20), bytes_b(1 << 20);
        uint64_t total = 0;
        for (const LayerLayoutView& l : view_a->layers) {
          total += 2ull * layout.num_kv_heads * l.count * layout.row_bytes();
        }
        bytes_a.resize(total);
        bytes_b.resize(total);
        ASSERT_TRUE(
            pool.pool.ReadExport(session, a, {}, view_a->version, 0, absl::MakeSpan(bytes_a)).ok());
        ASSERT_TRUE(
            pool.pool.ReadExport(session, b, {}, view_b->version, 0, absl::MakeSpan(bytes_b)).ok());
        EXPECT_EQ(bytes_a, bytes_b);
      }
    }
  }
  EXPECT_GT(checked, 0);
}

// D2O merges with values that do not depend on the position: a weighted mean whose weights sum to
// 1 leaves every V row as it was (d2o.md TV8), while keys (which differ) do get merged.
TEST_P(PolicyPropertyTest, D2oMergeConservesWeights) {
  const ModelLayout layout = [] {
    ModelLayout l = testing_util::MakeLayout(2, 2, 8, DType::kFloat32, 4);
    l.num_q_heads = 4;
    return l;
  }();
  auto constant_values = [](int layer, int kv, int head, int32_t position, int d) {
    return kv == 1 ? 0.25f * (d + 1) + layer - head : HashValue(layer, kv, head, position, d);
  };
  PolicyConfig policy;
  policy.name = kPolicyD2o;
  policy.allocator.min_layer_tokens = 1;
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string seq = pool.Create(session, policy, testing_util::Budget(8), "m");
  const int32_t prompt = 30;
  std::vector<int32_t> all_layers = {0, 1};
  std::vector<int32_t> positions(prompt);
  for (int32_t p = 0; p < prompt; ++p) positions[p] = p;
  auto reservation = pool.pool.Reserve(session, seq, prompt, {}, {});
  ASSERT_TRUE(reservation.ok());
  ASSERT_TRUE(pool.pool
                  .WriteReserved(session, seq, reservation->reservation_id, 0,
                                 BuildPayload(layout, all_layers, positions, constant_values))
                  .ok());
  const AttentionInput queries = Queries(layout, prompt);
  ASSERT_TRUE(pool.pool.Commit(session, seq, reservation->reservation_id, false, &queries).ok());
  CompressParams compress;
  compress.attention = queries;
  auto result = pool.pool.Compress(session, seq, compress);
  ASSERT_TRUE(result.ok()) << result.status();
  int32_t merged = 0;
  for (const LayerCompressResult& l : result->layers) merged += l.merged;
  EXPECT_GT(merged, 0) << "the test needs at least one merge to mean anything";
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  ASSERT_TRUE(view.ok());
  for (const LayerLayoutView& l : view->layers) {
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      for (int32_t s = 0; s < l.count; ++s) {
        std::vector<uint8_t> row(layout.row_bytes());
        // The V row of (layer, head, slot) through the export payload offset.
        uint64_t offset = 0;
        for (const LayerLayoutView& before : view->layers) {
          if (before.layer == l.layer) break;
          offset += 2ull * layout.num_kv_heads * before.count * layout.row_bytes();
        }
        offset += ((1ull * layout.num_kv_heads + h) * l.count + s) * layout.row_bytes();
        ASSERT_TRUE(
            pool.pool.ReadExport(session, seq, {}, view->version, offset, absl::MakeSpan(row))
                .ok());
        const float* values = reinterpret_cast<const float*>(row.data());
        for (int d = 0; d < layout.head_dim; ++d) {
          EXPECT_NEAR(values[d], constant_values(l.layer, 1, h, 0, d), 1e-5)
              << "layer " << l.layer << " head " << h << " slot " << s;
        }
      }
    }
  }
}

// Equal attention everywhere (the worker's own scores) and constant values: every score ties, so
// each policy keeps what it protects plus the lowest other positions.
TEST_P(PolicyPropertyTest, TiesKeepTheLowerPositions) {
  ModelLayout layout = testing_util::MakeLayout(1, 2, 4, DType::kFloat32, 4);
  layout.num_q_heads = 2;
  auto constant = [](int, int kv, int, int32_t, int d) { return kv == 1 ? 1.0f : 0.5f * d; };
  struct Expect {
    const char* name;
    int32_t sinks, recent;
  };
  const int32_t budget = 6, prompt = 16;
  for (const Expect& e : {Expect{kPolicyH2o, 0, 0}, Expect{kPolicyTova, 0, 0},
                          Expect{kPolicyD2o, 4, 0}, Expect{kPolicyCaote, 0, 0}}) {
    SCOPED_TRACE(e.name);
    PolicyConfig policy;
    policy.name = e.name;
    policy.allocator.kind = LayerAllocatorKind::kUniform;
    policy.allocator.min_layer_tokens = 1;
    TestPool pool;
    const std::string session = pool.Attach(layout, 32);
    const std::string seq = pool.Create(session, policy, testing_util::Budget(budget), "t");
    std::vector<int32_t> positions(prompt);
    for (int32_t p = 0; p < prompt; ++p) positions[p] = p;
    auto reservation = pool.pool.Reserve(session, seq, prompt, {}, {});
    ASSERT_TRUE(reservation.ok());
    ASSERT_TRUE(pool.pool
                    .WriteReserved(session, seq, reservation->reservation_id, 0,
                                   BuildPayload(layout, {0}, positions, constant))
                    .ok());
    ASSERT_TRUE(pool.pool.Commit(session, seq, reservation->reservation_id, false).ok());
    CompressParams compress;
    AttentionInput scores;
    scores.num_queries = 1;
    scores.softmax_scale = 1.0f;
    scores.scores.assign(static_cast<size_t>(layout.num_q_heads) * prompt, 1.0f / prompt);
    compress.attention = scores;
    auto result = pool.pool.Compress(session, seq, compress);
    ASSERT_TRUE(result.ok()) << result.status();
    auto view = pool.pool.GetLayout(session, seq, {}, true);
    ASSERT_TRUE(view.ok());
    // D2O protects sinks (4) and floor((budget - 4) * 0.25) = 0 recent tokens.
    std::vector<int32_t> expected;
    for (int32_t p = 0; p < budget - e.recent; ++p) expected.push_back(p);
    for (int32_t p = prompt - e.recent; p < prompt; ++p) expected.push_back(p);
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      EXPECT_EQ(testing_util::HeadPositions(view->layers[0], h), expected) << "head " << h;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, PolicyPropertyTest, ::testing::Values(1u, 2u, 3u));

}  // namespace
}  // namespace kvs
