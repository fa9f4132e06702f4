// Row-wise pieces the MLA consumers share: the keys a row may see and their masking, row maxima
// over a quad, scores to P with the row sums, rescaling, P as RS wgmma fragments and into the P
// panel, and the exchange of row sums between the consumer warpgroups. See kernel.cuh's map.
#pragma once

#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/stmatrix.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"

namespace pagedattn::cuda::mla {

// Keys this thread's rows row_a and row_a + 8 may see: [kv_begin, hi[h]). Rows past the
// request are zero queries that nobody stores: they see the whole split (no mask of their own,
// no NaN). Tiles ending at or before `mask_from` need no mask (CTA-uniform).
struct RowBounds {
  int hi[2];
  int mask_from;
};
// The end of the keys packed row `row` of the CTA may see (causal: its token's position).
__device__ __forceinline__ int row_key_end(const MlaParams& p, const Work& w, int row) {
  return row < w.num_rows ? min(w.kv_len - w.q_len + (w.row0 + row) / p.num_heads + 1, w.kv_end)
                          : w.kv_end;
}
__device__ __forceinline__ RowBounds row_bounds(const MlaParams& p, const Work& w, int row_a) {
  RowBounds b;
#pragma unroll
  for (int h = 0; h < 2; ++h) b.hi[h] = row_key_end(p, w, row_a + 8 * h);
  b.mask_from = row_key_end(p, w, 0);  // the first row sees the fewest keys
  return b;
}

// -inf for the keys past each row's bound in a score tile whose first key is `ts` (columns
// 8 nt + 2 t4 + {0, 1} of the wgmma accumulator layout).
template <int kSn>
__device__ __forceinline__ void mask_scores(float (&sacc)[kSn][4], const RowBounds& b, int ts,
                                            int t4) {
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = ts + nt * 8 + 2 * t4 + (c & 1);
      if (key >= b.hi[c >> 1]) sacc[nt][c] = -INFINITY;
    }
  }
}

// Row h's (row_a + 8 h) maximum over this thread's scores and then its quad's (a quad holds
// a row's keys).
template <int kSn>
__device__ __forceinline__ float quad_row_max(const float (&sacc)[kSn][4], int h) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) mx = fmaxf(mx, fmaxf(sacc[nt][2 * h], sacc[nt][2 * h + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

// Scores to P in place, in log2 units (one FFMA per score: the scale joins the exponent),
// each row's P added to sum[h].
template <int kSn>
__device__ __forceinline__ void exp_scores(float (&sacc)[kSn][4], float f, const float (&base)[2],
                                           float (&sum)[2]) {
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      sacc[nt][c] = sm80::exp2_approx(fmaf(sacc[nt][c], f, -base[c >> 1]));
      sum[c >> 1] += sacc[nt][c];
    }
  }
}

// An accumulator's rows scaled: row_a's columns by s[0], row_a + 8's by s[1].
template <int kN>
__device__ __forceinline__ void scale_rows(float (&o)[kN][4], const float (&s)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i][0] *= s[0], o[i][1] *= s[0], o[i][2] *= s[1], o[i][3] *= s[1];
}

// P as the A fragments of an RS P V (the S accumulator layout is wgmma's register-A layout).
template <DType kAct, int kSn>
__device__ __forceinline__ void pack_p(const float (&sacc)[kSn][4], uint32_t (&pa)[kSn / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kSn / 2; ++kk) {
    pa[kk][0] = pack2<kAct>(sacc[2 * kk][0], sacc[2 * kk][1]);
    pa[kk][1] = pack2<kAct>(sacc[2 * kk][2], sacc[2 * kk][3]);
    pa[kk][2] = pack2<kAct>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
    pa[kk][3] = pack2<kAct>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
  }
}

// P's packed fragments (pack_p's layout) into the 128-byte-swizzled P panel [64 rows][64 keys]
// by stmatrix, four 8 x 8 tiles per instruction instead of four 4-byte stores: k block kk (16
// keys) is the panel's chunks chunk0 + 2 kk and + 1; lane l gives the address of row l % 8 (+ 8
// for l / 8 odd) of its warp's 16 rows in chunk + l / 16.
template <int kKk>
__device__ __forceinline__ void store_p_panel(const uint32_t (&pa)[kKk][4], uint32_t panel,
                                              int warp, int lane, int chunk0) {
  const int r = 16 * warp + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
  for (int kk = 0; kk < kKk; ++kk) {
    sm90::stmatrix_x4(panel + sm90::sw128_offset(r, chunk0 + 2 * kk + (lane >> 4)), pa[kk][0],
                      pa[kk][1], pa[kk][2], pa[kk][3]);
  }
}

// The consumer warpgroups that count row sums over different keys (split-S, seesaw) add them:
// thread ct of warpgroup cw swaps its two rows' sums with thread ct of the other through `xs`
// (2 x 128 x 2 floats of shared memory no wgmma reads any more; named barrier 2).
__device__ __forceinline__ void add_other_row_sums(float (&l)[2], float* xs, int cw, int ct) {
  sm90::named_barrier_sync(2, 256);
  xs[(cw * 128 + ct) * 2] = l[0];
  xs[(cw * 128 + ct) * 2 + 1] = l[1];
  sm90::named_barrier_sync(2, 256);
  l[0] += xs[((1 - cw) * 128 + ct) * 2];
  l[1] += xs[((1 - cw) * 128 + ct) * 2 + 1];
}

}  // namespace pagedattn::cuda::mla
