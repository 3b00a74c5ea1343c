#include "service/auth.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

TEST(AuthTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(AuthTest, OwnerCheckSaysTheSameForMissingAndForeignSessions) {
  const std::optional<std::string> caller = "team-b";
  EXPECT_TRUE(Authenticator::CheckOwner(std::nullopt, absl::NotFoundError("x"), "s").ok());
  EXPECT_TRUE(Authenticator::CheckOwner(caller, std::string("team-b"), "s").ok());
  const absl::Status foreign = Authenticator::CheckOwner(caller, std::string("team-a"), "s");
  const absl::Status missing = Authenticator::CheckOwner(caller, absl::NotFoundError("gone"), "s");
  EXPECT_EQ(foreign.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(foreign, missing);
  EXPECT_THAT(std::string(foreign.message()), HasSubstr("does not exist or does not belong"));
  EXPECT_THAT(std::string(foreign.message()), ::testing::Not(HasSubstr("team-a")));
}

TEST(AuthTest, ModesFollowTheConfig) {
  EXPECT_FALSE(Authenticator(AuthConfig{}).data_auth());
  EXPECT_FALSE(Authenticator(AuthConfig{}).admin_auth());
  AuthConfig config;
  config.tenant_tokens["a"] = "t";
  config.admin_token = "adm";
  EXPECT_TRUE(Authenticator(config).data_auth());
  EXPECT_TRUE(Authenticator(config).admin_auth());
}

TEST(AuthTest, ServerCredentialsNameTheUnreadableFile) {
  auto plain = MakeServerCredentials(TlsFiles{});
  ASSERT_TRUE(plain.ok());
  auto missing = MakeServerCredentials(TlsFiles{"/nonexistent/c.pem", "/nonexistent/k.pem", ""});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("tls.cert_file="));
}

}  // namespace
}  // namespace kvs
