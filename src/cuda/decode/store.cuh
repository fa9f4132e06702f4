// The decode kernel's epilogue: the warps' partial states merged through shared memory, then
// the final rows (sinks, v scale, output and LSE) or the split partials. The map is
// kernel.cuh's.
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
#include "cuda/decode/cta.cuh"
#include "cuda/decode/tile.cuh"

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

// Every warp's O, m and l into the merge area (over the stages, once every warp is done with
// them); O in natural column order.
template <class T>
__device__ __forceinline__ void merge_warps(const Shape<T>& sh, RowAcc<kNtOf<T>>& acc) {
  unsigned char* const smem = dyn_smem();
  constexpr int kNt = kNtOf<T>;
  const SmemLayout& lay = sh.lay;
  const int nt_active = sh.nt_active;
  const Lane ln = lane_ids();
  const int warp = ln.warp, g = ln.g, t4 = ln.t4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    acc.l[h] += __shfl_xor_sync(0xffffffffu, acc.l[h], 1);
    acc.l[h] += __shfl_xor_sync(0xffffffffu, acc.l[h], 2);
  }
  __syncthreads();  // every warp is done with its stages
  float* const mo = reinterpret_cast<float*>(smem + lay.merge_offset);  // [warps][kRows][o_row]
  float* const mml = mo + T::kWarps * kRows * lay.merge_o_row;          // [warps][kRows][m, l]
  if constexpr (T::kRegFp8) {
    // Column n of n tile nt is head dim n * kNt + nt (tile.cuh); this thread holds n = 2 t4 +
    // {0,1}.
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c >> 1), col = (2 * t4 + (c & 1)) * kNt + nt;
        mo[(warp * kRows + row) * lay.merge_o_row + col] = acc.o[nt][c];
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      if (nt < nt_active) {
        float* dst = mo + (warp * kRows + g) * lay.merge_o_row + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(dst) = make_float2(acc.o[nt][0], acc.o[nt][1]);
        *reinterpret_cast<float2*>(dst + 8 * lay.merge_o_row) =
            make_float2(acc.o[nt][2], acc.o[nt][3]);
      }
    }
  }
  if (t4 == 0) {
    mml[(warp * kRows + g) * 2] = acc.m[0];
    mml[(warp * kRows + g) * 2 + 1] = acc.l[0];
    mml[(warp * kRows + g + 8) * 2] = acc.m[1];
    mml[(warp * kRows + g + 8) * 2 + 1] = acc.l[1];
  }
  __syncthreads();
}

// The CTA's rows out of the merge area: each thread takes 8 columns of a row at a time, merges
// the warps' states (their maxima, sums and O rows) and stores the final row, or the split's
// normalised partial and LSE (log2 units).
template <class T>
__device__ __forceinline__ void store_rows(const AttnParams& p, const Work& w, const Shape<T>& sh) {
  unsigned char* const smem = dyn_smem();
  const SmemLayout& lay = sh.lay;
  const int head_size = sh.v_cols;  // the columns past it are the padding's zeros
  constexpr int kWarps = T::kWarps;
  const float* const mo = reinterpret_cast<const float*>(smem + lay.merge_offset);
  const float* const mml = mo + kWarps * kRows * lay.merge_o_row;
  const int c8_per_row = head_size / 8;
  for (int item = threadIdx.x; item < kRows * c8_per_row; item += T::kThreads) {
    const int row = item / c8_per_row, c8 = item - row * c8_per_row;
    if (row >= w.num_rows) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) mx = fmaxf(mx, mml[(wi * kRows + row) * 2]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) {
      const float wgt = exp2f(mml[(wi * kRows + row) * 2] - base);
      sum += mml[(wi * kRows + row) * 2 + 1] * wgt;
      if (wgt > 0.0f) {
        const float4* src =
            reinterpret_cast<const float4*>(mo + (wi * kRows + row) * lay.merge_o_row + c8 * 8);
        const float4 a = src[0], b = src[1];
        acc[0] += wgt * a.x, acc[1] += wgt * a.y, acc[2] += wgt * a.z, acc[3] += wgt * a.w;
        acc[4] += wgt * b.x, acc[5] += wgt * b.y, acc[6] += wgt * b.z, acc[7] += wgt * b.w;
      }
    }
    const float inv = sum > 0.0f ? attn::v_scale_of(p, w.kv_head) / sum : 0.0f;
    const float lse2 = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= inv;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.group, head = w.kv_head * p.group + pr % p.group;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
      float4* dst = reinterpret_cast<float4*>(p.partial_o + at * head_size + c8 * 8);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      if (c8 == 0) p.partial_lse[at] = lse2;
    } else {
      store_final<T::act>(p, t, head, c8, acc, lse2);
    }
  }
}

}  // namespace pagedattn::cuda::decode
