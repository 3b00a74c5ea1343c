#include "gpu/cpu/attention_cpu.h"

namespace kvs {

absl::Status RunAttentionProbs(absl::Span<const AttentionJob>, ThreadPool&) {
  return absl::UnimplementedError("AttentionProbs: not yet implemented");
}

}  // namespace kvs
