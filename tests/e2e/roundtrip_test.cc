// End to end against the real server binary over loopback: zero-copy writes through the mapped
// arena, compression with KeyDiff and StreamingLLM, read back in place and through Export bit for
// bit; inline Append with 1 and 4 MiB chunks, batch Append, BatchReserve/BatchCommit, per-layer
// reservations and CancelReservation, every dtype.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/base/dtype.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"
#include "tests/test_backend.h"

namespace kvs_e2e {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::SizeIs;

class RoundTripTest : public SharedServerTest<RoundTripTest> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  std::unique_ptr<kvsidecar::Session> Attach(const v1::ModelLayout& layout, int num_blocks) {
    auto session = client_->Attach(layout, "e2e", num_blocks, /*lease_ms=*/30000);
    EXPECT_TRUE(session.ok()) << session.status() << "\n" << server_->Logs();
    return session.ok() ? std::move(*session) : nullptr;
  }

  std::unique_ptr<kvsidecar::Client> client_;
};

// The KeyDiff score (keydiff.md §3.1, default anchor) of every position of one (layer, head),
// computed in double from the keys the test wrote.
std::vector<double> KeyDiffScores(const v1::ModelLayout& layout, uint64_t seed, int layer, int head,
                                  int tokens) {
  const int dim = layout.head_dim();
  const auto dtype = static_cast<kvs::DType>(layout.dtype());
  std::vector<std::vector<double>> keys(tokens, std::vector<double>(dim));
  std::vector<double> anchor(dim, 0.0);
  for (int p = 0; p < tokens; ++p) {
    const auto row = PatternRow(layout, seed, layer, /*kv=*/0, head, p);
    double norm = 0;
    for (int d = 0; d < dim; ++d) {
      keys[p][d] = kvs::LoadAsFloat(row.data(), dtype, d);
      norm += keys[p][d] * keys[p][d];
    }
    norm = std::max(std::sqrt(norm), 1e-12);
    for (int d = 0; d < dim; ++d) anchor[d] += keys[p][d] / norm / tokens;
  }
  const double anchor_norm =
      std::sqrt(std::inner_product(anchor.begin(), anchor.end(), anchor.begin(), 0.0));
  std::vector<double> scores(tokens);
  for (int p = 0; p < tokens; ++p) {
    const double dot = std::inner_product(keys[p].begin(), keys[p].end(), anchor.begin(), 0.0);
    const double norm =
        std::sqrt(std::inner_product(keys[p].begin(), keys[p].end(), keys[p].begin(), 0.0));
    scores[p] = -dot / (std::max(norm, 1e-8) * std::max(anchor_norm, 1e-8));
  }
  return scores;
}

TEST_F(RoundTripTest, KeyDiffZeroCopyCompressReadsBackBitForBit) {
  const v1::ModelLayout layout = MakeLayout(4, 2, 8, 64, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 256);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->layout().block_tokens(), 16);
  EXPECT_EQ(session->arena().kind(), kvs::testing_util::TestBackendName() == "cuda"
                                         ? v1::ArenaHandle::KIND_CUDA_IPC
                                         : v1::ArenaHandle::KIND_MEMFD);
  EXPECT_TRUE(PollUntil([&] { return session->watching(); }, absl::Seconds(30)));

  // A witness sequence that nobody compresses: must stay intact through everything below.
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), std::nullopt, "witness").ok());
  ASSERT_TRUE(WriteTokens(*session, "witness", 40, /*seed=*/99).ok());

  auto created = session->CreateSequence(KeyDiffPolicy(), MakeBudget(64), "kd");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->sequence_id(), "kd");
  const uint64_t seed = 11;
  for (int round = 0; round < 2; ++round) {
    auto committed = WriteTokens(*session, "kd", 128, seed);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_THAT(committed->counts(), Each(128 * (round + 1)));
    EXPECT_EQ(committed->evicted(), 0);
  }
  // Before compression every written token reads back exactly, in position order.
  auto full = VerifySequence(*session, "kd", seed);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->rows, 4 * 2 * 256);

  kvsidecar::CompressOptions options;
  options.return_positions = true;
  auto compressed = session->Compress("kd", options);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  ASSERT_THAT(compressed->layers(), SizeIs(4));
  EXPECT_EQ(compressed->blocks_freed(), 4 * (16 - 4));
  auto layout_after = session->GetLayout("kd");
  ASSERT_TRUE(layout_after.ok());
  for (int layer = 0; layer < 4; ++layer) {
    const auto& result = compressed->layers(layer);
    EXPECT_EQ(result.layer(), layer);
    EXPECT_EQ(result.kept(), 64);
    EXPECT_EQ(result.evicted(), 192);
    // The response's positions are the position table, slot order.
    EXPECT_THAT(result.positions(),
                ::testing::ElementsAreArray(layout_after->layers(layer).positions()));
    EXPECT_EQ(layout_after->layers(layer).block_table_size(), 4);
  }

  auto kept = VerifySequence(*session, "kd", seed);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_THAT(kept->counts, ElementsAre(64, 64, 64, 64));
  EXPECT_EQ(kept->rows, 4 * 2 * 64);

  // The kept set is KeyDiff's: every position clearly above the 64th score is kept, every one
  // clearly below is evicted (a tiny band around the threshold absorbs fp32 rounding).
  for (int layer = 0; layer < 4; ++layer) {
    for (int head = 0; head < 2; ++head) {
      const auto scores = KeyDiffScores(layout, seed, layer, head, 256);
      std::vector<double> sorted = scores;
      std::sort(sorted.rbegin(), sorted.rend());
      const double threshold = sorted[63];
      const auto& held = kept->positions[layer][head];
      for (int p = 0; p < 256; ++p) {
        const bool is_kept = std::find(held.begin(), held.end(), p) != held.end();
        if (scores[p] > threshold + 1e-5) {
          EXPECT_TRUE(is_kept) << "layer " << layer << " head " << head << " position " << p;
        }
        if (scores[p] < threshold - 1e-5) {
          EXPECT_FALSE(is_kept) << "layer " << layer << " head " << head << " position " << p;
        }
      }
    }
  }

  // Compressing again within budget changes nothing.
  auto again = session->Compress("kd");
  ASSERT_TRUE(again.ok());
  for (const auto& result : again->layers()) EXPECT_EQ(result.evicted(), 0);

  // New tokens after compression continue at position 256 and fill the kept layout.
  auto more = WriteTokens(*session, "kd", 8, seed);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_THAT(more->counts(), Each(72));
  auto extended = VerifySequence(*session, "kd", seed);
  ASSERT_TRUE(extended.ok()) << extended.status();
  for (int head = 0; head < 2; ++head) {
    EXPECT_EQ(
        *std::max_element(extended->positions[0][head].begin(), extended->positions[0][head].end()),
        263);
  }

  auto witness = VerifySequence(*session, "witness", 99);
  ASSERT_TRUE(witness.ok()) << witness.status();
  EXPECT_THAT(witness->counts, Each(40));
  EXPECT_TRUE(session->ReleaseSequence("kd").ok());
  EXPECT_TRUE(session->Detach().ok());
}

TEST_F(RoundTripTest, StreamingLlmKeepsSinksAndRecentTokens) {
  const v1::ModelLayout layout = MakeLayout(3, 2, 4, 32, v1::DTYPE_BFLOAT16, 8);
  auto session = Attach(layout, 512);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(20), "sl").ok());
  const uint64_t seed = 5;
  ASSERT_TRUE(WriteTokens(*session, "sl", 50, seed).ok());
  ASSERT_TRUE(WriteTokens(*session, "sl", 50, seed).ok());
  auto compressed = session->Compress("sl");
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  for (const auto& result : compressed->layers()) {
    EXPECT_EQ(result.kept(), 20);
    EXPECT_EQ(result.evicted(), 80);
  }
  auto kept = VerifySequence(*session, "sl", seed);
  ASSERT_TRUE(kept.ok()) << kept.status();
  std::vector<int> expected = {0, 1, 2, 3};
  for (int p = 84; p < 100; ++p) expected.push_back(p);
  for (int layer = 0; layer < 3; ++layer) {
    for (int head = 0; head < 2; ++head) {
      std::vector<int> held = kept->positions[layer][head];
      std::sort(held.begin(), held.end());
      EXPECT_EQ(held, expected) << "layer " << layer << " head " << head;
    }
  }
  // Commit with compress_if_over_budget keeps the sequence at its budget.
  auto committed = WriteTokens(*session, "sl", 10, seed, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_THAT(committed->counts(), Each(20));
  EXPECT_EQ(committed->evicted(), 10);
  auto after = VerifySequence(*session, "sl", seed);
  ASSERT_TRUE(after.ok()) << after.status();
  expected = {0, 1, 2, 3};
  for (int p = 94; p < 110; ++p) expected.push_back(p);
  std::vector<int> held = after->positions[1][1];
  std::sort(held.begin(), held.end());
  EXPECT_EQ(held, expected);
}

// Compaction works on blocks first: StreamingLLM's evicted middle leaves the block table without
// a copy, the recent window's blocks (the fullest) form the new table where they are, and only
// the sinks move into its holes (hole filling over the whole table moved every kept token past
// the budget; keeping the first blocks moved a whole block per head).
TEST_F(RoundTripTest, StreamingLlmCompressCopiesOnlyPartlyKeptBlocks) {
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 32, v1::DTYPE_FLOAT16, 16);
  auto session = Attach(layout, 128);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(64), "blocks").ok());
  const uint64_t seed = 23;
  ASSERT_TRUE(WriteTokens(*session, "blocks", 256, seed).ok());
  auto compressed = session->Compress("blocks");
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  // Kept: positions 0..3 (block 0) and 196..255 (12 in block 12, blocks 13..15 whole). Blocks
  // 1..11 leave the table; the new one is blocks 13, 14, 15, 12 (fullest first), and block 0's
  // 4 sinks fill block 12's 4 holes, so per (layer, head) 4 tokens x (K, V) x 32 dims x 2 bytes
  // move, and block 0 is freed too.
  EXPECT_EQ(compressed->bytes_copied(), 2u * 2 * 4 * 2 * 32 * 2);
  EXPECT_EQ(compressed->blocks_freed(), 2 * (16 - 4));
  auto kept = VerifySequence(*session, "blocks", seed);  // every kept row is its position's
  ASSERT_TRUE(kept.ok()) << kept.status();
  std::vector<int> expected = {0, 1, 2, 3};
  for (int p = 196; p < 256; ++p) expected.push_back(p);
  for (int layer = 0; layer < 2; ++layer) {
    for (int head = 0; head < 2; ++head) {
      std::vector<int> held = kept->positions[layer][head];
      std::sort(held.begin(), held.end());
      EXPECT_EQ(held, expected) << "layer " << layer << " head " << head;
    }
  }
  auto layout_after = session->GetLayout("blocks");
  ASSERT_TRUE(layout_after.ok()) << layout_after.status();
  for (const auto& layer : layout_after->layers()) EXPECT_EQ(layer.block_table_size(), 4);
  // Decoding on from the compacted table appends and evicts as before.
  auto committed = WriteTokens(*session, "blocks", 10, seed, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_THAT(committed->counts(), Each(64));
  ASSERT_TRUE(VerifySequence(*session, "blocks", seed).ok());
}

TEST_F(RoundTripTest, StrictBudgetNeverHoldsMoreThanBudgetPlusBlock) {
  const v1::ModelLayout layout = MakeLayout(2, 2, 2, 16, v1::DTYPE_FLOAT32, 4);
  auto session = Attach(layout, 256);
  ASSERT_NE(session, nullptr);
  v1::Budget budget = MakeBudget(12);
  budget.set_strict(true);
  budget.set_prefill_block_tokens(8);
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), budget, "strict").ok());
  const uint64_t seed = 21;
  for (int block = 0; block < 6; ++block) {
    auto reservation = session->Reserve("strict", 8);
    ASSERT_TRUE(reservation.ok()) << reservation.status();
    EXPECT_EQ(reservation->positions()[0], block * 8);
    ASSERT_TRUE(WritePattern(*session, *reservation, seed).ok());
    auto committed = session->Commit(*reservation);
    ASSERT_TRUE(committed.ok()) << committed.status();
    for (int count : committed->counts()) EXPECT_LE(count, 12 + 8);
    auto verified = VerifySequence(*session, "strict", seed);
    ASSERT_TRUE(verified.ok()) << verified.status();
  }
  auto too_many = session->Reserve("strict", 9);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument) << too_many.status();
}

TEST_F(RoundTripTest, AppendAndExportRoundTripWithOneAndFourMiBChunks) {
  // 1024 tokens of L=4, H=4, D=128 fp16: an 8 MiB payload, several chunks of either size.
  const v1::ModelLayout layout = MakeLayout(4, 4, 8, 128, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 1024);
  ASSERT_NE(session, nullptr);
  std::vector<int> positions(1024);
  std::iota(positions.begin(), positions.end(), 0);
  for (size_t chunk : {size_t{1} << 20, size_t{4} << 20}) {
    SCOPED_TRACE(chunk);
    const std::string seq = absl::StrCat("append-", chunk);
    const uint64_t seed = 40 + chunk;
    ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, seq).ok());
    const std::string payload = PatternPayload(layout, seed, {}, positions);
    ASSERT_EQ(payload.size(), size_t{8} << 20);
    kvsidecar::AppendSegment segment;
    segment.sequence_id = seq;
    segment.num_tokens = 1024;
    segment.payload =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    kvsidecar::AppendOptions options;
    options.chunk_bytes = chunk;
    auto appended = session->Append(segment, options);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_EQ(appended->bytes_received(), payload.size());
    ASSERT_THAT(appended->items(), SizeIs(1));
    EXPECT_EQ(appended->items(0).sequence_id(), seq);
    EXPECT_THAT(appended->items(0).counts(), Each(1024));

    // Nothing evicted: Export's payload is the appended payload, byte for byte.
    auto exported = session->Export(seq, {}, static_cast<uint32_t>(chunk));
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(exported->header.payload_bytes(), payload.size());
    EXPECT_TRUE(exported->payload == payload);
    auto verified = VerifySequence(*session, seq, seed);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_EQ(verified->rows, 4 * 4 * 1024);
    ASSERT_TRUE(session->ReleaseSequence(seq).ok());
  }
}

TEST_F(RoundTripTest, BatchAppendOfSeveralSequencesInOneStream) {
  const v1::ModelLayout layout = MakeLayout(4, 2, 2, 32, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 512);
  ASSERT_NE(session, nullptr);
  std::vector<std::string> payloads;
  std::vector<kvsidecar::AppendSegment> segments;
  const std::vector<int> tokens = {5, 33, 17};
  payloads.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string seq = absl::StrCat("batch-", i);
    ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(16), seq).ok());
    std::vector<int> positions(tokens[i]);
    std::iota(positions.begin(), positions.end(), 0);
    payloads.push_back(PatternPayload(layout, 70 + i, {}, positions));
    kvsidecar::AppendSegment segment;
    segment.sequence_id = seq;
    segment.num_tokens = tokens[i];
    segment.payload = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payloads[i].data()),
                                          payloads[i].size());
    segment.compress_if_over_budget = true;
    segments.push_back(segment);
  }
  // A segment for only some layers: the other layers get nothing.
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "partial").ok());
  const std::string partial = PatternPayload(layout, 80, {1, 3}, {0, 1, 2});
  kvsidecar::AppendSegment layered;
  layered.sequence_id = "partial";
  layered.num_tokens = 3;
  layered.layers = {1, 3};
  layered.payload =
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(partial.data()), partial.size());
  segments.push_back(layered);

  kvsidecar::AppendOptions options;
  options.chunk_bytes = 1000;  // many small chunks, not aligned to rows
  auto appended = session->BatchAppend(segments, options);
  ASSERT_TRUE(appended.ok()) << appended.status();
  ASSERT_THAT(appended->items(), SizeIs(4));
  EXPECT_THAT(appended->items(0).counts(), Each(5));
  EXPECT_THAT(appended->items(1).counts(), Each(16));  // compressed to the budget
  EXPECT_EQ(appended->items(1).evicted(), 17);
  EXPECT_THAT(appended->items(2).counts(), Each(16));
  EXPECT_THAT(appended->items(3).counts(), ElementsAre(0, 3, 0, 3));
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto verified = VerifySequence(*session, absl::StrCat("batch-", i), 70 + i);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_THAT(verified->counts, Each(std::min(tokens[i], 16)));
  }
  auto verified = VerifySequence(*session, "partial", 80);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ElementsAre(0, 3, 0, 3));
}

TEST_F(RoundTripTest, BatchReserveAndBatchCommit) {
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 64, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 256);
  ASSERT_NE(session, nullptr);
  std::vector<kvsidecar::ReserveItem> items;
  for (int i = 0; i < 3; ++i) {
    const std::string seq = absl::StrCat("br-", i);
    ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, seq).ok());
    items.push_back({seq, 3 + i, {}});
  }
  for (int step = 0; step < 3; ++step) {
    auto reservations = session->BatchReserve(items);
    ASSERT_TRUE(reservations.ok()) << reservations.status();
    ASSERT_THAT(*reservations, SizeIs(3));
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ((*reservations)[i].sequence_id(), items[i].sequence_id);
      EXPECT_EQ((*reservations)[i].num_tokens(), 3 + i);
      EXPECT_EQ((*reservations)[i].positions()[0], step * (3 + i));
      ASSERT_TRUE(WritePattern(*session, (*reservations)[i], 100 + i).ok());
    }
    auto committed = session->BatchCommit(*reservations);
    ASSERT_TRUE(committed.ok()) << committed.status();
    ASSERT_THAT(committed->responses(), SizeIs(3));
    for (int i = 0; i < 3; ++i) {
      EXPECT_THAT(committed->responses(i).counts(), Each((step + 1) * (3 + i)));
    }
  }
  // A batch with one bad item reserves nothing: the good items can be reserved right after.
  std::vector<kvsidecar::ReserveItem> bad = items;
  bad[2].num_tokens = 0;
  auto refused = session->BatchReserve(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  auto reservations = session->BatchReserve(items);
  ASSERT_TRUE(reservations.ok()) << reservations.status();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(WritePattern(*session, (*reservations)[i], 100 + i).ok());
  ASSERT_TRUE(session->BatchCommit(*reservations).ok());
  for (int i = 0; i < 3; ++i) {
    auto verified = VerifySequence(*session, items[i].sequence_id, 100 + i);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_THAT(verified->counts, Each(4 * (3 + i)));
  }
}

TEST_F(RoundTripTest, ReserveInALayerSubsetAndCancelReservation) {
  const v1::ModelLayout layout = MakeLayout(3, 2, 4, 64, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 64);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "sub").ok());
  // A cancelled reservation gives its slots back; nothing of it is ever visible.
  auto cancelled = session->Reserve("sub", 20);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  ASSERT_TRUE(WritePattern(*session, *cancelled, 7).ok());
  ASSERT_TRUE(session->CancelReservation(*cancelled).ok());
  EXPECT_EQ(session->Commit(*cancelled).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(session->CancelReservation(*cancelled).code(), absl::StatusCode::kFailedPrecondition);

  // Layers 2 and 0 only, in that order: layer 1 gets no tokens.
  const std::vector<int32_t> layers = {2, 0};
  auto reservation = session->Reserve("sub", 5, {}, layers);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  ASSERT_EQ(reservation->response().layers_size(), 2);
  EXPECT_EQ(reservation->response().layers(0).layer(), 2);
  EXPECT_EQ(reservation->response().layers(0).first_slot(), 0);
  EXPECT_EQ(reservation->response().layers(1).layer(), 0);
  ASSERT_TRUE(WritePattern(*session, *reservation, 8).ok());
  auto committed = session->Commit(*reservation);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_THAT(committed->counts(), ElementsAre(5, 0, 5));
  auto verified = VerifySequence(*session, "sub", 8);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ElementsAre(5, 0, 5));

  const std::vector<int32_t> out_of_range = {3};
  auto refused = session->Reserve("sub", 1, {}, out_of_range);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(refused.status()), ::testing::HasSubstr("layers[0] = 3 is out of range"));
}

TEST_F(RoundTripTest, EveryDtypeRoundTripsInPlaceAndInline) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const v1::ModelLayout layout = MakeLayout(2, 3, 6, 24, dtype, 4);
    auto session = Attach(layout, 128);
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), MakeBudget(6), "z").ok());
    ASSERT_TRUE(WriteTokens(*session, "z", 9, 7).ok());
    const std::string payload = PatternPayload(layout, 7, {}, {9, 10, 11, 12, 13});
    kvsidecar::AppendSegment segment;
    segment.sequence_id = "z";
    segment.num_tokens = 5;
    segment.payload =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    auto appended = session->Append(segment);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_THAT(appended->items(0).counts(), Each(14));
    ASSERT_TRUE(session->Compress("z").ok());
    auto verified = VerifySequence(*session, "z", 7);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_THAT(verified->counts, Each(6));
  }
}

TEST_F(RoundTripTest, OneSessionServesConcurrentCallers) {
  const v1::ModelLayout layout = MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16);
  auto session = Attach(layout, 512);
  ASSERT_NE(session, nullptr);
  constexpr int kThreads = 4;
  std::vector<absl::Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string seq = absl::StrCat("c", t);
      results[t] = [&]() -> absl::Status {
        auto created = session->CreateSequence(KeyDiffPolicy(), MakeBudget(30), seq);
        if (!created.ok()) return created.status();
        for (int round = 0; round < 3; ++round) {
          auto committed = WriteTokens(*session, seq, 20, 200 + t);
          if (!committed.ok()) return committed.status();
        }
        auto compressed = session->Compress(seq);
        if (!compressed.ok()) return compressed.status();
        auto verified = VerifySequence(*session, seq, 200 + t);
        if (!verified.ok()) return verified.status();
        for (int count : verified->counts) {
          if (count != 30) return absl::InternalError(absl::StrCat(seq, " holds ", count));
        }
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(results[t].ok()) << t << ": " << results[t];
}

}  // namespace
}  // namespace kvs_e2e
