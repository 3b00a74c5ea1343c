// The backend a test runs on (tests/CMakeLists.txt registers suites again with KVS_TEST_BACKEND
// set): cache tests build their pool on MakeTestBackend, e2e tests start the server with the same
// --backend. Threading: call from the test thread.
#ifndef KVSIDECAR_TESTS_TEST_BACKEND_H_
#define KVSIDECAR_TESTS_TEST_BACKEND_H_

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "gtest/gtest.h"

namespace kvs::testing_util {

// The backend a test runs on, from KVS_TEST_BACKEND: the CPU backend (unset or "cpu");
// "device-sim", the simulated device (gpu/backend_factory.h), whose arena and scratch pointers
// fault when the host dereferences them, so that a run there shows the cache core reaching arena
// memory only through the backend and Arena::Read/Write, as a CUDA arena requires; or "cuda",
// the CUDA backend, whose run is the parity of every cache test with the CPU backend. ctest
// names of those runs end in /device_sim and /cuda (tests/CMakeLists.txt).
inline std::string TestBackendName() {
  const char* name = std::getenv("KVS_TEST_BACKEND");
  return name == nullptr || *name == '\0' ? "cpu" : name;
}

inline std::unique_ptr<Backend> MakeTestBackend(int threads) {
  const std::string name = TestBackendName();
  BackendKind kind = BackendKind::kCpu;
  if (name == "device-sim") {
    kind = BackendKind::kDeviceSim;
  } else if (name == "cuda") {
    kind = BackendKind::kCuda;
  } else if (name != "cpu") {
    ADD_FAILURE() << "KVS_TEST_BACKEND must be cpu, device-sim or cuda, got " << name;
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(kind, threads);
  if (!backend.ok()) {
    ADD_FAILURE() << "backend " << name << ": " << backend.status();
    return MakeCpuBackend(threads);
  }
  return *std::move(backend);
}

// The /cuda runs on a host without a usable CUDA device report themselves skipped: the process
// says why and exits with kSkipExitCode, which ctest reads as "Skipped" for that test name
// (SKIP_RETURN_CODE, tests/CMakeLists.txt). A GTEST_SKIP in a global environment would not do:
// gtest 1.12 then reports the test as passed. _Exit: nothing of the run is left to tear down.
inline constexpr int kSkipExitCode = 77;

class CudaTestEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (TestBackendName() != "cuda") return;
    std::string why;
    if (!CudaBuilt()) {
      why = "this build has no CUDA backend";
    } else if (ProbeCuda().devices == 0) {
      why = "no CUDA device (" + ProbeCuda().detail + ")";
    } else {
      return;
    }
    std::printf("[  SKIPPED ] KVS_TEST_BACKEND=cuda: %s\n", why.c_str());
    std::fflush(stdout);
    std::_Exit(kSkipExitCode);
  }
};
inline ::testing::Environment* const kCudaTestEnvironment =
    ::testing::AddGlobalTestEnvironment(new CudaTestEnvironment);

}  // namespace kvs::testing_util

#endif  // KVSIDECAR_TESTS_TEST_BACKEND_H_
