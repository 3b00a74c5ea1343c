// CRC-32C (Castagnoli), the checksum of every record the RocksDB tier writes and of every chunk
// of the remote tier. Uses the SSE4.2 crc32 instruction when the CPU has it (three interleaved
// chains for inputs of 24 KiB and more), else a table; both give the same values.
// Threading: pure functions.
#ifndef KVSIDECAR_STORAGE_CRC32C_H_
#define KVSIDECAR_STORAGE_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvs::storage {

// Extends `crc` (0 for a fresh checksum) over `size` bytes at `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
// The table implementation alone (tests compare it with the hardware path).
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(std::string_view bytes) {
  return Crc32cExtend(0, bytes.data(), bytes.size());
}
// Copies `bytes` to `to` and returns their CRC-32C: a piece at a time, so that the checksum
// reads what the copy just brought into the cache (one pass over memory instead of two).
uint32_t Crc32cCopy(std::string_view bytes, void* to);

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_CRC32C_H_
