// Clock: the time seam, so leases can be tested without sleeping. RealClock reads MonotonicNow();
// FakeClock is advanced by hand. Both are thread-safe.
#ifndef KVSIDECAR_CACHE_CLOCK_H_
#define KVSIDECAR_CACHE_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvs {

// The wall clock as read once (at the first call in the process), plus how far CLOCK_MONOTONIC
// has advanced since. Leases, nonce lifetimes, deadlines and latencies are measured on it, never
// on the system clock: NTP or a hypervisor may step the system clock by any amount at any moment,
// and a step forward of one lease would end every session at once (a step back would keep dead
// ones). The price: the times the sidecar reports (lease_expires_unix_ms, Admin's attached and
// created times) are off by whatever the system clock was stepped since the process started.
absl::Time MonotonicNow();

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return MonotonicNow(); }
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
