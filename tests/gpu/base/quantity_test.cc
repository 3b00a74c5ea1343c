// The byte-size parser shared by the sidecar's configuration and kvctl: Kubernetes quantity
// rules (binary Ki..Ei, decimal k..E, exponents, fractions that come to whole bytes), the
// compatibility aliases, and every refusal with its message.
#include "gpu/base/quantity.h"

#include <cstdint>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKi = uint64_t{1} << 10;
constexpr uint64_t kMi = uint64_t{1} << 20;
constexpr uint64_t kGi = uint64_t{1} << 30;
constexpr uint64_t kTi = uint64_t{1} << 40;

uint64_t Bytes(const char* text) {
  absl::StatusOr<uint64_t> bytes = ParseQuantityBytes(text, "--size");
  EXPECT_TRUE(bytes.ok()) << text << ": " << bytes.status();
  return bytes.ok() ? *bytes : 0;
}

std::string Error(const char* text) {
  absl::StatusOr<uint64_t> bytes = ParseQuantityBytes(text, "--size");
  EXPECT_FALSE(bytes.ok()) << text << " parsed as " << (bytes.ok() ? *bytes : 0);
  if (bytes.ok()) return "";
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bytes.status().message(), HasSubstr("--size")) << "names the field";
  return std::string(bytes.status().message());
}

TEST(QuantityTest, PlainIntegersAreBytes) {
  EXPECT_EQ(Bytes("0"), 0u);
  EXPECT_EQ(Bytes("1"), 1u);
  EXPECT_EQ(Bytes("1073741824"), kGi);
  EXPECT_EQ(Bytes("+7"), 7u);
  EXPECT_EQ(Bytes(" 42 "), 42u);
  EXPECT_EQ(Bytes("18446744073709551615"), std::numeric_limits<uint64_t>::max());
}

TEST(QuantityTest, BinarySuffixesArePowersOf1024) {
  EXPECT_EQ(Bytes("1Ki"), kKi);
  EXPECT_EQ(Bytes("512Mi"), 512 * kMi);
  EXPECT_EQ(Bytes("4Gi"), 4 * kGi);
  EXPECT_EQ(Bytes("2Ti"), 2 * kTi);
  EXPECT_EQ(Bytes("1Pi"), kTi * kKi);
  EXPECT_EQ(Bytes("15Ei"), uint64_t{15} << 60);
}

TEST(QuantityTest, DecimalSuffixesArePowersOf1000) {
  EXPECT_EQ(Bytes("1k"), 1000u);
  EXPECT_EQ(Bytes("64M"), 64'000'000u);
  EXPECT_EQ(Bytes("1G"), 1'000'000'000u);
  EXPECT_EQ(Bytes("3T"), 3'000'000'000'000u);
  EXPECT_EQ(Bytes("2P"), 2'000'000'000'000'000u);
  EXPECT_EQ(Bytes("18E"), 18'000'000'000'000'000'000u);
  EXPECT_EQ(Bytes("1e9"), 1'000'000'000u);
  EXPECT_EQ(Bytes("5E3"), 5000u);
  EXPECT_EQ(Bytes("3000e-3"), 3u);
}

TEST(QuantityTest, FractionsAreAllowedWhenTheResultIsWholeBytes) {
  EXPECT_EQ(Bytes("1.5Gi"), kGi + kGi / 2);
  EXPECT_EQ(Bytes("0.5Ki"), 512u);
  EXPECT_EQ(Bytes(".5G"), 500'000'000u);
  EXPECT_EQ(Bytes("1.25k"), 1250u);
  EXPECT_EQ(Bytes("2.000"), 2u);
  EXPECT_EQ(Bytes("0.001k"), 1u);
  EXPECT_EQ(Bytes("1."), 1u);
  EXPECT_THAT(Error("0.5"), HasSubstr("whole number of bytes"));
  EXPECT_THAT(Error("1.5"), HasSubstr("whole number of bytes"));
  EXPECT_THAT(Error("0.1Ki"), HasSubstr("whole number of bytes"));  // 102.4 bytes
  EXPECT_THAT(Error("1e-1"), HasSubstr("whole number of bytes"));
}

TEST(QuantityTest, ByteSpelledAliasesKeepTheirBase) {
  // Not Kubernetes, accepted for older configurations: xiB = xi (1024), xB = x (1000).
  EXPECT_EQ(Bytes("256MiB"), 256 * kMi);
  EXPECT_EQ(Bytes("1GiB"), kGi);
  EXPECT_EQ(Bytes("64KiB"), 64 * kKi);
  EXPECT_EQ(Bytes("1GB"), 1'000'000'000u);
  EXPECT_EQ(Bytes("2KB"), 2000u);
  EXPECT_EQ(Bytes("1.5GB"), 1'500'000'000u);
}

TEST(QuantityTest, RefusesWithAClearMessage) {
  EXPECT_THAT(Error(""), HasSubstr("must be a byte size"));
  EXPECT_THAT(Error("lots"), HasSubstr("must be a byte size"));
  EXPECT_THAT(Error("."), HasSubstr("must be a byte size"));
  EXPECT_THAT(Error("1.2.3"), HasSubstr("must be a byte size"));
  EXPECT_THAT(Error("Gi"), HasSubstr("must be a byte size"));
  EXPECT_THAT(Error("-1"), HasSubstr("must not be negative"));
  EXPECT_THAT(Error("-1Gi"), HasSubstr("must not be negative"));
  EXPECT_THAT(Error("12Q"), HasSubstr("unknown size suffix 'Q'"));
  // Kubernetes has no upper-case K, and milli is never whole bytes: refused, not guessed.
  EXPECT_THAT(Error("1K"), HasSubstr("unknown size suffix 'K'"));
  EXPECT_THAT(Error("500m"), HasSubstr("unknown size suffix 'm'"));
  EXPECT_THAT(Error("1 Gi"), HasSubstr("unknown size suffix"));
  EXPECT_THAT(Error("1gi"), HasSubstr("unknown size suffix"));
  EXPECT_THAT(Error("18446744073709551616"), HasSubstr("larger than 2^64-1"));
  EXPECT_THAT(Error("16Ei"), HasSubstr("larger than 2^64-1"));
  EXPECT_THAT(Error("99999999999Ti"), HasSubstr("larger than 2^64-1"));
  EXPECT_THAT(Error("19E"), HasSubstr("larger than 2^64-1"));
  EXPECT_THAT(Error("1e40"), HasSubstr("larger than 2^64-1"));
  EXPECT_THAT(Error("123456789012345678901234567890123456789"), HasSubstr("too many digits"));
}

}  // namespace
}  // namespace kvs
