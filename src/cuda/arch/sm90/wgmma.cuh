// Hopper (sm_90a) warpgroup instructions, each wrapped once: wgmma.mma_async (generated per N
// in wgmma_ops.inc), its fence / commit / wait, the shared-memory matrix descriptor of the
// 128-byte-swizzled layouts, and setmaxnreg. Only translation units compiled for sm_90a may
// include this (the wgmma and setmaxnreg instructions exist nowhere else).
#pragma once

#include <cstdint>
#include <type_traits>

namespace pagedattn::cuda::sm90 {

/// D (m64 x N, fp32) += A (m64 x k16) * B (k16 x N) for 16-bit A and B (bf16 when kBF16, else
/// f16), issued by a whole warpgroup. d[i][0..1] = (row 16 w + lane / 4, columns 8 i +
/// 2 (lane % 4) + {0, 1}), d[i][2..3] the same columns of row + 8 (w = warp in the group): the
/// mma.sync m16n8k16 accumulator layout, one n tile per i. `accumulate` 0 overwrites D.
///   ss: A and B from shared memory (descriptors);
///   rs: A from registers, the m16n8k16 A fragment of the warp's 16 rows.
/// kTransB: 0 = B is K-major (contiguous along k), 1 = MN-major (contiguous along n); ss's
/// kTransA the same for A (1: contiguous along m, e.g. V read as V^T).
template <int N, bool kBF16>
struct Wgmma;
/// D (m64 x N, fp32) += A (m64 x k32) * B (k32 x N), both e4m3 and K-major (fp8 wgmma has no
/// transposed operands). rs: A from registers, 4 bytes per register: a[0] = row 16 w + lane / 4,
/// k 4 (lane % 4) + {0..3}; a[1] the same k of row + 8; a[2], a[3] the same at k + 16.
template <int N>
struct WgmmaE4M3;
#include "cuda/arch/sm90/wgmma_ops.inc"

/// Orders this thread's register writes (accumulators, A fragments) before the wgmmas that
/// read them; the whole warpgroup executes it before its first wgmma and after touching them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/// Waits until at most kPending committed groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
/// Keeps the compiler from moving reads or writes of `x` across the asynchronous wgmmas that
/// own it (no instruction is emitted): fp32 accumulators, or A fragments built in registers
/// (wgmma RS), all of them computed before this point so that none is computed between the
/// wgmmas that read them (ptxas then serialises every wgmma of the kernel).
template <class T, int kRows, int kCols>
__device__ __forceinline__ void fence_operands(T (&x)[kRows][kCols]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        asm volatile("" : "+f"(x[i][j])::"memory");
      } else {
        asm volatile("" : "+r"(x[i][j])::"memory");
      }
    }
  }
}

/// Descriptor of a 128-byte-swizzled operand tile at shared address `addr` (1024-byte aligned
/// pattern base, so the base-offset field stays 0): rows of 128 bytes, 8-row groups `sbo`
/// bytes apart (1024), and for MN-major operands `lbo` = the distance between 64-element
/// panels (K-major operands ignore it; 16 by convention).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
         (uint64_t(1) << 62);
}

/// `d` moved `bytes` (a multiple of 16) further into shared memory: a 32-bit add on the
/// descriptor's low word, whose start-address field (bits 0-13, address / 16) cannot carry into
/// the leading-byte-offset field for addresses below 256 KiB. Descriptors built once per work
/// tile and advanced per k step cost one uniform add each instead of the mask, shift and ors of
/// sw128_desc (ptxas does not fold those across the unrolled steps).
__device__ __forceinline__ uint64_t desc_advance(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint64_t(uint32_t(d) + (bytes >> 4));
}

/// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside a 128-byte-swizzled panel
/// whose rows are 128 bytes: the chunk index is XORed with the row index modulo 8.
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return uint32_t(row) * 128u + uint32_t((chunk ^ (row & 7)) << 4);
}

/// Register budget of the executing warpgroup (a multiple of 8 in [24, 256]).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

/// Named barrier `id` (1..15) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/// Arrives on named barrier `id` without waiting (the producer side of a handoff).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace pagedattn::cuda::sm90
