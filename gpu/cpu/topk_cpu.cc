#include "gpu/cpu/topk_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvs {

absl::Status ValidateTopKJob(const TopKJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("top-k job ", index, ": ", parts...));
  };
  if (job.rows < 0) return invalid("rows must be >= 0, got ", job.rows);
  if (job.n < 0) return invalid("n must be >= 0, got ", job.n);
  if (job.k < 0 || job.k > job.n) {
    return invalid("k must be in [0, ", job.n, "], got ", job.k);
  }
  if (job.rows == 0) return absl::OkStatus();
  if (job.n > 0 && (job.scores == nullptr || job.positions == nullptr)) {
    return invalid("null scores or positions");
  }
  if (job.k > 0 && job.kept == nullptr) return invalid("null kept");
  if (job.forced != nullptr) {
    for (int32_t row = 0; row < job.rows; ++row) {
      const uint8_t* flags = job.forced + static_cast<int64_t>(row) * job.n;
      const int64_t forced = job.n - std::count(flags, flags + job.n, uint8_t{0});
      if (forced > job.k) {
        return invalid("row ", row, " forces ", forced, " slots but k is ", job.k);
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// One 64-bit key per candidate whose unsigned order is the rank order: the score (mapped to an
// order-preserving integer, NaN below -inf, -0 equal to +0) above the inverted position (equal
// scores: lower position ranks higher). Selection then compares plain integers instead of
// chasing two arrays through a comparator with NaN cases.
uint64_t RankKey(float score, int32_t position) {
  uint32_t ordered = 0;  // NaN: below every number
  if (!std::isnan(score)) {
    score += 0.0f;  // -0 -> +0
    uint32_t bits;
    std::memcpy(&bits, &score, sizeof(bits));
    ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    // Every number maps above 0: the smallest, -inf (0xff800000), maps to 0x007fffff.
  }
  const uint32_t position_order = static_cast<uint32_t>(position) ^ 0x80000000u;
  return (static_cast<uint64_t>(ordered) << 32) | (0xffffffffu - position_order);
}

}  // namespace

void TopKRow(const TopKJob& job, int32_t row, TopKScratch& scratch) {
  const int64_t base = static_cast<int64_t>(row) * job.n;
  const float* scores = job.scores + base;
  const int32_t* positions = job.positions + base;
  int32_t* kept = job.kept + static_cast<int64_t>(row) * job.k;
  if (job.k == 0) return;

  // Forced slots are kept outright; the others compete for the remaining places.
  std::vector<uint8_t>& keep = scratch.keep;
  std::vector<TopKCandidate>& candidates = scratch.candidates;
  keep.assign(job.n, 0);
  candidates.clear();
  int64_t num_forced = 0;
  for (int32_t s = 0; s < job.n; ++s) {
    if (job.forced != nullptr && job.forced[base + s] != 0) {
      keep[s] = 1;
      ++num_forced;
    } else {
      candidates.push_back({RankKey(scores[s], positions[s]), s});
    }
  }
  const int64_t wanted = job.k - num_forced;
  if (wanted > 0) {
    if (wanted < static_cast<int64_t>(candidates.size())) {
      std::nth_element(
          candidates.begin(), candidates.begin() + (wanted - 1), candidates.end(),
          [](const TopKCandidate& a, const TopKCandidate& b) { return a.key > b.key; });
    }
    for (int64_t i = 0; i < wanted; ++i) keep[candidates[i].slot] = 1;
  }
  // Emitting in slot order gives the ascending output without sorting the kept set.
  int32_t written = 0;
  for (int32_t s = 0; s < job.n && written < job.k; ++s) {
    if (keep[s]) kept[written++] = s;
  }
}

}  // namespace kvs
