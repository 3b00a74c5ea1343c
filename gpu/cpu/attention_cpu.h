// Attention probabilities on the host (Backend::AttentionProbs semantics, gpu/backend.h), exposed
// for the CPU backend and its tests. The hot loop is the q·k dot products of a GQA group's window
// queries against each key row: with 8+ rows per kv head (windows) a small GEMM per 48-slot tile
// of keys converted to fp32 once; with fewer (decode) the keys are converted in registers as they
// stream from the arena, every kv head of a job per tile (block order). fp32 with AVX2/FMA when the
// CPU has it (the window kernel with AVX-512 where the CPU has that), and an online per-tile
// softmax folded per row at the end. Also the paged-row helpers the other CPU kernels (CAOTE,
// nearest keys) share.
//
// Threading: RunAttentionProbs spreads (job, kv head or all kv heads[, chunk of slots]) tasks over
// `pool`; it may be called concurrently from several threads. The helpers are pure.
#ifndef KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_
#define KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/cpu_isa.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// INVALID_ARGUMENT "attention job <index>: <field> ..." when the job cannot be computed safely
// (shape, scale, null pointers, block table). Reads the block table. Shared by every backend
// that validates on the host (gpu/staging_backend.h, gpu/cuda) so that messages agree.
absl::Status ValidateAttentionJob(const AttentionJob& job, size_t index);

// Validates every job (INVALID_ARGUMENT naming the job index and the field; nothing written),
// then computes them all.
absl::Status RunAttentionProbs(absl::Span<const AttentionJob> jobs, ThreadPool& pool);

// Backend::AttentionLogits: the scaled logits (-inf where masked), validated like
// RunAttentionProbs. One task per (job, kv head, chunk of slots); each key row is converted once
// and dotted with every query row of its GQA group. `max_isa` caps the kernels (kScalar forces
// the scalar code; there is no AVX-512 variant: the pass is bound by the key stream).
absl::Status RunAttentionLogits(absl::Span<const AttentionJob> jobs, ThreadPool& pool,
                                CpuIsa max_isa = CpuIsa::kAvx512);

// Test hook: the same with the kernels capped at `max_isa` (gpu/cpu/cpu_isa.h; a level the CPU
// lacks falls to the best one below it). kScalar is the portable code, which RunAttentionProbs
// also uses on CPUs without AVX2/FMA/F16C or when head_dim % 8 != 0; kAvx512 runs the window
// kernel (8+ query rows per kv head) with AVX-512 and the decode kernel with AVX2.
absl::Status RunAttentionProbsWithIsa(absl::Span<const AttentionJob> jobs, ThreadPool& pool,
                                      CpuIsa max_isa);

// Backend::AttentionColumnSums: validated like RunAttentionProbs (sums in place of probs), then
// one task per (job, kv head) (per job when a head has fewer than 8 query rows) computes the
// head's probabilities tile by tile with the window kernel into a per-thread buffer and adds the
// normalised rows into `sums`; the probabilities never reach the caller's memory. Jobs of one
// query row are AttentionProbs with probs = sums. `max_isa` caps the kernels as in
// RunAttentionProbsWithIsa.
absl::Status ValidateAttentionSumsJob(const AttentionSumsJob& job, size_t index);
absl::Status RunAttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, ThreadPool& pool,
                                    CpuIsa max_isa = CpuIsa::kAvx512);

// Shared by the CPU kernels over paged layers (attention, CAOTE, nearest keys).

// The row of (view.kv_index, head, slot) as gpu/backend.h lays it out.
inline const uint8_t* PagedRow(const PagedLayerView& view, int64_t head, int64_t slot) {
  const uint64_t row_bytes = static_cast<uint64_t>(view.head_dim) * DTypeBytes(view.dtype);
  return view.arena +
         static_cast<uint64_t>(view.block_table[slot / view.block_tokens]) * view.block_bytes +
         ((static_cast<uint64_t>(view.kv_index) * view.num_kv_heads + head) * view.block_tokens +
          slot % view.block_tokens) *
             row_bytes;
}

// The rows of slots [s0, s0 + n) of one head into rows[0, n): rows of one block are contiguous,
// so only the first row of each run within a block costs a block-table lookup and a division.
inline void PagedRows(const PagedLayerView& view, int64_t head, int64_t s0, int n,
                      const uint8_t** rows) {
  const uint64_t row_bytes = static_cast<uint64_t>(view.head_dim) * DTypeBytes(view.dtype);
  int j = 0;
  while (j < n) {
    const int64_t s = s0 + j;
    const int64_t left_in_block = view.block_tokens - s % view.block_tokens;
    const int run = static_cast<int>(left_in_block < n - j ? left_in_block : n - j);
    const uint8_t* first = PagedRow(view, head, s);
    for (int k = 0; k < run; ++k) rows[j + k] = first + k * row_bytes;
    j += run;
  }
}

// INVALID_ARGUMENT "<context>: <field>.<member> ..." unless the view's shape, dtype, kv_index and
// block_bytes are consistent and, when count > 0, its arena and block table are usable.
absl::Status ValidatePagedLayerView(const PagedLayerView& view, std::string_view context,
                                    std::string_view field);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_
