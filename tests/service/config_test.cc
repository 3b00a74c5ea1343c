#include "service/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gpu/backend_factory.h"
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
  EXPECT_EQ(*ParseByteSize("1Gi", "--x"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("1G", "--x"), uint64_t{1000000000});  // Kubernetes: G is decimal
  EXPECT_EQ(*ParseByteSize(".5G", "--x"), uint64_t{500000000});
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
  EXPECT_STATUS(ParseByteSize("99999999999T", "--x").status(), kInvalidArgument,
                "larger than 2^64-1");
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
  auto sim = ChooseBackend("device-sim");
  ASSERT_TRUE(sim.ok());
  EXPECT_EQ(sim->name, "device-sim");
  auto automatic = ChooseBackend("auto");
  ASSERT_TRUE(automatic.ok());
  if (!CudaBuilt()) {
    EXPECT_EQ(automatic->name, "cpu");
    EXPECT_THAT(automatic->reason, HasSubstr("no CUDA backend"));
    EXPECT_STATUS(ChooseBackend("cuda").status(), kFailedPrecondition,
                  "this build has no CUDA backend");
  } else if (ProbeCuda().devices == 0) {
    EXPECT_EQ(automatic->name, "cpu");
    EXPECT_THAT(automatic->reason, HasSubstr("built with CUDA but no CUDA device is usable"));
    EXPECT_STATUS(ChooseBackend("cuda").status(), kFailedPrecondition,
                  "--backend=cuda: no CUDA device is usable on this host");
  } else {  // a usable device: both pick it
    EXPECT_EQ(automatic->name, "cuda");
    auto cuda = ChooseBackend("cuda");
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    EXPECT_EQ(cuda->name, "cuda");
  }
  EXPECT_STATUS(ChooseBackend("gpu").status(), kInvalidArgument,
                "--backend must be cpu, auto, cuda or device-sim");
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

TEST(ConfigTest, RemoteTierKeysFromYamlAndFlags) {
  SidecarConfig config;
  ASSERT_TRUE(ApplyConfigYaml("remote_tier:\n  url: redis://10.0.0.1:6379,10.0.0.2:6379\n"
                              "  user: kvs\n  password_file: /secrets/redis\n  ttl: 72h\n"
                              "  chunk_bytes: 4Mi\n"
                              "quotas:\n  t: {remote_bytes: 1Gi}\n",
                              "test.yaml", &config)
                  .ok());
  EXPECT_EQ(config.remote_tier, "redis://10.0.0.1:6379,10.0.0.2:6379");
  EXPECT_EQ(config.remote_tier_user, "kvs");
  EXPECT_EQ(config.remote_tier_password_file, "/secrets/redis");
  EXPECT_EQ(config.remote_tier_ttl_s, 72 * 3600);
  EXPECT_EQ(config.remote_tier_chunk_bytes, uint64_t{4} << 20);
  EXPECT_EQ(config.quotas["t"].remote_bytes, uint64_t{1} << 30);
  EXPECT_TRUE(ValidateConfig(config).ok()) << ValidateConfig(config);
  const std::string yaml = ConfigToYaml(config, BackendChoice{"cpu", "x"});
  EXPECT_THAT(yaml, HasSubstr("  password_file: \"/secrets/redis\"\n"));
  EXPECT_THAT(yaml, HasSubstr("remote_bytes: 1073741824"));
  ASSERT_TRUE(SetConfigValue(&config, "remote_tier_ttl", "90", "--remote_tier_ttl").ok());
  EXPECT_EQ(config.remote_tier_ttl_s, 90);

  SidecarConfig bad = config;
  bad.remote_tier = "redis://user:secret@host:6379";
  EXPECT_THAT(ValidateConfig(bad).message(), HasSubstr("--remote_tier"));
  EXPECT_THAT(ValidateConfig(bad).message(), ::testing::Not(HasSubstr("secret")));
  bad = config;
  bad.remote_tier_chunk_bytes = 1024;
  EXPECT_THAT(ValidateConfig(bad).message(), HasSubstr("--remote_tier_chunk_bytes"));
  bad = config;
  bad.remote_tier = "";
  EXPECT_THAT(ValidateConfig(bad).message(), HasSubstr("need --remote_tier"));
  EXPECT_FALSE(SetConfigValue(&config, "remote_tier_ttl", "soon", "--remote_tier_ttl").ok());
}

TEST(ConfigTest, YamlFileSetsEveryKey) {
  SidecarConfig config;
  const absl::Status status = ApplyConfigYaml(
      "listen: 0.0.0.0:6000\n"
      "admin_listen: 127.0.0.1:6001\n"
      "metrics_listen: 127.0.0.1:9464\n"
      "data_dir: /tmp/d\n"
      "shm_dir: /tmp/s\n"
      "arena_capacity_bytes: 2Gi\n"
      "default_session_bytes: 64MiB\n"
      "lease_ms: 3000\n"
      "backend: cpu\n"
      "default_policy: streaming_llm\n"
      "default_budget_tokens: 256\n"
      "threads: 3\n"
      "log_level: debug\n"
      "tls:\n  cert_file: /c.pem\n  key_file: /k.pem\n  client_ca_file: /ca.pem\n"
      "auth:\n  admin_token_file: /a\n  tenant_tokens_file: /t.yaml\n"
      "quotas:\n  team-a: {arena_bytes: 1Gi, host_bytes: 2G, disk_bytes: 3GB, sequences: 9}\n",
      "test.yaml", &config);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(config.listen, "0.0.0.0:6000");
  EXPECT_EQ(config.admin_listen, "127.0.0.1:6001");
  EXPECT_EQ(config.metrics_listen, "127.0.0.1:9464");
  EXPECT_EQ(config.data_dir, "/tmp/d");
  EXPECT_EQ(config.shm_dir, "/tmp/s");
  EXPECT_EQ(config.arena_capacity_bytes, uint64_t{2} << 30);
  EXPECT_EQ(config.default_session_bytes, uint64_t{64} << 20);
  EXPECT_EQ(config.lease_ms, 3000);
  EXPECT_EQ(config.backend, "cpu");
  EXPECT_EQ(config.default_policy, "streaming_llm");
  EXPECT_EQ(config.default_budget_tokens, 256);
  EXPECT_EQ(config.threads, 3);
  EXPECT_EQ(config.log_level, "debug");
  EXPECT_EQ(config.tls_cert_file, "/c.pem");
  EXPECT_EQ(config.tls_key_file, "/k.pem");
  EXPECT_EQ(config.tls_client_ca_file, "/ca.pem");
  EXPECT_EQ(config.admin_token_file, "/a");
  EXPECT_EQ(config.tenant_tokens_file, "/t.yaml");
  ASSERT_EQ(config.quotas.count("team-a"), 1u);
  EXPECT_EQ(config.quotas["team-a"].arena_bytes, uint64_t{1} << 30);
  EXPECT_EQ(config.quotas["team-a"].host_bytes, uint64_t{2000000000});
  EXPECT_EQ(config.quotas["team-a"].disk_bytes, uint64_t{3000000000});
  EXPECT_EQ(config.quotas["team-a"].sequences, 9);
  EXPECT_TRUE(ValidateConfig(config).ok()) << ValidateConfig(config);
  const std::string yaml = ConfigToYaml(config, BackendChoice{"cpu", "x"});
  EXPECT_THAT(yaml, HasSubstr("  client_ca_file: \"/ca.pem\"\n"));
  EXPECT_THAT(yaml, HasSubstr("  \"team-a\": {arena_bytes: 1073741824, host_bytes: 2000000000, "
                              "disk_bytes: 3000000000, sequences: 9}\n"));
  EXPECT_THAT(yaml, HasSubstr("metrics_listen: \"127.0.0.1:9464\"\n"));
}

TEST(ConfigTest, DrainTargetAndGrace) {
  SidecarConfig config;
  ASSERT_TRUE(ApplyConfigYaml("drain:\n  to: disk\n  grace: 1m30s\n", "f.yaml", &config).ok());
  EXPECT_EQ(config.drain_to, "disk");
  EXPECT_EQ(config.drain_grace_ms, 90000);
  EXPECT_TRUE(ValidateConfig(config).ok());
  ASSERT_TRUE(SetConfigValue(&config, "drain_grace", "12", "--drain_grace").ok());
  EXPECT_EQ(config.drain_grace_ms, 12000);
  EXPECT_STATUS(SetConfigValue(&config, "drain_grace", "soon", "--drain_grace"), kInvalidArgument,
                "--drain_grace: must be a duration");
  ASSERT_TRUE(SetConfigValue(&config, "drain_grace", "2h", "--drain_grace").ok());
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument, "drain.grace (--drain_grace)");
  config.drain_grace_ms = 1000;
  ASSERT_TRUE(SetConfigValue(&config, "drain_to", "tape", "--drain_to").ok());
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument,
                "drain.to (--drain_to) must be disk, remote or none");
  EXPECT_STATUS(ApplyConfigYaml("drain:\n  after: 5\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: drain.after: unknown key");
}

TEST(ConfigTest, YamlErrorsNameTheKey) {
  SidecarConfig config;
  EXPECT_STATUS(ApplyConfigYaml("lease_msec: 5\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: lease_msec: unknown key");
  EXPECT_STATUS(ApplyConfigYaml("tls:\n  cert: x\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: tls.cert: unknown key");
  EXPECT_STATUS(ApplyConfigYaml("lease_ms: [1]\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: lease_ms: must be a scalar");
  EXPECT_STATUS(ApplyConfigYaml("lease_ms: soon\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: lease_ms must be an integer");
  EXPECT_STATUS(ApplyConfigYaml("arena_capacity_bytes: 1X\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: arena_capacity_bytes has an unknown size suffix");
  EXPECT_STATUS(ApplyConfigYaml("quotas:\n  t: {seqs: 1}\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: quotas.t.seqs: unknown key");
  EXPECT_STATUS(ApplyConfigYaml("quotas: 3\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: quotas: must be a map");
  EXPECT_STATUS(ApplyConfigYaml("- a\n- b\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: the document must be a map");
  EXPECT_STATUS(ApplyConfigYaml("a: [\n", "f.yaml", &config), kInvalidArgument,
                "f.yaml: YAML syntax error");
  EXPECT_TRUE(ApplyConfigYaml("", "empty.yaml", &config).ok());
  EXPECT_STATUS(LoadConfigFile("/nonexistent/k.yaml", &config), kFailedPrecondition,
                "--config=/nonexistent/k.yaml: cannot read");
}

TEST(ConfigTest, FlagsOverrideTheFileThroughTheSameParsers) {
  SidecarConfig config;
  ASSERT_TRUE(ApplyConfigYaml("lease_ms: 3000\nthreads: 2\n", "f.yaml", &config).ok());
  ASSERT_TRUE(SetConfigValue(&config, "lease_ms", "4000", "--lease_ms").ok());
  EXPECT_EQ(config.lease_ms, 4000);
  EXPECT_EQ(config.threads, 2);
  ASSERT_TRUE(SetConfigValue(&config, "tls_cert_file", "/x.pem", "--tls_cert_file").ok());
  EXPECT_EQ(config.tls_cert_file, "/x.pem");
  ASSERT_TRUE(SetConfigValue(&config, "metrics_listen", "off", "--metrics_listen").ok());
  EXPECT_EQ(config.metrics_listen, "");
  EXPECT_STATUS(SetConfigValue(&config, "threads", "many", "--threads"), kInvalidArgument,
                "--threads must be an integer");
  EXPECT_STATUS(SetConfigValue(&config, "nope", "1", "--nope"), kInvalidArgument,
                "--nope: unknown key");
}

TEST(ConfigTest, ValidatesTlsMetricsAndQuotas) {
  SidecarConfig config;
  config.tls_cert_file = "/c.pem";
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument, "tls.key_file");
  config.tls_key_file = "/k.pem";
  EXPECT_TRUE(ValidateConfig(config).ok());
  config.tls_cert_file = config.tls_key_file = "";
  config.tls_client_ca_file = "/ca.pem";
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument, "tls.client_ca_file");
  config.tls_client_ca_file = "";
  config.metrics_listen = "nowhere";
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument, "--metrics_listen");
  config.metrics_listen = "";
  config.quotas["t"].sequences = -1;
  EXPECT_STATUS(ValidateConfig(config), kInvalidArgument, "quotas.t.sequences");
}

TEST(ConfigTest, SecretFiles) {
  const std::string dir = ::testing::TempDir();
  const std::string token = dir + "/admin.token";
  std::ofstream(token) << "  s3cret \nignored\n";
  EXPECT_EQ(*ReadSecretFile(token, "auth.admin_token_file"), "s3cret");
  const std::string empty = dir + "/empty.token";
  std::ofstream(empty) << "\n";
  EXPECT_STATUS(ReadSecretFile(empty, "auth.admin_token_file").status(), kFailedPrecondition,
                "auth.admin_token_file=" + empty + ": the first line (the secret) is empty");
  const std::string tokens = dir + "/tokens.yaml";
  std::ofstream(tokens) << "a: t1\nb: t2\n";
  auto parsed = ReadTenantTokens(tokens);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->at("a"), "t1");
  EXPECT_EQ(parsed->at("b"), "t2");
  const std::string shared = dir + "/shared.yaml";
  std::ofstream(shared) << "a: same\nb: same\n";
  EXPECT_STATUS(ReadTenantTokens(shared).status(), kInvalidArgument, "share a token");
}

TEST(ConfigTest, SpillOnPressure) {
  SidecarConfig config;
  EXPECT_FALSE(ToPoolOptions(config)->spill_on_pressure);
  EXPECT_THAT(ConfigToYaml(config, BackendChoice{"cpu", "x"}),
              HasSubstr("spill_on_pressure: false\n"));
  ASSERT_TRUE(ApplyConfigYaml("spill_on_pressure: true\n", "test.yaml", &config).ok());
  EXPECT_TRUE(config.spill_on_pressure);
  EXPECT_TRUE(ToPoolOptions(config)->spill_on_pressure);
  EXPECT_THAT(ConfigToYaml(config, BackendChoice{"cpu", "x"}),
              HasSubstr("spill_on_pressure: true\n"));
  const absl::Status bad =
      SetConfigValue(&config, "spill_on_pressure", "yes", "--spill_on_pressure");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("--spill_on_pressure"));
  EXPECT_TRUE(config.spill_on_pressure) << "a refused value changes nothing";
  ASSERT_TRUE(SetConfigValue(&config, "spill_on_pressure", "false", "--spill_on_pressure").ok());
  EXPECT_FALSE(config.spill_on_pressure);
}

}  // namespace
}  // namespace kvs
