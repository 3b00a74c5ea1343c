// Parity of the CUDA backend (gpu/cuda) with the CPU reference backend: every Backend method on
// random inputs (fp16/bf16/fp32, head_dim a multiple of 8 or not, partial last blocks, GQA, ties,
// NaN), kept sets and tie-breaking exact, values within the stated tolerance. Built only with
// CUDA; without a device every parity test reports itself skipped by name ("no CUDA device").
#include "gpu/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "gpu/base/dtype.h"
#include "gtest/gtest.h"
#include "tests/gpu/merge_rows_csr.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

// Relative tolerance of fp32 results whose summation order differs between the backends (the
// CPU backend's AVX2 kernels reassociate; the CUDA kernels follow the scalar order). Each test
// adds an absolute floor: KeyDiff and logits 1e-4, CAOTE and similarities 1e-5, probabilities
// 1e-6. Kept sets (top-k), merge targets, copies and merges must match exactly.
constexpr float kRelTolerance = 2e-5f;

void ExpectClose(const std::vector<float>& cuda, const std::vector<float>& cpu, float abs_floor,
                 const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(cpu[i])) {
      EXPECT_TRUE(std::isnan(cuda[i])) << what << " index " << i;
    } else if (std::isinf(cpu[i])) {
      EXPECT_EQ(cuda[i], cpu[i]) << what << " index " << i;
    } else {
      EXPECT_NEAR(cuda[i], cpu[i], std::max(abs_floor, kRelTolerance * std::fabs(cpu[i])))
          << what << " index " << i;
    }
  }
}

// Device memory holding a copy of a host vector; freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(1, size_) * sizeof(T)), cudaSuccess);
    if (size_ > 0) {
      EXPECT_EQ(cudaMemcpy(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  explicit DeviceBuffer(size_t size, T fill = T()) : DeviceBuffer(std::vector<T>(size, fill)) {}
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(data_); }
  std::vector<T> ToHost() const {
    std::vector<T> out(size_);
    if (size_ > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

 private:
  void* data_ = nullptr;
  size_t size_;
};

// A paged layer (keys and values of `heads` kv heads) behind a shuffled block table, unused
// blocks NaN, as host bytes; Upload copies it into a CUDA arena for the device view.
struct Layer {
  std::vector<uint8_t> bytes;
  std::vector<int32_t> table;
  PagedLayerView view;  // host view, kv_index 0

  Layer(int heads, int count, int dim, int block_tokens, DType dtype, uint32_t seed,
        int distinct_values = 0) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int type_bytes = DTypeBytes(dtype);
    const int used = (count + block_tokens - 1) / block_tokens;
    const int total = used + 2;
    const uint64_t block_bytes = 2ull * heads * block_tokens * dim * type_bytes;
    bytes.resize(total * block_bytes);
    for (uint64_t i = 0; i < bytes.size() / type_bytes; ++i) {
      StoreFromFloat(bytes.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
    }
    std::vector<int32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + used);
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < heads; ++h) {
        for (int s = 0; s < count; ++s) {
          const uint64_t row =
              table[s / block_tokens] * block_bytes +
              ((uint64_t(kv) * heads + h) * block_tokens + s % block_tokens) * dim * type_bytes;
          for (int d = 0; d < dim; ++d) {
            // distinct_values > 0: few distinct rows, so exact ties happen.
            const float x =
                distinct_values > 0
                    ? static_cast<float>((s % distinct_values) - distinct_values / 2) + 0.25f * d
                    : normal(rng);
            StoreFromFloat(bytes.data() + row, dtype, d, x);
          }
        }
      }
    }
    view.arena = bytes.data();
    view.block_table = table.data();
    view.count = count;
    view.num_kv_heads = heads;
    view.head_dim = dim;
    view.block_tokens = block_tokens;
    view.dtype = dtype;
    view.block_bytes = block_bytes;
  }
};

// The same layer in a CUDA arena.
struct DeviceLayer {
  std::unique_ptr<Arena> arena;
  std::unique_ptr<DeviceBuffer<int32_t>> table;
  PagedLayerView view;

  DeviceLayer(Backend& cuda, const Layer& layer) {
    auto made = cuda.CreateArena(layer.bytes.size(), ArenaOptions());
    EXPECT_TRUE(made.ok()) << made.status();
    arena = *std::move(made);
    EXPECT_TRUE(arena->Write(0, layer.bytes.data(), layer.bytes.size()).ok());
    table = std::make_unique<DeviceBuffer<int32_t>>(layer.table);
    view = layer.view;
    view.arena = arena->data();
    view.block_table = table->get();
  }
};

// The device twin of a host attention job: the keys of `device`, device copies of the job's
// positions and queries (held here), and `out` (device memory, or null) for its results.
class DeviceAttentionJob {
 public:
  DeviceAttentionJob(const AttentionJob& host, const DeviceLayer& device, float* out)
      : key_positions_(Copy(host.key_positions, int64_t{host.keys.num_kv_heads} * host.keys.count)),
        query_positions_(Copy(host.query_positions, host.num_queries)),
        queries_(
            Copy(host.queries, int64_t{host.num_q_heads} * host.num_queries * host.keys.head_dim)),
        job_(host) {
    job_.keys = device.view;
    job_.key_positions = key_positions_.get();
    job_.queries = queries_.get();
    job_.query_positions = query_positions_.get();
    job_.probs = out;
  }
  const AttentionJob& job() const { return job_; }

 private:
  template <typename T>
  static std::vector<T> Copy(const T* host, int64_t n) {
    return std::vector<T>(host, host + n);
  }

  DeviceBuffer<int32_t> key_positions_, query_positions_;
  DeviceBuffer<float> queries_;
  AttentionJob job_;
};

class CudaParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    auto made = MakeCudaBackend(0);
    ASSERT_TRUE(made.ok()) << made.status();
    cuda_ = *std::move(made);
    cpu_ = MakeCpuBackend(2);
  }
  void TearDown() override {
    if (cuda_ != nullptr) {
      EXPECT_TRUE(cuda_->healthy());
    }
  }

  // The column sums of `host` (an AttentionJob over `device`'s layer on the host, probs unused)
  // on the CPU and on the GPU agree.
  void ExpectColumnSumsMatch(const AttentionJob& host, const DeviceLayer& device,
                             const std::string& what) {
    const size_t n = static_cast<size_t>(host.num_q_heads) * host.keys.count;
    std::vector<float> expected(n, -7.0f);
    ASSERT_TRUE(cpu_->AttentionColumnSums({AttentionSumsJob{host, expected.data()}}, nullptr).ok());
    DeviceBuffer<float> sums(n, -7.0f);
    const DeviceAttentionJob on_device(host, device, nullptr);
    ASSERT_TRUE(
        cuda_->AttentionColumnSums({AttentionSumsJob{on_device.job(), sums.get()}}, nullptr).ok());
    ExpectClose(sums.ToHost(), expected, 1e-5f, "sums " + what);
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> cpu_;
};

struct Shape {
  DType dtype;
  int heads, count, dim, block_tokens;
};
const Shape kShapes[] = {
    {DType::kFloat16, 2, 37, 64, 16},  {DType::kBFloat16, 3, 100, 24, 8},
    {DType::kFloat32, 1, 16, 128, 16}, {DType::kFloat16, 4, 1, 8, 4},
    {DType::kFloat32, 2, 257, 40, 32},
};

TEST_F(CudaParityTest, KeyDiffScores) {
  const std::pair<KeyDiffAnchor, KeyDiffMetric> kinds[] = {
      {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine},
      {KeyDiffAnchor::kMeanRaw, KeyDiffMetric::kCosine},
      {KeyDiffAnchor::kMedianNormalized, KeyDiffMetric::kCosine},
      {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise},
      {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kDot},
      {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kEuclidean},
      {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kNegativeNorm}};
  // Beyond kShapes: several 256-row chunks per head (the tiled path), the widest head the tiled
  // path takes, and one wider (the one-block-per-head kernel).
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({DType::kFloat16, 2, 1100, 128, 16});
  shapes.push_back({DType::kBFloat16, 1, 513, 256, 32});
  shapes.push_back({DType::kFloat32, 1, 300, 264, 16});
  uint32_t seed = 1;
  for (const Shape& shape : shapes) {
    Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
    DeviceLayer device(*cuda_, layer);
    for (const auto& [anchor, metric] : kinds) {
      const size_t n = static_cast<size_t>(shape.heads) * shape.count;
      std::vector<float> expected(n, -1.0f);
      KeyDiffScoreJob job{layer.view, anchor, metric, expected.data()};
      ASSERT_TRUE(cpu_->KeyDiffScores({job}, nullptr).ok());
      DeviceBuffer<float> scores(n, -1.0f);
      job.keys = device.view;
      job.scores = scores.get();
      ASSERT_TRUE(cuda_->KeyDiffScores({job}, nullptr).ok());
      ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
      ExpectClose(scores.ToHost(), expected, 1e-4f,
                  "keydiff anchor " + std::to_string(int(anchor)) + " metric " +
                      std::to_string(int(metric)) + " dtype " +
                      std::string(DTypeName(shape.dtype)));
    }
  }
}

// The finiteness check with row_norms (a KNorm commit): the same verdict as the CPU, and norms
// that rank as the CPU's (close, not bit-equal: the block sums the squares in its own order),
// for the keys of every shape; a NaN planted in one key row is found with norms asked for too.
TEST_F(CudaParityTest, FindNonFiniteWithRowNorms) {
  uint32_t seed = 40;
  for (const Shape& shape : kShapes) {
    Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
    const int type_bytes = DTypeBytes(shape.dtype);
    std::vector<uint64_t> offsets;  // the keys, [head][slot]
    for (int h = 0; h < shape.heads; ++h) {
      for (int s = 0; s < shape.count; ++s) {
        offsets.push_back(layer.table[s / shape.block_tokens] * layer.view.block_bytes +
                          (uint64_t(h) * shape.block_tokens + s % shape.block_tokens) * shape.dim *
                              type_bytes);
      }
    }
    const std::string what = "dtype " + std::string(DTypeName(shape.dtype));
    for (bool plant : {false, true}) {
      if (plant) StoreFromFloat(layer.bytes.data() + offsets.back(), shape.dtype, 0, NAN);
      DeviceLayer device(*cuda_, layer);
      std::vector<float> expected(offsets.size(), -1.0f);
      int64_t cpu_first = 7;
      FiniteCheckJob job;
      job.arena = layer.bytes.data();
      job.row_offsets = offsets.data();
      job.count = static_cast<int64_t>(offsets.size());
      job.row_elements = shape.dim;
      job.dtype = shape.dtype;
      job.first_non_finite = &cpu_first;
      job.row_norms = expected.data();
      ASSERT_TRUE(cpu_->FindNonFinite({job}, nullptr).ok());
      DeviceBuffer<uint64_t> device_offsets(offsets);
      DeviceBuffer<int64_t> first(1, 7);
      DeviceBuffer<float> norms(offsets.size(), -1.0f);
      job.arena = device.arena->data();
      job.row_offsets = device_offsets.get();
      job.first_non_finite = first.get();
      job.row_norms = norms.get();
      ASSERT_TRUE(cuda_->FindNonFinite({job}, nullptr).ok());
      ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
      EXPECT_EQ(first.ToHost()[0], cpu_first) << what;
      EXPECT_EQ(cpu_first, plant ? int64_t(offsets.size() - 1) * shape.dim : -1) << what;
      if (!plant) ExpectClose(norms.ToHost(), expected, 1e-5f, "row norms " + what);
    }
  }
}

TEST_F(CudaParityTest, TopKKeepsTheSameSlotsWithTiesNanAndForced) {
  std::mt19937 rng(5);
  for (int n : {1, 7, 300, 5000}) {
    const int rows = 4;
    std::vector<float> scores(rows * n);
    std::vector<int32_t> positions(rows * n);
    std::vector<uint8_t> forced(rows * n, 0);
    for (int r = 0; r < rows; ++r) {
      std::vector<int32_t> p(n);
      std::iota(p.begin(), p.end(), 100);
      std::shuffle(p.begin(), p.end(), rng);
      std::copy(p.begin(), p.end(), positions.begin() + r * n);
    }
    for (float& s : scores) {
      const int pick = static_cast<int>(rng() % 12);  // few distinct values: many ties
      s = pick == 0   ? std::numeric_limits<float>::quiet_NaN()
          : pick == 1 ? -0.0f
          : pick == 2 ? 0.0f
                      : static_cast<float>(pick % 5) - 2.0f;
    }
    for (int k : {0, 1, n / 3, n / 2, n}) {
      for (bool with_forced : {false, true}) {
        std::fill(forced.begin(), forced.end(), 0);
        if (with_forced) {
          for (int r = 0; r < rows; ++r) {
            for (int f = 0; f < std::min(k, 3); ++f) forced[r * n + (rng() % n)] = 1;
          }
        }
        std::vector<int32_t> expected(rows * k, -1);
        TopKJob job{
            scores.data(),  positions.data(), with_forced ? forced.data() : nullptr, rows, n, k,
            expected.data()};
        ASSERT_TRUE(cpu_->TopK({job}, nullptr).ok());
        DeviceBuffer<float> d_scores(scores);
        DeviceBuffer<int32_t> d_positions(positions);
        DeviceBuffer<uint8_t> d_forced(forced);
        DeviceBuffer<int32_t> d_kept(rows * k, -1);
        job.scores = d_scores.get();
        job.positions = d_positions.get();
        job.forced = with_forced ? d_forced.get() : nullptr;
        job.kept = d_kept.get();
        ASSERT_TRUE(cuda_->TopK({job}, nullptr).ok());
        EXPECT_EQ(d_kept.ToHost(), expected)
            << "n " << n << " k " << k << " forced " << with_forced;
      }
    }
  }
}

TEST_F(CudaParityTest, CopyRowsKeepsChainOrder) {
  std::mt19937 rng(9);
  const uint64_t row_bytes = 48;  // not a multiple of 16 for half the rows' offsets
  std::vector<uint8_t> arena(64 * row_bytes + 8);
  for (uint8_t& b : arena) b = static_cast<uint8_t>(rng());
  // A chain: row i's destination is row i - 1's source, plus some unaligned rows.
  std::vector<uint64_t> src, dst;
  for (int i = 0; i < 20; ++i) {
    src.push_back((i + 1) * row_bytes);
    dst.push_back(i * row_bytes);
  }
  src.push_back(40 * row_bytes + 3);
  dst.push_back(50 * row_bytes + 5);
  std::vector<uint8_t> expected = arena;
  RowCopyJob job{expected.data(), src.data(), dst.data(), static_cast<int64_t>(src.size()),
                 row_bytes};
  ASSERT_TRUE(cpu_->CopyRows({job}, nullptr).ok());
  auto device = cuda_->CreateArena(arena.size(), ArenaOptions());
  ASSERT_TRUE(device.ok());
  ASSERT_TRUE((*device)->Write(0, arena.data(), arena.size()).ok());
  DeviceBuffer<uint64_t> d_src(src), d_dst(dst);
  job.arena = (*device)->data();
  job.src_offsets = d_src.get();
  job.dst_offsets = d_dst.get();
  ASSERT_TRUE(cuda_->CopyRows({job}, nullptr).ok());
  ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
  std::vector<uint8_t> actual(arena.size());
  ASSERT_TRUE((*device)->Read(0, actual.data(), actual.size()).ok());
  EXPECT_EQ(actual, expected);
}

TEST_F(CudaParityTest, CopyHostRowsBothWays) {
  std::mt19937 rng(11);
  const uint64_t row_bytes = 256;
  const int rows = 40;
  std::vector<uint8_t> arena(rows * 2 * row_bytes);
  for (uint8_t& b : arena) b = static_cast<uint8_t>(rng());
  std::vector<uint64_t> arena_offsets, host_offsets;
  for (int i = 0; i < rows; ++i) {
    arena_offsets.push_back((2 * i + 1) * row_bytes);
    host_offsets.push_back((rows - 1 - i) * row_bytes);
  }
  uint8_t* pinned = nullptr;
  ASSERT_EQ(
      cudaHostAlloc(reinterpret_cast<void**>(&pinned), rows * row_bytes, cudaHostAllocDefault),
      cudaSuccess);
  auto device = cuda_->CreateArena(arena.size(), ArenaOptions());
  ASSERT_TRUE(device.ok());
  ASSERT_TRUE((*device)->Write(0, arena.data(), arena.size()).ok());
  DeviceBuffer<uint64_t> d_arena_offsets(arena_offsets), d_host_offsets(host_offsets);
  for (bool to_host : {true, false}) {
    std::vector<uint8_t> cpu_arena = arena;
    std::vector<uint8_t> cpu_host(rows * row_bytes);
    for (size_t i = 0; i < cpu_host.size(); ++i) cpu_host[i] = static_cast<uint8_t>(i * 7);
    std::memcpy(pinned, cpu_host.data(), cpu_host.size());
    HostRowCopyJob job{
        cpu_arena.data(), cpu_host.data(), arena_offsets.data(), host_offsets.data(), rows,
        row_bytes,        to_host};
    ASSERT_TRUE(cpu_->CopyHostRows({job}, nullptr).ok());
    ASSERT_TRUE((*device)->Write(0, arena.data(), arena.size()).ok());
    job.arena = (*device)->data();
    job.host = pinned;
    job.arena_offsets = d_arena_offsets.get();
    job.host_offsets = d_host_offsets.get();
    ASSERT_TRUE(cuda_->CopyHostRows({job}, nullptr).ok());
    ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
    std::vector<uint8_t> actual_arena(arena.size());
    ASSERT_TRUE((*device)->Read(0, actual_arena.data(), actual_arena.size()).ok());
    EXPECT_EQ(actual_arena, cpu_arena) << "to_host " << to_host;
    EXPECT_EQ(std::vector<uint8_t>(pinned, pinned + cpu_host.size()), cpu_host)
        << "to_host " << to_host;
  }
  // Pageable host memory cannot be reached by the kernels: refused, naming the field.
  std::vector<uint8_t> pageable(rows * row_bytes);
  HostRowCopyJob bad{(*device)->data(),
                     pageable.data(),
                     d_arena_offsets.get(),
                     d_host_offsets.get(),
                     rows,
                     row_bytes,
                     true};
  const absl::Status status = cuda_->CopyHostRows({bad}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("host is not device-accessible"));
  cudaFreeHost(pinned);
}

TEST_F(CudaParityTest, AttentionProbsAndLogits) {
  uint32_t seed = 20;
  for (const Shape& shape : kShapes) {
    for (int group : {1, 4}) {
      Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
      DeviceLayer device(*cuda_, layer);
      std::mt19937 rng(seed);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const int q_heads = shape.heads * group;
      const int queries = 3;
      std::vector<float> q(static_cast<size_t>(q_heads) * queries * shape.dim);
      for (float& x : q) x = normal(rng);
      std::vector<int32_t> key_positions(static_cast<size_t>(shape.heads) * shape.count);
      for (size_t i = 0; i < key_positions.size(); ++i) {
        key_positions[i] = static_cast<int32_t>(i % shape.count) * 2;
      }
      // The first query sees nothing (all masked: zeros), the others part or all of the keys.
      std::vector<int32_t> query_positions = {-1, shape.count, 2 * shape.count};
      const size_t out_n = static_cast<size_t>(q_heads) * queries * shape.count;
      for (bool logits : {false, true}) {
        std::vector<float> expected(out_n, -7.0f);
        AttentionJob job{
            layer.view, key_positions.data(), 0, q.data(), query_positions.data(), q_heads, queries,
            0.125f,     expected.data()};
        ASSERT_TRUE(
            (logits ? cpu_->AttentionLogits({job}, nullptr) : cpu_->AttentionProbs({job}, nullptr))
                .ok());
        DeviceBuffer<float> d_out(out_n, -7.0f);
        const DeviceAttentionJob on_device(job, device, d_out.get());
        ASSERT_TRUE((logits ? cuda_->AttentionLogits({on_device.job()}, nullptr)
                            : cuda_->AttentionProbs({on_device.job()}, nullptr))
                        .ok());
        ExpectClose(d_out.ToHost(), expected, logits ? 1e-4f : 1e-6f,
                    std::string(logits ? "logits " : "probs ") +
                        std::string(DTypeName(shape.dtype)) + " group " + std::to_string(group));
      }
    }
  }
}

TEST_F(CudaParityTest, AttentionColumnSums) {
  uint32_t seed = 30;
  for (const Shape& shape : kShapes) {
    for (int group : {1, 4}) {
      Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
      DeviceLayer device(*cuda_, layer);
      std::mt19937 rng(seed);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const int q_heads = shape.heads * group;
      const int queries = 5;
      std::vector<float> q(static_cast<size_t>(q_heads) * queries * shape.dim);
      for (float& x : q) x = normal(rng);
      std::vector<int32_t> key_positions(static_cast<size_t>(shape.heads) * shape.count);
      for (size_t i = 0; i < key_positions.size(); ++i) {
        key_positions[i] = static_cast<int32_t>(i % shape.count) * 2;
      }
      std::vector<int32_t> query_positions = {-1, shape.count / 2, shape.count, 2 * shape.count,
                                              2 * shape.count + 1};
      ExpectColumnSumsMatch(
          AttentionJob{layer.view, key_positions.data(), 0, q.data(), query_positions.data(),
                       q_heads, queries, 0.125f, nullptr},
          device, std::string(DTypeName(shape.dtype)) + " group " + std::to_string(group));
    }
  }
}

// Logits of large queries are sums of terms that largely cancel: two fp32 sums in different
// orders differ by up to ~1e-7 of the sum of the terms' magnitudes (the CPU's own AVX2 and scalar
// kernels do too), so each logit is held to 1e-6 of that sum (and 1e-4 at least). `host` is the
// job as the CPU ran it, over `layer`'s keys.
void ExpectLogitsWithinRounding(const Layer& layer, const AttentionJob& host,
                                const std::vector<float>& actual,
                                const std::vector<float>& expected, const std::string& what) {
  const PagedLayerView& v = layer.view;
  const int group = host.num_q_heads / v.num_kv_heads;
  const uint64_t row_bytes = static_cast<uint64_t>(v.head_dim) * DTypeBytes(v.dtype);
  for (int qh = 0; qh < host.num_q_heads; ++qh) {
    for (int qi = 0; qi < host.num_queries; ++qi) {
      const int64_t query_row = int64_t{qh} * host.num_queries + qi;
      const float* query = host.queries + query_row * v.head_dim;
      for (int slot = 0; slot < v.count; ++slot) {
        const size_t i = static_cast<size_t>(query_row * v.count + slot);
        const uint8_t* key =
            layer.bytes.data() + layer.table[slot / v.block_tokens] * v.block_bytes +
            (uint64_t(qh / group) * v.block_tokens + slot % v.block_tokens) * row_bytes;
        double magnitude = 0.0;
        for (int d = 0; d < v.head_dim; ++d) {
          magnitude += std::fabs(query[d] * LoadAsFloat(key, v.dtype, d));
        }
        if (std::isinf(expected[i])) {
          EXPECT_EQ(actual[i], expected[i]) << what << " index " << i;
        } else {
          EXPECT_NEAR(actual[i], expected[i], std::max(1e-4, 1e-6 * host.scale * magnitude))
              << what << " index " << i;
        }
      }
    }
  }
}

// The tiled tensor-core path (fp16/bf16 keys, head_dim a multiple of 16): several key tiles,
// blocks of key tiles and row tiles per head, a ragged last tile, partly and fully masked rows,
// and a query head whose queries no fp16 part can hold (that tile falls back to fp32 dot
// products; bf16 parts hold them). Probabilities, logits and column sums against the CPU.
TEST_F(CudaParityTest, TiledAttentionAcrossTilesRowsAndQueryRanges) {
  const Shape shapes[] = {{DType::kFloat16, 2, 1100, 128, 16},
                          {DType::kBFloat16, 2, 1100, 128, 16},
                          {DType::kFloat16, 1, 600, 256, 32},
                          {DType::kBFloat16, 3, 70, 16, 8}};
  uint32_t seed = 40;
  for (const Shape& shape : shapes) {
    Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
    DeviceLayer device(*cuda_, layer);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int group = 4, queries = 40;  // 160 rows per kv head: three row tiles
    const int q_heads = shape.heads * group;
    std::vector<float> q(static_cast<size_t>(q_heads) * queries * shape.dim);
    for (float& x : q) x = normal(rng);
    std::vector<int32_t> key_positions(static_cast<size_t>(shape.heads) * shape.count);
    for (size_t i = 0; i < key_positions.size(); ++i) {
      key_positions[i] = static_cast<int32_t>(i % shape.count);
    }
    std::vector<int32_t> query_positions(queries);
    for (int i = 0; i < queries; ++i) {
      query_positions[i] = i == 0 ? -1 : shape.count - 1 - (queries - 1 - i) * 13;
    }
    const size_t out_n = static_cast<size_t>(q_heads) * queries * shape.count;
    for (bool large : {false, true}) {
      std::vector<float> scaled = q;
      if (large) {  // the last query head's queries beyond what an fp16 part holds
        for (size_t i = static_cast<size_t>(q_heads - 1) * queries * shape.dim; i < q.size(); ++i) {
          scaled[i] *= 40000.0f;
        }
      }
      const std::string what = std::string(DTypeName(shape.dtype)) + " dim " +
                               std::to_string(shape.dim) + (large ? " large queries" : "");
      // Probabilities of softmaxes this peaked are compared where they are moderate only.
      for (bool logits : {true, false}) {
        if (large && !logits) continue;
        std::vector<float> expected(out_n, -7.0f);
        AttentionJob job{layer.view,
                         key_positions.data(),
                         0,
                         scaled.data(),
                         query_positions.data(),
                         q_heads,
                         queries,
                         0.125f,
                         expected.data()};
        ASSERT_TRUE(
            (logits ? cpu_->AttentionLogits({job}, nullptr) : cpu_->AttentionProbs({job}, nullptr))
                .ok());
        DeviceBuffer<float> d_out(out_n, -7.0f);
        const DeviceAttentionJob on_device(job, device, d_out.get());
        ASSERT_TRUE((logits ? cuda_->AttentionLogits({on_device.job()}, nullptr)
                            : cuda_->AttentionProbs({on_device.job()}, nullptr))
                        .ok());
        if (large) {
          ExpectLogitsWithinRounding(layer, job, d_out.ToHost(), expected, "logits " + what);
        } else {
          ExpectClose(d_out.ToHost(), expected, logits ? 1e-4f : 1e-6f,
                      (logits ? "logits " : "probs ") + what);
        }
      }
      if (large) continue;
      ExpectColumnSumsMatch(AttentionJob{layer.view, key_positions.data(), 0, scaled.data(),
                                         query_positions.data(), q_heads, queries, 0.125f, nullptr},
                            device, what);
    }
  }
}

TEST_F(CudaParityTest, PoolScores) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (const int32_t count : {1, 7, 130, 4099}) {
    for (const int32_t kernel : {1, 5, 7}) {
      for (const PoolKind kind : {PoolKind::kAvg, PoolKind::kMax}) {
        const int32_t heads = 2, rows = 8;
        std::vector<float> in(static_cast<size_t>(rows) * count);
        for (float& v : in) v = uniform(rng);
        std::vector<int32_t> order(static_cast<size_t>(heads) * count), lengths(heads);
        for (int32_t h = 0; h < heads; ++h) {
          std::vector<int32_t> slots(count);
          std::iota(slots.begin(), slots.end(), 0);
          std::shuffle(slots.begin(), slots.end(), rng);
          lengths[h] = h == 0 ? count : count / 2;
          std::copy(slots.begin(), slots.end(), order.begin() + int64_t{h} * count);
        }
        std::vector<float> expected(in.size(), -1.0f);
        PoolJob job{in.data(), order.data(), lengths.data(), rows,           heads,
                    count,     kernel,       kind,           expected.data()};
        ASSERT_TRUE(cpu_->PoolScores({job}, nullptr).ok());
        DeviceBuffer<float> d_in(in), d_out(in.size(), -2.0f);
        DeviceBuffer<int32_t> d_order(order), d_lengths(lengths);
        job.in = d_in.get();
        job.order = d_order.get();
        job.lengths = d_lengths.get();
        job.out = d_out.get();
        ASSERT_TRUE(cuda_->PoolScores({job}, nullptr).ok());
        // The CPU backend's order of sums and comparisons, rounded once.
        ExpectClose(d_out.ToHost(), expected, 0.0f, "pooled count " + std::to_string(count));
      }
    }
  }
}

TEST_F(CudaParityTest, CaoteScores) {
  uint32_t seed = 40;
  for (const Shape& shape : kShapes) {
    Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++);
    DeviceLayer device(*cuda_, layer);
    PagedLayerView host_values = layer.view, device_values = device.view;
    host_values.kv_index = device_values.kv_index = 1;
    const int rows = shape.heads * 2;
    std::mt19937 rng(seed);
    std::vector<float> alpha(static_cast<size_t>(rows) * shape.count);
    for (int r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int s = 0; s < shape.count; ++s) {
        const float a = (rng() % 5 == 0) ? 0.0f : static_cast<float>(rng() % 1000) + 1.0f;
        alpha[r * shape.count + s] = a;
        sum += a;
      }
      for (int s = 0; s < shape.count; ++s) {
        alpha[r * shape.count + s] = sum > 0 ? alpha[r * shape.count + s] / sum : 0.0f;
      }
    }
    if (shape.count > 1) {  // one row holds almost all the mass: +inf
      for (int s = 0; s < shape.count; ++s) alpha[s] = s == 0 ? 1.0f : 0.0f;
    }
    for (bool fast : {false, true}) {
      std::vector<float> expected(alpha.size(), -3.0f);
      CaoteJob job{host_values, alpha.data(), rows, fast, 1e-6f, expected.data()};
      ASSERT_TRUE(cpu_->CaoteScores({job}, nullptr).ok());
      DeviceBuffer<float> d_alpha(alpha), d_scores(alpha.size(), -3.0f);
      job.values = device_values;
      job.alpha = d_alpha.get();
      job.scores = d_scores.get();
      ASSERT_TRUE(cuda_->CaoteScores({job}, nullptr).ok());
      ExpectClose(d_scores.ToHost(), expected, 1e-5f,
                  std::string("caote ") + std::string(DTypeName(shape.dtype)) +
                      (fast ? " fast" : " exact"));
    }
  }
}

TEST_F(CudaParityTest, NearestKeysPickTheSameTargetsWithTies) {
  uint32_t seed = 60;
  for (const Shape& shape : kShapes) {
    if (shape.count < 4) continue;
    // Few distinct rows: many candidates tie exactly; the lowest position must win on both.
    Layer layer(shape.heads, shape.count, shape.dim, shape.block_tokens, shape.dtype, seed++,
                /*distinct_values=*/5);
    DeviceLayer device(*cuda_, layer);
    std::vector<int32_t> query_slots, candidate_slots, candidate_positions;
    std::mt19937 rng(seed);
    for (int s = 0; s < shape.count; ++s) {
      (s % 3 == 0 ? query_slots : candidate_slots).push_back(s);
    }
    candidate_positions.resize(candidate_slots.size());
    std::iota(candidate_positions.begin(), candidate_positions.end(), 0);
    std::shuffle(candidate_positions.begin(), candidate_positions.end(), rng);
    const int q = static_cast<int>(query_slots.size());
    const int c = static_cast<int>(candidate_slots.size());
    for (int head = 0; head < shape.heads; ++head) {
      std::vector<float> expected_similarity(q, -9.0f);
      std::vector<int32_t> expected_target(q, -9);
      NearestKeyJob job{layer.view,
                        head,
                        query_slots.data(),
                        q,
                        candidate_slots.data(),
                        candidate_positions.data(),
                        c,
                        expected_similarity.data(),
                        expected_target.data()};
      ASSERT_TRUE(cpu_->NearestKeys({job}, nullptr).ok());
      DeviceBuffer<int32_t> d_queries(query_slots), d_candidates(candidate_slots),
          d_positions(candidate_positions), d_target(q, -9);
      DeviceBuffer<float> d_similarity(q, -9.0f);
      job.keys = device.view;
      job.query_slots = d_queries.get();
      job.candidate_slots = d_candidates.get();
      job.candidate_positions = d_positions.get();
      job.similarity = d_similarity.get();
      job.target = d_target.get();
      ASSERT_TRUE(cuda_->NearestKeys({job}, nullptr).ok());
      EXPECT_EQ(d_target.ToHost(), expected_target) << DTypeName(shape.dtype) << " head " << head;
      ExpectClose(d_similarity.ToHost(), expected_similarity, 1e-5f, "similarity");
    }
  }
}

// Jobs of at least 64 queries (a prefill's evicted tokens) take the tiled kernel, smaller ones one
// block per query: both give the same targets and bit-equal similarities, over candidate counts
// that do not fill the last tile, and agree with the host up to near-ties.
TEST_F(CudaParityTest, NearestKeysTiledKernelMatchesTheKernelOfOneBlockPerQuery) {
  struct Case {
    DType dtype;
    int dim;
  };
  uint32_t seed = 80;
  for (const Case& c : {Case{DType::kFloat16, 128}, Case{DType::kBFloat16, 64},
                        Case{DType::kFloat32, 40}, Case{DType::kFloat16, 6}}) {
    const int count = 1500;
    Layer layer(2, count, c.dim, 16, c.dtype, seed++);
    DeviceLayer device(*cuda_, layer);
    std::vector<int32_t> query_slots, candidate_slots;
    for (int s = 0; s < count; ++s) (s % 4 == 0 ? query_slots : candidate_slots).push_back(s);
    std::vector<int32_t> positions(candidate_slots.size());
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), std::mt19937(seed));
    const int q = static_cast<int>(query_slots.size());  // 375: tiled
    const int n = static_cast<int>(candidate_slots.size());
    DeviceBuffer<int32_t> d_queries(query_slots), d_candidates(candidate_slots),
        d_positions(positions), d_tiled_target(q, -9), d_split_target(q, -9);
    DeviceBuffer<float> d_tiled(q, -9.0f), d_split(q, -9.0f);
    const int head = 1;
    NearestKeyJob tiled{
        device.view, head,          d_queries.get(),     q, d_candidates.get(), d_positions.get(),
        n,           d_tiled.get(), d_tiled_target.get()};
    ASSERT_TRUE(cuda_->NearestKeys({tiled}, nullptr).ok());
    std::vector<NearestKeyJob> split;  // jobs of at most 47 queries
    for (int first = 0; first < q; first += 47) {
      NearestKeyJob job = tiled;
      job.query_slots = d_queries.get() + first;
      job.num_queries = std::min(47, q - first);
      job.similarity = d_split.get() + first;
      job.target = d_split_target.get() + first;
      split.push_back(job);
    }
    ASSERT_TRUE(cuda_->NearestKeys(split, nullptr).ok());
    ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
    const std::vector<int32_t> target = d_tiled_target.ToHost();
    const std::vector<float> similarity = d_tiled.ToHost();
    EXPECT_EQ(target, d_split_target.ToHost()) << DTypeName(c.dtype) << " dim " << c.dim;
    EXPECT_EQ(similarity, d_split.ToHost()) << DTypeName(c.dtype) << " dim " << c.dim;
    std::vector<float> host_similarity(q);
    std::vector<int32_t> host_target(q);
    NearestKeyJob host{layer.view,
                       head,
                       query_slots.data(),
                       q,
                       candidate_slots.data(),
                       positions.data(),
                       n,
                       host_similarity.data(),
                       host_target.data()};
    ASSERT_TRUE(cpu_->NearestKeys({host}, nullptr).ok());
    int differ = 0;
    for (int e = 0; e < q; ++e) {
      ASSERT_NEAR(similarity[e], host_similarity[e], 1e-5f) << e;
      differ += target[e] != host_target[e];
    }
    EXPECT_LE(differ, 2) << "targets other than the host's beyond near-ties";
  }
}

TEST_F(CudaParityTest, MergeRowsBitIdenticalWithDstAmongSources) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    const int elements = 40;
    const uint64_t row_bytes = elements * DTypeBytes(dtype);
    std::mt19937 rng(static_cast<uint32_t>(dtype));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint8_t> arena(16 * row_bytes);
    for (uint64_t i = 0; i < arena.size() / DTypeBytes(dtype); ++i) {
      StoreFromFloat(arena.data(), dtype, i, normal(rng));
    }
    // Job 0 merges rows 1, 2, 3 into row 1 and rows 10, 11 into row 12; job 1 rows 5, 6 into 8.
    MergeRowsCsr first, second;
    first.Add(row_bytes, {row_bytes, 2 * row_bytes, 3 * row_bytes}, {0.5f, 0.25f, 0.25f});
    first.Add(12 * row_bytes, {10 * row_bytes, 11 * row_bytes}, {0.125f, 2.0f});
    second.Add(8 * row_bytes, {5 * row_bytes, 6 * row_bytes}, {0.75f, 0.25f});
    std::vector<uint8_t> expected = arena;
    ASSERT_TRUE(cpu_->MergeRows({first.Job(expected.data(), dtype, elements),
                                 second.Job(expected.data(), dtype, elements)},
                                nullptr)
                    .ok());
    auto device = cuda_->CreateArena(arena.size(), ArenaOptions());
    ASSERT_TRUE(device.ok());
    ASSERT_TRUE((*device)->Write(0, arena.data(), arena.size()).ok());
    std::vector<RowMergeJob> jobs;
    std::deque<DeviceBuffer<uint64_t>> offsets;  // deques: buffers that never move
    std::deque<DeviceBuffer<int64_t>> starts;
    std::deque<DeviceBuffer<float>> weights;
    for (const MergeRowsCsr* csr : {&first, &second}) {
      RowMergeJob& job = jobs.emplace_back(csr->Job((*device)->data(), dtype, elements));
      job.dst_offsets = offsets.emplace_back(csr->dst).get();
      job.src_offsets = offsets.emplace_back(csr->src).get();
      job.source_starts = starts.emplace_back(csr->starts).get();
      job.weights = weights.emplace_back(csr->weights).get();
    }
    ASSERT_TRUE(cuda_->MergeRows(jobs, nullptr).ok());
    ASSERT_TRUE(cuda_->Synchronize(nullptr).ok());
    std::vector<uint8_t> actual(arena.size());
    ASSERT_TRUE((*device)->Read(0, actual.data(), actual.size()).ok());
    EXPECT_EQ(actual, expected) << DTypeName(dtype);
    // A row without a source (its start not above the previous) is refused; nothing moves.
    const std::vector<int64_t> flat = {0, 3, 3};
    DeviceBuffer<int64_t> d_flat(flat);
    jobs[0].source_starts = d_flat.get();
    const absl::Status status = cuda_->MergeRows(jobs, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("row merge job 0: source_starts[2]"));
    ASSERT_TRUE((*device)->Read(0, actual.data(), actual.size()).ok());
    EXPECT_EQ(actual, expected) << DTypeName(dtype);
  }
}

TEST_F(CudaParityTest, ArenaIsExportedThroughCudaIpc) {
  auto first = cuda_->CreateArena(1 << 20, ArenaOptions());
  auto second = cuda_->CreateArena(4096, ArenaOptions());
  ASSERT_TRUE(first.ok() && second.ok());
  const ArenaHandle& handle = (*first)->handle();
  EXPECT_EQ(handle.kind, ArenaHandle::Kind::kCudaIpc);
  EXPECT_EQ(handle.cuda_ipc_handle.size(), 64u);
  EXPECT_EQ(handle.cuda_device, 0);
  EXPECT_THAT(handle.cuda_device_uuid, ::testing::StartsWith("GPU-"));
  EXPECT_EQ(handle.size_bytes, 1u << 20);
  EXPECT_GT((*second)->handle().generation, handle.generation);
  std::vector<uint8_t> zeros(64, 1), data(64);
  ASSERT_TRUE((*first)->Read(0, zeros.data(), zeros.size()).ok());
  EXPECT_EQ(zeros, std::vector<uint8_t>(64, 0));  // a new arena reads as zeros
  std::iota(data.begin(), data.end(), 0);
  ASSERT_TRUE((*first)->Write((1 << 20) - 64, data.data(), data.size()).ok());
  std::vector<uint8_t> back(64);
  ASSERT_TRUE((*first)->Read((1 << 20) - 64, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ((*first)->Write((1 << 20) - 63, data.data(), 64).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cuda_->CreateArena(0, ArenaOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The device arena's block copies (a spill's and a restore's) against the CPU arena's default
// run-by-run copies on the same bytes: a few runs (one transfer each), many shuffled blocks
// across more than one 64 MiB scratch piece, into pageable and page-locked host memory; a block
// outside the arena refuses the call before anything moves.
TEST_F(CudaParityTest, ArenaBlockCopiesMatchTheCpuArena) {
  constexpr uint64_t kBlock = uint64_t{256} << 10;
  constexpr uint64_t kBlocks = 320;  // 80 MiB
  auto device = cuda_->CreateArena(kBlocks * kBlock, ArenaOptions());
  auto host = cpu_->CreateArena(kBlocks * kBlock, ArenaOptions());
  ASSERT_TRUE(device.ok() && host.ok());
  std::vector<uint8_t> fill(kBlocks * kBlock);
  std::mt19937_64 rng(11);
  for (size_t i = 0; i < fill.size(); i += 8) {
    const uint64_t word = rng();
    std::memcpy(fill.data() + i, &word, 8);
  }
  ASSERT_TRUE((*device)->Write(0, fill.data(), fill.size()).ok());
  ASSERT_TRUE((*host)->Write(0, fill.data(), fill.size()).ok());
  std::vector<uint64_t> order(kBlocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const std::vector<std::vector<uint64_t>> cases = {
      {7, 8, 9, 30, 2},                                      // three runs
      std::vector<uint64_t>(order.begin(), order.begin() + 300),  // 75 MiB, two pieces
      std::vector<uint64_t>(order.begin() + 300, order.end()),    // one piece
  };
  for (bool pinned : {false, true}) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const std::string what = absl::StrCat("case ", c, pinned ? " page-locked" : " pageable");
      std::vector<uint64_t> offsets;
      for (uint64_t b : cases[c]) offsets.push_back(b * kBlock);
      std::vector<uint8_t> expected(offsets.size() * kBlock), actual(offsets.size() * kBlock, 1);
      ASSERT_TRUE((*host)->ReadBlocks(offsets, kBlock, expected.data()).ok()) << what;
      if (pinned) {
        ASSERT_TRUE(cuda_->PinHostMemory(actual.data(), actual.size())) << what;
      }
      ASSERT_TRUE((*device)->ReadBlocks(offsets, kBlock, actual.data()).ok()) << what;
      EXPECT_TRUE(actual == expected) << what << ": ReadBlocks differs";
      // Written back to the blocks in reverse order, on both arenas.
      std::vector<uint64_t> reversed(offsets.rbegin(), offsets.rend());
      ASSERT_TRUE((*host)->WriteBlocks(reversed, kBlock, expected.data()).ok()) << what;
      ASSERT_TRUE((*device)->WriteBlocks(reversed, kBlock, actual.data()).ok()) << what;
      if (pinned) cuda_->UnpinHostMemory(actual.data());
      std::vector<uint8_t> device_all(fill.size()), host_all(fill.size());
      ASSERT_TRUE((*device)->Read(0, device_all.data(), device_all.size()).ok());
      ASSERT_TRUE((*host)->Read(0, host_all.data(), host_all.size()).ok());
      EXPECT_TRUE(device_all == host_all) << what << ": WriteBlocks differs";
    }
  }
  std::vector<uint8_t> before(fill.size()), after(fill.size()), ones(4 * kBlock, 1);
  ASSERT_TRUE((*device)->Read(0, before.data(), before.size()).ok());
  const std::vector<uint64_t> bad = {0, 3 * kBlock, 5 * kBlock, 9 * kBlock, 11 * kBlock,
                                     13 * kBlock, 15 * kBlock, 17 * kBlock, 19 * kBlock,
                                     kBlocks * kBlock - 4};
  std::vector<uint8_t> big(bad.size() * kBlock, 1);
  EXPECT_EQ((*device)->WriteBlocks(bad, kBlock, big.data()).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*device)->Read(0, after.data(), after.size()).ok());
  EXPECT_TRUE(after == before) << "a refused block write must change nothing";
  EXPECT_EQ((*device)->ReadBlocks({0}, kBlock, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda_->healthy());
}

TEST_F(CudaParityTest, InvalidJobsGetTheCpuMessagesAndLaunchNothing) {
  std::vector<float> scores(4, 1.0f);
  std::vector<int32_t> positions = {0, 1, 2, 3};
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<int32_t> d_positions(positions), d_kept(4, -1);
  TopKJob job{d_scores.get(), d_positions.get(), nullptr, 1, 4, 5, d_kept.get()};
  const absl::Status cuda_status = cuda_->TopK({job}, nullptr);
  TopKJob host_job{scores.data(), positions.data(), nullptr, 1, 4, 5, nullptr};
  const absl::Status cpu_status = cpu_->TopK({host_job}, nullptr);
  EXPECT_EQ(cuda_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_status.message(), cpu_status.message());
  EXPECT_EQ(d_kept.ToHost(), std::vector<int32_t>(4, -1));
  // Pageable host memory where device memory is required: refused, naming the field.
  job.k = 2;
  job.scores = scores.data();
  const absl::Status host_pointer = cuda_->TopK({job}, nullptr);
  EXPECT_EQ(host_pointer.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(host_pointer.message()), HasSubstr("scores is not device-accessible"));
  EXPECT_TRUE(cuda_->healthy());
}

// Runs on every CUDA build, with or without a device: probing never aborts, and the factory and
// backend constructor answer with statuses.
TEST(CudaBuildTest, ProbeAndFactoryAnswerWithoutAborting) {
  EXPECT_TRUE(CudaBuilt());
  std::string why;
  const int devices = CudaDeviceCount(&why);
  EXPECT_EQ(ProbeCuda().devices, devices);
  auto backend = MakeBackend(BackendKind::kCuda);
  if (devices == 0) {
    EXPECT_FALSE(why.empty());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(backend.status().message()), HasSubstr("no CUDA device"));
  } else {
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->name(), "cuda");
    EXPECT_TRUE((*backend)->healthy());
  }
  auto cpu = MakeBackend(BackendKind::kCpu, 1);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->name(), "cpu");
}

}  // namespace
}  // namespace kvs
