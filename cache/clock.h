// Clock: the time seam, so leases can be tested without sleeping. RealClock reads the system
// clock; FakeClock is advanced by hand. Both are thread-safe.
#ifndef KVSIDECAR_CACHE_CLOCK_H_
#define KVSIDECAR_CACHE_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvs {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24 * 365 * 50))
      : nanos_(absl::ToUnixNanos(start)) {}
  absl::Time Now() const override { return absl::FromUnixNanos(nanos_.load()); }
  void Advance(absl::Duration d) { nanos_ += absl::ToInt64Nanoseconds(d); }

 private:
  std::atomic<int64_t> nanos_;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_CLOCK_H_
