#include "cache/policy/caote.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/cake.h"
#include "cache/policy/h2o.h"
#include "cache/policy/snapkv.h"
#include "cache/policy/tova.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kDefaultCaoteEps = 1e-6f;
constexpr int32_t kDefaultCaoteSnapKvWindow = 32;
constexpr int32_t kDefaultCaoteSnapKvKernel = 5;

// Normalises every row of `reduced` ([rows][n], non-negative, +inf allowed) into alpha summing to
// 1 over its finite entries; a row whose finite entries sum to 0 becomes uniform over them
// (caote.md §3.7). `infinite` marks the +inf entries, which get alpha 0; it is left empty when
// there are none (the common case: only CAKE's window scores +inf). The buffers are reused.
void Normalise(const float* reduced, int64_t rows, int64_t n, std::vector<float>& alpha,
               std::vector<uint8_t>& infinite) {
  const size_t size = static_cast<size_t>(rows * n);
  alpha.resize(size);
  infinite.clear();
  bool any_infinite = false;
  for (size_t j = 0; j < size; ++j) any_infinite |= std::isinf(reduced[j]);
  if (any_infinite) {
    infinite.resize(size);
    for (size_t j = 0; j < size; ++j) infinite[j] = std::isinf(reduced[j]) ? 1 : 0;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = reduced + r * n;
    float* out = alpha.data() + r * n;
    double sum = 0.0;
    int64_t finite = n;
    if (any_infinite) {
      finite = 0;
      for (int64_t s = 0; s < n; ++s) {
        if (!std::isinf(in[s])) {
          sum += in[s];
          ++finite;
        }
      }
    } else {
      for (int64_t s = 0; s < n; ++s) sum += in[s];
    }
    for (int64_t s = 0; s < n; ++s) {
      if (any_infinite && std::isinf(in[s])) {
        out[s] = 0.0f;
        continue;
      }
      out[s] = sum > 0.0 ? static_cast<float>(in[s] / sum) : static_cast<float>(1.0 / finite);
    }
  }
}

// Index of the first raw score that is NaN or negative, or -1. The scan is a branch-free
// reduction (it runs over every raw score of every layer of every step); the index is only looked
// for when one is bad.
int64_t FirstInvalidRaw(absl::Span<const float> raw) {
  bool bad = false;
  for (const float x : raw) bad |= !(x >= 0.0f);
  if (!bad) return -1;
  for (size_t j = 0; j < raw.size(); ++j) {
    if (!(raw[j] >= 0.0f)) return static_cast<int64_t>(j);
  }
  return -1;
}

// sqrt(sum c^2) over each kv head's `group` rows of `rows_in` ([H * group][n]) into out [H][n].
void CombineRss(const float* rows_in, int64_t heads, int64_t group, int64_t n, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t s = 0; s < n; ++s) {
      double sum = 0.0;
      for (int64_t j = 0; j < group; ++j) {
        const double c = rows_in[(h * group + j) * n + s];
        sum += c * c;  // +inf stays +inf
      }
      out[h * n + s] = static_cast<float>(std::sqrt(sum));
    }
  }
}

absl::Status CheckFinite(const float* scores, int64_t size, int32_t layer) {
  bool any_nan = false;  // branch-free first: this runs over every score of every step
  for (int64_t j = 0; j < size; ++j) any_nan |= std::isnan(scores[j]);
  if (!any_nan) return absl::OkStatus();
  for (int64_t j = 0; j < size; ++j) {
    if (std::isnan(scores[j])) {
      return absl::InternalError(
          absl::StrCat("policy caote: NaN score in layer ", layer, " at ", j));
    }
  }
  return absl::OkStatus();
}

}  // namespace

CaotePolicy::CaotePolicy(const PolicyConfig& config, std::unique_ptr<AttentionScoredPolicy> base)
    : ScoredPolicy(config, MakeLayerAllocator(config)), base_(std::move(base)) {}

ScoredPolicy::Protection CaotePolicy::Protect(Phase phase, const LayerSelection& layer) const {
  const Protection from_base = base_->BaseProtect(phase, layer);
  const int32_t sinks = std::clamp(std::max(from_base.sinks, config().caote.n_sink), 0, layer.keep);
  const int32_t recent =
      std::clamp(std::max(from_base.recent, config().caote.n_recent), 0, layer.keep - sinks);
  return Protection{sinks, recent};
}

absl::Status CaotePolicy::Score(Backend& backend, Phase phase,
                                absl::Span<const LayerSelection> layers,
                                absl::Span<float* const> scores) const {
  const CaoteConfig& caote = config().caote;
  // Per layer: the normalised weights, their +inf marks and (rss) the per-row scores; the
  // buffers live until the batched backend call has finished.
  struct Work {
    int32_t rows = 0;  // rows of alpha: H (mean) or the base's rows (rss)
    std::vector<float> alpha;
    std::vector<uint8_t> infinite;
    std::vector<float> row_scores;  // rss only
    bool batched = false;
  };
  // Reused per thread across calls (a decode step calls this for every sequence): no
  // allocations, and no fresh pages to fault in, per step.
  thread_local std::vector<Work> work;
  thread_local std::vector<CaoteJob> jobs;
  thread_local std::vector<float> raw_storage;
  thread_local std::vector<float> reduced;
  if (work.size() < layers.size()) work.resize(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) work[i].batched = false;
  jobs.clear();
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSelection& layer = layers[i];
    const int64_t heads = layer.keys.num_kv_heads;
    const int64_t count = layer.keys.count;
    KVS_ASSIGN_OR_RETURN(const AttentionScoredPolicy::RawRows base_raw,
                         base_->RawScores(backend, phase, layer, raw_storage));
    const absl::Span<const float> raw = base_raw.values;
    const int32_t rows = base_raw.rows;
    if (rows < heads || rows % heads != 0 ||
        raw.size() != static_cast<size_t>(rows) * static_cast<size_t>(count)) {
      return absl::InternalError(absl::StrCat("policy caote: the base gave ", raw.size(),
                                              " raw scores in ", rows, " rows for layer ",
                                              layer.layer, " of ", heads, " x ", count));
    }
    // NaN or negative: the normalisation would be meaningless.
    if (const int64_t j = FirstInvalidRaw(raw); j >= 0) {
      return absl::InternalError(absl::StrCat("policy caote: base raw score ", raw[j], " in layer ",
                                              layer.layer, " at ", j));
    }
    float* out = scores[i];
    if (caote.variant == CaoteVariant::kNone) {
      GqaMean(raw, rows, static_cast<int32_t>(heads), static_cast<int32_t>(count),
              absl::MakeSpan(out, static_cast<size_t>(heads * count)));
      continue;
    }
    Work& w = work[i];
    if (caote.gqa_reduce == GqaReduce::kMean || rows == heads) {
      // Mean and sum give the same alpha; one CAOTE per kv head (caote.md §4).
      reduced.resize(static_cast<size_t>(heads * count));
      GqaMean(raw, rows, static_cast<int32_t>(heads), static_cast<int32_t>(count),
              absl::MakeSpan(reduced));
      w.rows = static_cast<int32_t>(heads);
      Normalise(reduced.data(), heads, count, w.alpha, w.infinite);
    } else {
      w.rows = rows;
      Normalise(raw.data(), rows, count, w.alpha, w.infinite);
    }
    if (caote.greedy) {
      if (w.infinite.empty()) w.infinite.assign(w.alpha.size(), 0);  // GreedyScores reads it
      KVS_RETURN_IF_ERROR(GreedyScores(backend, phase, layer, w.alpha, w.rows, w.infinite, out));
      continue;
    }
    CaoteJob job;
    job.values = ValuesOf(layer.keys);
    job.alpha = w.alpha.data();
    job.rows = w.rows;
    job.fast = caote.variant == CaoteVariant::kFast;
    job.eps = caote.eps;
    if (w.rows == heads) {
      job.scores = out;
    } else {
      w.row_scores.resize(w.alpha.size());  // every entry is written by the backend
      job.scores = w.row_scores.data();
    }
    w.batched = true;
    jobs.push_back(job);
  }
  if (!jobs.empty()) {
    KVS_RETURN_IF_ERROR(backend.CaoteScores(jobs, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    Work& w = work[i];
    const int64_t heads = layers[i].keys.num_kv_heads;
    const int64_t count = layers[i].keys.count;
    float* out = scores[i];
    if (w.batched) {
      float* per_row = w.rows == heads ? out : w.row_scores.data();
      for (size_t j = 0; j < w.infinite.size(); ++j) {
        if (w.infinite[j] != 0) per_row[j] = kInf;
      }
      if (w.rows != heads) CombineRss(per_row, heads, w.rows / heads, count, out);
    }
    KVS_RETURN_IF_ERROR(CheckFinite(out, heads * count, layers[i].layer));
  }
  return absl::OkStatus();
}

namespace {

// One greedy CAOTE pass over a layer (caote.md greedy extension): every step renormalises alpha
// over the tokens left, scores them and evicts the lowest of each head.
struct GreedyPass {
  int32_t heads = 0;
  int32_t n = 0;      // tokens of the layer
  int32_t rows = 0;   // query heads (or kv heads after the GQA mean)
  int32_t group = 0;  // rows per kv head
  bool fast = false;
  float eps = 0.0f;
  const std::vector<float>* alpha = nullptr;
  const std::vector<uint8_t>* infinite = nullptr;
  std::vector<uint8_t> forced;     // protected slots, never evicted
  std::vector<uint8_t> remaining;  // per (head, slot)
  std::vector<int32_t> evicted_at;
  std::vector<int32_t> left;  // |R| per head
  std::vector<float> renormalised, job_alpha, row_scores, combined;
};

// alpha over the tokens left: alpha_i / (1 - sum of the evicted alphas), per row.
void Renormalise(GreedyPass& p) {
  const std::vector<float>& alpha = *p.alpha;
  const std::vector<uint8_t>& infinite = *p.infinite;
  for (int32_t r = 0; r < p.rows; ++r) {
    const int32_t h = r / p.group;
    const int64_t base = int64_t{r} * p.n;
    const uint8_t* in = p.remaining.data() + int64_t{h} * p.n;
    double sum = 0.0;
    int32_t finite = 0;
    for (int32_t s = 0; s < p.n; ++s) {
      if (in[s] != 0 && infinite[base + s] == 0) {
        sum += alpha[base + s];
        ++finite;
      }
    }
    for (int32_t s = 0; s < p.n; ++s) {
      float a = 0.0f;
      if (in[s] != 0 && infinite[base + s] == 0) {
        a = sum > 0.0 ? static_cast<float>(alpha[base + s] / sum)
                      : static_cast<float>(1.0 / finite);
      }
      p.renormalised[base + s] = a;
      // Fast: uniform weights over the tokens left make the backend's exact X their plain
      // mean, and its score (1/|R|)/(1 - 1/|R|) * ||mean - v|| gives the distance back.
      p.job_alpha[base + s] =
          p.fast ? (in[s] != 0 ? 1.0f / static_cast<float>(p.left[h]) : 0.0f) : a;
    }
  }
}

// The backend's row scores turned into the step's: 0 for evicted tokens, inf for the infinite
// ones, and the fast variant's distance scaled back to a score.
void FinishRowScores(GreedyPass& p) {
  const std::vector<uint8_t>& infinite = *p.infinite;
  for (int32_t r = 0; r < p.rows; ++r) {
    const int32_t h = r / p.group;
    const int64_t base = int64_t{r} * p.n;
    for (int32_t s = 0; s < p.n; ++s) {
      float& c = p.row_scores[base + s];
      if (p.remaining[int64_t{h} * p.n + s] == 0) {
        c = 0.0f;
        continue;
      }
      if (infinite[base + s] != 0) {
        c = kInf;
        continue;
      }
      if (p.fast) {
        const float a = p.renormalised[base + s];
        const double distance = p.left[h] > 1 ? double{c} * (p.left[h] - 1) : 0.0;
        if (a == 0.0f) {
          c = 0.0f;
        } else if (1.0f - a <= p.eps) {
          c = kInf;
        } else {
          c = static_cast<float>(a / (1.0 - a) * distance);
        }
      }
    }
  }
}

// Evicts the lowest-scored unprotected token of every head at `step`.
absl::Status EvictLowest(GreedyPass& p, const LayerSelection& layer, int32_t step) {
  for (int32_t h = 0; h < p.heads; ++h) {
    const int64_t base = int64_t{h} * p.n;
    const int32_t* pos = layer.positions.data() + base;
    int32_t victim = -1;
    for (int32_t s = 0; s < p.n; ++s) {
      if (p.remaining[base + s] == 0 || p.forced[base + s] != 0) continue;
      // The lowest score goes; on a tie the higher position goes (the lower one is kept).
      if (victim < 0 || p.combined[base + s] < p.combined[base + victim] ||
          (p.combined[base + s] == p.combined[base + victim] && pos[s] > pos[victim])) {
        victim = s;
      }
    }
    if (victim < 0) {
      return absl::InternalError(absl::StrCat("policy caote: nothing left to evict greedily in ",
                                              "layer ", layer.layer, " head ", h));
    }
    p.remaining[base + victim] = 0;
    p.evicted_at[base + victim] = step;
    --p.left[h];
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CaotePolicy::GreedyScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                       const std::vector<float>& alpha, int32_t rows,
                                       const std::vector<uint8_t>& infinite, float* scores) const {
  const CaoteConfig& caote = config().caote;
  GreedyPass p;
  p.fast = caote.variant == CaoteVariant::kFast;
  p.eps = caote.eps;
  p.heads = layer.keys.num_kv_heads;
  p.n = layer.keys.count;
  p.rows = rows;
  p.group = rows / p.heads;
  p.alpha = &alpha;
  p.infinite = &infinite;
  const int32_t evictions = p.n - layer.keep;
  const int64_t size = int64_t{p.heads} * p.n;

  // Protected slots are never evicted; they still carry weight in every renormalisation.
  const Protection protection = Protect(phase, layer);
  p.forced.assign(static_cast<size_t>(size), 0);
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (int32_t h = 0; h < p.heads; ++h) {
    MarkSinksAndRecent(layer.positions.data() + int64_t{h} * p.n, p.n, protection.sinks,
                       protection.recent, scratch, bitmap, p.forced.data() + int64_t{h} * p.n);
  }
  p.remaining.assign(static_cast<size_t>(size), 1);
  p.evicted_at.assign(static_cast<size_t>(size), -1);
  p.left.assign(p.heads, p.n);
  p.renormalised.resize(alpha.size());
  p.job_alpha.resize(alpha.size());
  p.row_scores.resize(alpha.size());
  p.combined.resize(static_cast<size_t>(size));
  for (int32_t step = 0;; ++step) {
    Renormalise(p);
    CaoteJob job;
    job.values = ValuesOf(layer.keys);
    job.alpha = p.job_alpha.data();
    job.rows = rows;
    job.fast = false;
    job.eps = caote.eps;
    job.scores = p.row_scores.data();
    KVS_RETURN_IF_ERROR(backend.CaoteScores({job}, nullptr));
    KVS_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    FinishRowScores(p);
    if (p.group == 1) {
      p.combined = p.row_scores;
    } else {
      CombineRss(p.row_scores.data(), p.heads, p.group, p.n, p.combined.data());
    }
    KVS_RETURN_IF_ERROR(CheckFinite(p.combined.data(), size, layer.layer));
    if (step == evictions) break;
    KVS_RETURN_IF_ERROR(EvictLowest(p, layer, step));
  }
  for (int64_t j = 0; j < size; ++j) {
    scores[j] =
        p.evicted_at[j] >= 0 ? static_cast<float>(p.evicted_at[j] - evictions) : p.combined[j];
  }
  return absl::OkStatus();
}

std::unique_ptr<AttentionScoredPolicy> MakeCaoteBase(const PolicyConfig& config) {
  const CaoteConfig& caote = config.caote;
  switch (caote.base) {
    case CaoteBase::kTova:
      return std::make_unique<TovaPolicy>(config, config.tova);
    case CaoteBase::kSnapKv:
      return std::make_unique<SnapKvPolicy>(config, caote.snapkv);
    case CaoteBase::kCake:
      return MakeCakeScorer(config, caote.cake);
    case CaoteBase::kH2o:
    default:
      return std::make_unique<H2oPolicy>(config, H2oConfig{caote.n_sink, caote.n_recent});
  }
}

absl::Status ResolveCaoteConfig(PolicyConfig& config) {
  CaoteConfig& caote = config.caote;
  switch (caote.base) {
    case CaoteBase::kH2o:
    case CaoteBase::kTova:
    case CaoteBase::kSnapKv:
    case CaoteBase::kCake:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy.caote.base is not a known base: ", static_cast<int>(caote.base)));
  }
  switch (caote.variant) {
    case CaoteVariant::kExact:
    case CaoteVariant::kFast:
    case CaoteVariant::kNone:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.caote.variant is not a known variant: ", static_cast<int>(caote.variant)));
  }
  if (caote.gqa_reduce != GqaReduce::kMean && caote.gqa_reduce != GqaReduce::kRss) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.caote.gqa_reduce is not a known reduction: ", static_cast<int>(caote.gqa_reduce)));
  }
  if (caote.eps == 0.0f) caote.eps = kDefaultCaoteEps;  // zero values mean the spec's default
  if (!(caote.eps > 0.0f && caote.eps < 0.5f)) {        // written so that NaN fails too
    return absl::InvalidArgumentError(
        absl::StrCat("policy.caote.eps must be in (0, 0.5), got ", caote.eps));
  }
  if (caote.n_sink < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.caote.n_sink must be >= 0, got ", caote.n_sink));
  }
  if (caote.n_recent < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.caote.n_recent must be >= 0, got ", caote.n_recent));
  }
  KVS_RETURN_IF_ERROR(ResolveSnapKvParams(caote.snapkv, "policy.caote.snapkv",
                                          kDefaultCaoteSnapKvWindow, kDefaultCaoteSnapKvKernel));
  if (caote.base == CaoteBase::kCake) {
    KVS_RETURN_IF_ERROR(ResolveCakeParams(caote.cake, "policy.caote.cake"));
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeCaotePolicy(const PolicyConfig& config) {
  return std::make_unique<CaotePolicy>(config, MakeCaoteBase(config));
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeCaoteParams(const PolicyConfig& config, FieldWriter& out) {
  const CaoteConfig& c = config.caote;
  out.Enum(1, c.base);
  out.Enum(2, c.variant);
  out.Enum(3, c.gqa_reduce);
  out.F32(4, c.eps);
  out.I32(5, c.n_sink);
  out.I32(6, c.n_recent);
  out.Bool(7, c.greedy);
  FieldWriter snapkv, cake;
  EncodeSnapKvFields(c.snapkv, snapkv);
  EncodeCakeFields(c.cake, cake);
  out.Bytes(8, snapkv.bytes());
  out.Bytes(9, cake.bytes());
  // The TOVA base's own parameter (CAOTE over TOVA).
  out.Bool(10, config.tova.all_heads);
  if (config.tova.keep_last_token) out.Bool(11, true);  // absent = false, as earlier builds
}
bool DecodeCaoteParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  CaoteConfig& c = config->caote;
  std::string snapkv_bytes, cake_bytes;
  FieldReader snapkv, cake;
  return in.Enum(1, &c.base) && in.Enum(2, &c.variant) && in.Enum(3, &c.gqa_reduce) &&
         in.F32(4, &c.eps) && in.I32(5, &c.n_sink) && in.I32(6, &c.n_recent) &&
         in.Bool(7, &c.greedy) && in.Bytes(8, &snapkv_bytes) && snapkv.Parse(snapkv_bytes) &&
         DecodeSnapKvFields(snapkv, &c.snapkv) && in.Bytes(9, &cake_bytes) &&
         cake.Parse(cake_bytes) && DecodeCakeFields(cake, &c.cake) &&
         in.Bool(10, &config->tova.all_heads) && in.Bool(11, &config->tova.keep_last_token);
}
AllocatorDefaults CaoteAllocatorDefaults(const PolicyConfig& config) {
  if (config.caote.base == CaoteBase::kCake) {
    return {LayerAllocatorKind::kCake, &config.caote.cake, config.caote.cake.window};
  }
  return {};
}
}  // namespace

extern const PolicyUnit kCaoteUnit;
const PolicyUnit kCaoteUnit = {
    .name = kPolicyCaote,
    .capabilities = {.needs_attention = true},
    .resolve = &ResolveCaoteConfig,
    .make = &MakeCaotePolicy,
    .allocator_defaults = &CaoteAllocatorDefaults,
    .encode_params = &EncodeCaoteParams,
    .decode_params = &DecodeCaoteParams,
};

}  // namespace kvs
