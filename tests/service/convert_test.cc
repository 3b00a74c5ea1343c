#include "service/convert.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Expects `status` to have `code` and a message containing `text`.
#define EXPECT_STATUS(status_expr, expected_code, text)            \
  do {                                                             \
    const absl::Status s_ = (status_expr);                         \
    EXPECT_EQ(s_.code(), absl::StatusCode::expected_code) << s_;   \
    EXPECT_THAT(std::string(s_.message()), HasSubstr(text)) << s_; \
  } while (0)

v1::ModelLayout GoodLayout() {
  v1::ModelLayout layout;
  layout.set_num_layers(4);
  layout.set_num_kv_heads(2);
  layout.set_num_q_heads(8);
  layout.set_head_dim(16);
  layout.set_dtype(v1::DTYPE_FLOAT16);
  return layout;
}

ModelLayout Layout() { return *LayoutFromProto(GoodLayout()); }

// ---- Layout ------------------------------------------------------------------------------------

TEST(ConvertLayoutTest, GoodLayoutResolvesDefaultBlockTokens) {
  auto layout = LayoutFromProto(GoodLayout());
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_layers, 4);
  EXPECT_EQ(layout->num_kv_heads, 2);
  EXPECT_EQ(layout->num_q_heads, 8);
  EXPECT_EQ(layout->head_dim, 16);
  EXPECT_EQ(layout->dtype, DType::kFloat16);
  EXPECT_EQ(layout->block_tokens, 16);
  v1::ModelLayout back;
  LayoutToProto(*layout, &back);
  EXPECT_EQ(back.block_tokens(), 16);
  EXPECT_EQ(back.dtype(), v1::DTYPE_FLOAT16);
  EXPECT_EQ(back.num_q_heads(), 8);
}

TEST(ConvertLayoutTest, EveryDTypeRoundTrips) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32}) {
    auto converted = DTypeFromProto(dtype, "layout.dtype");
    ASSERT_TRUE(converted.ok());
    EXPECT_EQ(DTypeToProto(*converted), dtype);
  }
}

TEST(ConvertLayoutTest, DTypeUnspecifiedOrUnknownIsInvalid) {
  v1::ModelLayout layout = GoodLayout();
  layout.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_STATUS(LayoutFromProto(layout).status(), kInvalidArgument, "layout.dtype must be set");
  layout.set_dtype(static_cast<v1::DType>(42));
  EXPECT_STATUS(LayoutFromProto(layout).status(), kInvalidArgument,
                "layout.dtype has unknown value 42");
}

TEST(ConvertLayoutTest, EachShapeFieldIsNamed) {
  struct Case {
    void (*mutate)(v1::ModelLayout*);
    const char* text;
  } cases[] = {
      {[](v1::ModelLayout* l) { l->set_num_layers(0); }, "layout.num_layers must be in [1, 1024]"},
      {[](v1::ModelLayout* l) { l->set_num_layers(1025); }, "layout.num_layers"},
      {[](v1::ModelLayout* l) { l->set_num_kv_heads(-1); }, "layout.num_kv_heads"},
      {[](v1::ModelLayout* l) { l->set_num_q_heads(0); }, "layout.num_q_heads"},
      {[](v1::ModelLayout* l) { l->set_num_q_heads(3); },
       "layout.num_q_heads (3) must be a multiple"},
      {[](v1::ModelLayout* l) { l->set_head_dim(0); },
       "layout.head_dim must be in [1, 4096], got 0"},
      {[](v1::ModelLayout* l) { l->set_head_dim(5000); }, "layout.head_dim"},
      {[](v1::ModelLayout* l) { l->set_block_tokens(-3); }, "layout.block_tokens"},
      {[](v1::ModelLayout* l) { l->set_block_tokens(2048); }, "layout.block_tokens"},
      {[](v1::ModelLayout* l) {
         l->set_num_kv_heads(1024);
         l->set_num_q_heads(1024);
         l->set_head_dim(4096);
         l->set_block_tokens(1024);
       },
       "layout.block too large"},
  };
  for (const Case& c : cases) {
    v1::ModelLayout layout = GoodLayout();
    c.mutate(&layout);
    EXPECT_STATUS(LayoutFromProto(layout).status(), kInvalidArgument, c.text);
  }
}

TEST(ConvertLayoutTest, PrefixIsApplied) {
  v1::ModelLayout layout = GoodLayout();
  layout.set_head_dim(0);
  EXPECT_STATUS(LayoutFromProto(layout, "header.layout.").status(), kInvalidArgument,
                "header.layout.head_dim");
  layout = GoodLayout();
  layout.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_STATUS(LayoutFromProto(layout, "x.").status(), kInvalidArgument, "x.dtype");
}

// ---- Policies ----------------------------------------------------------------------------------

TEST(ConvertPolicyTest, EmptySpecMeansServerDefault) {
  auto policy = PolicyFromProto(v1::PolicySpec());
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_FALSE(policy->has_value());
}

TEST(ConvertPolicyTest, ParamsWithoutNameAreRefused) {
  v1::PolicySpec spec;
  spec.mutable_keydiff()->set_recent_fraction(0.5f);
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.name is empty but policy.keydiff is set");
  v1::PolicySpec only_allocator;
  only_allocator.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNIFORM);
  EXPECT_STATUS(PolicyFromProto(only_allocator).status(), kInvalidArgument, "policy.name");
}

TEST(ConvertPolicyTest, StreamingLlmDefaultsAndParams) {
  v1::PolicySpec spec;
  spec.set_name("streaming_llm");
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok() && policy->has_value()) << policy.status();
  EXPECT_EQ((*policy)->name, "streaming_llm");
  EXPECT_EQ((*policy)->streaming_llm.n_sink, 4);  // 0 = spec default
  spec.mutable_streaming_llm()->set_n_sink(7);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->streaming_llm.n_sink, 7);
  spec.mutable_streaming_llm()->set_n_sink(-1);
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.streaming_llm.n_sink must be >= 0, got -1");
}

TEST(ConvertPolicyTest, KeyDiffDefaultsAndParams) {
  v1::PolicySpec spec;
  spec.set_name("keydiff");
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok() && policy->has_value()) << policy.status();
  EXPECT_EQ((*policy)->keydiff.anchor, KeyDiffAnchor::kMeanNormalized);
  EXPECT_EQ((*policy)->keydiff.metric, KeyDiffMetric::kCosine);
  EXPECT_EQ((*policy)->keydiff.recent_fraction, 0.0f);

  spec.mutable_keydiff()->set_anchor(v1::KeyDiffParams::ANCHOR_MEDIAN_NORMALIZED);
  spec.mutable_keydiff()->set_metric(v1::KeyDiffParams::METRIC_EUCLIDEAN);
  spec.mutable_keydiff()->set_recent_fraction(0.25f);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ((*policy)->keydiff.anchor, KeyDiffAnchor::kMedianNormalized);
  EXPECT_EQ((*policy)->keydiff.metric, KeyDiffMetric::kEuclidean);
  EXPECT_EQ((*policy)->keydiff.recent_fraction, 0.25f);

  // Round trip through the proto keeps every parameter.
  v1::PolicySpec back;
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.name(), "keydiff");
  EXPECT_EQ(back.keydiff().anchor(), v1::KeyDiffParams::ANCHOR_MEDIAN_NORMALIZED);
  EXPECT_EQ(back.keydiff().metric(), v1::KeyDiffParams::METRIC_EUCLIDEAN);
  EXPECT_EQ(back.keydiff().recent_fraction(), 0.25f);
}

TEST(ConvertPolicyTest, AllKeyDiffEnumsMap) {
  for (auto anchor : {v1::KeyDiffParams::ANCHOR_MEAN_NORMALIZED, v1::KeyDiffParams::ANCHOR_MEAN_RAW,
                      v1::KeyDiffParams::ANCHOR_MEDIAN_NORMALIZED}) {
    for (auto metric : {v1::KeyDiffParams::METRIC_COSINE, v1::KeyDiffParams::METRIC_PAIRWISE,
                        v1::KeyDiffParams::METRIC_DOT, v1::KeyDiffParams::METRIC_EUCLIDEAN}) {
      v1::PolicySpec spec;
      spec.set_name("keydiff");
      spec.mutable_keydiff()->set_anchor(anchor);
      spec.mutable_keydiff()->set_metric(metric);
      auto policy = PolicyFromProto(spec);
      ASSERT_TRUE(policy.ok()) << policy.status();
      v1::PolicySpec back;
      PolicyToProto(**policy, &back);
      EXPECT_EQ(back.keydiff().anchor(), anchor);
      EXPECT_EQ(back.keydiff().metric(), metric);
    }
  }
}

TEST(ConvertPolicyTest, KeyDiffBadParamsNameTheirField) {
  v1::PolicySpec spec;
  spec.set_name("keydiff");
  spec.mutable_keydiff()->set_anchor(static_cast<v1::KeyDiffParams::Anchor>(9));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.keydiff.anchor has unknown value 9");
  spec.mutable_keydiff()->set_anchor(v1::KeyDiffParams::ANCHOR_UNSPECIFIED);
  spec.mutable_keydiff()->set_metric(static_cast<v1::KeyDiffParams::Metric>(-2));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument, "policy.keydiff.metric");
  spec.mutable_keydiff()->set_metric(v1::KeyDiffParams::METRIC_UNSPECIFIED);
  for (float bad : {1.0f, -0.1f, 2.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    spec.mutable_keydiff()->set_recent_fraction(bad);
    EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                  "policy.keydiff.recent_fraction must be in [0, 1)");
  }
  spec.mutable_keydiff()->set_recent_fraction(0.999f);
  EXPECT_TRUE(PolicyFromProto(spec).ok());
}

TEST(ConvertPolicyTest, OtherContractPoliciesAreUnimplemented) {
  for (const char* name : {"h2o", "tova", "snapkv", "cake", "d2o", "caote", "omnikv"}) {
    v1::PolicySpec spec;
    spec.set_name(name);
    const absl::Status status = PolicyFromProto(spec).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("policy '", name, "' is not implemented in this build")));
  }
}

TEST(ConvertPolicyTest, UnknownPolicyListsTheKnownNames) {
  v1::PolicySpec spec;
  spec.set_name("KeyDiff");
  const absl::Status status = PolicyFromProto(spec, "requests[2].policy.").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), StartsWith("requests[2].policy.name 'KeyDiff'"));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("streaming_llm, keydiff, h2o, tova, snapkv, cake, d2o, caote, omnikv"));
}

TEST(ConvertPolicyTest, AllocatorKinds) {
  v1::PolicySpec spec;
  spec.set_name("streaming_llm");
  spec.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNIFORM);
  EXPECT_TRUE(PolicyFromProto(spec).ok());
  spec.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_PYRAMIDKV);
  EXPECT_STATUS(PolicyFromProto(spec).status(), kUnimplemented,
                "policy.allocator.kind LAYER_ALLOCATOR_PYRAMIDKV is not implemented");
  spec.mutable_allocator()->set_kind(static_cast<v1::LayerAllocatorKind>(77));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument, "policy.allocator.kind");
  spec.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNSPECIFIED);
  spec.mutable_allocator()->set_min_layer_tokens(-1);
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.allocator.min_layer_tokens");
}

// The uniform allocator has no floor and no slope: setting either must not be silently ignored.
TEST(ConvertPolicyTest, AllocatorParametersAreUnimplemented) {
  v1::PolicySpec spec;
  spec.set_name("keydiff");
  spec.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNIFORM);
  spec.mutable_allocator()->set_min_layer_tokens(16);
  EXPECT_STATUS(PolicyFromProto(spec, "requests[1].policy.").status(), kUnimplemented,
                "requests[1].policy.allocator.min_layer_tokens 16");
  spec.mutable_allocator()->set_min_layer_tokens(0);
  spec.mutable_allocator()->set_pyramid_beta(20.0f);
  EXPECT_STATUS(PolicyFromProto(spec).status(), kUnimplemented, "policy.allocator.pyramid_beta");
  spec.mutable_allocator()->set_pyramid_beta(std::nanf(""));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kUnimplemented, "policy.allocator.pyramid_beta");
  spec.mutable_allocator()->set_pyramid_beta(0.0f);
  EXPECT_TRUE(PolicyFromProto(spec).ok());
  // What the server reports back (PolicyToProto) is accepted again as a request.
  v1::PolicySpec echoed;
  PolicyToProto(**PolicyFromProto(spec), &echoed);
  EXPECT_TRUE(PolicyFromProto(echoed).ok());
}

TEST(ConvertPolicyTest, DefaultPolicyNamed) {
  auto policy = DefaultPolicyNamed("streaming_llm", "--default_policy");
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ(policy->name, "streaming_llm");
  EXPECT_STATUS(DefaultPolicyNamed("h2o", "--default_policy").status(), kUnimplemented,
                "--default_policy: policy 'h2o'");
  EXPECT_STATUS(DefaultPolicyNamed("lru", "--default_policy").status(), kInvalidArgument,
                "--default_policy: name 'lru'");
  EXPECT_STATUS(DefaultPolicyNamed("", "--default_policy").status(), kInvalidArgument,
                "--default_policy must name a policy");
}

// ---- Budgets -----------------------------------------------------------------------------------

TEST(ConvertBudgetTest, GoodBudget) {
  v1::Budget budget;
  budget.set_tokens_per_layer(256);
  budget.set_strict(true);
  auto config = BudgetFromProto(budget, 1 << 20);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tokens_per_layer, 256);
  EXPECT_TRUE(config->strict);
  EXPECT_EQ(config->prefill_block_tokens, 128);  // 0 = default
  budget.set_prefill_block_tokens(32);
  EXPECT_EQ(BudgetFromProto(budget, 1 << 20)->prefill_block_tokens, 32);
  v1::Budget back;
  BudgetToProto(*BudgetFromProto(budget, 1 << 20), &back);
  EXPECT_EQ(back.tokens_per_layer(), 256);
  EXPECT_TRUE(back.strict());
  EXPECT_EQ(back.prefill_block_tokens(), 32);
}

TEST(ConvertBudgetTest, BadBudgetsNameTheirField) {
  v1::Budget budget;
  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20).status(), kInvalidArgument,
                "budget.tokens_per_layer must be in [1, 16777216], got 0");
  budget.set_tokens_per_layer(-5);
  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20).status(), kInvalidArgument,
                "budget.tokens_per_layer");
  budget.set_tokens_per_layer(kMaxBudgetTokens + 1);
  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20).status(), kInvalidArgument,
                "budget.tokens_per_layer");
  budget.set_tokens_per_layer(64);
  budget.set_prefill_block_tokens(-1);
  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20).status(), kInvalidArgument,
                "budget.prefill_block_tokens");
  budget.set_prefill_block_tokens(2000);
  EXPECT_STATUS(BudgetFromProto(budget, 1000).status(), kInvalidArgument,
                "budget.prefill_block_tokens must be in [0, 1000]");
  budget.set_prefill_block_tokens(0);
  budget.add_per_layer_tokens(10);
  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20).status(), kUnimplemented,
                "budget.per_layer_tokens");
}

// ---- Field checks ------------------------------------------------------------------------------

TEST(ConvertFieldTest, Names) {
  EXPECT_TRUE(ValidateName("abc", "session_id", true).ok());
  EXPECT_TRUE(ValidateName("", "sequence_id", false).ok());
  EXPECT_STATUS(ValidateName("", "session_id", true), kInvalidArgument,
                "session_id must not be empty");
  EXPECT_STATUS(ValidateName(std::string(kMaxNameBytes + 1, 'a'), "tenant", false),
                kInvalidArgument, "tenant is 257 bytes long");
  EXPECT_STATUS(ValidateName("a\nb", "worker_name", false), kInvalidArgument,
                "worker_name contains a control character");
}

TEST(ConvertFieldTest, NumTokens) {
  EXPECT_TRUE(ValidateNumTokens(1, 100, "num_tokens").ok());
  EXPECT_TRUE(ValidateNumTokens(100, 100, "num_tokens").ok());
  EXPECT_STATUS(ValidateNumTokens(0, 1 << 20, "num_tokens"), kInvalidArgument,
                "num_tokens must be in [1, 1048576], got 0");
  EXPECT_STATUS(ValidateNumTokens(101, 100, "requests[3].num_tokens"), kInvalidArgument,
                "requests[3].num_tokens must be in [1, 100], got 101");
  EXPECT_STATUS(ValidateNumTokens(-7, 100, "num_tokens"), kInvalidArgument, "got -7");
}

TEST(ConvertFieldTest, Positions) {
  const std::vector<int32_t> good = {3, 5, 9};
  EXPECT_TRUE(ValidatePositions(good, 3, "positions").ok());
  EXPECT_TRUE(ValidatePositions({}, 3, "positions").ok());
  EXPECT_STATUS(ValidatePositions(good, 4, "positions"), kInvalidArgument,
                "positions has 3 entries but num_tokens is 4");
  const std::vector<int32_t> negative = {-1, 2};
  EXPECT_STATUS(ValidatePositions(negative, 2, "positions"), kInvalidArgument,
                "positions[0] must be >= 0, got -1");
  const std::vector<int32_t> unsorted = {1, 4, 4};
  EXPECT_STATUS(ValidatePositions(unsorted, 3, "header.positions"), kInvalidArgument,
                "header.positions[2] (4) must be greater than header.positions[1] (4)");
}

TEST(ConvertFieldTest, Layers) {
  const std::vector<int32_t> good = {3, 0, 2};
  EXPECT_TRUE(ValidateLayers(good, 4, "layers").ok());
  const std::vector<int32_t> out_of_range = {0, 4};
  EXPECT_STATUS(ValidateLayers(out_of_range, 4, "header.layers"), kInvalidArgument,
                "header.layers[1] = 4 is out of range [0, 4)");
  const std::vector<int32_t> negative = {-1};
  EXPECT_STATUS(ValidateLayers(negative, 4, "layers"), kInvalidArgument, "layers[0] = -1");
  const std::vector<int32_t> repeat = {1, 2, 1};
  EXPECT_STATUS(ValidateLayers(repeat, 4, "layers"), kInvalidArgument,
                "layers[2] repeats layer 1 (already layers[0])");
  EXPECT_EQ(LayersOrAll({}, 3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(LayersOrAll(good, 4), good);
}

TEST(ConvertFieldTest, PayloadBytesAndOverflow) {
  const ModelLayout layout = Layout();  // H=2, D=16, fp16
  EXPECT_EQ(*InlinePayloadBytes(layout, 4, 10, "payload_bytes"), 4u * 2 * 2 * 10 * 16 * 2);
  ModelLayout big = layout;
  big.num_kv_heads = 1024;
  big.head_dim = 4096;
  EXPECT_STATUS(
      InlinePayloadBytes(big, int64_t{1} << 40, int64_t{1} << 30, "header.payload_bytes").status(),
      kInvalidArgument, "header.payload_bytes: payload size overflows");
}

TEST(ConvertFieldTest, ExportChunkClamp) {
  EXPECT_EQ(ClampExportChunkBytes(0), 1u << 20);
  EXPECT_EQ(ClampExportChunkBytes(1), 64u << 10);
  EXPECT_EQ(ClampExportChunkBytes(100000), 100000u);
  EXPECT_EQ(ClampExportChunkBytes(64u << 20), 4u << 20);
  EXPECT_EQ(ClampExportChunkBytes(UINT32_MAX), 4u << 20);
}

// ---- Requests ----------------------------------------------------------------------------------

TEST(ConvertRequestTest, Attach) {
  PoolOptions options;
  v1::AttachRequest request;
  EXPECT_STATUS(AttachFromProto(request, options).status(), kInvalidArgument, "layout is required");
  *request.mutable_layout() = GoodLayout();
  auto params = AttachFromProto(request, options);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->tenant, "default");
  EXPECT_EQ(params->num_blocks, 0);
  EXPECT_EQ(params->lease, absl::ZeroDuration());
  request.set_tenant("team-a");
  request.set_worker_name("w0");
  request.set_num_blocks(64);
  request.set_lease_ms(2000);
  params = AttachFromProto(request, options);
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->tenant, "team-a");
  EXPECT_EQ(params->worker_name, "w0");
  EXPECT_EQ(params->num_blocks, 64);
  EXPECT_EQ(params->lease, absl::Seconds(2));

  v1::AttachRequest bad = request;
  bad.mutable_layout()->set_head_dim(0);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument, "layout.head_dim");
  bad = request;
  bad.set_num_blocks(-1);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument,
                "num_blocks must be >= 0");
  bad = request;
  bad.set_lease_ms(-1);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument, "lease_ms must be >= 0");
  bad.set_lease_ms(5);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument,
                "lease_ms must be in [100, 600000]");
  bad.set_lease_ms(600001);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument, "lease_ms");
  bad = request;
  bad.set_staging_bytes(4096);
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kUnimplemented, "staging_bytes");
  bad = request;
  bad.set_tenant(std::string(300, 't'));
  EXPECT_STATUS(AttachFromProto(bad, options).status(), kInvalidArgument, "tenant");
}

TEST(ConvertRequestTest, CreateSequence) {
  v1::CreateSequenceRequest request;
  EXPECT_STATUS(SequenceParamsFromProto(request, 1 << 20).status(), kInvalidArgument,
                "session_id must not be empty");
  request.set_session_id("s");
  auto params = SequenceParamsFromProto(request, 1 << 20);
  ASSERT_TRUE(params.ok());
  EXPECT_FALSE(params->policy.has_value());
  EXPECT_FALSE(params->budget.has_value());
  EXPECT_TRUE(params->sequence_id.empty());

  request.set_sequence_id("req-1");
  request.mutable_policy()->set_name("streaming_llm");
  request.mutable_budget()->set_tokens_per_layer(100);
  params = SequenceParamsFromProto(request, 1 << 20);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->sequence_id, "req-1");
  ASSERT_TRUE(params->policy.has_value());
  EXPECT_EQ(params->policy->name, "streaming_llm");
  ASSERT_TRUE(params->budget.has_value());
  EXPECT_EQ(params->budget->tokens_per_layer, 100);

  v1::CreateSequenceRequest bad = request;
  bad.mutable_budget()->set_tokens_per_layer(0);
  EXPECT_STATUS(SequenceParamsFromProto(bad, 1 << 20).status(), kInvalidArgument,
                "budget.tokens_per_layer");
  bad = request;
  bad.mutable_policy()->set_name("tova");
  EXPECT_STATUS(SequenceParamsFromProto(bad, 1 << 20).status(), kUnimplemented, "policy 'tova'");
  bad = request;
  bad.set_retain_evicted(true);
  EXPECT_STATUS(SequenceParamsFromProto(bad, 1 << 20).status(), kUnimplemented, "retain_evicted");
  // An empty policy message present is still the server default.
  bad = request;
  bad.mutable_policy()->Clear();
  params = SequenceParamsFromProto(bad, 1 << 20);
  ASSERT_TRUE(params.ok());
  EXPECT_FALSE(params->policy.has_value());
}

TEST(ConvertRequestTest, ReserveAndCommit) {
  v1::ReserveRequest reserve;
  reserve.set_session_id("s");
  reserve.set_sequence_id("q");
  reserve.set_num_tokens(2);
  EXPECT_TRUE(ValidateReserveRequest(reserve, 100).ok());
  reserve.add_positions(10);
  EXPECT_STATUS(ValidateReserveRequest(reserve, 100, "requests[3]."), kInvalidArgument,
                "requests[3].positions has 1 entries but num_tokens is 2");
  reserve.add_positions(9);
  EXPECT_STATUS(ValidateReserveRequest(reserve, 100), kInvalidArgument, "positions[1] (9)");
  reserve.clear_positions();
  reserve.set_num_tokens(0);
  EXPECT_STATUS(ValidateReserveRequest(reserve, 100, "requests[3]."), kInvalidArgument,
                "requests[3].num_tokens must be in [1, 100], got 0");
  reserve.set_num_tokens(1);
  reserve.clear_sequence_id();
  EXPECT_STATUS(ValidateReserveRequest(reserve, 100, "requests[0]."), kInvalidArgument,
                "requests[0].sequence_id must not be empty");

  v1::CommitRequest commit;
  commit.set_session_id("s");
  commit.set_sequence_id("q");
  EXPECT_STATUS(ValidateCommitRequest(commit, "requests[1]."), kInvalidArgument,
                "requests[1].reservation_id must be set");
  commit.set_reservation_id(7);
  EXPECT_TRUE(ValidateCommitRequest(commit).ok());
  commit.clear_session_id();
  EXPECT_STATUS(ValidateCommitRequest(commit), kInvalidArgument, "session_id must not be empty");
}

TEST(ConvertRequestTest, CancelReservation) {
  v1::CancelReservationRequest cancel;
  cancel.set_session_id("s");
  cancel.set_sequence_id("q");
  EXPECT_STATUS(ValidateCancelReservationRequest(cancel), kInvalidArgument,
                "reservation_id must be set");
  cancel.set_reservation_id(3);
  EXPECT_TRUE(ValidateCancelReservationRequest(cancel).ok());
  cancel.set_sequence_id("bad\n");
  EXPECT_STATUS(ValidateCancelReservationRequest(cancel), kInvalidArgument,
                "sequence_id contains a control character");
}

TEST(ConvertRequestTest, AppendHeader) {
  const ModelLayout layout = Layout();  // L=4, H=2, D=16, fp16
  v1::AppendHeader header;
  header.set_session_id("s");
  header.set_sequence_id("q");
  header.set_num_tokens(3);
  header.set_payload_bytes(4ull * 2 * 2 * 3 * 16 * 2);
  EXPECT_TRUE(ValidateAppendHeader(header, layout, 1 << 20).ok());

  header.add_layers(2);
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.payload_bytes must be 384 (1 layers * 2 * 2 kv heads * 3 tokens * 16 "
                "head_dim * 2 bytes), got 1536");
  header.set_payload_bytes(384);
  EXPECT_TRUE(ValidateAppendHeader(header, layout, 1 << 20).ok());
  header.add_layers(4);
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.layers[1] = 4 is out of range [0, 4)");
  header.clear_layers();
  header.set_payload_bytes(1536);
  header.set_num_tokens(0);
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.num_tokens must be in [1, 1048576], got 0");
  header.set_num_tokens(3);
  header.add_positions(1);
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.positions has 1 entries");
  header.clear_positions();
  header.set_payload_bytes(UINT64_MAX);
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.payload_bytes must be 1536");
  header.clear_sequence_id();
  EXPECT_STATUS(ValidateAppendHeader(header, layout, 1 << 20), kInvalidArgument,
                "header.sequence_id must not be empty");
}

TEST(ConvertRequestTest, Compress) {
  v1::CompressRequest request;
  request.set_session_id("s");
  request.set_sequence_id("q");
  auto params = CompressParamsFromProto(request);
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->budget_tokens, 0);
  EXPECT_FALSE(params->policy.has_value());
  EXPECT_FALSE(params->return_positions);

  request.set_budget_tokens(64);
  request.set_return_positions(true);
  request.mutable_policy()->set_name("keydiff");
  params = CompressParamsFromProto(request);
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->budget_tokens, 64);
  EXPECT_TRUE(params->return_positions);
  ASSERT_TRUE(params->policy.has_value());
  EXPECT_EQ(params->policy->name, "keydiff");

  v1::CompressRequest bad = request;
  bad.set_budget_tokens(-1);
  EXPECT_STATUS(CompressParamsFromProto(bad, "requests[5].").status(), kInvalidArgument,
                "requests[5].budget_tokens must be in [0, 16777216]");
  bad = request;
  bad.mutable_policy()->set_name("snapkv");
  EXPECT_STATUS(CompressParamsFromProto(bad).status(), kUnimplemented, "policy 'snapkv'");
  bad = request;
  bad.mutable_policy()->mutable_keydiff()->set_recent_fraction(1.5f);
  EXPECT_STATUS(CompressParamsFromProto(bad, "requests[1].").status(), kInvalidArgument,
                "requests[1].policy.keydiff.recent_fraction");
  bad = request;
  bad.mutable_attention()->set_num_queries(1);
  EXPECT_STATUS(CompressParamsFromProto(bad).status(), kUnimplemented, "attention");
}

// ---- Responses ---------------------------------------------------------------------------------

TEST(ConvertResponseTest, ReservationAndLayout) {
  Reservation reservation;
  reservation.reservation_id = 9;
  reservation.layers.push_back({1, 5, {7, 8}});
  reservation.positions = {20, 21};
  reservation.evicted_before = 3;
  v1::ReserveResponse response;
  ReservationToProto(reservation, &response);
  EXPECT_EQ(response.reservation_id(), 9u);
  ASSERT_EQ(response.layers_size(), 1);
  EXPECT_EQ(response.layers(0).layer(), 1);
  EXPECT_EQ(response.layers(0).first_slot(), 5);
  EXPECT_THAT(response.layers(0).blocks(), testing::ElementsAre(7, 8));
  EXPECT_THAT(response.positions(), testing::ElementsAre(20, 21));
  EXPECT_EQ(response.evicted_before(), 3);

  SequenceLayout layout;
  layout.layers.push_back({0, 2, {4}, {0, 1, 1, 0}, 64});
  layout.next_position = 2;
  layout.tokens_appended = 2;
  layout.policy.name = "streaming_llm";
  layout.budget.tokens_per_layer = 64;
  v1::GetLayoutResponse out;
  SequenceLayoutToProto(layout, &out);
  ASSERT_EQ(out.layers_size(), 1);
  EXPECT_EQ(out.layers(0).count(), 2);
  EXPECT_THAT(out.layers(0).block_table(), testing::ElementsAre(4));
  EXPECT_THAT(out.layers(0).positions(), testing::ElementsAre(0, 1, 1, 0));
  EXPECT_EQ(out.layers(0).budget(), 64);
  EXPECT_EQ(out.next_position(), 2);
  EXPECT_EQ(out.tier(), v1::TIER_ARENA);
  EXPECT_EQ(out.policy().name(), "streaming_llm");
  EXPECT_EQ(out.policy().streaming_llm().n_sink(), 4);
  EXPECT_EQ(out.budget().tokens_per_layer(), 64);
}

TEST(ConvertResponseTest, ArenaHandle) {
  SessionView session;
  session.arena.kind = ArenaHandle::Kind::kSharedMemoryFile;
  session.arena.shm_path = "/dev/shm/kvsidecar-1";
  session.arena.size_bytes = 4096;
  session.arena.generation = 3;
  session.num_blocks = 4;
  session.block_bytes = 1024;
  v1::ArenaHandle handle;
  ArenaHandleToProto(session, &handle);
  EXPECT_EQ(handle.kind(), v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
  EXPECT_EQ(handle.shm_path(), "/dev/shm/kvsidecar-1");
  EXPECT_EQ(handle.size_bytes(), 4096u);
  EXPECT_EQ(handle.generation(), 3u);
  EXPECT_EQ(handle.block_bytes(), 1024u);
  EXPECT_EQ(handle.num_blocks(), 4);
  EXPECT_EQ(handle.staging_bytes(), 0u);
}

TEST(ConvertResponseTest, UnixMillis) {
  EXPECT_EQ(UnixMillisOf(absl::FromUnixMillis(1234)), 1234);
  EXPECT_EQ(UnixMillisOf(absl::InfiniteFuture()), std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace kvs
