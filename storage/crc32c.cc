#include "storage/crc32c.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvs::storage {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

uint32_t ExtendTable(uint32_t crc, const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

#if defined(__x86_64__)
// One crc32 chain waits on its previous result (latency 3 cycles, one issued per cycle), so
// large inputs run three chains over the thirds of each block and join them. Joining carries a
// chain's register over the bytes after it: multiplication by x^(8 kStream) mod P, linear in the
// register, so four tables indexed by its bytes hold it.
constexpr size_t kStream = 8192;

using ShiftTables = std::array<std::array<uint32_t, 256>, 4>;

__attribute__((target("sse4.2"))) ShiftTables MakeShiftTables() {
  std::array<uint32_t, 32> bit{};  // each single-bit register carried over kStream zero bytes
  for (int b = 0; b < 32; ++b) {
    uint64_t c = uint32_t{1} << b;
    for (size_t i = 0; i < kStream; i += 8) c = _mm_crc32_u64(c, 0);
    bit[b] = static_cast<uint32_t>(c);
  }
  ShiftTables tables{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t v = 0; v < 256; ++v) {
      for (int b = 0; b < 8; ++b) {
        if (v & (1u << b)) tables[k][v] ^= bit[8 * k + b];
      }
    }
  }
  return tables;
}

uint32_t ShiftOverStream(const ShiftTables& t, uint32_t reg) {
  return t[0][reg & 0xff] ^ t[1][(reg >> 8) & 0xff] ^ t[2][(reg >> 16) & 0xff] ^ t[3][reg >> 24];
}

__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc & 0xffffffffu;
  if (n >= 3 * kStream) {
    static const ShiftTables shift = MakeShiftTables();
    for (; n >= 3 * kStream; p += 3 * kStream, n -= 3 * kStream) {
      uint64_t a = c, b = 0, d = 0;
      for (size_t i = 0; i < kStream; i += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, p + i, 8);
        std::memcpy(&wb, p + kStream + i, 8);
        std::memcpy(&wd, p + 2 * kStream + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      const uint32_t ab =
          ShiftOverStream(shift, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      c = ShiftOverStream(shift, ab) ^ static_cast<uint32_t>(d);
    }
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n > 0) {
    c32 = _mm_crc32_u8(c32, *p++);
    --n;
  }
  return ~c32;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (HasSse42()) return ExtendSse42(crc, p, size);
#endif
  return ExtendTable(crc, p, size);
}

uint32_t Crc32cCopy(std::string_view bytes, void* to) {
  // Inside L2 with its source, and whole blocks of ExtendSse42's three chains.
  constexpr size_t kPiece = size_t{48} << 10;
  auto* out = static_cast<uint8_t*>(to);
  uint32_t crc = 0;
  for (size_t at = 0; at < bytes.size(); at += kPiece) {
    const size_t n = std::min(kPiece, bytes.size() - at);
    std::memcpy(out + at, bytes.data() + at, n);
    crc = Crc32cExtend(crc, bytes.data() + at, n);
  }
  return crc;
}

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size) {
  return ExtendTable(crc, static_cast<const uint8_t*>(data), size);
}

}  // namespace kvs::storage
