#include "gpu/cpu/caote_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/thread_pool.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Values of one layer ([H][count][D]) stored as the value half (kv index 1) of real paged blocks
// ([2][H][B][D]) behind a shuffled block table; the key half and spare blocks hold NaN so that a
// read of the wrong rows shows up in the scores.
struct PagedValues {
  std::vector<uint8_t> arena;
  std::vector<int32_t> block_table;
  PagedLayerView view;
  std::vector<float> stored;  // [H][count][D] as rounded to dtype

  PagedValues(const std::vector<std::vector<std::vector<float>>>& values, DType dtype,
              int block_tokens) {
    const int heads = static_cast<int>(values.size());
    const int count = static_cast<int>(values[0].size());
    const int dim = static_cast<int>(values[0][0].size());
    const int bytes = DTypeBytes(dtype);
    const int used = (count + block_tokens - 1) / block_tokens;
    const int total = used + 2;
    const uint64_t block_bytes = 2ull * heads * block_tokens * dim * bytes;
    arena.resize(total * block_bytes);
    for (uint64_t i = 0; i < arena.size() / bytes; ++i) {
      StoreFromFloat(arena.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
    }
    std::vector<int32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
    block_table.assign(ids.begin(), ids.begin() + used);
    for (int h = 0; h < heads; ++h) {
      for (int s = 0; s < count; ++s) {
        uint8_t* row = arena.data() + block_table[s / block_tokens] * block_bytes +
                       ((1ull * heads + h) * block_tokens + s % block_tokens) * dim * bytes;
        for (int d = 0; d < dim; ++d) {
          StoreFromFloat(row, dtype, d, values[h][s][d]);
          stored.push_back(LoadAsFloat(row, dtype, d));
        }
      }
    }
    view.arena = arena.data();
    view.kv_index = 1;
    view.block_table = block_table.data();
    view.count = count;
    view.num_kv_heads = heads;
    view.head_dim = dim;
    view.block_tokens = block_tokens;
    view.dtype = dtype;
    view.block_bytes = block_bytes;
  }
};

std::vector<float> Scores(const PagedValues& values, const std::vector<float>& alpha, int rows,
                          bool fast, int threads = 2, bool avx2 = true) {
  ThreadPool pool(threads);
  std::vector<float> scores(alpha.size(), -5.0f);
  CaoteJob job;
  job.values = values.view;
  job.alpha = alpha.data();
  job.rows = rows;
  job.fast = fast;
  job.scores = scores.data();
  const absl::Status status = RunCaoteScoresWithIsa({&job, 1}, pool, avx2);
  EXPECT_TRUE(status.ok()) << status;
  return scores;
}

void ExpectNear(const std::vector<float>& actual, const std::vector<double>& expected,
                double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "index " << i;
  }
}

// caote.md §13 TV1: one head, n = 5, d = 2.
TEST(CaoteCpu, Tv1ExactAndFast) {
  const std::vector<float> alpha = {.1f, .2f, .4f, .1f, .2f};
  for (int block_tokens : {2, 16}) {
    PagedValues v({{{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}}}, DType::kFloat32, block_tokens);
    ExpectNear(Scores(v, alpha, 1, false), {0.067586, 0.246221, 0.274874, 0.120185, 0.313249},
               1e-6);
    ExpectNear(Scores(v, alpha, 1, true), {0.049690, 0.25, 0.421637, 0.099381, 0.316228}, 1e-6);
  }
}

// TV6: a token holding all the mass scores +inf; zero-weight tokens exactly 0.
void ExpectTv6(const PagedValues& v) {
  for (bool fast : {false, true}) {
    const std::vector<float> scores = Scores(v, {1.0f, 0.0f, 0.0f}, 1, fast);
    EXPECT_EQ(scores[0], kInf);
    EXPECT_EQ(scores[1], 0.0f);
    EXPECT_EQ(scores[2], 0.0f);
  }
}

TEST(CaoteCpu, Tv6InfiniteAndZero) {
  ExpectTv6(PagedValues({{{1, 0}, {0, 1}, {1, 1}}}, DType::kFloat16, 2));
}

// TV5 (rss): two query-head rows (G = 2) over one kv head; per-row scores combined as
// sqrt(sum_rows c^2).
TEST(CaoteCpu, Tv5RssOfQueryHeadRows) {
  PagedValues v({{{1, 0}, {0, 1}, {0, 0}, {-1, 0}}}, DType::kBFloat16, 3);
  const std::vector<float> alpha = {.7f, .1f, .1f, .1f, .1f, .1f, .1f, .7f};
  const std::vector<float> c = Scores(v, alpha, 2, false);
  std::vector<float> rss(4);
  for (int s = 0; s < 4; ++s) rss[s] = std::sqrt(c[s] * c[s] + c[4 + s] * c[4 + s]);
  ExpectNear(rss, {0.978409, 0.169967, 0.095581, 0.978409}, 1e-6);
}

// Random values, several kv heads with G rows each, every dtype: against a double reference of
// the formula on the stored values.
TEST(CaoteCpu, RandomMatchesDoubleReference) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    const int heads = 3, group = 2, count = 37, dim = 24, rows = heads * group;
    std::vector<std::vector<std::vector<float>>> values(
        heads, std::vector<std::vector<float>>(count, std::vector<float>(dim)));
    for (auto& h : values) {
      for (auto& row : h) {
        for (float& x : row) x = normal(rng);
      }
    }
    PagedValues v(values, dtype, 5);
    std::vector<float> alpha(rows * count);
    for (int r = 0; r < rows; ++r) {
      float sum = 0;
      for (int s = 0; s < count; ++s)
        sum += alpha[r * count + s] = uniform(rng) < .2f ? 0 : uniform(rng);
      for (int s = 0; s < count; ++s) alpha[r * count + s] /= sum;
    }
    for (bool fast : {false, true}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " fast=" << fast);
      std::vector<double> expected(rows * count);
      for (int r = 0; r < rows; ++r) {
        const int h = r / group;
        std::vector<double> x(dim, 0.0);
        for (int s = 0; s < count; ++s) {
          for (int d = 0; d < dim; ++d) {
            x[d] +=
                (fast ? 1.0 / count : alpha[r * count + s]) * v.stored[(h * count + s) * dim + d];
          }
        }
        for (int s = 0; s < count; ++s) {
          double sq = 0;
          for (int d = 0; d < dim; ++d) {
            const double diff = x[d] - v.stored[(h * count + s) * dim + d];
            sq += diff * diff;
          }
          const double a = alpha[r * count + s];
          expected[r * count + s] = a / (1 - a) * std::sqrt(sq);
        }
      }
      const std::vector<float> scores = Scores(v, alpha, rows, fast, 3);
      ExpectNear(scores, expected, 1e-5);
      for (int i = 0; i < rows * count; ++i) {
        if (alpha[i] == 0) {
          EXPECT_EQ(scores[i], 0.0f);
        }
      }
    }
  }
}

// TV1 and TV6 with the rows zero-padded to d = 8 (same distances): the vector kernels, both with
// one row per head read in place and with several rows per head sharing converted rows.
TEST(CaoteCpu, TestVectorsOnTheVectorPath) {
  auto pad = [](std::vector<std::vector<float>> rows) {
    for (auto& row : rows) row.resize(8, 0.0f);
    return std::vector<std::vector<std::vector<float>>>{rows};
  };
  const std::vector<float> alpha = {.1f, .2f, .4f, .1f, .2f};
  const std::vector<double> exact = {0.067586, 0.246221, 0.274874, 0.120185, 0.313249};
  const std::vector<double> fast = {0.049690, 0.25, 0.421637, 0.099381, 0.316228};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    PagedValues v(pad({{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}}), dtype, 2);
    ExpectNear(Scores(v, alpha, 1, false), exact, 1e-6);
    ExpectNear(Scores(v, alpha, 1, true), fast, 1e-6);
    // Two identical rows over the one head.
    std::vector<float> twice = alpha;
    twice.insert(twice.end(), alpha.begin(), alpha.end());
    std::vector<double> exact2 = exact, fast2 = fast;
    exact2.insert(exact2.end(), exact.begin(), exact.end());
    fast2.insert(fast2.end(), fast.begin(), fast.end());
    ExpectNear(Scores(v, twice, 2, false), exact2, 1e-6);
    ExpectNear(Scores(v, twice, 2, true), fast2, 1e-6);
  }
  ExpectTv6(PagedValues(pad({{1, 0}, {0, 1}, {1, 1}}), DType::kFloat16, 2));
}

// Model-sized rows (head_dim 128, the vector kernels) over many blocks and a partial last group
// of 8 slots, one or four rows per kv head, both kernels: against a double reference. Some
// weights are 0 (exactly 0), one row puts almost all its mass on one slot (+inf).
TEST(CaoteCpu, VectorKernelsMatchDoubleReference) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const int heads = 2, count = 203, dim = 128;
  std::vector<std::vector<std::vector<float>>> values(
      heads, std::vector<std::vector<float>>(count, std::vector<float>(dim)));
  for (auto& h : values) {
    for (auto& row : h) {
      for (float& x : row) x = normal(rng);
    }
  }
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    PagedValues v(values, dtype, 16);
    for (int group : {1, 4}) {
      const int rows = heads * group;
      std::vector<float> alpha(rows * count);
      for (int r = 0; r < rows; ++r) {
        float sum = 0;
        for (int s = 0; s < count; ++s) {
          sum += alpha[r * count + s] = uniform(rng) < .2f ? 0 : uniform(rng);
        }
        for (int s = 0; s < count; ++s) alpha[r * count + s] /= sum;
      }
      // Row 1: slot 7 holds all but 1e-8 of the mass.
      std::fill(alpha.begin() + count, alpha.begin() + 2 * count, 0.0f);
      alpha[count + 7] = 1.0f - 1e-8f;
      for (bool fast : {false, true}) {
        for (bool avx2 : {true, false}) {
          SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " group=" << group
                                            << " fast=" << fast << " avx2=" << avx2);
          std::vector<double> expected(rows * count);
          for (int r = 0; r < rows; ++r) {
            const int h = r / group;
            std::vector<double> x(dim, 0.0);
            for (int s = 0; s < count; ++s) {
              for (int d = 0; d < dim; ++d) {
                x[d] += (fast ? 1.0 / count : alpha[r * count + s]) *
                        v.stored[(h * count + s) * dim + d];
              }
            }
            for (int s = 0; s < count; ++s) {
              double sq = 0;
              for (int d = 0; d < dim; ++d) {
                const double diff = x[d] - v.stored[(h * count + s) * dim + d];
                sq += diff * diff;
              }
              const double a = alpha[r * count + s];
              expected[r * count + s] = a == 0          ? 0
                                        : 1 - a <= 1e-6 ? kInf
                                                        : a / (1 - a) * std::sqrt(sq);
            }
          }
          const std::vector<float> scores = Scores(v, alpha, rows, fast, 3, avx2);
          for (int i = 0; i < rows * count; ++i) {
            if (std::isinf(expected[i])) {
              EXPECT_EQ(scores[i], kInf) << i;
            } else if (expected[i] == 0) {
              EXPECT_EQ(scores[i], 0.0f) << i;
            } else {
              // Relative: the distances of 128 normal dims are ~16.
              EXPECT_NEAR(scores[i], expected[i], 1e-5 * std::max(1.0, expected[i])) << i;
            }
          }
        }
      }
    }
  }
}

TEST(CaoteCpu, InvalidJobsAreRejectedAndNothingIsWritten) {
  PagedValues v({{{1, 0}, {0, 1}, {1, 1}}, {{1, 0}, {0, 1}, {1, 1}}}, DType::kFloat32, 2);
  const std::vector<float> alpha(2 * 3, 1.0f / 3);
  struct Case {
    const char* field;
    void (*mutate)(CaoteJob&);
  };
  const Case cases[] = {
      {"rows", [](CaoteJob& j) { j.rows = 3; }},
      {"rows", [](CaoteJob& j) { j.rows = 0; }},
      {"eps", [](CaoteJob& j) { j.eps = -1.0f; }},
      {"eps", [](CaoteJob& j) { j.eps = std::numeric_limits<float>::quiet_NaN(); }},
      {"alpha", [](CaoteJob& j) { j.alpha = nullptr; }},
      {"scores", [](CaoteJob& j) { j.scores = nullptr; }},
      {"values.kv_index", [](CaoteJob& j) { j.values.kv_index = 2; }},
      {"values.block_bytes", [](CaoteJob& j) { j.values.block_bytes -= 1; }},
      {"values.count", [](CaoteJob& j) { j.values.count = -1; }},
      {"values.arena", [](CaoteJob& j) { j.values.arena = nullptr; }},
      {"values.block_table", [](CaoteJob& j) { j.values.block_table = nullptr; }},
  };
  ThreadPool pool(2);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    std::vector<float> good_scores(6, -5.0f), bad_scores(6, -5.0f);
    CaoteJob good;
    good.values = v.view;
    good.alpha = alpha.data();
    good.rows = 2;
    good.scores = good_scores.data();
    CaoteJob bad = good;
    bad.scores = bad_scores.data();
    c.mutate(bad);
    const std::vector<CaoteJob> jobs = {good, bad};
    const absl::Status status = RunCaoteScores(jobs, pool);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("caote job 1: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    for (float s : good_scores) EXPECT_EQ(s, -5.0f);
    for (float s : bad_scores) EXPECT_EQ(s, -5.0f);
  }
}

// Through the Backend entry point.
TEST(CaoteCpu, BackendCaoteScores) {
  PagedValues v({{{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}}}, DType::kFloat32, 4);
  const std::vector<float> alpha = {.1f, .2f, .4f, .1f, .2f};
  std::vector<float> scores(5);
  CaoteJob job;
  job.values = v.view;
  job.alpha = alpha.data();
  job.rows = 1;
  job.scores = scores.data();
  ASSERT_TRUE(MakeCpuBackend(2)->CaoteScores({&job, 1}, nullptr).ok());
  ExpectNear(scores, {0.067586, 0.246221, 0.274874, 0.120185, 0.313249}, 1e-6);
}

}  // namespace
}  // namespace kvs
