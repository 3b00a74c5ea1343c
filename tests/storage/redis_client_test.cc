// The Redis client's pure parts: key slots (the Redis Cluster specification's CRC16 and hash
// tags), seed URLs (credentials refused in them), and the mapping of Redis error replies to
// status codes. The client against real Redis is tested in tests/e2e/remote_tier_test.cc.
#include "storage/redis/redis_client.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs::storage::redis {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(KeySlotTest, MatchesTheClusterSpecification) {
  // The specification's CRC16 check value: "123456789" -> 0x31C3.
  EXPECT_EQ(KeySlot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(KeySlot("foo"), 12182);  // CLUSTER KEYSLOT foo
  EXPECT_EQ(KeySlot("bar"), 5061);   // CLUSTER KEYSLOT bar
  // Hash tags: only the part between the first { and the next }, when non-empty.
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("{user1000}.followers"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("foo{}{bar}"), KeySlot("foo{}{bar}"));
  EXPECT_NE(KeySlot("foo{}{bar}"), KeySlot("bar"));  // empty first tag: the whole key
  EXPECT_EQ(KeySlot("foo{{bar}}zap"), KeySlot("{bar"));
  EXPECT_EQ(KeySlot("foo{bar}{zap}"), KeySlot("bar"));
}

TEST(ParseRedisUrlTest, SeedsAndErrors) {
  auto seeds = ParseRedisUrl("redis://127.0.0.1:6379, redis-1.redis:7000", "--remote_tier");
  ASSERT_TRUE(seeds.ok()) << seeds.status();
  EXPECT_THAT(*seeds, ElementsAre("127.0.0.1:6379", "redis-1.redis:7000"));
  for (const char* bad : {"127.0.0.1:6379", "redis://", "redis://host", "redis://host:0",
                          "redis://host:99999", "redis://:6379", "redis://user:pw@host:6379",
                          "redis://host:6379/0"}) {
    auto parsed = ParseRedisUrl(bad, "--remote_tier");
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(parsed.status().message(), HasSubstr("--remote_tier")) << bad;
  }
  // A password in the URL is not echoed back.
  auto secret = ParseRedisUrl("redis://u:hunter2@host:6379", "--remote_tier");
  EXPECT_THAT(secret.status().message(), HasSubstr("never in the URL"));
  EXPECT_THAT(secret.status().message(), ::testing::Not(HasSubstr("hunter2")));
}

TEST(ErrorReplyStatusTest, MapsRedisErrors) {
  EXPECT_EQ(ErrorReplyStatus("SET", "OOM command not allowed when used memory > 'maxmemory'.")
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrorReplyStatus("AUTH", "WRONGPASS invalid username-password pair").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ErrorReplyStatus("GET", "NOAUTH Authentication required.").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ErrorReplyStatus("GET", "NOPERM this user has no permissions").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrorReplyStatus("GET", "CLUSTERDOWN The cluster is down").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrorReplyStatus("GET", "ERR something").code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvs::storage::redis
