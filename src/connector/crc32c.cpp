#include "connector/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace pagedattn::connector {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

// table[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      t[size_t(k)][b] = (t[size_t(k - 1)][b] >> 8) ^ t[0][t[size_t(k - 1)][b] & 0xffu];
    }
  }
  return t;
}
constexpr auto kTables = make_tables();

uint32_t crc_software(const uint8_t* p, size_t n, uint32_t c) {
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian host (safetensors.cpp asserts it)
    w ^= c;
    c = kTables[7][w & 0xff] ^ kTables[6][(w >> 8) & 0xff] ^ kTables[5][(w >> 16) & 0xff] ^
        kTables[4][(w >> 24) & 0xff] ^ kTables[3][(w >> 32) & 0xff] ^ kTables[2][(w >> 40) & 0xff] ^
        kTables[1][(w >> 48) & 0xff] ^ kTables[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xffu];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = uint32_t(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}

bool has_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (has_sse42()) return ~crc_sse42(p, bytes, c);
#endif
  return ~crc_software(p, bytes, c);
}

uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  return ~crc_software(static_cast<const uint8_t*>(data), bytes, ~crc);
}

}  // namespace pagedattn::connector
