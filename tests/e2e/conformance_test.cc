// End to end conformance: the policy specs' normative test vectors (shared/design/policies/
// {caote,d2o,cake,keydiff}.md) driven through gRPC against the real server binary. Keys and
// values are written exactly (fp32 layouts, inline Append / DecodeStep inline_kv), attention goes
// in as post-RoPE fp32 queries or as the worker's own probabilities (attention_scores, mapped to
// the current slot order by position: hole-filling compaction scrambles slots), and the kept
// positions per (layer, kv head) are read back with GetLayout, merged values with Export.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

absl::Status StatusOf(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}
#define KVS_ASSERT_OK(expr)                         \
  do {                                              \
    const absl::Status kvs_status = StatusOf(expr); \
    ASSERT_TRUE(kvs_status.ok()) << kvs_status;     \
  } while (false)

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::SizeIs;

// [layer][head] -> sorted positions.
using KeptSets = std::vector<std::vector<std::vector<int>>>;
// Element c of the K (kv 0) or V (kv 1) row of `head` for the token at `position` of `layer`.
using KvFn = std::function<double(int layer, int kv, int head, int position, int c)>;
// Element c of query head `qhead`'s query at `position` of `layer`.
using QueryFn = std::function<double(int layer, int qhead, int position, int c)>;
// The probability query row `row` of query head `qhead` gives the key at `position` of `layer`.
using ProbFn = std::function<double(int layer, int qhead, int row, int position)>;

void PutFloat(std::string& out, double value) {
  const float f = static_cast<float>(value);
  char bytes[sizeof(float)];
  std::memcpy(bytes, &f, sizeof(float));
  out.append(bytes, sizeof(float));
}

// Inline payload [layers][2][H][positions][D] fp32 (every layer of `layout`).
std::string KvPayload(const v1::ModelLayout& layout, const std::vector<int>& positions,
                      const KvFn& fn) {
  std::string out;
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < layout.num_kv_heads(); ++head) {
        for (int position : positions) {
          for (int c = 0; c < layout.head_dim(); ++c) {
            PutFloat(out, fn(layer, kv, head, position, c));
          }
        }
      }
    }
  }
  return out;
}

// Queries [layers][Hq][positions][D] fp32, scale 1/sqrt(D). `list_layers` names the layers in
// attention.layers (else empty = all, which must then be every layer of the model).
v1::AttentionInputs QueryAttention(const v1::ModelLayout& layout, const std::vector<int>& layers,
                                   bool list_layers, const std::vector<int>& query_positions,
                                   const QueryFn& fn) {
  v1::AttentionInputs attention;
  if (list_layers) {
    for (int layer : layers) attention.add_layers(layer);
  }
  attention.set_num_queries(static_cast<int>(query_positions.size()));
  for (int p : query_positions) attention.add_query_positions(p);
  attention.set_softmax_scale(static_cast<float>(1.0 / std::sqrt(layout.head_dim())));
  attention.set_queries_dtype(v1::DTYPE_FLOAT32);
  std::string bytes;
  for (int layer : layers) {
    for (int q = 0; q < layout.num_q_heads(); ++q) {
      for (int p : query_positions) {
        for (int c = 0; c < layout.head_dim(); ++c) PutFloat(bytes, fn(layer, q, p, c));
      }
    }
  }
  attention.set_inline_queries(bytes);
  return attention;
}

const v1::LayerLayout* FindLayer(const v1::GetLayoutResponse& layout, int layer) {
  for (const auto& l : layout.layers()) {
    if (l.layer() == layer) return &l;
  }
  return nullptr;
}

// The worker's probabilities [layers][Hq][num_queries][count] fp32 in the slot order of `layout`
// (as GetLayout returned it before this call); `new_position` >= 0 is a token this call appends
// (DecodeStep inline_kv), which lands in slot `count` of every head.
v1::AttentionInputs ScoresAttention(const v1::ModelLayout& model,
                                    const v1::GetLayoutResponse& layout,
                                    const std::vector<int>& layers, bool list_layers,
                                    int num_queries, const ProbFn& fn, int new_position = -1) {
  v1::AttentionInputs attention;
  if (list_layers) {
    for (int layer : layers) attention.add_layers(layer);
  }
  attention.set_num_queries(num_queries);
  const int group = model.num_q_heads() / model.num_kv_heads();
  std::string bytes;
  for (int layer : layers) {
    const v1::LayerLayout* l = FindLayer(layout, layer);
    EXPECT_NE(l, nullptr) << "layer " << layer;
    if (l == nullptr) continue;
    const int count = l->count();
    for (int q = 0; q < model.num_q_heads(); ++q) {
      const int head = q / group;
      for (int row = 0; row < num_queries; ++row) {
        for (int s = 0; s < count; ++s) {
          PutFloat(bytes, fn(layer, q, row, l->positions(head * count + s)));
        }
        if (new_position >= 0) PutFloat(bytes, fn(layer, q, row, new_position));
      }
    }
  }
  attention.set_attention_scores(bytes);
  return attention;
}

// A probability table by position: rows[qhead][row][position].
ProbFn Table(std::vector<std::vector<std::vector<double>>> rows) {
  return [rows = std::move(rows)](int, int q, int row, int position) {
    return rows[q][row][position];
  };
}

std::vector<int> Range(int begin, int end) {
  std::vector<int> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

v1::PolicySpec Named(const std::string& name) {
  v1::PolicySpec spec;
  spec.set_name(name);
  spec.mutable_allocator()->set_min_layer_tokens(1);
  return spec;
}

v1::PolicySpec H2o(int n_sink = 0, int n_recent = 0) {
  v1::PolicySpec spec = Named("h2o");
  spec.mutable_h2o()->set_n_sink(n_sink);
  spec.mutable_h2o()->set_n_recent(n_recent);
  return spec;
}

v1::PolicySpec Tova() {
  v1::PolicySpec spec = Named("tova");
  spec.mutable_tova()->set_all_heads(false);
  return spec;
}

v1::PolicySpec SnapKv(int window, int kernel) {
  v1::PolicySpec spec = Named("snapkv");
  spec.mutable_snapkv()->set_window(window);
  spec.mutable_snapkv()->set_kernel_size(kernel);
  spec.mutable_snapkv()->set_pooling(v1::SnapKvParams::POOLING_AVG);
  return spec;
}

v1::PolicySpec Caote(v1::CaoteParams::Base base, v1::CaoteParams::Variant variant,
                     v1::CaoteParams::GqaReduce reduce = v1::CaoteParams::GQA_REDUCE_MEAN,
                     int snap_window = 2, int snap_kernel = 3) {
  v1::PolicySpec spec = Named("caote");
  v1::CaoteParams* caote = spec.mutable_caote();
  caote->set_base(base);
  caote->set_variant(variant);
  caote->set_gqa_reduce(reduce);
  caote->mutable_snapkv()->set_window(snap_window);
  caote->mutable_snapkv()->set_kernel_size(snap_kernel);
  caote->mutable_snapkv()->set_pooling(v1::SnapKvParams::POOLING_AVG);
  return spec;
}

v1::PolicySpec KeyDiff(v1::KeyDiffParams::Anchor anchor = v1::KeyDiffParams::ANCHOR_MEAN_NORMALIZED,
                       v1::KeyDiffParams::Metric metric = v1::KeyDiffParams::METRIC_COSINE,
                       float recent_fraction = 0.0f) {
  v1::PolicySpec spec = Named("keydiff");
  spec.mutable_keydiff()->set_anchor(anchor);
  spec.mutable_keydiff()->set_metric(metric);
  spec.mutable_keydiff()->set_recent_fraction(recent_fraction);
  return spec;
}

v1::PolicySpec Cake(int kernel) {
  v1::PolicySpec spec = Named("cake");
  v1::CakeParams* cake = spec.mutable_cake();
  cake->set_window(2);
  cake->set_tau1(1.0f);
  cake->set_tau2(1.0f);
  cake->set_gamma(200.0f);
  cake->set_kernel_size(kernel);
  return spec;
}

v1::PolicySpec D2o(v1::D2oParams::MergeWeighting weighting) {
  v1::PolicySpec spec = Named("d2o");
  v1::D2oParams* d2o = spec.mutable_d2o();
  d2o->set_n_sink(1);
  d2o->set_recent_frac(0.5f);
  d2o->set_beta(0.7f);
  d2o->set_merge_weighting(weighting);
  return spec;
}

// Per-token 2-d vectors as a KvFn (same for every layer and head): keys[position],
// values[position].
KvFn Vectors(std::vector<std::array<double, 2>> keys, std::vector<std::array<double, 2>> values) {
  return
      [keys = std::move(keys), values = std::move(values)](int, int kv, int, int position, int c) {
        return kv == 0 ? keys[position][c] : values[position][c];
      };
}

std::vector<std::array<double, 2>> IndexValues(int n) {
  std::vector<std::array<double, 2>> values;
  for (int i = 0; i < n; ++i) values.push_back({static_cast<double>(i), 1.0});
  return values;
}

class ConformanceTest : public SharedServerTest<ConformanceTest> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  // An fp32 session with block_tokens 4.
  std::unique_ptr<kvsidecar::Session> Attach(int layers, int kv_heads, int q_heads, int head_dim) {
    layout_ = MakeLayout(layers, kv_heads, q_heads, head_dim, v1::DTYPE_FLOAT32, 4);
    auto session = client_->Attach(layout_, "conformance", 512, /*lease_ms=*/60000);
    EXPECT_TRUE(session.ok()) << session.status() << "\n" << server_->Logs();
    return session.ok() ? std::move(*session) : nullptr;
  }

  absl::Status Create(kvsidecar::Session& session, const std::string& seq,
                      const v1::PolicySpec& policy, const v1::Budget& budget) {
    auto created = session.CreateSequence(policy, budget, seq);
    return created.status();
  }

  absl::StatusOr<v1::AppendResponse> Append(kvsidecar::Session& session, const std::string& seq,
                                            const std::vector<int>& positions, const KvFn& fn) {
    const std::string payload = KvPayload(layout_, positions, fn);
    kvsidecar::AppendSegment segment;
    segment.sequence_id = seq;
    segment.num_tokens = static_cast<int32_t>(positions.size());
    segment.positions.assign(positions.begin(), positions.end());
    segment.payload =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    return session.Append(segment);
  }

  absl::StatusOr<v1::CompressResponse> CompressWith(kvsidecar::Session& session,
                                                    const std::string& seq,
                                                    const v1::AttentionInputs& attention,
                                                    int budget_tokens = 0) {
    v1::CompressRequest request;
    request.set_sequence_id(seq);
    if (budget_tokens > 0) request.set_budget_tokens(budget_tokens);
    *request.mutable_attention() = attention;
    request.set_return_positions(true);
    return session.Compress(std::move(request));
  }

  absl::StatusOr<v1::DecodeStepResponse> Decode(kvsidecar::Session& session, const std::string& seq,
                                                int position, const KvFn& fn,
                                                const v1::AttentionInputs* attention) {
    v1::DecodeStepRequest request;
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_session_id(session.session_id());
    item->set_sequence_id(seq);
    item->set_inline_kv(KvPayload(layout_, {position}, fn));
    if (attention != nullptr) *item->mutable_attention() = *attention;
    return session.DecodeStep(std::move(request));
  }

  absl::StatusOr<v1::ScoreResponse> ScoreWith(kvsidecar::Session& session, const std::string& seq,
                                              const v1::AttentionInputs& attention,
                                              int budget_tokens) {
    v1::ScoreRequest request;
    request.set_session_id(session.session_id());
    request.set_sequence_id(seq);
    request.set_budget_tokens(budget_tokens);
    *request.mutable_attention() = attention;
    return session.Score(std::move(request));
  }

  static KeptSets KeptFromLayout(const v1::GetLayoutResponse& layout) {
    KeptSets kept;
    for (const auto& l : layout.layers()) {
      const int heads = l.count() == 0 ? 0 : l.positions_size() / l.count();
      std::vector<std::vector<int>> per_head;
      for (int h = 0; h < heads; ++h) {
        std::vector<int> positions(l.positions().begin() + h * l.count(),
                                   l.positions().begin() + (h + 1) * l.count());
        std::sort(positions.begin(), positions.end());
        per_head.push_back(positions);
      }
      kept.push_back(per_head);
    }
    return kept;
  }

  absl::StatusOr<KeptSets> Kept(kvsidecar::Session& session, const std::string& seq) {
    auto layout = session.GetLayout(seq);
    if (!layout.ok()) return layout.status();
    return KeptFromLayout(*layout);
  }

  // The exported row (kv, head) of the token at `position` of `layer`, as doubles; empty if the
  // position is not held.
  static std::vector<double> ExportedRow(const kvsidecar::ExportResult& exported, int layer, int kv,
                                         int head, int position) {
    int index = -1;
    for (int i = 0; i < exported.header.layers_size(); ++i) {
      if (exported.header.layers(i).layer() == layer) index = i;
    }
    if (index < 0) return {};
    const v1::LayerLayout& l = exported.header.layers(index);
    for (int s = 0; s < l.count(); ++s) {
      if (l.positions(head * l.count() + s) != position) continue;
      auto row = exported.Row(index, kv, head, s);
      if (!row.ok()) return {};
      std::vector<double> out(row->size() / sizeof(float));
      for (size_t c = 0; c < out.size(); ++c) {
        float f;
        std::memcpy(&f, row->data() + c * sizeof(float), sizeof(float));
        out[c] = f;
      }
      return out;
    }
    return {};
  }

  // Every held row of `seq` equals `fn` at its position, bit for bit (policies that never merge).
  void ExpectRowsExact(kvsidecar::Session& session, const std::string& seq, const KvFn& fn) {
    auto exported = session.Export(seq);
    ASSERT_TRUE(exported.ok()) << exported.status();
    for (int i = 0; i < exported->header.layers_size(); ++i) {
      const v1::LayerLayout& l = exported->header.layers(i);
      for (int head = 0; head < layout_.num_kv_heads(); ++head) {
        for (int s = 0; s < l.count(); ++s) {
          const int position = l.positions(head * l.count() + s);
          for (int kv = 0; kv < 2; ++kv) {
            const auto row = ExportedRow(*exported, l.layer(), kv, head, position);
            ASSERT_EQ(row.size(), static_cast<size_t>(layout_.head_dim()));
            for (int c = 0; c < layout_.head_dim(); ++c) {
              EXPECT_EQ(row[c], static_cast<float>(fn(l.layer(), kv, head, position, c)))
                  << "layer " << l.layer() << " kv " << kv << " head " << head << " position "
                  << position << " c " << c;
            }
          }
        }
      }
    }
  }

  // Kept positions of a Score layer, per head, sorted.
  static std::vector<std::vector<int>> ScoreKept(const v1::ScoreResponse::LayerScores& scores,
                                                 int heads) {
    std::vector<std::vector<int>> out(heads);
    const int count = heads == 0 ? 0 : scores.positions_size() / heads;
    const int kept = scores.kept();
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < kept && h * kept + i < scores.kept_slots_size(); ++i) {
        const int slot = scores.kept_slots(h * kept + i);
        if (slot >= 0 && slot < count) out[h].push_back(scores.positions(h * count + slot));
      }
      std::sort(out[h].begin(), out[h].end());
    }
    return out;
  }

  // The Score value of the token at `position` of kv head `head`.
  static double ScoreAt(const v1::ScoreResponse::LayerScores& scores, int heads, int head,
                        int position) {
    const int count = scores.positions_size() / heads;
    for (int s = 0; s < count; ++s) {
      if (scores.positions(head * count + s) == position && head * count + s < scores.scores_size())
        return scores.scores(head * count + s);
    }
    return std::numeric_limits<double>::quiet_NaN();
  }

  std::unique_ptr<kvsidecar::Client> client_;
  v1::ModelLayout layout_;
};

// ------------------------------------------------------------------------------------------------
// 1. CAOTE §13 "Streaming": L=1, Hq=4, H=2, d=4, b=6; prefill 10 tokens in blocks 4+4+2 (each
// block appended, then compressed with that block's queries, also under budget: H2O accumulates
// on every step), then 6 decode steps (inline K/V + the new query). SnapKV w=2, kernel 3.

double StreamQ(int, int h, int t, int c) { return 2.0 * std::sin(1.3 * t + 0.9 * c + 0.7 * h); }
double StreamKv(int, int kv, int g, int t, int c) {
  if (kv == 0) return 1.5 * std::cos(0.8 * t * (c + 1) + 1.1 * g);
  return std::sin(0.6 * t * (c + 2) - 0.4 * g) + 0.5 * std::cos(0.3 * t + c);
}

struct StreamCase {
  std::string name;
  v1::PolicySpec policy;
  std::vector<int> head0;
  std::vector<int> head1;
};

class ConformanceCaoteStreaming : public ConformanceTest {
 protected:
  void RunStream(kvsidecar::Session& session, const StreamCase& test) {
    SCOPED_TRACE(test.name);
    const std::string seq = "stream-" + test.name;
    KVS_ASSERT_OK(Create(session, seq, test.policy, MakeBudget(6)));
    const std::vector<std::vector<int>> blocks = {Range(0, 4), Range(4, 8), Range(8, 10)};
    const std::vector<int> expected_counts = {4, 6, 6};
    for (size_t b = 0; b < blocks.size(); ++b) {
      auto appended = Append(session, seq, blocks[b], StreamKv);
      ASSERT_TRUE(appended.ok()) << appended.status();
      auto compressed =
          CompressWith(session, seq, QueryAttention(layout_, {0}, false, blocks[b], StreamQ));
      ASSERT_TRUE(compressed.ok()) << "block " << b << ": " << compressed.status();
      ASSERT_THAT(compressed->layers(), SizeIs(1));
      EXPECT_EQ(compressed->layers(0).kept(), expected_counts[b]) << "block " << b;
    }
    for (int t = 10; t < 16; ++t) {
      const v1::AttentionInputs attention = QueryAttention(layout_, {0}, false, {t}, StreamQ);
      auto decoded = Decode(session, seq, t, StreamKv, &attention);
      ASSERT_TRUE(decoded.ok()) << "decode " << t << ": " << decoded.status();
      ASSERT_THAT(decoded->items(), SizeIs(1));
      EXPECT_THAT(decoded->items(0).counts(), ElementsAre(6)) << "decode " << t;
      EXPECT_EQ(decoded->items(0).position(), t);
    }
    auto kept = Kept(session, seq);
    ASSERT_TRUE(kept.ok()) << kept.status();
    ASSERT_THAT(*kept, SizeIs(1));
    ASSERT_THAT((*kept)[0], SizeIs(2));
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.head0)) << "head 0";
    EXPECT_THAT((*kept)[0][1], ElementsAreArray(test.head1)) << "head 1";
    ExpectRowsExact(session, seq, StreamKv);
    EXPECT_TRUE(session.ReleaseSequence(seq).ok());
  }
};

TEST_F(ConformanceCaoteStreaming, TableCellsAndPlainBasePolicies) {
  auto session = Attach(1, 2, 4, 4);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  const std::vector<int> h2o0 = {0, 1, 2, 3, 4, 6}, h2o1 = {0, 1, 2, 3, 4, 5};
  const std::vector<int> tova0 = {3, 4, 11, 12, 13, 15}, tova1 = {3, 4, 5, 11, 12, 14};
  const std::vector<int> snap0 = {2, 8, 9, 10, 12, 15}, snap1 = {3, 6, 8, 12, 14, 15};
  const std::vector<StreamCase> cases = {
      {"h2o-none", Caote(P::BASE_H2O, P::VARIANT_NONE), h2o0, h2o1},
      {"h2o-exact", Caote(P::BASE_H2O, P::VARIANT_EXACT), h2o0, h2o1},
      {"h2o-fast", Caote(P::BASE_H2O, P::VARIANT_FAST), h2o0, h2o1},
      {"tova-none", Caote(P::BASE_TOVA, P::VARIANT_NONE), tova0, tova1},
      {"tova-exact",
       Caote(P::BASE_TOVA, P::VARIANT_EXACT),
       {4, 5, 11, 12, 13, 15},
       {3, 5, 11, 12, 14, 15}},
      {"tova-fast", Caote(P::BASE_TOVA, P::VARIANT_FAST), tova0, tova1},
      {"snapkv-none", Caote(P::BASE_SNAPKV, P::VARIANT_NONE), snap0, snap1},
      {"snapkv-exact",
       Caote(P::BASE_SNAPKV, P::VARIANT_EXACT),
       {1, 9, 10, 12, 13, 15},
       {2, 6, 9, 11, 14, 15}},
      {"snapkv-fast",
       Caote(P::BASE_SNAPKV, P::VARIANT_FAST),
       {2, 9, 10, 12, 13, 15},
       {2, 6, 10, 13, 14, 15}},
      // The "none" column is the plain base policy.
      {"plain-h2o", H2o(), h2o0, h2o1},
      {"plain-tova", Tova(), tova0, tova1},
      {"plain-snapkv", SnapKv(2, 3), snap0, snap1},
  };
  for (const StreamCase& test : cases) RunStream(*session, test);
}

TEST_F(ConformanceCaoteStreaming, RssRowsAndH2oWithSinkAndRecent) {
  auto session = Attach(1, 2, 4, 4);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  v1::PolicySpec sink_recent = Caote(P::BASE_H2O, P::VARIANT_EXACT);
  sink_recent.mutable_caote()->set_n_sink(1);
  sink_recent.mutable_caote()->set_n_recent(2);
  const std::vector<StreamCase> cases = {
      {"rss-h2o-fast",
       Caote(P::BASE_H2O, P::VARIANT_FAST, P::GQA_REDUCE_RSS),
       {0, 1, 2, 3, 4, 6},
       {0, 1, 2, 3, 4, 6}},
      {"rss-tova-fast",
       Caote(P::BASE_TOVA, P::VARIANT_FAST, P::GQA_REDUCE_RSS),
       {3, 4, 11, 12, 13, 15},
       {3, 5, 11, 12, 14, 15}},
      {"rss-snapkv-exact",
       Caote(P::BASE_SNAPKV, P::VARIANT_EXACT, P::GQA_REDUCE_RSS),
       {1, 9, 10, 12, 13, 15},
       {2, 6, 10, 13, 14, 15}},
      {"h2o-exact-sink1-recent2", sink_recent, {0, 1, 2, 9, 14, 15}, {0, 1, 2, 7, 14, 15}},
  };
  for (const StreamCase& test : cases) RunStream(*session, test);
}

// ------------------------------------------------------------------------------------------------
// 2. CAOTE TV1/TV2/TV5/TV7 (caote.md §13).

class ConformanceCaote : public ConformanceTest {};

// TV1 values, TV2 keys (the same alpha from q = (sqrt2, 0) at scale 1/sqrt2).
const std::vector<std::array<double, 2>> kTv1Values = {{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}};
const std::vector<std::array<double, 2>> kTv2Keys = {
    {0, 0}, {std::log(2.0), 0}, {std::log(4.0), 0}, {0, 0}, {std::log(2.0), 0}};
const std::vector<double> kTv1Alpha = {.1, .2, .4, .1, .2};

TEST_F(ConformanceCaote, Tv1H2oBaseKeptSetsAndScores) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  const KvFn kv = Vectors(kTv2Keys, kTv1Values);
  struct Case {
    P::Variant variant;
    bool greedy;
    int budget;
    std::vector<int> kept;
  };
  const std::vector<Case> cases = {
      {P::VARIANT_EXACT, false, 1, {4}},         {P::VARIANT_FAST, false, 1, {2}},
      {P::VARIANT_NONE, false, 1, {2}},          {P::VARIANT_EXACT, false, 2, {2, 4}},
      {P::VARIANT_FAST, false, 2, {2, 4}},       {P::VARIANT_NONE, false, 2, {1, 2}},
      {P::VARIANT_EXACT, false, 3, {1, 2, 4}},   {P::VARIANT_FAST, false, 3, {1, 2, 4}},
      {P::VARIANT_NONE, false, 3, {1, 2, 4}},    {P::VARIANT_EXACT, false, 4, {1, 2, 3, 4}},
      {P::VARIANT_FAST, false, 4, {1, 2, 3, 4}}, {P::VARIANT_NONE, false, 4, {0, 1, 2, 4}},
      {P::VARIANT_EXACT, true, 2, {1, 4}},
  };
  int index = 0;
  for (const Case& test : cases) {
    const std::string seq = absl::StrCat("tv1-", index++);
    SCOPED_TRACE(absl::StrCat(seq, " variant ", P::Variant_Name(test.variant), " greedy ",
                              test.greedy, " b=", test.budget));
    v1::PolicySpec policy = Caote(P::BASE_H2O, test.variant);
    policy.mutable_caote()->set_greedy(test.greedy);
    KVS_ASSERT_OK(Create(*session, seq, policy, MakeBudget(test.budget)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 5), kv));
    auto layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const auto alpha = ScoresAttention(layout_, *layout, {0}, false, 1, Table({{kTv1Alpha}}));
    auto compressed = CompressWith(*session, seq, alpha);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.kept));
    ExpectRowsExact(*session, seq, kv);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }

  // The same alpha computed by the sidecar from the query (TV2) gives the same kept sets.
  for (const Case& test : cases) {
    if (test.greedy) continue;
    const std::string seq = absl::StrCat("tv2-", index++);
    SCOPED_TRACE(absl::StrCat(seq, " variant ", P::Variant_Name(test.variant), " b=", test.budget));
    KVS_ASSERT_OK(Create(*session, seq, Caote(P::BASE_H2O, test.variant), MakeBudget(test.budget)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 5), kv));
    auto compressed = CompressWith(
        *session, seq, QueryAttention(layout_, {0}, false, {4}, [](int, int, int, int c) {
          return c == 0 ? std::sqrt(2.0) : 0.0;
        }));
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.kept));
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }

  // Score reports the CAOTE scores themselves.
  const std::vector<std::pair<P::Variant, std::vector<double>>> scores = {
      {P::VARIANT_EXACT, {0.067586, 0.246221, 0.274874, 0.120185, 0.313249}},
      {P::VARIANT_FAST, {0.049690, 0.25, 0.421637, 0.099381, 0.316228}},
  };
  for (const auto& [variant, expected] : scores) {
    const std::string seq = absl::StrCat("tv1-score-", P::Variant_Name(variant));
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(*session, seq, Caote(P::BASE_H2O, variant), MakeBudget(2)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 5), kv));
    auto layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto scored = ScoreWith(
        *session, seq, ScoresAttention(layout_, *layout, {0}, false, 1, Table({{kTv1Alpha}})), 2);
    ASSERT_TRUE(scored.ok()) << scored.status();
    ASSERT_THAT(scored->layers(), SizeIs(1));
    for (int p = 0; p < 5; ++p) {
      EXPECT_NEAR(ScoreAt(scored->layers(0), 1, 0, p), expected[p], 1e-5) << "position " << p;
    }
    EXPECT_THAT(ScoreKept(scored->layers(0), 1)[0], ElementsAre(2, 4));
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

TEST_F(ConformanceCaote, Tv5GqaMeanAndRss) {
  auto session = Attach(1, 1, 2, 2);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  const KvFn kv = Vectors({{1, 0}, {0, 1}, {1, 1}, {0, 0}}, {{1, 0}, {0, 1}, {0, 0}, {-1, 0}});
  const ProbFn raw = Table({{{.7, .1, .1, .1}}, {{.1, .1, .1, .7}}});
  struct Mode {
    P::Variant variant;
    P::GqaReduce reduce;
    std::vector<double> scores;
  };
  const std::vector<Mode> modes = {
      {P::VARIANT_EXACT, P::GQA_REDUCE_MEAN, {0.669992, 0.1, 0.011111, 0.669992}},
      {P::VARIANT_EXACT, P::GQA_REDUCE_RSS, {0.978409, 0.169967, 0.095581, 0.978409}},
      {P::VARIANT_FAST, P::GQA_REDUCE_MEAN, {0.687184, 0.083333, 0.027778, 0.687184}},
      {P::VARIANT_FAST, P::GQA_REDUCE_RSS, {2.40787, 0.117851, 0.039284, 2.40787}},
  };
  int index = 0;
  for (const Mode& mode : modes) {
    for (int budget : {2, 3}) {
      const std::string seq = absl::StrCat("tv5-", index++);
      SCOPED_TRACE(absl::StrCat(seq, " ", P::Variant_Name(mode.variant), " ",
                                P::GqaReduce_Name(mode.reduce), " b=", budget));
      KVS_ASSERT_OK(
          Create(*session, seq, Caote(P::BASE_H2O, mode.variant, mode.reduce), MakeBudget(budget)));
      KVS_ASSERT_OK(Append(*session, seq, Range(0, 4), kv));
      auto layout = session->GetLayout(seq);
      ASSERT_TRUE(layout.ok());
      const auto attention = ScoresAttention(layout_, *layout, {0}, false, 1, raw);
      auto scored = ScoreWith(*session, seq, attention, budget);
      ASSERT_TRUE(scored.ok()) << scored.status();
      for (int p = 0; p < 4; ++p) {
        EXPECT_NEAR(ScoreAt(scored->layers(0), 1, 0, p), mode.scores[p],
                    1e-5 * std::max(1.0, mode.scores[p]))
            << "position " << p;
      }
      auto compressed = CompressWith(*session, seq, attention);
      ASSERT_TRUE(compressed.ok()) << compressed.status();
      auto kept = Kept(*session, seq);
      ASSERT_TRUE(kept.ok());
      EXPECT_THAT((*kept)[0][0], ElementsAreArray(budget == 2 ? std::vector<int>{0, 3}
                                                              : std::vector<int>{0, 1, 3}));
      EXPECT_TRUE(session->ReleaseSequence(seq).ok());
    }
  }
}

TEST_F(ConformanceCaote, Tv7SnapKvBase) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  const KvFn kv = Vectors({{1, 0}, {0, 1}, {1, 1}, {-1, 0}, {0, -1}, {1, -1}},
                          {{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}, {0, 2}});
  const ProbFn rows =
      Table({{{.5, .1, .1, .3, 0, 0}, {.2, .2, .1, .1, .4, 0}, {.1, .3, .2, .1, .1, .2}}});
  struct Case {
    P::Variant variant;
    int budget;
    std::vector<int> kept;
    std::vector<double> prefix_scores;  // positions 0..3 (4 and 5 are the protected window)
  };
  const std::vector<Case> cases = {
      {P::VARIANT_EXACT, 4, {1, 3, 4, 5}, {0.1044, 0.240007, 0.09328, 0.105908}},
      {P::VARIANT_FAST, 4, {0, 1, 4, 5}, {0.126869, 0.186339, 0.104757, 0.094281}},
      {P::VARIANT_NONE, 4, {1, 2, 4, 5}, {}},
      {P::VARIANT_EXACT, 3, {1, 4, 5}, {}},
      {P::VARIANT_FAST, 3, {1, 4, 5}, {}},
      {P::VARIANT_NONE, 3, {1, 4, 5}, {}},
  };
  int index = 0;
  for (const Case& test : cases) {
    const std::string seq = absl::StrCat("tv7-", index++);
    SCOPED_TRACE(absl::StrCat(seq, " ", P::Variant_Name(test.variant), " b=", test.budget));
    KVS_ASSERT_OK(
        Create(*session, seq, Caote(P::BASE_SNAPKV, test.variant), MakeBudget(test.budget)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 3), kv));
    KVS_ASSERT_OK(Append(*session, seq, Range(3, 6), kv));
    auto layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto attention = ScoresAttention(layout_, *layout, {0}, false, 3, rows);
    for (int p : {3, 4, 5}) attention.add_query_positions(p);
    if (!test.prefix_scores.empty()) {
      auto scored = ScoreWith(*session, seq, attention, test.budget);
      ASSERT_TRUE(scored.ok()) << scored.status();
      for (int p = 0; p < 4; ++p) {
        EXPECT_NEAR(ScoreAt(scored->layers(0), 1, 0, p), test.prefix_scores[p], 1e-5)
            << "position " << p;
      }
      EXPECT_THAT(ScoreKept(scored->layers(0), 1)[0], ElementsAreArray(test.kept));
    }
    auto compressed = CompressWith(*session, seq, attention);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.kept));
    ExpectRowsExact(*session, seq, kv);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

// ------------------------------------------------------------------------------------------------
// 3. KeyDiff §12: TV6 SnapKV rows through the snapkv policy, TV1-TV5, TV7 through keydiff.

class ConformanceKeyDiff : public ConformanceTest {};

const std::vector<std::array<double, 2>> kTv4Keys = {{-1, -1}, {1, 0},  {0, 1}, {3, 2},
                                                     {-3, -1}, {-1, 3}, {1, 1}, {2, -1}};
const std::vector<std::array<double, 2>> kTv6Queries = {{1, 0}, {0, 1}, {1, 1}, {0, 1},
                                                        {1, 0}, {1, 1}, {0, 1}, {1, 0}};

TEST_F(ConformanceKeyDiff, Tv6SnapKvBlockwise) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  const KvFn kv = Vectors(kTv4Keys, IndexValues(8));
  const QueryFn query = [](int, int, int p, int c) { return kTv6Queries[p][c]; };
  struct Case {
    int window;
    int kernel;
    std::vector<std::vector<int>> steps;
  };
  const std::vector<Case> cases = {
      {1, 1, {{0, 1}, {1, 2, 3}, {1, 3, 5}, {1, 3, 7}}},
      {2, 3, {{0, 1}, {0, 2, 3}, {2, 4, 5}, {4, 6, 7}}},
  };
  for (const Case& test : cases) {
    const std::string seq = absl::StrCat("tv6-w", test.window, "-k", test.kernel);
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(*session, seq, SnapKv(test.window, test.kernel), MakeBudget(3)));
    for (int block = 0; block < 4; ++block) {
      const std::vector<int> positions = Range(2 * block, 2 * block + 2);
      KVS_ASSERT_OK(Append(*session, seq, positions, kv));
      auto compressed =
          CompressWith(*session, seq, QueryAttention(layout_, {0}, false, positions, query));
      ASSERT_TRUE(compressed.ok()) << "block " << block << ": " << compressed.status();
      auto kept = Kept(*session, seq);
      ASSERT_TRUE(kept.ok());
      EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.steps[block])) << "block " << block;
    }
    ExpectRowsExact(*session, seq, kv);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

const std::vector<std::array<double, 2>> kTv1Keys = {{1, 0},  {2, 0}, {1, 1},
                                                     {1, -1}, {0, 4}, {0, -0.5}};

TEST_F(ConformanceKeyDiff, Tv1Tv2Tv3OneShot) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  using K = v1::KeyDiffParams;
  const KvFn kv = Vectors(kTv1Keys, IndexValues(6));
  struct Case {
    std::string name;
    v1::PolicySpec policy;
    int budget;
    std::vector<int> kept;
  };
  const std::vector<Case> cases = {
      {"tv1-n3", KeyDiff(), 3, {2, 4, 5}},
      {"tv1-n4", KeyDiff(), 4, {2, 3, 4, 5}},
      {"tv1-n5", KeyDiff(), 5, {0, 2, 3, 4, 5}},
      {"tv2-raw", KeyDiff(K::ANCHOR_MEAN_RAW), 3, {3, 4, 5}},
      {"tv3-pairwise", KeyDiff(K::ANCHOR_MEAN_NORMALIZED, K::METRIC_PAIRWISE), 3, {2, 4, 5}},
      {"tv3-median", KeyDiff(K::ANCHOR_MEDIAN_NORMALIZED), 3, {2, 4, 5}},
      {"tv3-dot", KeyDiff(K::ANCHOR_MEAN_RAW, K::METRIC_DOT), 3, {0, 3, 5}},
      {"tv3-euclidean", KeyDiff(K::ANCHOR_MEAN_RAW, K::METRIC_EUCLIDEAN), 3, {3, 4, 5}},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    KVS_ASSERT_OK(Create(*session, test.name, test.policy, MakeBudget(test.budget)));
    KVS_ASSERT_OK(Append(*session, test.name, Range(0, 6), kv));
    auto compressed = session->Compress(test.name);
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    auto kept = Kept(*session, test.name);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.kept));
    ExpectRowsExact(*session, test.name, kv);
    EXPECT_TRUE(session->ReleaseSequence(test.name).ok());
  }
}

TEST_F(ConformanceKeyDiff, Tv4Tv5StrictBlockwisePrefill) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  using K = v1::KeyDiffParams;
  const KvFn kv = Vectors(kTv4Keys, IndexValues(8));
  auto strict = [](int n) {
    v1::Budget budget = MakeBudget(n);
    budget.set_strict(true);
    budget.set_prefill_block_tokens(2);
    return budget;
  };
  struct Case {
    std::string name;
    v1::PolicySpec policy;
    int budget;
    // Held after each Append of a 2-token block (the pending block not evicted yet), then the
    // final flush (Compress).
    std::vector<std::vector<int>> held;
    std::vector<int> final_kept;
  };
  const std::vector<Case> cases = {
      {"tv4", KeyDiff(), 3, {{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 4, 5}, {0, 1, 4, 6, 7}}, {0, 4, 6}},
      {"tv4-raw",
       KeyDiff(K::ANCHOR_MEAN_RAW),
       3,
       {{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 4, 5}, {0, 1, 2, 6, 7}},
       {0, 2, 6}},
      {"tv5-recent",
       KeyDiff(K::ANCHOR_MEAN_NORMALIZED, K::METRIC_COSINE, 0.5f),
       4,
       {{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3, 4, 5}, {0, 1, 4, 5, 6, 7}},
       {0, 4, 6, 7}},
      {"tv5-vanilla",
       KeyDiff(),
       4,
       {{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3, 4, 5}, {0, 1, 3, 4, 6, 7}},
       {0, 3, 4, 6}},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    KVS_ASSERT_OK(Create(*session, test.name, test.policy, strict(test.budget)));
    for (int block = 0; block < 4; ++block) {
      auto appended = Append(*session, test.name, Range(2 * block, 2 * block + 2), kv);
      ASSERT_TRUE(appended.ok()) << "block " << block << ": " << appended.status();
      auto kept = Kept(*session, test.name);
      ASSERT_TRUE(kept.ok());
      EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.held[block])) << "block " << block;
    }
    KVS_ASSERT_OK(session->Compress(test.name));
    auto kept = Kept(*session, test.name);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(test.final_kept));
    ExpectRowsExact(*session, test.name, kv);
    EXPECT_TRUE(session->ReleaseSequence(test.name).ok());
  }
}

// TV4 decode: prefill 6 tokens in blocks of 2 under a strict budget N=3, N_b=2, then tokens 6
// and 7 as decode steps (N_b = 1): [0,1] -> [0,1,2] -> [0,1,4] -> [1,4,6] -> [4,6,7].
class ConformanceKeyDiffDecode : public ConformanceKeyDiff {
 protected:
  void RunDecode(bool flush) {
    auto session = Attach(1, 1, 1, 2);
    ASSERT_NE(session, nullptr);
    const KvFn kv = Vectors(kTv4Keys, IndexValues(8));
    v1::Budget budget = MakeBudget(3);
    budget.set_strict(true);
    budget.set_prefill_block_tokens(2);
    const std::string seq = flush ? "tv4-decode-flush" : "tv4-decode";
    KVS_ASSERT_OK(Create(*session, seq, KeyDiff(), budget));
    for (int block = 0; block < 3; ++block) {
      KVS_ASSERT_OK(Append(*session, seq, Range(2 * block, 2 * block + 2), kv));
    }
    if (flush) {
      KVS_ASSERT_OK(session->Compress(seq));
      auto kept = Kept(*session, seq);
      ASSERT_TRUE(kept.ok());
      EXPECT_THAT((*kept)[0][0], ElementsAre(0, 1, 4));
    }
    const std::vector<std::vector<int>> after = {{1, 4, 6}, {4, 6, 7}};
    for (int t = 6; t < 8; ++t) {
      auto decoded = Decode(*session, seq, t, kv, nullptr);
      ASSERT_TRUE(decoded.ok()) << "decode " << t << ": " << decoded.status();
      EXPECT_THAT(decoded->items(0).counts(), ElementsAre(3));
      auto kept = Kept(*session, seq);
      ASSERT_TRUE(kept.ok());
      EXPECT_THAT((*kept)[0][0], ElementsAreArray(after[t - 6])) << "decode " << t;
    }
    ExpectRowsExact(*session, seq, kv);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
};

// With an explicit flush (Compress) after the prefill.
TEST_F(ConformanceKeyDiffDecode, Tv4DecodeAfterFlush) { RunDecode(true); }

// keydiff.md §9 "Final flush: first decode append": under a strict budget the DecodeStep's
// inline token is appended only after the pending block is evicted down to N (the sequence never
// holds more than N + N_b), so the kept sets are the same as with the explicit flush.
TEST_F(ConformanceKeyDiffDecode, Tv4DecodeFlushedByFirstDecodeAppend) { RunDecode(false); }

TEST_F(ConformanceKeyDiff, Tv7PerHeadIndependence) {
  auto session = Attach(1, 2, 2, 2);
  ASSERT_NE(session, nullptr);
  const KvFn kv = [](int, int kv, int head, int position, int c) -> double {
    if (kv == 1) return c == 0 ? position : head;
    return kTv1Keys[head == 0 ? position : 5 - position][c];
  };
  KVS_ASSERT_OK(Create(*session, "tv7", KeyDiff(), MakeBudget(3)));
  KVS_ASSERT_OK(Append(*session, "tv7", Range(0, 6), kv));
  KVS_ASSERT_OK(session->Compress("tv7"));
  auto kept = Kept(*session, "tv7");
  ASSERT_TRUE(kept.ok());
  EXPECT_THAT((*kept)[0][0], ElementsAre(2, 4, 5));
  EXPECT_THAT((*kept)[0][1], ElementsAre(0, 1, 2));
  ExpectRowsExact(*session, "tv7", kv);
}

// ------------------------------------------------------------------------------------------------
// 4. D2O TV3-TV6 (d2o.md §11): L=1, H=Hq=1, d=2, T=1, recent_frac 0.5, beta 0.7, B=5.

class ConformanceD2o : public ConformanceTest {};

std::vector<std::array<double, 2>> D2oKeys() {
  std::vector<std::array<double, 2>> keys = {{1, 0}, {4, 1},   {0, 1},  {-1, 0},
                                             {2, 0}, {-1, -1}, {0, -1}, {1, -1}};
  keys.push_back({0, -2});  // position 8 (TV5)
  keys.push_back({2, 1});   // position 9 (TV6)
  return keys;
}
std::vector<std::array<double, 2>> D2oValues() { return IndexValues(10); }

void ExpectRowNear(const std::vector<double>& row, std::vector<double> expected,
                   const std::string& what) {
  ASSERT_EQ(row.size(), expected.size()) << what;
  for (size_t c = 0; c < row.size(); ++c)
    EXPECT_NEAR(row[c], expected[c], 1e-5) << what << " c " << c;
}

TEST_F(ConformanceD2o, Tv3Tv4PrefillMergeThenTv5Tv6Decode) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  const KvFn kv = Vectors(D2oKeys(), D2oValues());
  const std::vector<double> column_sums = {5, .2, .9, .9, .9, .1, .3, .6};
  for (auto weighting :
       {v1::D2oParams::MERGE_WEIGHTING_PAPER, v1::D2oParams::MERGE_WEIGHTING_CODE}) {
    const std::string seq = absl::StrCat("d2o-", v1::D2oParams::MergeWeighting_Name(weighting));
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(*session, seq, D2o(weighting), MakeBudget(5)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 8), kv));
    auto layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto compressed = CompressWith(
        *session, seq, ScoresAttention(layout_, *layout, {0}, false, 1, Table({{column_sums}})));
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    ASSERT_THAT(compressed->layers(), SizeIs(1));
    EXPECT_EQ(compressed->layers(0).kept(), 5);
    EXPECT_EQ(compressed->layers(0).evicted(), 3);
    EXPECT_EQ(compressed->layers(0).merged(), 2);  // tokens 1 and 4 into 0; 5 dropped
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAre(0, 2, 3, 6, 7));
    auto exported = session->Export(seq);
    ASSERT_TRUE(exported.ok()) << exported.status();
    const bool paper = weighting == v1::D2oParams::MERGE_WEIGHTING_PAPER;
    ExpectRowNear(
        ExportedRow(*exported, 0, 0, 0, 0),
        paper ? std::vector<double>{2.316829, 0.326732} : std::vector<double>{2.293523, 0.323381},
        "k0'");
    ExpectRowNear(
        ExportedRow(*exported, 0, 1, 0, 0),
        paper ? std::vector<double>{1.673268, 1} : std::vector<double>{1.656714, 0.990048}, "v0'");
    for (int p : {2, 3, 6, 7}) {
      ExpectRowNear(ExportedRow(*exported, 0, 0, 0, p), {D2oKeys()[p][0], D2oKeys()[p][1]},
                    absl::StrCat("k", p));
      ExpectRowNear(ExportedRow(*exported, 0, 1, 0, p), {static_cast<double>(p), 1},
                    absl::StrCat("v", p));
    }
    if (!paper) {
      EXPECT_TRUE(session->ReleaseSequence(seq).ok());
      continue;
    }

    // TV5: pos 8, p over [0,2,3,6,7,8] = [.5,.1,.1,.1,.1,.1]: 6 evicted, merged into 8.
    const std::map<int, double> p5 = {{0, .5}, {2, .1}, {3, .1}, {6, .1}, {7, .1}, {8, .1}};
    layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto attention5 = ScoresAttention(
        layout_, *layout, {0}, false, 1, [&](int, int, int, int p) { return p5.at(p); }, 8);
    auto decoded = Decode(*session, seq, 8, kv, &attention5);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_THAT(decoded->items(0).counts(), ElementsAre(5));
    EXPECT_THAT(decoded->items(0).evicted_positions(), ElementsAre(6));
    EXPECT_EQ(decoded->items(0).merged(), 1);
    EXPECT_EQ(decoded->items(0).position(), 8);
    kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAre(0, 2, 3, 7, 8));
    exported = session->Export(seq);
    ASSERT_TRUE(exported.ok());
    ExpectRowNear(ExportedRow(*exported, 0, 0, 0, 8), {0, -1.5}, "k8'");
    ExpectRowNear(ExportedRow(*exported, 0, 1, 0, 8), {7, 1}, "v8'");
    ExpectRowNear(ExportedRow(*exported, 0, 0, 0, 0), {2.316829, 0.326732}, "k0' after TV5");

    // TV6: pos 9, p over [0,2,3,7,8,9] = [.4,.05,.3,.05,.1,.1]: 7 evicted and dropped.
    const std::map<int, double> p6 = {{0, .4}, {2, .05}, {3, .3}, {7, .05}, {8, .1}, {9, .1}};
    layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto attention6 = ScoresAttention(
        layout_, *layout, {0}, false, 1, [&](int, int, int, int p) { return p6.at(p); }, 9);
    decoded = Decode(*session, seq, 9, kv, &attention6);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_THAT(decoded->items(0).evicted_positions(), ElementsAre(7));
    EXPECT_EQ(decoded->items(0).merged(), 0);
    kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAre(0, 2, 3, 8, 9));
    exported = session->Export(seq);
    ASSERT_TRUE(exported.ok());
    ExpectRowNear(ExportedRow(*exported, 0, 0, 0, 8), {0, -1.5}, "k8' after TV6");
    ExpectRowNear(ExportedRow(*exported, 0, 0, 0, 9), {2, 1}, "k9");
    ExpectRowNear(ExportedRow(*exported, 0, 1, 0, 9), {9, 1}, "v9");
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

// ------------------------------------------------------------------------------------------------
// 5. CAKE TV1/TV3 (cascade and one-shot) and TV6 (decode), cake.md §11.

class ConformanceCake : public ConformanceTest {};

const std::vector<std::vector<std::vector<double>>> kCakeRows = {
    {{.40, .10, .10, .10, .10, .00, .20, .00}, {.20, .10, .10, .10, .10, .20, .10, .10}},
    {{.15, .15, .15, .15, .10, .10, .20, .00}, {.10, .20, .10, .20, .10, .10, .10, .10}},
    {{.70, .00, .00, .00, .00, .10, .20, .00}, {.80, .00, .00, .00, .00, .00, .10, .10}},
};

ProbFn CakeProbs() {
  return [](int layer, int, int row, int position) { return kCakeRows[layer][row][position]; };
}

KvFn CakeKv() {
  return [](int layer, int kv, int, int position, int c) -> double {
    return kv == 0 ? std::cos(0.7 * position + 0.3 * layer + c) : position + 0.1 * layer + c;
  };
}

std::vector<int> Counts(const v1::GetLayoutResponse& layout) {
  std::vector<int> counts;
  for (const auto& l : layout.layers()) counts.push_back(l.count());
  return counts;
}

// Final kept sets per kernel size (TV1): {0,1,2,3,5,6,7}, {1,6,7}, {6,7} for k=1 (ties among 1-4
// keep 1,2,3; 1 vs 3 keeps 1) and {0,1,2,3,4,6,7}, {2,6,7}, {6,7} for k=5.
std::vector<std::vector<int>> CakeTv1Kept(int kernel) {
  if (kernel == 1) return {{0, 1, 2, 3, 5, 6, 7}, {1, 6, 7}, {6, 7}};
  return {{0, 1, 2, 3, 4, 6, 7}, {2, 6, 7}, {6, 7}};
}

class ConformanceCakeCascade : public ConformanceCake {
 protected:
  // TV3: one Compress per layer (attention.layers = [m]); stage budgets (non-window) [6], [6,1],
  // [5,1,0], so the held counts are b + W; the final kept sets equal the one-shot ones.
  void RunCascade(kvsidecar::Session& session, int kernel) {
    const std::string seq = absl::StrCat("cake-cascade-k", kernel);
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(session, seq, Cake(kernel), MakeBudget(4)));
    KVS_ASSERT_OK(Append(session, seq, Range(0, 8), CakeKv()));
    const std::vector<std::vector<int>> stage_counts = {{8, 8, 8}, {8, 3, 8}, {7, 3, 2}};
    for (int m = 0; m < 3; ++m) {
      auto layout = session.GetLayout(seq);
      ASSERT_TRUE(layout.ok());
      auto attention = ScoresAttention(layout_, *layout, {m}, true, 2, CakeProbs());
      attention.add_query_positions(6);
      attention.add_query_positions(7);
      auto compressed = CompressWith(session, seq, attention);
      ASSERT_TRUE(compressed.ok()) << "stage " << m << ": " << compressed.status();
      layout = session.GetLayout(seq);
      ASSERT_TRUE(layout.ok());
      EXPECT_THAT(Counts(*layout), ElementsAreArray(stage_counts[m])) << "counts after stage " << m;
      // LayerLayout.budget is "tokens this layer may keep (after allocation)": b_l + W.
      for (int l = 0; l <= m; ++l) {
        EXPECT_EQ(layout->layers(l).budget(), stage_counts[m][l])
            << "LayerLayout.budget after stage " << m << " of layer " << l;
      }
    }
    auto kept = Kept(session, seq);
    ASSERT_TRUE(kept.ok());
    const auto sets = CakeTv1Kept(kernel);
    for (int l = 0; l < 3; ++l) {
      EXPECT_THAT((*kept)[l][0], ElementsAreArray(sets[l])) << "layer " << l;
    }
    ExpectRowsExact(session, seq, CakeKv());
    EXPECT_TRUE(session.ReleaseSequence(seq).ok());
  }
};

TEST_F(ConformanceCakeCascade, Tv3CascadeKernel1) {
  auto session = Attach(3, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  RunCascade(*session, 1);
}

TEST_F(ConformanceCakeCascade, Tv3CascadeKernel5) {
  auto session = Attach(3, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  RunCascade(*session, 5);
}

// TV3 as a cascading prefill commits it: layer m's prompt (the real positions 0..7, the same
// in every layer) is appended only when the cascade reaches it, then compressed with its window
// attention. The final kept sets are TV1's, and a layer still refuses positions it already holds.
TEST_F(ConformanceCakeCascade, Tv3CascadeCommittedLayerByLayer) {
  auto session = Attach(3, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  for (int kernel : {1, 5}) {
    const std::string seq = absl::StrCat("cake-layer-by-layer-k", kernel);
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(*session, seq, Cake(kernel), MakeBudget(4)));
    for (int m = 0; m < 3; ++m) {
      // [1 layer][2][H][8][D] of layer m.
      std::string payload;
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < layout_.num_kv_heads(); ++head) {
          for (int position : Range(0, 8)) {
            for (int c = 0; c < layout_.head_dim(); ++c) {
              PutFloat(payload, CakeKv()(m, kv, head, position, c));
            }
          }
        }
      }
      kvsidecar::AppendSegment segment;
      segment.sequence_id = seq;
      segment.num_tokens = 8;
      segment.positions = Range(0, 8);
      segment.layers = {m};
      segment.payload =
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
      auto appended = session->Append(segment);
      ASSERT_TRUE(appended.ok()) << "layer " << m << ": " << appended.status();
      auto layout = session->GetLayout(seq);
      ASSERT_TRUE(layout.ok());
      auto attention = ScoresAttention(layout_, *layout, {m}, true, 2, CakeProbs());
      attention.add_query_positions(6);
      attention.add_query_positions(7);
      auto compressed = CompressWith(*session, seq, attention);
      ASSERT_TRUE(compressed.ok()) << "stage " << m << ": " << compressed.status();
    }
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    const auto sets = CakeTv1Kept(kernel);
    for (int l = 0; l < 3; ++l) {
      EXPECT_THAT((*kept)[l][0], ElementsAreArray(sets[l])) << "layer " << l;
    }
    ExpectRowsExact(*session, seq, CakeKv());
    // Positions still increase within a layer: layer 0 holds 7 already.
    auto again = session->Reserve(seq, 1, std::vector<int32_t>{7}, std::vector<int32_t>{0});
    EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(MessageOf(again.status()), ::testing::HasSubstr("already appended to layer 0"));
    // Every layer holds 0..7: the next decode token continues at 8 in all of them.
    auto layout = session->GetLayout(seq, {}, /*omit_positions=*/true);
    ASSERT_TRUE(layout.ok());
    EXPECT_EQ(layout->next_position(), 8);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

TEST_F(ConformanceCake, Tv1OneShot) {
  auto session = Attach(3, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  for (int kernel : {1, 5}) {
    // Every layer's window in one Compress.
    const std::string seq = absl::StrCat("cake-oneshot-k", kernel);
    SCOPED_TRACE(seq);
    KVS_ASSERT_OK(Create(*session, seq, Cake(kernel), MakeBudget(4)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 8), CakeKv()));
    auto layout = session->GetLayout(seq);
    ASSERT_TRUE(layout.ok());
    auto compressed = CompressWith(
        *session, seq, ScoresAttention(layout_, *layout, {0, 1, 2}, false, 2, CakeProbs()));
    ASSERT_TRUE(compressed.ok()) << compressed.status();
    ASSERT_THAT(compressed->layers(), SizeIs(3));
    EXPECT_EQ(compressed->layers(0).kept(), 7);
    EXPECT_EQ(compressed->layers(1).kept(), 3);
    EXPECT_EQ(compressed->layers(2).kept(), 2);
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    const auto sets = CakeTv1Kept(kernel);
    for (int l = 0; l < 3; ++l)
      EXPECT_THAT((*kept)[l][0], ElementsAreArray(sets[l])) << "layer " << l;
    ExpectRowsExact(*session, seq, CakeKv());
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

TEST_F(ConformanceCake, Tv6Decode) {
  auto session = Attach(1, 1, 2, 2);
  ASSERT_NE(session, nullptr);
  const KvFn kv = Vectors({{1, 0}, {0, 1}, {0, 2}, {1, -1}, {1, 1}}, IndexValues(5));
  const QueryFn decode_query = [](int, int q, int, int c) {
    return c == 0 ? 0.0 : (q == 0 ? 1.0 : 2.0);
  };
  const std::map<int, std::vector<int>> expected = {{1, {1, 2, 3, 4}}, {5, {0, 1, 3, 4}}};
  for (const auto& [kernel, positions] : expected) {
    const std::string seq = absl::StrCat("cake-decode-k", kernel);
    SCOPED_TRACE(seq);
    // C = 4 = b + W: the 4-token prompt fits (no prefill eviction), decode budget b = C - W = 2.
    KVS_ASSERT_OK(Create(*session, seq, Cake(kernel), MakeBudget(4)));
    KVS_ASSERT_OK(Append(*session, seq, Range(0, 4), kv));
    // The prompt's window queries (positions 2, 3): the cascade runs, nothing is evicted.
    auto prefill = CompressWith(
        *session, seq, QueryAttention(layout_, {0}, false, {2, 3}, [](int, int q, int p, int c) {
          return (p + q + c) % 2 == 0 ? 1.0 : -0.5;
        }));
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    EXPECT_EQ(prefill->layers(0).kept(), 4);
    const v1::AttentionInputs attention = QueryAttention(layout_, {0}, false, {4}, decode_query);
    auto decoded = Decode(*session, seq, 4, kv, &attention);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_THAT(decoded->items(0).counts(), ElementsAre(4));
    auto kept = Kept(*session, seq);
    ASSERT_TRUE(kept.ok());
    EXPECT_THAT((*kept)[0][0], ElementsAreArray(positions));
    ExpectRowsExact(*session, seq, kv);
    EXPECT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

// ------------------------------------------------------------------------------------------------
// 6. Score is a dry run: it reports what the next Compress keeps and changes nothing.

class ConformanceScoreDryRun : public ConformanceTest {};

TEST_F(ConformanceScoreDryRun, H2oScoreChangesNothingAndPredictsCompress) {
  auto session = Attach(1, 1, 1, 2);
  ASSERT_NE(session, nullptr);
  const KvFn kv = Vectors(kTv2Keys, kTv1Values);
  KVS_ASSERT_OK(Create(*session, "dry", H2o(), MakeBudget(2)));
  KVS_ASSERT_OK(Append(*session, "dry", Range(0, 5), kv));
  auto before = session->GetLayout("dry");
  ASSERT_TRUE(before.ok());
  auto exported_before = session->Export("dry");
  ASSERT_TRUE(exported_before.ok());

  // A Score whose attention would favour 3 and 4: if it leaked into the accumulators, the
  // Compress below (attention favouring 1 and 2) would keep 3 and 4.
  auto decoy = ScoresAttention(layout_, *before, {0}, false, 1, Table({{{0, 0, 0, 9, 9}}}));
  auto scored = ScoreWith(*session, "dry", decoy, 2);
  ASSERT_TRUE(scored.ok()) << scored.status();
  ASSERT_THAT(scored->layers(), SizeIs(1));
  EXPECT_EQ(scored->layers(0).kept(), 2);
  EXPECT_THAT(ScoreKept(scored->layers(0), 1)[0], ElementsAre(3, 4));

  const auto real = ScoresAttention(layout_, *before, {0}, false, 1, Table({{kTv1Alpha}}));
  scored = ScoreWith(*session, "dry", real, 2);
  ASSERT_TRUE(scored.ok()) << scored.status();
  const auto predicted = ScoreKept(scored->layers(0), 1)[0];
  EXPECT_THAT(predicted, ElementsAre(1, 2));

  auto after = session->GetLayout("dry");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->DebugString(), before->DebugString());
  auto exported_after = session->Export("dry");
  ASSERT_TRUE(exported_after.ok());
  EXPECT_TRUE(exported_after->payload == exported_before->payload);

  auto compressed = CompressWith(*session, "dry", real);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  auto kept = Kept(*session, "dry");
  ASSERT_TRUE(kept.ok());
  EXPECT_THAT((*kept)[0][0], ElementsAreArray(predicted));
}

TEST_F(ConformanceScoreDryRun, CaoteSnapKvScoreMatchesCompressOnStream) {
  // On the CAOTE streaming stream after two prefill blocks: Score with the third block's queries
  // names exactly the kept set the Compress with the same queries then makes.
  auto session = Attach(1, 2, 4, 4);
  ASSERT_NE(session, nullptr);
  using P = v1::CaoteParams;
  KVS_ASSERT_OK(
      Create(*session, "dry-stream", Caote(P::BASE_SNAPKV, P::VARIANT_EXACT), MakeBudget(6)));
  for (const auto& block : {Range(0, 4), Range(4, 8)}) {
    KVS_ASSERT_OK(Append(*session, "dry-stream", block, StreamKv));
    KVS_ASSERT_OK(
        CompressWith(*session, "dry-stream", QueryAttention(layout_, {0}, false, block, StreamQ)));
  }
  KVS_ASSERT_OK(Append(*session, "dry-stream", Range(8, 10), StreamKv));
  auto before = session->GetLayout("dry-stream");
  ASSERT_TRUE(before.ok());
  const auto attention = QueryAttention(layout_, {0}, false, Range(8, 10), StreamQ);
  auto scored = ScoreWith(*session, "dry-stream", attention, 6);
  ASSERT_TRUE(scored.ok()) << scored.status();
  ASSERT_THAT(scored->layers(), SizeIs(1));
  EXPECT_EQ(scored->layers(0).kept(), 6);
  const auto predicted = ScoreKept(scored->layers(0), 2);
  auto after = session->GetLayout("dry-stream");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->DebugString(), before->DebugString());
  auto compressed = CompressWith(*session, "dry-stream", attention);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  auto kept = Kept(*session, "dry-stream");
  ASSERT_TRUE(kept.ok());
  EXPECT_THAT((*kept)[0][0], ElementsAreArray(predicted[0]));
  EXPECT_THAT((*kept)[0][1], ElementsAreArray(predicted[1]));
}

}  // namespace
}  // namespace kvs_e2e
