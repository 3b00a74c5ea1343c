#include "service/log.h"

#include "gtest/gtest.h"

namespace kvs {
namespace {

TEST(LogTest, SafeValuesStayBare) {
  EXPECT_EQ(QuoteLogValue("s-1"), "s-1");
  EXPECT_EQ(QuoteLogValue("INVALID_ARGUMENT"), "INVALID_ARGUMENT");
}

TEST(LogTest, UnsafeValuesAreQuotedAndEscaped) {
  EXPECT_EQ(QuoteLogValue(""), "\"\"");
  EXPECT_EQ(QuoteLogValue("two words"), "\"two words\"");
  EXPECT_EQ(QuoteLogValue("a=b"), "\"a=b\"");
  EXPECT_EQ(QuoteLogValue("say \"hi\""), "\"say \\\"hi\\\"\"");
  EXPECT_EQ(QuoteLogValue("back\\slash"), "\"back\\\\slash\"");
  EXPECT_EQ(QuoteLogValue("line\nbreak\t"), "\"line\\nbreak\\t\"");
  EXPECT_EQ(QuoteLogValue(std::string("nul\0x", 5)), "\"nul\\x00x\"");
}

TEST(LogTest, LevelsParseAndFilter) {
  LogLevel level = LogLevel::kError;
  EXPECT_TRUE(ParseLogLevel("debug", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  EXPECT_TRUE(ParseLogLevel("WARNING", &level));
  EXPECT_EQ(level, LogLevel::kWarning);
  EXPECT_FALSE(ParseLogLevel("verbose", &level));
  EXPECT_EQ(level, LogLevel::kWarning);

  const LogLevel saved = GetLogLevel();
  SetLogLevel(LogLevel::kError);
  testing::internal::CaptureStderr();
  KVS_LOG(kInfo, "hidden")("k", 1);
  KVS_LOG(kError, "shown")("session", "s 1")("count", 3)("ok", true);
  const std::string out = testing::internal::GetCapturedStderr();
  SetLogLevel(saved);
  EXPECT_EQ(out.find("hidden"), std::string::npos);
  EXPECT_NE(out.find(" ERROR shown session=\"s 1\" count=3 ok=true\n"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
}

}  // namespace
}  // namespace kvs
