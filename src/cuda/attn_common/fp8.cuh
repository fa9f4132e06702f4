// fp8 caches in registers: exact widening to 16-bit floats, and a bf16 query row scaled into
// f16 (the decode and prefill kernels over an fp8 cache).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"

namespace pagedattn::cuda::attn {

// fp8 -> 16-bit in registers, exactly. An fp8 code x (sign, then exponent and mantissa in
// `mag` = x & 0x7f) becomes sign << 15 | mag << (8 - shift), a 16-bit float of the same sign
// whose exponent field holds x's exponent field and whose mantissa starts with x's: the value
// times 2^-(bias difference). One multiply by 2^(bias difference) (no flush: subnormal codes
// land on normal values) gives the exact value:
//   e4m3 -> bf16: shift 4, x 2^120     e5m2 -> bf16: shift 3, x 2^112
//   e4m3 -> f16:  shift 1, x 2^8       e5m2 -> f16:  shift 0, x 1 (the code is f16's top byte)
// Unlike the cvt path, the codes without a finite value (e4m3 NaN, e5m2 inf / NaN) come out
// finite (e4m3 NaN as +-480): write_kv never stores them from finite inputs (satfinite).
template <DType kAct>
struct Fp8Widen {
  static constexpr bool kBF16 = kAct == DType::kBF16;
  int shift;
  uint32_t bias;  // 2^(bias difference), twice
  __device__ __forceinline__ explicit Fp8Widen(bool e5m2) {
    if constexpr (kBF16) {
      shift = e5m2 ? 3 : 4;
      bias = e5m2 ? 0x77807780u : 0x7B807B80u;  // bf16 2^112 / 2^120
    } else {
      shift = e5m2 ? 0 : 1;
      bias = e5m2 ? 0x3C003C00u : 0x5C005C00u;  // f16 1 / 2^8
    }
  }
  /// The two values whose codes are bytes 1 (low half of the result) and 3 of `w`.
  __device__ __forceinline__ uint32_t hi(uint32_t w) const {
    const uint32_t bits = (w & 0x80008000u) | ((w & 0x7F007F00u) >> shift);
    return sm80::mul2<kBF16>(bits, bias);
  }
  /// Bytes 0 and 2 of `w`.
  __device__ __forceinline__ uint32_t lo(uint32_t w) const { return hi(w << 8); }
};

// The fp8 kernel multiplies in f16 for both activation types: every e4m3 / e5m2 value is exact
// in f16, and the hardware converts two codes per instruction (F2FP.F16.E4M3.UNPACK_B), where
// widening to bf16 takes a bit trick and a multiply per pair (Fp8Widen, ~4.5 instructions).
// Half kHi of `w` (bytes 2, 3, else 0, 1), the lower byte into the lower half.
template <bool kE5m2, int kHi>
__device__ __forceinline__ uint32_t fp8x2_f16(uint32_t w) {
  return fp8x2_to_16bit<DType::kF16>(uint16_t(kHi ? w >> 16 : w), kE5m2);
}

// A bf16 query row meets the fp8 cache in f16: it is scaled by 2^k with k chosen so that its
// largest |q| lands in [2^14, 2^15) (f16's largest finite value is 65504), so every element
// down to 2^-28 of that largest one stays exact (bf16 has 8 significant bits, f16 11) and
// smaller ones round at f16's subnormal step. Their share of q.k is below 2^-28 of the
// largest term: far under bf16's own rounding. k is undone in the score multiplier
// (ThreadRow::score2). `max_bits`: the row's largest |q| as float bits; zero rows and rows
// holding inf / NaN keep k = 0 (inf / NaN propagate as in the reference).
__device__ __forceinline__ int q_row_shift(uint32_t max_bits) {
  if (max_bits == 0 || max_bits >= 0x7f800000u) return 0;
  const int e = int(max_bits >> 23) - 127;  // floor(log2 max); -127 for float subnormals
  return min(max(14 - e, -126), 126);
}
__device__ __forceinline__ float pow2f(int k) {  // k in [-126, 127]
  return __int_as_float((127 + k) << 23);
}
// The largest |x| of 8 bf16 values, as float bits (bf16 bits order like float's for x >= 0).
__device__ __forceinline__ uint32_t bf16x8_abs_max_bits(const uint4& raw) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t mx = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) mx = max(mx, max(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
  return mx << 16;
}
// Two bf16 values times 2^k (exact in float) rounded to f16.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w, float pow2k) {
  return pack2<DType::kF16>(__uint_as_float(w << 16) * pow2k,
                            __uint_as_float(w & 0xffff0000u) * pow2k);
}

}  // namespace pagedattn::cuda::attn
