// End to end: every kind of bad input the contract names gets its gRPC code and a message naming
// the field, changes nothing, and afterwards the server still serves and other sequences (in the
// same session and in another one) are intact bit for bit.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <limits>
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

constexpr uint64_t kWitnessSeed = 1;
constexpr uint64_t kOtherSeed = 2;

#define EXPECT_CODE(expr, expected_code, substring)                                \
  do {                                                                             \
    const absl::Status kvs_status_ = (expr);                                       \
    EXPECT_EQ(kvs_status_.code(), absl::StatusCode::expected_code) << kvs_status_; \
    EXPECT_THAT(MessageOf(kvs_status_), HasSubstr(substring)) << kvs_status_;      \
  } while (0)

class BadInputTest : public SharedServerTest<BadInputTest> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    layout_ = MakeLayout(4, 2, 4, 64, v1::DTYPE_FLOAT16);
    auto session = client_->Attach(layout_, "e2e", 64, 30000);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
    auto other = client_->Attach(layout_, "e2e-other", 64, 30000);
    ASSERT_TRUE(other.ok()) << other.status();
    other_ = std::move(*other);
    // Witnesses: a sequence in the same session and one in another session.
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(24), "witness").ok());
    ASSERT_TRUE(WriteTokens(*session_, "witness", 40, kWitnessSeed).ok());
    ASSERT_TRUE(other_->CreateSequence(StreamingPolicy(4), MakeBudget(24), "other").ok());
    ASSERT_TRUE(WriteTokens(*other_, "other", 30, kOtherSeed).ok());
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(16), "target").ok());
    ASSERT_TRUE(WriteTokens(*session_, "target", 10, 3).ok());
  }

  // The server still serves, and nothing bad inputs touched changed.
  void TearDown() override {
    if (server_ == nullptr || session_ == nullptr || other_ == nullptr) return;
    auto witness = VerifySequence(*session_, "witness", kWitnessSeed);
    ASSERT_TRUE(witness.ok()) << witness.status();
    EXPECT_THAT(witness->counts, Each(40));
    auto other = VerifySequence(*other_, "other", kOtherSeed);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_THAT(other->counts, Each(30));
    auto target = VerifySequence(*session_, "target", 3);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_THAT(target->counts, Each(10));
    // A fresh sequence still works end to end.
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "after").ok());
    ASSERT_TRUE(WriteTokens(*session_, "after", 12, 4).ok());
    ASSERT_TRUE(session_->Compress("after").ok());
    auto after = VerifySequence(*session_, "after", 4);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_THAT(after->counts, Each(8));
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_GE(stats->sessions(), 2);
    EXPECT_TRUE(server_->process().Running()) << server_->Logs();
  }

  // Append with a raw segment (the library computes payload_bytes from the payload).
  absl::Status AppendRaw(const v1::AppendHeader& header, const std::vector<std::string>& data,
                         bool send_header = true) {
    grpc::ClientContext context;
    v1::AppendResponse response;
    auto writer = session_->stub()->Append(&context, &response);
    v1::AppendChunk chunk;
    bool open = true;
    if (send_header) {
      *chunk.mutable_header() = header;
      chunk.mutable_header()->set_session_id(session_->session_id());
      open = writer->Write(chunk);
    }
    for (const std::string& piece : data) {
      if (!open) break;
      chunk.set_data(piece);
      open = writer->Write(chunk);
    }
    if (open) writer->WritesDone();
    return kvsidecar::ToStatus(writer->Finish());
  }

  std::unique_ptr<kvsidecar::Client> client_;
  v1::ModelLayout layout_;
  std::unique_ptr<kvsidecar::Session> session_;
  std::unique_ptr<kvsidecar::Session> other_;
};

TEST_F(BadInputTest, AttachRejectsBadLayoutsAndSizes) {
  v1::ModelLayout layout = layout_;
  layout.set_head_dim(0);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.head_dim");
  layout = layout_;
  layout.set_num_q_heads(3);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.num_q_heads");
  layout = layout_;
  layout.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.dtype");
  layout = layout_;
  layout.set_num_layers(5000);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.num_layers");
  layout = layout_;
  layout.set_num_kv_heads(-1);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.num_kv_heads");
  // A block over the per-block limit: 2 * 1024 * 1024 * 4096 * 4 bytes.
  layout = MakeLayout(1, 1024, 1024, 4096, v1::DTYPE_FLOAT32, 1024);
  EXPECT_CODE(client_->Attach(layout).status(), kInvalidArgument, "layout.");
  EXPECT_CODE(client_->Attach(layout_, "e2e", -1).status(), kInvalidArgument, "num_blocks");
  EXPECT_CODE(client_->Attach(layout_, "e2e", 64, -5).status(), kInvalidArgument, "lease_ms");
  // More blocks than the pool can ever hold (the product does not fit in the capacity).
  EXPECT_CODE(client_->Attach(layout_, "e2e", std::numeric_limits<int32_t>::max()).status(),
              kResourceExhausted, "num_blocks");
  v1::AttachRequest request;
  *request.mutable_layout() = layout_;
  request.set_staging_bytes(std::numeric_limits<uint64_t>::max());
  EXPECT_CODE(client_->Attach(request).status(), kInvalidArgument, "staging_bytes");
  request.set_staging_bytes(0);
  request.set_tenant(std::string(1, '\x01'));
  EXPECT_CODE(client_->Attach(request).status(), kInvalidArgument, "tenant");
}

TEST_F(BadInputTest, UnknownSessionsAndSequencesAreNotFound) {
  v1::ReserveRequest reserve;
  reserve.set_session_id("no-such-session");
  reserve.set_sequence_id("target");
  reserve.set_num_tokens(1);
  v1::ReserveResponse reserved;
  grpc::ClientContext context;
  EXPECT_CODE(kvsidecar::ToStatus(session_->stub()->Reserve(&context, reserve, &reserved)),
              kNotFound, "session");
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_session_id("no-such-session");
  v1::HeartbeatResponse beat;
  grpc::ClientContext heartbeat_context;
  EXPECT_CODE(
      kvsidecar::ToStatus(session_->stub()->Heartbeat(&heartbeat_context, heartbeat, &beat)),
      kNotFound, "session");
  // A sequence of another session is unknown here, whatever its name.
  EXPECT_CODE(session_->Reserve("other", 1).status(), kNotFound, "sequence other");
  EXPECT_CODE(session_->Reserve("nope", 1).status(), kNotFound, "sequence nope");
  EXPECT_CODE(session_->GetLayout("nope").status(), kNotFound, "nope");
  EXPECT_CODE(session_->Export("nope").status(), kNotFound, "nope");
  EXPECT_CODE(session_->Compress("nope").status(), kNotFound, "nope");
  EXPECT_CODE(session_->ReleaseSequence("nope").status(), kNotFound, "nope");
  kvsidecar::AppendSegment segment;
  segment.sequence_id = "nope";
  segment.num_tokens = 1;
  const std::string payload = PatternPayload(layout_, 9, {}, {0});
  segment.payload =
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
  EXPECT_CODE(session_->Append(segment).status(), kNotFound, "nope");
}

TEST_F(BadInputTest, CreateSequenceRejectsBadBudgetsAndPolicies) {
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(0), "b0").status(),
              kInvalidArgument, "budget.tokens_per_layer");
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(-5), "b1").status(),
              kInvalidArgument, "budget.tokens_per_layer");
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget((1 << 24) + 1), "b2").status(),
              kInvalidArgument, "budget.tokens_per_layer");
  v1::Budget strict = MakeBudget(16);
  strict.set_strict(true);
  strict.set_prefill_block_tokens(-1);
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), strict, "b3").status(), kInvalidArgument,
              "budget.prefill_block_tokens");
  v1::PolicySpec bogus;
  bogus.set_name("bogus");
  EXPECT_CODE(session_->CreateSequence(bogus, MakeBudget(8), "b4").status(), kInvalidArgument,
              "policy.name");
  v1::PolicySpec omnikv;
  omnikv.set_name("omnikv");
  EXPECT_CODE(session_->CreateSequence(omnikv, MakeBudget(8), "b5").status(), kInvalidArgument,
              "policy.omnikv.filter_layers is required");
  v1::PolicySpec keydiff = KeyDiffPolicy();
  keydiff.mutable_keydiff()->set_recent_fraction(1.5f);
  EXPECT_CODE(session_->CreateSequence(keydiff, MakeBudget(8), "b6").status(), kInvalidArgument,
              "recent_fraction");
  EXPECT_CODE(session_->CreateSequence(StreamingPolicy(-1), MakeBudget(8), "b7").status(),
              kInvalidArgument, "n_sink");
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "target").status(),
              kAlreadyExists, "target");
  EXPECT_CODE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "bad id!").status(),
              kInvalidArgument, "sequence_id");
  v1::CreateSequenceRequest retain;
  retain.set_retain_evicted(true);
  retain.mutable_policy()->set_name("omnikv");
  EXPECT_CODE(session_->CreateSequence(retain).status(), kInvalidArgument, "retain_evicted");
  // None of them was created.
  for (const char* id : {"b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"}) {
    EXPECT_EQ(session_->GetLayout(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
}

TEST_F(BadInputTest, ReserveRejectsBadShapesAndPositions) {
  EXPECT_CODE(session_->Reserve("target", 0).status(), kInvalidArgument, "num_tokens");
  EXPECT_CODE(session_->Reserve("target", -3).status(), kInvalidArgument, "num_tokens");
  EXPECT_CODE(session_->Reserve("target", std::numeric_limits<int32_t>::max()).status(),
              kInvalidArgument, "num_tokens");
  const std::vector<int32_t> two = {20, 21};
  EXPECT_CODE(session_->Reserve("target", 3, two).status(), kInvalidArgument, "positions");
  const std::vector<int32_t> decreasing = {30, 29};
  EXPECT_CODE(session_->Reserve("target", 2, decreasing).status(), kInvalidArgument, "positions");
  const std::vector<int32_t> old = {5, 50};  // 5 is already appended
  EXPECT_CODE(session_->Reserve("target", 2, old).status(), kInvalidArgument, "positions");
  const std::vector<int32_t> negative = {-1};
  EXPECT_CODE(session_->Reserve("target", 1, negative).status(), kInvalidArgument, "positions");
  const std::vector<int32_t> last = {std::numeric_limits<int32_t>::max()};
  auto edge = session_->Reserve("target", 1, last);
  if (edge.ok()) {  // a position at the very top is either refused or leaves no room after it
    ASSERT_TRUE(WritePattern(*session_, *edge, 3).ok());
    ASSERT_TRUE(session_->ReleaseSequence("target").ok());
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(16), "target").ok());
    ASSERT_TRUE(WriteTokens(*session_, "target", 10, 3).ok());
  } else {
    EXPECT_EQ(edge.status().code(), absl::StatusCode::kInvalidArgument) << edge.status();
    EXPECT_THAT(MessageOf(edge.status()), HasSubstr("position"));
  }
}

TEST_F(BadInputTest, ReservationStateErrors) {
  auto reservation = session_->Reserve("target", 4);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  // One outstanding reservation per sequence; compress must wait for the commit.
  EXPECT_CODE(session_->Reserve("target", 1).status(), kFailedPrecondition, "pending");
  EXPECT_CODE(session_->Compress("target").status(), kFailedPrecondition, "pending");
  // A commit of a reservation that does not exist.
  v1::CommitRequest commit;
  commit.set_session_id(session_->session_id());
  commit.set_sequence_id("target");
  commit.set_reservation_id(reservation->id() + 1000);
  v1::CommitResponse committed;
  grpc::ClientContext context;
  EXPECT_CODE(kvsidecar::ToStatus(session_->stub()->Commit(&context, commit, &committed)),
              kNotFound, "reservation");
  commit.set_reservation_id(0);
  grpc::ClientContext zero_context;
  EXPECT_CODE(kvsidecar::ToStatus(session_->stub()->Commit(&zero_context, commit, &committed)),
              kInvalidArgument, "reservation_id");
  // The client refuses rows outside the reservation before touching memory.
  EXPECT_EQ(reservation->RowPointer(0, 0, 0, 4).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reservation->RowPointer(4, 0, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reservation->RowPointer(0, 2, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(reservation->RowPointer(0, 0, 2, 0).status().code(), absl::StatusCode::kOutOfRange);
  const std::vector<uint8_t> short_row(10);
  EXPECT_EQ(session_->WriteReserved(*reservation, 0, 0, 0, 0, short_row).code(),
            absl::StatusCode::kInvalidArgument);

  // Commit writes 10..13 as usual; a second commit of the same reservation is refused.
  ASSERT_TRUE(WritePattern(*session_, *reservation, 3).ok());
  ASSERT_TRUE(session_->Commit(*reservation).ok());
  EXPECT_CODE(session_->Commit(*reservation).status(), kFailedPrecondition, "already committed");
  EXPECT_CODE(session_->BatchCommit({*reservation}).status(), kFailedPrecondition,
              "already committed");
  // Put "target" back to the 10 tokens TearDown expects.
  ASSERT_TRUE(session_->ReleaseSequence("target").ok());
  EXPECT_CODE(session_->Commit(*reservation).status(), kNotFound, "target");
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(16), "target").ok());
  ASSERT_TRUE(WriteTokens(*session_, "target", 10, 3).ok());
}

TEST_F(BadInputTest, AppendRejectsWrongShapesDtypesAndStreams) {
  const std::vector<int> positions = {10, 11, 12};
  v1::AppendHeader header;
  header.set_sequence_id("target");
  header.set_num_tokens(3);
  const std::string good = PatternPayload(layout_, 3, {}, positions);
  // The payload of an fp32 cache of the same shape: twice the bytes of this fp16 session.
  v1::ModelLayout fp32 = layout_;
  fp32.set_dtype(v1::DTYPE_FLOAT32);
  const std::string wrong_dtype = PatternPayload(fp32, 3, {}, positions);
  kvsidecar::AppendSegment segment;
  segment.sequence_id = "target";
  segment.num_tokens = 3;
  segment.payload =
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(wrong_dtype.data()), wrong_dtype.size());
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "payload_bytes");
  // Payload for 2 layers, header for all 4.
  const std::string two_layers = PatternPayload(layout_, 3, {0, 1}, positions);
  segment.payload =
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(two_layers.data()), two_layers.size());
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "payload_bytes");
  segment.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(good.data()), good.size());
  segment.layers = {0, 4, 1, 2};
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "layers");
  segment.layers = {0, 1, 1, 2};
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "layers");
  segment.layers = {};
  segment.num_tokens = 0;
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "num_tokens");
  segment.num_tokens = 3;
  segment.positions = {12, 11, 10};
  EXPECT_CODE(session_->Append(segment).status(), kInvalidArgument, "positions");
  segment.positions = {};

  // Sizes that overflow or lie, through the raw stream.
  header.set_payload_bytes(std::numeric_limits<uint64_t>::max());
  EXPECT_CODE(AppendRaw(header, {good}), kInvalidArgument, "payload_bytes");
  header.set_num_tokens(std::numeric_limits<int32_t>::max());
  EXPECT_CODE(AppendRaw(header, {good}), kInvalidArgument, "num_tokens");
  header.set_num_tokens(3);
  header.set_payload_bytes(good.size());
  EXPECT_CODE(AppendRaw(header, {good.substr(0, 100)}), kInvalidArgument, "payload_bytes");
  EXPECT_CODE(AppendRaw(header, {good + "xyz"}), kInvalidArgument, "payload_bytes");
  EXPECT_CODE(AppendRaw(header, {good}, /*send_header=*/false), kInvalidArgument, "header");
  // Data after a complete segment: the segments before the bad chunk stay committed (the message
  // says so); shown on a sequence of its own.
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), std::nullopt, "extra").ok());
  v1::AppendHeader extra = header;
  extra.set_sequence_id("extra");
  const std::string extra_payload = PatternPayload(layout_, 5, {}, {0, 1, 2});
  EXPECT_CODE(AppendRaw(extra, {extra_payload, "x"}), kInvalidArgument,
              "segments 0..0 were committed");
  auto extra_kept = VerifySequence(*session_, "extra", 5);
  ASSERT_TRUE(extra_kept.ok()) << extra_kept.status();
  EXPECT_THAT(extra_kept->counts, Each(3));

  // After all that the target can take a correct append (and drops it again for TearDown).
  segment.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(good.data()), good.size());
  auto appended = session_->Append(segment);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_THAT(appended->items(0).counts(), Each(13));
  auto verified = VerifySequence(*session_, "target", 3);
  ASSERT_TRUE(verified.ok()) << verified.status();
  ASSERT_TRUE(session_->ReleaseSequence("target").ok());
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(16), "target").ok());
  ASSERT_TRUE(WriteTokens(*session_, "target", 10, 3).ok());
}

TEST_F(BadInputTest, LayersOutOfRangeAndBadCompressArguments) {
  const std::vector<int32_t> too_high = {4};
  const std::vector<int32_t> negative = {-1};
  const std::vector<int32_t> repeated = {1, 1};
  EXPECT_CODE(session_->GetLayout("target", too_high).status(), kInvalidArgument, "layers");
  EXPECT_CODE(session_->GetLayout("target", negative).status(), kInvalidArgument, "layers");
  EXPECT_CODE(session_->GetLayout("target", repeated).status(), kInvalidArgument, "layers");
  EXPECT_CODE(session_->Export("target", too_high).status(), kInvalidArgument, "layers");
  EXPECT_CODE(session_->Export("target", negative).status(), kInvalidArgument, "layers");
  kvsidecar::CompressOptions options;
  options.budget_tokens = -1;
  EXPECT_CODE(session_->Compress("target", options).status(), kInvalidArgument, "budget_tokens");
  options.budget_tokens = std::numeric_limits<int32_t>::max();
  EXPECT_CODE(session_->Compress("target", options).status(), kInvalidArgument, "budget_tokens");
  options.budget_tokens = 0;  // refused by the client, as in every client
  EXPECT_CODE(session_->Compress("target", options).status(), kInvalidArgument,
              "budget_tokens=0 keeps no token");
  options.budget_tokens.reset();
  v1::PolicySpec bogus;
  bogus.set_name("bogus");
  options.policy = bogus;
  EXPECT_CODE(session_->Compress("target", options).status(), kInvalidArgument, "policy");
  v1::CompressRequest attention;
  attention.set_sequence_id("target");
  attention.mutable_attention()->set_num_queries(1);
  attention.mutable_attention()->set_softmax_scale(0.5f);
  attention.mutable_attention()->set_inline_queries("abc");  // not [layers][Hq][w][D] values
  EXPECT_CODE(session_->Compress(attention).status(), kInvalidArgument, "attention.inline_queries");
  attention.mutable_attention()->clear_inline_queries();
  attention.mutable_attention()->set_staging_offset(0);
  // This session reserved no staging area.
  EXPECT_CODE(session_->Compress(attention).status(), kInvalidArgument, "attention.staging_offset");
  // A layer subset works and names only those layers.
  const std::vector<int32_t> some = {3, 1};
  auto layout = session_->GetLayout("target", some);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->layers_size(), 2);
  EXPECT_EQ(layout->layers(0).layer(), 3);
  EXPECT_EQ(layout->layers(1).layer(), 1);
  // Slots out of range are refused by the client's in-place reader.
  EXPECT_EQ(session_->ReadRow(*layout, 3, 0, 0, 10).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(session_->ReadRow(*layout, 0, 0, 0, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(session_->ReadRow(*layout, 3, 0, 0, -1).status().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(BadInputTest, ExhaustedArenaAndPoolAreResourceExhausted) {
  // 8 blocks of 16 tokens for 4 layers: 32 tokens fit, 33 do not.
  auto small = client_->Attach(layout_, "e2e", 8, 30000);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE((*small)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  EXPECT_CODE((*small)->Reserve("s", 33).status(), kResourceExhausted, "free blocks");
  auto unchanged = (*small)->GetLayout("s");
  ASSERT_TRUE(unchanged.ok());
  for (const auto& layer : unchanged->layers()) EXPECT_EQ(layer.count(), 0);
  ASSERT_TRUE(WriteTokens(**small, "s", 32, 6).ok());
  EXPECT_CODE((*small)->Reserve("s", 1).status(), kResourceExhausted, "free blocks");
  ASSERT_TRUE((*small)->CreateSequence(KeyDiffPolicy(), std::nullopt, "t").ok());
  EXPECT_CODE((*small)->Reserve("t", 1).status(), kResourceExhausted, "free blocks");
  // Compressing frees blocks, and then there is room again.
  kvsidecar::CompressOptions options;
  options.budget_tokens = 16;
  ASSERT_TRUE((*small)->Compress("s", options).ok());
  ASSERT_TRUE(WriteTokens(**small, "t", 16, 7).ok());
  auto s = VerifySequence(**small, "s", 6);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->counts, Each(16));
  auto t = VerifySequence(**small, "t", 7);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(t->counts, Each(16));
  // The whole pool (1 GiB by default) cannot hold another 2 GiB session.
  // (blocks of 8 KiB: 2 heads * 16 tokens * 64 dims * 2 bytes * K and V).
  EXPECT_CODE(client_->Attach(layout_, "e2e", 1 << 18).status(), kResourceExhausted,
              "arena bytes free");
}

TEST_F(BadInputTest, BatchCallsAreAllOrNothing) {
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), std::nullopt, "batch").ok());
  std::vector<kvsidecar::ReserveItem> items = {{"batch", 2, {}}, {"nope", 2, {}}};
  EXPECT_CODE(session_->BatchReserve(items).status(), kNotFound, "nope");
  items = {{"batch", 2, {}}, {"target", 0, {}}};
  EXPECT_CODE(session_->BatchReserve(items).status(), kInvalidArgument, "requests[1].num_tokens");
  items = {{"batch", 2, {}}, {"batch", 2, {}}};
  EXPECT_CODE(session_->BatchReserve(items).status(), kInvalidArgument, "requests[1]");
  // Nothing was reserved by the failed batches.
  items = {{"batch", 2, {}}};
  auto reservations = session_->BatchReserve(items);
  ASSERT_TRUE(reservations.ok()) << reservations.status();
  ASSERT_TRUE(WritePattern(*session_, (*reservations)[0], 8).ok());
  ASSERT_TRUE(session_->BatchCommit(*reservations).ok());
  auto verified = VerifySequence(*session_, "batch", 8);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, Each(2));
}

TEST_F(BadInputTest, DecodeSelectAndTierCallsNameTheBadField) {
  // DecodeStep, Score and Select exist: a malformed item names itself.
  v1::DecodeStepRequest decode;
  decode.add_items()->set_sequence_id("target");
  decode.mutable_items(0)->set_inline_kv("short");
  EXPECT_CODE(session_->DecodeStep(decode).status(), kInvalidArgument, "items[0]");
  v1::SelectRequest select;
  select.add_items()->set_sequence_id("target");
  EXPECT_CODE(session_->Select(select).status(), kInvalidArgument,
              "items[0].attention is required");
  // Spill/Restore exist (tests/e2e/spill_test.cc): bad inputs name their field.
  v1::SpillRequest spill;
  spill.set_sequence_id("target");
  EXPECT_CODE(session_->Spill(spill).status(), kInvalidArgument, "target");
  spill.set_target(v1::TIER_HOST);
  spill.set_sequence_id("no-such-sequence");
  EXPECT_CODE(session_->Spill(spill).status(), kNotFound, "no-such-sequence");
  v1::RestoreRequest restore;
  restore.set_sequence_id(std::string(300, 'x'));
  EXPECT_CODE(session_->Restore(restore).status(), kInvalidArgument, "sequence_id");
}

TEST_F(BadInputTest, BatchItemIdsAreCheckedBeforeTheirSessionIsLookedUp) {
  // An item naming an unknown session and no sequence: the missing sequence_id is the request's
  // error, INVALID_ARGUMENT naming it, found in the one validation pass before any lookup (a
  // lookup first would answer NOT_FOUND for the session).
  v1::DecodeStepRequest decode;
  decode.add_items()->set_session_id("no-such-session");
  decode.mutable_items(0)->set_reservation_id(1);
  v1::DecodeStepResponse decoded;
  grpc::ClientContext decode_context;
  EXPECT_CODE(
      kvsidecar::ToStatus(session_->stub()->DecodeStep(&decode_context, decode, &decoded)),
      kInvalidArgument, "items[0].sequence_id must not be empty");
  v1::SelectRequest select;
  select.add_items()->set_session_id("no-such-session");
  v1::SelectResponse selected;
  grpc::ClientContext select_context;
  EXPECT_CODE(kvsidecar::ToStatus(session_->stub()->Select(&select_context, select, &selected)),
              kInvalidArgument, "items[0].sequence_id must not be empty");
}

// A session detached while one of its Append or Export streams is open: the stream's next step
// answers NOT_FOUND naming the session, as a call by id would, commits nothing, and the server
// keeps serving (the fixture's TearDown checks the other sessions).
TEST_F(BadInputTest, ASessionDetachedMidStreamEndsItsAppendAndExport) {
  // 8 MiB of export payload, far more than the stream's flow-control window holds, so that the
  // server is still producing chunks when the session ends.
  constexpr int kTokens = 4096;
  auto mid = client_->Attach(layout_, "e2e", kTokens * 4 / 16 + 8, 30000);
  ASSERT_TRUE(mid.ok()) << mid.status();
  auto created = (*mid)->CreateSequence(KeyDiffPolicy(), MakeBudget(kTokens + 16), "s");
  ASSERT_TRUE(created.ok()) << created.status();
  for (int written = 0; written < kTokens; written += 512) {
    ASSERT_TRUE(WriteTokens(**mid, "s", 512, 5).ok());
  }
  const std::string id = (*mid)->session_id();
  v1::Sidecar::Stub* stub = (*mid)->stub();
  auto free_blocks = [&] {
    grpc::ClientContext context;
    v1::HeartbeatRequest beat;
    beat.set_session_id(id);
    v1::HeartbeatResponse response;
    EXPECT_TRUE(stub->Heartbeat(&context, beat, &response).ok());
    return response.free_blocks();
  };
  const int32_t free_before = free_blocks();

  // Append: a segment of 4 tokens whose header has been taken (its reservation holds a new
  // block per layer) and half of its payload sent.
  const std::string payload =
      PatternPayload(layout_, 6, {}, {kTokens, kTokens + 1, kTokens + 2, kTokens + 3});
  grpc::ClientContext append_context;
  v1::AppendResponse appended;
  auto writer = stub->Append(&append_context, &appended);
  v1::AppendChunk piece;
  piece.mutable_header()->set_session_id(id);
  piece.mutable_header()->set_sequence_id("s");
  piece.mutable_header()->set_num_tokens(4);
  piece.mutable_header()->set_payload_bytes(payload.size());
  ASSERT_TRUE(writer->Write(piece));
  piece.set_data(payload.substr(0, payload.size() / 2));
  ASSERT_TRUE(writer->Write(piece));
  ASSERT_TRUE(PollUntil([&] { return free_blocks() < free_before; }, absl::Seconds(10)));

  // Export (of the sequence as the reservation left it): the header and one 64 KiB chunk.
  grpc::ClientContext export_context;
  v1::ExportRequest request;
  request.set_session_id(id);
  request.set_sequence_id("s");
  request.set_chunk_bytes(64 << 10);
  // A channel whose flow-control window stays small, so that most chunks wait for the reader.
  grpc::ChannelArguments small_window;
  small_window.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  small_window.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto slow = v1::Sidecar::NewStub(grpc::CreateCustomChannel(
      server_->data_target(), grpc::InsecureChannelCredentials(), small_window));
  auto reader = slow->Export(&export_context, request);
  v1::ExportChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_TRUE(chunk.has_header());
  ASSERT_TRUE(reader->Read(&chunk));

  // Then the session ends.
  ASSERT_TRUE((*mid)->Detach().ok());
  const std::string gone = "session " + id + " not found";
  piece.set_data(payload.substr(payload.size() / 2));
  if (writer->Write(piece)) writer->WritesDone();
  const grpc::Status append_end = writer->Finish();
  EXPECT_EQ(append_end.error_code(), grpc::StatusCode::NOT_FOUND) << append_end.error_message();
  EXPECT_THAT(append_end.error_message(), HasSubstr(gone));
  EXPECT_EQ(appended.items_size(), 0);
  while (reader->Read(&chunk)) {
  }
  const grpc::Status export_end = reader->Finish();
  EXPECT_EQ(export_end.error_code(), grpc::StatusCode::NOT_FOUND) << export_end.error_message();
  EXPECT_THAT(export_end.error_message(), HasSubstr(gone));
}

}  // namespace
}  // namespace kvs_e2e
