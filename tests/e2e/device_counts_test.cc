// End to end, on the simulated device (--backend=device-sim): the shape of a decode step and of a
// compress, counted by the compute seam (gpu/device_counters.h) and read through Admin.GetStats
// around each call (bench/rpc_shape.h). A device path is fast when a call's round trips and
// bytes do not grow with the batch: for every evicting policy, a DecodeStep of 64 sequences x 32
// layers makes as many backend calls and synchronisations as one of 1 sequence x 4 layers (at
// most 8 calls) and writes the arena from the host at most once; where the policy's step runs on
// the device (Policy::DeviceDecode), at most 2 synchronisations, and it brings back at most one
// int32 per (sequence, layer, kv head) beyond what the response holds. A Compress of 32 layers
// makes as many calls and synchronisations as one of 4. These counts are
// what the same calls cost on a GPU, where each synchronisation is a round trip of microseconds
// and a call a staged launch.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/rpc_shape.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using kvs::bench::RpcShape;
using kvs::bench::ShapeOptions;

// A small model with the shape of a large batch: 2 kv heads of 64 dims, 48 tokens per sequence.
ShapeOptions SmallModel() {
  ShapeOptions options;
  options.kv_heads = 2;
  options.q_heads = 8;
  options.head_dim = 64;
  options.prefill = 48;
  options.window = 32;
  return options;
}

std::string Describe(const RpcShape& shape) { return kvs::bench::FormatShape(shape); }

class DeviceCountsTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    ServerProcess::Options options;
    options.extra_args = {"--backend=device-sim", "--arena_capacity_bytes=1Gi"};
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
  }

  RpcShape Decode(int sequences, int layers, const ShapeOptions& options) {
    auto shape =
        kvs::bench::MeasureDecodeStep(*client_, *admin_, GetParam(), sequences, layers, options);
    EXPECT_TRUE(shape.ok()) << shape.status();
    return shape.ok() ? *shape : RpcShape();
  }

  // Policies whose decode step runs where the layer lives (Policy::DeviceDecode): their state
  // stays on the device and only the evicted slots come back. The others' steps run on the host
  // (SnapKV's pooling by position, CAKE's window statistics, CAOTE's output errors, D2O's merge):
  // batched all the same, but each call that brings scores back waits for them.
  static bool HasDeviceRule(const std::string& policy) {
    return policy == "streaming_llm" || policy == "keydiff" || policy == "knorm" ||
           policy == "h2o" || policy == "tova";
  }

  // The bounds of a decode step's device path, against the same step of 1 sequence x 4 layers.
  void ExpectBatchedDecode(const ShapeOptions& options) {
    const RpcShape small = Decode(1, 4, options);
    const RpcShape big = Decode(64, 32, options);
    SCOPED_TRACE(Describe(small));
    SCOPED_TRACE(Describe(big));
    EXPECT_LE(big.calls, 8u);
    EXPECT_EQ(big.calls, small.calls);
    EXPECT_EQ(big.syncs, small.syncs);
    EXPECT_LE(big.arena_writes, 1u);
    if (!HasDeviceRule(GetParam())) return;
    EXPECT_LE(big.syncs, 2u);
    const uint64_t per_head = 4ull * big.sequences * big.layers * big.kv_heads;
    EXPECT_LE(big.down_bytes, per_head + big.response_bytes);
  }

  static inline ServerProcess* server_ = nullptr;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
};

TEST_P(DeviceCountsTest, AnInlineDecodeStepOf64SequencesAnd32LayersCostsWhatOneSequenceDoes) {
  ExpectBatchedDecode(SmallModel());
}

TEST_P(DeviceCountsTest, AReservedDecodeStepOf64SequencesAnd32LayersCostsWhatOneSequenceDoes) {
  ShapeOptions options = SmallModel();
  options.inline_kv = false;  // the rows the worker wrote are checked on the device
  ExpectBatchedDecode(options);
}

TEST_P(DeviceCountsTest, AStepWithStagedQueriesAndReservedRowsCarriesNoTensorBytes) {
  ShapeOptions options = SmallModel();
  options.inline_kv = false;
  options.staged_queries = true;
  ExpectBatchedDecode(options);
  const RpcShape step = Decode(64, 32, options);
  // 64 items of names, ids and offsets: no K/V (32 KiB a token) and no queries (64 KiB).
  EXPECT_LT(step.request_bytes, 64u * 200) << Describe(step);
}

TEST_P(DeviceCountsTest, ACompressOf32LayersCostsWhatOneOf4Does) {
  const ShapeOptions options = SmallModel();
  auto small = kvs::bench::MeasureCompress(*client_, *admin_, GetParam(), 4, options);
  auto big = kvs::bench::MeasureCompress(*client_, *admin_, GetParam(), 32, options);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(big.ok()) << big.status();
  SCOPED_TRACE(Describe(*small));
  SCOPED_TRACE(Describe(*big));
  EXPECT_EQ(big->calls, small->calls);
  EXPECT_EQ(big->syncs, small->syncs);
}

INSTANTIATE_TEST_SUITE_P(EveryEvictingPolicy, DeviceCountsTest,
                         ::testing::ValuesIn(kvs::bench::EvictingPolicies()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace kvs_e2e
