// retain_evicted end to end against the real server binary: the tokens a compression evicts
// come back through GetRetained bit for bit (PatternRow of their positions), layer filters and
// bad input answer with the field named, and ListSequences shows the host bytes.
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

class RetainedE2eTest : public SharedServerTest<RetainedE2eTest> {};

TEST_F(RetainedE2eTest, EvictedTokensComeBackBitForBit) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 8, v1::DTYPE_BFLOAT16, 4);
  auto session = (*client)->Attach(layout, "e2e", 64, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  v1::CreateSequenceRequest create;
  create.set_sequence_id("r");
  *create.mutable_policy() = StreamingPolicy(2);
  *create.mutable_budget() = MakeBudget(5);
  create.set_retain_evicted(true);
  ASSERT_TRUE((*session)->CreateSequence(create).ok());
  constexpr uint64_t kSeed = 5;
  ASSERT_TRUE(WriteTokens(**session, "r", 12, kSeed, /*compress_if_over_budget=*/true).ok());

  v1::GetRetainedRequest request;
  request.set_sequence_id("r");
  auto retained = (*session)->GetRetained(request);
  ASSERT_TRUE(retained.ok()) << retained.status();
  ASSERT_EQ(retained->heads_size(), 2 * 2);
  for (const v1::GetRetainedResponse::Head& head : retained->heads()) {
    // StreamingLLM with 2 sinks keeps 0, 1 and the newest 3 (9..11): 2..8 left.
    EXPECT_THAT(head.positions(), ElementsAre(2, 3, 4, 5, 6, 7, 8));
    ASSERT_EQ(head.scores_size(), 7);
    std::string keys, values;
    for (int p : head.positions()) {
      const std::vector<uint8_t> k = PatternRow(layout, kSeed, head.layer(), 0, head.head(), p);
      const std::vector<uint8_t> v = PatternRow(layout, kSeed, head.layer(), 1, head.head(), p);
      keys.append(k.begin(), k.end());
      values.append(v.begin(), v.end());
    }
    EXPECT_EQ(head.keys(), keys) << "layer " << head.layer() << " head " << head.head();
    EXPECT_EQ(head.values(), values);
  }
  request.add_layers(1);
  retained = (*session)->GetRetained(request);
  ASSERT_TRUE(retained.ok());
  ASSERT_EQ(retained->heads_size(), 2);
  EXPECT_EQ(retained->heads(0).layer(), 1);
  request.set_layers(0, 9);
  EXPECT_THAT(MessageOf((*session)->GetRetained(request).status()), HasSubstr("layers[0]"));

  // Admin lists the sequence with its host bytes.
  auto admin = server_->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListSequences((*session)->session_id());
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->sequences_size(), 1);
  EXPECT_GT(listed->sequences(0).host_bytes(), 0u);

  // A sequence created without the option has nothing to return.
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "plain").ok());
  request.clear_layers();
  request.set_sequence_id("plain");
  auto status = (*session)->GetRetained(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(status), HasSubstr("retain_evicted"));
}

}  // namespace
}  // namespace kvs_e2e
