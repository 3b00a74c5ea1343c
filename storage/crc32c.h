// CRC-32C (Castagnoli), the checksum of every record the RocksDB tier writes. Uses the SSE4.2
// crc32 instruction when the CPU has it, else a table; both give the same values.
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

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_CRC32C_H_
