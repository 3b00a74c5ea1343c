// End to end: backend selection at start-up (--backend / the YAML key `backend`). The real binary,
// built with or without CUDA, serves under --backend=auto with CUDA where a device is usable and
// with the CPU backend otherwise, saying why in its log, in Admin.GetConfig / GetStats and in the
// Attach response; --backend=cuda exits 2 with the reason where no device can be used;
// --backend=device-sim serves on the simulated device.
#include <sys/wait.h>

#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend_factory.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

// True where this binary can serve with CUDA: built with it and a device is usable.
bool CudaServes() { return kvs::CudaBuilt() && kvs::ProbeCuda().devices > 0; }

// What --backend=auto must give as its reason, and --backend=cuda as its error, on this host.
std::string ExpectedAutoReason() {
  if (!kvs::CudaBuilt()) return "this build has no CUDA backend, using cpu";
  if (kvs::ProbeCuda().devices == 0) return "built with CUDA but no CUDA device is usable";
  return "--backend=auto: CUDA device ";
}
std::string ExpectedCudaError() {
  if (!kvs::CudaBuilt()) return "--backend=cuda: this build has no CUDA backend";
  return "--backend=cuda: no CUDA device is usable on this host";
}

// Runs the binary with `args`; expects exit code 2 and returns its stderr.
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

TEST(BackendE2eTest, AutoPicksTheBackendAndSaysWhy) {
  const std::string expected = CudaServes() ? "cuda" : "cpu";
  ServerProcess::Options options;
  options.extra_args = {"--backend=auto"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  // The log names the backend and the reason.
  const std::string logs = (*server)->Logs();
  EXPECT_THAT(logs, HasSubstr("backend name=" + expected));
  EXPECT_THAT(logs, HasSubstr(ExpectedAutoReason()));
  // Admin says so too.
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto config = (*admin)->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->backend(), expected);
  EXPECT_THAT(config->backend_reason(), HasSubstr("--backend=auto"));
  EXPECT_THAT(config->backend_reason(), HasSubstr(ExpectedAutoReason()));
  auto stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->backend(), expected);
  EXPECT_TRUE(stats->backend_healthy());
  // And the session a worker attaches is served by it (a shared-memory arena).
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  v1::AttachRequest request;
  *request.mutable_layout() = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
  request.set_num_blocks(16);
  auto session = (*client)->Attach(request);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->attach_response().backend(), expected);
  EXPECT_EQ(
      (*session)->attach_response().arena().kind(),
      CudaServes() ? v1::ArenaHandle::KIND_CUDA_IPC : v1::ArenaHandle::KIND_MEMFD);
}

// The simulated device serves the whole data path: a memfd arena the worker maps, and the
// sidecar's own pointers in an address space it cannot dereference on the host.
TEST(BackendE2eTest, DeviceSimServesAndSaysSo) {
  ServerProcess::Options options;
  options.extra_args = {"--backend=device-sim"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->Logs(), HasSubstr("backend name=device-sim"));
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto config = (*admin)->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->backend(), "device-sim");
  EXPECT_THAT(config->backend_reason(), HasSubstr("simulated device"));
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  v1::AttachRequest request;
  *request.mutable_layout() = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
  request.set_num_blocks(16);
  auto session = (*client)->Attach(request);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->attach_response().backend(), "device-sim");
  EXPECT_EQ((*session)->attach_response().arena().kind(), v1::ArenaHandle::KIND_MEMFD);
}

TEST(BackendE2eTest, CudaExits2WithTheReason) {
  if (CudaServes()) GTEST_SKIP() << "a CUDA device is usable here: --backend=cuda serves";
  const std::string dir = MakeTempDir("kvs-backend-e2e-");
  const std::string err = ExpectExit2(dir, {"--backend=cuda"});
  EXPECT_THAT(err, HasSubstr(ExpectedCudaError()));
  EXPECT_THAT(err, HasSubstr("use --backend=cpu or auto"));
}

TEST(BackendE2eTest, YamlKeyBackendIsHonoured) {
  const std::string dir = MakeTempDir("kvs-backend-e2e-");
  const std::string path = dir + "/cuda.yaml";
  std::ofstream(path) << "# the CUDA backend, from the file\nbackend: cuda\n";
  if (!CudaServes()) {
    EXPECT_THAT(ExpectExit2(dir, {"--config=" + path}), HasSubstr(ExpectedCudaError()));
  }
  // An explicit flag wins over the file.
  ServerProcess::Options options;
  options.extra_args = {"--config=" + path, "--backend=cpu"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto config = (*admin)->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->backend(), "cpu");
  EXPECT_EQ(config->backend_reason(), "--backend=cpu");
}

TEST(BackendE2eTest, UnknownBackendExits2NamingTheFlag) {
  const std::string dir = MakeTempDir("kvs-backend-e2e-");
  EXPECT_THAT(ExpectExit2(dir, {"--backend=gpu"}),
              HasSubstr("--backend must be cpu, auto, cuda or device-sim"));
}

}  // namespace
}  // namespace kvs_e2e
