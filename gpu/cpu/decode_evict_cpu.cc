// The decode-time eviction on the host (gpu/cpu/decode_evict_cpu.h).
#include "gpu/cpu/decode_evict_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/finite.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/attention_cpu.h"  // ValidatePagedLayerView

namespace kvs {
namespace {

// TopKJob's order (gpu/cpu/topk_cpu.cc): an unsigned key, NaN below every number, -0 as +0.
uint32_t ScoreKey(float score) {
  const bool nan = std::isnan(score);
  score += 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  const uint32_t key = bits ^ ((0u - (bits >> 31)) | 0x80000000u);
  return nan ? 0u : key;
}

// The row of (kv, head, slot) of the layer `view` pages.
uint8_t* Row(const PagedLayerView& view, int kv, int head, int32_t slot) {
  const uint64_t row_bytes = static_cast<uint64_t>(view.head_dim) * DTypeBytes(view.dtype);
  const uint64_t in_block =
      ((static_cast<uint64_t>(kv) * view.num_kv_heads + head) * view.block_tokens +
       static_cast<uint64_t>(slot % view.block_tokens)) *
      row_bytes;
  return const_cast<uint8_t*>(view.arena) +
         static_cast<uint64_t>(view.block_table[slot / view.block_tokens]) * view.block_bytes +
         in_block;
}

// An attention probability the host path accepts (CheckLayerStep): finite and >= 0.
bool Probability(float p) { return std::isfinite(p) && p >= 0.0f; }

// Whether the probabilities the job reads (sums, and rows that are probabilities) are finite and
// >= 0 (CheckLayerStep).
bool ProbabilitiesValid(const DecodeEvictJob& job) {
  const int64_t n = job.keys.count;
  auto valid = [n](const float* rows, int64_t count) {
    for (int64_t i = 0; i < count * n; ++i) {
      if (!Probability(rows[i])) return false;
    }
    return true;
  };
  if (job.sums != nullptr && !valid(job.sums, job.num_q_heads)) return false;
  if (job.rows != nullptr && job.rows_are_probabilities && !valid(job.rows, job.rows_count)) {
    return false;
  }
  return true;
}

// The scores of head `h` ([count]), as ScoredPolicy::Select sees them.
void HeadScores(const DecodeEvictJob& job, int32_t h, std::vector<float>& out) {
  const int32_t n = job.keys.count;
  const int32_t last = n - 1;
  const int32_t heads = job.keys.num_kv_heads;
  out.assign(static_cast<size_t>(n), 0.0f);
  // A GQA mean (GqaMean): the group's rows summed per slot in fp64, in row order, divided once.
  auto group_mean = [&](int32_t rows, auto&& value) {
    const int32_t group = rows / heads;
    if (group == 1) {
      for (int32_t s = 0; s < n; ++s) out[s] = value(h, s);
      return;
    }
    std::vector<double> sums(static_cast<size_t>(n), 0.0);
    for (int32_t j = 0; j < group; ++j) {
      for (int32_t s = 0; s < n; ++s) sums[s] += value(h * group + j, s);
    }
    for (int32_t s = 0; s < n; ++s) out[s] = static_cast<float>(sums[s] / group);
  };
  switch (job.scores) {
    case DecodeScores::kNone:
      return;
    case DecodeScores::kAccumulated: {
      // The new slot starts at 0 (LayerPolicyState::Extend); the step's sums are added to every
      // slot (AccumulateColumnSums) before the mean.
      group_mean(job.num_q_heads, [&](int32_t r, int32_t s) {
        float v = s < last ? job.accumulated[int64_t{r} * job.stride + s] : 0.0f;
        if (job.sums != nullptr) v += job.sums[int64_t{r} * n + s];
        return v;
      });
      return;
    }
    case DecodeScores::kRows:
      group_mean(job.rows_count,
                 [&](int32_t r, int32_t s) { return job.rows[int64_t{r} * n + s]; });
      return;
  }
}

// MarkSinksAndRecent's protection of head `h`: its `sinks` lowest and `recent` highest positions
// (positions are distinct within a head, so the sets are exact).
void Protected(const int32_t* positions, int32_t n, int32_t sinks, int32_t recent,
               std::vector<int32_t>& scratch, std::vector<uint8_t>& forced) {
  forced.assign(static_cast<size_t>(n), 0);
  if (int64_t{sinks} + recent >= n) {
    std::fill(forced.begin(), forced.end(), uint8_t{1});
    return;
  }
  int64_t sink_limit = -1;
  int64_t recent_limit = std::numeric_limits<int64_t>::max();
  scratch.assign(positions, positions + n);
  if (sinks > 0) {
    std::nth_element(scratch.begin(), scratch.begin() + (sinks - 1), scratch.end());
    sink_limit = scratch[sinks - 1];
  }
  if (recent > 0) {
    std::nth_element(scratch.begin() + sinks, scratch.begin() + (n - recent), scratch.end());
    recent_limit = scratch[n - recent];
  }
  for (int32_t s = 0; s < n; ++s) {
    forced[s] = positions[s] <= sink_limit || positions[s] >= recent_limit ? 1 : 0;
  }
}

void Choose(const DecodeEvictJob& job) {
  const int32_t heads = job.keys.num_kv_heads;
  const int32_t n = job.keys.count;
  const int32_t last = n - 1;
  const int32_t dim = job.keys.head_dim;
  for (int32_t h = 0; h < heads; ++h)
    job.positions[int64_t{h} * job.stride + last] = job.new_position;
  // The new token's rows, as a commit's check reads them.
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t h = 0; h < heads; ++h) {
      const uint8_t* row = Row(job.keys, kv, h, last);
      if (FirstNonFinite(row, dim, job.keys.dtype) >= 0) {
        job.evicted[0] = kDecodeRowsNotFinite;
        return;
      }
    }
  }
  // The step's queries and probabilities are checked whether or not the layer evicts, as the
  // host path's checks of every listed layer are.
  for (int64_t i = 0; i < job.query_values; ++i) {
    if (!std::isfinite(job.queries[i])) {
      job.evicted[0] = kDecodeScoresInvalid;
      return;
    }
  }
  if (!ProbabilitiesValid(job)) {
    job.evicted[0] = kDecodeScoresInvalid;
    return;
  }
  if (!job.evict) {
    std::fill(job.evicted, job.evicted + heads, -1);
    return;
  }
  std::vector<float> scores;
  std::vector<int32_t> scratch;
  std::vector<uint8_t> forced;
  std::vector<int32_t> worst(static_cast<size_t>(heads), -1);
  for (int32_t h = 0; h < heads; ++h) {
    HeadScores(job, h, scores);
    const int32_t* positions = job.positions + int64_t{h} * job.stride;
    Protected(positions, n, job.sinks, job.recent, scratch, forced);
    // The candidate TopK drops first: the lowest key, of those the highest position.
    int32_t chosen = -1;
    uint32_t chosen_key = 0;
    for (int32_t s = 0; s < n; ++s) {
      if (forced[s] != 0) continue;
      const uint32_t key = ScoreKey(scores[s]);
      if (chosen < 0 || key < chosen_key ||
          (key == chosen_key && positions[s] > positions[chosen])) {
        chosen = s;
        chosen_key = key;
      }
    }
    worst[h] = chosen;
  }
  std::copy(worst.begin(), worst.end(), job.evicted);
}

void Apply(const DecodeEvictJob& job) {
  const int32_t heads = job.keys.num_kv_heads;
  const int32_t n = job.keys.count;
  const int32_t last = n - 1;
  if (job.accumulated != nullptr) {
    for (int32_t r = 0; r < job.num_q_heads; ++r) {
      float* row = job.accumulated + int64_t{r} * job.stride;
      row[last] = 0.0f;
      if (job.sums == nullptr) continue;
      const float* sums = job.sums + int64_t{r} * n;
      for (int32_t s = 0; s < n; ++s) row[s] += sums[s];
    }
  }
  if (!job.evict) return;
  const int32_t group = job.num_q_heads / heads;
  const uint64_t row_bytes = static_cast<uint64_t>(job.keys.head_dim) * DTypeBytes(job.keys.dtype);
  for (int32_t h = 0; h < heads; ++h) {
    const int32_t e = job.evicted[h];
    if (e < 0 || e == last) continue;  // the new token itself left: nothing moves
    for (int kv = 0; kv < 2; ++kv) {
      std::memcpy(Row(job.keys, kv, h, e), Row(job.keys, kv, h, last), row_bytes);
    }
    int32_t* positions = job.positions + int64_t{h} * job.stride;
    positions[e] = positions[last];
    if (job.accumulated != nullptr) {
      for (int32_t r = h * group; r < (h + 1) * group; ++r) {
        float* row = job.accumulated + int64_t{r} * job.stride;
        row[e] = row[last];
      }
    }
  }
}

}  // namespace

absl::Status ValidateDecodeEvictJob(const DecodeEvictJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("decode evict job ", index, ": ", parts...));
  };
  const std::string context = absl::StrCat("decode evict job ", index);
  KVS_RETURN_IF_ERROR(ValidatePagedLayerView(job.keys, context, "keys"));
  const int32_t heads = job.keys.num_kv_heads;
  if (job.keys.count < 1)
    return invalid("keys.count must be >= 1 (the step's token), got ", job.keys.count);
  if (job.stride < job.keys.count) {
    return invalid("stride ", job.stride, " is below keys.count ", job.keys.count);
  }
  if (job.num_q_heads < heads || job.num_q_heads % heads != 0) {
    return invalid("num_q_heads must be a positive multiple of ", heads, ", got ", job.num_q_heads);
  }
  if (job.positions == nullptr || job.evicted == nullptr)
    return invalid("null positions or evicted");
  if (job.sums != nullptr && job.accumulated == nullptr) return invalid("sums without accumulated");
  if (job.query_values < 0 || (job.query_values > 0 && job.queries == nullptr)) {
    return invalid("query_values ", job.query_values, " without queries");
  }
  switch (job.scores) {
    case DecodeScores::kNone:
      break;
    case DecodeScores::kAccumulated:
      if (job.accumulated == nullptr) return invalid("kAccumulated scores without accumulated");
      break;
    case DecodeScores::kRows:
      if (job.rows == nullptr || (job.rows_count != heads && job.rows_count != job.num_q_heads)) {
        return invalid("kRows scores need rows of num_kv_heads or num_q_heads rows, got ",
                       job.rows_count);
      }
      break;
    default:
      return invalid("scores is not a known source: ", static_cast<int>(job.scores));
  }
  if (job.sinks < 0 || job.recent < 0) {
    return invalid("sinks and recent must be >= 0, got ", job.sinks, " and ", job.recent);
  }
  if (job.evict && int64_t{job.sinks} + job.recent > job.keys.count - 1) {
    return invalid("protects ", job.sinks, " + ", job.recent, " tokens of the ", job.keys.count - 1,
                   " kept");
  }
  return absl::OkStatus();
}

void DecodeEvictCpu(const DecodeEvictJob& job, DecodeStage stage) {
  if (stage == DecodeStage::kChoose) {
    Choose(job);
  } else {
    Apply(job);
  }
}

// ---- Backend's host-memory defaults (gpu/backend.h) ----------------------------------------

namespace {

class HostBuffer final : public DeviceBuffer {
 public:
  HostBuffer(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  ~HostBuffer() override { std::free(data_); }
  uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }

 private:
  uint8_t* const data_;
  const uint64_t size_;
};

absl::Status CheckBufferRange(const DeviceBuffer& buffer, uint64_t offset, uint64_t bytes,
                              const void* host, const char* op) {
  if (offset > buffer.size() || bytes > buffer.size() - offset) {
    return absl::OutOfRangeError(absl::StrCat("buffer ", op, " of ", bytes, " bytes at offset ",
                                              offset, " leaves the buffer of ", buffer.size(),
                                              " bytes"));
  }
  if (bytes > 0 && host == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("buffer ", op, ": null host pointer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Backend::DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                                  Stream) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    KVS_RETURN_IF_ERROR(ValidateDecodeEvictJob(jobs[i], i));
  }
  for (const DecodeEvictJob& job : jobs) DecodeEvictCpu(job, stage);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> Backend::AllocateBuffer(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("AllocateBuffer of 0 bytes");
  constexpr uint64_t kAlignment = 256;
  const uint64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded < bytes) return absl::ResourceExhaustedError("buffer size overflows");
  auto* data = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, rounded));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a buffer of ", bytes, " bytes"));
  }
  return std::unique_ptr<DeviceBuffer>(new HostBuffer(data, bytes));
}

absl::Status Backend::WriteBuffer(DeviceBuffer& buffer, uint64_t offset, const void* source,
                                  uint64_t bytes) {
  KVS_RETURN_IF_ERROR(CheckBufferRange(buffer, offset, bytes, source, "write"));
  if (bytes > 0) std::memcpy(buffer.data() + offset, source, bytes);
  return absl::OkStatus();
}

absl::Status Backend::ReadBuffer(const DeviceBuffer& buffer, uint64_t offset, void* destination,
                                 uint64_t bytes) {
  KVS_RETURN_IF_ERROR(CheckBufferRange(buffer, offset, bytes, destination, "read"));
  if (bytes > 0) std::memcpy(destination, buffer.data() + offset, bytes);
  return absl::OkStatus();
}

}  // namespace kvs
