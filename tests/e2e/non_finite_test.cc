// End to end, for every evicting policy: K/V, queries and attention scores must be finite. A NaN
// or inf anywhere a worker brings them (DecodeStep inline_kv, rows written into a reservation and
// handed over by DecodeStep or Commit, inline Append, queries and attention_scores of DecodeStep
// and Compress) is INVALID_ARGUMENT naming where it is, the sequence keeps its counts and next
// position, and later valid calls work on it with every kept row intact.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::Each;
using ::testing::HasSubstr;

constexpr uint64_t kSeed = 91;
constexpr int kBudget = 8;
constexpr uint16_t kHalfNan = 0x7e00;
constexpr uint16_t kHalfInf = 0x7c00;

void PutFloat(std::string& out, float value) {
  char bytes[sizeof(float)];
  std::memcpy(bytes, &value, sizeof(float));
  out.append(bytes, sizeof(float));
}

// Sets element `index` of an fp16 byte string.
void SetHalf(std::string& bytes, size_t index, uint16_t bits) {
  std::memcpy(bytes.data() + 2 * index, &bits, sizeof(bits));
}

v1::PolicySpec Policy(const std::string& name) {
  v1::PolicySpec policy;
  policy.set_name(name);
  if (name == "streaming_llm") policy.mutable_streaming_llm()->set_n_sink(2);
  if (name == "keydiff") policy.mutable_keydiff();
  if (name == "h2o") policy.mutable_h2o();
  if (name == "tova") policy.mutable_tova();
  if (name == "snapkv") {
    policy.mutable_snapkv()->set_window(2);
    policy.mutable_snapkv()->set_kernel_size(1);
  }
  if (name == "cake") {
    policy.mutable_cake()->set_window(2);
    policy.mutable_cake()->set_kernel_size(1);
  }
  if (name == "d2o") policy.mutable_d2o();
  if (name == "caote") policy.mutable_caote();
  return policy;
}

class NonFiniteTest : public SharedServerTest<NonFiniteTest>,
                      public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    // 2 layers, 2 kv heads, 4 q heads, head_dim 16, fp16, blocks of 4 tokens.
    layout_ = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
    auto session = client_->Attach(layout_);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
    v1::Budget budget = MakeBudget(kBudget);
    // D2O's allocator gives layers their own shares: explicit per-layer budgets keep every layer
    // at kBudget, as for the other policies.
    if (GetParam() == "d2o") {
      for (int l = 0; l < layout_.num_layers(); ++l) budget.add_per_layer_tokens(kBudget);
    }
    ASSERT_TRUE(session_->CreateSequence(Policy(GetParam()), budget, "seq").ok());
    ASSERT_TRUE(WriteTokens(*session_, "seq", kBudget, kSeed).ok());
  }

  // One decode-step query per layer ([L][Hq][1][D] fp32) for the token at the next position.
  v1::AttentionInputs Query() const {
    v1::AttentionInputs attention;
    attention.set_num_queries(1);
    attention.set_softmax_scale(0.25f);
    attention.set_queries_dtype(v1::DTYPE_FLOAT32);
    std::string bytes;
    for (int layer = 0; layer < layout_.num_layers(); ++layer) {
      for (int q = 0; q < layout_.num_q_heads(); ++q) {
        for (int c = 0; c < layout_.head_dim(); ++c) {
          PutFloat(bytes, 0.5f * std::sin(static_cast<float>(1 + layer * 31 + q * 7 + c)));
        }
      }
    }
    attention.set_inline_queries(bytes);
    return attention;
  }

  v1::DecodeStepRequest Decode(const std::string& inline_kv, uint64_t reservation_id = 0) const {
    v1::DecodeStepRequest request;
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_sequence_id("seq");
    if (!inline_kv.empty()) item->set_inline_kv(inline_kv);
    item->set_reservation_id(reservation_id);
    *item->mutable_attention() = Query();
    return request;
  }

  // The inline K/V of the token at `position` ([L][2][H][1][D] fp16 pattern values).
  std::string Kv(int position) const { return PatternPayload(layout_, kSeed, {}, {position}); }
  size_t KvIndex(int layer, int kv, int head, int dim) const {
    return ((static_cast<size_t>(layer) * 2 + kv) * layout_.num_kv_heads() + head) *
               layout_.head_dim() +
           dim;
  }

  // Counts per layer and the next position, which no failed call may change.
  std::pair<std::vector<int>, int> State() const {
    auto layout = session_->GetLayout("seq", {}, /*omit_positions=*/true);
    EXPECT_TRUE(layout.ok()) << layout.status();
    std::vector<int> counts;
    if (!layout.ok()) return {counts, -1};
    for (const v1::LayerLayout& layer : layout->layers()) counts.push_back(layer.count());
    return {counts, static_cast<int>(layout->next_position())};
  }

  void ExpectRefused(const absl::Status& status, const std::string& substring) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(MessageOf(status), HasSubstr(substring)) << status;
  }

  std::unique_ptr<kvsidecar::Client> client_;
  v1::ModelLayout layout_;
  std::unique_ptr<kvsidecar::Session> session_;
};

TEST_P(NonFiniteTest, NonFiniteInputIsRefusedAndChangesNothing) {
  const auto before = State();
  ASSERT_THAT(before.first, Each(kBudget));
  ASSERT_EQ(before.second, kBudget);

  // DecodeStep, inline K with a NaN: refused every time, the sequence stays at its budget.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::string kv = Kv(kBudget);
    SetHalf(kv, KvIndex(0, 0, 1, 5), kHalfNan);
    ExpectRefused(session_->DecodeStep(Decode(kv)).status(),
                  "items[0]: inline_kv: non-finite value (NaN or inf) in K at layer 0 head 1 dim 5");
    EXPECT_EQ(State(), before) << "attempt " << attempt;
  }
  // Inline V with an inf.
  {
    std::string kv = Kv(kBudget);
    SetHalf(kv, KvIndex(1, 1, 0, 2), kHalfInf);
    ExpectRefused(session_->DecodeStep(Decode(kv)).status(),
                  "items[0]: inline_kv: non-finite value (NaN or inf) in V at layer 1 head 0 dim 2");
    EXPECT_EQ(State(), before);
  }
  // A NaN in the query, finite K/V.
  {
    v1::DecodeStepRequest request = Decode(Kv(kBudget));
    std::string queries = request.items(0).attention().inline_queries();
    const float nan = std::nanf("");
    std::memcpy(queries.data() + 4 * 21, &nan, sizeof(nan));  // layer 0, q head 1, dim 5
    request.mutable_items(0)->mutable_attention()->set_inline_queries(queries);
    ExpectRefused(session_->DecodeStep(request).status(),
                  "items[0]: attention.inline_queries: non-finite value at layer 0 q head 1 "
                  "query 0 dim 5");
    EXPECT_EQ(State(), before);
  }
  // An inf among the worker's own attention probabilities ([L][Hq][1][count after the token]).
  {
    v1::DecodeStepRequest request = Decode(Kv(kBudget));
    v1::AttentionInputs* attention = request.mutable_items(0)->mutable_attention();
    attention->clear_inline_queries();
    std::string scores;
    const int count = kBudget + 1;
    for (int i = 0; i < layout_.num_layers() * layout_.num_q_heads() * count; ++i) {
      PutFloat(scores, i == 3 ? INFINITY : 1.0f / count);
    }
    attention->set_attention_scores(scores);
    ExpectRefused(session_->DecodeStep(request).status(), "items[0]: attention.attention_scores");
    EXPECT_EQ(State(), before);
  }

  // Rows written into a reservation: a NaN in V of layer 1, head 0, dim 3. DecodeStep and Commit
  // both refuse to take them; the reservation stays pending.
  auto reservation = session_->Reserve("seq", 1);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  ASSERT_TRUE(WritePattern(*session_, *reservation, kSeed).ok());
  std::vector<uint8_t> row = PatternRow(layout_, kSeed, 1, 1, 0, kBudget);
  std::memcpy(row.data() + 2 * 3, &kHalfNan, sizeof(kHalfNan));
  ASSERT_TRUE(session_->WriteReserved(*reservation, 1, 1, 0, 0, row).ok());
  const std::string where = "non-finite value (NaN or inf) in V at layer 1 head 0 token 0 (position " +
                            std::to_string(kBudget) + ") dim 3";
  ExpectRefused(
      session_->DecodeStep(Decode("", reservation->response().reservation_id())).status(), where);
  EXPECT_EQ(State(), before);
  ExpectRefused(session_->Commit(*reservation).status(), where);
  EXPECT_EQ(State(), before);
  // Rewritten finite, the same reservation goes through as this decode step's token.
  ASSERT_TRUE(WritePattern(*session_, *reservation, kSeed).ok());
  auto stepped = session_->DecodeStep(Decode("", reservation->response().reservation_id()));
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  auto after = State();
  EXPECT_THAT(after.first, Each(kBudget));
  EXPECT_EQ(after.second, kBudget + 1);

  // Inline Append of a token with an inf in K.
  {
    std::string payload = Kv(kBudget + 1);
    SetHalf(payload, KvIndex(0, 0, 0, 0), kHalfInf);
    kvsidecar::AppendSegment segment;
    segment.sequence_id = "seq";
    segment.num_tokens = 1;
    segment.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()),
                                          payload.size());
    ExpectRefused(session_->Append(segment).status(),
                  "non-finite value (NaN or inf) in K at layer 0 head 0 token 0");
    EXPECT_EQ(State(), after);
  }
  // Compress with a NaN query.
  {
    v1::CompressRequest request;
    request.set_sequence_id("seq");
    request.set_budget_tokens(kBudget - 2);
    v1::AttentionInputs attention = Query();
    std::string queries = attention.inline_queries();
    const float inf = INFINITY;
    std::memcpy(queries.data() + queries.size() - 4, &inf, sizeof(inf));
    attention.set_inline_queries(queries);
    *request.mutable_attention() = attention;
    ExpectRefused(session_->Compress(request).status(), "attention.inline_queries: non-finite");
    EXPECT_EQ(State(), after);
  }

  // Valid calls still work, and every kept row is what was written for its position.
  auto step = session_->DecodeStep(Decode(Kv(kBudget + 1)));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_THAT(step->items(0).counts(), Each(kBudget));
  if (GetParam() != "d2o") {  // D2O merges evicted rows into kept ones: their bytes change
    auto verified = VerifySequence(*session_, "seq", kSeed);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_THAT(verified->counts, Each(kBudget));
  }
  EXPECT_EQ(State().second, kBudget + 2);
}

// Finite inputs whose logits overflow: every key of the new token is +1 and every query element
// 3e38, so its logit is +inf in every layer and the softmax has no finite value (inf - inf).
// The step is refused naming the first layer in layer order, although the server observes the
// layers side by side, and nothing changes.
// Run for the policies that read attention only (the others never compute a softmax).
class AttentionNonFiniteTest : public NonFiniteTest {};

TEST_P(AttentionNonFiniteTest, OverflowingLogitsAreRefusedNamingTheFirstLayer) {
  const auto before = State();
  std::string kv = Kv(kBudget);
  constexpr uint16_t kHalfOne = 0x3c00;
  for (int layer = 0; layer < layout_.num_layers(); ++layer) {
    for (int head = 0; head < layout_.num_kv_heads(); ++head) {
      for (int dim = 0; dim < layout_.head_dim(); ++dim) {
        SetHalf(kv, KvIndex(layer, 0, head, dim), kHalfOne);
      }
    }
  }
  v1::DecodeStepRequest request = Decode(kv);
  std::string queries;
  const int per_layer = layout_.num_q_heads() * layout_.head_dim();
  for (int i = 0; i < layout_.num_layers() * per_layer; ++i) PutFloat(queries, 3e38f);
  request.mutable_items(0)->mutable_attention()->set_inline_queries(queries);
  for (int attempt = 0; attempt < 5; ++attempt) {
    const absl::Status status = session_->DecodeStep(request).status();
    ExpectRefused(status, "layer 0");
    EXPECT_THAT(MessageOf(status), ::testing::Not(HasSubstr("layer 1"))) << status;
    EXPECT_EQ(State(), before) << "attempt " << attempt;
  }
  // The same step with ordinary queries still works.
  EXPECT_TRUE(session_->DecodeStep(Decode(Kv(kBudget))).ok());
}

// BatchCommit checks the rows of every item in one pass before committing any; what it reports is
// what committing the items one by one in order would: the first item with a non-finite row is
// refused naming where it is, the items before it are committed, it and the items after it keep
// their pending reservations (a later item's bad row is reported once the first is fixed).
TEST_P(NonFiniteTest, BatchCommitRefusesTheFirstItemWithNonFiniteRows) {
  constexpr int kItems = 4, kTokens = 2;
  std::vector<kvsidecar::ReserveItem> items;
  for (int i = 0; i < kItems; ++i) {
    const std::string id = "batch-" + std::to_string(i);
    ASSERT_TRUE(session_->CreateSequence(Policy(GetParam()), std::nullopt, id).ok());
    ASSERT_TRUE(WriteTokens(*session_, id, kTokens, kSeed + i).ok());
    items.push_back({id, 1, {}});
  }
  auto reservations = session_->BatchReserve(items);
  ASSERT_TRUE(reservations.ok()) << reservations.status();
  for (int i = 0; i < kItems; ++i) {
    ASSERT_TRUE(WritePattern(*session_, (*reservations)[i], kSeed + i).ok());
  }
  // Item 1: a NaN in K of layer 0, head 1, dim 4; item 3: an inf in V of layer 1, head 0, dim 2.
  auto poison = [&](int item, int layer, int kv, int head, int dim, uint16_t bits) {
    std::vector<uint8_t> row = PatternRow(layout_, kSeed + item, layer, kv, head, kTokens);
    std::memcpy(row.data() + 2 * dim, &bits, sizeof(bits));
    return session_->WriteReserved((*reservations)[item], layer, kv, head, 0, row);
  };
  ASSERT_TRUE(poison(1, 0, 0, 1, 4, kHalfNan).ok());
  ASSERT_TRUE(poison(3, 1, 1, 0, 2, kHalfInf).ok());
  auto counts = [&](int item) {
    auto layout = session_->GetLayout(items[item].sequence_id, {}, /*omit_positions=*/true);
    EXPECT_TRUE(layout.ok()) << layout.status();
    std::vector<int> out;
    if (layout.ok()) {
      for (const v1::LayerLayout& layer : layout->layers()) out.push_back(layer.count());
    }
    return out;
  };

  auto refused = session_->BatchCommit(*reservations);
  ExpectRefused(refused.status(),
                "requests[1]: reservation " +
                    std::to_string((*reservations)[1].response().reservation_id()) +
                    ": non-finite value (NaN or inf) in K at layer 0 head 1 token 0 (position " +
                    std::to_string(kTokens) + ") dim 4");
  EXPECT_THAT(MessageOf(refused.status()),
              HasSubstr("(requests[0..0] were committed; requests[1..3] were not)"));
  EXPECT_THAT(counts(0), Each(kTokens + 1));
  for (int i = 1; i < kItems; ++i) EXPECT_THAT(counts(i), Each(kTokens)) << "item " << i;

  // Item 1 rewritten finite: item 3's row is the one refused now, items 1 and 2 commit.
  ASSERT_TRUE(WritePattern(*session_, (*reservations)[1], kSeed + 1).ok());
  std::vector<kvsidecar::Reservation> rest(reservations->begin() + 1, reservations->end());
  refused = session_->BatchCommit(rest);
  ExpectRefused(refused.status(),
                "requests[2]: reservation " +
                    std::to_string((*reservations)[3].response().reservation_id()) +
                    ": non-finite value (NaN or inf) in V at layer 1 head 0 token 0 (position " +
                    std::to_string(kTokens) + ") dim 2");
  for (int i = 0; i < 3; ++i) EXPECT_THAT(counts(i), Each(kTokens + 1)) << "item " << i;
  EXPECT_THAT(counts(3), Each(kTokens));

  // Item 3 rewritten finite commits; every row kept is the one written for its position.
  ASSERT_TRUE(WritePattern(*session_, (*reservations)[3], kSeed + 3).ok());
  auto committed = session_->BatchCommit({(*reservations)[3]});
  ASSERT_TRUE(committed.ok()) << committed.status();
  for (int i = 0; i < kItems; ++i) {
    auto verified = VerifySequence(*session_, items[i].sequence_id, kSeed + i);
    ASSERT_TRUE(verified.ok()) << "item " << i << ": " << verified.status();
    EXPECT_THAT(verified->counts, Each(kTokens + 1)) << "item " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPolicy, NonFiniteTest,
                         ::testing::Values("streaming_llm", "keydiff", "knorm", "h2o", "tova",
                                           "snapkv", "cake", "d2o", "caote"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });
INSTANTIATE_TEST_SUITE_P(AttentionPolicies, AttentionNonFiniteTest,
                         ::testing::Values("h2o", "tova", "snapkv", "cake", "d2o", "caote"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace kvs_e2e
