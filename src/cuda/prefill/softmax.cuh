// The two prefill kernels' online softmax on the mma accumulator layout of S (m16n8k16's, which
// is also wgmma's per warp): scale, soft cap, ALiBi and mask of a tile of scores, the running
// max and sum, P packed as the A operand of P V, and O's rescale. The maps are the kernels'.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/prefill/common.cuh"

namespace pagedattn::cuda::prefill {

// Scale, soft cap, ALiBi and mask of one kBlockN-key tile of S for one m16 tile (this
// thread's rows row_a and row_a + 8), then the online-softmax update of m and l: s becomes P
// and corr the factor O must be rescaled by (rescale_o; the Hopper kernel does that only once
// the previous P V has finished). kFeatures false compiles soft cap and ALiBi out: their
// branches alone made ptxas spill 20-100 bytes in the Hopper kernel's main loop. `undo`: the
// factors of rows row_a and row_a + 8 that undo a scaling of their Q rows (1 without one).
template <int kSn, bool kFeatures = true>
__device__ __forceinline__ void softmax_scores(const AttnParams& p, const attn::Work& w,
                                               float (&s)[kSn][4], int row_a, int tile_start,
                                               bool need_mask, int t4, float (&m)[2], float (&l)[2],
                                               float (&corr)[2], float2 undo = {1.0f, 1.0f}) {
  // Without soft cap or ALiBi the scores stay raw and the scale joins the exponent (one FFMA
  // per score instead of a multiply and a subtraction; max(s) * f = max(s * f) for f > 0).
  // At least FLT_MIN: a row scaled up by 2^126 (its largest |q| below 2^-112) under a tiny
  // k_scale would get f = 0 and its masked scores -inf * 0 = NaN. Raising f to 2^-126 moves
  // such a row's scores (|raw| < 2^40 after the scaling) by less than 2^-86.
  float f[2] = {fmaxf(p.scale_log2 * undo.x, FLT_MIN), fmaxf(p.scale_log2 * undo.y, FLT_MIN)};
  if (kFeatures && p.softcap > 0.0f) {
    const float arg[2] = {p.softcap_arg_scale * undo.x, p.softcap_arg_scale * undo.y};
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[nt][c] = p.softcap_log2 * tanhf(s[nt][c] * arg[c >> 1]);
      }
    }
    f[0] = f[1] = 1.0f;
  } else if (kFeatures && p.alibi_slopes != nullptr) {
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nt][c] *= f[c >> 1];
    }
    f[0] = f[1] = 1.0f;
  }
  const bool alibi = kFeatures && p.alibi_slopes != nullptr;
  if (alibi || need_mask) {
    const ThreadRow rows[2] = {thread_row(p, w, row_a), thread_row(p, w, row_a + 8)};
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const ThreadRow& rw = rows[c >> 1];
        const int j = tile_start + nt * 8 + 2 * t4 + (c & 1);
        float x = s[nt][c];
        if (alibi) x += rw.alibi2 * float(j - rw.pos);
        if (need_mask && (j < rw.lo || j >= rw.hi)) x = -INFINITY;
        s[nt][c] = x;
      }
    }
  }
  float base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // a quad holds a row's keys
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx * f[h]);
    base[h] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
    corr[h] = sm80::exp2_approx(m[h] - base[h]);
    m[h] = m_new;
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[nt][c] = sm80::exp2_approx(fmaf(s[nt][c], f[c >> 1], -base[c >> 1]));
      sum[c >> 1] += s[nt][c];
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
}

// P of keys [16 kk, 16 kk + 16) of one m16 tile, packed as the A fragment of the P V product
// (the accumulator layout of S is the A layout of m16n8k16 and of wgmma's register A).
template <DType kAct, int kSn>
__device__ __forceinline__ void pack_p(const float (&s)[kSn][4], int kk, uint32_t (&pa)[4]) {
  pa[0] = pack2<kAct>(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = pack2<kAct>(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = pack2<kAct>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = pack2<kAct>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

template <int kNt>
__device__ __forceinline__ void rescale_o(float (&o)[kNt][4], const float (&corr)[2]) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    o[nt][0] *= corr[0];
    o[nt][1] *= corr[0];
    o[nt][2] *= corr[1];
    o[nt][3] *= corr[1];
  }
}

}  // namespace pagedattn::cuda::prefill
