#include "gpu/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/keydiff_cpu.h"
#include "gpu/cpu/thread_pool.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

// A paged layer on the host, K and V per block ([2][H][B][D]), through a shuffled block table.
// Everything but the key rows (values, unused blocks) is NaN so a stray read shows up in probs.
struct PagedLayer {
  std::vector<uint8_t> arena;
  std::vector<int32_t> block_table;
  PagedLayerView view;
  std::vector<float> stored;  // keys as stored, [H][count][D], after rounding to dtype

  PagedLayer(int heads, int count, int dim, DType dtype, int block_tokens, std::mt19937& rng) {
    const int bytes = DTypeBytes(dtype);
    const int used = (count + block_tokens - 1) / block_tokens;
    const int total = used + 3;
    const uint64_t block_bytes = 2ull * heads * block_tokens * dim * bytes;
    arena.resize(total * block_bytes);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (uint64_t i = 0; i < arena.size() / bytes; ++i) StoreFromFloat(arena.data(), dtype, i, nan);
    std::vector<int32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    block_table.assign(ids.begin(), ids.begin() + used);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    stored.resize(static_cast<size_t>(heads) * count * dim);
    for (int h = 0; h < heads; ++h) {
      for (int s = 0; s < count; ++s) {
        uint8_t* row = arena.data() + block_table[s / block_tokens] * block_bytes +
                       (static_cast<uint64_t>(h) * block_tokens + s % block_tokens) * dim * bytes;
        for (int d = 0; d < dim; ++d) {
          StoreFromFloat(row, dtype, d, normal(rng));
          stored[(static_cast<size_t>(h) * count + s) * dim + d] = LoadAsFloat(row, dtype, d);
        }
      }
    }
    view.arena = arena.data();
    view.kv_index = 0;
    view.block_table = block_table.data();
    view.count = count;
    view.num_kv_heads = heads;
    view.head_dim = dim;
    view.block_tokens = block_tokens;
    view.dtype = dtype;
    view.block_bytes = block_bytes;
  }
};

struct Problem {
  PagedLayer layer;
  std::vector<int32_t> key_positions;    // [H][count], scrambled per head
  std::vector<float> queries;            // [Hq][w][D]
  std::vector<int32_t> query_positions;  // [w]
  std::vector<float> probs;
  AttentionJob job;

  Problem(int heads, int group, int window, int count, int dim, DType dtype, int block_tokens,
          uint32_t seed)
      : layer(heads, count, dim, dtype, block_tokens, rng(seed)) {
    std::mt19937 r(seed + 1);
    const int q_heads = heads * group;
    for (int h = 0; h < heads; ++h) {
      // Slot order != position order: a permutation of positions 10..count+9 per head.
      std::vector<int32_t> p(count);
      std::iota(p.begin(), p.end(), 10);
      std::shuffle(p.begin(), p.end(), r);
      key_positions.insert(key_positions.end(), p.begin(), p.end());
    }
    std::normal_distribution<float> normal(0.0f, 1.0f);
    queries.resize(static_cast<size_t>(q_heads) * window * dim);
    for (float& q : queries) q = normal(r);
    // Query 0 sits before every key (a fully masked row); the rest spread over the range, the
    // last one after every key (nothing masked).
    std::uniform_int_distribution<int32_t> pos(10, count + 9);
    for (int i = 0; i < window; ++i) query_positions.push_back(pos(r));
    query_positions[0] = 5;
    if (window > 1) query_positions[window - 1] = count + 20;
    probs.assign(static_cast<size_t>(q_heads) * window * count, -7.0f);
    job.keys = layer.view;
    job.key_positions = key_positions.data();
    job.queries = queries.data();
    job.query_positions = query_positions.data();
    job.num_q_heads = q_heads;
    job.num_queries = window;
    job.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    job.probs = probs.data();
  }

  static std::mt19937& rng(uint32_t seed) {
    thread_local std::mt19937 r;
    r.seed(seed);
    return r;
  }

  // Naive double-precision softmax of the stored (dtype-rounded) keys.
  std::vector<double> Reference() const {
    const int heads = job.keys.num_kv_heads, count = job.keys.count, dim = job.keys.head_dim;
    const int group = job.num_q_heads / heads, window = job.num_queries;
    std::vector<double> out(probs.size(), 0.0);
    for (int q = 0; q < job.num_q_heads; ++q) {
      const int g = q / group;
      for (int i = 0; i < window; ++i) {
        std::vector<double> l(count);
        double max = -INFINITY;
        for (int s = 0; s < count; ++s) {
          if (key_positions[g * count + s] > query_positions[i]) {
            l[s] = -INFINITY;
            continue;
          }
          double dot = 0;
          for (int d = 0; d < dim; ++d) {
            dot += static_cast<double>(queries[(static_cast<size_t>(q) * window + i) * dim + d]) *
                   layer.stored[(static_cast<size_t>(g) * count + s) * dim + d];
          }
          l[s] = dot * job.scale;
          max = std::max(max, l[s]);
        }
        double* row = out.data() + (static_cast<size_t>(q) * window + i) * count;
        if (max == -INFINITY) continue;
        double sum = 0;
        for (int s = 0; s < count; ++s) sum += l[s] == -INFINITY ? 0 : std::exp(l[s] - max);
        for (int s = 0; s < count; ++s) row[s] = l[s] == -INFINITY ? 0 : std::exp(l[s] - max) / sum;
      }
    }
    return out;
  }

  // expected_masked_rows < 0: one per query head (query 0 precedes every key).
  void ExpectMatchesReference(double tolerance = 1e-5, int expected_masked_rows = -1) const {
    const std::vector<double> expected = Reference();
    const int count = job.keys.count;
    int masked_rows = 0;
    for (size_t r = 0; r < probs.size() / count; ++r) {
      double row_sum = 0;
      for (int s = 0; s < count; ++s) {
        const size_t k = r * count + s;
        ASSERT_NEAR(probs[k], expected[k], tolerance) << "row " << r << " slot " << s;
        if (expected[k] == 0.0) {
          ASSERT_EQ(probs[k], 0.0f) << "masked slot must be exactly 0, row " << r << " slot " << s;
        }
        row_sum += probs[k];
      }
      if (row_sum == 0) {
        ++masked_rows;
      } else {
        EXPECT_NEAR(row_sum, 1.0, 1e-5) << "row " << r;
      }
    }
    // Query 0 of every head precedes all keys.
    EXPECT_EQ(masked_rows, expected_masked_rows < 0 ? job.num_q_heads : expected_masked_rows);
  }
};

// Every ISA level the kernels have; a level the CPU lacks runs the best one below it.
constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

// dtype, group size G, window w, highest ISA allowed.
class AttentionCpuTest : public ::testing::TestWithParam<std::tuple<DType, int, int, CpuIsa>> {};

TEST_P(AttentionCpuTest, MatchesDoubleReference) {
  const auto [dtype, group, window, isa] = GetParam();
  ThreadPool pool(3);
  // count 100 with block_tokens 16: neither the blocks nor the 48-slot tiles divide it.
  for (int dim : {64, 20}) {  // 20: not a multiple of 8, always the scalar kernel
    SCOPED_TRACE(dim);
    Problem problem(/*heads=*/2, group, window, /*count=*/100, dim, dtype, /*block_tokens=*/16,
                    /*seed=*/static_cast<uint32_t>(group * 100 + window + dim));
    ASSERT_TRUE(RunAttentionProbsWithIsa({&problem.job, 1}, pool, isa).ok());
    problem.ExpectMatchesReference();
  }
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCpuTest,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16,
                                                              DType::kFloat32),
                                            ::testing::Values(1, 2, 4), ::testing::Values(1, 32),
                                            ::testing::ValuesIn(kAllIsas)));

// A long single job on a 4-thread pool is split into chunks of tiles whose partial softmaxes are
// merged in the second phase; several jobs of different shapes share one call.
TEST(AttentionCpu, ChunkedAndMultiJobMatchReference) {
  for (CpuIsa isa : kAllIsas) {
    SCOPED_TRACE(CpuIsaName(isa));
    ThreadPool pool(4);
    Problem a(/*heads=*/1, /*group=*/4, /*window=*/16, /*count=*/2000, /*dim=*/128, DType::kFloat16,
              /*block_tokens=*/32, 11);
    Problem b(/*heads=*/2, /*group=*/2, /*window=*/3, /*count=*/333, /*dim=*/32, DType::kFloat32,
              /*block_tokens=*/7, 12);
    Problem c(/*heads=*/4, /*group=*/1, /*window=*/1, /*count=*/1, /*dim=*/8, DType::kBFloat16,
              /*block_tokens=*/16, 13);
    const std::vector<AttentionJob> jobs = {a.job, b.job, c.job};
    ASSERT_TRUE(RunAttentionProbsWithIsa(jobs, pool, isa).ok());
    a.ExpectMatchesReference();
    b.ExpectMatchesReference();
    c.ExpectMatchesReference();
  }
}

// Decode shapes (one query, fewer than 8 rows per kv head: the fused decode kernel, which walks
// every kv head of a job per tile): model-sized rows, every dtype, GQA groups that fill one
// 4-row strip, part of one or one and a half; the query after every key, then in the middle of
// the positions (part masked); a 1-thread pool (whole jobs) and a 4-thread one (a single job
// split into chunks of tiles).
TEST(AttentionCpu, DecodeShapesMatchReference) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int group : {1, 3, 4, 6}) {
      for (int threads : {1, 4}) {
        for (bool middle : {false, true}) {
          SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " group=" << group
                                            << " threads=" << threads << " middle=" << middle);
          ThreadPool pool(threads);
          Problem p(/*heads=*/8, group, /*window=*/1, /*count=*/1000, /*dim=*/128, dtype,
                    /*block_tokens=*/16, static_cast<uint32_t>(group * 10 + threads));
          p.query_positions[0] = middle ? 500 : 5000;
          ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, CpuIsa::kAvx512).ok());
          p.ExpectMatchesReference(1e-5, /*expected_masked_rows=*/0);
        }
      }
    }
  }
}

// The Backend entry point runs the same kernels.
TEST(AttentionCpu, BackendAttentionProbs) {
  auto backend = MakeCpuBackend(2);
  Problem p(/*heads=*/8, /*group=*/4, /*window=*/32, /*count=*/200, /*dim=*/128, DType::kFloat16,
            /*block_tokens=*/16, 21);
  ASSERT_TRUE(backend->AttentionProbs({&p.job, 1}, nullptr).ok());
  p.ExpectMatchesReference();
}

// Large logits: the softmax is max-subtracted (a naive exp would overflow to inf / NaN).
TEST(AttentionCpu, LargeLogitsAreStable) {
  for (CpuIsa isa : kAllIsas) {
    SCOPED_TRACE(CpuIsaName(isa));
    ThreadPool pool(1);
    // 16 query rows per kv head: the window kernel. Logits in the hundreds.
    Problem p(1, 8, 2, 60, 16, DType::kFloat32, 16, 5);
    p.job.scale = 40.0f;
    ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, isa).ok());
    for (float v : p.probs) ASSERT_TRUE(std::isfinite(v));
    p.ExpectMatchesReference(1e-4);
  }
}

// Queries so large that the dot products overflow (+inf and -inf terms meet: NaN logits) give
// non-finite probabilities (and column sums) on every ISA and shape, for the caller's finiteness
// check to refuse: a NaN must not vanish into a max reduction and leave finite, meaningless
// probabilities.
TEST(AttentionCpu, OverflowingLogitsGiveNonFiniteProbabilitiesOnEveryIsa) {
  for (CpuIsa isa : kAllIsas) {
    for (const int window : {1, 32}) {  // the decode kernel and the window kernel
      SCOPED_TRACE(::testing::Message() << CpuIsaName(isa) << " window " << window);
      ThreadPool pool(2);
      Problem p(/*heads=*/2, /*group=*/4, window, /*count=*/200, /*dim=*/128, DType::kFloat16,
                /*block_tokens=*/16, 31);
      for (float& q : p.queries) q = q >= 0.0f ? 3e38f : -3e38f;
      for (int32_t& position : p.query_positions) position = p.job.keys.count + 20;  // sees all
      ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, isa).ok());
      const int count = p.job.keys.count;
      const int rows = static_cast<int>(p.probs.size()) / count;
      for (int r = 0; r < rows; ++r) {
        const float* row = p.probs.data() + static_cast<size_t>(r) * count;
        EXPECT_FALSE(std::all_of(row, row + count, [](float v) { return std::isfinite(v); }))
            << "row " << r << " has only finite probabilities";
      }
      std::vector<float> sums(static_cast<size_t>(p.job.num_q_heads) * count, -7.0f);
      AttentionSumsJob sums_job{.attention = p.job, .sums = sums.data()};
      sums_job.attention.probs = nullptr;
      ASSERT_TRUE(RunAttentionColumnSums({&sums_job, 1}, pool, isa).ok());
      for (int q = 0; q < p.job.num_q_heads; ++q) {
        const float* row = sums.data() + static_cast<size_t>(q) * count;
        EXPECT_FALSE(std::all_of(row, row + count, [](float v) { return std::isfinite(v); }))
            << "the column sums of query head " << q << " are all finite";
      }
    }
  }
}

// The AVX-512 window kernel against the scalar code (and the AVX2 kernel) on shapes that reach
// every tail: key counts around the 48-slot tile and the 16-lane vectors, rows per kv head
// (G x w) at every remainder of the 8-row block (and under 8: the decode kernel), head_dim 64,
// 128 and 24 (not a multiple of 16), and 20 (not a multiple of 8: scalar for every level);
// causally masked slots and a fully masked row (query 0), scrambled key positions. Probabilities
// (AttentionProbs) and window sums (AttentionColumnSums) must agree up to summation order, and
// masked slots must be exactly 0.
class AttentionAvx512Test : public ::testing::TestWithParam<std::tuple<DType, int, int>> {};

TEST_P(AttentionAvx512Test, MatchesScalarAndAvx2) {
  if (HardwareCpuIsa() != CpuIsa::kAvx512) {
    GTEST_SKIP() << "this CPU lacks AVX-512 (F/BW/VL/DQ): the AVX-512 kernel cannot run here";
  }
  if (DetectedCpuIsa() != CpuIsa::kAvx512) {
    GTEST_SKIP() << "KVS_CPU_ISA caps this process below avx512";
  }
  const auto [dtype, group, dim] = GetParam();
  ThreadPool pool(2);
  for (const int window : {1, 5, 8, 9, 13, 16, 31, 64}) {
    for (const int count : {1, 15, 17, 48, 49, 100, 337}) {
      SCOPED_TRACE(::testing::Message() << "window " << window << " count " << count);
      Problem p(/*heads=*/2, group, window, count, dim, dtype, /*block_tokens=*/16,
                static_cast<uint32_t>(window * 1000 + count + group * 7 + dim));
      std::vector<std::vector<float>> probs, sums;
      for (CpuIsa isa : kAllIsas) {
        std::fill(p.probs.begin(), p.probs.end(), -7.0f);
        ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, isa).ok());
        probs.push_back(p.probs);
        std::vector<float> out(static_cast<size_t>(p.job.num_q_heads) * count, -7.0f);
        AttentionSumsJob job{.attention = p.job, .sums = out.data()};
        job.attention.probs = nullptr;
        ASSERT_TRUE(RunAttentionColumnSums({&job, 1}, pool, isa).ok());
        sums.push_back(std::move(out));
      }
      const std::vector<float>& scalar = probs[0];
      const std::vector<float>& avx2 = probs[1];
      const std::vector<float>& avx512 = probs[2];
      for (size_t k = 0; k < scalar.size(); ++k) {
        ASSERT_NEAR(avx512[k], scalar[k], 2e-6) << "probs[" << k << "] vs scalar";
        ASSERT_NEAR(avx512[k], avx2[k], 1e-6) << "probs[" << k << "] vs avx2";
        if (scalar[k] == 0.0f) {
          ASSERT_EQ(avx512[k], 0.0f) << "masked probs[" << k << "]";
        }
      }
      for (size_t k = 0; k < sums[0].size(); ++k) {
        ASSERT_NEAR(sums[2][k], sums[0][k], 2e-6 * window) << "sums[" << k << "] vs scalar";
        ASSERT_NEAR(sums[2][k], sums[1][k], 1e-6 * window) << "sums[" << k << "] vs avx2";
        if (sums[0][k] == 0.0f) {
          ASSERT_EQ(sums[2][k], 0.0f) << "masked sums[" << k << "]";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionAvx512Test,
    ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16, DType::kFloat32),
                       ::testing::Values(1, 4, 8), ::testing::Values(64, 128, 24, 20)));

// The window kernel's row max over a long row: one large logit in the last partial tile must
// rescale every earlier tile (the per-tile records), and one huge negative logit must give an
// exact 0, under every ISA level.
TEST(AttentionCpu, Avx512LateMaxAndUnderflow) {
  for (CpuIsa isa : kAllIsas) {
    SCOPED_TRACE(CpuIsaName(isa));
    ThreadPool pool(1);
    Problem p(/*heads=*/1, /*group=*/8, /*window=*/2, /*count=*/101, /*dim=*/32, DType::kFloat32,
              /*block_tokens=*/16, 9);
    // Key 100 (the last tile holds keys 96..100) = 4 x query 1 of head 0: a logit far above the
    // rest; key 50 = -4 x that query: exp underflows to 0 in its row.
    float* keys = reinterpret_cast<float*>(p.layer.arena.data());
    auto key_row = [&](int s) {
      return keys +
             (static_cast<uint64_t>(p.layer.block_table[s / 16]) * p.layer.view.block_bytes / 4) +
             (s % 16) * 32;
    };
    for (int d = 0; d < 32; ++d) {
      key_row(100)[d] = 4.0f * p.queries[32 + d];
      key_row(50)[d] = -4.0f * p.queries[32 + d];
      p.layer.stored[100 * 32 + d] = key_row(100)[d];
      p.layer.stored[50 * 32 + d] = key_row(50)[d];
    }
    p.job.scale = 1.0f;
    ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, isa).ok());
    p.ExpectMatchesReference(1e-5);
    EXPECT_EQ(p.probs[1 * 101 + 50], 0.0f);
    EXPECT_GT(p.probs[1 * 101 + 100], 0.99f);
  }
}

TEST(AttentionCpu, EmptyCountWritesNothing) {
  ThreadPool pool(2);
  AttentionJob job;
  job.keys.num_kv_heads = 2;
  job.keys.head_dim = 8;
  job.keys.block_tokens = 16;
  job.keys.block_bytes = 2 * 2 * 16 * 8 * 2;
  job.num_q_heads = 4;
  job.num_queries = 3;
  job.scale = 1.0f;
  EXPECT_TRUE(RunAttentionProbs({&job, 1}, pool).ok());
}

TEST(AttentionCpu, InvalidJobsAreRejectedAndNothingIsWritten) {
  ThreadPool pool(2);
  struct Case {
    const char* field;
    void (*mutate)(AttentionJob&);
  };
  const Case cases[] = {
      {"num_q_heads", [](AttentionJob& j) { j.num_q_heads = 3; }},
      {"num_q_heads", [](AttentionJob& j) { j.num_q_heads = 0; }},
      {"num_queries", [](AttentionJob& j) { j.num_queries = 0; }},
      {"scale", [](AttentionJob& j) { j.scale = 0.0f; }},
      {"scale", [](AttentionJob& j) { j.scale = std::numeric_limits<float>::infinity(); }},
      {"scale", [](AttentionJob& j) { j.scale = std::numeric_limits<float>::quiet_NaN(); }},
      {"keys.count", [](AttentionJob& j) { j.keys.count = -1; }},
      {"keys.num_kv_heads", [](AttentionJob& j) { j.keys.num_kv_heads = 0; }},
      {"keys.head_dim", [](AttentionJob& j) { j.keys.head_dim = 0; }},
      {"keys.block_tokens", [](AttentionJob& j) { j.keys.block_tokens = 0; }},
      {"keys.block_bytes",
       [](AttentionJob& j) { j.keys.block_bytes = j.keys.block_bytes / 2 - 1; }},
      {"keys.kv_index", [](AttentionJob& j) { j.keys.kv_index = 2; }},
      {"keys.dtype", [](AttentionJob& j) { j.keys.dtype = static_cast<DType>(9); }},
      {"keys.arena", [](AttentionJob& j) { j.keys.arena = nullptr; }},
      {"keys.block_table", [](AttentionJob& j) { j.keys.block_table = nullptr; }},
      {"key_positions", [](AttentionJob& j) { j.key_positions = nullptr; }},
      {"queries", [](AttentionJob& j) { j.queries = nullptr; }},
      {"query_positions", [](AttentionJob& j) { j.query_positions = nullptr; }},
      {"probs", [](AttentionJob& j) { j.probs = nullptr; }},
      {"overflows", [](AttentionJob& j) { j.num_q_heads = j.num_queries = 1 << 30; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    Problem good(2, 2, 4, 40, 16, DType::kFloat16, 16, 3);
    Problem bad(2, 2, 4, 40, 16, DType::kFloat16, 16, 4);
    c.mutate(bad.job);
    const std::vector<AttentionJob> jobs = {good.job, bad.job};
    const absl::Status status = RunAttentionProbs(jobs, pool);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("attention job 1: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    for (float v : good.probs) ASSERT_EQ(v, -7.0f);
  }
  // A block table entry that is negative.
  Problem bad(1, 1, 1, 40, 8, DType::kFloat32, 16, 4);
  bad.layer.block_table[2] = -1;
  const absl::Status status = RunAttentionProbs({&bad.job, 1}, pool);
  EXPECT_THAT(std::string(status.message()), HasSubstr("keys.block_table[2]"));
  for (float v : bad.probs) ASSERT_EQ(v, -7.0f);
}

// AttentionColumnSums: the probabilities summed over the window's rows, never written out. Checked
// against the double reference summed the same way, and against summing AttentionProbs' own
// output (the two kernels share their arithmetic), for odd sizes, GQA ratios and every dtype.
class AttentionSumsTest : public ::testing::TestWithParam<std::tuple<DType, int, int, CpuIsa>> {};

TEST_P(AttentionSumsTest, MatchesSummedReferenceAndProbs) {
  const auto [dtype, group, window, isa] = GetParam();
  ThreadPool pool(2);
  for (const int count : {1, 47, 100, 1000}) {
    Problem p(/*heads=*/3, group, window, count, /*dim=*/dtype == DType::kFloat32 ? 24 : 64, dtype,
              /*block_tokens=*/16, /*seed=*/static_cast<uint32_t>(count * 7 + group + window));
    const int q_heads = 3 * group;
    std::vector<float> sums(static_cast<size_t>(q_heads) * count, -7.0f);
    AttentionSumsJob job{.attention = p.job, .sums = sums.data()};
    job.attention.probs = nullptr;
    ASSERT_TRUE(RunAttentionColumnSums({&job, 1}, pool, isa).ok());
    ASSERT_TRUE(RunAttentionProbsWithIsa({&p.job, 1}, pool, isa).ok());
    const std::vector<double> expected = p.Reference();
    for (int q = 0; q < q_heads; ++q) {
      for (int s = 0; s < count; ++s) {
        double want = 0.0;
        float from_probs = 0.0f;
        for (int i = 0; i < window; ++i) {
          const size_t k = (static_cast<size_t>(q) * window + i) * count + s;
          want += expected[k];
          from_probs += p.probs[k];
        }
        const float got = sums[static_cast<size_t>(q) * count + s];
        ASSERT_NEAR(got, want, 1e-5 * window) << "count " << count << " q " << q << " s " << s;
        ASSERT_NEAR(got, from_probs, 1e-6 * window)
            << "count " << count << " q " << q << " s " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionSumsTest,
    ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16, DType::kFloat32),
                       ::testing::Values(1, 3, 4), ::testing::Values(1, 2, 5, 32),
                       ::testing::ValuesIn(kAllIsas)));

TEST(AttentionCpu, BackendColumnSumsMatchesTheDefaultPath) {
  // The CPU backend's fused kernel against Backend's default (AttentionProbs, then a host sum),
  // reached through a backend that only forwards AttentionProbs.
  class Forwarding : public Backend {
   public:
    explicit Forwarding(Backend& cpu) : cpu_(cpu) {}
    std::string_view name() const override { return "forwarding"; }
    bool healthy() const override { return true; }
    absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t b, const ArenaOptions& o) override {
      return cpu_.CreateArena(b, o);
    }
    absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> j, Stream s) override {
      return cpu_.KeyDiffScores(j, s);
    }
    absl::Status TopK(absl::Span<const TopKJob> j, Stream s) override { return cpu_.TopK(j, s); }
    absl::Status CopyRows(absl::Span<const RowCopyJob> j, Stream s) override {
      return cpu_.CopyRows(j, s);
    }
    absl::Status AttentionProbs(absl::Span<const AttentionJob> j, Stream s) override {
      return cpu_.AttentionProbs(j, s);
    }
    absl::Status AttentionLogits(absl::Span<const AttentionJob> j, Stream s) override {
      return cpu_.AttentionLogits(j, s);
    }
    absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> j, Stream s) override {
      return cpu_.CopyHostRows(j, s);
    }
    absl::Status CaoteScores(absl::Span<const CaoteJob> j, Stream s) override {
      return cpu_.CaoteScores(j, s);
    }
    absl::Status NearestKeys(absl::Span<const NearestKeyJob> j, Stream s) override {
      return cpu_.NearestKeys(j, s);
    }
    absl::Status MergeRows(absl::Span<const RowMergeJob> j, Stream s) override {
      return cpu_.MergeRows(j, s);
    }
    absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> j, Stream s) override {
      return cpu_.FindNonFinite(j, s);
    }
    absl::Status Synchronize(Stream s) override { return cpu_.Synchronize(s); }

   private:
    Backend& cpu_;
  };
  auto cpu = MakeCpuBackend(2);
  Forwarding forwarding(*cpu);
  Problem p(/*heads=*/2, /*group=*/4, /*window=*/32, /*count=*/777, /*dim=*/128, DType::kFloat16,
            /*block_tokens=*/16, /*seed=*/11);
  std::vector<float> fused(static_cast<size_t>(8) * 777), host(fused.size());
  AttentionSumsJob job{.attention = p.job, .sums = fused.data()};
  ASSERT_TRUE(cpu->AttentionColumnSums({&job, 1}, nullptr).ok());
  job.sums = host.data();
  ASSERT_TRUE(forwarding.AttentionColumnSums({&job, 1}, nullptr).ok());
  for (size_t k = 0; k < fused.size(); ++k) ASSERT_NEAR(fused[k], host[k], 1e-6) << k;
}

TEST(AttentionCpu, ColumnSumsRejectInvalidJobsAndWriteNothing) {
  ThreadPool pool(2);
  Problem good(2, 2, 4, 50, 16, DType::kFloat16, 16, 3);
  Problem bad(2, 2, 4, 50, 16, DType::kFloat16, 16, 4);
  std::vector<float> good_sums(4 * 50, -7.0f), bad_sums(4 * 50, -7.0f);
  AttentionSumsJob jobs[2] = {{.attention = good.job, .sums = good_sums.data()},
                              {.attention = bad.job, .sums = bad_sums.data()}};
  jobs[1].attention.scale = -1.0f;
  absl::Status status = RunAttentionColumnSums(jobs, pool);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("attention job 1: scale"));
  jobs[1].attention.scale = 0.25f;
  jobs[1].sums = nullptr;
  status = RunAttentionColumnSums(jobs, pool);
  EXPECT_THAT(status.message(), HasSubstr("attention job 1: sums is null"));
  for (float v : good_sums) ASSERT_EQ(v, -7.0f);
}

}  // namespace
}  // namespace kvs
