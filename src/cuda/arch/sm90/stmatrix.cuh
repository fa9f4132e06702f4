// stmatrix (sm_90): a warp stores four 8 x 8 tiles of 16-bit values held in the mma
// accumulator layout (lane l: row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each tile),
// 16 bytes per tile row, one instruction for what takes four 4-byte st.shared.
#pragma once

#include <cstdint>

namespace pagedattn::cuda::sm90 {

/// Tile i's values are `ri` of every lane; lanes 8 i .. 8 i + 7 give the shared-window addresses
/// of its rows 0..7 (16-byte aligned).
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace pagedattn::cuda::sm90
