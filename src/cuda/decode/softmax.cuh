// One 16-key tile of S through scale, soft cap, ALiBi and mask into the online softmax (the
// decode and portable prefill kernels' mma fragment layout). The map is kernel.cuh's.
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
using attn::ThreadRow;

// Scale, soft cap, ALiBi and mask of one 16-key tile of S (this thread's 8 scores), then the
// online-softmax update: s becomes P (float), m / l / o are rescaled.
template <int kNt>
__device__ __forceinline__ void softmax_tile(const AttnParams& p, float (&s)[2][4],
                                             const ThreadRow (&rows)[2], int tile_start,
                                             bool need_mask, int t4, float (&m)[2], float (&l)[2],
                                             float (&o)[kNt][4]) {
  // Warp-uniform branches around the loops: the common case (no soft cap, no ALiBi, a tile
  // inside every row's range) runs 8 multiplies.
  if (p.softcap > 0.0f) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[nt][c] = p.softcap_log2 * tanhf(s[nt][c] * rows[c >> 1].cap_arg);
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nt][c] *= rows[c >> 1].score2;
    }
  }
  if (p.alibi_slopes != nullptr || need_mask) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const ThreadRow& rw = rows[c >> 1];
        const int j = tile_start + nt * 8 + 2 * t4 + (c & 1);
        float x = s[nt][c];
        if (p.alibi_slopes != nullptr) x += rw.alibi2 * float(j - rw.pos);
        if (need_mask && (j < rw.lo || j >= rw.hi)) x = -INFINITY;
        s[nt][c] = x;
      }
    }
  }
  float mx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
    // The four threads of a quad hold the 16 keys of a row.
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
  float corr[2], base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m[h], mx[h]);
    base[h] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no visible key yet: no NaN
    corr[h] = sm80::exp2_approx(m[h] - base[h]);
    m[h] = m_new;
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s[nt][c] = sm80::exp2_approx(s[nt][c] - base[c >> 1]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = l[h] * corr[h] + (s[0][2 * h] + s[0][2 * h + 1]) + (s[1][2 * h] + s[1][2 * h + 1]);
  }
  // O is rescaled only when some row's running max moved (corr is exactly 1 otherwise): after
  // the first tiles of a long range, almost never. The vote keeps the branch warp-uniform.
  if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      o[nt][0] *= corr[0];
      o[nt][1] *= corr[0];
      o[nt][2] *= corr[1];
      o[nt][3] *= corr[1];
    }
  }
}

}  // namespace pagedattn::cuda::decode
