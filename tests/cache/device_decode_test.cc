// The device path of a decode step (cache/sequence_device.cc) against the host path it stands
// for: the same sequences stepped on the CPU backend (the host path, the reference) and on the
// simulated device (the device path: positions and accumulated attention kept in device memory,
// each phase one call for every sequence and layer) give the same kept positions, the same K/V
// bit for bit, the same evicted positions per step, and afterwards the same policy state (the
// Score dry run reads it back on the host). For every policy with a device rule and its options,
// with inline tokens and reserved ones, over steps that evict and steps that do not.
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "gpu/device_counters.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using testing_util::BuildPayload;
using testing_util::HashValue;

// One pool on a backend of the given kind.
struct Side {
  explicit Side(BackendKind kind) {
    auto made = MakeBackend(kind, 2);
    EXPECT_TRUE(made.ok()) << made.status();
    backend = *std::move(made);
    PoolOptions options = testing_util::TestPool::DefaultOptions();
    pool = std::make_unique<KvPool>(backend.get(), &clock, options);
  }
  std::unique_ptr<Backend> backend;
  FakeClock clock;
  std::unique_ptr<KvPool> pool;
  std::string session;
};

std::string AttachTo(KvPool& pool, const ModelLayout& layout, int32_t num_blocks) {
  AttachParams params;
  params.layout = layout;
  params.num_blocks = num_blocks;
  absl::StatusOr<SessionView> view = pool.Attach(params);
  EXPECT_TRUE(view.ok()) << view.status();
  return view.ok() ? view->session_id : std::string();
}

struct Case {
  std::string name;
  PolicyConfig policy;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, PolicyConfig config) {
    cases.push_back(Case{std::move(name), std::move(config)});
  };
  add("streaming_llm", testing_util::StreamingLlm(2));
  add("keydiff", testing_util::KeyDiff());
  add("keydiff_recent",
      testing_util::KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 0.25f));
  add("keydiff_pairwise",
      testing_util::KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise));
  PolicyConfig knorm;
  knorm.name = "knorm";
  add("knorm", knorm);
  PolicyConfig h2o;
  h2o.name = kPolicyH2o;
  add("h2o", h2o);
  h2o.h2o.n_sink = 1;
  h2o.h2o.n_recent = 2;
  add("h2o_sinks_recent", h2o);
  PolicyConfig tova;
  tova.name = kPolicyTova;
  add("tova", tova);
  tova.tova.keep_last_token = true;
  add("tova_keep_last", tova);
  return cases;
}

class DeviceDecodeTest : public ::testing::TestWithParam<Case> {
 protected:
  // 3 layers, 2 kv heads of 4 query heads each, head_dim 8, fp16, blocks of 4 tokens.
  DeviceDecodeTest() : layout_(Layout()) {}

  static ModelLayout Layout() {
    ModelLayout layout = testing_util::MakeLayout(3, 2, 8, DType::kFloat16, 4);
    layout.num_q_heads = 8;
    return layout;
  }

  // The step's query for every layer: [L][Hq][1][D].
  AttentionInput Query(int32_t step) const {
    AttentionInput attention;
    attention.num_queries = 1;
    attention.softmax_scale = 0.35f;
    const int64_t n = int64_t{layout_.num_layers} * layout_.num_q_heads * layout_.head_dim;
    attention.queries.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      attention.queries[i] =
          HashValue(static_cast<int>(i % 7), 0, step, static_cast<int32_t>(i), 1);
    }
    return attention;
  }

  DecodeItem Item(Side& side, const std::string& id, int32_t position, int32_t step, bool reserve) {
    DecodeItem item;
    item.session_id = side.session;
    item.sequence_id = id;
    item.attention = Query(step);
    std::vector<int32_t> layers(layout_.num_layers);
    std::iota(layers.begin(), layers.end(), 0);
    if (!reserve) {
      item.inline_kv = BuildPayload(layout_, layers, {position}, HashValue);
      return item;
    }
    auto reservation = side.pool->Reserve(side.session, id, 1, {}, {});
    EXPECT_TRUE(reservation.ok()) << reservation.status();
    if (!reservation.ok()) return item;
    EXPECT_EQ(reservation->positions[0], position);
    const auto payload = BuildPayload(layout_, layers, {position}, HashValue);
    EXPECT_TRUE(
        side.pool->WriteReserved(side.session, id, reservation->reservation_id, 0, payload).ok());
    item.reservation_id = reservation->reservation_id;
    return item;
  }

  // Both sides' sequences: `prompt` tokens each, budget `budget`.
  void Start(Side& side, int32_t budget, int32_t prompt) {
    side.session = AttachTo(*side.pool, layout_, 256);
    for (const std::string& id : ids_) {
      SequenceParams params;
      params.policy = GetParam().policy;
      params.budget = testing_util::Budget(budget);
      params.sequence_id = id;
      ASSERT_TRUE(side.pool->CreateSequence(side.session, params).ok());
      ASSERT_TRUE(
          testing_util::Append(*side.pool, side.session, id, prompt, layout_, HashValue).ok());
    }
  }

  const ModelLayout layout_;
  const std::vector<std::string> ids_ = {"a", "b"};
};

TEST_P(DeviceDecodeTest, TheDevicePathStepsAsTheHostPathDoes) {
  Side host(BackendKind::kCpu);
  Side device(BackendKind::kDeviceSim);
  // Under budget for the first steps, then at it: steps that only append and steps that evict.
  constexpr int32_t kBudget = 9, kPrompt = 6, kSteps = 14;
  Start(host, kBudget, kPrompt);
  Start(device, kBudget, kPrompt);
  const uint64_t device_calls_before =
      DeviceCounters::Read().calls[static_cast<size_t>(BackendMethod::kDecodeEvict)];
  for (int32_t step = 0; step < kSteps; ++step) {
    const int32_t position = kPrompt + step;
    // Sequence "b" alternates between inline tokens and reserved ones.
    const bool reserve = step % 2 == 1;
    std::vector<DecodeItem> host_items, device_items;
    for (const std::string& id : ids_) {
      host_items.push_back(Item(host, id, position, step, reserve && id == "b"));
      device_items.push_back(Item(device, id, position, step, reserve && id == "b"));
    }
    auto host_results = host.pool->DecodeStep(host_items);
    auto device_results = device.pool->DecodeStep(device_items);
    ASSERT_TRUE(host_results.ok()) << host_results.status();
    ASSERT_TRUE(device_results.ok()) << device_results.status();
    for (size_t i = 0; i < ids_.size(); ++i) {
      SCOPED_TRACE(ids_[i] + " step " + std::to_string(step));
      EXPECT_EQ((*device_results)[i].counts, (*host_results)[i].counts);
      EXPECT_EQ((*device_results)[i].evicted_positions, (*host_results)[i].evicted_positions);
      EXPECT_EQ((*device_results)[i].position, (*host_results)[i].position);
      auto host_layout = host.pool->GetLayout(host.session, ids_[i], {}, true);
      auto device_layout = device.pool->GetLayout(device.session, ids_[i], {}, true);
      ASSERT_TRUE(host_layout.ok() && device_layout.ok());
      for (size_t l = 0; l < host_layout->layers.size(); ++l) {
        EXPECT_EQ(device_layout->layers[l].positions, host_layout->layers[l].positions)
            << "layer " << l;
        EXPECT_EQ(device_layout->layers[l].budget, host_layout->layers[l].budget) << "layer " << l;
      }
      EXPECT_EQ(device_layout->version, host_layout->version);
      EXPECT_TRUE(
          testing_util::ContentsMatch(*device.pool, device.session, ids_[i], layout_, HashValue));
    }
  }
  // The device path ran (two stages a step), and its state reads back as the host's.
  EXPECT_EQ(DeviceCounters::Read().calls[static_cast<size_t>(BackendMethod::kDecodeEvict)] -
                device_calls_before,
            2u * kSteps);
  for (const std::string& id : ids_) {
    ScoreParams params;
    params.budget_tokens = kBudget - 3;
    params.attention = Query(99);
    auto host_scores = host.pool->Score(host.session, id, params);
    auto device_scores = device.pool->Score(device.session, id, params);
    ASSERT_TRUE(host_scores.ok()) << host_scores.status();
    ASSERT_TRUE(device_scores.ok()) << device_scores.status();
    ASSERT_EQ(device_scores->size(), host_scores->size());
    for (size_t l = 0; l < host_scores->size(); ++l) {
      EXPECT_EQ((*device_scores)[l].scores, (*host_scores)[l].scores) << id << " layer " << l;
      EXPECT_EQ((*device_scores)[l].kept_slots, (*host_scores)[l].kept_slots)
          << id << " layer " << l;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryDeviceRule, DeviceDecodeTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace kvs
