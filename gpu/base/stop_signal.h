// StopSignal: the flag a background loop (the server's lease reaper) sleeps on between rounds,
// and that stops it at once when raised.
//
// Its waits run on the monotonic clock (std::condition_variable over steady_clock, which
// libstdc++ waits on with CLOCK_MONOTONIC). absl::Mutex's timed waits turn the timeout into a
// deadline on the system clock (FUTEX_CLOCK_REALTIME in the abseil that Debian ships), so a step
// of the system clock back by an hour would stall such a loop for that hour: no lease would
// lapse, or no heartbeat would be sent until the session's own lease had lapsed.
#ifndef KVSIDECAR_GPU_BASE_STOP_SIGNAL_H_
#define KVSIDECAR_GPU_BASE_STOP_SIGNAL_H_

#include <condition_variable>
#include <mutex>

#include "absl/time/time.h"

namespace kvs {

class StopSignal {
 public:
  // Sleeps until Stop() or for `timeout` by the monotonic clock; true once stopped.
  bool WaitFor(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return stopped_; });
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_STOP_SIGNAL_H_
