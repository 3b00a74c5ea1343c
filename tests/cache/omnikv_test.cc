// KvPool::Select on real pools (CPU backend, shm arenas, the real host tier): the spec's
// propagation vector TV7 with and without offload, the staged bytes read back from the arena,
// the approximation error against full attention, idempotent retries, tails, and bad input.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "cache/pool.h"
#include "cache/policy/omnikv.h"
#include "cache/sequence_kind.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/tier_manager.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using testing_util::Append;
using testing_util::MakeLayout;
using testing_util::TestPool;

MATCHER_P2(StatusIs, code, substring, "") {
  return arg.code() == code && std::string(arg.message()).find(substring) != std::string::npos;
}

constexpr int kLayers = 8, kHq = 4, kHkv = 2, kDim = 4, kPrompt = 12, kTokens = 14;

// TV7 inputs (omnikv.md §13): per layer l, keys, values and the layer's query.
float Key(int l, int h, int t, int i) {
  return static_cast<float>(((7 * t + 3 * i + 5 * h + l) % 11) - 5);
}
float Value(int l, int h, int t, int i) {
  return static_cast<float>(((2 * t + 5 * i + 3 * h + l) % 9) - 4) / 4.0f;
}
float Query(int l, int h, int i) { return static_cast<float>(((3 * h + 5 * i + l) % 7) - 3); }

float Tv7(int layer, int kv, int head, int32_t position, int d) {
  return kv == 0 ? Key(layer, head, position, d) : Value(layer, head, position, d);
}

ModelLayout Tv7Layout(DType dtype) {
  ModelLayout layout = MakeLayout(kLayers, kHkv, kDim, dtype, 4);
  layout.num_q_heads = kHq;
  return layout;
}

PolicyConfig OmniKv(int32_t k, bool offload, OmniKvSelector selector = OmniKvSelector::kLast) {
  PolicyConfig config;
  config.name = kPolicyOmniKv;
  config.omnikv.filter_layers = {1, 4};
  config.omnikv.wait_layers = 1;
  config.omnikv.selected_tokens = k;
  config.omnikv.selector = selector;
  config.omnikv.offload = offload;
  return config;
}

// Queries of `layers`, [layers][Hq][1][D].
AttentionInput FilterQueries(const std::vector<int32_t>& layers, int salt = 0) {
  AttentionInput input;
  input.layers = layers;
  input.num_queries = 1;
  input.softmax_scale = 0.5f;
  for (int32_t l : layers) {
    for (int h = 0; h < kHq; ++h) {
      for (int i = 0; i < kDim; ++i) input.queries.push_back(Query(l + salt, h, i));
    }
  }
  return input;
}

// What a worker sees in a session's arena: a read-only mapping of the memfd the worker would
// receive; a device arena (the /cuda runs) is read through the pool (Arena::Read) at each At.
class ArenaReader {
 public:
  ArenaReader(const KvPool& pool, const SessionView& view)
      : pool_(pool), session_(view.session_id), size_(view.arena.size_bytes) {
    if (view.arena.kind == ArenaHandle::Kind::kCudaIpc) return;
    const int fd = pool.DuplicateArenaFd(view.session_id).value_or(-1);
    EXPECT_GE(fd, 0) << view.session_id;
    data_ = static_cast<const uint8_t*>(mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~ArenaReader() {
    if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  }
  // Element d of (kv, head, slot) of a view with `block_table`.
  float At(const ModelLayout& layout, const std::vector<int32_t>& block_table, int kv, int head,
           int slot, int d) const {
    const uint64_t offset =
        static_cast<uint64_t>(block_table[slot / layout.block_tokens]) * layout.block_bytes() +
        ((static_cast<uint64_t>(kv) * layout.num_kv_heads + head) * layout.block_tokens +
         slot % layout.block_tokens) *
            layout.row_bytes();
    if (data_ != nullptr) return LoadAsFloat(data_ + offset, layout.dtype, d);
    std::vector<uint8_t> row(layout.row_bytes());
    const absl::Status read = pool_.ReadArena(session_, offset, row.data(), row.size());
    EXPECT_TRUE(read.ok()) << read;
    return LoadAsFloat(row.data(), layout.dtype, d);
  }

 private:
  const KvPool& pool_;
  std::string session_;
  uint64_t size_;
  const uint8_t* data_ = nullptr;
};

// Attention output of layer l's query over `positions` (exact, double), [Hq][D].
std::vector<double> AttentionOutput(int l, const std::vector<int32_t>& positions) {
  std::vector<double> out(kHq * kDim, 0.0);
  for (int h = 0; h < kHq; ++h) {
    const int g = h / (kHq / kHkv);
    std::vector<double> logits;
    double max = -INFINITY;
    for (int32_t t : positions) {
      double dot = 0;
      for (int i = 0; i < kDim; ++i) dot += Query(l, h, i) * Key(l, g, t, i);
      logits.push_back(0.5 * dot);
      max = std::max(max, logits.back());
    }
    double sum = 0;
    for (double& z : logits) sum += (z = std::exp(z - max));
    for (size_t j = 0; j < positions.size(); ++j) {
      for (int i = 0; i < kDim; ++i) {
        out[h * kDim + i] += logits[j] / sum * Value(l, g, positions[j], i);
      }
    }
  }
  return out;
}

std::vector<int32_t> AllPositions(int n) {
  std::vector<int32_t> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  return all;
}

double RelativeError(const std::vector<double>& approx, const std::vector<double>& exact) {
  double num = 0, den = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    num += (approx[i] - exact[i]) * (approx[i] - exact[i]);
    den += exact[i] * exact[i];
  }
  return std::sqrt(num / den);
}

struct Fixture {
  explicit Fixture(DType dtype = DType::kFloat32, uint64_t host_bytes = uint64_t{1} << 20,
                   int32_t blocks = 64, int32_t decode_threads = 0)
      : layout(Tv7Layout(dtype)),
        tiers(storage::TierManager::Open({host_bytes, "", 0})),
        pool(Options(tiers.get(), decode_threads)) {
    session = pool.Attach(layout, blocks);
  }
  static PoolOptions Options(SequenceTiers* tiers, int32_t decode_threads = 0) {
    PoolOptions options = TestPool::DefaultOptions();
    options.tiers = tiers;
    options.decode_threads = decode_threads;
    return options;
  }
  std::string Sequence(const PolicyConfig& policy, const std::string& id) {
    std::string made = pool.Create(session, policy, BudgetConfig{}, id);
    EXPECT_TRUE(Append(pool.pool, session, made, kTokens, layout, Tv7).ok());
    return made;
  }
  absl::StatusOr<SelectResult> Select(const std::string& seq, int64_t step,
                                      const std::vector<int32_t>& layers, int salt = 0) {
    SelectItem item;
    item.session_id = session;
    item.sequence_id = seq;
    item.step_id = step;
    item.attention = FilterQueries(layers, salt);
    item.prompt_tokens = kPrompt;
    absl::StatusOr<std::vector<SelectResult>> results = pool.pool.Select({&item, 1});
    if (!results.ok()) return results.status();
    return (*results)[0];
  }

  ModelLayout layout;
  std::unique_ptr<storage::TierManager> tiers;
  TestPool pool;
  std::string session;
};

class OmniKvSelectTest : public ::testing::TestWithParam<std::tuple<bool, DType>> {};

TEST_P(OmniKvSelectTest, Tv7PropagationStagesTheSelectedRows) {
  const auto [offload, dtype] = GetParam();
  Fixture f(dtype);
  const std::string seq = f.Sequence(OmniKv(4, offload), "tv7");
  absl::StatusOr<SelectResult> result = f.Select(seq, 1, {1, 4});
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->filters.size(), 2u);
  EXPECT_EQ(result->filters[0].filter_layer, 1);
  EXPECT_THAT(result->filters[0].positions, ElementsAre(1, 2, 5, 9));
  EXPECT_THAT(result->filters[0].sparse_layers, ElementsAre(3));
  EXPECT_THAT(result->filters[1].positions, ElementsAre(3, 6, 7, 10));
  EXPECT_THAT(result->filters[1].sparse_layers, ElementsAre(6, 7));
  EXPECT_EQ(result->prompt_tokens, kPrompt);
  EXPECT_EQ(result->budget_tokens, 4);
  // Sparse layers' prompt: 12 tokens x 2 (K, V) x 2 heads x 4 dims.
  const uint64_t per_layer = uint64_t{kPrompt} * 2 * kHkv * f.layout.row_bytes();
  if (offload) {
    EXPECT_EQ(result->host_bytes, 3 * per_layer + std::string("omnikv offloaded prompt").size());
  } else {
    EXPECT_EQ(result->host_bytes, 0u);
  }

  // Every staged row holds the token the spec says: layer 3 sees [1,2,5,9,12,13], layers 6 and
  // 7 see [3,6,7,10,12,13].
  ASSERT_EQ(result->sparse_layers.size(), 3u);
  absl::StatusOr<SessionView> view = f.pool.pool.GetSession(f.session);
  ASSERT_TRUE(view.ok());
  ArenaReader arena(f.pool.pool, *view);
  const std::vector<std::vector<int32_t>> expected = {
      {1, 2, 5, 9, 12, 13}, {3, 6, 7, 10, 12, 13}, {3, 6, 7, 10, 12, 13}};
  for (size_t j = 0; j < 3; ++j) {
    const LayerLayoutView& staged = result->sparse_layers[j];
    EXPECT_EQ(staged.layer, (std::vector<int32_t>{3, 6, 7})[j]);
    ASSERT_EQ(staged.count, 6);
    for (int s = 0; s < staged.count; ++s) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kHkv; ++h) {
          for (int d = 0; d < kDim; ++d) {
            ASSERT_EQ(arena.At(f.layout, staged.block_table, kv, h, s, d),
                      Tv7(staged.layer, kv, h, expected[j][s], d))
                << "layer " << staged.layer << " slot " << s << " kv " << kv << " head " << h;
          }
        }
      }
    }
  }

  // With offload the sparse layers keep only their generated tokens in the arena.
  absl::StatusOr<SequenceLayout> layout = f.pool.pool.GetLayout(f.session, seq, {}, true);
  ASSERT_TRUE(layout.ok());
  for (int l = 0; l < kLayers; ++l) {
    const bool sparse = l == 3 || l == 6 || l == 7;
    EXPECT_EQ(layout->layers[l].count, offload && sparse ? 2 : kTokens) << l;
  }
  if (offload) {
    EXPECT_THAT(layout->layers[3].positions, ElementsAre(12, 13, 12, 13));
  }
}

INSTANTIATE_TEST_SUITE_P(OffloadAndDtypes, OmniKvSelectTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(DType::kFloat32, DType::kFloat16,
                                                              DType::kBFloat16)));

TEST(OmniKvSelect, ApproximationErrorAgainstFullAttention) {
  // Dense layers attend to everything (error 0 by construction); for the sparse layers the
  // error of attending to T_f + the generated tokens falls as k grows, captured mass rises
  // monotonically, and k = N is exact.
  Fixture f(DType::kFloat32, uint64_t{1} << 22, 512);
  double previous_mass = 0;
  for (int32_t k = 1; k <= kPrompt; ++k) {
    const std::string seq = f.Sequence(OmniKv(k, /*offload=*/k % 2 == 0), "k" + std::to_string(k));
    absl::StatusOr<SelectResult> result = f.Select(seq, 1, {1, 4});
    ASSERT_TRUE(result.ok()) << result.status();
    double mass = 0;
    std::string errors;
    for (size_t fi = 0; fi < result->filters.size(); ++fi) {
      std::vector<int32_t> visible = result->filters[fi].positions;
      visible.push_back(12);
      visible.push_back(13);
      for (int32_t l : result->filters[fi].sparse_layers) {
        const double error =
            RelativeError(AttentionOutput(l, visible), AttentionOutput(l, AllPositions(kTokens)));
        errors += " layer " + std::to_string(l) + ": " + std::to_string(error);
        if (k == kPrompt) {
          EXPECT_LT(error, 1e-12) << "layer " << l;
        }
      }
      // Captured mass of the filter layer's own attention (max over heads, as it ranks).
      const int32_t fl = result->filters[fi].filter_layer;
      for (int h = 0; h < kHq; ++h) {
        std::vector<double> z(kPrompt);
        double max = -INFINITY, sum = 0;
        for (int t = 0; t < kPrompt; ++t) {
          double dot = 0;
          for (int i = 0; i < kDim; ++i) dot += Query(fl, h, i) * Key(fl, h / 2, t, i);
          max = std::max(max, z[t] = 0.5 * dot);
        }
        for (double& v : z) sum += (v = std::exp(v - max));
        for (int32_t t : result->filters[fi].positions) mass += z[t] / sum;
      }
    }
    std::printf("omnikv TV7 k=%d: relative output error vs full attention:%s; captured mass %.4f\n",
                k, errors.c_str(), mass / (2 * kHq));
    EXPECT_GE(mass, previous_mass - 1e-12) << "k " << k;
    previous_mass = mass;
  }
  EXPECT_NEAR(previous_mass / (2 * kHq), 1.0, 1e-12);
}

TEST(OmniKvSelect, RetriedStepReturnsTheSameSelectionAndNewTokensJoinTheTail) {
  Fixture f;
  const std::string seq = f.Sequence(OmniKv(4, true), "s");
  absl::StatusOr<SelectResult> first = f.Select(seq, 7, {1});
  ASSERT_TRUE(first.ok()) << first.status();
  // Same step, other queries: the same selection (idempotent per (sequence, step, filter)).
  absl::StatusOr<SelectResult> retry = f.Select(seq, 7, {1}, /*salt=*/3);
  ASSERT_TRUE(retry.ok());
  EXPECT_EQ(retry->filters[0].positions, first->filters[0].positions);
  // A new step with other queries selects again.
  absl::StatusOr<SelectResult> next = f.Select(seq, 8, {1}, /*salt=*/3);
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->filters[0].positions, first->filters[0].positions);

  // A decode token appended later is staged after the selection.
  ASSERT_TRUE(Append(f.pool.pool, f.session, seq, 1, f.layout, Tv7).ok());
  absl::StatusOr<SelectResult> after = f.Select(seq, 9, {1});
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->sparse_layers.size(), 1u);
  EXPECT_EQ(after->sparse_layers[0].count, 4 + 3);
  absl::StatusOr<SessionView> view = f.pool.pool.GetSession(f.session);
  ArenaReader arena(f.pool.pool, *view);
  EXPECT_EQ(arena.At(f.layout, after->sparse_layers[0].block_table, 1, 1, 6, 2),
            Tv7(3, 1, 1, 14, 2));
}

TEST(OmniKvSelect, ReleaseReturnsStagingBlocksAndHostBytes) {
  Fixture f;
  const int32_t free_before = f.pool.FreeBlocks(f.session);
  const std::string seq = f.Sequence(OmniKv(4, true), "s");
  ASSERT_TRUE(f.Select(seq, 1, {1, 4}).ok());
  EXPECT_GT(f.tiers->GetStats().host_bytes_used, 0u);
  EXPECT_TRUE(f.tiers->List().empty()) << "pinned entries are not spilled sequences";
  std::vector<SequenceInfo> listed = f.pool.pool.ListSequences(f.session);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].host_bytes, f.tiers->GetStats().host_bytes_used);
  // Spill is refused: the cache spans arena, staging and host tier.
  EXPECT_THAT(f.pool.pool.Spill(f.session, seq, StorageTier::kHost).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "cannot be spilled"));
  ASSERT_TRUE(f.pool.pool.ReleaseSequence(f.session, seq).ok());
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, 0u);
  EXPECT_EQ(f.pool.FreeBlocks(f.session), free_before);
}

TEST(OmniKvSelect, HostTierTooSmallChangesNothing) {
  Fixture f(DType::kFloat32, /*host_bytes=*/1000);
  const std::string seq = f.Sequence(OmniKv(4, true), "s");
  absl::StatusOr<SequenceLayout> before = f.pool.pool.GetLayout(f.session, seq, {}, true);
  const int32_t free_before = f.pool.FreeBlocks(f.session);
  EXPECT_THAT(f.Select(seq, 1, {1}).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "items[0]: "));
  absl::StatusOr<SequenceLayout> after = f.pool.pool.GetLayout(f.session, seq, {}, true);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(after->layers[l].count, before->layers[l].count);
    EXPECT_EQ(after->layers[l].positions, before->layers[l].positions);
  }
  EXPECT_EQ(f.pool.FreeBlocks(f.session), free_before);
  EXPECT_EQ(f.tiers->GetStats().host_bytes_used, 0u);
}

TEST(OmniKvSelect, FullArenaForStagingIsResourceExhausted) {
  // 8 layers x 14 tokens at 4 tokens per block = 32 blocks; staging needs 2 more per sparse layer.
  Fixture f(DType::kFloat32, uint64_t{1} << 20, /*blocks=*/33);
  const std::string seq = f.Sequence(OmniKv(4, false), "s");
  EXPECT_THAT(f.Select(seq, 1, {1, 4}).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "staging"));
}

// The items of one call run side by side on the pool's decode threads (4 here, whatever the
// machine has) with the results of one call per sequence, bit for bit: two pools with the same
// history (8 sequences, each with its own queries), then each step as one call of 8 items on the
// first and 8 calls on the second: the same T_f, the same staging block tables (blocks are
// freed and taken in item order) and every staged value the same.
TEST(OmniKvSelect, OneCallOfManySequencesIsBitIdenticalToOneCallEach) {
  constexpr int kSequences = 8;
  for (const bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "offload" : "in arena");
    Fixture together(DType::kFloat32, uint64_t{1} << 20, /*blocks=*/400, /*decode_threads=*/4);
    Fixture alone(DType::kFloat32, uint64_t{1} << 20, /*blocks=*/400, /*decode_threads=*/4);
    std::vector<std::string> ids;
    for (int i = 0; i < kSequences; ++i) {
      ids.push_back(together.Sequence(OmniKv(4, offload), "s" + std::to_string(i)));
      ASSERT_EQ(alone.Sequence(OmniKv(4, offload), "s" + std::to_string(i)), ids.back());
    }
    absl::StatusOr<SessionView> together_view = together.pool.pool.GetSession(together.session);
    absl::StatusOr<SessionView> alone_view = alone.pool.pool.GetSession(alone.session);
    ASSERT_TRUE(together_view.ok() && alone_view.ok());
    ArenaReader together_arena(together.pool.pool, *together_view);
    ArenaReader alone_arena(alone.pool.pool, *alone_view);
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<SelectItem> items(kSequences);
      for (int i = 0; i < kSequences; ++i) {
        items[i].session_id = together.session;
        items[i].sequence_id = ids[i];
        items[i].step_id = step;
        items[i].attention = FilterQueries({1, 4}, static_cast<int>(step) * 5 + i);
        items[i].prompt_tokens = kPrompt;
      }
      absl::StatusOr<std::vector<SelectResult>> batch = together.pool.pool.Select(items);
      ASSERT_TRUE(batch.ok()) << batch.status();
      ASSERT_EQ(batch->size(), static_cast<size_t>(kSequences));
      std::set<std::vector<int32_t>> distinct;
      for (int i = 0; i < kSequences; ++i) {
        SCOPED_TRACE(testing::Message() << "step " << step << " sequence " << i);
        absl::StatusOr<SelectResult> one =
            alone.Select(ids[i], step, {1, 4}, static_cast<int>(step) * 5 + i);
        ASSERT_TRUE(one.ok()) << one.status();
        const SelectResult& a = (*batch)[i];
        ASSERT_EQ(a.filters.size(), one->filters.size());
        for (size_t f = 0; f < a.filters.size(); ++f) {
          EXPECT_EQ(a.filters[f].filter_layer, one->filters[f].filter_layer);
          EXPECT_EQ(a.filters[f].positions, one->filters[f].positions);
          EXPECT_EQ(a.filters[f].sparse_layers, one->filters[f].sparse_layers);
        }
        distinct.insert(a.filters[0].positions);
        EXPECT_EQ(a.prompt_tokens, one->prompt_tokens);
        EXPECT_EQ(a.budget_tokens, one->budget_tokens);
        EXPECT_EQ(a.host_bytes, one->host_bytes);
        ASSERT_EQ(a.sparse_layers.size(), one->sparse_layers.size());
        for (size_t j = 0; j < a.sparse_layers.size(); ++j) {
          const LayerLayoutView& x = a.sparse_layers[j];
          const LayerLayoutView& y = one->sparse_layers[j];
          EXPECT_EQ(x.layer, y.layer);
          EXPECT_EQ(x.count, y.count);
          ASSERT_EQ(x.block_table, y.block_table);
          for (int slot = 0; slot < x.count; ++slot) {
            for (int kv = 0; kv < 2; ++kv) {
              for (int h = 0; h < kHkv; ++h) {
                for (int d = 0; d < kDim; ++d) {
                  ASSERT_EQ(together_arena.At(together.layout, x.block_table, kv, h, slot, d),
                            alone_arena.At(alone.layout, y.block_table, kv, h, slot, d))
                      << "layer " << x.layer << " slot " << slot;
                }
              }
            }
          }
        }
      }
      // The sequences chose differently, so a result given to the wrong item would show.
      EXPECT_GT(distinct.size(), 1u);
    }
  }
}

// The items of one call run side by side, so a sequence may appear once: a second item for it
// is refused before anything changes (the first Select would have offloaded the prompt).
TEST(OmniKvSelect, SameSequenceTwiceInOneCallIsRefusedAndChangesNothing) {
  Fixture f;
  const std::string seq = f.Sequence(OmniKv(4, true), "s");
  SelectItem item;
  item.session_id = f.session;
  item.sequence_id = seq;
  item.step_id = 1;
  item.attention = FilterQueries({1});
  item.prompt_tokens = kPrompt;
  const std::vector<SelectItem> items = {item, item};
  EXPECT_THAT(f.pool.pool.Select(items).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "items[1]: sequence s is already selected by items[0]"));
  absl::StatusOr<SequenceLayout> layout = f.pool.pool.GetLayout(f.session, seq, {}, false);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const LayerLayoutView& layer : layout->layers) EXPECT_EQ(layer.count, kTokens);
}

TEST(OmniKvSelect, BadInputIsRefusedNamingTheField) {
  Fixture f;
  const std::string seq = f.Sequence(OmniKv(4, true), "s");
  EXPECT_THAT(f.Select(seq, 1, {2}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "attention.layers[0] = 2 is not a filter layer"));
  SelectItem item;
  item.session_id = f.session;
  item.sequence_id = seq;
  item.attention = FilterQueries({1});
  item.prompt_tokens = 99;
  EXPECT_THAT(f.pool.pool.Select({&item, 1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "prompt_tokens 99 is beyond"));
  item.prompt_tokens = 12;
  item.attention.queries.pop_back();
  EXPECT_THAT(f.pool.pool.Select({&item, 1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "attention.inline_queries"));
  // Compress and Score do not apply; a budget is refused.
  EXPECT_THAT(f.pool.pool.Compress(f.session, seq, CompressParams{}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "never evicts"));
  SequenceParams params;
  params.policy = OmniKv(4, false);
  params.budget = BudgetConfig{};
  params.budget->tokens_per_layer = 8;
  EXPECT_THAT(f.pool.pool.CreateSequence(f.session, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget must be unset"));
  params.budget.reset();
  params.policy->omnikv.filter_layers = {3, 9};
  EXPECT_THAT(f.pool.pool.CreateSequence(f.session, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "filter_layers[1] = 9"));
  params.policy->omnikv.filter_layers.clear();  // no default for 8 layers
  EXPECT_THAT(f.pool.pool.CreateSequence(f.session, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "filter_layers is required"));
  // Select on another policy's sequence.
  PolicyConfig h2o;
  h2o.name = kPolicyH2o;
  const std::string other = f.pool.Create(f.session, h2o, BudgetConfig{}, "h2o");
  item.sequence_id = other;
  item.attention = FilterQueries({1});
  EXPECT_THAT(f.pool.pool.Select({&item, 1}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "Select needs a sequence created"));
}

// A new sequence's parameters are settled by its kind (SequenceAdmission), not by tests for a
// policy in the pool: OmniKV fills in its filter layers and refuses what applies only to
// eviction; an evicting kind takes everything as given.
TEST(SequenceAdmission, TheKindSettlesANewSequencesParameters) {
  SequenceParams params;
  params.budget = BudgetConfig{};
  params.budget->tokens_per_layer = 8;

  PolicyConfig h2o;
  h2o.name = kPolicyH2o;
  auto evicting = SequenceAdmission::Resolve(h2o, params, 32, /*has_tiers=*/false);
  ASSERT_TRUE(evicting.ok()) << evicting.status();
  EXPECT_TRUE(evicting->evicts());
  EXPECT_EQ(evicting->Budget(*params.budget).tokens_per_layer, 8);
  // retain_evicted is the pool's to check against its tiers, not the evicting kind's.
  params.retain_evicted = true;
  EXPECT_TRUE(SequenceAdmission::Resolve(h2o, params, 32, false).ok());
  params.retain_evicted = false;

  PolicyConfig omnikv;
  omnikv.name = kPolicyOmniKv;
  EXPECT_THAT(SequenceAdmission::Resolve(omnikv, params, 32, false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "budget must be unset"));
  params.budget.reset();
  auto selecting = SequenceAdmission::Resolve(omnikv, params, 32, false);
  ASSERT_TRUE(selecting.ok()) << selecting.status();
  EXPECT_FALSE(selecting->evicts());
  EXPECT_EQ(omnikv.omnikv.filter_layers, DefaultOmniKvFilterLayers(32));
  BudgetConfig requested;
  requested.tokens_per_layer = 8;
  EXPECT_EQ(selecting->Budget(requested).tokens_per_layer, 0);
  // Sliding windows: served on any layer but a filter layer (the defaults 2, 8, 18 here).
  params.layer_windows.assign(32, 0);
  params.layer_windows[3] = 16;
  PolicyConfig windowed;
  windowed.name = kPolicyOmniKv;
  EXPECT_TRUE(SequenceAdmission::Resolve(windowed, params, 32, false).ok());
  params.layer_windows[8] = 16;
  EXPECT_THAT(SequenceAdmission::Resolve(windowed, params, 32, false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "policy.omnikv.filter_layers[1] = 8 is a sliding-window layer"));
  params.layer_windows.clear();
  params.retain_evicted = true;
  EXPECT_THAT(SequenceAdmission::Resolve(omnikv, params, 32, true).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "retain_evicted does not apply to policy omnikv"));
  params.retain_evicted = false;
  omnikv.omnikv.offload = true;
  EXPECT_THAT(SequenceAdmission::Resolve(omnikv, params, 32, false).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "policy.omnikv.offload needs"));
  EXPECT_TRUE(SequenceAdmission::Resolve(omnikv, params, 32, true).ok());
}

// Sliding-window layers on an OmniKV sequence (Gemma 3's local layers), through the pool: each
// holds its last W tokens at every commit and is never staged, the filters select as without
// windows, and the full-attention layers past the wait layers are the only sparse ones. A
// windowed filter layer is refused, naming it, and nothing is created.
TEST(SequenceAdmission, PoolServesOmniKvWithSlidingWindowLayers) {
  constexpr int32_t kWindow = 5;
  for (const bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "offload" : "in the arena");
    Fixture f;
    SequenceParams params;
    params.policy = OmniKv(4, offload);  // filters 1 and 4, one wait layer each
    // Layers 0, 3 and 6 windowed: roles prefix-windowed, filter, wait, windowed, filter, wait,
    // windowed, sparse.
    params.layer_windows = {kWindow, 0, 0, kWindow, 0, 0, kWindow, 0};
    params.sequence_id = "gemma";
    absl::StatusOr<SequenceCreated> created = f.pool.pool.CreateSequence(f.session, params);
    ASSERT_TRUE(created.ok()) << created.status();
    ASSERT_TRUE(Append(f.pool.pool, f.session, "gemma", kTokens, f.layout, Tv7).ok());
    absl::StatusOr<SequenceLayout> held = f.pool.pool.GetLayout(f.session, "gemma", {}, true);
    ASSERT_TRUE(held.ok()) << held.status();
    for (int32_t l : {0, 3, 6}) {
      EXPECT_EQ(held->layers[l].count, kWindow) << l;
      EXPECT_EQ(held->layers[l].window, kWindow) << l;
      EXPECT_THAT(held->layers[l].positions,
                  UnorderedElementsAre(9, 10, 11, 12, 13, 9, 10, 11, 12, 13));
    }

    absl::StatusOr<SelectResult> result = f.Select("gemma", 1, {1, 4});
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->filters.size(), 2u);
    EXPECT_THAT(result->filters[0].positions, ElementsAre(1, 2, 5, 9));  // as TV7
    EXPECT_TRUE(result->filters[0].sparse_layers.empty());               // layer 3 is windowed
    EXPECT_THAT(result->filters[1].positions, ElementsAre(3, 6, 7, 10));
    EXPECT_THAT(result->filters[1].sparse_layers, ElementsAre(7));
    const uint64_t per_layer = uint64_t{kPrompt} * 2 * kHkv * f.layout.row_bytes();
    EXPECT_EQ(result->host_bytes,
              offload ? per_layer + std::string("omnikv offloaded prompt").size() : 0u);
    ASSERT_EQ(result->sparse_layers.size(), 1u);
    EXPECT_EQ(result->sparse_layers[0].layer, 7);
    ASSERT_EQ(result->sparse_layers[0].count, 6);
    absl::StatusOr<SessionView> view = f.pool.pool.GetSession(f.session);
    ASSERT_TRUE(view.ok());
    {
      ArenaReader arena(f.pool.pool, *view);
      const std::vector<int32_t> staged_positions = {3, 6, 7, 10, 12, 13};
      for (int s = 0; s < 6; ++s) {
        for (int kv = 0; kv < 2; ++kv) {
          for (int h = 0; h < kHkv; ++h) {
            for (int d = 0; d < kDim; ++d) {
              ASSERT_EQ(arena.At(f.layout, result->sparse_layers[0].block_table, kv, h, s, d),
                        Tv7(7, kv, h, staged_positions[s], d))
                  << "slot " << s << " kv " << kv << " head " << h;
            }
          }
        }
      }
    }

    // A decode token: the windows slide, the sparse layer's tail grows, the rest hold it all.
    ASSERT_TRUE(Append(f.pool.pool, f.session, "gemma", 1, f.layout, Tv7).ok());
    absl::StatusOr<SelectResult> next = f.Select("gemma", 2, {1, 4});
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_EQ(next->sparse_layers.size(), 1u);
    EXPECT_EQ(next->sparse_layers[0].count, 4 + 3);
    held = f.pool.pool.GetLayout(f.session, "gemma", {}, true);
    ASSERT_TRUE(held.ok());
    for (int32_t l = 0; l < kLayers; ++l) {
      const bool windowed = l == 0 || l == 3 || l == 6;
      const int32_t expected = windowed ? kWindow : (offload && l == 7 ? 3 : kTokens + 1);
      EXPECT_EQ(held->layers[l].count, expected) << l;
    }
    // The window's rows are the tokens its positions name (10..14).
    ArenaReader arena(f.pool.pool, *view);
    const LayerLayoutView& window = held->layers[6];
    EXPECT_THAT(window.positions, UnorderedElementsAre(10, 11, 12, 13, 14, 10, 11, 12, 13, 14));
    for (int h = 0; h < kHkv; ++h) {
      for (int s = 0; s < kWindow; ++s) {
        const int32_t position = window.positions[h * kWindow + s];
        for (int kv = 0; kv < 2; ++kv) {
          EXPECT_EQ(arena.At(f.layout, window.block_table, kv, h, s, 2), Tv7(6, kv, h, position, 2))
              << "windowed layer 6 head " << h << " slot " << s;
        }
      }
    }
  }

  Fixture f;
  SequenceParams params;
  params.policy = OmniKv(4, false);
  params.layer_windows = {0, 0, 0, 0, kWindow, 0, 0, 0};
  params.sequence_id = "w";
  EXPECT_THAT(f.pool.pool.CreateSequence(f.session, params).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "policy.omnikv.filter_layers[1] = 4 is a sliding-window layer "
                       "(layer_windows[4] = 5)"));
  EXPECT_TRUE(f.pool.pool.ListSequences(f.session).empty());
}

TEST(OmniKvSelect, WindowSelectorForcesThePromptQueriesTokensTv3) {
  // TV3: N = 8, two window queries at prompt positions 6 and 7 (p = 2), uniform, s = 1,
  // K[0,4] = (1,0), K[0,6] = (5,0), every other key 0; k = 3 and k = 1 both give [4, 6, 7].
  ModelLayout layout = MakeLayout(3, 1, 2, DType::kFloat32, 4);  // filter, wait, sparse
  storage::TierOptions options;
  options.host_capacity_bytes = 1 << 20;
  auto tiers = storage::TierManager::Open(options);
  PoolOptions pool_options = Fixture::Options(tiers.get());
  TestPool pool(pool_options);
  const std::string session = pool.Attach(layout, 16);
  auto keys = [](int, int kv, int, int32_t t, int d) -> float {
    if (kv == 1 || d != 0) return 0.0f;
    return t == 4 ? 1.0f : t == 6 ? 5.0f : 0.0f;
  };
  for (int32_t k : {3, 1}) {
    PolicyConfig policy;
    policy.name = kPolicyOmniKv;
    policy.omnikv.filter_layers = {0};
    policy.omnikv.selected_tokens = k;
    policy.omnikv.selector = OmniKvSelector::kUniform;
    policy.omnikv.window = 16;
    const std::string seq = pool.Create(session, policy, BudgetConfig{}, "k" + std::to_string(k));
    ASSERT_TRUE(Append(pool.pool, session, seq, 8, layout, keys).ok());
    SelectItem item;
    item.session_id = session;
    item.sequence_id = seq;
    item.attention.layers = {0};
    item.attention.num_queries = 2;
    item.attention.query_positions = {6, 7};
    item.attention.softmax_scale = 1.0f;
    item.attention.queries = {2, 0, 1, 0};  // [Hq 1][w 2][D 2]
    absl::StatusOr<std::vector<SelectResult>> result = pool.pool.Select({&item, 1});
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_THAT((*result)[0].filters[0].positions, ElementsAre(4, 6, 7)) << "k " << k;
    EXPECT_THAT((*result)[0].filters[0].sparse_layers, ElementsAre(2));
  }
}

}  // namespace
}  // namespace kvs
