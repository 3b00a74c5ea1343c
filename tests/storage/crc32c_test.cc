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

// Inputs of 24 KiB and more run three interleaved chains joined by a table: every length around
// the block edges, and every start register, must give the table implementation's value.
TEST(Crc32cTest, InterleavedChainsAgreeWithTheTableAroundBlockEdges) {
  std::mt19937 gen(11);
  std::string data(3 * 24576 + 200, '\0');
  for (char& c : data) c = static_cast<char>(gen());
  for (size_t size : {24575, 24576, 24577, 24584, 49151, 49152, 49160, 73728, 73828}) {
    SCOPED_TRACE(size);
    const uint32_t start = gen();
    EXPECT_EQ(Crc32cExtend(start, data.data(), size),
              Crc32cExtendPortable(start, data.data(), size));
    EXPECT_EQ(Crc32cExtend(0, data.data() + 3, size),
              Crc32cExtendPortable(0, data.data() + 3, size))
        << "unaligned input";
  }
}

TEST(Crc32cTest, CopyCopiesTheBytesAndReturnsTheirChecksum) {
  std::mt19937 gen(5);
  for (size_t size : {0, 1, 32767, 32768, 32769, 100000}) {
    std::string data(size, '\0');
    for (char& c : data) c = static_cast<char>(gen());
    std::string to(size, '\x55');
    EXPECT_EQ(Crc32cCopy(data, to.data()), Crc32c(data)) << size;
    EXPECT_EQ(to, data) << size;
  }
}

}  // namespace
}  // namespace kvs::storage
