#include "storage/host_pool.h"

#include <memory>
#include <random>

#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvs::storage {
namespace {

std::shared_ptr<const SpilledSequence> Sized(size_t meta, size_t layer) {
  auto data = std::make_shared<SpilledSequence>();
  data->meta.assign(meta, 'm');
  data->layers = {std::string(layer, 'k')};
  return data;
}

TEST(HostPoolTest, CapacityReplaceEraseAndTenants) {
  HostPool pool(1000);
  const SpillKey a{"t1", "s", "a"}, b{"t2", "s", "b"};
  const absl::Time now = absl::FromUnixSeconds(100);
  ASSERT_TRUE(pool.Put(a, Sized(100, 500), now).ok());
  EXPECT_EQ(pool.used_bytes(), 600u);
  absl::Status full = pool.Put(b, Sized(100, 400), now);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("--host_tier_bytes"), std::string::npos) << full;
  EXPECT_FALSE(pool.Find(b).has_value()) << "a refused Put stores nothing";
  // Replacing a copy counts only the difference.
  ASSERT_TRUE(pool.Put(a, Sized(100, 800), now).ok());
  EXPECT_EQ(pool.used_bytes(), 900u);
  EXPECT_EQ(pool.Get(a)->layers[0].size(), 800u);
  EXPECT_EQ(pool.Find(a)->bytes, 900u);
  EXPECT_EQ(pool.Find(a)->spilled, now);
  EXPECT_EQ(pool.TenantBytes("t1"), 900u);
  EXPECT_EQ(pool.TenantBytes("t2"), 0u);
  EXPECT_TRUE(pool.Erase(a));
  EXPECT_FALSE(pool.Erase(a));
  EXPECT_EQ(pool.used_bytes(), 0u);
  EXPECT_EQ(pool.Get(a), nullptr);
  ASSERT_TRUE(pool.Put(b, Sized(100, 400), now).ok());
  ASSERT_EQ(pool.List().size(), 1u);
  EXPECT_EQ(pool.List()[0].tier, StorageTier::kHost);
}

}  // namespace
}  // namespace kvs::storage
