// ThreadPool: a small fixed set of worker threads for the CPU backend's data-parallel loops.
// ParallelFor runs fn(i) for i in [0, n) on the caller plus the workers and returns when every
// index is done.
//
// Threading: ParallelFor may be called from any number of threads at once; calls share the
// workers (the caller always works on its own loop, so a busy pool never stalls a call). A
// ParallelFor called from inside the body of a loop that runs on several threads (of any pool)
// runs inline on the calling thread: the outer loop already occupies the threads.
#ifndef KVSIDECAR_GPU_CPU_THREAD_POOL_H_
#define KVSIDECAR_GPU_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"

namespace kvs {

class ThreadPool {
 public:
  // `num_threads` counts the caller: num_threads - 1 workers are started (none for <= 1).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n), at most `max_parallel` (<= 0: all) threads at once.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn, int max_parallel = 0);

 private:
  void WorkerLoop();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_THREAD_POOL_H_
