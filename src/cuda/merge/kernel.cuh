// merge_states: merges two partial attention results over disjoint key sets by their LSEs
// (vLLM's merge_attn_states; cascade attention, context parallelism).
//
// Map
//   computes  per (token t, head h): p, s = the two LSEs, any infinity read as -inf;
//             M = max(p, s); M = -inf -> out = prefix, lse = -inf; else
//             out = (e^(p-M) out_p + e^(s-M) out_s) / (e^(p-M) + e^(s-M)),
//             lse = M + ln(e^(p-M) + e^(s-M)). A side of weight 0 is never read (its rows may
//             hold garbage for an empty partial). Float math, output rounded to nearest even.
//   grid      grid-stride loop over (row, chunk) items, kVec elements per chunk (one 16-byte
//             access for 16-bit outputs); any head size (scalar chunks when not a multiple of
//             kVec or not aligned).
//   budget    no shared memory; each item recomputes its row's two weights (two LSE loads that
//             hit L1) rather than synchronising with its row's other items.
//   test      tests/cuda MergeStates* (vs the reference, infinities, garbage on the empty side).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/merge/config.h"
#include "cuda/merge/launch.h"
#include "cuda/merge/params.h"

namespace pagedattn::cuda::merge {

__device__ __forceinline__ float read_lse(const void* base, int f64, int64_t at) {
  const float v =
      f64 ? float(static_cast<const double*>(base)[at]) : static_cast<const float*>(base)[at];
  return isinf(v) ? -INFINITY : v;  // FA2 reports +inf for empty rows: both mean "no keys"
}

template <DType kDType>
__global__ void __launch_bounds__(kThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  constexpr int kBytes = kElemBytes<kDType>;
  const int per_item = p.vectorized ? kVec : 1;
  const int items_per_row = p.head_size / per_item;
  const int64_t total = int64_t(p.num_tokens) * p.num_heads * items_per_row;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = item / items_per_row;
    const int c = int(item - row * items_per_row);
    const int t = int(row / p.num_heads), h = int(row - int64_t(t) * p.num_heads);
    const float lp = read_lse(p.prefix_lse, p.prefix_lse_f64,
                              h * p.prefix_lse_stride_head + t * p.prefix_lse_stride_token);
    const float ls = read_lse(p.suffix_lse, p.suffix_lse_f64,
                              h * p.suffix_lse_stride_head + t * p.suffix_lse_stride_token);
    const float mx = fmaxf(lp, ls);
    float wp = 1.0f, ws = 0.0f, lse = -INFINITY;
    if (mx != -INFINITY) {
      wp = expf(lp - mx);
      ws = expf(ls - mx);
      const float sum = wp + ws;
      lse = logf(sum) + mx;
      wp /= sum;
      ws /= sum;
    }
    const int d0 = c * per_item;
    const char* pp = static_cast<const char*>(p.prefix_out) +
                     (t * p.prefix_stride_token + h * p.prefix_stride_head + d0) * kBytes;
    const char* sp = static_cast<const char*>(p.suffix_out) +
                     (t * p.suffix_stride_token + h * p.suffix_stride_head + d0) * kBytes;
    char* op =
        static_cast<char*>(p.out) + (t * p.out_stride_token + h * p.out_stride_head + d0) * kBytes;
    float po[kVec] = {0, 0, 0, 0, 0, 0, 0, 0}, so[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (p.vectorized) {
      if (wp != 0.0f) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) po[i] = load_as_float<kDType>(pp, i);
      }
      if (ws != 0.0f) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) so[i] = load_as_float<kDType>(sp, i);
      }
      if constexpr (kDType == DType::kF32) {
        float4* o4 = reinterpret_cast<float4*>(op);
        o4[0] = make_float4(po[0] * wp + so[0] * ws, po[1] * wp + so[1] * ws,
                            po[2] * wp + so[2] * ws, po[3] * wp + so[3] * ws);
        o4[1] = make_float4(po[4] * wp + so[4] * ws, po[5] * wp + so[5] * ws,
                            po[6] * wp + so[6] * ws, po[7] * wp + so[7] * ws);
      } else {
        uint4 raw;
        uint32_t* r32 = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec / 2; ++i) {
          r32[i] = pack2<kDType>(po[2 * i] * wp + so[2 * i] * ws,
                                 po[2 * i + 1] * wp + so[2 * i + 1] * ws);
        }
        *reinterpret_cast<uint4*>(op) = raw;
      }
    } else {
      const float a = wp != 0.0f ? load_as_float<kDType>(pp, 0) : 0.0f;
      const float b = ws != 0.0f ? load_as_float<kDType>(sp, 0) : 0.0f;
      store_from_float<kDType>(op, 0, a * wp + b * ws);
    }
    if (p.out_lse != nullptr && c == 0) {
      const int64_t at = h * p.out_lse_stride_head + t * p.out_lse_stride_token;
      if (p.out_lse_f64) {
        static_cast<double*>(p.out_lse)[at] = double(lse);
      } else {
        static_cast<float*>(p.out_lse)[at] = lse;
      }
    }
  }
}

template <DType kDType>
void MergeOps<kDType>::launch(const MergeParams& p, cudaStream_t stream) {
  const int64_t items =
      int64_t(p.num_tokens) * p.num_heads * (p.vectorized ? p.head_size / kVec : p.head_size);
  if (items == 0) return;
  // Enough CTAs for a few waves; the loop covers the rest.
  const int64_t ctas = std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16);
  merge_kernel<kDType><<<unsigned(ctas), kThreads, 0, stream>>>(p);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::merge
