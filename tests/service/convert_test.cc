#include "service/convert.h"

#include <cmath>
#include <limits>

#include "cache/policy/policy.h"
#include "gmock/gmock.h"
#include "gpu/base/dtype.h"
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

TEST(ConvertPolicyTest, StreamingLlmValuesAreCopied) {
  v1::PolicySpec spec;
  spec.set_name("streaming_llm");
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok() && policy->has_value()) << policy.status();
  EXPECT_EQ((*policy)->name, "streaming_llm");
  EXPECT_EQ((*policy)->streaming_llm.n_sink, 4);  // unset = the paper's default
  spec.mutable_streaming_llm()->set_n_sink(0);       // explicit presence: 0 sinks is honoured
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->streaming_llm.n_sink, 0);
  spec.mutable_streaming_llm()->set_n_sink(7);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->streaming_llm.n_sink, 7);
  // Range checks are the policy's (ResolvePolicyConfig), not the conversion's.
  spec.mutable_streaming_llm()->set_n_sink(-1);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_STATUS(ResolvePolicyConfig(**policy).status(), kInvalidArgument,
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

TEST(ConvertPolicyTest, KeyDiffBadEnumsNameTheirField) {
  v1::PolicySpec spec;
  spec.set_name("keydiff");
  spec.mutable_keydiff()->set_anchor(static_cast<v1::KeyDiffParams::Anchor>(9));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.keydiff.anchor has unknown value 9");
  spec.mutable_keydiff()->set_anchor(v1::KeyDiffParams::ANCHOR_UNSPECIFIED);
  spec.mutable_keydiff()->set_metric(static_cast<v1::KeyDiffParams::Metric>(-2));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument, "policy.keydiff.metric");
  spec.mutable_keydiff()->set_metric(v1::KeyDiffParams::METRIC_UNSPECIFIED);
  // Values are mapped as given; the range belongs to ResolvePolicyConfig.
  spec.mutable_keydiff()->set_recent_fraction(2.0f);
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ((*policy)->keydiff.recent_fraction, 2.0f);
  EXPECT_STATUS(ResolvePolicyConfig(**policy).status(), kInvalidArgument,
                "policy.keydiff.recent_fraction");
}

TEST(ConvertPolicyTest, OmniKvRoundTrip) {
  v1::PolicySpec spec;
  spec.set_name("omnikv");
  spec.mutable_omnikv()->add_filter_layers(2);
  spec.mutable_omnikv()->add_filter_layers(8);
  spec.mutable_omnikv()->set_wait_layers(2);
  spec.mutable_omnikv()->set_selected_tokens(64);
  spec.mutable_omnikv()->set_selector(v1::OmniKvParams::SELECTOR_SOFTMAX_BEFORE_LAST);
  spec.mutable_omnikv()->set_window(8);
  spec.mutable_omnikv()->set_offload(true);
  auto policy = PolicyFromProto(spec, "requests[1].policy.");
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ((*policy)->omnikv.filter_layers, (std::vector<int32_t>{2, 8}));
  EXPECT_EQ((*policy)->omnikv.selector, OmniKvSelector::kSoftmaxBeforeLast);
  v1::PolicySpec back;
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.omnikv().SerializeAsString(), spec.omnikv().SerializeAsString());
  spec.mutable_omnikv()->set_selector(static_cast<v1::OmniKvParams::Selector>(9));
  EXPECT_STATUS(PolicyFromProto(spec, "requests[1].policy.").status(), kInvalidArgument,
                "requests[1].policy.omnikv.selector");
  // It cannot be a server default: it never evicts and its filter layers depend on the model.
  EXPECT_STATUS(DefaultPolicyNamed("omnikv", "--default_policy").status(), kInvalidArgument,
                "--default_policy");
}

// Every policy of the contract converts; each round trip keeps every parameter.
TEST(ConvertPolicyTest, H2oTovaRoundTrip) {
  v1::PolicySpec spec;
  spec.set_name("h2o");
  spec.mutable_h2o()->set_n_sink(3);
  spec.mutable_h2o()->set_n_recent(11);
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_EQ((*policy)->name, "h2o");
  EXPECT_EQ((*policy)->h2o.n_sink, 3);
  EXPECT_EQ((*policy)->h2o.n_recent, 11);
  v1::PolicySpec back;
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.name(), "h2o");
  EXPECT_EQ(back.h2o().n_sink(), 3);
  EXPECT_EQ(back.h2o().n_recent(), 11);

  for (bool all_heads : {false, true}) {
    v1::PolicySpec tova;
    tova.set_name("tova");
    tova.mutable_tova()->set_all_heads(all_heads);
    policy = PolicyFromProto(tova);
    ASSERT_TRUE(policy.ok()) << policy.status();
    EXPECT_EQ((*policy)->tova.all_heads, all_heads);
    back.Clear();
    PolicyToProto(**policy, &back);
    EXPECT_EQ(back.name(), "tova");
    EXPECT_TRUE(back.has_tova());
    EXPECT_EQ(back.tova().all_heads(), all_heads);
  }
}

TEST(ConvertPolicyTest, SnapKvRoundTripAndPooling) {
  const std::pair<v1::SnapKvParams::Pooling, Pooling> cases[] = {
      {v1::SnapKvParams::POOLING_UNSPECIFIED, Pooling::kAvg},
      {v1::SnapKvParams::POOLING_AVG, Pooling::kAvg},
      {v1::SnapKvParams::POOLING_MAX, Pooling::kMax}};
  for (const auto& [proto, config] : cases) {
    v1::PolicySpec spec;
    spec.set_name("snapkv");
    spec.mutable_snapkv()->set_window(16);
    spec.mutable_snapkv()->set_kernel_size(3);
    spec.mutable_snapkv()->set_pooling(proto);
    auto policy = PolicyFromProto(spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    EXPECT_EQ((*policy)->snapkv.window, 16);
    EXPECT_EQ((*policy)->snapkv.kernel_size, 3);
    EXPECT_EQ((*policy)->snapkv.pooling, config);
    v1::PolicySpec back;
    PolicyToProto(**policy, &back);
    EXPECT_EQ(back.snapkv().window(), 16);
    EXPECT_EQ(back.snapkv().kernel_size(), 3);
    EXPECT_EQ(back.snapkv().pooling(), config == Pooling::kMax ? v1::SnapKvParams::POOLING_MAX
                                                               : v1::SnapKvParams::POOLING_AVG);
  }
  v1::PolicySpec zero;
  zero.set_name("snapkv");
  auto policy = PolicyFromProto(zero);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->snapkv.window, 0);  // resolved cache-side
  EXPECT_EQ((*policy)->snapkv.kernel_size, 0);
  v1::PolicySpec bad;
  bad.set_name("snapkv");
  bad.mutable_snapkv()->set_pooling(static_cast<v1::SnapKvParams::Pooling>(5));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument,
                "policy.snapkv.pooling has unknown value 5");
}

v1::CakeParams SomeCakeParams() {
  v1::CakeParams cake;
  cake.set_window(24);
  cake.set_tau1(0.5f);
  cake.set_tau2(2.0f);
  cake.set_gamma(150.0f);
  cake.set_kernel_size(9);
  cake.set_non_cascading(true);
  return cake;
}

void ExpectCake(const CakeConfig& cake) {
  EXPECT_EQ(cake.window, 24);
  EXPECT_EQ(cake.tau1, 0.5f);
  EXPECT_EQ(cake.tau2, 2.0f);
  EXPECT_EQ(cake.gamma, 150.0f);
  EXPECT_EQ(cake.kernel_size, 9);
  EXPECT_TRUE(cake.non_cascading);
}

TEST(ConvertPolicyTest, CakeRoundTrip) {
  v1::PolicySpec spec;
  spec.set_name("cake");
  *spec.mutable_cake() = SomeCakeParams();
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok()) << policy.status();
  ExpectCake((*policy)->cake);
  v1::PolicySpec back;
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.name(), "cake");
  EXPECT_EQ(back.cake().SerializeAsString(), SomeCakeParams().SerializeAsString());
}

TEST(ConvertPolicyTest, D2oRoundTripAndEnums) {
  v1::PolicySpec spec;
  spec.set_name("d2o");
  v1::D2oParams* d2o = spec.mutable_d2o();
  d2o->set_rho(0.4f);
  d2o->set_recent_frac(0.3f);
  d2o->set_n_sink(2);
  d2o->set_beta(0.5f);
  d2o->set_density_mode(v1::D2oParams::DENSITY_MODE_RAW);
  d2o->set_min_ratio(0.05f);
  d2o->set_max_ratio(0.9f);
  d2o->add_full_cache_layers(0);
  d2o->add_full_cache_layers(3);
  d2o->set_merge_weighting(v1::D2oParams::MERGE_WEIGHTING_CODE);
  d2o->set_threshold_scope(v1::D2oParams::THRESHOLD_SCOPE_LAYER);
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok()) << policy.status();
  const D2oConfig& config = (*policy)->d2o;
  EXPECT_EQ(config.rho, 0.4f);
  EXPECT_EQ(config.recent_frac, 0.3f);
  EXPECT_EQ(config.n_sink, 2);
  EXPECT_EQ(config.beta, 0.5f);
  EXPECT_EQ(config.density_mode, D2oDensityMode::kRaw);
  EXPECT_EQ(config.min_ratio, 0.05f);
  EXPECT_EQ(config.max_ratio, 0.9f);
  EXPECT_EQ(config.full_cache_layers, (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(config.merge_weighting, D2oMergeWeighting::kCode);
  EXPECT_EQ(config.threshold_scope, D2oThresholdScope::kLayer);
  v1::PolicySpec back;
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.d2o().SerializeAsString(), spec.d2o().SerializeAsString());

  // The other value of every enum, and UNSPECIFIED = the default.
  d2o->set_density_mode(v1::D2oParams::DENSITY_MODE_HEADNORM);
  d2o->set_merge_weighting(v1::D2oParams::MERGE_WEIGHTING_PAPER);
  d2o->set_threshold_scope(v1::D2oParams::THRESHOLD_SCOPE_LAYER_HEAD);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->d2o.density_mode, D2oDensityMode::kHeadNorm);
  EXPECT_EQ((*policy)->d2o.merge_weighting, D2oMergeWeighting::kPaper);
  EXPECT_EQ((*policy)->d2o.threshold_scope, D2oThresholdScope::kLayerHead);
  back.Clear();
  PolicyToProto(**policy, &back);
  EXPECT_EQ(back.d2o().SerializeAsString(), spec.d2o().SerializeAsString());
  d2o->set_density_mode(v1::D2oParams::DENSITY_MODE_UNSPECIFIED);
  d2o->set_merge_weighting(v1::D2oParams::MERGE_WEIGHTING_UNSPECIFIED);
  d2o->set_threshold_scope(v1::D2oParams::THRESHOLD_SCOPE_UNSPECIFIED);
  policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->d2o.density_mode, D2oDensityMode::kHeadNorm);
  EXPECT_EQ((*policy)->d2o.merge_weighting, D2oMergeWeighting::kPaper);
  EXPECT_EQ((*policy)->d2o.threshold_scope, D2oThresholdScope::kLayerHead);

  v1::PolicySpec bad = spec;
  bad.mutable_d2o()->set_density_mode(static_cast<v1::D2oParams::DensityMode>(3));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument, "policy.d2o.density_mode");
  bad = spec;
  bad.mutable_d2o()->set_merge_weighting(static_cast<v1::D2oParams::MergeWeighting>(-1));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument, "policy.d2o.merge_weighting");
  bad = spec;
  bad.mutable_d2o()->set_threshold_scope(static_cast<v1::D2oParams::ThresholdScope>(8));
  EXPECT_STATUS(PolicyFromProto(bad, "requests[0].policy.").status(), kInvalidArgument,
                "requests[0].policy.d2o.threshold_scope has unknown value 8");
}

TEST(ConvertPolicyTest, CaoteRoundTripEveryEnum) {
  const std::pair<v1::CaoteParams::Base, CaoteBase> bases[] = {
      {v1::CaoteParams::BASE_H2O, CaoteBase::kH2o},
      {v1::CaoteParams::BASE_TOVA, CaoteBase::kTova},
      {v1::CaoteParams::BASE_SNAPKV, CaoteBase::kSnapKv},
      {v1::CaoteParams::BASE_CAKE, CaoteBase::kCake}};
  const std::pair<v1::CaoteParams::Variant, CaoteVariant> variants[] = {
      {v1::CaoteParams::VARIANT_EXACT, CaoteVariant::kExact},
      {v1::CaoteParams::VARIANT_FAST, CaoteVariant::kFast},
      {v1::CaoteParams::VARIANT_NONE, CaoteVariant::kNone}};
  const std::pair<v1::CaoteParams::GqaReduce, GqaReduce> reduces[] = {
      {v1::CaoteParams::GQA_REDUCE_MEAN, GqaReduce::kMean},
      {v1::CaoteParams::GQA_REDUCE_RSS, GqaReduce::kRss}};
  for (const auto& [base_proto, base] : bases) {
    for (const auto& [variant_proto, variant] : variants) {
      for (const auto& [reduce_proto, reduce] : reduces) {
        v1::PolicySpec spec;
        spec.set_name("caote");
        v1::CaoteParams* caote = spec.mutable_caote();
        caote->set_base(base_proto);
        caote->set_variant(variant_proto);
        caote->set_gqa_reduce(reduce_proto);
        caote->set_eps(1e-4f);
        caote->set_n_sink(2);
        caote->set_n_recent(6);
        caote->set_greedy(true);
        caote->mutable_snapkv()->set_window(8);
        caote->mutable_snapkv()->set_kernel_size(3);
        caote->mutable_snapkv()->set_pooling(v1::SnapKvParams::POOLING_MAX);
        *caote->mutable_cake() = SomeCakeParams();
        auto policy = PolicyFromProto(spec);
        ASSERT_TRUE(policy.ok()) << policy.status();
        const CaoteConfig& config = (*policy)->caote;
        EXPECT_EQ(config.base, base);
        EXPECT_EQ(config.variant, variant);
        EXPECT_EQ(config.gqa_reduce, reduce);
        EXPECT_EQ(config.eps, 1e-4f);
        EXPECT_EQ(config.n_sink, 2);
        EXPECT_EQ(config.n_recent, 6);
        EXPECT_TRUE(config.greedy);
        EXPECT_EQ(config.snapkv.window, 8);
        EXPECT_EQ(config.snapkv.kernel_size, 3);
        EXPECT_EQ(config.snapkv.pooling, Pooling::kMax);
        ExpectCake(config.cake);
        v1::PolicySpec back;
        PolicyToProto(**policy, &back);
        EXPECT_EQ(back.caote().SerializeAsString(), spec.caote().SerializeAsString())
            << back.DebugString();
      }
    }
  }
  v1::PolicySpec unspecified;
  unspecified.set_name("caote");
  auto policy = PolicyFromProto(unspecified);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->caote.base, CaoteBase::kH2o);
  EXPECT_EQ((*policy)->caote.variant, CaoteVariant::kExact);
  EXPECT_EQ((*policy)->caote.gqa_reduce, GqaReduce::kMean);
  EXPECT_EQ((*policy)->caote.eps, 0.0f);  // resolved cache-side

  v1::PolicySpec bad = unspecified;
  bad.mutable_caote()->set_base(static_cast<v1::CaoteParams::Base>(9));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument,
                "policy.caote.base has unknown value 9");
  bad = unspecified;
  bad.mutable_caote()->set_variant(static_cast<v1::CaoteParams::Variant>(4));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument, "policy.caote.variant");
  bad = unspecified;
  bad.mutable_caote()->set_gqa_reduce(static_cast<v1::CaoteParams::GqaReduce>(3));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument, "policy.caote.gqa_reduce");
  bad = unspecified;
  bad.mutable_caote()->mutable_snapkv()->set_pooling(static_cast<v1::SnapKvParams::Pooling>(7));
  EXPECT_STATUS(PolicyFromProto(bad).status(), kInvalidArgument,
                "policy.caote.snapkv.pooling has unknown value 7");
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

TEST(ConvertPolicyTest, AllocatorRoundTripEveryKind) {
  const std::pair<v1::LayerAllocatorKind, LayerAllocatorKind> kinds[] = {
      {v1::LAYER_ALLOCATOR_UNSPECIFIED, LayerAllocatorKind::kDefault},
      {v1::LAYER_ALLOCATOR_UNIFORM, LayerAllocatorKind::kUniform},
      {v1::LAYER_ALLOCATOR_PYRAMIDKV, LayerAllocatorKind::kPyramidKv},
      {v1::LAYER_ALLOCATOR_D2O, LayerAllocatorKind::kD2o},
      {v1::LAYER_ALLOCATOR_CAKE, LayerAllocatorKind::kCake}};
  for (const auto& [proto, kind] : kinds) {
    v1::PolicySpec spec;
    spec.set_name("keydiff");
    spec.mutable_allocator()->set_kind(proto);
    spec.mutable_allocator()->set_min_layer_tokens(16);
    spec.mutable_allocator()->set_pyramid_beta(12.5f);
    auto policy = PolicyFromProto(spec);
    ASSERT_TRUE(policy.ok()) << policy.status();
    EXPECT_EQ((*policy)->allocator.kind, kind);
    EXPECT_EQ((*policy)->allocator.min_layer_tokens, 16);
    EXPECT_EQ((*policy)->allocator.pyramid_beta, 12.5f);
    v1::PolicySpec back;
    PolicyToProto(**policy, &back);
    EXPECT_EQ(back.allocator().kind(), proto);
    EXPECT_EQ(back.allocator().min_layer_tokens(), 16);
    EXPECT_EQ(back.allocator().pyramid_beta(), 12.5f);
    // What the server reports back is accepted again as a request.
    EXPECT_TRUE(PolicyFromProto(back).ok());
  }
  v1::PolicySpec spec;
  spec.set_name("streaming_llm");
  spec.mutable_allocator()->set_kind(static_cast<v1::LayerAllocatorKind>(77));
  EXPECT_STATUS(PolicyFromProto(spec).status(), kInvalidArgument,
                "policy.allocator.kind has unknown value 77");
  // Zero stays zero (the cache resolves the defaults); negative floors are Resolve's to refuse.
  spec.mutable_allocator()->set_kind(v1::LAYER_ALLOCATOR_UNSPECIFIED);
  auto policy = PolicyFromProto(spec);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ((*policy)->allocator.min_layer_tokens, 0);
  EXPECT_EQ((*policy)->allocator.pyramid_beta, 0.0f);
}

TEST(ConvertPolicyTest, DefaultPolicyNamed) {
  auto policy = DefaultPolicyNamed("streaming_llm", "--default_policy");
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ(policy->name, "streaming_llm");
  EXPECT_EQ(policy->streaming_llm.n_sink, 4);  // resolved
  EXPECT_STATUS(DefaultPolicyNamed("omnikv", "--default_policy").status(), kInvalidArgument,
                "--default_policy: omnikv cannot be the default policy");
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
}

TEST(ConvertBudgetTest, PerLayerTokens) {
  v1::Budget budget;
  budget.set_tokens_per_layer(64);
  for (int32_t tokens : {32, 64, 96, 128}) budget.add_per_layer_tokens(tokens);
  auto config = BudgetFromProto(budget, 1 << 20, "budget.", 4);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->per_layer_tokens, (std::vector<int32_t>{32, 64, 96, 128}));
  v1::Budget back;
  BudgetToProto(*config, &back);
  EXPECT_EQ(back.SerializeAsString(), [&] {
    v1::Budget expected = budget;
    expected.set_prefill_block_tokens(128);
    return expected.SerializeAsString();
  }());
  // Layout unknown: the size is not checked, the values are.
  EXPECT_TRUE(BudgetFromProto(budget, 1 << 20).ok());

  EXPECT_STATUS(BudgetFromProto(budget, 1 << 20, "budget.", 5).status(), kInvalidArgument,
                "budget.per_layer_tokens has 4 entries; give one per layer (5) or none");
  v1::Budget bad = budget;
  bad.set_per_layer_tokens(3, 0);
  EXPECT_STATUS(BudgetFromProto(bad, 1 << 20, "budget.", 4).status(), kInvalidArgument,
                "budget.per_layer_tokens[3] must be > 0, got 0");
  bad.set_per_layer_tokens(3, -7);
  EXPECT_STATUS(BudgetFromProto(bad, 1 << 20).status(), kInvalidArgument,
                "budget.per_layer_tokens[3] must be > 0, got -7");
  bad.set_per_layer_tokens(3, kMaxBudgetTokens + 1);
  EXPECT_STATUS(BudgetFromProto(bad, 1 << 20, "budget.", 4).status(), kInvalidArgument,
                "budget.per_layer_tokens[3] must be at most");
  // An empty list is always fine.
  v1::Budget none;
  none.set_tokens_per_layer(8);
  ASSERT_TRUE(BudgetFromProto(none, 1 << 20, "budget.", 4).ok());
  EXPECT_TRUE(BudgetFromProto(none, 1 << 20, "budget.", 4)->per_layer_tokens.empty());
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
  // A staging area is the session table's to bound (Plan); the conversion carries it.
  v1::AttachRequest staged = request;
  staged.set_staging_bytes(4096);
  auto staged_params = AttachFromProto(staged, options);
  ASSERT_TRUE(staged_params.ok()) << staged_params.status();
  EXPECT_EQ(staged_params->staging_bytes, 4096u);
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
  bad.mutable_policy()->set_name("omnikv");  // mapped here; the pool checks it against the model
  EXPECT_TRUE(SequenceParamsFromProto(bad, 1 << 20).ok());
  bad = request;
  bad.mutable_policy()->set_name("tova");
  EXPECT_TRUE(SequenceParamsFromProto(bad, 1 << 20).ok());
  bad = request;
  bad.mutable_budget()->add_per_layer_tokens(5);
  EXPECT_STATUS(SequenceParamsFromProto(bad, 1 << 20, /*num_layers=*/2).status(), kInvalidArgument,
                "budget.per_layer_tokens has 1 entries");
  bad = request;
  bad.set_retain_evicted(true);
  params = SequenceParamsFromProto(bad, 1 << 20);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_TRUE(params->retain_evicted);
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
  auto params = CompressParamsFromProto(request, Layout());
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->budget_tokens, 0);
  EXPECT_FALSE(params->policy.has_value());
  EXPECT_FALSE(params->return_positions);
  EXPECT_FALSE(params->attention.has_value());

  request.set_budget_tokens(64);
  request.set_return_positions(true);
  request.mutable_policy()->set_name("keydiff");
  params = CompressParamsFromProto(request, Layout());
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->budget_tokens, 64);
  EXPECT_TRUE(params->return_positions);
  ASSERT_TRUE(params->policy.has_value());
  EXPECT_EQ(params->policy->name, "keydiff");

  v1::CompressRequest bad = request;
  bad.set_budget_tokens(-1);
  EXPECT_STATUS(CompressParamsFromProto(bad, Layout(), "requests[5].").status(), kInvalidArgument,
                "requests[5].budget_tokens must be in [0, 16777216]");
  bad = request;
  bad.mutable_policy()->set_name("omnikv");  // mapped here; the sequence refuses it
  EXPECT_TRUE(CompressParamsFromProto(bad, Layout()).ok());
  bad = request;
  bad.mutable_policy()->mutable_keydiff()->set_anchor(static_cast<v1::KeyDiffParams::Anchor>(40));
  EXPECT_STATUS(CompressParamsFromProto(bad, Layout(), "requests[1].").status(), kInvalidArgument,
                "requests[1].policy.keydiff.anchor");

  // Attention is converted (scores here; queries in the attention tests).
  v1::CompressRequest with_attention = request;
  with_attention.mutable_attention()->set_num_queries(1);
  with_attention.mutable_attention()->set_attention_scores(std::string(8, '\0'));
  params = CompressParamsFromProto(with_attention, Layout());
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_TRUE(params->attention.has_value());
  EXPECT_EQ(params->attention->scores.size(), 2u);
  bad = with_attention;
  bad.mutable_attention()->set_num_queries(0);
  EXPECT_STATUS(CompressParamsFromProto(bad, Layout(), "requests[2].").status(), kInvalidArgument,
                "requests[2].attention.num_queries must be >= 1");
}

// ---- Attention inputs --------------------------------------------------------------------------

// Layout(): 4 layers, 2 kv heads, 8 q heads, head_dim 16, fp16.
v1::AttentionInputs QueryAttention(int layers_listed, int num_queries, v1::DType dtype,
                                   int dtype_bytes) {
  v1::AttentionInputs attention;
  for (int l = 0; l < layers_listed; ++l) attention.add_layers(3 - l);
  attention.set_num_queries(num_queries);
  attention.set_softmax_scale(0.25f);
  attention.set_queries_dtype(dtype);
  const int layers = layers_listed == 0 ? 4 : layers_listed;
  attention.set_inline_queries(std::string(layers * 8 * num_queries * 16 * dtype_bytes, '\0'));
  return attention;
}

TEST(ConvertAttentionTest, QueriesOfEveryDTypeDecodeToFp32) {
  const float values[] = {1.5f, -2.0f, 0.0f, 65504.0f, -0.125f};
  for (v1::DType dtype :
       {v1::DTYPE_UNSPECIFIED, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32}) {
    // UNSPECIFIED = the session dtype (fp16).
    const DType stored =
        dtype == v1::DTYPE_UNSPECIFIED ? DType::kFloat16 : *DTypeFromProto(dtype, "");
    const int bytes = DTypeBytes(stored);
    v1::AttentionInputs attention = QueryAttention(2, 3, dtype, bytes);
    attention.add_query_positions(10);
    attention.add_query_positions(11);
    attention.add_query_positions(12);
    std::string& payload = *attention.mutable_inline_queries();
    for (int i = 0; i < 5; ++i) StoreFromFloat(payload.data(), stored, i, values[i]);
    StoreFromFloat(payload.data(), stored, 2 * 8 * 3 * 16 - 1, 3.0f);  // the last element
    auto converted = AttentionFromProto(attention, Layout());
    ASSERT_TRUE(converted.ok()) << converted.status();
    EXPECT_EQ(converted->layers, (std::vector<int32_t>{3, 2}));
    EXPECT_EQ(converted->num_queries, 3);
    EXPECT_EQ(converted->query_positions, (std::vector<int32_t>{10, 11, 12}));
    EXPECT_EQ(converted->softmax_scale, 0.25f);
    ASSERT_EQ(converted->queries.size(), 2u * 8 * 3 * 16);
    for (int i = 0; i < 5; ++i) {
      // bf16 keeps 8 bits of mantissa: 65504 rounds to 65536.
      const float expected = stored == DType::kBFloat16 && i == 3 ? 65536.0f : values[i];
      EXPECT_EQ(converted->queries[i], expected) << DTypeName(stored) << " " << i;
    }
    EXPECT_EQ(converted->queries.back(), 3.0f);
    EXPECT_TRUE(converted->scores.empty());
  }
}

TEST(ConvertAttentionTest, AllLayersWhenNoneListed) {
  auto converted = AttentionFromProto(QueryAttention(0, 1, v1::DTYPE_FLOAT32, 4), Layout());
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_TRUE(converted->layers.empty());
  EXPECT_EQ(converted->queries.size(), 4u * 8 * 16);
}

TEST(ConvertAttentionTest, InlineQueriesSizeIsExact) {
  v1::AttentionInputs attention = QueryAttention(2, 1, v1::DTYPE_UNSPECIFIED, 2);
  attention.mutable_inline_queries()->push_back('\0');
  EXPECT_STATUS(AttentionFromProto(attention, Layout(), "items[4].attention.").status(),
                kInvalidArgument,
                "items[4].attention.inline_queries has 513 bytes, expected 512 = 2 layers * 8 q "
                "heads * 1 queries * 16 head_dim * 2 bytes");
  // fp32 queries in an fp16 session: sized by queries_dtype.
  attention = QueryAttention(1, 2, v1::DTYPE_FLOAT32, 2);
  EXPECT_STATUS(AttentionFromProto(attention, Layout()).status(), kInvalidArgument,
                "attention.inline_queries has 512 bytes, expected 1024");
  attention.set_queries_dtype(static_cast<v1::DType>(9));
  EXPECT_STATUS(AttentionFromProto(attention, Layout()).status(), kInvalidArgument,
                "attention.queries_dtype has unknown value 9");
}

TEST(ConvertAttentionTest, BadFieldsAreNamed) {
  v1::AttentionInputs attention = QueryAttention(1, 1, v1::DTYPE_FLOAT16, 2);
  v1::AttentionInputs bad = attention;
  bad.set_num_queries(-1);
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.num_queries must be >= 1 (the queries of this step), got -1");
  bad = attention;
  bad.set_layers(0, -1);
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.layers[0] = -1 is out of range");
  bad = attention;
  bad.add_layers(3);  // repeats layer 3
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.layers[1] repeats layer 3");
  bad = attention;
  bad.add_query_positions(1);
  bad.add_query_positions(2);
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.query_positions has 2 entries but num_queries is 1");
  bad = attention;
  bad.set_staging_offset(0);
  // Staged queries are fp32 (the worker writes them as the kernels read them).
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.queries_dtype must be DTYPE_FLOAT32 (or unset) for queries in the "
                "staging area");
  bad = attention;
  bad.set_attention_scores(std::string(6, '\0'));
  EXPECT_STATUS(AttentionFromProto(bad, Layout()).status(), kInvalidArgument,
                "attention.attention_scores has 6 bytes, not a whole number of fp32 values");
}

TEST(ConvertAttentionTest, ScoresAreCopied) {
  v1::AttentionInputs attention;
  attention.set_num_queries(1);
  const float scores[] = {0.25f, 0.75f, 1.0f};
  attention.set_attention_scores(
      std::string(reinterpret_cast<const char*>(scores), sizeof(scores)));
  auto converted = AttentionFromProto(attention, Layout());
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(converted->scores, (std::vector<float>{0.25f, 0.75f, 1.0f}));
  EXPECT_TRUE(converted->queries.empty());
}

TEST(ConvertRequestTest, DecodeItem) {
  v1::DecodeStepRequest::Item item;
  item.set_session_id("s");
  item.set_sequence_id("q");
  auto decode = DecodeItemFromProto(item, Layout());
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(decode->session_id, "s");
  EXPECT_EQ(decode->sequence_id, "q");
  EXPECT_EQ(decode->reservation_id, 0u);
  EXPECT_TRUE(decode->inline_kv.empty());
  EXPECT_EQ(decode->attention.num_queries, 0);  // absent: no attention
  EXPECT_TRUE(decode->attention.queries.empty());

  // inline_kv [L][2][H][1][D] fp16 = 4 * 2 * 2 * 16 * 2 = 512 bytes.
  item.set_inline_kv(std::string(512, '\x01'));
  *item.mutable_attention() = QueryAttention(0, 1, v1::DTYPE_UNSPECIFIED, 2);
  decode = DecodeItemFromProto(item, Layout(), "items[0].");
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(decode->inline_kv, std::vector<uint8_t>(512, 1));
  EXPECT_EQ(decode->attention.num_queries, 1);
  EXPECT_EQ(decode->attention.queries.size(), 4u * 8 * 16);

  v1::DecodeStepRequest::Item bad = item;
  bad.set_inline_kv(std::string(511, '\0'));
  EXPECT_STATUS(DecodeItemFromProto(bad, Layout(), "items[2].").status(), kInvalidArgument,
                "items[2].inline_kv has 511 bytes, expected 512");
  bad = item;
  bad.set_reservation_id(7);
  EXPECT_STATUS(DecodeItemFromProto(bad, Layout(), "items[2].").status(), kInvalidArgument,
                "items[2].inline_kv is set together with items[2].reservation_id");
  bad = item;
  *bad.mutable_attention() = QueryAttention(0, 2, v1::DTYPE_UNSPECIFIED, 2);
  EXPECT_STATUS(DecodeItemFromProto(bad, Layout(), "items[1].").status(), kInvalidArgument,
                "items[1].attention.num_queries must be 1");
  // The ids are checked before the session is looked up (ValidateSequenceIds), not here.
  EXPECT_STATUS(ValidateSequenceIds("s", "", "items[3]."), kInvalidArgument,
                "items[3].sequence_id must not be empty");
  EXPECT_STATUS(ValidateSequenceIds("", "q", "items[3]."), kInvalidArgument,
                "items[3].session_id must not be empty");
  bad = item;
  bad.clear_inline_kv();
  bad.set_reservation_id(9);
  decode = DecodeItemFromProto(bad, Layout());
  ASSERT_TRUE(decode.ok());
  EXPECT_EQ(decode->reservation_id, 9u);
}

TEST(ConvertRequestTest, Score) {
  v1::ScoreRequest request;
  request.set_session_id("s");
  request.set_sequence_id("q");
  auto params = ScoreParamsFromProto(request, Layout());
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->budget_tokens, 0);
  EXPECT_FALSE(params->policy.has_value());
  EXPECT_FALSE(params->attention.has_value());
  EXPECT_TRUE(params->layers.empty());

  request.set_budget_tokens(12);
  request.mutable_policy()->set_name("streaming_llm");
  request.add_layers(2);
  request.add_layers(0);
  request.mutable_attention()->set_num_queries(1);
  params = ScoreParamsFromProto(request, Layout());
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->budget_tokens, 12);
  EXPECT_EQ(params->policy->name, "streaming_llm");
  EXPECT_EQ(params->layers, (std::vector<int32_t>{2, 0}));
  ASSERT_TRUE(params->attention.has_value());

  v1::ScoreRequest bad = request;
  bad.add_layers(4);
  EXPECT_STATUS(ScoreParamsFromProto(bad, Layout()).status(), kInvalidArgument,
                "layers[2] = 4 is out of range");
  bad = request;
  bad.set_budget_tokens(-3);
  EXPECT_STATUS(ScoreParamsFromProto(bad, Layout()).status(), kInvalidArgument, "budget_tokens");
  bad = request;
  bad.mutable_policy()->mutable_caote()->set_base(static_cast<v1::CaoteParams::Base>(12));
  bad.mutable_policy()->set_name("caote");
  EXPECT_STATUS(ScoreParamsFromProto(bad, Layout()).status(), kInvalidArgument,
                "policy.caote.base has unknown value 12");
}

TEST(ConvertResponseTest, DecodeScoreAndCompressResults) {
  DecodeResult decode;
  decode.counts = {5, 5};
  decode.evicted_positions = {3, -1, 2, 4};
  decode.merged = 2;
  decode.position = 9;
  v1::DecodeStepResponse::Item item;
  DecodeResultToProto(decode, &item);
  EXPECT_THAT(item.counts(), ::testing::ElementsAre(5, 5));
  EXPECT_THAT(item.evicted_positions(), ::testing::ElementsAre(3, -1, 2, 4));
  EXPECT_EQ(item.merged(), 2);
  EXPECT_EQ(item.position(), 9);

  LayerScores scores;
  scores.layer = 1;
  scores.kept = 1;
  scores.scores = {0.5f, std::numeric_limits<float>::infinity(), 0.1f, 0.2f};
  scores.kept_slots = {1, 0};
  scores.positions = {7, 8, 7, 8};
  v1::ScoreResponse::LayerScores layer;
  LayerScoresToProto(scores, &layer);
  EXPECT_EQ(layer.layer(), 1);
  EXPECT_EQ(layer.kept(), 1);
  EXPECT_THAT(layer.scores(),
              ::testing::ElementsAre(0.5f, std::numeric_limits<float>::infinity(), 0.1f, 0.2f));
  EXPECT_THAT(layer.kept_slots(), ::testing::ElementsAre(1, 0));
  EXPECT_THAT(layer.positions(), ::testing::ElementsAre(7, 8, 7, 8));

  CompressResult compress;
  compress.floor_applied_layers = 3;
  compress.layers.push_back({0, 4, 2, 1, {}});
  v1::CompressResponse response;
  CompressResultToProto(compress, &response);
  EXPECT_EQ(response.floor_applied_layers(), 3);
  EXPECT_EQ(response.layers(0).merged(), 1);
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
