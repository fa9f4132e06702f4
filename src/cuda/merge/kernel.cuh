// merge_states: merges two partial attention results over disjoint key sets by their LSEs
// (vLLM's merge_attn_states; cascade attention, context parallelism); merge_ranks: the same
// merge applied rank by rank to N gathered partials (decode context parallelism).
//
// Map
//   computes  per (token t, head h): p, s = the two LSEs, any infinity read as -inf;
//             M = max(p, s); M = -inf -> out = prefix, lse = -inf; else
//             out = (e^(p-M) out_p + e^(s-M) out_s) / (e^(p-M) + e^(s-M)),
//             lse = M + ln(e^(p-M) + e^(s-M)). A side of weight 0 is never read (its rows may
//             hold garbage for an empty partial). Float math, output rounded to nearest even.
//             merge_ranks: a running (out, lse) in float registers, starting as "no keys"
//             (0, -inf), merged with rank 0, 1, ..., N-1 in turn by the same formula, rounded
//             once at the end (a row no rank has keys for: 0, -inf).
//   grid      grid-stride loop over (row, chunk) items, kVec elements per chunk (one 16-byte
//             access for 16-bit outputs); any head size (scalar chunks when not a multiple of
//             kVec or not aligned).
//   budget    no shared memory; each item recomputes its row's weights (LSE loads that hit
//             L1) rather than synchronising with its row's other items; merge_ranks holds kVec
//             float accumulators per thread.
//   test      tests/cuda MergeStates* (vs the reference, infinities, garbage on the empty side);
//             tests/cuda/test_cuda_parallel.cpp CudaMergeRanks* (vs the host merge and a
//             float64 chain, every dtype pair, 1 to 8 ranks).
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

// The weights of a prefix of LSE lp and a suffix of LSE ls (both already -inf for "no keys")
// and the merged LSE; M = -inf gives weights (1, 0) and LSE -inf.
__device__ __forceinline__ float merge_weights(float lp, float ls, float& wp, float& ws) {
  const float mx = fmaxf(lp, ls);
  wp = 1.0f;
  ws = 0.0f;
  if (mx == -INFINITY) return -INFINITY;
  wp = expf(lp - mx);
  ws = expf(ls - mx);
  const float sum = wp + ws;
  wp /= sum;
  ws /= sum;
  return logf(sum) + mx;
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
    float wp, ws;
    const float lse = merge_weights(lp, ls, wp, ws);
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

// kVec elements of a row as floats: 16-byte loads (two for float32).
template <DType kDType>
__device__ __forceinline__ void load_vec(const char* src, float (&v)[kVec]) {
  if constexpr (kDType == DType::kF32) {
    const float4 a = reinterpret_cast<const float4*>(src)[0];
    const float4 b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z;
    v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const auto* e = reinterpret_cast<const typename Elem<kDType>::type*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = load_as_float<kDType>(e, i);
  }
}

// kVec floats rounded to kDType (nearest even) and stored with 16-byte stores.
template <DType kDType>
__device__ __forceinline__ void store_vec(char* dst, const float (&v)[kVec]) {
  if constexpr (kDType == DType::kF32) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 raw;
    uint32_t* r32 = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) r32[i] = pack2<kDType>(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = raw;
  }
}

template <DType kPartial, DType kOut>
__global__ void __launch_bounds__(kThreads)
    merge_ranks_kernel(const __grid_constant__ MergeRanksParams p) {
  constexpr int kInBytes = kElemBytes<kPartial>, kOutBytes = kElemBytes<kOut>;
  const int per_item = p.vectorized ? kVec : 1;
  const int items_per_row = p.head_size / per_item;
  const int64_t total = int64_t(p.num_tokens) * p.num_heads * items_per_row;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = item / items_per_row;
    const int c = int(item - row * items_per_row);
    const int t = int(row / p.num_heads), h = int(row - int64_t(t) * p.num_heads);
    const int d0 = c * per_item;
    float acc[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
    float lse = -INFINITY;  // the running merge starts as "no keys"
    for (int r = 0; r < p.num_ranks; ++r) {
      const float l =
          read_lse(p.lses, 0,
                   r * p.lse_stride_rank + h * p.lse_stride_head + int64_t(t) * p.lse_stride_token);
      float wp, ws;
      const float merged = merge_weights(lse, l, wp, ws);
      if (merged == -INFINITY) continue;  // neither side has keys yet: nothing changes
      lse = merged;
      const char* src = static_cast<const char*>(p.partials) +
                        (r * p.partial_stride_rank + int64_t(t) * p.partial_stride_token +
                         h * p.partial_stride_head + d0) *
                            kInBytes;
      // A side of weight 0 is never read: an empty rank's rows may hold garbage, and so may the
      // running merge's before its first rank with keys.
      if (p.vectorized) {
        float v[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (ws != 0.0f) load_vec<kPartial>(src, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = (wp != 0.0f ? acc[i] * wp : 0.0f) + v[i] * ws;
      } else {
        const float v = ws != 0.0f ? load_as_float<kPartial>(src, 0) : 0.0f;
        acc[0] = (wp != 0.0f ? acc[0] * wp : 0.0f) + v * ws;
      }
    }
    char* op = static_cast<char*>(p.out) +
               (int64_t(t) * p.out_stride_token + h * p.out_stride_head + d0) * kOutBytes;
    if (p.vectorized) {
      store_vec<kOut>(op, acc);
    } else {
      store_from_float<kOut>(op, 0, acc[0]);
    }
    if (p.out_lse != nullptr && c == 0) {
      p.out_lse[h * p.out_lse_stride_head + int64_t(t) * p.out_lse_stride_token] = lse;
    }
  }
}

template <DType kPartial, DType kOut>
void MergeRanksOps<kPartial, kOut>::launch(const MergeRanksParams& p, cudaStream_t stream) {
  const int64_t items =
      int64_t(p.num_tokens) * p.num_heads * (p.vectorized ? p.head_size / kVec : p.head_size);
  if (items == 0) return;
  const int64_t ctas = std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16);
  merge_ranks_kernel<kPartial, kOut><<<unsigned(ctas), kThreads, 0, stream>>>(p);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::merge
