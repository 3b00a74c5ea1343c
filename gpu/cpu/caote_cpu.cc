#include "gpu/cpu/caote_cpu.h"

namespace kvs {

absl::Status RunCaoteScores(absl::Span<const CaoteJob>, ThreadPool&) {
  return absl::UnimplementedError("CaoteScores: not yet implemented");
}

}  // namespace kvs
