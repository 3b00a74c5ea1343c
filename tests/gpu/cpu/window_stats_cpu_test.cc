// CAKE's window statistics on the CPU (gpu/cpu/window_stats_cpu.h) against their definitions in
// gpu/backend.h, written out naively here: WindowVarianceScores exactly, on the scalar and the
// AVX2 paths and with or without a thread pool; WindowEntropyShift exactly on the scalar path
// (std::log) and within fp32 rounding of the logarithm on the AVX2 path; validation by field.
#include "gpu/cpu/window_stats_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

struct Case {
  int32_t hq, kv, nq, window, count;
};
// One row, GQA, counts not a multiple of the vector widths (4, 8) and beyond a 512-slot block.
const Case kCases[] = {{2, 1, 1, 1, 7},  {4, 2, 6, 4, 130}, {3, 3, 5, 5, 1029},
                       {8, 2, 9, 9, 33}, {1, 1, 2, 2, 1},   {2, 1, 40, 32, 515}};

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
  // Some exact zeros (ln(0 + 1e-10) is finite) as masked attention leaves them.
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

const float* Row(const Window& w, const Case& c, int32_t q, int32_t i) {
  return w.probs.data() + (static_cast<int64_t>(q) * c.nq + (c.nq - c.window) + i) * c.count;
}

// gpu/backend.h WindowVarianceJob, slot by slot.
std::vector<float> VarianceReference(const Window& w, const Case& c, double gamma) {
  std::vector<float> out(static_cast<size_t>(c.hq) * c.count);
  for (int32_t q = 0; q < c.hq; ++q) {
    for (int32_t s = 0; s < c.count; ++s) {
      double mean = 0.0;
      for (int32_t i = 0; i < c.window; ++i) mean += Row(w, c, q, i)[s];
      mean /= c.window;
      double squares = 0.0;
      for (int32_t i = 0; i < c.window; ++i) {
        const double d = Row(w, c, q, i)[s] - mean;
        squares += d * d;
      }
      const double var = c.window > 1 ? squares / (c.window - 1) : 0.0;
      out[static_cast<size_t>(q) * c.count + s] = static_cast<float>(mean + gamma * var);
    }
  }
  return out;
}

// gpu/backend.h WindowEntropyJob, in the CPU backend's (q, s) order, with std::log.
std::pair<double, double> EntropyReference(const Window& w, const Case& c) {
  const int32_t group = c.hq / c.kv;
  double plogp = 0.0, shift = 0.0;
  for (int32_t q = 0; q < c.hq; ++q) {
    for (int32_t s = 0; s < c.count; ++s) {
      if (w.positions[static_cast<size_t>(q / group) * c.count + s] >= w.first) continue;
      float terms = 0.0f;
      double mean = 0.0;
      for (int32_t i = 0; i < c.window; ++i) {
        const float p = Row(w, c, q, i)[s];
        terms += p * std::log(p + 1e-10f);
        mean += p;
      }
      plogp += terms;
      if (c.window < 2) continue;
      mean /= c.window;
      double squares = 0.0;
      for (int32_t i = 0; i < c.window; ++i) {
        const double d = Row(w, c, q, i)[s] - mean;
        squares += d * d;
      }
      shift += squares / (c.window - 1);
    }
  }
  return {-plogp, shift};
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(WindowVarianceScores, EqualsTheDefinitionToTheBitOnEveryPath) {
  std::mt19937 rng(1);
  ThreadPool pool(3);
  for (const Case& c : kCases) {
    const Window w = MakeWindow(c, rng);
    for (const double gamma : {0.0, 1.0, 200.0}) {
      const std::vector<float> expected = VarianceReference(w, c, gamma);
      for (const bool avx2 : {false, true}) {
        for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
          std::vector<float> out(expected.size(), -1.0f);
          const WindowVarianceJob job{.probs = w.probs.data(),
                                      .num_q_heads = c.hq,
                                      .num_queries = c.nq,
                                      .window = c.window,
                                      .count = c.count,
                                      .gamma = gamma,
                                      .scores = out.data()};
          ASSERT_TRUE(RunWindowVarianceScores({&job, 1}, p, avx2).ok());
          EXPECT_TRUE(BitEqual(out, expected))
              << "count " << c.count << " window " << c.window << " gamma " << gamma << " avx2 "
              << avx2 << " pool " << (p != nullptr);
        }
      }
    }
  }
}

TEST(WindowEntropyShift, EqualsTheDefinitionScalarExactlyAndAvx2WithinLogRounding) {
  std::mt19937 rng(2);
  ThreadPool pool(3);
  for (const Case& c : kCases) {
    const Window w = MakeWindow(c, rng);
    const auto [entropy, shift] = EntropyReference(w, c);
    for (const bool avx2 : {false, true}) {
      // Two jobs in one call so that the pool runs them side by side.
      double e[2] = {-1.0, -1.0}, v[2] = {-1.0, -1.0};
      WindowEntropyJob jobs[2];
      for (int j = 0; j < 2; ++j) {
        jobs[j] = WindowEntropyJob{.probs = w.probs.data(),
                                   .key_positions = w.positions.data(),
                                   .num_q_heads = c.hq,
                                   .num_kv_heads = c.kv,
                                   .num_queries = c.nq,
                                   .window = c.window,
                                   .count = c.count,
                                   .first_query_position = w.first,
                                   .entropy = &e[j],
                                   .shift = &v[j]};
      }
      ASSERT_TRUE(RunWindowEntropyShift(jobs, &pool, avx2).ok());
      for (int j = 0; j < 2; ++j) {
        // The squares are the same fp64 operations on both paths.
        EXPECT_EQ(v[j], shift) << "count " << c.count << " avx2 " << avx2;
        if (avx2) {
          // The polynomial logarithm is within ~1 ulp of std::log per term.
          EXPECT_NEAR(e[j], entropy, 1e-5 * std::fabs(entropy) + 1e-9) << "count " << c.count;
        } else {
          EXPECT_EQ(e[j], entropy) << "count " << c.count;
        }
      }
      if (c.count > 3) {
        EXPECT_GT(e[0], 0.0);
      }
      if (c.window < 2) {
        EXPECT_EQ(v[0], 0.0);
      }
    }
  }
}

TEST(WindowEntropyShift, NoPrefixSlotsMeasureZeroAndBadProbabilitiesAreNotFinite) {
  std::mt19937 rng(3);
  const Case c{2, 1, 4, 4, 20};
  Window w = MakeWindow(c, rng);
  double entropy = -1.0, shift = -1.0;
  WindowEntropyJob job{.probs = w.probs.data(),
                       .key_positions = w.positions.data(),
                       .num_q_heads = c.hq,
                       .num_kv_heads = c.kv,
                       .num_queries = c.nq,
                       .window = c.window,
                       .count = c.count,
                       .first_query_position = 0,  // every slot is window
                       .entropy = &entropy,
                       .shift = &shift};
  ASSERT_TRUE(RunWindowEntropyShift({&job, 1}, nullptr).ok());
  EXPECT_EQ(entropy, 0.0);
  EXPECT_EQ(shift, 0.0);
  // A negative probability poisons the entropy on both paths, as std::log would.
  w.probs[5] = -0.5f;
  job.first_query_position = c.count;
  for (const bool avx2 : {false, true}) {
    ASSERT_TRUE(RunWindowEntropyShift({&job, 1}, nullptr, avx2).ok());
    EXPECT_TRUE(std::isnan(entropy)) << "avx2 " << avx2;
  }
}

TEST(WindowStats, MalformedJobsAreRefusedByFieldAndWriteNothing) {
  std::vector<float> probs(2 * 3 * 4, 0.25f), scores(2 * 4, -1.0f);
  std::vector<int32_t> positions(4, 0);
  const WindowVarianceJob good{.probs = probs.data(),
                               .num_q_heads = 2,
                               .num_queries = 3,
                               .window = 2,
                               .count = 4,
                               .gamma = 1.0,
                               .scores = scores.data()};
  struct VarianceCase {
    WindowVarianceJob job;
    std::string message;
  };
  std::vector<VarianceCase> variance_cases;
  WindowVarianceJob bad = good;
  bad.window = 0;
  variance_cases.push_back({bad, "window variance job 1: window must be in [1, num_queries = 3]"});
  bad = good;
  bad.num_q_heads = 0;
  variance_cases.push_back({bad, "window variance job 1: num_q_heads must be >= 1"});
  bad = good;
  bad.gamma = std::nan("");
  variance_cases.push_back({bad, "window variance job 1: gamma must be finite"});
  bad = good;
  bad.probs = nullptr;
  variance_cases.push_back({bad, "window variance job 1: probs is null"});
  bad = good;
  bad.scores = nullptr;
  variance_cases.push_back({bad, "window variance job 1: scores is null"});
  for (const VarianceCase& vc : variance_cases) {
    const WindowVarianceJob jobs[2] = {good, vc.job};
    const absl::Status status = RunWindowVarianceScores(jobs, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << vc.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(vc.message));
    EXPECT_EQ(scores, std::vector<float>(scores.size(), -1.0f)) << "the good job ran";
  }

  double entropy = -1.0, shift = -1.0;
  const WindowEntropyJob good_entropy{.probs = probs.data(),
                                      .key_positions = positions.data(),
                                      .num_q_heads = 2,
                                      .num_kv_heads = 1,
                                      .num_queries = 3,
                                      .window = 3,
                                      .count = 4,
                                      .first_query_position = 1,
                                      .entropy = &entropy,
                                      .shift = &shift};
  struct EntropyCase {
    WindowEntropyJob job;
    std::string message;
  };
  std::vector<EntropyCase> entropy_cases;
  WindowEntropyJob bad_entropy = good_entropy;
  bad_entropy.num_kv_heads = 0;
  entropy_cases.push_back({bad_entropy, "window entropy job 1: num_kv_heads must be >= 1"});
  bad_entropy = good_entropy;
  bad_entropy.num_q_heads = 3;
  bad_entropy.num_kv_heads = 2;
  entropy_cases.push_back(
      {bad_entropy, "window entropy job 1: num_q_heads must be a positive multiple"});
  bad_entropy = good_entropy;
  bad_entropy.window = 4;
  entropy_cases.push_back({bad_entropy, "window entropy job 1: window must be in [1"});
  bad_entropy = good_entropy;
  bad_entropy.key_positions = nullptr;
  entropy_cases.push_back({bad_entropy, "window entropy job 1: key_positions is null"});
  bad_entropy = good_entropy;
  bad_entropy.shift = nullptr;
  entropy_cases.push_back({bad_entropy, "window entropy job 1: shift is null"});
  for (const EntropyCase& ec : entropy_cases) {
    const WindowEntropyJob jobs[2] = {good_entropy, ec.job};
    const absl::Status status = RunWindowEntropyShift(jobs, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << ec.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(ec.message));
    EXPECT_EQ(entropy, -1.0) << "the good job ran";
  }
}

TEST(WindowStats, TheCpuBackendAndBackendsDefaultAgreeWithTheHostCode) {
  std::mt19937 rng(4);
  const Case c{4, 2, 6, 4, 700};
  const Window w = MakeWindow(c, rng);
  const std::vector<float> expected = VarianceReference(w, c, 3.0);
  std::unique_ptr<Backend> cpu = MakeCpuBackend(2);
  std::vector<float> out(expected.size(), -1.0f);
  const WindowVarianceJob job{.probs = w.probs.data(),
                              .num_q_heads = c.hq,
                              .num_queries = c.nq,
                              .window = c.window,
                              .count = c.count,
                              .gamma = 3.0,
                              .scores = out.data()};
  ASSERT_TRUE(cpu->WindowVarianceScores({&job, 1}, nullptr).ok());
  EXPECT_TRUE(BitEqual(out, expected));
  std::fill(out.begin(), out.end(), -1.0f);
  ASSERT_TRUE(cpu->Backend::WindowVarianceScores({&job, 1}, nullptr).ok());
  EXPECT_TRUE(BitEqual(out, expected));
}

}  // namespace
}  // namespace kvs
