// Every option of the papers can be sent through the real kvsidecar binary: a zero that the paper
// means (no sinks, no recent share, no variance weight) is honoured rather than read as "use the
// default", a wrapper's base keeps its own parameters (CAOTE over TOVA with all_heads), and D2O's
// rho is a budget of its own. Attention already folded into a sequence (H2O's accumulated column
// sums) serves a later Compress or Score that carries none, so the worker never resends queries
// it already sent. kvpress's variants are options beside the papers' defaults
// (docs/policies/kvpress_variants.md): H2O normalised by the queries that see each key, TOVA's
// kept last token, SnapKV/PyramidKV's kvpress defaults.
#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

constexpr uint64_t kSeed = 91;

class PaperOptionsE2eTest : public SharedServerTest<PaperOptionsE2eTest> {
 protected:
  void SetUp() override {
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    layout_ = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
    auto session = client_->Attach(layout_);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
  }

  v1::ModelLayout layout_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::Session> session_;
};

// StreamingLLM with n_sink = 0 is a pure sliding window: the newest `budget` positions stay.
TEST_F(PaperOptionsE2eTest, StreamingLlmWithoutSinksKeepsOnlyTheNewest) {
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  policy.mutable_streaming_llm()->set_n_sink(0);
  auto created = session_->CreateSequence(policy, MakeBudget(8), "window");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().streaming_llm().n_sink(), 0);
  ASSERT_TRUE(WriteTokens(*session_, "window", 20, kSeed, /*compress_if_over_budget=*/true).ok());
  auto verified = VerifySequence(*session_, "window", kSeed);
  ASSERT_TRUE(verified.ok()) << verified.status();
  const std::vector<int> newest = {12, 13, 14, 15, 16, 17, 18, 19};
  for (const auto& layer : verified->positions) {
    for (const std::vector<int>& head : layer) {
      std::vector<int> sorted = head;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(sorted, newest);
    }
  }
  // Unset still means the paper's default of 4 sinks.
  v1::PolicySpec unset;
  unset.set_name("streaming_llm");
  auto defaulted = session_->CreateSequence(unset, MakeBudget(8), "sinks");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->policy().streaming_llm().n_sink(), 4);
}

TEST_F(PaperOptionsE2eTest, D2oZeroSinksAndZeroRecentShareAreHonoured) {
  v1::PolicySpec policy;
  policy.set_name("d2o");
  policy.mutable_d2o()->set_n_sink(0);
  policy.mutable_d2o()->set_recent_frac(0.0f);
  auto created = session_->CreateSequence(policy, MakeBudget(8), "d2o");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().d2o().n_sink(), 0);
  EXPECT_EQ(created->policy().d2o().recent_frac(), 0.0f);
  v1::PolicySpec unset;
  unset.set_name("d2o");
  auto defaulted = session_->CreateSequence(unset, MakeBudget(8), "d2o-default");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->policy().d2o().n_sink(), 4);
  EXPECT_EQ(defaulted->policy().d2o().recent_frac(), 0.25f);
}

TEST_F(PaperOptionsE2eTest, CakeZeroGammaIsHonoured) {
  v1::PolicySpec policy;
  policy.set_name("cake");
  policy.mutable_cake()->set_gamma(0.0f);
  auto created = session_->CreateSequence(policy, MakeBudget(8), "cake");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().cake().gamma(), 0.0f);
  v1::PolicySpec unset;
  unset.set_name("cake");
  auto defaulted = session_->CreateSequence(unset, MakeBudget(8), "cake-default");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->policy().cake().gamma(), 200.0f);
}

// The worker's attention probabilities [layers][Hq][1][count] for every layer of a sequence
// that holds `count` tokens per layer: the same varied row in every layer and head, so D2O's
// layer densities are equal and its split gives every layer the sequence budget.
v1::AttentionInputs SameRowScores(const v1::ModelLayout& layout, int count) {
  v1::AttentionInputs attention;
  attention.set_num_queries(1);
  attention.add_query_positions(count - 1);
  std::string bytes;
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    for (int q = 0; q < layout.num_q_heads(); ++q) {
      for (int p = 0; p < count; ++p) {
        const float score = static_cast<float>((p * 7) % 5 + 1) / 100.0f;
        bytes.append(reinterpret_cast<const char*>(&score), sizeof score);
      }
    }
  }
  attention.set_attention_scores(bytes);
  return attention;
}

std::vector<int> CountsOf(kvsidecar::Session& session, const std::string& seq) {
  std::vector<int> counts;
  auto layout = session.GetLayout(seq, {}, /*omit_positions=*/true);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return counts;
  for (const auto& layer : layout->layers()) counts.push_back(layer.count());
  return counts;
}

// D2O's rho is a budget: with no token budget a sequence keeps FloorFraction(rho, P) tokens per
// layer before the layer split (8 of a 16-token prompt at rho = 0.5), fixed for decode. A token
// budget, when given, wins over rho.
TEST_F(PaperOptionsE2eTest, D2oRhoIsABudgetWhenNoTokenBudgetIsGiven) {
  v1::PolicySpec policy;
  policy.set_name("d2o");
  policy.mutable_d2o()->set_rho(0.5f);
  // No budget: the server default (unbounded here) leaves rho as the budget.
  auto created = session_->CreateSequence(policy, std::nullopt, "rho");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().d2o().rho(), 0.5f);
  ASSERT_TRUE(WriteTokens(*session_, "rho", 16, kSeed).ok());
  v1::CompressRequest compress;
  compress.set_sequence_id("rho");
  *compress.mutable_attention() = SameRowScores(layout_, 16);
  auto compressed = session_->Compress(compress);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_EQ(CountsOf(*session_, "rho"), (std::vector<int>{8, 8}));
  auto layout = session_->GetLayout("rho", {}, /*omit_positions=*/true);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const auto& layer : layout->layers()) EXPECT_EQ(layer.budget(), 8);
  // The budget stays the prompt's: more tokens and another Compress come back to 8.
  ASSERT_TRUE(WriteTokens(*session_, "rho", 4, kSeed).ok());
  *compress.mutable_attention() = SameRowScores(layout_, 12);
  compressed = session_->Compress(compress);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_EQ(CountsOf(*session_, "rho"), (std::vector<int>{8, 8}));

  // rho and a token budget: the token budget (12) decides.
  auto both = session_->CreateSequence(policy, MakeBudget(12), "rho-and-tokens");
  ASSERT_TRUE(both.ok()) << both.status();
  ASSERT_TRUE(WriteTokens(*session_, "rho-and-tokens", 16, kSeed).ok());
  compress.set_sequence_id("rho-and-tokens");
  *compress.mutable_attention() = SameRowScores(layout_, 16);
  compressed = session_->Compress(compress);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_EQ(CountsOf(*session_, "rho-and-tokens"), (std::vector<int>{12, 12}));
}

// CAOTE over TOVA carries TOVA's own all_heads; it used to be unreachable (setting the TOVA
// message replaced the CAOTE one in the params oneof).
TEST_F(PaperOptionsE2eTest, CaoteOverTovaCarriesAllHeads) {
  v1::PolicySpec policy;
  policy.set_name("caote");
  policy.mutable_caote()->set_base(v1::CaoteParams::BASE_TOVA);
  policy.mutable_caote()->mutable_tova()->set_all_heads(true);
  auto created = session_->CreateSequence(policy, MakeBudget(8), "caote");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().caote().base(), v1::CaoteParams::BASE_TOVA);
  EXPECT_TRUE(created->policy().caote().tova().all_heads());
  auto layout = session_->GetLayout("caote");
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE(layout->policy().caote().tova().all_heads());
}

// The worker's own probabilities [layers][Hq][1][count] fp32: `weight` on the positions
// `favoured[layer]` (slot s holds position s in a sequence that has not evicted yet), a small
// uniform floor elsewhere.
v1::AttentionInputs FavouringScores(const v1::ModelLayout& layout, const std::vector<int>& layers,
                                    int count, const std::vector<std::set<int>>& favoured,
                                    float weight) {
  v1::AttentionInputs attention;
  for (int layer : layers) attention.add_layers(layer);
  attention.set_num_queries(1);
  std::string bytes;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (int q = 0; q < layout.num_q_heads(); ++q) {
      for (int s = 0; s < count; ++s) {
        const float p = favoured[i].count(s) ? weight : 0.001f;
        char raw[sizeof(float)];
        std::memcpy(raw, &p, sizeof(float));
        bytes.append(raw, sizeof(float));
      }
    }
  }
  attention.set_attention_scores(bytes);
  return attention;
}

// Commits `count` tokens with the worker's attention, observed but not compressed.
absl::StatusOr<v1::CommitResponse> CommitObserved(kvsidecar::Session& session,
                                                  const std::string& seq, int count,
                                                  v1::AttentionInputs attention) {
  auto reservation = session.Reserve(seq, count);
  if (!reservation.ok()) return reservation.status();
  absl::Status written = WritePattern(session, *reservation, kSeed);
  if (!written.ok()) return written;
  v1::CommitRequest request;
  request.set_sequence_id(seq);
  request.set_reservation_id(reservation->id());
  *request.mutable_attention() = std::move(attention);
  return session.Commit(std::move(request));
}

std::set<int> SortedHead(const google::protobuf::RepeatedField<int32_t>& positions, int head,
                         int kept) {
  return std::set<int>(positions.begin() + head * kept, positions.begin() + (head + 1) * kept);
}

v1::PolicySpec PlainH2o() {
  v1::PolicySpec policy;
  policy.set_name("h2o");
  policy.mutable_h2o()->set_n_sink(0);
  policy.mutable_h2o()->set_n_recent(0);
  return policy;
}

TEST_F(PaperOptionsE2eTest, AccumulatedAttentionServesCompressAndScoreWithoutAttention) {
  const std::vector<std::set<int>> favoured = {{2, 5, 7, 10}, {1, 3, 8, 11}};
  ASSERT_TRUE(session_->CreateSequence(PlainH2o(), MakeBudget(4), "h2o").ok());
  auto committed =
      CommitObserved(*session_, "h2o", 12, FavouringScores(layout_, {0, 1}, 12, favoured, 1.0f));
  ASSERT_TRUE(committed.ok()) << committed.status();
  ASSERT_EQ(committed->counts(0), 12);  // observed, not compressed

  // Score without attention: the dry run reads the accumulated sums.
  v1::ScoreRequest score;
  score.set_sequence_id("h2o");
  auto scored = session_->Score(score);
  ASSERT_TRUE(scored.ok()) << scored.status();
  ASSERT_EQ(scored->layers_size(), 2);
  for (const auto& layer : scored->layers()) {
    ASSERT_EQ(layer.kept(), 4);
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      EXPECT_EQ(SortedHead(layer.kept_slots(), h, 4), favoured[layer.layer()])
          << "layer " << layer.layer() << " head " << h;
    }
  }

  // Compress without attention keeps what Score said.
  v1::CompressRequest compress;
  compress.set_sequence_id("h2o");
  compress.set_return_positions(true);
  auto compressed = session_->Compress(compress);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  for (const auto& layer : compressed->layers()) {
    ASSERT_EQ(layer.kept(), 4);
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      EXPECT_EQ(SortedHead(layer.positions(), h, 4), favoured[layer.layer()])
          << "layer " << layer.layer() << " head " << h;
    }
  }
  auto verified = VerifySequence(*session_, "h2o", kSeed);
  ASSERT_TRUE(verified.ok()) << verified.status();
}

// A call that carries attention for some layers adds it to what those layers accumulated (it
// never replaces it); the layers it does not list use their accumulated sums alone.
TEST_F(PaperOptionsE2eTest, AttentionInACallAddsToTheAccumulatedSums) {
  const std::vector<std::set<int>> first = {{2, 5, 7, 10}, {1, 3, 8, 11}};
  ASSERT_TRUE(session_->CreateSequence(PlainH2o(), MakeBudget(4), "mixed").ok());
  ASSERT_TRUE(
      CommitObserved(*session_, "mixed", 12, FavouringScores(layout_, {0, 1}, 12, first, 1.0f))
          .ok());
  // Layer 0 only: 0.6 on {2, 5, 0, 1}. Summed: 2 and 5 lead (1.6), then 7 and 10 (1.0) beat
  // 0 and 1 (0.6); had the call replaced the sums, 0 and 1 would be kept instead of 7 and 10.
  v1::CompressRequest compress;
  compress.set_sequence_id("mixed");
  compress.set_return_positions(true);
  *compress.mutable_attention() = FavouringScores(layout_, {0}, 12, {{2, 5, 0, 1}}, 0.6f);
  auto compressed = session_->Compress(compress);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  for (const auto& layer : compressed->layers()) {
    for (int h = 0; h < layout_.num_kv_heads(); ++h) {
      EXPECT_EQ(SortedHead(layer.positions(), h, 4), first[layer.layer()])
          << "layer " << layer.layer() << " head " << h;
    }
  }
}

// Nothing accumulated yet, or a policy that remembers nothing between calls: still refused,
// naming the policy and the field, and nothing changes.
TEST_F(PaperOptionsE2eTest, CompressWithoutAttentionOrAccumulatedSumsIsRefused) {
  ASSERT_TRUE(session_->CreateSequence(PlainH2o(), MakeBudget(4), "fresh").ok());
  ASSERT_TRUE(WriteTokens(*session_, "fresh", 12, kSeed).ok());
  v1::CompressRequest compress;
  compress.set_sequence_id("fresh");
  auto refused = session_->Compress(compress);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(MessageOf(refused.status()).find("policy h2o needs attention"), std::string::npos)
      << MessageOf(refused.status());

  v1::PolicySpec tova;
  tova.set_name("tova");
  ASSERT_TRUE(session_->CreateSequence(tova, MakeBudget(4), "tova").ok());
  ASSERT_TRUE(CommitObserved(*session_, "tova", 12,
                             FavouringScores(layout_, {0, 1}, 12, {{1, 2, 3, 4}, {1, 2, 3, 4}},
                                             1.0f))
                  .ok());
  compress.set_sequence_id("tova");
  refused = session_->Compress(compress);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(MessageOf(refused.status()).find("attention"), std::string::npos);
  // An H2O override on the TOVA sequence finds no sums either (TOVA accumulates none).
  *compress.mutable_policy() = PlainH2o();
  EXPECT_EQ(session_->Compress(compress).status().code(), absl::StatusCode::kInvalidArgument);
  auto layout = session_->GetLayout("tova");
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const auto& layer : layout->layers()) EXPECT_EQ(layer.count(), 12);
}

// --- kvpress's variants ---------------------------------------------------------------------

// The worker's probabilities [layers][Hq][rows][count] fp32: every layer and query head gets
// `rows` (position order = slot order: nothing has been evicted yet).
std::string ScoresBytes(const v1::ModelLayout& layout, const std::vector<std::vector<float>>& rows) {
  std::string bytes;
  for (int l = 0; l < layout.num_layers(); ++l) {
    for (int q = 0; q < layout.num_q_heads(); ++q) {
      for (const std::vector<float>& row : rows) {
        for (float p : row) bytes.append(reinterpret_cast<const char*>(&p), sizeof p);
      }
    }
  }
  return bytes;
}

// Compresses `seq` to `budget` with `rows` as the prompt's attention; the kept positions of every
// (layer, kv head), sorted.
absl::StatusOr<std::vector<std::vector<int>>> CompressKept(
    kvsidecar::Session& session, const v1::ModelLayout& layout, const std::string& seq,
    int budget, const std::vector<std::vector<float>>& rows) {
  v1::CompressRequest request;
  request.set_sequence_id(seq);
  request.set_budget_tokens(budget);
  request.set_return_positions(true);
  request.mutable_attention()->set_num_queries(static_cast<int>(rows.size()));
  request.mutable_attention()->set_attention_scores(ScoresBytes(layout, rows));
  auto response = session.Compress(std::move(request));
  if (!response.ok()) return response.status();
  std::vector<std::vector<int>> kept;
  for (const auto& layer : response->layers()) {
    for (int h = 0; h < layout.num_kv_heads(); ++h) {
      std::vector<int> head(layer.positions().begin() + h * layer.kept(),
                            layer.positions().begin() + (h + 1) * layer.kept());
      std::sort(head.begin(), head.end());
      kept.push_back(head);
    }
  }
  return kept;
}

// Causal attention of 4 queries over 4 tokens: sums [1.8, 1.0, .85, .35]; divided by the
// queries that see each key [4, 3, 2, 1]: [.45, .333, .425, .35].
const std::vector<std::vector<float>> kCausalRows = {
    {1, 0, 0, 0}, {.5f, .5f, 0, 0}, {.2f, .2f, .6f, 0}, {.1f, .3f, .25f, .35f}};

TEST_F(PaperOptionsE2eTest, H2oNormalizedByQueriesKeepsWhatObservedAttentionKeeps) {
  for (const bool normalize : {false, true}) {
    const std::string seq = normalize ? "h2o-normalized" : "h2o-sum";
    v1::PolicySpec policy;
    policy.set_name("h2o");
    if (normalize) policy.mutable_h2o()->set_normalize_by_queries(true);
    auto created = session_->CreateSequence(policy, MakeBudget(64), seq);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->policy().h2o().normalize_by_queries(), normalize);
    ASSERT_TRUE(WriteTokens(*session_, seq, 4, kSeed).ok());
    auto kept = CompressKept(*session_, layout_, seq, 2, kCausalRows);
    ASSERT_TRUE(kept.ok()) << kept.status();
    const std::vector<int> want = normalize ? std::vector<int>{0, 2} : std::vector<int>{0, 1};
    for (const std::vector<int>& head : *kept) EXPECT_EQ(head, want) << seq;
    auto layout = session_->GetLayout(seq);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->policy().h2o().normalize_by_queries(), normalize);
  }
}

TEST_F(PaperOptionsE2eTest, TovaKeepLastTokenKeepsTheNewestToken) {
  // The last query: [.4, .3, .2, .1]; the paper keeps 0 and 1, kvpress's variant 0 and 3.
  for (const bool keep_last : {false, true}) {
    const std::string seq = keep_last ? "tova-last" : "tova";
    v1::PolicySpec policy;
    policy.set_name("tova");
    policy.mutable_tova()->set_all_heads(true);
    if (keep_last) policy.mutable_tova()->set_keep_last_token(true);
    auto created = session_->CreateSequence(policy, MakeBudget(64), seq);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->policy().tova().keep_last_token(), keep_last);
    ASSERT_TRUE(WriteTokens(*session_, seq, 4, kSeed).ok());
    auto kept = CompressKept(*session_, layout_, seq, 2, {{.4f, .3f, .2f, .1f}});
    ASSERT_TRUE(kept.ok()) << kept.status();
    const std::vector<int> want = keep_last ? std::vector<int>{0, 3} : std::vector<int>{0, 1};
    for (const std::vector<int>& head : *kept) EXPECT_EQ(head, want) << seq;
  }
}

TEST_F(PaperOptionsE2eTest, SnapKvKvpressDefaultsAndPyramidRule) {
  v1::PolicySpec policy;
  policy.set_name("snapkv");
  policy.mutable_snapkv()->set_defaults(v1::SnapKvParams::DEFAULTS_KVPRESS);
  auto created = session_->CreateSequence(policy, MakeBudget(64), "snapkv-kvpress");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->policy().snapkv().window(), 64);
  EXPECT_EQ(created->policy().snapkv().kernel_size(), 5);
  EXPECT_EQ(created->policy().snapkv().defaults(), v1::SnapKvParams::DEFAULTS_KVPRESS);
  v1::PolicySpec paper;
  paper.set_name("snapkv");
  paper.mutable_snapkv();
  auto defaulted = session_->CreateSequence(paper, MakeBudget(64), "snapkv-paper");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->policy().snapkv().window(), 32);
  EXPECT_EQ(defaulted->policy().snapkv().kernel_size(), 7);

  // PyramidKV over 2 layers of 32 tokens, budget 8, window 4: the paper's pyramid gives 16 and 0
  // (raised to the floor of 4); kvpress's rule falls back to uniform 8 / 8 (min 8/20 < window).
  for (const bool kvpress : {false, true}) {
    const std::string seq = kvpress ? "pyramid-kvpress" : "pyramid-paper";
    v1::PolicySpec pyramid;
    pyramid.set_name("snapkv");
    pyramid.mutable_snapkv()->set_window(4);
    if (kvpress) pyramid.mutable_snapkv()->set_defaults(v1::SnapKvParams::DEFAULTS_KVPRESS);
    pyramid.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_PYRAMIDKV);
    ASSERT_TRUE(session_->CreateSequence(pyramid, MakeBudget(64), seq).ok());
    ASSERT_TRUE(WriteTokens(*session_, seq, 32, kSeed).ok());
    v1::CompressRequest request;
    request.set_sequence_id(seq);
    request.set_budget_tokens(8);
    request.mutable_attention()->set_num_queries(4);
    request.mutable_attention()->set_attention_scores(
        ScoresBytes(layout_, std::vector<std::vector<float>>(4, std::vector<float>(32, 1 / 32.f))));
    auto response = session_->Compress(std::move(request));
    ASSERT_TRUE(response.ok()) << response.status();
    std::vector<int> kept;
    for (const auto& layer : response->layers()) kept.push_back(layer.kept());
    EXPECT_EQ(kept, kvpress ? std::vector<int>({8, 8}) : std::vector<int>({16, 4})) << seq;
  }
}

TEST_F(PaperOptionsE2eTest, UnknownSnapKvDefaultsIsRefusedNamingTheField) {
  v1::PolicySpec policy;
  policy.set_name("snapkv");
  policy.mutable_snapkv()->set_defaults(static_cast<v1::SnapKvParams::Defaults>(7));
  auto created = session_->CreateSequence(policy, MakeBudget(64), "bad-defaults");
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(created.status().message()),
              ::testing::HasSubstr("policy.snapkv.defaults"));
  EXPECT_EQ(session_->GetLayout("bad-defaults").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvs_e2e
