#include "service/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

#define EXPECT_STATUS(status_expr, expected_code, text)            \
  do {                                                             \
    const absl::Status s_ = (status_expr);                         \
    EXPECT_EQ(s_.code(), absl::StatusCode::expected_code) << s_;   \
    EXPECT_THAT(std::string(s_.message()), HasSubstr(text)) << s_; \
  } while (0)

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("1073741824", "--x"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("1G", "--x"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("256MiB", "--x"), uint64_t{256} << 20);
  EXPECT_EQ(*ParseByteSize("64Ki", "--x"), uint64_t{64} << 10);
  EXPECT_EQ(*ParseByteSize("2GB", "--x"), uint64_t{2000000000});
  EXPECT_EQ(*ParseByteSize(" 7 ", "--x"), 7u);
  EXPECT_STATUS(ParseByteSize("", "--arena_capacity_bytes").status(), kInvalidArgument,
                "--arena_capacity_bytes must be a byte size");
  EXPECT_STATUS(ParseByteSize("-1", "--arena_capacity_bytes").status(), kInvalidArgument,
                "--arena_capacity_bytes");
  EXPECT_STATUS(ParseByteSize("12X", "--default_session_bytes").status(), kInvalidArgument,
                "--default_session_bytes has an unknown size suffix 'X'");
  EXPECT_STATUS(ParseByteSize("99999999999T", "--x").status(), kInvalidArgument, "overflows");
}

TEST(ConfigTest, Integers) {
  EXPECT_EQ(*ParseInteger("42", "--threads"), 42);
  EXPECT_EQ(*ParseInteger("-3", "--threads"), -3);
  EXPECT_STATUS(ParseInteger("abc", "--threads").status(), kInvalidArgument,
                "--threads must be an integer, got 'abc'");
  EXPECT_STATUS(ParseInteger("1.5", "--lease_ms").status(), kInvalidArgument, "--lease_ms");
}

TEST(ConfigTest, ListenAddresses) {
  EXPECT_TRUE(ValidateListenAddress("127.0.0.1:0", "--listen").ok());
  EXPECT_TRUE(ValidateListenAddress("[::1]:50051", "--listen").ok());
  EXPECT_TRUE(ValidateListenAddress("0.0.0.0:65535", "--listen").ok());
  EXPECT_STATUS(ValidateListenAddress("localhost", "--listen"), kInvalidArgument,
                "--listen must be host:port");
  EXPECT_STATUS(ValidateListenAddress(":50051", "--listen"), kInvalidArgument, "--listen");
  EXPECT_STATUS(ValidateListenAddress("h:65536", "--admin_listen"), kInvalidArgument,
                "--admin_listen must end in a port in [0, 65535]");
  EXPECT_STATUS(ValidateListenAddress("h:", "--listen"), kInvalidArgument, "--listen");
  EXPECT_STATUS(ValidateListenAddress("h:-1", "--listen"), kInvalidArgument, "--listen");
}

TEST(ConfigTest, DefaultsAreValid) {
  SidecarConfig config;
  EXPECT_TRUE(ValidateConfig(config).ok());
  auto options = ToPoolOptions(config);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->arena_capacity_bytes, uint64_t{1} << 30);
  EXPECT_EQ(options->default_session_bytes, uint64_t{256} << 20);
  EXPECT_EQ(options->default_lease, absl::Seconds(10));
  EXPECT_EQ(options->default_policy.name, "keydiff");
  EXPECT_EQ(options->default_budget.tokens_per_layer, 0);
  EXPECT_EQ(options->arena_options.shm_directory, "/dev/shm");
}

TEST(ConfigTest, EveryBadValueNamesItsFlag) {
  struct Case {
    void (*mutate)(SidecarConfig*);
    const char* flag;
  } cases[] = {
      {[](SidecarConfig* c) { c->listen = "nope"; }, "--listen"},
      {[](SidecarConfig* c) { c->admin_listen = "x:99999"; }, "--admin_listen"},
      {[](SidecarConfig* c) { c->data_dir = ""; }, "--data_dir"},
      {[](SidecarConfig* c) { c->shm_dir = ""; }, "--shm_dir"},
      {[](SidecarConfig* c) { c->arena_capacity_bytes = 0; }, "--arena_capacity_bytes"},
      {[](SidecarConfig* c) { c->default_session_bytes = 0; }, "--default_session_bytes"},
      {[](SidecarConfig* c) { c->default_session_bytes = uint64_t{2} << 30; },
       "--default_session_bytes"},
      {[](SidecarConfig* c) { c->lease_ms = 5; }, "--lease_ms"},
      {[](SidecarConfig* c) { c->lease_ms = 3600 * 1000; }, "--lease_ms"},
      {[](SidecarConfig* c) { c->backend = "tpu"; }, "--backend"},
      {[](SidecarConfig* c) { c->default_policy = "lru"; }, "--default_policy"},
      {[](SidecarConfig* c) { c->default_policy = "omnikv"; }, "--default_policy"},
      {[](SidecarConfig* c) { c->default_budget_tokens = -1; }, "--default_budget_tokens"},
      {[](SidecarConfig* c) { c->threads = -1; }, "--threads"},
      {[](SidecarConfig* c) { c->log_level = "loud"; }, "--log_level"},
  };
  for (const Case& c : cases) {
    SidecarConfig config;
    c.mutate(&config);
    const absl::Status status = ValidateConfig(config);
    EXPECT_FALSE(status.ok()) << c.flag;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.flag)) << status;
    EXPECT_FALSE(ToPoolOptions(config).ok()) << c.flag;
  }
}

TEST(ConfigTest, Backends) {
  auto cpu = ChooseBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->name, "cpu");
  auto automatic = ChooseBackend("auto");
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ(automatic->name, "cpu");
  EXPECT_THAT(automatic->reason, HasSubstr("no CUDA backend"));
  EXPECT_STATUS(ChooseBackend("cuda").status(), kFailedPrecondition,
                "this build has no CUDA backend");
  EXPECT_STATUS(ChooseBackend("gpu").status(), kInvalidArgument, "--backend must be cpu, auto");
}

TEST(ConfigTest, PoolOptionsFollowTheFlags) {
  SidecarConfig config;
  config.arena_capacity_bytes = uint64_t{64} << 20;
  config.default_session_bytes = uint64_t{8} << 20;
  config.lease_ms = 1500;
  config.shm_dir = "/tmp";
  config.default_policy = "streaming_llm";
  config.default_budget_tokens = 512;
  auto options = ToPoolOptions(config);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->arena_capacity_bytes, uint64_t{64} << 20);
  EXPECT_EQ(options->default_session_bytes, uint64_t{8} << 20);
  EXPECT_EQ(options->default_lease, absl::Milliseconds(1500));
  EXPECT_EQ(options->arena_options.shm_directory, "/tmp");
  EXPECT_EQ(options->default_policy.name, "streaming_llm");
  EXPECT_EQ(options->default_policy.streaming_llm.n_sink, 4);
  EXPECT_EQ(options->default_budget.tokens_per_layer, 512);
}

TEST(ConfigTest, PrepareDirectory) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("kvs_config_test_" + std::to_string(getpid()));
  fs::remove_all(root);
  const std::string nested = (root / "a" / "b").string();
  EXPECT_FALSE(PrepareDirectory(nested, "--data_dir", /*create=*/false).ok());
  ASSERT_TRUE(PrepareDirectory(nested, "--data_dir", /*create=*/true).ok());
  EXPECT_TRUE(fs::is_directory(nested));
  EXPECT_TRUE(fs::is_empty(nested));  // the probe file is gone
  EXPECT_TRUE(PrepareDirectory(nested, "--data_dir", /*create=*/false).ok());

  const std::string file = (root / "file").string();
  std::ofstream(file) << "x";
  EXPECT_STATUS(PrepareDirectory(file, "--data_dir", true), kFailedPrecondition, "--data_dir=");
  EXPECT_STATUS(PrepareDirectory(file + "/sub", "--data_dir", true), kFailedPrecondition,
                "cannot create the directory");
  EXPECT_STATUS(PrepareDirectory(file, "--shm_dir", false), kFailedPrecondition,
                "--shm_dir=" + file + ": not a directory");
  fs::remove_all(root);
}

TEST(ConfigTest, YamlShowsEveryValue) {
  SidecarConfig config;
  config.data_dir = "/var/lib/\"kv\"";
  const std::string yaml = ConfigToYaml(config, BackendChoice{"cpu", "because"});
  EXPECT_THAT(yaml, HasSubstr("listen: \"127.0.0.1:50051\"\n"));
  EXPECT_THAT(yaml, HasSubstr("admin_listen: \"127.0.0.1:50052\"\n"));
  EXPECT_THAT(yaml, HasSubstr("data_dir: \"/var/lib/\\\"kv\\\"\"\n"));
  EXPECT_THAT(yaml, HasSubstr("arena_capacity_bytes: 1073741824\n"));
  EXPECT_THAT(yaml, HasSubstr("lease_ms: 10000\n"));
  EXPECT_THAT(yaml, HasSubstr("backend: \"cpu\"\n"));
  EXPECT_THAT(yaml, HasSubstr("backend_reason: \"because\"\n"));
  EXPECT_THAT(yaml, HasSubstr("default_policy: \"keydiff\"\n"));
  EXPECT_THAT(yaml, HasSubstr("default_budget_tokens: 0\n"));
  EXPECT_THAT(yaml, HasSubstr("threads: 0\n"));
}

}  // namespace
}  // namespace kvs
