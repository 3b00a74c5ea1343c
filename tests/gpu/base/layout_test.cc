#include "gpu/base/layout.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

ModelLayout Llama8B() {
  ModelLayout layout;
  layout.num_layers = 32;
  layout.num_kv_heads = 8;
  layout.num_q_heads = 32;
  layout.head_dim = 128;
  layout.dtype = DType::kBFloat16;
  layout.block_tokens = 16;
  return layout;
}

void ExpectRejected(const ModelLayout& layout, const std::string& field) {
  const absl::Status status = layout.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_THAT(status.message(), HasSubstr(field));
}

TEST(ModelLayoutTest, AcceptsARealModelAndComputesItsGeometry) {
  const ModelLayout layout = Llama8B();
  ASSERT_TRUE(layout.Validate().ok());
  EXPECT_EQ(layout.row_bytes(), 256u);
  EXPECT_EQ(layout.block_bytes(), 2u * 8 * 16 * 128 * 2);
  EXPECT_EQ(layout.token_bytes(), 2u * 8 * 256);
  EXPECT_EQ(layout.RowOffsetInBlock(0, 0, 0), 0u);
  EXPECT_EQ(layout.RowOffsetInBlock(0, 0, 1), 256u);
  EXPECT_EQ(layout.RowOffsetInBlock(0, 1, 0), 16u * 256);
  EXPECT_EQ(layout.RowOffsetInBlock(1, 0, 0), 8u * 16 * 256);  // values follow all key heads
  EXPECT_EQ(layout.RowOffsetInBlock(1, 7, 15) + layout.row_bytes(), layout.block_bytes());
}

TEST(ModelLayoutTest, RejectsEachFieldByName) {
  ModelLayout layout = Llama8B();
  layout.num_layers = 0;
  ExpectRejected(layout, "layout.num_layers");
  layout.num_layers = kMaxLayers + 1;
  ExpectRejected(layout, "layout.num_layers");

  layout = Llama8B();
  layout.num_kv_heads = -1;
  ExpectRejected(layout, "layout.num_kv_heads");

  layout = Llama8B();
  layout.num_q_heads = kMaxHeads + 1;
  ExpectRejected(layout, "layout.num_q_heads");

  layout = Llama8B();
  layout.num_q_heads = 12;  // not a multiple of 8
  ExpectRejected(layout, "layout.num_q_heads");

  layout = Llama8B();
  layout.head_dim = 0;
  ExpectRejected(layout, "layout.head_dim");
  layout.head_dim = kMaxHeadDim + 1;
  ExpectRejected(layout, "layout.head_dim");

  layout = Llama8B();
  layout.block_tokens = 0;
  ExpectRejected(layout, "layout.block_tokens");
  layout.block_tokens = kMaxBlockTokens + 1;
  ExpectRejected(layout, "layout.block_tokens");

  layout = Llama8B();
  layout.dtype = static_cast<DType>(9);
  ExpectRejected(layout, "layout.dtype");
}

TEST(ModelLayoutTest, MessageReportsTheRangeAndValue) {
  ModelLayout layout = Llama8B();
  layout.head_dim = 0;
  EXPECT_EQ(layout.Validate().message(), "layout.head_dim must be in [1, 4096], got 0");
}

TEST(ModelLayoutTest, UsesTheGivenFieldPrefix) {
  ModelLayout layout = Llama8B();
  layout.num_layers = 0;
  EXPECT_THAT(layout.Validate("session.layout.").message(), HasSubstr("session.layout.num_layers"));
}

TEST(ModelLayoutTest, BlockSizeLimitIsInclusiveAndOverflowSafe) {
  ModelLayout layout = Llama8B();
  layout.dtype = DType::kFloat16;
  layout.num_kv_heads = 512;
  layout.num_q_heads = 512;
  layout.block_tokens = 1024;
  layout.head_dim = 1024;  // 2 * 512 * 1024 * 1024 * 2 = 2^31 exactly
  EXPECT_TRUE(layout.Validate().ok());
  EXPECT_EQ(layout.block_bytes(), kMaxBlockBytes);
  layout.head_dim = 1025;
  ExpectRejected(layout, "block too large");

  // Every field at its maximum: 2 * 1024 * 1024 * 4096 * 4 = 2^36 bytes, far past the limit.
  layout.num_kv_heads = kMaxHeads;
  layout.num_q_heads = kMaxHeads;
  layout.block_tokens = kMaxBlockTokens;
  layout.head_dim = kMaxHeadDim;
  layout.dtype = DType::kFloat32;
  ExpectRejected(layout, "block too large");
}

}  // namespace
}  // namespace kvs
