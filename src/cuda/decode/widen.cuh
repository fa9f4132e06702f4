// A warp's stage widened in shared memory for the conversion path (fp8 at head size 80, and
// the generic kernel), and the word loads the in-register fp8 path reads its stages with. The
// map is kernel.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/decode/config.h"

namespace pagedattn::cuda::decode {

using attn::AttnParams;
using attn::kv_elem_bytes;

/// Loads kBytes (a multiple of 4) of shared memory, aligned to the largest of 16, 8, 4 that
/// divides kBytes, as 32-bit words.
template <int kBytes>
__device__ __forceinline__ void lds_words(const unsigned char* src, uint32_t (&w)[kBytes / 4]) {
  static_assert(kBytes % 4 == 0);
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(src)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  }
}

// Widens one warp's stage (K tile then V tile, kTileTokens rows each) into the conversion
// buffer: fp8 -> the 16-bit activation type for the tensor-core kernel, anything -> float for
// the generic kernel. `chunks_per_row` counts 16-byte chunks of a source row.
template <class T>
__device__ __forceinline__ void widen_stage(const AttnParams& p, const SmemLayout& lay,
                                            const unsigned char* stage, unsigned char* conv,
                                            int chunks_per_row, int lane) {
  const int per_tensor = kTileTokens * chunks_per_row;
  for (int c = lane; c < 2 * per_tensor; c += 32) {
    const int tensor = c >= per_tensor ? 1 : 0;
    const int rem = c - tensor * per_tensor;
    const int row = rem / chunks_per_row, col = rem - row * chunks_per_row;
    const uint4 raw = *reinterpret_cast<const uint4*>(
        stage + (tensor * kTileTokens + row) * lay.kv_row_bytes + col * 16);
    unsigned char* dst_row = conv + (tensor * kTileTokens + row) * lay.conv_row_bytes;
    if constexpr (T::kMma) {
      // 16 fp8 values -> 16 x 16 bits (32 bytes).
      const bool e5m2 = p.kv_dtype == int(DType::kFp8E5M2);
      const uint16_t* two = reinterpret_cast<const uint16_t*>(&raw);
      uint4 out[2];
      uint32_t* o32 = reinterpret_cast<uint32_t*>(out);
#pragma unroll
      for (int i = 0; i < 8; ++i) o32[i] = fp8x2_to_16bit<T::act>(two[i], e5m2);
      uint4* dst = reinterpret_cast<uint4*>(dst_row + col * 32);
      dst[0] = out[0];
      dst[1] = out[1];
    } else {
      // Any dtype -> float: 4, 8 or 16 values per 16-byte chunk.
      float* dst = reinterpret_cast<float*>(dst_row);
      switch (kv_elem_bytes(p.kv_dtype)) {
        case 4:
          reinterpret_cast<float4*>(dst)[col] = *reinterpret_cast<const float4*>(&raw);
          break;
        case 2: {
          const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
          const bool is_bf16 = p.kv_dtype == int(DType::kBF16);
          float f[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            f[i] = is_bf16 ? __bfloat162float(__ushort_as_bfloat16(h[i]))
                           : __half2float(__ushort_as_half(h[i]));
          }
          float4* d4 = reinterpret_cast<float4*>(dst) + 2 * col;
          d4[0] = make_float4(f[0], f[1], f[2], f[3]);
          d4[1] = make_float4(f[4], f[5], f[6], f[7]);
          break;
        }
        default: {
          const uint16_t* two = reinterpret_cast<const uint16_t*>(&raw);
          const bool e5m2 = p.kv_dtype == int(DType::kFp8E5M2);
          float4* d4 = reinterpret_cast<float4*>(dst) + 4 * col;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const __half2_raw lo =
                __nv_cvt_fp8x2_to_halfraw2(two[2 * i], e5m2 ? __NV_E5M2 : __NV_E4M3);
            const __half2_raw hi =
                __nv_cvt_fp8x2_to_halfraw2(two[2 * i + 1], e5m2 ? __NV_E5M2 : __NV_E4M3);
            const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
            d4[i] = make_float4(a.x, a.y, b.x, b.y);
          }
          break;
        }
      }
    }
  }
}

}  // namespace pagedattn::cuda::decode
