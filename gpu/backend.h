// Backend: the compute seam. Kernels over raw pointers, shapes and a stream, with two
// implementations of identical semantics: gpu/cpu (always built; the reference) and gpu/cuda.
// Nothing here knows protobuf, sequences or policies: cache/ plans the work and calls in.
//
// Pointer spaces: every pointer in a job lives where the backend computes (host memory for the
// CPU backend, device memory for CUDA), except where a field says otherwise.
//
// Threading: a Backend is shared by all sessions; every method is safe to call concurrently.
// Jobs within one call are independent and may run in parallel.
#ifndef KVSIDECAR_GPU_BACKEND_H_
#define KVSIDECAR_GPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/arena.h"
#include "gpu/base/dtype.h"

namespace kvs {

// An execution stream. nullptr = the backend's default stream. The CPU backend runs every call
// to completion before returning.
using Stream = void*;

// The stream of a call whose outputs all stay where the backend computes (device buffers): a
// device backend behind the staging layer queues the call on the calling thread's stream and
// returns without waiting for it; the next call of that thread that waits (one with host
// outputs, or Synchronize) waits for it too. Every host array the call reads has been read when
// it returns. A backend that computes on host memory runs such a call to completion as any other.
// A device path uses it to make a chain of calls one round trip (cache/sequence_device.cc).
inline Stream QueuedStream() { return reinterpret_cast<Stream>(static_cast<uintptr_t>(1)); }

// The keys of one (sequence, layer) in paged form: slot s of kv head h is the row
//   arena + block_table[s / block_tokens] * block_bytes
//         + ((0 * num_kv_heads + h) * block_tokens + s % block_tokens) * head_dim * dtype_bytes.
// Values are the same with kv index 1: kv_index selects which of the two a view reads.
struct PagedLayerView {
  const uint8_t* arena = nullptr;
  int32_t kv_index = 0;                  // 0 = the keys of the layer, 1 = its values
  const int32_t* block_table = nullptr;  // at least ceil(count / block_tokens) entries
  int32_t count = 0;                     // slots [0, count) hold tokens, for every kv head
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_tokens = 0;
  DType dtype = DType::kFloat16;
  uint64_t block_bytes = 0;
};

enum class KeyDiffAnchor { kMeanNormalized, kMeanRaw, kMedianNormalized };
// kNegativeNorm is not one of KeyDiff's: -||k||_2 with no anchor, KNorm's score (the keys of
// lowest norm kept; docs/policies/knorm.md), in one pass over the keys. A KeyDiff policy
// refuses it.
enum class KeyDiffMetric { kCosine, kPairwise, kDot, kEuclidean, kNegativeNorm };

// KeyDiff scores (shared/design/policies/keydiff.md §3.1, §3.5) of every slot of every kv head
// of one layer. A higher score means more distinctive, i.e. kept first. fp32 accumulation.
struct KeyDiffScoreJob {
  PagedLayerView keys;
  KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized;
  KeyDiffMetric metric = KeyDiffMetric::kCosine;
  float* scores = nullptr;  // out: [num_kv_heads][keys.count]
};

// Per-row top-k: keeps the k slots with the highest score; equal scores keep the lower position
// (`positions`), never the lower slot. Slots with forced[row * n + s] != 0 are kept first and count
// toward k (the caller guarantees at most k are forced). NaN scores rank lowest.
struct TopKJob {
  const float* scores = nullptr;       // [rows][n]
  const int32_t* positions = nullptr;  // [rows][n], distinct within a row
  const uint8_t* forced = nullptr;     // optional [rows][n]
  int32_t rows = 0;
  int32_t n = 0;
  int32_t k = 0;            // 0 <= k <= n
  int32_t* kept = nullptr;  // out: [rows][k] slot indices, ascending
};

// Copies `count` rows of `row_bytes` inside one arena: row i from arena + src_offsets[i] to
// arena + dst_offsets[i]. Rows must not overlap each other's destinations or a later source.
struct RowCopyJob {
  uint8_t* arena = nullptr;
  const uint64_t* src_offsets = nullptr;
  const uint64_t* dst_offsets = nullptr;
  int64_t count = 0;
  uint64_t row_bytes = 0;
};

// Copies `count` rows of `row_bytes` between host memory and one arena: row i between
// host + host_offsets[i] and arena + arena_offsets[i], in the direction `to_host` says. `host`
// is host memory (page-locked on the CUDA backend: the OmniKV tier and spill buffers); the
// rows of one job must not overlap each other's destinations.
struct HostRowCopyJob {
  uint8_t* arena = nullptr;
  uint8_t* host = nullptr;
  const uint64_t* arena_offsets = nullptr;
  const uint64_t* host_offsets = nullptr;
  int64_t count = 0;
  uint64_t row_bytes = 0;
  bool to_host = false;  // false: host -> arena; true: arena -> host
};

// Attention probabilities of a window of queries against one layer's cached keys, in fp32
// (policies/caote.md §2, cake.md step 1, d2o.md §4.1):
//   probs[q][i][s] = exp(l[q][i][s] - max_s' l) / sum_s' exp(...) over the unmasked slots s' of
//   kv head g = q / (num_q_heads / num_kv_heads), with l = scale * <queries[q][i], key(g, s)>,
//   and slot s masked (probability exactly 0) when key_positions[g][s] > query_positions[i]
//   (causal). A row with every slot masked is all zeros. Logits and sums accumulate in fp32.
struct AttentionJob {
  PagedLayerView keys;                       // kv_index 0
  const int32_t* key_positions = nullptr;    // [num_kv_heads][key_stride]
  // Row length of key_positions; 0 = keys.count. A device path's positions live in rows with room
  // to grow (cache/sequence_device.cc).
  int32_t key_stride = 0;
  const float* queries = nullptr;            // [num_q_heads][num_queries][head_dim], fp32
  const int32_t* query_positions = nullptr;  // [num_queries]
  int32_t num_q_heads = 0;                   // a positive multiple of keys.num_kv_heads
  int32_t num_queries = 0;                   // >= 1
  float scale = 0.0f;                        // softmax scale, finite and > 0
  float* probs = nullptr;                    // out: [num_q_heads][num_queries][keys.count]
};

// Where kv head h's key positions start in key_positions.
inline int64_t KeyPositionsOffset(const AttentionJob& job, int64_t h) {
  return h * (job.key_stride > 0 ? int64_t{job.key_stride} : int64_t{job.keys.count});
}

// The column sums of a window's attention probabilities (SnapKV's vote, shared/design/policies/
// snapkv.md): sums[q][s] = sum over i in [0, num_queries) of probs[q][i][s], probs as
// AttentionJob defines them, added in ascending i in fp32, without the probabilities ever being
// written out ([Hq][w][count] fp32 is 32 MiB per layer for a 32-query window over 8K tokens;
// the sums are w times smaller). The values equal a sum of AttentionProbs' output up to fp32
// rounding. `attention.probs` is neither read nor written (may be null).
struct AttentionSumsJob {
  AttentionJob attention;  // keys, positions, queries, scale: as AttentionJob
  float* sums = nullptr;   // out: [attention.num_q_heads][attention.keys.count]
};

enum class PoolKind { kAvg, kMax };

// 1-D pooling of score rows along an order of their slots: SnapKV's and CAKE's smoothing of a
// window's attention by position (policies/snapkv.md, cake.md step 3; the caller orders each
// head's slots by position). Row r belongs to kv head h = r / (rows / num_kv_heads); with
// o = order + h * count and m = lengths[h] (distinct slots), for every j < m:
//   kAvg: out[r][o[j]] = (sum over t = max(0, j - k/2) .. min(m - 1, j + k/2), ascending, in fp64,
//         of in[r][o[t]]) / kernel_size, rounded once to fp32 (zero padding counted in the
//         divisor, as torch avg_pool1d with count_include_pad);
//   kMax: the max of the same values (each compared as `best < v ? v : best`, ascending);
// every slot s outside o[0, m) gets out[r][s] = in[r][s]. `in` and `out` do not overlap.
struct PoolJob {
  const float* in = nullptr;         // [rows][count]
  const int32_t* order = nullptr;    // [num_kv_heads][count]; the first lengths[h] are read
  const int32_t* lengths = nullptr;  // [num_kv_heads], 0 <= lengths[h] <= count
  int32_t rows = 0;                  // a positive multiple of num_kv_heads
  int32_t num_kv_heads = 0;
  int32_t count = 0;
  int32_t kernel_size = 1;  // odd, >= 1
  PoolKind kind = PoolKind::kAvg;
  float* out = nullptr;  // out: [rows][count]
};

// CAKE's per-slot statistics of a window of attention probabilities (policies/cake.md step 3):
// with `probs` [num_q_heads][num_queries][count] and the window its trailing `window` rows,
//   scores[q][s] = mean + gamma * var, mean and the unbiased variance (0 when window = 1) of
//   probs[q][i][s] over the window's rows i,
// each accumulated per slot in fp64 in ascending i (the mean first, then the squared
// deviations from it), rounded once to fp32. No reduction across slots, so a backend that keeps
// the order and rounds like the CPU backend (no fused multiply-add) gives the same bits.
struct WindowVarianceJob {
  const float* probs = nullptr;  // [num_q_heads][num_queries][count]
  int32_t num_q_heads = 0;       // >= 1
  int32_t num_queries = 0;       // >= 1
  int32_t window = 1;            // 1 <= window <= num_queries
  int32_t count = 0;             // >= 0
  double gamma = 0.0;            // finite
  float* scores = nullptr;       // out: [num_q_heads][count]
};

// CAKE's layer preference terms (policies/cake.md step 2) from a window of attention
// probabilities laid out as WindowVarianceJob's, over the prefix slots only: slot s of query
// head q counts when key_positions[q / (num_q_heads / num_kv_heads)][s] < first_query_position.
//   *entropy = -sum over counted (q, s) of e[q][s], with e[q][s] = the sum over the window's rows
//              of p ln(p + 1e-10) accumulated in fp32 (NaN for a p + 1e-10 the log cannot take);
//   *shift   = sum over counted (q, s) of the unbiased variance over the window's rows (fp64 per
//              slot, as WindowVarianceJob; nothing is added when window < 2).
// The sums across slots are fp64. The CPU backend adds in (q, s) order, with its own fp32
// logarithm; other backends may reduce in another order and use their own logf: the values agree
// to fp64 rounding (shift) and a few fp32 ulps per term (entropy), not to the bit.
struct WindowEntropyJob {
  const float* probs = nullptr;            // [num_q_heads][num_queries][count]
  const int32_t* key_positions = nullptr;  // [num_kv_heads][count]
  int32_t num_q_heads = 0;                 // a positive multiple of num_kv_heads
  int32_t num_kv_heads = 0;                // >= 1
  int32_t num_queries = 0;                 // >= 1
  int32_t window = 1;                      // 1 <= window <= num_queries
  int32_t count = 0;                       // >= 0
  int32_t first_query_position = 0;
  double* entropy = nullptr;  // out: one value
  double* shift = nullptr;    // out: one value
};

// CAOTE output-error scores (policies/caote.md §3): for every row r, reading the values of kv
// head r / (rows / num_kv_heads), with alpha[r][:] >= 0 summing to 1 (the caller normalises):
//   X_r = sum_s alpha[r][s] * v_s (exact) or the plain mean of the row's values (fast),
//   scores[r][s] = alpha[r][s] / (1 - alpha[r][s]) * ||X_r - v_s||_2,
// with +inf where 1 - alpha <= eps and exactly 0 where alpha == 0. fp32 accumulation.
struct CaoteJob {
  PagedLayerView values;         // kv_index 1
  const float* alpha = nullptr;  // [rows][values.count]
  int32_t rows = 0;              // a positive multiple of values.num_kv_heads
  bool fast = false;
  float eps = 1e-6f;
  float* scores = nullptr;  // out: [rows][values.count]
};

// D2O nearest kept key (policies/d2o.md §4.1 step 6): for every query slot e of kv head `head`,
// similarity[e] = max over candidates c of cos(k_e, k_c) with both norms floored at 1e-6, and
// target[e] = the index (into candidate_slots) of the argmax; equal similarities pick the
// candidate with the lowest position. fp32 accumulation.
struct NearestKeyJob {
  PagedLayerView keys;  // kv_index 0
  int32_t head = 0;
  const int32_t* query_slots = nullptr;  // [num_queries]
  int32_t num_queries = 0;
  const int32_t* candidate_slots = nullptr;      // [num_candidates]
  const int32_t* candidate_positions = nullptr;  // [num_candidates], distinct
  int32_t num_candidates = 0;                    // >= 1 when num_queries > 0
  float* similarity = nullptr;                   // out: [num_queries]
  int32_t* target = nullptr;                     // out: [num_queries]
};

// Weighted merges of rows inside one arena: for each r < rows,
//   row(dst_offsets[r]) = sum_{k in [source_starts[r], source_starts[r+1])}
//                           weights[k] * row(src_offsets[k]),
// accumulated in fp32 and rounded once into `dtype`. The sources of all rows are one CSR array
// (source_starts[0] = 0, every row has at least one source), so that a policy that folds
// thousands of evicted tokens into their targets sends one job per layer, not one per row. A row's
// dst may be among its own sources (every source is read before dst is written). The rows of a
// call write distinct rows and read no row another row of the call writes.
struct RowMergeJob {
  uint8_t* arena = nullptr;
  DType dtype = DType::kFloat16;
  int32_t row_elements = 0;                // head_dim
  int64_t rows = 0;                        // rows written
  const uint64_t* dst_offsets = nullptr;   // [rows], byte offsets into the arena
  const int64_t* source_starts = nullptr;  // [rows + 1]
  const uint64_t* src_offsets = nullptr;   // [source_starts[rows]], byte offsets into the arena
  const float* weights = nullptr;          // [source_starts[rows]]
};
// A merge job's rows are at most this many: the bound is checked before any of its arrays is
// read, so a host-validating backend can mirror rows + 1 starts.
inline constexpr int64_t kMaxRowMergeRows = (int64_t{1} << 31) - 1;

// Finds non-finite values (NaN, +-inf: every exponent bit set) in `count` rows of `row_elements`
// values of `dtype` inside one arena, row i at arena + row_offsets[i]. Writes to
// *first_non_finite the lowest flat index (i * row_elements + element) holding one, or -1 when
// every value is finite. Reads the arena only: how K/V the worker wrote into the arena is checked
// before it becomes part of a sequence.
//
// With row_norms, the same pass also writes the L2 norm of every row (fp32), the value KNorm's
// KeyDiff job (KeyDiffMetric::kNegativeNorm) negates: a policy that ranks keys by their norms then
// scores a committed prompt without reading its keys again. The norms are defined only when every
// row is finite (first_non_finite == -1).
struct FiniteCheckJob {
  const uint8_t* arena = nullptr;
  const uint64_t* row_offsets = nullptr;  // [count]
  int64_t count = 0;
  int32_t row_elements = 0;  // head_dim
  DType dtype = DType::kFloat16;
  int64_t* first_non_finite = nullptr;  // out: one value
  float* row_norms = nullptr;           // optional out: [count]
};

// Where a decode eviction's selection scores come from (DecodeEvictJob::scores).
enum class DecodeScores {
  kNone,         // every score 0: the protection alone decides (StreamingLLM)
  kAccumulated,  // `accumulated` with this step's `sums` added, as a GQA mean per kv head
  kRows,         // `rows` [rows_count][count]: a GQA mean per kv head when rows_count is
                 // num_q_heads, used as they are when it is num_kv_heads
};

// The decode-time eviction of one (sequence, layer) where the layer lives: the device path of a
// DecodeStep (cache/sequence_step.cc), whose per-layer state stays in device memory and whose
// result is one slot per kv head. The step's new token is in slot count - 1 of every head. Two
// stages, each a call over every job of a step:
//   kChoose changes nothing below slot count - 1: it writes new_position into
//   positions[h][count-1],
//     checks that the new token's K and V rows and `queries` are finite and that the
//     probabilities it reads (`sums`, and `rows` marked as probabilities) are finite and >= 0, as
//     the host path's checks do, and writes into `evicted` the slot each head drops: among the
//     slots that are not protected (each head's `sinks` lowest and `recent` highest positions),
//     the lowest score key (TopKJob's order: NaN lowest, -0 as +0), of those the highest
//     position. A job whose inputs fail a check writes kDecodeRowsNotFinite or
//     kDecodeScoresInvalid into the `evicted` entry of at least one head (the caller then runs
//     the step on the host, which reports it); one that does not evict writes -1 for every head.
//   kApply (after kChoose, on its `evicted`): starts slot count - 1 of `accumulated` at 0 and
//     adds `sums` into it, then per head moves slot count - 1 into the evicted slot: its K and V
//     rows, its position and its `accumulated` rows (those of the head's query group). The layer
//     then holds count - 1 tokens per head (count when it evicts nothing).
// The result equals the host path of the same step bit for bit: ScoredPolicy::Select's ranking
// (GqaMean's fp64 group means, TopK's order), MarkSinksAndRecent's protection and the hole-filling
// compaction PlanCompaction plans for one token per head (block_tokens >= 2).
enum class DecodeStage { kChoose, kApply };
inline constexpr int32_t kDecodeRowsNotFinite = -2;
inline constexpr int32_t kDecodeScoresInvalid = -3;

struct DecodeEvictJob {
  PagedLayerView keys;           // kv_index 0, count >= 1 (with the step's token); values too
  int32_t stride = 0;            // row length of positions and the state arrays, >= count
  int32_t* positions = nullptr;  // [H][stride], slot order
  int32_t new_position = 0;
  int32_t num_q_heads = 0;       // a positive multiple of keys.num_kv_heads
  float* accumulated = nullptr;  // optional [num_q_heads][stride]
  const float* sums = nullptr;   // optional [num_q_heads][count], added into `accumulated`
  DecodeScores scores = DecodeScores::kNone;
  const float* rows = nullptr;  // kRows: [rows_count][count]
  int32_t rows_count = 0;
  bool rows_are_probabilities = false;  // kRows: checked as attention probabilities
  int32_t sinks = 0;                    // >= 0; sinks + recent <= count - 1 when evicting
  int32_t recent = 0;
  bool evict = false;          // false: the token joins, nothing leaves
  int32_t* evicted = nullptr;  // [H]: written by kChoose, read by kApply
  // Optional: `query_values` fp32 queries kChoose checks finite (a worker's staged queries, which
  // no host check has read).
  const float* queries = nullptr;
  int64_t query_values = 0;
};

struct ArenaOptions {
  // CPU backend. false (default): an anonymous memfd, sealed against resizing, reachable only
  // through a descriptor the sidecar hands out. true: the legacy named file in shm_directory,
  // which every process of the sidecar's uid can open (no isolation between tenants in memory).
  bool shm_names = false;
  std::string shm_directory = "/dev/shm";  // shm_names: where the shm file is created
  std::string name_prefix = "kvsidecar";   // file name prefix (pid and generation are appended);
                                           // the memfd's name, shown in /proc, otherwise
};

// Memory where a backend's jobs may point and which keeps its contents between calls: device
// memory on a device backend, host memory on the CPU backend. A device path keeps a sequence's
// slot tables and a step's intermediate arrays there, so that they never cross the bus.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual uint8_t* data() const = 0;  // 256-byte aligned
  virtual uint64_t size() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;  // "cpu" or "cuda"
  // False after a device error; the sidecar then refuses new work and reports it.
  virtual bool healthy() const = 0;
  // True when every call is a round trip to a device the host waits for (a device backend behind
  // the staging layer): the cache core then gives each call the work of a whole RPC, every
  // sequence and layer of it, instead of splitting it across host threads. False for backends
  // that compute on host memory, whose calls cost nothing to split.
  virtual bool batches_calls() const { return false; }

  // RESOURCE_EXHAUSTED when the memory cannot be had, INTERNAL on other system errors.
  virtual absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                             const ArenaOptions& options) = 0;

  virtual absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) = 0;
  virtual absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) = 0;
  virtual absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) = 0;
  // INVALID_ARGUMENT naming the job index and field for malformed jobs; nothing is written then.
  virtual absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream stream) = 0;
  // The scaled logits AttentionProbs normalises, written to `probs`: l[q][i][s] as defined there,
  // -inf where masked (OmniKV's "last" selector ranks raw logits across heads). Same validation.
  virtual absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream stream) = 0;
  // AttentionSumsJob; validated as AttentionProbs (with `sums` in place of `probs`). The default
  // computes AttentionProbs into host memory and sums there: right for backends that compute
  // on host memory (test wrappers); device backends override it.
  virtual absl::Status AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, Stream stream);
  // PoolJob. INVALID_ARGUMENT naming the job index and field for malformed jobs (shape, kernel,
  // an order entry out of range); nothing is written then. The default computes on host memory
  // (gpu/cpu/pool_cpu.h): right for host backends; device backends override it.
  virtual absl::Status PoolScores(absl::Span<const PoolJob> jobs, Stream stream);
  // WindowVarianceJob / WindowEntropyJob. INVALID_ARGUMENT naming the job index and field for
  // malformed jobs; nothing is written then. The defaults compute on host memory
  // (gpu/cpu/window_stats_cpu.h): right for host backends; device backends override them.
  virtual absl::Status WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs,
                                            Stream stream);
  virtual absl::Status WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream stream);
  virtual absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream stream) = 0;
  virtual absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream stream) = 0;
  virtual absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream stream) = 0;
  virtual absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream stream) = 0;
  // INVALID_ARGUMENT naming the job index and field for malformed jobs; nothing is written then.
  virtual absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream stream) = 0;
  virtual absl::Status Synchronize(Stream stream) = 0;

  // DecodeEvictJob's `stage` for every job. INVALID_ARGUMENT naming the job index and field for
  // malformed jobs; nothing is written then. The default computes on host memory
  // (gpu/cpu/decode_evict_cpu.h): right for host backends; device backends override it.
  virtual absl::Status DecodeEvict(absl::Span<const DecodeEvictJob> jobs, DecodeStage stage,
                                   Stream stream);

  // A buffer of at least `bytes` (> 0) bytes (its contents undefined), RESOURCE_EXHAUSTED when
  // the memory cannot be had. The default is host memory: right for host backends.
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(uint64_t bytes);
  // Synchronous copies between host memory and [offset, offset + bytes) of `buffer`, ordered
  // after the calling thread's queued work; OUT_OF_RANGE when the range leaves the buffer.
  virtual absl::Status WriteBuffer(DeviceBuffer& buffer, uint64_t offset, const void* source,
                                   uint64_t bytes);
  virtual absl::Status ReadBuffer(const DeviceBuffer& buffer, uint64_t offset, void* destination,
                                  uint64_t bytes);

  // Page-locks [p, p + bytes) of host memory so that copies between it and this backend's arenas
  // (Arena::Read/Write) run at the bus's speed and its kernels may reach it (CUDA:
  // cudaHostRegister). False where nothing needs pinning (host backends) or the driver refused:
  // the memory works either way, only slower. A pinned range is unpinned (UnpinHostMemory with
  // the same p) before it is freed. The spill buffers use it (cache/spill_buffers.h).
  virtual bool PinHostMemory(void* p, uint64_t bytes) { return false; }
  virtual void UnpinHostMemory(void* p) {}
};

// The always-available reference backend. `num_threads` <= 0 picks the hardware concurrency.
std::unique_ptr<Backend> MakeCpuBackend(int num_threads = 0);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BACKEND_H_
