// The MLA consumers' epilogue: a thread's two rows normalised and written out (the output and
// LSE, or the split partials for the combine). See kernel.cuh's map.
#pragma once

#include <cstdint>

#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"

namespace pagedattn::cuda::mla {

// A row's sum over its quad (the four threads t4 that hold its columns), on every lane.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// A finished row's LSE (log2 units; -inf without keys) and the factor that normalises its O
// (v_scale folded in; 0 without keys), from its maximum m and its whole sum.
struct RowEnd {
  float lse2, factor;
};
__device__ __forceinline__ RowEnd row_end(float m, float total, float v_scale) {
  return total > 0.0f ? RowEnd{m + log2f(total), v_scale / total} : RowEnd{-INFINITY, 0.0f};
}

// A row's natural-log LSE into the caller's [num_heads, num_tokens] tensor (float or double);
// lse2 is in log2 units.
__device__ __forceinline__ void store_lse(const MlaParams& p, int head, int t, float lse2) {
  const int64_t at = int64_t(head) * p.lse_stride_head + int64_t(t) * p.lse_stride_token;
  if (p.lse_is_f64) {
    static_cast<double*>(p.lse)[at] = double(lse2 * kLn2);
  } else {
    static_cast<float*>(p.lse)[at] = lse2 * kLn2;
  }
}

// This thread's rows row_a and row_a + 8 out: normalise by the row sums (l: this thread's part,
// a row's sum is spread over its quad), v scale; the output's first p.out_cols columns and the
// LSE, or the split partials (every column computed). Warpgroup cw writes kv_c columns 256 cw ..
// 256 cw + 255, and the k_pe columns it holds: all 64 (kPe = 8: warpgroup kPeWg's are written),
// 32 cw .. 32 cw + 31 (kPe = 4) or none (kPe = 0, o_pe unused); warpgroup 0 the LSE.
template <class T, int kPe, int kPeWg = 0>
__device__ __forceinline__ void store_rows(const MlaParams& p, const Work& w,
                                           const float (&o)[32][4], const float (*o_pe)[4],
                                           const float (&m)[2], const float (&l)[2], int row_a,
                                           int t4, int cw) {
  static_assert(kPe == 8 || kPe == 4 || kPe == 0);
  const bool pe_mine = kPe == 4 || (kPe == 8 && cw == kPeWg);
  const int pe0 = kPe == 4 ? 512 + 32 * cw : 512;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowEnd end = row_end(m[h], quad_sum(l[h]), p.v_scale);
    const int row = row_a + 8 * h;
    if (row >= w.num_rows) continue;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
    const float lse2 = end.lse2, factor = end.factor;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
      float* const dst = p.partial_o + at * kEntry + 2 * t4;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        *reinterpret_cast<float2*>(dst + 256 * cw + 8 * i) =
            make_float2(o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
      }
      if (pe_mine) {
#pragma unroll
        for (int i = 0; i < kPe; ++i) {
          *reinterpret_cast<float2*>(dst + pe0 + 8 * i) =
              make_float2(o_pe[i][2 * h] * factor, o_pe[i][2 * h + 1] * factor);
        }
      }
      if (cw == 0 && t4 == 0) p.partial_lse[at] = lse2;
      continue;
    }
    char* const out = static_cast<char*>(p.out) +
                      (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * 2;
    auto put = [&](int col, float x0, float x1) {  // col is even; out_cols may be odd
      if (col + 1 < p.out_cols) {
        if (p.vec_out) {
          *reinterpret_cast<uint32_t*>(out + col * 2) = pack2<T::act>(x0, x1);
        } else {
          store_from_float<T::act>(out, col, x0);
          store_from_float<T::act>(out, col + 1, x1);
        }
      } else if (col < p.out_cols) {
        store_from_float<T::act>(out, col, x0);
      }
    };
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      put(256 * cw + 8 * i + 2 * t4, o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
    }
    if (pe_mine) {
#pragma unroll
      for (int i = 0; i < kPe; ++i) {
        put(pe0 + 8 * i + 2 * t4, o_pe[i][2 * h] * factor, o_pe[i][2 * h + 1] * factor);
      }
    }
    if (cw == 0 && p.lse != nullptr && t4 == 0) store_lse(p, head, t, lse2);
  }
}

// The same without k_pe columns (the seesaw: the 512 latent columns only).
template <class T>
__device__ __forceinline__ void store_rows(const MlaParams& p, const Work& w,
                                           const float (&o)[32][4], const float (&m)[2],
                                           const float (&l)[2], int row_a, int t4, int cw) {
  store_rows<T, 0>(p, w, o, nullptr, m, l, row_a, t4, cw);
}

}  // namespace pagedattn::cuda::mla
