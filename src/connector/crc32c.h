// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of stored KV entries:
// SSE4.2's crc32 instruction when the CPU has it, a slicing-by-8 table otherwise (same value).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedattn::connector {

/// CRC-32C of `bytes` bytes at `data`, continuing from `crc` (0 to start). crc32c("123456789")
/// is 0xE3069283.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
/// The table version (no special instructions), for tests.
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace pagedattn::connector
