#include "storage/crc32c.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvs::storage {
namespace {

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);  // the CRC-32C check value
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(Crc32cExtendPortable(0, "123456789", 9), 0xE3069283u);
}

TEST(Crc32cTest, HardwareAndTableAgreeAndExtendComposes) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string data(gen() % 3000, '\0');
    for (char& c : data) c = static_cast<char>(gen());
    const uint32_t whole = Crc32c(data);
    EXPECT_EQ(whole, Crc32cExtendPortable(0, data.data(), data.size()));
    const size_t cut = data.empty() ? 0 : gen() % data.size();
    EXPECT_EQ(whole, Crc32cExtend(Crc32cExtend(0, data.data(), cut), data.data() + cut,
                                  data.size() - cut));
    if (!data.empty()) {
      data[gen() % data.size()] ^= static_cast<char>(1 << (gen() % 8));
      EXPECT_NE(whole, Crc32c(data)) << "a flipped bit changes the checksum";
    }
  }
}

}  // namespace
}  // namespace kvs::storage
