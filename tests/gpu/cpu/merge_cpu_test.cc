#include "gpu/cpu/merge_cpu.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/attention_cpu.h"
#include "gpu/cpu/avx2_util.h"
#include "gpu/cpu/cpu_isa.h"
#include "gpu/cpu/thread_pool.h"
#include "gtest/gtest.h"
#include "tests/gpu/merge_rows_csr.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Keys and values of one layer ([H][count][D] each) in real paged blocks ([2][H][B][D]) behind a
// shuffled block table.
struct PagedKv {
  std::vector<uint8_t> arena;
  std::vector<int32_t> block_table;
  PagedLayerView keys, values;

  PagedKv(const std::vector<std::vector<std::vector<float>>>& k,
          const std::vector<std::vector<std::vector<float>>>& v, DType dtype, int block_tokens) {
    const int heads = static_cast<int>(k.size());
    const int count = static_cast<int>(k[0].size());
    const int dim = static_cast<int>(k[0][0].size());
    const int bytes = DTypeBytes(dtype);
    const int used = (count + block_tokens - 1) / block_tokens;
    const uint64_t block_bytes = 2ull * heads * block_tokens * dim * bytes;
    arena.assign((used + 2) * block_bytes, 0xff);  // NaN in every dtype
    std::vector<int32_t> ids(used + 2);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
    block_table.assign(ids.begin(), ids.begin() + used);
    keys.arena = arena.data();
    keys.block_table = block_table.data();
    keys.count = count;
    keys.num_kv_heads = heads;
    keys.head_dim = dim;
    keys.block_tokens = block_tokens;
    keys.dtype = dtype;
    keys.block_bytes = block_bytes;
    values = keys;
    values.kv_index = 1;
    for (int h = 0; h < heads; ++h) {
      for (int s = 0; s < count; ++s) {
        for (int d = 0; d < dim; ++d) {
          StoreFromFloat(Row(keys, h, s), dtype, d, k[h][s][d]);
          StoreFromFloat(Row(values, h, s), dtype, d, v[h][s][d]);
        }
      }
    }
  }
  uint8_t* Row(const PagedLayerView& view, int head, int slot) {
    return const_cast<uint8_t*>(PagedRow(view, head, slot));
  }
  uint64_t Offset(const PagedLayerView& view, int head, int slot) {
    return PagedRow(view, head, slot) - arena.data();
  }
  std::vector<float> Read(const PagedLayerView& view, int head, int slot) {
    std::vector<float> out(view.head_dim);
    for (int d = 0; d < view.head_dim; ++d)
      out[d] = LoadAsFloat(Row(view, head, slot), view.dtype, d);
    return out;
  }
};

// `count` keys of `dim` standard normal values (one head's).
std::vector<std::vector<float>> RandomKeys(int count, int dim, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> keys(count);
  for (auto& row : keys) {
    for (int d = 0; d < dim; ++d) row.push_back(normal(rng));
  }
  return keys;
}

// d2o.md §11 TV4 keys k0..k7 and values v_i = (i, 1), one head.
PagedKv Tv4(DType dtype, int block_tokens) {
  const std::vector<std::vector<float>> k = {{1, 0}, {4, 1},   {0, 1},  {-1, 0},
                                             {2, 0}, {-1, -1}, {0, -1}, {1, -1}};
  std::vector<std::vector<float>> v;
  for (int i = 0; i < 8; ++i) v.push_back({static_cast<float>(i), 1.0f});
  return PagedKv({k}, {v}, dtype, block_tokens);
}

struct Nearest {
  std::vector<float> similarity;
  std::vector<int32_t> target;
};

Nearest RunNearest(const PagedLayerView& keys, int head, const std::vector<int32_t>& query_slots,
                   const std::vector<int32_t>& candidate_slots,
                   const std::vector<int32_t>& candidate_positions,
                   NearestKeysPath path = NearestKeysPath::kAuto) {
  ThreadPool pool(2);
  Nearest out{std::vector<float>(query_slots.size(), -9.0f),
              std::vector<int32_t>(query_slots.size(), -9)};
  NearestKeyJob job;
  job.keys = keys;
  job.head = head;
  job.query_slots = query_slots.data();
  job.num_queries = static_cast<int32_t>(query_slots.size());
  job.candidate_slots = candidate_slots.data();
  job.candidate_positions = candidate_positions.data();
  job.num_candidates = static_cast<int32_t>(candidate_slots.size());
  job.similarity = out.similarity.data();
  job.target = out.target.data();
  const absl::Status status = RunNearestKeys({&job, 1}, pool, path);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

constexpr NearestKeysPath kPaths[] = {NearestKeysPath::kAuto, NearestKeysPath::kStreaming,
                                      NearestKeysPath::kPacked};

// TV4: evicted {1, 4, 5} against kept {0, 2, 3, 6, 7} (slot = position here).
TEST(NearestKeysCpu, Tv4NearestWithPositionTie) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (NearestKeysPath path : kPaths) {
      SCOPED_TRACE(DTypeName(dtype));
      SCOPED_TRACE(static_cast<int>(path));
      PagedKv kv = Tv4(dtype, 3);
      const Nearest n = RunNearest(kv.keys, 0, {1, 4, 5}, {0, 2, 3, 6, 7}, {0, 2, 3, 6, 7}, path);
      EXPECT_THAT(n.target, ElementsAre(0, 0, 2));  // 5 -> candidate 2 = position 3 (tie with 6)
      EXPECT_NEAR(n.similarity[0], 0.970143, 1e-6);
      EXPECT_NEAR(n.similarity[1], 1.0, 1e-6);
      EXPECT_NEAR(n.similarity[2], 0.707107, 1e-6);
    }
  }
}

// Ties go to the lowest POSITION, not the lowest slot or candidate index.
TEST(NearestKeysCpu, TieGoesToLowestPositionNotIndex) {
  PagedKv kv = Tv4(DType::kFloat32, 4);
  for (NearestKeysPath path : kPaths) {
    SCOPED_TRACE(static_cast<int>(path));
    // Candidates listed as slots {6, 3} with positions {2, 9}: slot 6 has the lower position.
    const Nearest n = RunNearest(kv.keys, 0, {5}, {6, 3}, {2, 9}, path);
    EXPECT_THAT(n.target, ElementsAre(0));
    const Nearest m = RunNearest(kv.keys, 0, {5}, {6, 3}, {9, 2}, path);
    EXPECT_THAT(m.target, ElementsAre(1));
  }
}

// Zero keys: norms floored at 1e-6, so the cosine is 0 rather than NaN.
TEST(NearestKeysCpu, ZeroKeyHasZeroSimilarity) {
  PagedKv kv({{{0, 0}, {1, 0}, {-1, 0}}}, {{{0, 0}, {0, 0}, {0, 0}}}, DType::kFloat32, 2);
  for (NearestKeysPath path : kPaths) {
    SCOPED_TRACE(static_cast<int>(path));
    const Nearest n = RunNearest(kv.keys, 0, {0, 2}, {1, 0}, {1, 0}, path);
    EXPECT_EQ(n.similarity[0], 0.0f);
    EXPECT_EQ(n.target[0], 1);  // both candidates give 0: position 0 wins
    EXPECT_EQ(n.similarity[1], 0.0f);
    EXPECT_EQ(n.target[1], 1);  // cos(-1,0 ; 1,0) = -1 < cos with the zero key = 0
  }
}

// Random keys, two heads, against a double reference (cosine, floored norms, tie rule).
TEST(NearestKeysCpu, RandomMatchesDoubleReference) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int heads = 2, count = 50, dim = 16;
  std::vector<std::vector<std::vector<float>>> k(heads, std::vector<std::vector<float>>(count));
  for (auto& h : k) {
    for (auto& row : h) {
      for (int d = 0; d < dim; ++d) row.push_back(normal(rng));
    }
  }
  PagedKv kv(k, k, DType::kFloat16, 7);
  std::vector<int32_t> slots(count);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  const std::vector<int32_t> queries(slots.begin(), slots.begin() + 20);
  const std::vector<int32_t> candidates(slots.begin() + 20, slots.end());
  std::vector<int32_t> positions(candidates.size());
  std::iota(positions.begin(), positions.end(), 100);
  std::shuffle(positions.begin(), positions.end(), rng);
  for (int head = 0; head < heads; ++head) {
    const Nearest n = RunNearest(kv.keys, head, queries, candidates, positions);
    for (size_t e = 0; e < queries.size(); ++e) {
      const std::vector<float> q = kv.Read(kv.keys, head, queries[e]);
      double best = -2;
      size_t best_c = 0;
      for (size_t c = 0; c < candidates.size(); ++c) {
        const std::vector<float> x = kv.Read(kv.keys, head, candidates[c]);
        double dot = 0, nq = 0, nx = 0;
        for (int d = 0; d < dim; ++d) {
          dot += double{q[d]} * x[d];
          nq += double{q[d]} * q[d];
          nx += double{x[d]} * x[d];
        }
        const double cos = dot / (std::max(std::sqrt(nq), 1e-6) * std::max(std::sqrt(nx), 1e-6));
        if (cos > best) {
          best = cos;
          best_c = c;
        }
      }
      EXPECT_NEAR(n.similarity[e], best, 1e-5);
      EXPECT_EQ(n.target[e], static_cast<int32_t>(best_c));
    }
  }
}

// Larger shapes (several jobs in one call, queries not a multiple of the micro-kernel's rows,
// candidates not a multiple of its panel, odd head_dim) against a double reference: the result
// must be a maximum within 1e-5, and duplicated candidate keys (exact ties) must go to the lowest
// position.
TEST(NearestKeysCpu, LargerRandomWithDuplicatesMatchesDoubleReference) {
  for (int dim : {128, 20}) {
    SCOPED_TRACE(dim);
    std::mt19937 rng(7 + dim);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int heads = 2, count = 300;
    std::vector<std::vector<std::vector<float>>> k(heads, std::vector<std::vector<float>>(count));
    for (auto& h : k) {
      for (auto& row : h) {
        for (int d = 0; d < dim; ++d) row.push_back(normal(rng));
      }
      // Slots 250.. repeat slots 200.. (same rows, so bit-equal cosines).
      for (int s = 250; s < count; ++s) h[s] = h[s - 50];
    }
    PagedKv kv(k, k, DType::kFloat16, 16);
    std::vector<int32_t> queries(200), candidates(100), positions(100);
    std::iota(queries.begin(), queries.end(), 0);
    queries.resize(197);
    std::iota(candidates.begin(), candidates.end(), 200);
    std::iota(positions.begin(), positions.end(), 1000);
    std::shuffle(positions.begin(), positions.end(), rng);
    // Drop a few candidates so num_candidates is not a multiple of 16.
    candidates.resize(93);
    positions.resize(93);
    std::vector<Nearest> out(heads);
    std::vector<NearestKeyJob> jobs(heads);
    for (int head = 0; head < heads; ++head) {
      out[head] = {std::vector<float>(queries.size(), -9.0f),
                   std::vector<int32_t>(queries.size(), -9)};
      NearestKeyJob& job = jobs[head];
      job.keys = kv.keys;
      job.head = head;
      job.query_slots = queries.data();
      job.num_queries = static_cast<int32_t>(queries.size());
      job.candidate_slots = candidates.data();
      job.candidate_positions = positions.data();
      job.num_candidates = static_cast<int32_t>(candidates.size());
      job.similarity = out[head].similarity.data();
      job.target = out[head].target.data();
    }
    ThreadPool pool(2);
    ASSERT_TRUE(RunNearestKeys(jobs, pool).ok());
    for (int head = 0; head < heads; ++head) {
      std::vector<std::vector<float>> rows;
      for (int32_t c : candidates) rows.push_back(kv.Read(kv.keys, head, c));
      for (size_t e = 0; e < queries.size(); ++e) {
        const std::vector<float> q = kv.Read(kv.keys, head, queries[e]);
        std::vector<double> cos(candidates.size());
        double best = -2;
        for (size_t c = 0; c < candidates.size(); ++c) {
          double dot = 0, nq = 0, nx = 0;
          for (int d = 0; d < dim; ++d) {
            dot += double{q[d]} * rows[c][d];
            nq += double{q[d]} * q[d];
            nx += double{rows[c][d]} * rows[c][d];
          }
          cos[c] = dot / (std::max(std::sqrt(nq), 1e-6) * std::max(std::sqrt(nx), 1e-6));
          best = std::max(best, cos[c]);
        }
        const int32_t t = out[head].target[e];
        ASSERT_GE(t, 0);
        ASSERT_LT(t, static_cast<int32_t>(candidates.size()));
        EXPECT_NEAR(out[head].similarity[e], best, 1e-5);
        EXPECT_NEAR(cos[t], best, 1e-5);
        // An identical candidate at a lower position would have had a bit-equal cosine.
        for (size_t c = 0; c < candidates.size(); ++c) {
          if (rows[c] == rows[t]) {
            EXPECT_GE(positions[c], positions[t]) << e << " " << c;
          }
        }
      }
    }
  }
}

// The streaming path (few queries: decode) and the packed path (prefill) on the same random jobs:
// every dtype, head_dims with and without a tail past the 8-wide vectors, candidate counts that
// are not multiples of 4 or 16, 1..5 queries per job, several jobs per call. Targets must be
// equal exactly; similarities within kPathTolerance (the paths round differently: unit rows
// dotted vs dot / (norm * norm)). Candidate rows repeat other rows at other positions (exact
// ties: both paths must pick the lowest position) and copies of the queries (cosine ~1, tied
// among the copies), one candidate is a zero key (cosine 0) and one holds a NaN (never chosen).
TEST(NearestKeysCpu, StreamingAndPackedPathsAgree) {
  constexpr float kPathTolerance = 2e-6f;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int dim : {128, 20, 3}) {
      SCOPED_TRACE(DTypeName(dtype));
      SCOPED_TRACE(dim);
      std::mt19937 rng(11 + dim);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const int heads = 2, count = 330;
      std::vector<std::vector<std::vector<float>>> k(heads, std::vector<std::vector<float>>(count));
      for (auto& h : k) {
        for (auto& row : h) {
          for (int d = 0; d < dim; ++d) row.push_back(normal(rng));
        }
        // Queries are slots [0, 10). Slots 250.. repeat slots 200.. (ties among candidates),
        // 320..324 copy queries 0..4 twice over (ties at cosine ~1), 325 is zero, 326 NaN.
        for (int s = 250; s < 300; ++s) h[s] = h[s - 50];
        for (int s = 320; s < 325; ++s) h[s] = h[s - 320];
        for (int s = 315; s < 320; ++s) h[s] = h[s - 315];
        h[325].assign(dim, 0.0f);
        h[326][dim / 2] = std::numeric_limits<float>::quiet_NaN();
      }
      PagedKv kv(k, k, dtype, 16);
      std::vector<int32_t> candidates(count - 10 - 100);  // slots 110..329 minus a few
      std::iota(candidates.begin(), candidates.end(), 110);
      candidates.erase(candidates.begin() + 7);  // 219 candidates: not a multiple of 4 or 16
      std::vector<int32_t> positions(candidates.size());
      std::iota(positions.begin(), positions.end(), 1000);
      std::shuffle(positions.begin(), positions.end(), rng);
      for (int queries = 1; queries <= 5; queries += 2) {
        SCOPED_TRACE(queries);
        std::vector<int32_t> query_slots(queries);
        std::iota(query_slots.begin(), query_slots.end(), 0);
        std::vector<Nearest> out[2];
        for (int p = 0; p < 2; ++p) {
          const NearestKeysPath path =
              p == 0 ? NearestKeysPath::kStreaming : NearestKeysPath::kPacked;
          std::vector<NearestKeyJob> jobs(heads);
          out[p].assign(heads, Nearest{std::vector<float>(queries, -9.0f),
                                       std::vector<int32_t>(queries, -9)});
          for (int head = 0; head < heads; ++head) {
            NearestKeyJob& job = jobs[head];
            job.keys = kv.keys;
            job.head = head;
            job.query_slots = query_slots.data();
            job.num_queries = queries;
            job.candidate_slots = candidates.data();
            job.candidate_positions = positions.data();
            job.num_candidates = static_cast<int32_t>(candidates.size());
            job.similarity = out[p][head].similarity.data();
            job.target = out[p][head].target.data();
          }
          ThreadPool pool(2);
          ASSERT_TRUE(RunNearestKeys(jobs, pool, path).ok());
        }
        int ties = 0;
        for (int head = 0; head < heads; ++head) {
          for (int e = 0; e < queries; ++e) {
            const int32_t t = out[0][head].target[e];
            EXPECT_EQ(t, out[1][head].target[e]) << head << " " << e;
            EXPECT_NEAR(out[0][head].similarity[e], out[1][head].similarity[e], kPathTolerance);
            ASSERT_GE(t, 0);
            ASSERT_LT(t, static_cast<int32_t>(candidates.size()));
            // Every row equal to the target's sits at a higher position.
            const std::vector<float> row = kv.Read(kv.keys, head, candidates[t]);
            for (size_t c = 0; c < candidates.size(); ++c) {
              if (static_cast<int32_t>(c) != t && kv.Read(kv.keys, head, candidates[c]) == row) {
                EXPECT_GT(positions[c], positions[t]) << e << " " << c;
                ++ties;
              }
            }
          }
        }
        EXPECT_GT(ties, 0);  // the copies of the queries were the targets
      }
    }
  }
}

// The packed path's dot products on AVX-512 (a panel's 16 candidates in one register, 12 queries
// per pass) and on AVX2 (two registers, 6 queries) are the same FMA chains: bit-equal targets and
// similarities, over query counts that leave a partial pass and candidate counts a partial panel,
// with exact ties (repeated rows), a zero key and a NaN key among the candidates.
TEST(NearestKeysCpu, PackedPathIsBitEqualOnAvx2AndAvx512) {
  if (HardwareCpuIsa() < CpuIsa::kAvx512 || DetectedCpuIsa() < CpuIsa::kAvx512) {
    GTEST_SKIP() << "AVX-512 is not available here (CPU or KVS_CPU_ISA)";
  }
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int dim : {128, 20}) {
      SCOPED_TRACE(DTypeName(dtype));
      SCOPED_TRACE(dim);
      std::mt19937 rng(31 + dim);
      const int count = 700;
      std::vector<std::vector<std::vector<float>>> k = {RandomKeys(count, dim, rng)};
      for (int s = 600; s < 650; ++s) k[0][s] = k[0][s - 50];   // tied candidates
      for (int s = 650; s < 660; ++s) k[0][s] = k[0][s - 650];  // copies of queries
      k[0][660].assign(dim, 0.0f);
      k[0][661][dim / 2] = std::numeric_limits<float>::quiet_NaN();
      PagedKv kv(k, k, dtype, 16);
      std::vector<int32_t> queries(203), candidates(count - 300 - 3);  // 203 = 4 x 48 + 11
      std::iota(queries.begin(), queries.end(), 0);
      std::iota(candidates.begin(), candidates.end(), 300);  // 397: 24 panels + 13 lanes
      std::vector<int32_t> positions(candidates.size());
      std::iota(positions.begin(), positions.end(), 0);
      std::shuffle(positions.begin(), positions.end(), rng);
      Nearest out[2];
      const CpuIsa isas[2] = {CpuIsa::kAvx2, CpuIsa::kAvx512};
      for (int i = 0; i < 2; ++i) {
        out[i] = Nearest{std::vector<float>(queries.size(), -9.0f),
                         std::vector<int32_t>(queries.size(), -9)};
        NearestKeyJob job;
        job.keys = kv.keys;
        job.query_slots = queries.data();
        job.num_queries = static_cast<int32_t>(queries.size());
        job.candidate_slots = candidates.data();
        job.candidate_positions = positions.data();
        job.num_candidates = static_cast<int32_t>(candidates.size());
        job.similarity = out[i].similarity.data();
        job.target = out[i].target.data();
        ThreadPool pool(2);
        ASSERT_TRUE(RunNearestKeys({&job, 1}, pool, NearestKeysPath::kPacked, isas[i]).ok());
      }
      EXPECT_EQ(out[0].target, out[1].target);
      for (size_t e = 0; e < queries.size(); ++e) {
        ASSERT_EQ(std::bit_cast<uint32_t>(out[0].similarity[e]),
                  std::bit_cast<uint32_t>(out[1].similarity[e]))
            << e;
      }
      EXPECT_GE(*std::min_element(out[1].target.begin(), out[1].target.end()), 0);
    }
  }
}

// The packed path's numbers, pinned exactly: every query and candidate normalised in fp32 as a
// sequential sum of rounded squares, sqrt, floor 1e-6 and division, then one fp32 FMA chain over d
// per (query, candidate). The prefill results must not move when the kernel changes.
TEST(NearestKeysCpu, PackedPathMatchesExactReference) {
  // The packed path is AVX2 code; without it (or with KVS_CPU_ISA=scalar) RunNearestKeys runs
  // the scalar path, whose sums round differently from this reference.
  if (!CpuSupportsAvx2()) GTEST_SKIP() << "the packed path needs AVX2/FMA/F16C";
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int dim : {128, 20}) {
      SCOPED_TRACE(DTypeName(dtype));
      SCOPED_TRACE(dim);
      std::mt19937 rng(23 + dim);
      const int count = 200;
      std::vector<std::vector<std::vector<float>>> k = {RandomKeys(count, dim, rng)};
      for (int s = 190; s < count; ++s) k[0][s] = k[0][s - 10];  // exact ties
      k[0][150].assign(dim, 0.0f);
      PagedKv kv(k, k, dtype, 16);
      std::vector<int32_t> queries(70), candidates(count - 70), positions(count - 70);
      std::iota(queries.begin(), queries.end(), 0);
      std::iota(candidates.begin(), candidates.end(), 70);
      std::iota(positions.begin(), positions.end(), 0);
      std::shuffle(positions.begin(), positions.end(), rng);
      const Nearest n =
          RunNearest(kv.keys, 0, queries, candidates, positions, NearestKeysPath::kPacked);
      auto unit = [&](int32_t slot) {
        std::vector<float> x = kv.Read(kv.keys, 0, slot);
        float squared = 0.0f;
        for (float v : x) {
          volatile float product = v * v;  // rounded, never fused with the add
          squared += product;
        }
        const float norm = std::max(std::sqrt(squared), 1e-6f);
        for (float& v : x) v /= norm;
        return x;
      };
      std::vector<std::vector<float>> rows;
      for (int32_t c : candidates) rows.push_back(unit(c));
      for (size_t e = 0; e < queries.size(); ++e) {
        const std::vector<float> q = unit(queries[e]);
        float best = 0.0f;
        int32_t best_c = -1;
        for (size_t c = 0; c < candidates.size(); ++c) {
          float dot = 0.0f;
          for (int d = 0; d < dim; ++d) dot = std::fma(q[d], rows[c][d], dot);
          if (best_c < 0 || dot > best || (dot == best && positions[c] < positions[best_c])) {
            best = dot;
            best_c = static_cast<int32_t>(c);
          }
        }
        EXPECT_EQ(n.similarity[e], best) << e;
        EXPECT_EQ(n.target[e], best_c) << e;
      }
    }
  }
}

// A NaN query: the paths agree (first candidate, NaN similarity) rather than skip the job.
TEST(NearestKeysCpu, NanQueryPathsAgree) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  PagedKv kv({{{nan, 0}, {1, 0}, {-1, 0}}}, {{{0, 0}, {0, 0}, {0, 0}}}, DType::kFloat32, 2);
  for (NearestKeysPath path : kPaths) {
    SCOPED_TRACE(static_cast<int>(path));
    const Nearest n = RunNearest(kv.keys, 0, {0}, {2, 1}, {5, 3}, path);
    EXPECT_TRUE(std::isnan(n.similarity[0]));
    EXPECT_EQ(n.target[0], 0);
  }
}

TEST(NearestKeysCpu, InvalidJobsAreRejectedAndNothingIsWritten) {
  PagedKv kv = Tv4(DType::kFloat32, 3);
  const std::vector<int32_t> q = {1, 4}, c = {0, 2}, p = {0, 2}, bad_slot = {1, 8};
  struct Case {
    const char* field;
    std::function<void(NearestKeyJob&)> mutate;
  };
  const Case cases[] = {
      {"head", [](NearestKeyJob& j) { j.head = 1; }},
      {"num_queries", [](NearestKeyJob& j) { j.num_queries = -1; }},
      {"num_candidates", [](NearestKeyJob& j) { j.num_candidates = 0; }},
      {"query_slots[1]", [&](NearestKeyJob& j) { j.query_slots = bad_slot.data(); }},
      {"candidate_slots[1]", [&](NearestKeyJob& j) { j.candidate_slots = bad_slot.data(); }},
      {"candidate_positions", [](NearestKeyJob& j) { j.candidate_positions = nullptr; }},
      {"similarity", [](NearestKeyJob& j) { j.similarity = nullptr; }},
      {"target", [](NearestKeyJob& j) { j.target = nullptr; }},
      {"keys.head_dim", [](NearestKeyJob& j) { j.keys.head_dim = 0; }},
  };
  ThreadPool pool(2);
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.field);
    std::vector<float> sim(2, -9.0f);
    std::vector<int32_t> target(2, -9);
    NearestKeyJob good;
    good.keys = kv.keys;
    good.query_slots = q.data();
    good.num_queries = 2;
    good.candidate_slots = c.data();
    good.candidate_positions = p.data();
    good.num_candidates = 2;
    good.similarity = sim.data();
    good.target = target.data();
    NearestKeyJob bad = good;
    cs.mutate(bad);
    const std::vector<NearestKeyJob> jobs = {good, bad};
    const absl::Status status = RunNearestKeys(jobs, pool);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("nearest key job 1: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(cs.field));
    EXPECT_THAT(sim, ElementsAre(-9.0f, -9.0f));
    EXPECT_THAT(target, ElementsAre(-9, -9));
  }
}

absl::Status Merge(std::vector<RowMergeJob> jobs, int threads = 2) {
  ThreadPool pool(threads);
  return RunMergeRows(jobs, pool);
}

// TV4 end to end: nearest keys, then the paper weights (e for the kept key, e^u for each merged
// key, normalised) merged into slot 0 of keys and values; dst is one of the sources.
TEST(MergeRowsCpu, Tv4PaperWeights) {
  PagedKv kv = Tv4(DType::kFloat32, 3);
  const Nearest n = RunNearest(kv.keys, 0, {1, 4}, {0, 2, 3, 6, 7}, {0, 2, 3, 6, 7});
  ASSERT_THAT(n.target, ElementsAre(0, 0));
  const double e = std::exp(1.0), e1 = std::exp(double{n.similarity[0]}),
               e4 = std::exp(double{n.similarity[1]});
  const double z = e + e1 + e4;
  const std::vector<float> weights = {static_cast<float>(e / z), static_cast<float>(e1 / z),
                                      static_cast<float>(e4 / z)};
  const std::vector<uint64_t> key_src = {kv.Offset(kv.keys, 0, 0), kv.Offset(kv.keys, 0, 1),
                                         kv.Offset(kv.keys, 0, 4)};
  const std::vector<uint64_t> value_src = {kv.Offset(kv.values, 0, 0), kv.Offset(kv.values, 0, 1),
                                           kv.Offset(kv.values, 0, 4)};
  MergeRowsCsr csr;
  csr.Add(key_src[0], key_src, weights);
  csr.Add(value_src[0], value_src, weights);
  ASSERT_TRUE(Merge({csr.Job(kv.arena.data(), DType::kFloat32, 2)}).ok());
  const std::vector<float> k0 = kv.Read(kv.keys, 0, 0), v0 = kv.Read(kv.values, 0, 0);
  EXPECT_NEAR(k0[0], 2.316829, 1e-6);
  EXPECT_NEAR(k0[1], 0.326732, 1e-6);
  EXPECT_NEAR(v0[0], 1.673268, 1e-6);
  EXPECT_NEAR(v0[1], 1.0, 1e-6);
  // Sources other than dst are untouched.
  EXPECT_THAT(kv.Read(kv.keys, 0, 1), ElementsAre(4.0f, 1.0f));
  EXPECT_THAT(kv.Read(kv.values, 0, 4), ElementsAre(4.0f, 1.0f));
}

// The fp32 sum is rounded once: 1 + 2^-11 + 2^-11 = 1 + 2^-10 is an fp16 value, while rounding
// after each addition would give 1 (1 + 2^-11 is a tie that rounds to even).
TEST(MergeRowsCpu, Fp16RoundsOnce) {
  std::vector<uint8_t> arena(64, 0);
  const float half_ulp = std::ldexp(1.0f, -11);
  StoreFromFloat(arena.data() + 0, DType::kFloat16, 0, 1.0f);
  StoreFromFloat(arena.data() + 8, DType::kFloat16, 0, half_ulp);
  StoreFromFloat(arena.data() + 16, DType::kFloat16, 0, half_ulp);
  const std::vector<uint64_t> src = {0, 8, 16};
  const std::vector<float> weights = {1, 1, 1};
  MergeRowsCsr csr;
  csr.Add(0, src, weights);
  ASSERT_TRUE(Merge({csr.Job(arena.data(), DType::kFloat16, 1)}).ok());
  EXPECT_EQ(LoadAsFloat(arena.data(), DType::kFloat16, 0), 1.0f + std::ldexp(1.0f, -10));
}

// Many rows in one call (parallel path), bf16, split over two jobs, against a float reference
// rounded once.
TEST(MergeRowsCpu, ManyRowsBFloat16) {
  const int rows = 600, dim = 64, sources = 3;
  std::vector<uint8_t> arena(static_cast<size_t>(rows) * (sources + 1) * dim * 2);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < arena.size() / 2; ++i) {
    StoreFromFloat(arena.data(), DType::kBFloat16, i, normal(rng));
  }
  const std::vector<uint8_t> before = arena;
  MergeRowsCsr first, second;
  std::vector<uint64_t> dst(rows);
  std::vector<std::vector<uint64_t>> offsets(rows);
  std::vector<std::vector<float>> weights(rows);
  for (int r = 0; r < rows; ++r) {
    const uint64_t base = static_cast<uint64_t>(r) * (sources + 1) * dim * 2;
    for (int k = 0; k < sources; ++k) {
      offsets[r].push_back(base + (k + 1) * dim * 2);
      weights[r].push_back(normal(rng));
    }
    dst[r] = base;
    (r < 250 ? first : second).Add(dst[r], offsets[r], weights[r]);
  }
  ASSERT_TRUE(Merge({first.Job(arena.data(), DType::kBFloat16, dim),
                     second.Job(arena.data(), DType::kBFloat16, dim)},
                    3)
                  .ok());
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < dim; ++d) {
      float sum = 0;
      for (int k = 0; k < sources; ++k) {
        sum += weights[r][k] * LoadAsFloat(before.data() + offsets[r][k], DType::kBFloat16, d);
      }
      const float expected = BFloat16ToFloat(FloatToBFloat16(sum));
      const float actual = LoadAsFloat(arena.data() + dst[r], DType::kBFloat16, d);
      ASSERT_NEAR(actual, expected, std::abs(expected) * 1e-2 + 1e-6) << r << " " << d;
    }
  }
}

TEST(MergeRowsCpu, InvalidJobsAreRejectedAndNothingIsWritten) {
  std::vector<uint8_t> arena(64, 0);
  const std::vector<uint64_t> huge = {8, ~uint64_t{0} - 1}, huge_dst = {32, ~uint64_t{0}};
  const std::vector<int64_t> not_from_zero = {1, 2, 3}, empty_row = {0, 2, 2};
  MergeRowsCsr csr;
  csr.Add(0, {8, 16}, {1, 1});
  csr.Add(48, {24}, {1});
  struct Case {
    const char* field;
    std::function<void(RowMergeJob&)> mutate;
  };
  const Case cases[] = {
      {"row_elements", [](RowMergeJob& j) { j.row_elements = 0; }},
      {"rows", [](RowMergeJob& j) { j.rows = -2; }},
      {"rows", [](RowMergeJob& j) { j.rows = std::numeric_limits<int64_t>::max(); }},
      {"arena", [](RowMergeJob& j) { j.arena = nullptr; }},
      {"dst_offsets", [](RowMergeJob& j) { j.dst_offsets = nullptr; }},
      {"source_starts", [](RowMergeJob& j) { j.source_starts = nullptr; }},
      {"src_offsets", [](RowMergeJob& j) { j.src_offsets = nullptr; }},
      {"weights", [](RowMergeJob& j) { j.weights = nullptr; }},
      {"dtype", [](RowMergeJob& j) { j.dtype = static_cast<DType>(0); }},
      {"source_starts[0]", [&](RowMergeJob& j) { j.source_starts = not_from_zero.data(); }},
      {"source_starts[2]", [&](RowMergeJob& j) { j.source_starts = empty_row.data(); }},
      {"src_offsets[1]", [&](RowMergeJob& j) { j.src_offsets = huge.data(); }},
      {"dst_offsets[1]", [&](RowMergeJob& j) { j.dst_offsets = huge_dst.data(); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    std::fill(arena.begin(), arena.end(), 0x3c);
    const RowMergeJob good = csr.Job(arena.data(), DType::kFloat16, 2);
    RowMergeJob bad = good;
    c.mutate(bad);
    const absl::Status status = Merge({good, bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("row merge job 1: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    for (uint8_t b : arena) ASSERT_EQ(b, 0x3c);
  }
  // A job of no rows reads nothing: its arrays may be null.
  RowMergeJob none;
  none.dtype = DType::kFloat16;
  none.row_elements = 2;
  EXPECT_TRUE(Merge({none}).ok());
}

// Through the Backend entry points.
TEST(MergeRowsCpu, BackendNearestAndMerge) {
  auto backend = MakeCpuBackend(2);
  PagedKv kv = Tv4(DType::kFloat16, 3);
  const std::vector<int32_t> q = {5}, c = {0, 2, 3, 6, 7};
  float sim = 0;
  int32_t target = -1;
  NearestKeyJob nearest;
  nearest.keys = kv.keys;
  nearest.query_slots = q.data();
  nearest.num_queries = 1;
  nearest.candidate_slots = c.data();
  nearest.candidate_positions = c.data();
  nearest.num_candidates = 5;
  nearest.similarity = &sim;
  nearest.target = &target;
  ASSERT_TRUE(backend->NearestKeys({&nearest, 1}, nullptr).ok());
  EXPECT_EQ(target, 2);
  const std::vector<uint64_t> src = {kv.Offset(kv.values, 0, 3), kv.Offset(kv.values, 0, 5)};
  const std::vector<float> weights = {0.5f, 0.5f};
  MergeRowsCsr csr;
  csr.Add(src[0], src, weights);
  const RowMergeJob merge = csr.Job(kv.arena.data(), DType::kFloat16, 2);
  ASSERT_TRUE(backend->MergeRows({&merge, 1}, nullptr).ok());
  EXPECT_THAT(kv.Read(kv.values, 0, 3), ElementsAre(4.0f, 1.0f));
}

}  // namespace
}  // namespace kvs
