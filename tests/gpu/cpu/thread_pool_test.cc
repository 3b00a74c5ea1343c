// ThreadPool: every index runs exactly once, from any number of calling threads at once, and a
// loop started inside the body of a loop that runs on several threads runs inline.
#include "gpu/cpu/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvs {
namespace {

TEST(ThreadPoolTest, EveryIndexRunsExactlyOnce) {
  for (const int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (const int64_t n : {0, 1, 5, 1000}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      pool.ParallelFor(n, [&](int64_t i) { runs[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(runs[i].load(), 1) << "threads " << threads << " n " << n << " index " << i;
      }
    }
  }
}

TEST(ThreadPoolTest, ConcurrentCallersShareTheWorkers) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int repeat = 0; repeat < 20; ++repeat) {
        pool.ParallelFor(100, [&](int64_t i) { total.fetch_add(i); });
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(total.load(), 4 * 20 * (99 * 100 / 2));
}

// Both indices of a 2-index loop wait for each other (up to `patience`): true when they ran at
// once.
bool RanTogether(std::atomic<int>& entered,
                 std::chrono::milliseconds patience = std::chrono::seconds(10)) {
  entered.fetch_add(1);
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (entered.load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  return entered.load() >= 2;
}

TEST(ThreadPoolTest, NestedLoopsRunInlineInsideAParallelLoop) {
  ThreadPool outer(2);
  ThreadPool inner(4);
  std::atomic<int> entered{0}, together{0}, inline_loops{0}, inner_runs{0};
  std::atomic<int> inner_together{0};
  outer.ParallelFor(2, [&](int64_t) {
    if (RanTogether(entered)) together.fetch_add(1);
    const std::thread::id self = std::this_thread::get_id();
    std::atomic<bool> all_here{true};
    inner.ParallelFor(64, [&](int64_t) {
      inner_runs.fetch_add(1);
      if (std::this_thread::get_id() != self) all_here = false;
    });
    if (all_here) inline_loops.fetch_add(1);
    // Inline, the two indices of an inner loop run one after the other: never together (each
    // outer body waits 300 ms for a partner that does not come).
    std::atomic<int> inner_entered{0};
    inner.ParallelFor(2, [&](int64_t i) {
      // Index 0 runs first when inline: only it can tell (index 1 then finds it came before).
      if (RanTogether(inner_entered, std::chrono::milliseconds(300)) && i == 0) {
        inner_together.fetch_add(1);
      }
    });
  });
  ASSERT_EQ(together.load(), 2) << "the outer loop did not run on two threads";
  EXPECT_EQ(inner_runs.load(), 2 * 64);
  EXPECT_EQ(inline_loops.load(), 2);
  EXPECT_EQ(inner_together.load(), 0) << "a loop inside a parallel loop spread over threads";

  // Outside any parallel loop (and after one), loops spread over the workers again.
  std::atomic<int> entered_again{0}, together_again{0};
  inner.ParallelFor(2, [&](int64_t) {
    if (RanTogether(entered_again)) together_again.fetch_add(1);
  });
  EXPECT_EQ(together_again.load(), 2);
}

}  // namespace
}  // namespace kvs
