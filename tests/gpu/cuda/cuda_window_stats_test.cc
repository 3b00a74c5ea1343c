// Parity of the CUDA backend's CAKE window statistics (gpu/backend.h WindowVarianceJob,
// WindowEntropyJob) with the CPU reference backend, on random windows (GQA, one row, counts not a
// multiple of the vector widths and beyond the CPU's 512-slot blocks, exact zeros), plus the
// validation the CUDA backend shares with the CPU one and its refusal of host pointers. Built
// only with CUDA; without a device every test reports itself skipped ("no CUDA device").
//
// Tolerances (the accumulation is the same type on both backends; only order and the logarithm
// differ):
// - WindowVarianceScores: per slot the same fp64 operations in the same row order, the kernels
//   built with --fmad=false, one rounding to fp32: expected bit-identical; the test allows
//   1 fp32 ulp (relative 2^-23) so that a libdevice division change would not fail it.
// - WindowEntropyShift shift: fp64 per slot as on the CPU; the sum across slots is a fixed tree
//   on the device instead of the CPU's (q, s) order: relative 1e-12.
// - WindowEntropyShift entropy: each slot's terms p ln(p + 1e-10) are summed in fp32 over the
//   window on both backends, with logf on the device and a Cephes polynomial (~1 ulp) on the
//   CPU, then in fp64 across slots (tree vs sequential): relative 1e-5.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/cuda/cuda_backend.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

constexpr double kVarianceRelTolerance = 1.0 / (1 << 23);
constexpr double kShiftRelTolerance = 1e-12;
constexpr double kEntropyRelTolerance = 1e-5;

// Device memory holding a copy of a host vector; freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(1, size_) * sizeof(T)), cudaSuccess);
    if (size_ > 0) {
      EXPECT_EQ(cudaMemcpy(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(data_); }
  std::vector<T> ToHost() const {
    std::vector<T> out(size_);
    if (size_ > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

 private:
  void* data_ = nullptr;
  size_t size_;
};

struct Case {
  int32_t hq, kv, nq, window, count;
};
const Case kCases[] = {{2, 1, 1, 1, 7}, {4, 2, 6, 4, 130},     {3, 3, 5, 5, 1029}, {8, 2, 9, 9, 33},
                       {1, 1, 2, 2, 1}, {32, 8, 40, 32, 4099}, {2, 2, 3, 2, 0}};

struct Window {
  std::vector<float> probs;
  std::vector<int32_t> positions;
  int32_t first = 0;
};

Window MakeWindow(const Case& c, std::mt19937& rng) {
  Window w;
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  w.probs.resize(static_cast<size_t>(c.hq) * c.nq * c.count);
  for (float& v : w.probs) v = uniform(rng) * uniform(rng);
  for (size_t i = 0; i < w.probs.size(); i += 11) w.probs[i] = 0.0f;
  for (int32_t h = 0; h < c.kv; ++h) {
    std::vector<int32_t> slots(c.count);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    w.positions.insert(w.positions.end(), slots.begin(), slots.end());
  }
  w.first = c.count - c.count / 3;
  return w;
}

void ExpectRelNear(double cuda, double cpu, double rel, const std::string& what) {
  EXPECT_NEAR(cuda, cpu, rel * std::fabs(cpu) + 1e-300) << what;
}

class CudaWindowStatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    auto made = MakeCudaBackend(0);
    ASSERT_TRUE(made.ok()) << made.status();
    cuda_ = *std::move(made);
    cpu_ = MakeCpuBackend(2);
  }
  void TearDown() override {
    if (cuda_ != nullptr) {
      EXPECT_TRUE(cuda_->healthy());
    }
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(CudaWindowStatsTest, WindowVarianceScores) {
  std::mt19937 rng(51);
  for (const Case& c : kCases) {
    const Window w = MakeWindow(c, rng);
    for (const double gamma : {0.0, 1.0, 200.0}) {
      const size_t n = static_cast<size_t>(c.hq) * c.count;
      std::vector<float> expected(n, -1.0f);
      WindowVarianceJob job{.probs = w.probs.data(),
                            .num_q_heads = c.hq,
                            .num_queries = c.nq,
                            .window = c.window,
                            .count = c.count,
                            .gamma = gamma,
                            .scores = expected.data()};
      ASSERT_TRUE(cpu_->WindowVarianceScores({&job, 1}, nullptr).ok());
      DeviceBuffer<float> d_probs(w.probs), d_scores(std::vector<float>(n, -2.0f));
      job.probs = d_probs.get();
      job.scores = d_scores.get();
      ASSERT_TRUE(cuda_->WindowVarianceScores({&job, 1}, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = d_scores.ToHost();
      for (size_t i = 0; i < n; ++i) {
        ExpectRelNear(got[i], expected[i], kVarianceRelTolerance,
                      "variance count " + std::to_string(c.count) + " gamma " +
                          std::to_string(gamma) + " index " + std::to_string(i));
      }
    }
  }
}

TEST_F(CudaWindowStatsTest, WindowEntropyShift) {
  std::mt19937 rng(52);
  for (const Case& c : kCases) {
    const Window w = MakeWindow(c, rng);
    double entropy = -1.0, shift = -1.0;
    WindowEntropyJob job{.probs = w.probs.data(),
                         .key_positions = w.positions.data(),
                         .num_q_heads = c.hq,
                         .num_kv_heads = c.kv,
                         .num_queries = c.nq,
                         .window = c.window,
                         .count = c.count,
                         .first_query_position = w.first,
                         .entropy = &entropy,
                         .shift = &shift};
    ASSERT_TRUE(cpu_->WindowEntropyShift({&job, 1}, nullptr).ok());
    DeviceBuffer<float> d_probs(w.probs);
    DeviceBuffer<int32_t> d_positions(w.positions);
    DeviceBuffer<double> d_out(std::vector<double>{-2.0, -2.0});
    job.probs = d_probs.get();
    job.key_positions = d_positions.get();
    job.entropy = d_out.get();
    job.shift = d_out.get() + 1;
    ASSERT_TRUE(cuda_->WindowEntropyShift({&job, 1}, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> got = d_out.ToHost();
    const std::string what = "count " + std::to_string(c.count);
    ExpectRelNear(got[0], entropy, kEntropyRelTolerance, "entropy " + what);
    ExpectRelNear(got[1], shift, kShiftRelTolerance, "shift " + what);
    // Deterministic: the same job again gives the same bits.
    ASSERT_TRUE(cuda_->WindowEntropyShift({&job, 1}, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> again = d_out.ToHost();
    EXPECT_EQ(again[0], got[0]) << what;
    EXPECT_EQ(again[1], got[1]) << what;
  }
}

TEST_F(CudaWindowStatsTest, NegativeProbabilityPoisonsTheEntropyAsOnTheCpu) {
  std::mt19937 rng(53);
  const Case c{2, 1, 4, 4, 20};
  Window w = MakeWindow(c, rng);
  w.probs[5] = -0.5f;
  DeviceBuffer<float> d_probs(w.probs);
  DeviceBuffer<int32_t> d_positions(w.positions);
  DeviceBuffer<double> d_out(std::vector<double>{-2.0, -2.0});
  const WindowEntropyJob job{.probs = d_probs.get(),
                             .key_positions = d_positions.get(),
                             .num_q_heads = c.hq,
                             .num_kv_heads = c.kv,
                             .num_queries = c.nq,
                             .window = c.window,
                             .count = c.count,
                             .first_query_position = c.count,
                             .entropy = d_out.get(),
                             .shift = d_out.get() + 1};
  ASSERT_TRUE(cuda_->WindowEntropyShift({&job, 1}, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(std::isnan(d_out.ToHost()[0]));
}

TEST_F(CudaWindowStatsTest, MalformedJobsAndHostPointersAreRefused) {
  std::vector<float> host_probs(2 * 3 * 4, 0.25f), host_scores(2 * 4, -1.0f);
  DeviceBuffer<float> d_probs(host_probs), d_scores(host_scores);
  WindowVarianceJob job{.probs = d_probs.get(),
                        .num_q_heads = 2,
                        .num_queries = 3,
                        .window = 4,
                        .count = 4,
                        .gamma = 1.0,
                        .scores = d_scores.get()};
  absl::Status status = cuda_->WindowVarianceScores({&job, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("window variance job 0: window must be"));
  job.window = 2;
  job.scores = host_scores.data();
  status = cuda_->WindowVarianceScores({&job, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("window variance job 0: scores"));
  EXPECT_EQ(d_scores.ToHost(), host_scores);

  std::vector<int32_t> positions(4, 0);
  DeviceBuffer<int32_t> d_positions(positions);
  double host_entropy = 0.0;
  DeviceBuffer<double> d_out(std::vector<double>{-2.0, -2.0});
  WindowEntropyJob entropy_job{.probs = d_probs.get(),
                               .key_positions = d_positions.get(),
                               .num_q_heads = 2,
                               .num_kv_heads = 1,
                               .num_queries = 3,
                               .window = 3,
                               .count = 4,
                               .first_query_position = 1,
                               .entropy = &host_entropy,
                               .shift = d_out.get() + 1};
  status = cuda_->WindowEntropyShift({&entropy_job, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("window entropy job 0: entropy"));
  entropy_job.entropy = d_out.get();
  entropy_job.num_kv_heads = 3;
  status = cuda_->WindowEntropyShift({&entropy_job, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("window entropy job 0: num_q_heads must be a positive multiple"));
  EXPECT_EQ(d_out.ToHost(), (std::vector<double>{-2.0, -2.0}));
}

}  // namespace
}  // namespace kvs
