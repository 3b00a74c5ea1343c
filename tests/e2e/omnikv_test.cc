// OmniKV Select end to end against the real server binary: per filter layer the top-k prompt
// tokens computed independently here (from the K rows the test wrote and the queries it sends,
// "last" selector, ties to the lower position) come back, and every staged row of every sparse
// layer, read in place from the mapped arena, is the row of the position it stands for — with and
// without offload to the host tier. Also: retries, the tail, bad input and Admin's view.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kLayers = 8, kKvHeads = 2, kQHeads = 4, kDim = 8, kTokens = 20, kPrompt = 16,
              kTopK = 5;
constexpr uint64_t kSeed = 77;
constexpr float kScale = 0.35355339f;  // 1 / sqrt(8)

float Fp16ToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 31, mantissa = h & 1023;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 1024), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

float QueryValue(int layer, int head, int i) {
  return static_cast<float>(((layer * 31 + head * 17 + i * 7) % 23) - 11) / 8.0f;
}

v1::AttentionInputs Queries(const std::vector<int>& layers, int salt = 0) {
  v1::AttentionInputs attention;
  attention.set_num_queries(1);
  attention.set_softmax_scale(kScale);
  attention.set_queries_dtype(v1::DTYPE_FLOAT32);
  std::string bytes;
  for (int layer : layers) {
    attention.add_layers(layer);
    for (int h = 0; h < kQHeads; ++h) {
      for (int i = 0; i < kDim; ++i) {
        const float q = QueryValue(layer + salt, h, i);
        bytes.append(reinterpret_cast<const char*>(&q), sizeof(q));
      }
    }
  }
  attention.set_inline_queries(bytes);
  return attention;
}

// The expected T_f: max over query heads of scale * <q, k> over the prompt, top k, ties to the
// lower position, ascending.
std::vector<int> ExpectedSelection(const v1::ModelLayout& layout, int layer, int salt = 0,
                                   uint64_t seed = kSeed) {
  std::vector<std::pair<float, int>> ranked;
  for (int t = 0; t < kPrompt; ++t) {
    float best = -INFINITY;
    for (int h = 0; h < kQHeads; ++h) {
      const std::vector<uint8_t> key = PatternRow(layout, seed, layer, 0, h / 2, t);
      float dot = 0;
      for (int i = 0; i < kDim; ++i)
        dot += QueryValue(layer + salt, h, i) * Fp16ToFloat(&key[2 * i]);
      best = std::max(best, kScale * dot);
    }
    ranked.emplace_back(-best, t);
  }
  std::sort(ranked.begin(), ranked.end());
  std::vector<int> selected;
  for (int i = 0; i < kTopK; ++i) selected.push_back(ranked[i].second);
  std::sort(selected.begin(), selected.end());
  return selected;
}

v1::PolicySpec OmniKvPolicy(bool offload) {
  v1::PolicySpec policy;
  policy.set_name("omnikv");
  v1::OmniKvParams* params = policy.mutable_omnikv();
  params->add_filter_layers(1);
  params->add_filter_layers(4);
  params->set_selected_tokens(kTopK);
  params->set_offload(offload);
  return policy;
}

class OmniKvE2eTest : public SharedServerTest<OmniKvE2eTest>,
                      public ::testing::WithParamInterface<bool> {};

TEST_P(OmniKvE2eTest, SelectStagesTheTopKOfEachFilterForItsSparseLayers) {
  const bool offload = GetParam();
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(kLayers, kKvHeads, kQHeads, kDim, v1::DTYPE_FLOAT16, 4);
  auto session = (*client)->Attach(layout, "e2e", 256, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  auto created = (*session)->CreateSequence(OmniKvPolicy(offload), std::nullopt, "omni");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().omnikv().wait_layers(), 1);
  ASSERT_TRUE(WriteTokens(**session, "omni", kTokens, kSeed).ok());

  v1::SelectRequest request;
  v1::SelectRequest::Item* item = request.add_items();
  item->set_sequence_id("omni");
  item->set_step_id(1);
  item->set_prompt_tokens(kPrompt);
  *item->mutable_attention() = Queries({1, 4});
  auto response = (*session)->Select(request);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->items_size(), 1);
  const v1::SelectResponse::Item& result = response->items(0);
  EXPECT_EQ(result.prompt_tokens(), kPrompt);
  EXPECT_EQ(result.budget_tokens(), kTopK);
  EXPECT_EQ(result.host_bytes() > 0, offload);
  ASSERT_EQ(result.filters_size(), 2);
  const std::vector<int> expected1 = ExpectedSelection(layout, 1);
  const std::vector<int> expected4 = ExpectedSelection(layout, 4);
  EXPECT_EQ(
      std::vector<int>(result.filters(0).positions().begin(), result.filters(0).positions().end()),
      expected1);
  EXPECT_EQ(
      std::vector<int>(result.filters(1).positions().begin(), result.filters(1).positions().end()),
      expected4);
  EXPECT_EQ(
      std::vector<int>(result.selected_positions().begin(), result.selected_positions().end()),
      expected1);
  EXPECT_THAT(result.filters(1).sparse_layers(), ElementsAre(6, 7));

  // Every staged row, read in place: T_f's tokens, then the generated ones (16..19).
  ASSERT_EQ(result.sparse_layers_size(), 3);
  int rows = 0;
  for (const v1::LayerLayout& staged : result.sparse_layers()) {
    std::vector<int> positions = staged.layer() == 3 ? expected1 : expected4;
    for (int t = kPrompt; t < kTokens; ++t) positions.push_back(t);
    ASSERT_EQ(staged.count(), static_cast<int>(positions.size()));
    for (int s = 0; s < staged.count(); ++s) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kKvHeads; ++h) {
          const std::vector<uint8_t> want =
              PatternRow(layout, kSeed, staged.layer(), kv, h, positions[s]);
          std::vector<uint8_t> row(want.size());
          const absl::Status read = (*session)->ReadRowInto(staged, kv, h, s, absl::MakeSpan(row));
          ASSERT_TRUE(read.ok()) << read;
          ASSERT_TRUE(row == want)
              << "layer " << staged.layer() << " slot " << s << " kv " << kv << " head " << h;
          ++rows;
        }
      }
    }
  }
  EXPECT_EQ(rows, 3 * 9 * 2 * kKvHeads);

  // Dense layers keep everything in place; offloaded sparse layers only their generated tokens.
  auto view = (*session)->GetLayout("omni");
  ASSERT_TRUE(view.ok());
  for (int l = 0; l < kLayers; ++l) {
    const bool sparse = l == 3 || l == 6 || l == 7;
    EXPECT_EQ(view->layers(l).count(), offload && sparse ? kTokens - kPrompt : kTokens) << l;
  }

  // A retry of the step (other queries) answers the same; the next step selects anew.
  *item->mutable_attention() = Queries({4}, /*salt=*/5);
  auto retry = (*session)->Select(request);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(std::vector<int>(retry->items(0).filters(0).positions().begin(),
                             retry->items(0).filters(0).positions().end()),
            expected4);
  item->set_step_id(2);
  auto next = (*session)->Select(request);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(std::vector<int>(next->items(0).filters(0).positions().begin(),
                             next->items(0).filters(0).positions().end()),
            ExpectedSelection(layout, 4, /*salt=*/5));
  ASSERT_TRUE((*session)->ReleaseSequence("omni").ok());
}

std::vector<int> Positions(const v1::SelectResponse::Item& item, int filter) {
  return std::vector<int>(item.filters(filter).positions().begin(),
                          item.filters(filter).positions().end());
}

// Every staged row of `item` (sequence written with `seed`), read in place: the row of the
// position each slot stands for.
void ExpectStagedRows(kvsidecar::Session& session, const v1::ModelLayout& layout,
                      const v1::SelectResponse::Item& item, uint64_t seed) {
  ASSERT_EQ(item.sparse_layers_size(), 3);
  for (const v1::LayerLayout& staged : item.sparse_layers()) {
    std::vector<int> positions = Positions(item, staged.layer() == 3 ? 0 : 1);
    for (int t = kPrompt; t < kTokens; ++t) positions.push_back(t);
    ASSERT_EQ(staged.count(), static_cast<int>(positions.size())) << staged.layer();
    for (int s = 0; s < staged.count(); ++s) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kKvHeads; ++h) {
          const std::vector<uint8_t> want =
              PatternRow(layout, seed, staged.layer(), kv, h, positions[s]);
          std::vector<uint8_t> row(want.size());
          const absl::Status read = session.ReadRowInto(staged, kv, h, s, absl::MakeSpan(row));
          ASSERT_TRUE(read.ok()) << read;
          ASSERT_TRUE(row == want) << "layer " << staged.layer() << " slot " << s;
        }
      }
    }
  }
}

// The sequences of one Select call run side by side; what each gets is what it gets from a call
// of its own: the same T_f per filter layer (each sequence has its own keys and queries, so a
// result handed to the wrong item shows), the same N, k and host bytes, and staged rows that
// hold the selected tokens — at the first Select (which offloads) and at a later step.
TEST_P(OmniKvE2eTest, OneCallOfManySequencesSelectsAsOneCallEach) {
  const bool offload = GetParam();
  constexpr int kSequences = 6;
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(kLayers, kKvHeads, kQHeads, kDim, v1::DTYPE_FLOAT16, 4);
  auto session = (*client)->Attach(layout, "e2e", 1024, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  for (int i = 0; i < kSequences; ++i) {
    for (const std::string prefix : {"batch", "alone"}) {
      const std::string id = prefix + std::to_string(i);
      ASSERT_TRUE((*session)->CreateSequence(OmniKvPolicy(offload), std::nullopt, id).ok());
      ASSERT_TRUE(WriteTokens(**session, id, kTokens, kSeed + i).ok());
    }
  }
  for (int step = 1; step <= 2; ++step) {
    auto item_of = [&](v1::SelectRequest& request, const std::string& id, int i) {
      v1::SelectRequest::Item* item = request.add_items();
      item->set_sequence_id(id);
      item->set_step_id(step);
      item->set_prompt_tokens(kPrompt);
      *item->mutable_attention() = Queries({1, 4}, /*salt=*/3 * i + step);
    };
    v1::SelectRequest batch;
    for (int i = 0; i < kSequences; ++i) item_of(batch, "batch" + std::to_string(i), i);
    auto together = (*session)->Select(batch);
    ASSERT_TRUE(together.ok()) << together.status();
    ASSERT_EQ(together->items_size(), kSequences);
    std::vector<std::vector<int>> firsts;
    for (int i = 0; i < kSequences; ++i) {
      SCOPED_TRACE(testing::Message() << "step " << step << " sequence " << i);
      v1::SelectRequest one;
      item_of(one, "alone" + std::to_string(i), i);
      auto alone = (*session)->Select(one);
      ASSERT_TRUE(alone.ok()) << alone.status();
      const v1::SelectResponse::Item& a = together->items(i);
      const v1::SelectResponse::Item& b = alone->items(0);
      ASSERT_EQ(a.filters_size(), 2);
      ASSERT_EQ(b.filters_size(), 2);
      for (int f = 0; f < 2; ++f) {
        EXPECT_EQ(Positions(a, f), Positions(b, f)) << "filter " << f;
        EXPECT_EQ(Positions(a, f), ExpectedSelection(layout, f == 0 ? 1 : 4, 3 * i + step,
                                                     kSeed + i))
            << "filter " << f;
      }
      EXPECT_EQ(a.prompt_tokens(), b.prompt_tokens());
      EXPECT_EQ(a.budget_tokens(), b.budget_tokens());
      EXPECT_EQ(a.host_bytes(), b.host_bytes());
      ASSERT_EQ(a.sparse_layers_size(), b.sparse_layers_size());
      for (int j = 0; j < a.sparse_layers_size(); ++j) {
        EXPECT_EQ(a.sparse_layers(j).layer(), b.sparse_layers(j).layer());
        EXPECT_EQ(a.sparse_layers(j).count(), b.sparse_layers(j).count());
      }
      ExpectStagedRows(**session, layout, a, kSeed + i);
      ExpectStagedRows(**session, layout, b, kSeed + i);
      firsts.push_back(Positions(a, 0));
    }
    // The sequences chose differently, so a mix-up between items could not go unseen.
    std::sort(firsts.begin(), firsts.end());
    EXPECT_GT(std::unique(firsts.begin(), firsts.end()) - firsts.begin(), 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, OmniKvE2eTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Offload" : "InArena"; });

class OmniKvE2eBadInputTest : public SharedServerTest<OmniKvE2eBadInputTest> {};

TEST_F(OmniKvE2eBadInputTest, BadInputNamesTheFieldAndChangesNothing) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(kLayers, kKvHeads, kQHeads, kDim, v1::DTYPE_FLOAT16, 4);
  auto session = (*client)->Attach(layout, "e2e", 256, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(OmniKvPolicy(true), std::nullopt, "omni").ok());
  ASSERT_TRUE(WriteTokens(**session, "omni", kTokens, kSeed).ok());
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "kd").ok());

  v1::SelectRequest request;
  v1::SelectRequest::Item* item = request.add_items();
  item->set_sequence_id("omni");
  *item->mutable_attention() = Queries({2});
  auto status = (*session)->Select(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(status),
              HasSubstr("items[0]: attention.layers[0] = 2 is not a filter layer"));
  item->clear_attention();
  status = (*session)->Select(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(status), HasSubstr("items[0].attention is required"));
  item->set_sequence_id("kd");
  *item->mutable_attention() = Queries({1});
  status = (*session)->Select(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(status), HasSubstr("Select needs a sequence created with policy omnikv"));
  // A budget is refused, Compress does not apply; nothing was offloaded by the failed calls.
  auto budgeted = (*session)->CreateSequence(OmniKvPolicy(false), MakeBudget(8), "b");
  EXPECT_EQ(budgeted.status().code(), absl::StatusCode::kInvalidArgument);
  auto compressed = (*session)->Compress("omni");
  EXPECT_EQ(compressed.status().code(), absl::StatusCode::kFailedPrecondition);
  auto view = (*session)->GetLayout("omni");
  ASSERT_TRUE(view.ok());
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(view->layers(l).count(), kTokens) << l;
}

// selected_fraction follows the one rounding rule of every fraction (floor of the product, with
// a float's representation error forgiven): 0.9 of a 10-token prompt selects 9, not 8.
TEST_F(OmniKvE2eBadInputTest, SelectedFractionRoundsAsEveryFraction) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(kLayers, kKvHeads, kQHeads, kDim, v1::DTYPE_FLOAT16, 4);
  auto session = (*client)->Attach(layout, "e2e", 256, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  v1::PolicySpec policy = OmniKvPolicy(false);
  policy.mutable_omnikv()->set_selected_tokens(0);
  policy.mutable_omnikv()->set_selected_fraction(0.9f);
  ASSERT_TRUE((*session)->CreateSequence(policy, std::nullopt, "fraction").ok());
  ASSERT_TRUE(WriteTokens(**session, "fraction", kTokens, kSeed).ok());
  v1::SelectRequest request;
  v1::SelectRequest::Item* item = request.add_items();
  item->set_sequence_id("fraction");
  item->set_step_id(1);
  item->set_prompt_tokens(10);
  *item->mutable_attention() = Queries({1, 4});
  auto response = (*session)->Select(request);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->items_size(), 1);
  EXPECT_EQ(response->items(0).budget_tokens(), 9);
}

}  // namespace
}  // namespace kvs_e2e
