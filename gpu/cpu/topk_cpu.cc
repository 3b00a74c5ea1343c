#include "gpu/cpu/topk_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

// An unsigned key whose order is the score order: NaN below every number (0), -0 equal to +0.
// Equal scores are then ordered by position separately (lower position ranks higher).
// Branch-free: scores of both signs in random order would mispredict a branch on the sign half
// the time.
inline uint32_t ScoreKey(float score) {
  const bool nan = std::isnan(score);
  score += 0.0f;  // -0 -> +0
  uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  // Negative: every bit flipped; otherwise the sign bit set. Every number maps above 0: the
  // smallest, -inf (0xff800000), maps to 0x007fffff.
  const uint32_t key = bits ^ ((0u - (bits >> 31)) | 0x80000000u);
  return nan ? 0u : key;
}

// Bits per digit of the radix select (the last digit may have fewer).
constexpr int kDigitBits = 11;
// Up to this many dropped candidates per row, the drop list replaces the radix select.
constexpr int32_t kFewDropped = 8;

}  // namespace

namespace {

// One row of a job, its scores turned into keys (TopKScratch::keys).
struct Row {
  const uint32_t* keys;
  const int32_t* positions;
  const uint8_t* forced;  // null: nothing forced
  int32_t n;
  bool candidate(int32_t s) const { return forced == nullptr || forced[s] == 0; }
};

// The kept set is every forced slot, every candidate whose key is above `threshold`, and those
// whose key equals it and whose position is at most `tie_position_limit`.
struct Cut {
  uint32_t threshold = 0;
  int32_t tie_position_limit = std::numeric_limits<int32_t>::max();
};

// A decode step drops one token or a few: finds the `drop` worst candidates (lowest key, then
// highest position) in one pass over a tiny sorted list, and keeps everything else.
void KeepAllButTheWorst(const Row& row, int32_t drop, int32_t* kept) {
  struct Worst {
    uint32_t key;
    int32_t position;
    int32_t slot;
  };
  // a is dropped before b: lower key, or the same key and a higher position.
  auto worse = [](const Worst& a, const Worst& b) {
    return a.key < b.key || (a.key == b.key && a.position > b.position);
  };
  Worst worst[kFewDropped];
  int32_t found = 0;
  for (int32_t s = 0; s < row.n; ++s) {
    if (!row.candidate(s)) continue;
    const Worst candidate{row.keys[s], row.positions[s], s};
    if (found == drop && !worse(candidate, worst[found - 1])) continue;
    int32_t at = found < drop ? found++ : drop - 1;
    while (at > 0 && worse(candidate, worst[at - 1])) {
      worst[at] = worst[at - 1];
      --at;
    }
    worst[at] = candidate;
  }
  for (int32_t i = 1; i < found; ++i) {  // by slot, for the walk below
    const Worst item = worst[i];
    int32_t at = i;
    for (; at > 0 && worst[at - 1].slot > item.slot; --at) worst[at] = worst[at - 1];
    worst[at] = item;
  }
  int32_t written = 0;
  int32_t next_dropped = 0;
  for (int32_t s = 0; s < row.n; ++s) {
    if (next_dropped < found && worst[next_dropped].slot == s) {
      ++next_dropped;
      continue;
    }
    kept[written++] = s;
  }
}

// Radix select of the wanted-th largest candidate key: per digit, count the candidates per digit
// value, find the value holding the wanted-th largest and keep only those candidates for the
// next digit. The first digit reads the keys directly, the later ones the few slots left.
// The digits start below the high bits every key shares (`lowest` and `highest` are the row's
// extreme keys): scores of one magnitude (key norms, attention sums) share sign and exponent,
// and a first digit over those bits puts most slots in a few buckets, the same counters
// incremented back to back and a large candidate list; below them the slots spread out.
Cut RadixCut(const Row& row, int32_t wanted, uint32_t lowest, uint32_t highest,
             TopKScratch& scratch) {
  std::vector<int32_t>& candidates = scratch.candidates;
  std::vector<int32_t>& spare = scratch.spare;
  const uint32_t differing = lowest ^ highest;
  int varying_bits = differing == 0 ? 0 : 32 - __builtin_clz(differing);
  int32_t remaining = wanted;  // how many of the current candidates are still to be taken
  uint32_t prefix = varying_bits == 32 ? 0u : lowest & ~((uint32_t{1} << varying_bits) - 1);
  if (varying_bits == 0) {  // every key is equal: all candidates tie at it
    candidates.clear();
    for (int32_t s = 0; s < row.n; ++s) {
      if (row.candidate(s)) candidates.push_back(s);
    }
  }
  for (int digit = 0; varying_bits > 0; ++digit) {
    const int width = std::min(kDigitBits, varying_bits);
    const int shift = varying_bits - width;
    varying_bits = shift;
    const uint32_t mask = (uint32_t{1} << width) - 1;
    auto digit_of = [&](int32_t s) { return (row.keys[s] >> shift) & mask; };
    uint32_t histogram[uint32_t{1} << kDigitBits];
    std::fill_n(histogram, mask + 1, 0u);
    if (digit == 0) {
      for (int32_t s = 0; s < row.n; ++s) {
        if (row.candidate(s)) ++histogram[digit_of(s)];
      }
    } else {
      for (int32_t s : candidates) ++histogram[digit_of(s)];
    }
    uint32_t value = mask;
    int32_t above = 0;
    while (above + static_cast<int32_t>(histogram[value]) < remaining) {
      above += static_cast<int32_t>(histogram[value]);
      --value;
    }
    remaining -= above;
    prefix |= value << shift;
    spare.clear();
    if (digit == 0) {
      for (int32_t s = 0; s < row.n; ++s) {
        if (digit_of(s) == value && row.candidate(s)) spare.push_back(s);
      }
    } else {
      for (int32_t s : candidates) {
        if (digit_of(s) == value) spare.push_back(s);
      }
    }
    candidates.swap(spare);
  }
  Cut cut;
  cut.threshold = prefix;
  // Every candidate left has key == threshold; 1 <= `ties` <= their count are kept.
  const int32_t ties = remaining;
  if (ties < static_cast<int32_t>(candidates.size())) {
    // Positions are distinct within a row: the ties-th smallest is the cut.
    spare.clear();
    for (int32_t s : candidates) spare.push_back(row.positions[s]);
    std::nth_element(spare.begin(), spare.begin() + (ties - 1), spare.end());
    cut.tie_position_limit = spare[ties - 1];
  }
  return cut;
}

// Writes the k kept slots in slot order, which is the ascending output without a sort. Which
// slots are kept is data: a branch per slot mispredicts on a quarter of them at a 25 % budget, so
// each run of 64 slots becomes a bit mask first, whose set bits are then written one by one.
void EmitKept(const Row& row, const Cut& cut, int32_t k, int32_t* kept) {
  int32_t written = 0;
  for (int32_t base = 0; base < row.n && written < k; base += 64) {
    const int32_t end = std::min(row.n, base + 64);
    uint64_t bits = 0;
    for (int32_t s = base; s < end; ++s) {
      const uint32_t key = row.keys[s];
      const bool keep = !row.candidate(s) | (key > cut.threshold) |
                        ((key == cut.threshold) & (row.positions[s] <= cut.tie_position_limit));
      bits |= uint64_t{keep} << (s - base);
    }
    for (; bits != 0 && written < k; bits &= bits - 1) {
      kept[written++] = base + __builtin_ctzll(bits);
    }
  }
}

}  // namespace

void TopKRow(const TopKJob& job, int32_t row, TopKScratch& scratch) {
  const int64_t base = static_cast<int64_t>(row) * job.n;
  const float* scores = job.scores + base;
  const uint8_t* forced = job.forced != nullptr ? job.forced + base : nullptr;
  int32_t* kept = job.kept + static_cast<int64_t>(row) * job.k;
  const int32_t n = job.n;
  if (job.k == 0) return;

  // Forced slots are kept outright; the others compete for the remaining places.
  int32_t num_forced = 0;
  if (forced != nullptr) {
    for (int32_t s = 0; s < n; ++s) num_forced += forced[s] != 0 ? 1 : 0;
  }
  const int32_t wanted = job.k - num_forced;
  const int32_t num_candidates = n - num_forced;
  if (wanted <= 0 || wanted >= num_candidates) {
    // Nothing to rank (StreamingLLM's sinks + window fill the budget, or every slot fits): the
    // forced slots, or every slot, in slot order, without reading a score.
    int32_t written = 0;
    const bool forced_only = wanted <= 0 && forced != nullptr;
    for (int32_t s = 0; s < n && written < job.k; ++s) {
      if (!forced_only || forced[s] != 0) kept[written++] = s;
    }
    return;
  }
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(n);
  uint32_t lowest = std::numeric_limits<uint32_t>::max();
  uint32_t highest = 0;
  for (int32_t s = 0; s < n; ++s) {
    const uint32_t key = ScoreKey(scores[s]);
    keys[s] = key;
    lowest = std::min(lowest, key);
    highest = std::max(highest, key);
  }
  const Row view{keys.data(), job.positions + base, forced, n};
  if (num_candidates - wanted <= kFewDropped) {
    KeepAllButTheWorst(view, num_candidates - wanted, kept);
    return;
  }
  EmitKept(view, RadixCut(view, wanted, lowest, highest, scratch), job.k, kept);
}

}  // namespace kvs
