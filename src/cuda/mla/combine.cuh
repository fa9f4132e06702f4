// The second kernel of a split-KV MLA launch: merges the num_splits partial results of every
// query row (576 columns; the decode family's combine stops at 256).
//
// Map
//   computes  for row (t, h): M = max_s lse_s, w_s = 2^(lse_s - M), out = sum_s w_s o_s /
//             sum_s w_s (its first p.out_cols columns; the partials hold those at least), lse = M +
//             log2(sum_s w_s) (log2 inside, natural log out); a split with no keys has lse -inf and
//             is never read.
//   grid      one warp per row, 4 rows per CTA; lane s holds split s's LSE (s < 64); each lane
//             then owns float4 chunks lane + 32 k of the row's 144.
//   budget    no shared memory; reads num_splits * 577 floats per row.
//   test      backend_ops mla cases with splits (forced and planned); timed in bench_mla.
#pragma once

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/launch.h"
#include "cuda/mla/store.cuh"

namespace pagedattn::cuda::mla {

inline constexpr int kCombineRowsPerCta = 4;

template <DType kAct>
__global__ void __launch_bounds__(32 * kCombineRowsPerCta)
    mla_combine_kernel(const __grid_constant__ MlaParams p) {
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();
  constexpr int kChunks = kEntry / 4, kPerLane = (kChunks + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kCombineRowsPerCta + (threadIdx.x >> 5);
  if (row >= p.num_actual_tokens * p.num_heads) return;
  const int t = row / p.num_heads, h = row - t * p.num_heads;
  const int splits = p.num_splits;
  const int64_t split_rows = int64_t(p.num_actual_tokens) * p.num_heads;

  const float l0 = lane < splits ? p.partial_lse[lane * split_rows + row] : -INFINITY;
  const float l1 = lane + 32 < splits ? p.partial_lse[(lane + 32) * split_rows + row] : -INFINITY;
  float mx = fmaxf(l0, l1);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float base = mx == -INFINITY ? 0.0f : mx;
  const float w0 = exp2f(l0 - base), w1 = exp2f(l1 - base);
  float sum = w0 + w1;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);

  const int out_chunks = (p.out_cols + 3) / 4;  // only these are read and written
  float acc[kPerLane][4] = {};
  for (int s = 0; s < splits; ++s) {
    const float wgt = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31);
    if (wgt == 0.0f) continue;  // warp-uniform: a split without keys is never read
    const float4* src =
        reinterpret_cast<const float4*>(p.partial_o + (s * split_rows + row) * kEntry);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = lane + 32 * k;
      if (c < out_chunks) {
        const float4 v = src[c];
        acc[k][0] += wgt * v.x, acc[k][1] += wgt * v.y, acc[k][2] += wgt * v.z;
        acc[k][3] += wgt * v.w;
      }
    }
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  char* const out = static_cast<char*>(p.out) +
                    (int64_t(t) * p.out_stride_token + int64_t(h) * p.out_stride_head) * 2;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < out_chunks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (4 * c + i < p.out_cols) store_from_float<kAct>(out, 4 * c + i, acc[k][i] * inv);
      }
    }
  }
  if (p.lse != nullptr && lane == 0) store_lse(p, h, t, sum > 0.0f ? mx + log2f(sum) : -INFINITY);
}

template <DType kAct>
void MlaCombineOps<kAct>::launch(const MlaParams& p, cudaStream_t stream) {
  const int rows = p.num_actual_tokens * p.num_heads;
  if (rows == 0 || p.num_splits <= 1) return;
  const int ctas = (rows + kCombineRowsPerCta - 1) / kCombineRowsPerCta;
  launch_with_pdl(mla_combine_kernel<kAct>, dim3(unsigned(ctas)), dim3(32 * kCombineRowsPerCta), 0,
                  stream, p);
}

}  // namespace pagedattn::cuda::mla
