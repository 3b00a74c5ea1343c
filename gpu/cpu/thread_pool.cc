#include "gpu/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

namespace kvs {
namespace {

// Set while this thread runs the body of a loop that another thread runs alongside it. A loop
// started from there runs inline: both cores are busy already (the decode step runs sequences
// side by side, each calling the backend), and splitting again only adds wake-ups and threads
// fighting over the same cores.
thread_local bool t_in_parallel_loop = false;

class ParallelRegion {
 public:
  ParallelRegion() : outer_(t_in_parallel_loop) { t_in_parallel_loop = true; }
  ~ParallelRegion() { t_in_parallel_loop = outer_; }

 private:
  const bool outer_;
};

// One ParallelFor call. Shared with the helper tasks so that a helper dequeued after the loop
// finished (and after the caller returned) still touches valid memory; it then finds no index
// left and never calls `fn`, whose lifetime ends with the caller's frame.
struct LoopState {
  explicit LoopState(int64_t n, absl::FunctionRef<void(int64_t)> f) : total(n), fn(f) {}
  const int64_t total;
  absl::FunctionRef<void(int64_t)> fn;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  void Work() {
    ParallelRegion region;
    int64_t finished_here = 0;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < total;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
      ++finished_here;
    }
    if (finished_here > 0 &&
        done.fetch_add(finished_here, std::memory_order_acq_rel) + finished_here == total) {
      std::lock_guard<std::mutex> lock(mutex);
      finished.notify_all();
    }
  }
};

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn, int max_parallel) {
  if (n <= 0) return;
  int64_t parallel = num_threads();
  if (max_parallel > 0) parallel = std::min<int64_t>(parallel, max_parallel);
  parallel = std::min(parallel, n);
  if (parallel <= 1 || t_in_parallel_loop) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<LoopState>(n, fn);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t i = 1; i < parallel; ++i) queue_.emplace_back([state] { state->Work(); });
  }
  if (parallel == 2) {
    wake_.notify_one();
  } else {
    wake_.notify_all();
  }
  state->Work();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == n; });
}

}  // namespace kvs
