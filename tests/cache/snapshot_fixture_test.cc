// Snapshots written by an earlier build must restore in this one: tests/cache/fixtures/ holds one
// encoded snapshot per policy as the first snapshot format ("KVSSNAP1") wrote it, with every
// parameter away from its default and every piece of per-layer policy state filled. Each fixture
// must decode to exactly the snapshot Sample() builds, and build a working policy.
//
// The fixtures were written by this test with KVS_WRITE_SNAPSHOT_FIXTURES=<dir> set, by the build
// that still wrote the first format; they are never rewritten, since what they pin is the old
// format.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "cache/sequence_snapshot.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

// Policies the first format could record (it had no field for OmniKV's parameters).
const char* const kFixturePolicies[] = {"streaming_llm", "keydiff", "h2o", "tova",
                                        "snapkv",        "cake",    "d2o", "caote"};

// A resolved configuration of `name` with its parameters set away from their defaults.
PolicyConfig SampleConfig(const std::string& name) {
  PolicyConfig p;
  p.name = name;
  if (name == "streaming_llm") {
    p.streaming_llm.n_sink = 3;
  } else if (name == "keydiff") {
    p.keydiff.anchor = KeyDiffAnchor::kMedianNormalized;
    p.keydiff.metric = KeyDiffMetric::kDot;
    p.keydiff.recent_fraction = 0.25f;
  } else if (name == "h2o") {
    p.h2o.n_sink = 2;
    p.h2o.n_recent = 5;
  } else if (name == "tova") {
    p.tova.all_heads = true;
  } else if (name == "snapkv") {
    p.snapkv = {16, 3, Pooling::kMax};
  } else if (name == "cake") {
    p.cake = {8, 0.5f, 2.0f, 100.0f, 3, true};
  } else if (name == "d2o") {
    p.d2o.rho = 0.5f;
    p.d2o.recent_frac = 0.125f;
    p.d2o.n_sink = 2;
    p.d2o.beta = 0.5f;
    p.d2o.density_mode = D2oDensityMode::kRaw;
    p.d2o.min_ratio = 0.05f;
    p.d2o.max_ratio = 0.9f;
    p.d2o.full_cache_layers = {1};
    p.d2o.merge_weighting = D2oMergeWeighting::kCode;
    p.d2o.threshold_scope = D2oThresholdScope::kLayer;
  } else if (name == "omnikv") {
    p.omnikv.filter_layers = {0};
    p.omnikv.wait_layers = 1;
    p.omnikv.selected_tokens = 2;
    p.omnikv.selector = OmniKvSelector::kExp;
    p.omnikv.window = 4;
    p.allocator.kind = LayerAllocatorKind::kUniform;
  } else if (name == "caote") {
    p.caote.base = CaoteBase::kCake;
    p.caote.variant = CaoteVariant::kFast;
    p.caote.gqa_reduce = GqaReduce::kRss;
    p.caote.eps = 1e-5f;
    p.caote.n_sink = 1;
    p.caote.n_recent = 2;
    p.caote.greedy = true;
    p.caote.snapkv = {12, 3, Pooling::kMax};
    p.caote.cake = {6, 0.75f, 1.5f, 50.0f, 3, false};
  }
  if (name != "omnikv") p.allocator.kind = LayerAllocatorKind::kPyramidKv;
  p.allocator.min_layer_tokens = 2;
  p.allocator.pyramid_beta = 10.0f;
  absl::StatusOr<PolicyConfig> resolved = ResolvePolicyConfig(p);
  EXPECT_TRUE(resolved.ok()) << name << ": " << resolved.status();
  return resolved.ok() ? *resolved : p;
}

// A spilled sequence of two layers (2 kv heads, 4 query heads) holding 3 and 2 tokens.
SequenceSnapshot Sample(const std::string& name) {
  SequenceSnapshot s;
  s.id = absl::StrCat("seq-", name);
  s.layout.num_layers = 2;
  s.layout.num_kv_heads = 2;
  s.layout.num_q_heads = 4;
  s.layout.head_dim = 8;
  s.layout.dtype = DType::kBFloat16;
  s.layout.block_tokens = 16;
  s.policy = SampleConfig(name);
  s.budget.tokens_per_layer = 3;
  s.budget.strict = true;
  s.budget.prefill_block_tokens = 4;
  s.budget.per_layer_tokens = {3, 2};
  s.created = absl::FromUnixNanos(1700000000123456789);
  s.last_used = absl::FromUnixNanos(1700000001987654321);
  s.next_position = 7;
  s.version = 11;
  s.last_committed = 5;
  s.last_cancelled = 4;
  s.layers.resize(2);
  for (int32_t l = 0; l < 2; ++l) {
    SequenceSnapshot::Layer& layer = s.layers[l];
    layer.count = 3 - l;
    layer.appended = 7 + l;
    layer.positions = l == 0 ? std::vector<std::vector<int32_t>>{{0, 4, 6}, {1, 5, 6}}
                             : std::vector<std::vector<int32_t>>{{0, 6}, {5, 6}};
    layer.allocated = 3 - l;
    LayerPolicyState& st = layer.state;
    for (int32_t i = 0; i < 4 * layer.count; ++i) st.accumulated.push_back(0.25f * (i + 1) + l);
    for (int32_t i = 0; i < 2 * layer.count; ++i) st.indicator.push_back(0.5f * (i + 2) - l);
    st.threshold = {0.125f + l, 0.375f};
    st.preference = 1.75 + l;
    st.measured = true;
    st.frozen_budget = 3 - l;
    st.frozen_for = 3;
  }
  return s;
}

std::string FixturePath(const std::string& dir, const std::string& name) {
  return absl::StrCat(dir, "/snapshot_v1_", name, ".bin");
}

// Writes the fixtures with this build's encoder; only when asked (see the file comment).
TEST(SnapshotFixtureTest, WriteFixturesWhenAsked) {
  const char* dir = std::getenv("KVS_WRITE_SNAPSHOT_FIXTURES");
  if (dir == nullptr) GTEST_SKIP() << "KVS_WRITE_SNAPSHOT_FIXTURES is not set";
  for (const char* name : kFixturePolicies) {
    std::ofstream out(FixturePath(dir, name), std::ios::binary | std::ios::trunc);
    const std::string bytes = EncodeSnapshot(Sample(name));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << name;
  }
}

std::string ReadFixture(const std::string& name) {
  std::ifstream in(FixturePath(KVS_SNAPSHOT_FIXTURE_DIR, name), std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing fixture for " << name;
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

void ExpectSameState(const LayerPolicyState& got, const LayerPolicyState& want) {
  EXPECT_EQ(got.accumulated, want.accumulated);
  EXPECT_EQ(got.indicator, want.indicator);
  EXPECT_EQ(got.threshold, want.threshold);
  EXPECT_EQ(got.preference, want.preference);
  EXPECT_EQ(got.measured, want.measured);
  EXPECT_EQ(got.frozen_budget, want.frozen_budget);
  EXPECT_EQ(got.frozen_for, want.frozen_for);
}

TEST(SnapshotFixtureTest, FirstFormatFixturesRestoreUnchanged) {
  for (const char* name : kFixturePolicies) {
    SCOPED_TRACE(name);
    const std::string bytes = ReadFixture(name);
    ASSERT_EQ(bytes.substr(0, 8), "KVSSNAP1");
    absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    const SequenceSnapshot want = Sample(name);
    EXPECT_EQ(decoded->id, want.id);
    EXPECT_EQ(decoded->layout.num_layers, want.layout.num_layers);
    EXPECT_EQ(decoded->layout.num_q_heads, want.layout.num_q_heads);
    EXPECT_EQ(decoded->layout.dtype, want.layout.dtype);
    EXPECT_EQ(decoded->policy.name, want.policy.name);
    EXPECT_EQ(decoded->budget.per_layer_tokens, want.budget.per_layer_tokens);
    EXPECT_EQ(decoded->created, want.created);
    EXPECT_EQ(decoded->last_used, want.last_used);
    EXPECT_EQ(decoded->next_position, want.next_position);
    EXPECT_EQ(decoded->version, want.version);
    EXPECT_EQ(decoded->last_committed, want.last_committed);
    EXPECT_EQ(decoded->last_cancelled, want.last_cancelled);
    ASSERT_EQ(decoded->layers.size(), want.layers.size());
    for (size_t l = 0; l < want.layers.size(); ++l) {
      EXPECT_EQ(decoded->layers[l].count, want.layers[l].count);
      EXPECT_EQ(decoded->layers[l].appended, want.layers[l].appended);
      EXPECT_EQ(decoded->layers[l].positions, want.layers[l].positions);
      EXPECT_EQ(decoded->layers[l].allocated, want.layers[l].allocated);
      ExpectSameState(decoded->layers[l].state, want.layers[l].state);
    }
    // Every field, parameters included: this build's encoding of both must agree.
    EXPECT_EQ(EncodeSnapshot(*decoded), EncodeSnapshot(want));
    absl::StatusOr<std::unique_ptr<Policy>> policy = MakePolicy(decoded->policy);
    EXPECT_TRUE(policy.ok()) << policy.status();
  }
}

// The current format round-trips every policy, OmniKV's parameters included (the first format
// had no field for them, so a spilled OmniKV sequence came back without its filter layers).
TEST(SnapshotFixtureTest, CurrentFormatRoundTripsEveryPolicy) {
  for (const std::string& name : KnownPolicyNames()) {
    SCOPED_TRACE(name);
    const SequenceSnapshot want = Sample(name);
    const std::string bytes = EncodeSnapshot(want);
    EXPECT_EQ(bytes.substr(0, 8), "KVSSNAP2");
    absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->policy.omnikv.filter_layers, want.policy.omnikv.filter_layers);
    EXPECT_EQ(decoded->policy.omnikv.selector, want.policy.omnikv.selector);
    EXPECT_EQ(decoded->policy.tova.all_heads, want.policy.tova.all_heads);
    for (size_t l = 0; l < want.layers.size(); ++l) {
      ExpectSameState(decoded->layers[l].state, want.layers[l].state);
    }
    EXPECT_EQ(EncodeSnapshot(*decoded), bytes);
    absl::StatusOr<std::unique_ptr<Policy>> policy = MakePolicy(decoded->policy);
    EXPECT_TRUE(policy.ok()) << policy.status();
  }
}

// A field a later build adds is skipped by this one: the snapshot still restores.
TEST(SnapshotFixtureTest, FieldsOfALaterBuildAreSkipped) {
  const SequenceSnapshot want = Sample("d2o");
  std::string bytes = EncodeSnapshot(want);
  FieldWriter extra;
  extra.F32s(99, {1.0f, 2.0f});
  bytes += extra.bytes();
  absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(EncodeSnapshot(*decoded), EncodeSnapshot(want));
}

}  // namespace
}  // namespace kvs
