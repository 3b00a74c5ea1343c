#include "cache/clock.h"

#include <chrono>

namespace kvs {
namespace {

struct Anchor {
  absl::Time wall;
  std::chrono::steady_clock::time_point steady;
};

}  // namespace

absl::Time MonotonicNow() {
  // Read together once; thread-safe by the rules for function-local statics.
  static const Anchor anchor{absl::Now(), std::chrono::steady_clock::now()};
  return anchor.wall + absl::FromChrono(std::chrono::steady_clock::now() - anchor.steady);
}

}  // namespace kvs
