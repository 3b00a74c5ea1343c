// End to end: the demo program (clients/cpp/demo.cc) against the real server: it must exit 0 and
// report every kept token verified bit for bit, for both policies.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

TEST(DemoTest, RunsAgainstTheRealServerAndVerifiesBitForBit) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto demo = ChildProcess::Spawn(
      {BuildDir() + "/clients/cpp/kvs_demo", "--target=" + (*server)->data_target()},
      (*server)->dir(), "demo");
  ASSERT_TRUE(demo.ok()) << demo.status();
  const int status = (*demo)->Wait(absl::Seconds(120));
  const std::string out = (*demo)->Stdout();
  ASSERT_EQ(status, 0) << out << (*demo)->Stderr() << (*server)->Logs();
  EXPECT_THAT(out, ::testing::HasSubstr("[keydiff] verified 512 kept tokens bit-for-bit"));
  EXPECT_THAT(out, ::testing::HasSubstr("[streaming_llm] verified 512 kept tokens bit-for-bit"));
  EXPECT_THAT(out, ::testing::HasSubstr("first kept positions: 0 1 2 3 196 197"));
  EXPECT_THAT(out, ::testing::HasSubstr("kvs_demo: OK"));
}

}  // namespace
}  // namespace kvs_e2e
