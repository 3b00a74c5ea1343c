// The staging decorator (gpu/staging_backend.h) over the simulated device
// (gpu/sim/simulated_device.h) against the plain CPU backend: for every Backend method, random
// jobs over host arrays (fp16/bf16/fp32, head_dim a multiple of 8 or not, partial blocks, GQA,
// multi-job calls with a zero-work job) give bit-identical results (the simulated device runs the
// CPU kernels on translated pointers, so any difference is a staging error: a wrong size, offset,
// field or copy). Invalid jobs get the CPU backend's message and write nothing; a host arena is
// refused; a call without work allocates nothing; a call stages with one allocation, one upload
// and one download; device-resident arrays pass through.
#include "gpu/staging_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/sim/simulated_device.h"
#include "gtest/gtest.h"
#include "tests/gpu/merge_rows_csr.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kArenaBytes = uint64_t{2} << 20;

template <typename T>
void ExpectBitEqual(const std::vector<T>& staged, const std::vector<T>& cpu, const char* what) {
  ASSERT_EQ(staged.size(), cpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::memcmp(&staged[i], &cpu[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << " differs first at index " << i << ": staged " << staged[i]
                    << ", cpu " << cpu[i];
      return;
    }
  }
}

struct Shape {
  int heads, count, dim, block_tokens;
};
// head_dim a multiple of 8 (SIMD paths) or not, partial last blocks, one slot, a zero-count job.
const Shape kShapes[] = {{2, 37, 64, 16},  {3, 100, 24, 8}, {1, 1, 8, 4},
                         {2, 257, 40, 32}, {4, 0, 16, 16},  {2, 45, 10, 4}};

// A paged view of `shape` over an arena of kArenaBytes with a random table of distinct blocks.
struct Layer {
  std::vector<int32_t> table;
  PagedLayerView view;

  Layer(const Shape& shape, DType dtype, uint32_t seed) {
    view.count = shape.count;
    view.num_kv_heads = shape.heads;
    view.head_dim = shape.dim;
    view.block_tokens = shape.block_tokens;
    view.dtype = dtype;
    view.block_bytes = 2ull * shape.heads * shape.block_tokens * shape.dim * DTypeBytes(dtype);
    const int total = static_cast<int>(kArenaBytes / view.block_bytes);
    const int used = (shape.count + shape.block_tokens - 1) / shape.block_tokens;
    std::vector<int32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
    table.assign(ids.begin(), ids.begin() + used);
    view.block_table = table.data();
  }
  PagedLayerView On(uint8_t* arena, int kv_index = 0) const {
    PagedLayerView v = view;
    v.arena = arena;
    v.block_table = table.data();
    v.kv_index = kv_index;
    return v;
  }
};

std::vector<float> RandomFloats(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

class StagingTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    cpu_ = MakeCpuBackend(2);
    SimulatedDevice sim = MakeSimulatedDevice(2);
    memory_ = sim.memory.get();
    control_ = sim.control;
    staged_ = MakeStagingBackend(std::move(sim.backend), std::move(sim.memory));
    ArenaOptions options;
    options.name_prefix = "kvs-staging-test";
    auto cpu_arena = cpu_->CreateArena(kArenaBytes, options);
    ASSERT_TRUE(cpu_arena.ok()) << cpu_arena.status();
    cpu_arena_ = *std::move(cpu_arena);
    auto dev_arena = staged_->CreateArena(kArenaBytes, options);
    ASSERT_TRUE(dev_arena.ok()) << dev_arena.status();
    dev_arena_ = *std::move(dev_arena);
    // The same random elements of the test's dtype in both arenas.
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint8_t> bytes(kArenaBytes);
    for (uint64_t i = 0; i < kArenaBytes / DTypeBytes(dtype()); ++i) {
      StoreFromFloat(bytes.data(), dtype(), i, normal(rng));
    }
    ASSERT_TRUE(cpu_arena_->Write(0, bytes.data(), bytes.size()).ok());
    ASSERT_TRUE(dev_arena_->Write(0, bytes.data(), bytes.size()).ok());
  }

  DType dtype() const { return GetParam(); }
  uint8_t* cpu_base() { return cpu_arena_->data(); }
  uint8_t* dev_base() { return dev_arena_->data(); }

  std::vector<uint8_t> ArenaBytes(const Arena& arena) {
    std::vector<uint8_t> out(kArenaBytes);
    EXPECT_TRUE(arena.Read(0, out.data(), out.size()).ok());
    return out;
  }
  void ExpectArenasEqual() {
    const std::vector<uint8_t> cpu = ArenaBytes(*cpu_arena_), dev = ArenaBytes(*dev_arena_);
    EXPECT_TRUE(cpu == dev) << "arena contents differ";
  }

  std::vector<Layer> Layers(uint32_t seed) {
    std::vector<Layer> layers;
    for (const Shape& shape : kShapes) layers.emplace_back(shape, dtype(), seed++);
    return layers;
  }

  std::unique_ptr<Backend> cpu_;
  std::unique_ptr<Backend> staged_;
  DeviceMemory* memory_ = nullptr;  // owned by staged_
  std::shared_ptr<SimulatedDeviceControl> control_;
  std::unique_ptr<Arena> cpu_arena_, dev_arena_;
};

TEST_P(StagingTest, NameAndArenaComeFromTheDevice) {
  EXPECT_EQ(staged_->name(), "device-sim");
  EXPECT_TRUE(staged_->healthy());
  EXPECT_TRUE(memory_->IsDeviceAccessible(dev_base()));
  EXPECT_TRUE(memory_->IsDeviceAccessible(dev_base() + kArenaBytes - 1));
  EXPECT_FALSE(memory_->IsDeviceAccessible(dev_base() + kArenaBytes));
  EXPECT_FALSE(memory_->IsDeviceAccessible(cpu_base()));
  EXPECT_EQ(dev_arena_->handle().kind, ArenaHandle::Kind::kMemfd);
  EXPECT_TRUE(dev_arena_->handle().shm_path.empty());
  EXPECT_TRUE(staged_->Synchronize(nullptr).ok());
}

TEST_P(StagingTest, KeyDiffScoresBitIdentical) {
  const std::vector<Layer> layers = Layers(1);
  const KeyDiffAnchor anchors[] = {KeyDiffAnchor::kMeanNormalized, KeyDiffAnchor::kMeanRaw,
                                   KeyDiffAnchor::kMedianNormalized};
  const KeyDiffMetric metrics[] = {KeyDiffMetric::kCosine, KeyDiffMetric::kPairwise,
                                   KeyDiffMetric::kDot, KeyDiffMetric::kEuclidean};
  std::vector<std::vector<float>> cpu_out, dev_out;
  std::vector<KeyDiffScoreJob> cpu_jobs, dev_jobs;
  int combo = 0;
  for (const Layer& layer : layers) {
    for (int repeat = 0; repeat < 2; ++repeat, ++combo) {
      const size_t n = static_cast<size_t>(layer.view.num_kv_heads) * layer.view.count;
      cpu_out.emplace_back(n, -1.0f);
      dev_out.emplace_back(n, -2.0f);
    }
  }
  combo = 0;
  size_t out = 0;
  for (const Layer& layer : layers) {
    for (int repeat = 0; repeat < 2; ++repeat, ++combo, ++out) {
      KeyDiffScoreJob job;
      job.anchor = anchors[combo % 3];
      job.metric = metrics[combo % 4];
      job.keys = layer.On(cpu_base());
      job.scores = cpu_out[out].data();
      cpu_jobs.push_back(job);
      job.keys = layer.On(dev_base());
      job.scores = dev_out[out].data();
      dev_jobs.push_back(job);
    }
  }
  ASSERT_TRUE(cpu_->KeyDiffScores(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->KeyDiffScores(dev_jobs, nullptr).ok());
  for (size_t i = 0; i < cpu_out.size(); ++i) ExpectBitEqual(dev_out[i], cpu_out[i], "scores");
}

// The finiteness check with row_norms (what a KNorm commit asks for): the staged call writes the
// same verdicts and the same norms, downloaded into the host arrays, as the CPU backend.
TEST_P(StagingTest, FindNonFiniteRowNormsBitIdentical) {
  constexpr int kDim = 64;
  const uint64_t row_bytes = static_cast<uint64_t>(kDim) * DTypeBytes(dtype());
  std::vector<uint64_t> offsets;
  for (uint64_t at = 0; at + row_bytes <= kArenaBytes && offsets.size() < 300;
       at += 3 * row_bytes) {
    offsets.push_back(at);
  }
  std::vector<float> cpu_norms(offsets.size(), -1.0f), dev_norms(offsets.size(), -2.0f);
  int64_t cpu_first = 7, dev_first = 8;
  FiniteCheckJob job;
  job.row_offsets = offsets.data();
  job.count = static_cast<int64_t>(offsets.size());
  job.row_elements = kDim;
  job.dtype = dtype();
  job.arena = cpu_base();
  job.first_non_finite = &cpu_first;
  job.row_norms = cpu_norms.data();
  ASSERT_TRUE(cpu_->FindNonFinite({job}, nullptr).ok());
  job.arena = dev_base();
  job.first_non_finite = &dev_first;
  job.row_norms = dev_norms.data();
  ASSERT_TRUE(staged_->FindNonFinite({job}, nullptr).ok());
  ASSERT_TRUE(staged_->Synchronize(nullptr).ok());
  EXPECT_EQ(cpu_first, -1);
  EXPECT_EQ(dev_first, -1);
  ExpectBitEqual(dev_norms, cpu_norms, "row_norms");
}

TEST_P(StagingTest, TopKBitIdenticalWithTiesNanAndForced) {
  struct Spec {
    int rows, n, k;
    bool forced;
  };
  const Spec specs[] = {{3, 50, 10, true},
                        {2, 17, 0, false},
                        {0, 9, 3, false},
                        {4, 1000, 100, true},
                        {1, 5, 5, false}};
  std::mt19937 rng(3);
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<int32_t>> positions;
  std::vector<std::vector<uint8_t>> forced;
  std::vector<std::vector<int32_t>> cpu_kept, dev_kept;
  std::vector<TopKJob> cpu_jobs, dev_jobs;
  for (const Spec& spec : specs) {
    const size_t slots = static_cast<size_t>(spec.rows) * spec.n;
    std::vector<float> s = RandomFloats(slots, rng);
    for (size_t i = 0; i < slots; i += 7) s[i] = 0.5f;  // ties
    for (size_t i = 3; i < slots; i += 29) s[i] = std::numeric_limits<float>::quiet_NaN();
    scores.push_back(s);
    std::vector<int32_t> p(slots);
    for (int r = 0; r < spec.rows; ++r) {
      std::vector<int32_t> row(spec.n);
      std::iota(row.begin(), row.end(), 100);
      std::shuffle(row.begin(), row.end(), rng);
      std::copy(row.begin(), row.end(), p.begin() + static_cast<size_t>(r) * spec.n);
    }
    positions.push_back(p);
    std::vector<uint8_t> f(slots, 0);
    if (spec.forced) {
      for (int r = 0; r < spec.rows; ++r) f[static_cast<size_t>(r) * spec.n + r % spec.n] = 1;
    }
    forced.push_back(f);
    cpu_kept.emplace_back(static_cast<size_t>(spec.rows) * spec.k, -1);
    dev_kept.emplace_back(static_cast<size_t>(spec.rows) * spec.k, -2);
  }
  for (size_t i = 0; i < std::size(specs); ++i) {
    TopKJob job;
    job.rows = specs[i].rows;
    job.n = specs[i].n;
    job.k = specs[i].k;
    job.scores = scores[i].data();
    job.positions = positions[i].data();
    job.forced = specs[i].forced ? forced[i].data() : nullptr;
    job.kept = cpu_kept[i].data();
    cpu_jobs.push_back(job);
    job.kept = dev_kept[i].data();
    dev_jobs.push_back(job);
  }
  ASSERT_TRUE(cpu_->TopK(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->TopK(dev_jobs, nullptr).ok());
  for (size_t i = 0; i < cpu_kept.size(); ++i) ExpectBitEqual(dev_kept[i], cpu_kept[i], "kept");
}

TEST_P(StagingTest, CopyRowsMovesTheSameBytes) {
  std::mt19937 rng(5);
  const uint64_t row_bytes = 16 * DTypeBytes(dtype());
  const uint64_t rows = kArenaBytes / row_bytes;
  std::vector<uint64_t> ids(rows);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<uint64_t> src, dst, src2, dst2;
  for (int i = 0; i < 40; ++i)
    src.push_back(ids[i] * row_bytes), dst.push_back(ids[40 + i] * row_bytes);
  // A chain inside one job (a destination is a later row's source), in order.
  src2 = {ids[100] * row_bytes, ids[101] * row_bytes};
  dst2 = {ids[101] * row_bytes, ids[102] * row_bytes};
  auto jobs_on = [&](uint8_t* base) {
    std::vector<RowCopyJob> jobs(4);
    jobs[0] = RowCopyJob{base, src.data(), dst.data(), static_cast<int64_t>(src.size()), row_bytes};
    jobs[1] = RowCopyJob{base, nullptr, nullptr, 0, row_bytes};  // no rows
    jobs[2] = RowCopyJob{base, src2.data(), dst2.data(), 2, row_bytes};
    jobs[3] = RowCopyJob{base, src.data(), dst.data(), 3, 0};  // zero-byte rows
    return jobs;
  };
  ASSERT_TRUE(cpu_->CopyRows(jobs_on(cpu_base()), nullptr).ok());
  ASSERT_TRUE(staged_->CopyRows(jobs_on(dev_base()), nullptr).ok());
  ExpectArenasEqual();
}

TEST_P(StagingTest, AttentionProbsAndLogitsBitIdentical) {
  const std::vector<Layer> layers = Layers(21);
  std::mt19937 rng(9);
  for (bool logits : {false, true}) {
    std::vector<std::vector<int32_t>> key_positions, query_positions;
    std::vector<std::vector<float>> queries, cpu_out, dev_out;
    std::vector<AttentionJob> cpu_jobs, dev_jobs;
    for (const Layer& layer : layers) {
      const PagedLayerView& v = layer.view;
      const int q_heads = v.num_kv_heads * 2, num_queries = 3;
      std::vector<int32_t> kp(static_cast<size_t>(v.num_kv_heads) * v.count);
      for (size_t i = 0; i < kp.size(); ++i) kp[i] = static_cast<int32_t>(i % std::max(1, v.count));
      key_positions.push_back(kp);
      query_positions.push_back({v.count / 3, v.count - 1, v.count + 5});  // masks some slots
      queries.push_back(RandomFloats(static_cast<size_t>(q_heads) * num_queries * v.head_dim, rng));
      const size_t probs = static_cast<size_t>(q_heads) * num_queries * v.count;
      cpu_out.emplace_back(probs, -1.0f);
      dev_out.emplace_back(probs, -2.0f);
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      AttentionJob job;
      job.num_q_heads = layers[i].view.num_kv_heads * 2;
      job.num_queries = 3;
      job.scale = 0.125f;
      job.key_positions = key_positions[i].data();
      job.queries = queries[i].data();
      job.query_positions = query_positions[i].data();
      job.keys = layers[i].On(cpu_base());
      job.probs = cpu_out[i].data();
      cpu_jobs.push_back(job);
      job.keys = layers[i].On(dev_base());
      job.probs = dev_out[i].data();
      dev_jobs.push_back(job);
    }
    if (logits) {
      ASSERT_TRUE(cpu_->AttentionLogits(cpu_jobs, nullptr).ok());
      ASSERT_TRUE(staged_->AttentionLogits(dev_jobs, nullptr).ok());
    } else {
      ASSERT_TRUE(cpu_->AttentionProbs(cpu_jobs, nullptr).ok());
      ASSERT_TRUE(staged_->AttentionProbs(dev_jobs, nullptr).ok());
    }
    for (size_t i = 0; i < cpu_out.size(); ++i) {
      ExpectBitEqual(dev_out[i], cpu_out[i], logits ? "logits" : "probs");
    }
  }
}

TEST_P(StagingTest, AttentionColumnSumsMatchCpu) {
  // The window vote through the staged device against the CPU backend's fused kernel: the device
  // sums probabilities it computed itself, so agreement is to fp32 rounding, not to the bit.
  const std::vector<Layer> layers = Layers(23);
  std::mt19937 rng(10);
  std::vector<std::vector<int32_t>> key_positions, query_positions;
  std::vector<std::vector<float>> queries, cpu_out, dev_out;
  std::vector<AttentionSumsJob> cpu_jobs, dev_jobs;
  const int num_queries = 9;
  for (const Layer& layer : layers) {
    const PagedLayerView& v = layer.view;
    const int q_heads = v.num_kv_heads * 3;
    std::vector<int32_t> kp(static_cast<size_t>(v.num_kv_heads) * v.count);
    for (size_t i = 0; i < kp.size(); ++i) kp[i] = static_cast<int32_t>(i % std::max(1, v.count));
    key_positions.push_back(kp);
    std::vector<int32_t> qp;
    for (int i = 0; i < num_queries; ++i) qp.push_back(v.count * i / num_queries);
    query_positions.push_back(qp);
    queries.push_back(RandomFloats(static_cast<size_t>(q_heads) * num_queries * v.head_dim, rng));
    cpu_out.emplace_back(static_cast<size_t>(q_heads) * v.count, -1.0f);
    dev_out.emplace_back(static_cast<size_t>(q_heads) * v.count, -2.0f);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    AttentionSumsJob job;
    job.attention.num_q_heads = layers[i].view.num_kv_heads * 3;
    job.attention.num_queries = num_queries;
    job.attention.scale = 0.125f;
    job.attention.key_positions = key_positions[i].data();
    job.attention.queries = queries[i].data();
    job.attention.query_positions = query_positions[i].data();
    job.attention.keys = layers[i].On(cpu_base());
    job.sums = cpu_out[i].data();
    cpu_jobs.push_back(job);
    job.attention.keys = layers[i].On(dev_base());
    job.sums = dev_out[i].data();
    dev_jobs.push_back(job);
  }
  ASSERT_TRUE(cpu_->AttentionColumnSums(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->AttentionColumnSums(dev_jobs, nullptr).ok());
  for (size_t i = 0; i < cpu_out.size(); ++i) {
    ASSERT_EQ(dev_out[i].size(), cpu_out[i].size());
    for (size_t k = 0; k < cpu_out[i].size(); ++k) {
      ASSERT_NEAR(dev_out[i][k], cpu_out[i][k], 1e-5) << "job " << i << " value " << k;
    }
  }
}

TEST_P(StagingTest, PoolScoresBitIdentical) {
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (const int32_t count : {0, 1, 7, 130}) {
    for (const int32_t kernel : {1, 3, 7}) {
      for (const PoolKind kind : {PoolKind::kAvg, PoolKind::kMax}) {
        const int32_t heads = 2, rows = 6;
        std::vector<float> in(static_cast<size_t>(rows) * count);
        for (float& v : in) v = uniform(rng);
        std::vector<int32_t> order(static_cast<size_t>(heads) * count), lengths(heads);
        for (int32_t h = 0; h < heads; ++h) {
          std::vector<int32_t> slots(count);
          std::iota(slots.begin(), slots.end(), 0);
          std::shuffle(slots.begin(), slots.end(), rng);
          lengths[h] = h == 0 ? count : count / 2;  // head 1: half its slots are passed through
          std::copy(slots.begin(), slots.end(), order.begin() + int64_t{h} * count);
        }
        std::vector<float> cpu_out(in.size(), -1.0f), dev_out(in.size(), -2.0f);
        PoolJob job{.in = in.data(),
                    .order = order.data(),
                    .lengths = lengths.data(),
                    .rows = rows,
                    .num_kv_heads = heads,
                    .count = count,
                    .kernel_size = kernel,
                    .kind = kind,
                    .out = cpu_out.data()};
        ASSERT_TRUE(cpu_->PoolScores({&job, 1}, nullptr).ok());
        job.out = dev_out.data();
        ASSERT_TRUE(staged_->PoolScores({&job, 1}, nullptr).ok());
        ExpectBitEqual(dev_out, cpu_out, "pooled");
      }
    }
  }
  // A malformed job is refused by name and writes nothing.
  std::vector<float> in(4, 1.0f), out(4, -3.0f);
  std::vector<int32_t> order = {0, 1, 2, 9}, lengths = {4};
  PoolJob bad{.in = in.data(),
              .order = order.data(),
              .lengths = lengths.data(),
              .rows = 1,
              .num_kv_heads = 1,
              .count = 4,
              .kernel_size = 3,
              .kind = PoolKind::kAvg,
              .out = out.data()};
  const absl::Status status = staged_->PoolScores({&bad, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("pool job 0: order[0][3] = 9"));
  EXPECT_EQ(out, std::vector<float>(4, -3.0f));
}

// Random window probabilities [hq][nq][count] and key positions (a shuffled permutation per kv
// head) for the CAKE window statistics.
struct WindowCase {
  int32_t hq, kv, nq, window, count;
};
const WindowCase kWindowCases[] = {{2, 1, 1, 1, 7}, {4, 2, 6, 4, 130}, {3, 3, 5, 5, 513},
                                   {2, 2, 3, 2, 0}, {8, 2, 9, 9, 33},  {1, 1, 2, 2, 1}};

TEST_P(StagingTest, WindowVarianceScoresBitIdentical) {
  std::mt19937 rng(14);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  // A multi-job call (one of them without slots) and one job per call.
  std::vector<std::vector<float>> probs, cpu_out, dev_out;
  for (const WindowCase& c : kWindowCases) {
    probs.emplace_back(static_cast<size_t>(c.hq) * c.nq * c.count);
    for (float& v : probs.back()) v = uniform(rng);
    cpu_out.emplace_back(static_cast<size_t>(c.hq) * c.count, -1.0f);
    dev_out.emplace_back(static_cast<size_t>(c.hq) * c.count, -2.0f);
  }
  std::vector<WindowVarianceJob> cpu_jobs, dev_jobs;
  for (size_t i = 0; i < std::size(kWindowCases); ++i) {
    const WindowCase& c = kWindowCases[i];
    WindowVarianceJob job{.probs = probs[i].data(),
                          .num_q_heads = c.hq,
                          .num_queries = c.nq,
                          .window = c.window,
                          .count = c.count,
                          .gamma = 0.5 + static_cast<double>(i),
                          .scores = cpu_out[i].data()};
    cpu_jobs.push_back(job);
    job.scores = dev_out[i].data();
    dev_jobs.push_back(job);
  }
  ASSERT_TRUE(cpu_->WindowVarianceScores(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->WindowVarianceScores(dev_jobs, nullptr).ok());
  for (size_t i = 0; i < cpu_out.size(); ++i) ExpectBitEqual(dev_out[i], cpu_out[i], "variance");
  for (size_t i = 0; i < cpu_out.size(); ++i) {
    std::fill(dev_out[i].begin(), dev_out[i].end(), -3.0f);
    ASSERT_TRUE(staged_->WindowVarianceScores({&dev_jobs[i], 1}, nullptr).ok());
    ExpectBitEqual(dev_out[i], cpu_out[i], "variance, one job");
  }
  // A malformed job is refused by name and writes nothing.
  WindowVarianceJob bad = dev_jobs[1];
  bad.window = bad.num_queries + 1;
  std::fill(dev_out[1].begin(), dev_out[1].end(), -4.0f);
  const absl::Status status = staged_->WindowVarianceScores({&bad, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("window variance job 0: window must be"));
  EXPECT_EQ(dev_out[1], std::vector<float>(dev_out[1].size(), -4.0f));
}

TEST_P(StagingTest, WindowEntropyShiftBitIdentical) {
  std::mt19937 rng(15);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<std::vector<float>> probs;
  std::vector<std::vector<int32_t>> positions;
  std::vector<int32_t> first;
  for (const WindowCase& c : kWindowCases) {
    probs.emplace_back(static_cast<size_t>(c.hq) * c.nq * c.count);
    for (float& v : probs.back()) v = uniform(rng);
    positions.emplace_back();
    for (int32_t h = 0; h < c.kv; ++h) {
      std::vector<int32_t> slots(c.count);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      positions.back().insert(positions.back().end(), slots.begin(), slots.end());
    }
    first.push_back(c.count - c.count / 4);  // the newest quarter is window, not prefix
  }
  const size_t n = std::size(kWindowCases);
  std::vector<double> cpu_entropy(n, -1.0), cpu_shift(n, -1.0);
  std::vector<double> dev_entropy(n, -2.0), dev_shift(n, -2.0);
  std::vector<WindowEntropyJob> cpu_jobs, dev_jobs;
  for (size_t i = 0; i < n; ++i) {
    const WindowCase& c = kWindowCases[i];
    WindowEntropyJob job{.probs = probs[i].data(),
                         .key_positions = positions[i].data(),
                         .num_q_heads = c.hq,
                         .num_kv_heads = c.kv,
                         .num_queries = c.nq,
                         .window = c.window,
                         .count = c.count,
                         .first_query_position = first[i],
                         .entropy = &cpu_entropy[i],
                         .shift = &cpu_shift[i]};
    cpu_jobs.push_back(job);
    job.entropy = &dev_entropy[i];
    job.shift = &dev_shift[i];
    dev_jobs.push_back(job);
  }
  ASSERT_TRUE(cpu_->WindowEntropyShift(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->WindowEntropyShift(dev_jobs, nullptr).ok());
  ExpectBitEqual(dev_entropy, cpu_entropy, "entropy");
  ExpectBitEqual(dev_shift, cpu_shift, "shift");
  // Something was measured: the cases with prefix slots and two window rows have a shift.
  EXPECT_GT(cpu_entropy[1], 0.0);
  EXPECT_GT(cpu_shift[1], 0.0);
  // A malformed job is refused by name and writes nothing.
  WindowEntropyJob bad = dev_jobs[1];
  bad.num_kv_heads = 3;
  dev_entropy[1] = dev_shift[1] = -5.0;
  const absl::Status status = staged_->WindowEntropyShift({&bad, 1}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("window entropy job 0: num_q_heads must be a positive multiple"));
  EXPECT_EQ(dev_entropy[1], -5.0);
  EXPECT_EQ(dev_shift[1], -5.0);
}

TEST_P(StagingTest, CaoteScoresBitIdentical) {
  const std::vector<Layer> layers = Layers(31);
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (bool fast : {false, true}) {
    std::vector<std::vector<float>> alpha, cpu_out, dev_out;
    std::vector<CaoteJob> cpu_jobs, dev_jobs;
    for (const Layer& layer : layers) {
      const int rows = layer.view.num_kv_heads * 2, count = layer.view.count;
      std::vector<float> a(static_cast<size_t>(rows) * count);
      for (int r = 0; r < rows; ++r) {
        float sum = 0.0f;
        for (int s = 0; s < count; ++s) sum += a[r * count + s] = s % 5 == 0 ? 0.0f : uniform(rng);
        for (int s = 0; s < count; ++s) a[r * count + s] /= sum > 0 ? sum : 1.0f;
      }
      alpha.push_back(a);
      cpu_out.emplace_back(a.size(), -1.0f);
      dev_out.emplace_back(a.size(), -2.0f);
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      CaoteJob job;
      job.rows = layers[i].view.num_kv_heads * 2;
      job.fast = fast;
      job.alpha = alpha[i].data();
      job.values = layers[i].On(cpu_base(), 1);
      job.scores = cpu_out[i].data();
      cpu_jobs.push_back(job);
      job.values = layers[i].On(dev_base(), 1);
      job.scores = dev_out[i].data();
      dev_jobs.push_back(job);
    }
    ASSERT_TRUE(cpu_->CaoteScores(cpu_jobs, nullptr).ok());
    ASSERT_TRUE(staged_->CaoteScores(dev_jobs, nullptr).ok());
    for (size_t i = 0; i < cpu_out.size(); ++i) ExpectBitEqual(dev_out[i], cpu_out[i], "caote");
  }
}

TEST_P(StagingTest, NearestKeysBitIdentical) {
  const std::vector<Layer> layers = Layers(41);
  std::mt19937 rng(17);
  std::vector<std::vector<int32_t>> queries, candidates, positions, cpu_target, dev_target;
  std::vector<std::vector<float>> cpu_sim, dev_sim;
  std::vector<NearestKeyJob> cpu_jobs, dev_jobs;
  for (const Layer& layer : layers) {
    const int count = layer.view.count;
    std::vector<int32_t> slots(count);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    const int nq = count / 3, nc = count - nq;  // 0 queries for tiny layers: a zero-work job
    queries.emplace_back(slots.begin(), slots.begin() + nq);
    candidates.emplace_back(slots.begin() + nq, slots.end());
    std::vector<int32_t> p(nc);
    std::iota(p.begin(), p.end(), 7);
    std::shuffle(p.begin(), p.end(), rng);
    positions.push_back(p);
    cpu_sim.emplace_back(nq, -1.0f);
    dev_sim.emplace_back(nq, -2.0f);
    cpu_target.emplace_back(nq, -1);
    dev_target.emplace_back(nq, -2);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    NearestKeyJob job;
    job.head = static_cast<int32_t>(i) % layers[i].view.num_kv_heads;
    job.query_slots = queries[i].data();
    job.num_queries = static_cast<int32_t>(queries[i].size());
    job.candidate_slots = candidates[i].data();
    job.candidate_positions = positions[i].data();
    job.num_candidates = static_cast<int32_t>(candidates[i].size());
    job.keys = layers[i].On(cpu_base());
    job.similarity = cpu_sim[i].data();
    job.target = cpu_target[i].data();
    cpu_jobs.push_back(job);
    job.keys = layers[i].On(dev_base());
    job.similarity = dev_sim[i].data();
    job.target = dev_target[i].data();
    dev_jobs.push_back(job);
  }
  ASSERT_TRUE(cpu_->NearestKeys(cpu_jobs, nullptr).ok());
  ASSERT_TRUE(staged_->NearestKeys(dev_jobs, nullptr).ok());
  for (size_t i = 0; i < layers.size(); ++i) {
    ExpectBitEqual(dev_sim[i], cpu_sim[i], "similarity");
    ExpectBitEqual(dev_target[i], cpu_target[i], "target");
  }
}

TEST_P(StagingTest, MergeRowsBitIdenticalWithDstAmongSources) {
  std::mt19937 rng(19);
  const int dim = 40;
  const uint64_t row_bytes = dim * DTypeBytes(dtype());
  std::vector<uint64_t> ids(kArenaBytes / row_bytes);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<uint64_t>> sources;
  std::vector<std::vector<float>> weights;
  std::vector<uint64_t> dsts;
  size_t next = 0;
  for (int j = 0; j < 5; ++j) {
    const int n = 1 + j * 2;
    std::vector<uint64_t> s;
    for (int k = 0; k < n; ++k) s.push_back(ids[next++] * row_bytes);
    dsts.push_back(j % 2 == 0 ? s[0] : ids[next++] * row_bytes);  // dst among the sources or not
    sources.push_back(s);
    std::uniform_real_distribution<float> w(0.1f, 1.0f);
    std::vector<float> ws(n);
    for (float& x : ws) x = w(rng);
    weights.push_back(ws);
  }
  // Two jobs: rows 0-2 and rows 3-4.
  MergeRowsCsr first, second;
  for (size_t j = 0; j < sources.size(); ++j) {
    (j < 3 ? first : second).Add(dsts[j], sources[j], weights[j]);
  }
  auto jobs_on = [&](uint8_t* base) {
    return std::vector<RowMergeJob>{first.Job(base, dtype(), dim), second.Job(base, dtype(), dim)};
  };
  ASSERT_TRUE(cpu_->MergeRows(jobs_on(cpu_base()), nullptr).ok());
  ASSERT_TRUE(staged_->MergeRows(jobs_on(dev_base()), nullptr).ok());
  ExpectArenasEqual();
}

TEST_P(StagingTest, CopyHostRowsBothWaysThroughOneBounceBuffer) {
  const uint64_t row_bytes = 24 * DTypeBytes(dtype());
  const uint64_t arena_rows = kArenaBytes / row_bytes;
  std::mt19937 rng(23);
  // Job 0 (arena -> host): two runs of 4 contiguous rows, then 5 scattered rows. Job 1 (host ->
  // arena): 6 contiguous rows, then rows contiguous in the arena only and in the host only
  // (neither coalesces). Job 2: zero rows.
  std::vector<uint64_t> a0, h0, a1, h1;
  for (int r = 0; r < 4; ++r) a0.push_back((10 + r) * row_bytes), h0.push_back(r * row_bytes);
  for (int r = 0; r < 4; ++r) a0.push_back((50 + r) * row_bytes), h0.push_back((4 + r) * row_bytes);
  for (int r = 0; r < 5; ++r)
    a0.push_back((200 + 7 * r) * row_bytes), h0.push_back((20 - 2 * r) * row_bytes);
  for (int r = 0; r < 6; ++r)
    a1.push_back((arena_rows - 100 + r) * row_bytes), h1.push_back((30 + r) * row_bytes);
  a1.push_back(400 * row_bytes), h1.push_back(40 * row_bytes);
  a1.push_back(401 * row_bytes), h1.push_back(45 * row_bytes);  // arena contiguous only
  a1.push_back(500 * row_bytes), h1.push_back(46 * row_bytes);  // host contiguous only
  const uint64_t host_bytes = 64 * row_bytes;
  std::vector<uint8_t> host_init(host_bytes);
  for (uint8_t& b : host_init) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> cpu_host = host_init, dev_host = host_init;
  auto jobs_on = [&](uint8_t* base, uint8_t* host) {
    std::vector<HostRowCopyJob> jobs(3);
    jobs[0] = HostRowCopyJob{base,
                             host,
                             a0.data(),
                             h0.data(),
                             static_cast<int64_t>(a0.size()),
                             row_bytes,
                             /*to_host=*/true};
    jobs[1] = HostRowCopyJob{base,
                             host,
                             a1.data(),
                             h1.data(),
                             static_cast<int64_t>(a1.size()),
                             row_bytes,
                             /*to_host=*/false};
    jobs[2] = HostRowCopyJob{base, host, nullptr, nullptr, 0, row_bytes, false};
    return jobs;
  };
  const SimulatedDeviceStats before = control_->stats();
  ASSERT_TRUE(cpu_->CopyHostRows(jobs_on(cpu_base(), cpu_host.data()), nullptr).ok());
  ASSERT_TRUE(staged_->CopyHostRows(jobs_on(dev_base(), dev_host.data()), nullptr).ok());
  const SimulatedDeviceStats after = control_->stats();
  EXPECT_TRUE(cpu_host == dev_host) << "host buffers differ";
  ExpectArenasEqual();
  // Pageable host rows go through one page-locked bounce buffer for the call: packed into it (job
  // 1) or unpacked from it (job 0) on the host, the device copying between it and the arena. One
  // upload (the offsets), one staging allocation, no transfer per run of rows.
  EXPECT_EQ(after.copies_to_host - before.copies_to_host, 0u);
  EXPECT_EQ(after.copies_to_device - before.copies_to_device, 1u);
  EXPECT_EQ(after.allocate_calls - before.allocate_calls, 1u);
}

TEST_P(StagingTest, OneAllocationOneUploadOneDownloadPerCall) {
  const std::vector<Layer> layers = Layers(51);
  std::vector<std::vector<float>> out;
  std::vector<KeyDiffScoreJob> jobs;
  for (const Layer& layer : layers) out.emplace_back(layer.view.num_kv_heads * layer.view.count);
  for (size_t i = 0; i < layers.size(); ++i) {
    KeyDiffScoreJob job;
    job.keys = layers[i].On(dev_base());
    job.scores = out[i].data();
    jobs.push_back(job);
  }
  const SimulatedDeviceStats before = control_->stats();
  ASSERT_TRUE(staged_->KeyDiffScores(jobs, nullptr).ok());
  const SimulatedDeviceStats mid = control_->stats();
  EXPECT_EQ(mid.allocate_calls - before.allocate_calls, 1u);
  EXPECT_EQ(mid.copies_to_device - before.copies_to_device, 1u);
  EXPECT_EQ(mid.copies_to_host - before.copies_to_host, 1u);
  EXPECT_EQ(mid.live_scratch, 0u);
  // The freed buffer is reused by the next call of the same size: no new reservation.
  ASSERT_TRUE(staged_->KeyDiffScores(jobs, nullptr).ok());
  const SimulatedDeviceStats after = control_->stats();
  EXPECT_EQ(after.allocate_calls - mid.allocate_calls, 1u);
  EXPECT_EQ(after.reservations, mid.reservations);
}

TEST_P(StagingTest, CallsWithoutWorkAllocateNothing) {
  const Layer empty(Shape{2, 0, 16, 16}, dtype(), 1);
  const Layer some(Shape{2, 20, 16, 16}, dtype(), 2);
  std::vector<float> scores(64);
  std::vector<int32_t> slots(4);
  std::vector<uint64_t> offsets(4);
  uint8_t host[64];
  const SimulatedDeviceStats before = control_->stats();
  KeyDiffScoreJob keydiff;
  keydiff.keys = empty.On(dev_base());
  EXPECT_TRUE(staged_->KeyDiffScores({keydiff, keydiff}, nullptr).ok());
  EXPECT_TRUE(staged_->KeyDiffScores({}, nullptr).ok());
  TopKJob topk;
  topk.rows = 2;
  topk.n = 4;
  topk.k = 0;
  topk.scores = scores.data();
  topk.positions = slots.data();
  EXPECT_TRUE(staged_->TopK({topk}, nullptr).ok());
  EXPECT_TRUE(staged_->CopyRows({RowCopyJob{dev_base(), nullptr, nullptr, 0, 64}}, nullptr).ok());
  EXPECT_TRUE(staged_
                  ->CopyHostRows({HostRowCopyJob{dev_base(), host, offsets.data(), offsets.data(),
                                                 4, 0, true}},
                                 nullptr)
                  .ok());
  AttentionJob attention;
  attention.keys = empty.On(dev_base());
  attention.num_q_heads = 2;
  attention.num_queries = 1;
  attention.scale = 1.0f;
  EXPECT_TRUE(staged_->AttentionProbs({attention}, nullptr).ok());
  EXPECT_TRUE(staged_->AttentionLogits({attention}, nullptr).ok());
  CaoteJob caote;
  caote.values = empty.On(dev_base(), 1);
  caote.rows = 2;
  EXPECT_TRUE(staged_->CaoteScores({caote}, nullptr).ok());
  NearestKeyJob nearest;
  nearest.keys = some.On(dev_base());
  nearest.num_queries = 0;
  EXPECT_TRUE(staged_->NearestKeys({nearest}, nullptr).ok());
  EXPECT_TRUE(staged_->MergeRows({}, nullptr).ok());
  const SimulatedDeviceStats after = control_->stats();
  EXPECT_EQ(after.allocate_calls, before.allocate_calls);
  EXPECT_EQ(after.copies_to_device, before.copies_to_device);
  EXPECT_EQ(after.copies_to_host, before.copies_to_host);
}

TEST_P(StagingTest, AHostArenaIsRefusedNamingTheJobAndField) {
  const Layer layer(Shape{2, 20, 16, 16}, dtype(), 3);
  std::vector<float> scores(40, -7.0f);
  KeyDiffScoreJob ok;
  ok.keys = layer.On(dev_base());
  ok.scores = scores.data();
  KeyDiffScoreJob host = ok;
  host.keys = layer.On(cpu_base());
  const absl::Status status = staged_->KeyDiffScores({ok, host}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "keydiff job 1: keys.arena is not device memory");
  EXPECT_THAT(scores, ::testing::Each(-7.0f));  // job 0 was not run either

  std::vector<uint64_t> offsets = {0};
  std::vector<float> weights = {1.0f};
  MergeRowsCsr csr;
  csr.Add(64, offsets, weights);
  const absl::Status merged = staged_->MergeRows({csr.Job(cpu_base(), dtype(), 8)}, nullptr);
  EXPECT_EQ(merged.message(), "row merge job 0: arena is not device memory");
  uint8_t buffer[64];
  const absl::Status copied = staged_->CopyHostRows(
      {HostRowCopyJob{cpu_base(), buffer, offsets.data(), offsets.data(), 1, 8, true}}, nullptr);
  EXPECT_EQ(copied.message(), "host row copy job 0: arena is not device memory");
}

// Runs `call` on both backends with jobs built by `make(arena base, output sentinel)`; both must
// fail with the same INVALID_ARGUMENT message and leave outputs and arenas untouched.
TEST_P(StagingTest, InvalidJobsGetTheCpuMessageAndWriteNothing) {
  const Layer layer(Shape{2, 20, 16, 16}, dtype(), 4);
  Layer bad_table = layer;
  bad_table.table[1] = -3;
  std::vector<float> cpu_out(1000, -1.0f), dev_out(1000, -1.0f);
  std::vector<int32_t> cpu_idx(1000, -1), dev_idx(1000, -1);
  std::vector<int32_t> positions(1000), slots = {0, 1, 2, 25};
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> inputs(1000, 0.01f);
  std::vector<uint8_t> forced(100, 1);
  std::vector<uint64_t> offsets = {0, 64, 128};
  auto expect_same = [&](const absl::Status& cpu, const absl::Status& dev, const char* what) {
    EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument) << what << ": " << cpu;
    EXPECT_EQ(dev.code(), absl::StatusCode::kInvalidArgument) << what << ": " << dev;
    EXPECT_EQ(dev.message(), cpu.message()) << what;
    EXPECT_THAT(dev_out, ::testing::Each(-1.0f)) << what;
    EXPECT_THAT(dev_idx, ::testing::Each(-1)) << what;
  };
  const std::vector<uint8_t> arena_before = ArenaBytes(*dev_arena_);
  {  // KeyDiff: a negative block id in the second job.
    auto job = [&](uint8_t* base, float* out, const Layer& l) {
      KeyDiffScoreJob j;
      j.keys = l.On(base);
      j.scores = out;
      return j;
    };
    expect_same(cpu_->KeyDiffScores({job(cpu_base(), cpu_out.data(), layer),
                                     job(cpu_base(), cpu_out.data() + 40, bad_table)},
                                    nullptr),
                staged_->KeyDiffScores({job(dev_base(), dev_out.data(), layer),
                                        job(dev_base(), dev_out.data() + 40, bad_table)},
                                       nullptr),
                "keydiff");
  }
  {  // TopK: too many forced slots in a row.
    auto job = [&](int32_t* kept) {
      TopKJob j;
      j.rows = 2;
      j.n = 10;
      j.k = 3;
      j.scores = inputs.data();
      j.positions = positions.data();
      j.forced = forced.data();
      j.kept = kept;
      return j;
    };
    expect_same(cpu_->TopK({job(cpu_idx.data())}, nullptr),
                staged_->TopK({job(dev_idx.data())}, nullptr), "topk");
  }
  {  // CopyRows: negative count; null offsets.
    expect_same(
        cpu_->CopyRows({RowCopyJob{cpu_base(), offsets.data(), offsets.data(), -1, 8}}, nullptr),
        staged_->CopyRows({RowCopyJob{dev_base(), offsets.data(), offsets.data(), -1, 8}}, nullptr),
        "copy rows");
    expect_same(cpu_->CopyRows({RowCopyJob{cpu_base(), nullptr, offsets.data(), 2, 8}}, nullptr),
                staged_->CopyRows({RowCopyJob{dev_base(), nullptr, offsets.data(), 2, 8}}, nullptr),
                "copy rows null");
  }
  {  // CopyHostRows: null host.
    expect_same(
        cpu_->CopyHostRows(
            {HostRowCopyJob{cpu_base(), nullptr, offsets.data(), offsets.data(), 2, 8, true}},
            nullptr),
        staged_->CopyHostRows(
            {HostRowCopyJob{dev_base(), nullptr, offsets.data(), offsets.data(), 2, 8, true}},
            nullptr),
        "host rows");
  }
  {  // Attention: num_q_heads not a multiple; then a zero scale.
    auto job = [&](uint8_t* base, float* out, int q_heads, float scale) {
      AttentionJob j;
      j.keys = layer.On(base);
      j.key_positions = positions.data();
      j.queries = inputs.data();
      j.query_positions = positions.data();
      j.num_q_heads = q_heads;
      j.num_queries = 2;
      j.scale = scale;
      j.probs = out;
      return j;
    };
    expect_same(cpu_->AttentionProbs({job(cpu_base(), cpu_out.data(), 2, 1.0f),
                                      job(cpu_base(), cpu_out.data() + 100, 3, 1.0f)},
                                     nullptr),
                staged_->AttentionProbs({job(dev_base(), dev_out.data(), 2, 1.0f),
                                         job(dev_base(), dev_out.data() + 100, 3, 1.0f)},
                                        nullptr),
                "attention");
    expect_same(cpu_->AttentionLogits({job(cpu_base(), cpu_out.data(), 2, 0.0f)}, nullptr),
                staged_->AttentionLogits({job(dev_base(), dev_out.data(), 2, 0.0f)}, nullptr),
                "logits");
  }
  {  // CAOTE: eps out of range.
    auto job = [&](uint8_t* base, float* out) {
      CaoteJob j;
      j.values = layer.On(base, 1);
      j.alpha = inputs.data();
      j.rows = 2;
      j.eps = 2.0f;
      j.scores = out;
      return j;
    };
    expect_same(cpu_->CaoteScores({job(cpu_base(), cpu_out.data())}, nullptr),
                staged_->CaoteScores({job(dev_base(), dev_out.data())}, nullptr), "caote");
  }
  {  // Nearest keys: a query slot beyond count (25 >= 20).
    auto job = [&](uint8_t* base, float* similarity, int32_t* target) {
      NearestKeyJob j;
      j.keys = layer.On(base);
      j.head = 1;
      j.query_slots = slots.data();
      j.num_queries = 4;
      j.candidate_slots = slots.data();
      j.candidate_positions = positions.data();
      j.num_candidates = 2;
      j.similarity = similarity;
      j.target = target;
      return j;
    };
    expect_same(cpu_->NearestKeys({job(cpu_base(), cpu_out.data(), cpu_idx.data())}, nullptr),
                staged_->NearestKeys({job(dev_base(), dev_out.data(), dev_idx.data())}, nullptr),
                "nearest");
  }
  {  // Merge: an overflowing source offset in the second job.
    MergeRowsCsr good, bad;
    good.Add(256, {offsets[0], offsets[1]}, {0.5f, 0.5f});
    bad.Add(512, {0, 64}, {0.5f, 0.5f});
    bad.Add(576, {0, ~uint64_t{0} - 4}, {0.5f, 0.5f});
    auto jobs = [&](uint8_t* base) {
      return std::vector<RowMergeJob>{good.Job(base, dtype(), 8), bad.Job(base, dtype(), 8)};
    };
    expect_same(cpu_->MergeRows(jobs(cpu_base()), nullptr),
                staged_->MergeRows(jobs(dev_base()), nullptr), "merge");
  }
  EXPECT_TRUE(ArenaBytes(*dev_arena_) == arena_before) << "an invalid call wrote the arena";
}

TEST_P(StagingTest, DeviceResidentArraysPassThrough) {
  const Layer layer(Shape{3, 50, 24, 8}, dtype(), 6);
  const size_t n = 3 * 50;
  // The block table and the output already live on the device; only nothing else is staged.
  auto table = memory_->Allocate(layer.table.size() * sizeof(int32_t));
  auto scores = memory_->Allocate(n * sizeof(float));
  ASSERT_TRUE(table.ok() && scores.ok());
  ASSERT_TRUE(
      memory_
          ->CopyToDevice(*table, layer.table.data(), layer.table.size() * sizeof(int32_t), nullptr)
          .ok());
  std::vector<float> cpu_scores(n, -1.0f), dev_scores(n, -2.0f);
  KeyDiffScoreJob job;
  job.keys = layer.On(cpu_base());
  job.scores = cpu_scores.data();
  ASSERT_TRUE(cpu_->KeyDiffScores({job}, nullptr).ok());
  job.keys = layer.On(dev_base());
  job.keys.block_table = static_cast<const int32_t*>(*table);
  job.scores = static_cast<float*>(*scores);
  const SimulatedDeviceStats before = control_->stats();
  ASSERT_TRUE(staged_->KeyDiffScores({job}, nullptr).ok());
  const SimulatedDeviceStats after = control_->stats();
  EXPECT_EQ(after.allocate_calls, before.allocate_calls);  // nothing to stage
  EXPECT_EQ(after.copies_to_device, before.copies_to_device);
  EXPECT_EQ(after.copies_to_host - before.copies_to_host, 1u);  // the table, mirrored to validate
  ASSERT_TRUE(memory_->CopyToHost(dev_scores.data(), *scores, n * sizeof(float), nullptr).ok());
  ExpectBitEqual(dev_scores, cpu_scores, "scores");
  memory_->Free(*table);
  memory_->Free(*scores);
}

TEST_P(StagingTest, AFailedDeviceCallWritesNoOutput) {
  // candidate_positions in device memory too short for num_candidates: host validation passes
  // (it reads no positions), the device refuses the job, and the host outputs stay untouched.
  const Layer layer(Shape{2, 20, 16, 16}, dtype(), 7);
  std::vector<int32_t> queries = {0, 1}, candidates = {2, 3, 4, 5};
  auto positions = memory_->Allocate(4);  // a whole 256-byte scratch
  ASSERT_TRUE(positions.ok());
  const auto* device_positions = static_cast<const int32_t*>(*positions) + 63;  // 1 int left
  std::vector<float> similarity(2, -1.0f);
  std::vector<int32_t> target(2, -1);
  NearestKeyJob job;
  job.keys = layer.On(dev_base());
  job.query_slots = queries.data();
  job.num_queries = 2;
  job.candidate_slots = candidates.data();
  job.candidate_positions = device_positions;
  job.num_candidates = 4;
  job.similarity = similarity.data();
  job.target = target.data();
  const absl::Status status = staged_->NearestKeys({job}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("candidate_positions"));
  EXPECT_THAT(similarity, ::testing::Each(-1.0f));
  EXPECT_THAT(target, ::testing::Each(-1));
  EXPECT_EQ(control_->stats().live_scratch, 1u);  // only the test's own buffer
  memory_->Free(*positions);
}

TEST_P(StagingTest, ConcurrentCallsStageIndependently) {
  // Threads share the decorator, the simulated device and its scratch cache; each call's
  // staging buffer is its own, so every thread gets the CPU backend's answer.
  const std::vector<Layer> layers = Layers(61);
  std::vector<std::vector<float>> expected;
  for (const Layer& layer : layers) {
    expected.emplace_back(layer.view.num_kv_heads * layer.view.count);
    KeyDiffScoreJob job;
    job.keys = layer.On(cpu_base());
    job.scores = expected.back().data();
    ASSERT_TRUE(cpu_->KeyDiffScores({job}, nullptr).ok());
  }
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 10; ++round) {
        const size_t i = (t + round) % layers.size();
        std::vector<float> scores(expected[i].size(), -3.0f);
        KeyDiffScoreJob job;
        job.keys = layers[i].On(dev_base());
        job.scores = scores.data();
        if (!staged_->KeyDiffScores({job}, nullptr).ok() ||
            std::memcmp(scores.data(), expected[i].data(), scores.size() * sizeof(float)) != 0) {
          ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(mismatches, ::testing::Each(0));
  EXPECT_EQ(control_->stats().live_scratch, 0u);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, StagingTest,
                         ::testing::Values(DType::kFloat16, DType::kBFloat16, DType::kFloat32),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace kvs
