// The policy factory and the shared selector (scores + protected positions -> Backend::TopK).
#include "cache/policy/policy.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "cache/policy/streaming_llm.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PolicyFactoryTest, UnknownNameListsKnownOnes) {
  PolicyConfig config;
  config.name = "lru";
  auto policy = MakePolicy(config);
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(policy.status().message(), HasSubstr("policy.name \"lru\""));
  EXPECT_THAT(policy.status().message(),
              HasSubstr("streaming_llm, keydiff, h2o, tova, snapkv, cake, d2o, caote, omnikv"));
  config.name = "";
  EXPECT_EQ(MakePolicy(config).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PolicyFactoryTest, EveryPolicyOfThePapersIsBuilt) {
  for (const char* name :
       {"streaming_llm", "keydiff", "h2o", "tova", "snapkv", "cake", "d2o", "caote"}) {
    PolicyConfig config;
    config.name = name;
    auto policy = MakePolicy(config);
    ASSERT_TRUE(policy.ok()) << name << ": " << policy.status();
    EXPECT_EQ((*policy)->config().name, name);
  }
}

TEST(PolicyFactoryTest, OmniKvResolvesItsDefaults) {
  PolicyConfig config;
  config.name = "omnikv";
  config.omnikv.selected_fraction = 0.0f;
  config.omnikv.wait_layers = 0;
  auto policy = MakePolicy(config);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ((*policy)->config().omnikv.wait_layers, 1);
  EXPECT_FLOAT_EQ((*policy)->config().omnikv.selected_fraction, 0.067f);
  EXPECT_FALSE((*policy)->attention(Phase::kDecode).needed);
  config.omnikv.window = -1;
  EXPECT_THAT(std::string(ResolvePolicyConfig(config).status().message()),
              HasSubstr("policy.omnikv.window"));
}

TEST(PolicyFactoryTest, AllocatorConfigIsValidatedForEveryPolicy) {
  PolicyConfig config;
  config.name = "h2o";
  config.allocator.min_layer_tokens = -1;
  EXPECT_THAT(ResolvePolicyConfig(config).status().message(),
              HasSubstr("policy.allocator.min_layer_tokens"));
  config.allocator.min_layer_tokens = 0;
  config.allocator.pyramid_beta = 0.5f;
  EXPECT_THAT(ResolvePolicyConfig(config).status().message(),
              HasSubstr("policy.allocator.pyramid_beta"));
  config.allocator.pyramid_beta = 0.0f;
  auto resolved = ResolvePolicyConfig(config);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->allocator.pyramid_beta, 20.0f);
}

TEST(PolicyFactoryTest, MakesBothPoliciesWithResolvedConfigs) {
  auto keydiff = MakePolicy(testing_util::KeyDiff(KeyDiffAnchor::kMeanRaw));
  ASSERT_TRUE(keydiff.ok());
  EXPECT_EQ((*keydiff)->config().name, kPolicyKeyDiff);
  EXPECT_EQ((*keydiff)->config().keydiff.anchor, KeyDiffAnchor::kMeanRaw);
  auto sink = MakePolicy(testing_util::StreamingLlm(0));
  ASSERT_TRUE(sink.ok());
  EXPECT_EQ((*sink)->config().streaming_llm.n_sink, 0);  // no sinks: a pure sliding window
  EXPECT_EQ(KnownPolicyNames().size(), 10u);
}

TEST(PolicyTest, UniformLayerAllocationNeverExceedsCounts) {
  auto policy = MakePolicy(testing_util::KeyDiff());
  ASSERT_TRUE(policy.ok());
  const std::vector<int32_t> counts = {10, 3, 5};
  std::vector<LayerPolicyState> states(3);
  AllocationRequest request;
  request.budget = 5;
  request.counts = counts;
  request.states = absl::MakeSpan(states);
  auto allocation = (*policy)->AllocateLayers(request);
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(5, 3, 5));
}

// The selector on a position table alone (StreamingLLM needs no keys): scrambled positions, two
// heads, a keep of all and a keep of none in the same batch.
TEST(ScoredPolicyTest, SelectsByPositionPerHead) {
  auto policy = MakePolicy(testing_util::StreamingLlm(2));
  ASSERT_TRUE(policy.ok());
  auto backend = MakeCpuBackend(1);
  const std::vector<int32_t> positions = {9, 3, 50, 7,  1,  20,   // head 0
                                          4, 8, 15, 16, 23, 42};  // head 1
  std::vector<int32_t> kept(2 * 4), all(2 * 6), none;
  std::vector<LayerSelection> layers(3);
  for (LayerSelection& layer : layers) {
    layer.keys.count = 6;
    layer.keys.num_kv_heads = 2;
    layer.positions = positions;
  }
  layers[0].keep = 4;
  layers[0].kept = absl::MakeSpan(kept);
  layers[1].keep = 6;
  layers[1].kept = absl::MakeSpan(all);
  layers[2].keep = 0;
  layers[2].kept = absl::MakeSpan(none);
  ASSERT_TRUE((*policy)->Select(*backend, Phase::kPrefill, layers).ok());
  // Head 0: sinks 1 (slot 4), 3 (slot 1); newest 50 (slot 2), 20 (slot 5).
  // Head 1: sinks 4, 8 (slots 0, 1); newest 42, 23 (slots 5, 4).
  EXPECT_THAT(kept, ElementsAre(1, 2, 4, 5, 0, 1, 4, 5));
  EXPECT_THAT(all, ElementsAre(0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5));
}

TEST(ScoredPolicyTest, MalformedSelectionIsInternal) {
  auto policy = MakePolicy(testing_util::StreamingLlm(2));
  auto backend = MakeCpuBackend(1);
  const std::vector<int32_t> positions = {0, 1, 2};
  std::vector<int32_t> kept(2);
  LayerSelection layer;
  layer.keys.count = 3;
  layer.keys.num_kv_heads = 1;
  layer.positions = positions;
  layer.keep = 4;  // more than count
  layer.kept = absl::MakeSpan(kept);
  EXPECT_EQ((*policy)->Select(*backend, Phase::kPrefill, {&layer, 1}).code(),
            absl::StatusCode::kInternal);
  layer.keep = 1;  // kept has room for 2
  EXPECT_EQ((*policy)->Select(*backend, Phase::kPrefill, {&layer, 1}).code(),
            absl::StatusCode::kInternal);
}

// LayerPolicyState keeps its slot-aligned arrays ([rows][count], rows a multiple of the kv
// heads) aligned with the rows the sequence moves: checked against a plain gather for
// hole-filling plans (the in-place path) and for arbitrary ones (the copying path).
TEST(LayerPolicyStateTest, CompactGathersEveryArrayLikeTheSequenceMovesRows) {
  std::mt19937 rng(21);
  const int32_t heads = 2;
  for (const int32_t rows_per_head : {1, 4}) {
    for (const int32_t count : {1, 5, 64}) {
      for (int32_t keep = 0; keep <= count; keep += std::max(1, count / 4)) {
        for (const bool hole_filling : {true, false}) {
          std::vector<std::vector<int32_t>> sources(heads);
          for (std::vector<int32_t>& source : sources) {
            std::vector<int32_t> slots(count);
            std::iota(slots.begin(), slots.end(), 0);
            std::shuffle(slots.begin(), slots.end(), rng);
            slots.resize(keep);
            if (hole_filling) {
              // Kept slots below keep stay; the others fill the holes in order.
              std::sort(slots.begin(), slots.end());
              source.assign(keep, -1);
              std::vector<int32_t> movers;
              for (int32_t slot : slots) {
                if (slot < keep) {
                  source[slot] = slot;
                } else {
                  movers.push_back(slot);
                }
              }
              size_t next = 0;
              for (int32_t& entry : source) {
                if (entry < 0) entry = movers[next++];
              }
            } else {
              source = slots;  // any order, sources below keep included
            }
          }
          const int32_t rows = heads * rows_per_head;
          LayerPolicyState state;
          state.accumulated.resize(rows * count);
          for (float& v : state.accumulated) v = static_cast<float>(rng() % 1000);
          state.indicator.resize(heads * count);
          for (float& v : state.indicator) v = static_cast<float>(rng() % 1000);
          state.step_scores.assign(static_cast<size_t>(rows) * count, 1.0f);
          state.step_protected_recent = 2;
          const LayerPolicyState before = state;
          state.Compact(heads, count, sources);
          for (const auto& [array, original, array_rows] :
               {std::make_tuple(&state.accumulated, &before.accumulated, rows),
                std::make_tuple(&state.indicator, &before.indicator, heads)}) {
            ASSERT_EQ(array->size(), static_cast<size_t>(array_rows * keep));
            const int32_t per_head = array_rows / heads;
            for (int32_t r = 0; r < array_rows; ++r) {
              for (int32_t t = 0; t < keep; ++t) {
                ASSERT_EQ((*array)[r * keep + t], (*original)[r * count + sources[r / per_head][t]])
                    << "row " << r << " slot " << t << " count " << count << " keep " << keep
                    << " hole filling " << hole_filling;
              }
            }
          }
          // The step's scores are consumed by the selection that compacts: dropped.
          EXPECT_TRUE(state.step_scores.empty());
          EXPECT_EQ(state.step_protected_recent, 0);
        }
      }
    }
  }
}

TEST(LayerPolicyStateTest, ExtendAppendsZeroedSlotsToEveryRow) {
  LayerPolicyState state;
  state.accumulated = {1, 2, 3, 4, 5, 6};  // 3 rows x 2 slots
  state.step_scores = {7, 8};              // 1 row x 2 slots
  state.Extend(1, 2, 2);
  EXPECT_THAT(state.accumulated, ElementsAre(1, 2, 0, 0, 3, 4, 0, 0, 5, 6, 0, 0));
  EXPECT_THAT(state.step_scores, ElementsAre(7, 8, 0, 0));
  EXPECT_TRUE(state.indicator.empty());  // empty arrays stay empty
}

}  // namespace
}  // namespace kvs
