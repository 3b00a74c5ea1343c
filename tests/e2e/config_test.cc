// End to end: the real kvsidecar binary reads its YAML configuration (--config), lets explicit
// flags override it (visible in Admin.GetConfig), and refuses a bad file at start with exit code
// 2 and a message naming the key.
#include <sys/wait.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "gpu/base/build_info.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Runs the binary with `args` and expects it to exit with code 2; returns its stderr.
std::string ExpectExit2(const std::string& dir, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BuildDir() + "/service/kvsidecar", "--listen=127.0.0.1:0",
                                   "--admin_listen=127.0.0.1:0", "--data_dir=" + dir + "/data"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto process = ChildProcess::Spawn(argv, dir, "kvsidecar");
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return "";
  const int status = (*process)->Wait(kStartTimeout);
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << (*process)->Stderr();
  EXPECT_EQ(WEXITSTATUS(status), 2) << (*process)->Stderr();
  return (*process)->Stderr();
}

class ConfigE2eTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir("kvs-config-e2e-"); }
  std::string dir_;
};

// Runs the binary with only `args`; returns {exit code, stdout}.
std::pair<int, std::string> RunSidecar(const std::string& dir,
                                       const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BuildDir() + "/service/kvsidecar"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto process = ChildProcess::Spawn(argv, dir, "kvsidecar-usage");
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return {-1, ""};
  const int status = (*process)->Wait(kStartTimeout);
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << (*process)->Stderr();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, (*process)->Stdout()};
}

TEST_F(ConfigE2eTest, HelpListsTheSidecarsOwnFlagsWithTheirHelp) {
  // Abseil's --help exits 1 after printing (its convention); the text is what matters.
  for (const char* flag : {"--help", "--helpshort"}) {
    const auto [code, out] = RunSidecar(dir_, {flag});
    EXPECT_EQ(code, 1) << flag;
    EXPECT_THAT(out, Not(HasSubstr("No flags matched"))) << flag;
    EXPECT_THAT(out, HasSubstr("Usage: kvsidecar [--config=FILE.yaml]")) << flag;
    EXPECT_THAT(out, HasSubstr("Flags from service/main.cc:")) << flag;
    EXPECT_THAT(out, HasSubstr("--backend (Compute backend: cpu, auto, cuda or device-sim"))
        << flag;
    EXPECT_THAT(out, HasSubstr("--arena_capacity_bytes (Total bytes of all session arenas"))
        << flag;
    EXPECT_THAT(out, HasSubstr("--config (YAML configuration file")) << flag;
  }
}

TEST_F(ConfigE2eTest, VersionNamesTheRevisionAndBuildType) {
  const auto [code, out] = RunSidecar(dir_, {"--version"});
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, absl::StrCat("kvsidecar ", KVS_VERSION, "\ngit revision: ", KVS_GIT_REVISION,
                              "\nbuild type: ", KVS_BUILD_TYPE, "\n"));
  EXPECT_THAT(out, Not(HasSubstr("Debug build")));
  EXPECT_STRNE(KVS_GIT_REVISION, "");
}

TEST_F(ConfigE2eTest, UnknownKeyExits2NamingTheKey) {
  const std::string path = WriteFile(dir_, "bad.yaml", "lease_ms: 5000\narena_capacity_byts: 1G\n");
  const std::string err = ExpectExit2(dir_, {"--config=" + path});
  EXPECT_THAT(err, HasSubstr("arena_capacity_byts"));
  EXPECT_THAT(err, HasSubstr("unknown key"));
}

TEST_F(ConfigE2eTest, BadValuesExit2NamingTheKeyAndReason) {
  std::string err =
      ExpectExit2(dir_, {"--config=" + WriteFile(dir_, "a.yaml", "default_session_bytes: 12Q\n")});
  EXPECT_THAT(err, HasSubstr("default_session_bytes has an unknown size suffix 'Q'"));
  err = ExpectExit2(dir_, {"--config=" + WriteFile(dir_, "b.yaml", "lease_ms: 5\n")});
  EXPECT_THAT(err, HasSubstr("lease_ms must be in"));
  err = ExpectExit2(dir_, {"--config=" + WriteFile(dir_, "c.yaml", "tls:\n  cert_file: x.pem\n")});
  EXPECT_THAT(err, HasSubstr("tls.key_file"));
  err = ExpectExit2(dir_,
                    {"--config=" + WriteFile(dir_, "d.yaml", "quotas:\n  t: {sequences: -3}\n")});
  EXPECT_THAT(err, HasSubstr("quotas.t.sequences"));
  err = ExpectExit2(dir_, {"--config=" + WriteFile(dir_, "e.yaml", "listen: [1, 2\n")});
  EXPECT_THAT(err, HasSubstr("YAML syntax error"));
  err = ExpectExit2(dir_, {"--config=" + dir_ + "/missing.yaml"});
  EXPECT_THAT(err, HasSubstr("missing.yaml"));
  // A bad flag value still names the flag, even with a good file.
  err =
      ExpectExit2(dir_, {"--config=" + WriteFile(dir_, "f.yaml", "threads: 2\n"), "--threads=-4"});
  EXPECT_THAT(err, HasSubstr("--threads must be in"));
  err = ExpectExit2(dir_, {"--exit_when_stdin_closes=maybe"});
  EXPECT_THAT(err, HasSubstr("--exit_when_stdin_closes=\"maybe\" is not a boolean"));
}

TEST_F(ConfigE2eTest, FileValuesApplyAndExplicitFlagsWin) {
  const std::string path = WriteFile(dir_, "ok.yaml",
                                     "# the effective config is visible through Admin\n"
                                     "default_policy: streaming_llm\n"
                                     "default_budget_tokens: 64\n"
                                     "lease_ms: 5000\n"
                                     "arena_capacity_bytes: 512MiB\n"
                                     "quotas:\n"
                                     "  team-a: {sequences: 7, arena_bytes: 1Mi}\n");
  ServerProcess::Options options;  // passes --lease_ms=10000 explicitly
  options.extra_args = {"--config=" + path, "--default_budget_tokens=128"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto config = (*admin)->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_policy().name(), "streaming_llm");                 // file
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 128);                 // flag wins
  EXPECT_THAT(config->effective_config_yaml(), HasSubstr("lease_ms: 10000"));  // flag wins
  EXPECT_THAT(config->effective_config_yaml(), HasSubstr("arena_capacity_bytes: 536870912"));
  EXPECT_THAT(config->effective_config_yaml(), HasSubstr("config_file: \"" + path + "\""));
  ASSERT_EQ(config->quotas_size(), 1);
  EXPECT_EQ(config->quotas(0).tenant(), "team-a");
  EXPECT_EQ(config->quotas(0).quota().sequences(), 7);
  EXPECT_EQ(config->quotas(0).quota().arena_bytes(), 1u << 20);
  auto stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->arena_bytes_capacity(), 512u << 20);
  // Logged once at start.
  EXPECT_THAT((*server)->Logs(), HasSubstr("config source="));
}

}  // namespace
}  // namespace kvs_e2e
