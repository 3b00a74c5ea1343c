// The shape of one model's KV cache (ModelLayout) and the byte geometry of a block of it.
// Value types, no threading concerns.
#ifndef KVSIDECAR_GPU_BASE_LAYOUT_H_
#define KVSIDECAR_GPU_BASE_LAYOUT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "gpu/base/dtype.h"

namespace kvs {

inline constexpr int kDefaultBlockTokens = 16;
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxHeads = 1024;
inline constexpr int kMaxHeadDim = 4096;
inline constexpr int kMaxBlockTokens = 1024;
// One block may not exceed this many bytes (keeps every in-block offset in 32 bits).
inline constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 31;

struct ModelLayout {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t num_q_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kFloat16;
  int32_t block_tokens = kDefaultBlockTokens;

  // INVALID_ARGUMENT naming the field (prefixed by `field_prefix`, e.g. "layout.") when a value is
  // out of range, when num_q_heads is not a multiple of num_kv_heads, or when a block is too big.
  absl::Status Validate(const char* field_prefix = "layout.") const;

  int dtype_bytes() const { return DTypeBytes(dtype); }
  // Elements of one (kv, head) row of one token: head_dim.
  uint64_t row_bytes() const { return static_cast<uint64_t>(head_dim) * dtype_bytes(); }
  // Bytes of one block: [2][H][B][D] elements. Valid only after Validate() succeeded.
  uint64_t block_bytes() const {
    return 2ull * num_kv_heads * block_tokens * head_dim * dtype_bytes();
  }
  // Byte offset, inside a block, of the row of (kv = 0 keys / 1 values, head, in_block slot).
  uint64_t RowOffsetInBlock(int kv, int head, int in_block) const {
    return ((static_cast<uint64_t>(kv) * num_kv_heads + head) * block_tokens + in_block) *
           row_bytes();
  }
  // Byte offset in the arena of (kv, head, slot) of a layer whose block table is `blocks`.
  uint64_t SlotRowOffset(const int32_t* blocks, int kv, int head, int64_t slot) const {
    return static_cast<uint64_t>(blocks[slot / block_tokens]) * block_bytes() +
           RowOffsetInBlock(kv, head, static_cast<int>(slot % block_tokens));
  }
  // Bytes of one token of one layer (K and V, all heads).
  uint64_t token_bytes() const { return 2ull * num_kv_heads * row_bytes(); }

  bool operator==(const ModelLayout&) const = default;
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_LAYOUT_H_
