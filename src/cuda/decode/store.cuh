// The decode kernel's final rows: sinks, v scale, output and LSE. The map is kernel.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/decode/config.h"

namespace pagedattn::cuda::decode {

using attn::AttnParams;
using attn::kLn2;
using attn::kLog2e;

// Final rows: sinks, v scale, output and LSE. `o8` holds 8 normalised, v-scaled values of row
// (t, h) starting at column c8 * 8.
template <DType kAct>
__device__ __forceinline__ void store_final(const AttnParams& p, int t, int h, int c8,
                                            float (&o8)[8], float lse2) {
  if (p.sinks != nullptr) {
    // The sink joins the denominator only: out *= e^lse / (e^lse + e^sink).
    const float sink2 = p.sinks[h] * kLog2e;
    const float mx = fmaxf(lse2, sink2);
    const float total = mx + log2f(exp2f(lse2 - mx) + exp2f(sink2 - mx));
    const float factor = exp2f(lse2 - total);
#pragma unroll
    for (int i = 0; i < 8; ++i) o8[i] *= factor;
    lse2 = total;
  }
  char* out = static_cast<char*>(p.out) +
              (int64_t(t) * p.out_stride_token + int64_t(h) * p.out_stride_head + c8 * 8) *
                  kElemBytes<kAct>;
  if (p.vec_out) {
    if constexpr (kAct == DType::kF32) {
      reinterpret_cast<float4*>(out)[0] = make_float4(o8[0], o8[1], o8[2], o8[3]);
      reinterpret_cast<float4*>(out)[1] = make_float4(o8[4], o8[5], o8[6], o8[7]);
    } else {
      uint4 raw;
      uint32_t* r32 = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) r32[i] = pack2<kAct>(o8[2 * i], o8[2 * i + 1]);
      *reinterpret_cast<uint4*>(out) = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) store_from_float<kAct>(out, i, o8[i]);
  }
  if (p.lse != nullptr && c8 == 0) {
    const int64_t at = int64_t(h) * p.lse_stride_head + int64_t(t) * p.lse_stride_token;
    const float lse = lse2 * kLn2;  // -inf stays -inf
    if (p.lse_is_f64) {
      static_cast<double*>(p.lse)[at] = double(lse);
    } else {
      static_cast<float*>(p.lse)[at] = lse;
    }
  }
}

}  // namespace pagedattn::cuda::decode
