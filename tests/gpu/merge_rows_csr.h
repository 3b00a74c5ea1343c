// Test helper: builds the CSR arrays of a RowMergeJob (gpu/backend.h) one merged row at a time,
// so that tests state each row as (dst, sources, weights) and get a job over arrays it keeps.
#ifndef KVSIDECAR_TESTS_GPU_MERGE_ROWS_CSR_H_
#define KVSIDECAR_TESTS_GPU_MERGE_ROWS_CSR_H_

#include <cstdint>
#include <vector>

#include "gpu/backend.h"

namespace kvs {

struct MergeRowsCsr {
  std::vector<uint64_t> dst;
  std::vector<int64_t> starts{0};
  std::vector<uint64_t> src;
  std::vector<float> weights;

  void Add(uint64_t dst_offset, const std::vector<uint64_t>& sources,
           const std::vector<float>& source_weights) {
    dst.push_back(dst_offset);
    src.insert(src.end(), sources.begin(), sources.end());
    weights.insert(weights.end(), source_weights.begin(), source_weights.end());
    starts.push_back(static_cast<int64_t>(src.size()));
  }

  // A job over this object's arrays (host memory); a device test repoints the four arrays.
  RowMergeJob Job(uint8_t* arena, DType dtype, int32_t row_elements) const {
    RowMergeJob job;
    job.arena = arena;
    job.dtype = dtype;
    job.row_elements = row_elements;
    job.rows = static_cast<int64_t>(dst.size());
    job.dst_offsets = dst.data();
    job.source_starts = starts.data();
    job.src_offsets = src.data();
    job.weights = weights.data();
    return job;
  }
};

}  // namespace kvs

#endif  // KVSIDECAR_TESTS_GPU_MERGE_ROWS_CSR_H_
