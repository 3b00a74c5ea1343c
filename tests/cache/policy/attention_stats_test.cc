// Tests of the position-order helpers in cache/policy/attention_stats.cc against plain sorts,
// on both of their paths: positions spanning a few times the slot count (bitmap / counting
// placement) and sparse positions (the comparison-based fallback).
#include "cache/policy/attention_stats.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

namespace kvs {
namespace {

// `n` distinct positions in random slot order, drawn from a span of `span_factor` * n values
// starting at `low` (negative allowed).
std::vector<int32_t> RandomPositions(std::mt19937& rng, int32_t n, int64_t span_factor,
                                     int32_t low) {
  std::vector<int32_t> pool(static_cast<size_t>(n * span_factor));
  std::iota(pool.begin(), pool.end(), low);
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(n);
  return pool;
}

std::vector<uint8_t> ReferenceProtected(const std::vector<int32_t>& positions, int32_t sinks,
                                        int32_t recent) {
  const int32_t n = static_cast<int32_t>(positions.size());
  std::vector<int32_t> sorted = positions;
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint8_t> forced(n, 0);
  for (int32_t s = 0; s < n; ++s) {
    const int32_t rank = static_cast<int32_t>(
        std::lower_bound(sorted.begin(), sorted.end(), positions[s]) - sorted.begin());
    forced[s] = rank < sinks || rank >= n - recent ? 1 : 0;
  }
  return forced;
}

TEST(MarkSinksAndRecentTest, MatchesASortOnDenseAndSparsePositions) {
  std::mt19937 rng(5);
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (const int64_t span_factor : {1, 3, 64, 65, 1000}) {  // 64 is the last bitmap span
    for (const int32_t n : {1, 2, 63, 64, 65, 700}) {
      for (int trial = 0; trial < 4; ++trial) {
        const std::vector<int32_t> positions =
            RandomPositions(rng, n, span_factor, trial % 2 == 0 ? 0 : -5000);
        const int32_t sinks = static_cast<int32_t>(rng() % (n + 1));
        const int32_t recent = static_cast<int32_t>(rng() % (n + 1 - sinks));
        std::vector<uint8_t> forced(n, 7);
        MarkSinksAndRecent(positions.data(), n, sinks, recent, scratch, bitmap, forced.data());
        EXPECT_EQ(forced, ReferenceProtected(positions, sinks, recent))
            << "n " << n << " span x" << span_factor << " sinks " << sinks << " recent " << recent;
      }
    }
  }
}

TEST(MarkSinksAndRecentTest, NewestAloneMatchesASort) {
  // recent = 1 without sinks (a decode step's SnapKV window) has a path of its own.
  std::mt19937 rng(9);
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (const int64_t span_factor : {1, 1000}) {
    for (const int32_t n : {2, 3, 64, 700}) {
      const std::vector<int32_t> positions = RandomPositions(rng, n, span_factor, -7);
      std::vector<uint8_t> forced(n, 7);
      MarkSinksAndRecent(positions.data(), n, 0, 1, scratch, bitmap, forced.data());
      EXPECT_EQ(forced, ReferenceProtected(positions, 0, 1)) << "n " << n;
    }
  }
}

TEST(MarkSinksAndRecentTest, ExtremePositionsDoNotOverflowTheSpan) {
  const std::vector<int32_t> positions = {INT32_MAX, INT32_MIN, 0, 17};
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  std::vector<uint8_t> forced(4, 7);
  MarkSinksAndRecent(positions.data(), 4, 1, 1, scratch, bitmap, forced.data());
  EXPECT_THAT(forced, ::testing::ElementsAre(1, 1, 0, 0));
}

TEST(HoldsConsecutivePositionsTest, EveryLengthAndEveryBrokenSlot) {
  for (const int32_t n : {0, 1, 2, 15, 16, 17, 31, 32, 33, 100}) {
    for (const int32_t first : {0, -40, 1000, INT32_MAX - 100}) {
      std::vector<int32_t> positions(static_cast<size_t>(n));
      std::iota(positions.begin(), positions.end(), first);
      EXPECT_TRUE(HoldsConsecutivePositions(positions.data(), n)) << "n " << n;
      for (int32_t s = 0; s < n && n > 1; ++s) {  // one slot off, in a chunk or the tail
        std::vector<int32_t> broken = positions;
        broken[s] += s == 0 ? -1 : 1;
        EXPECT_FALSE(HoldsConsecutivePositions(broken.data(), n)) << "n " << n << " slot " << s;
      }
      if (n >= 2) {  // the same positions, two slots swapped
        std::vector<int32_t> swapped = positions;
        std::swap(swapped[n / 2 - 1], swapped[n / 2]);
        EXPECT_FALSE(HoldsConsecutivePositions(swapped.data(), n)) << "n " << n;
      }
    }
  }
  const std::vector<int32_t> wrapped = {INT32_MAX, INT32_MIN};  // +1 in unsigned arithmetic only
  EXPECT_FALSE(HoldsConsecutivePositions(wrapped.data(), 2));
}

TEST(SlotsByPositionTest, MatchesASortWithAndWithoutEligibility) {
  std::mt19937 rng(9);
  std::vector<int32_t> scratch, order;
  for (const int64_t span_factor : {1, 4, 32, 33, 500}) {  // 32 is the last counting span
    for (const int32_t n : {1, 5, 300}) {
      const std::vector<int32_t> positions = RandomPositions(rng, n, span_factor, -100);
      std::vector<uint8_t> eligible(n);
      for (uint8_t& flag : eligible) flag = rng() % 3 != 0 ? 1 : 0;
      for (const bool filtered : {false, true}) {
        std::vector<int32_t> expected;
        for (int32_t s = 0; s < n; ++s) {
          if (!filtered || eligible[s] != 0) expected.push_back(s);
        }
        std::sort(expected.begin(), expected.end(),
                  [&](int32_t a, int32_t b) { return positions[a] < positions[b]; });
        SlotsByPosition(positions.data(), n, filtered ? eligible.data() : nullptr, scratch, order);
        EXPECT_EQ(order, expected) << "n " << n << " span x" << span_factor;
      }
    }
  }
}

// The definition in attention_stats.h, one window at a time.
std::vector<float> ReferencePool(const std::vector<float>& in, int32_t rows, int32_t heads,
                                 int32_t count, const std::vector<int32_t>& positions,
                                 const std::vector<uint8_t>& eligible, int32_t kernel,
                                 Pooling pooling) {
  std::vector<float> out = in;
  const int32_t half = kernel / 2;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t h = r / (rows / heads);
    std::vector<int32_t> order;
    for (int32_t s = 0; s < count; ++s) {
      if (eligible.empty() || eligible[h * count + s] != 0) order.push_back(s);
    }
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return positions[h * count + a] < positions[h * count + b];
    });
    const int32_t m = static_cast<int32_t>(order.size());
    for (int32_t j = 0; j < m; ++j) {
      double sum = 0.0;
      float best = -std::numeric_limits<float>::infinity();
      for (int32_t t = std::max(0, j - half); t <= std::min(m - 1, j + half); ++t) {
        const float v = in[r * count + order[t]];
        sum += v;
        best = std::max(best, v);
      }
      out[r * count + order[j]] =
          pooling == Pooling::kMax ? best : static_cast<float>(sum / kernel);
    }
  }
  return out;
}

TEST(PoolByPositionTest, MatchesTheDefinitionBitForBit) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> value(0.0f, 1.0f);
  const int32_t heads = 2, rows = 6;
  const std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  for (const int32_t count : {1, 3, 7, 40, 257}) {
    for (const int32_t kernel : {1, 3, 7, 9}) {
      for (const Pooling pooling : {Pooling::kAvg, Pooling::kMax}) {
        for (const bool filtered : {false, true}) {
          std::vector<int32_t> positions;
          for (int32_t h = 0; h < heads; ++h) {
            const std::vector<int32_t> head = RandomPositions(rng, count, h == 0 ? 2 : 40, 0);
            positions.insert(positions.end(), head.begin(), head.end());
          }
          std::vector<uint8_t> eligible;
          if (filtered) {
            for (int32_t i = 0; i < heads * count; ++i) eligible.push_back(rng() % 4 != 0);
          }
          std::vector<float> in(rows * count);
          for (float& v : in) v = value(rng);
          std::vector<float> out(in.size(), -1.0f);
          ASSERT_TRUE(PoolByPosition(*backend, in, rows, heads, count, positions, eligible, kernel,
                                     pooling, absl::MakeSpan(out))
                          .ok());
          EXPECT_EQ(out,
                    ReferencePool(in, rows, heads, count, positions, eligible, kernel, pooling))
              << "count " << count << " kernel " << kernel << " max " << (pooling == Pooling::kMax)
              << " filtered " << filtered;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvs
