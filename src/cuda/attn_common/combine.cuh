// The second kernel of a split-KV (flash-decoding) launch of the decode or a prefill kernel:
// merges the num_splits partial results of every query row.
//
// Map
//   computes  for row (t, h): M = max_s lse_s, w_s = 2^(lse_s - M), out = sum_s w_s o_s /
//             sum_s w_s, lse = M + log2(sum_s w_s) (log2 units inside, natural log out), then
//             the sink and the output dtype (spec 4.12 applied num_splits ways; a split with
//             no keys has lse -inf and is never read).
//   grid      one warp per row, 4 rows per CTA; lane s holds split s's LSE (s < 64), and each
//             lane then owns 4 columns (float4) of each 128 of the head.
//   budget    no shared memory; reads num_splits * (v_head_size + 1) floats per row and writes
//             one output row: small next to the KV traffic when splits hold >= 256 keys.
//   test      split cases in tests/cuda (forced split counts) and every long-context case of
//             backend_ops; timed inside bench/gpu/bench_decode.
#pragma once

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/launch.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/common/launch.cuh"

namespace pagedattn::cuda::attn {

inline constexpr int kCombineRowsPerCta = 4;

template <DType kAct>
__global__ void __launch_bounds__(32 * kCombineRowsPerCta)
    combine_kernel(const __grid_constant__ AttnParams p) {
  // Launched right behind the attention kernel (programmatic dependent launch): wait for its
  // partials, and let the next kernel of the stream be scheduled behind us in turn.
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kCombineRowsPerCta + (threadIdx.x >> 5);
  if (row >= p.num_actual_tokens * p.num_heads) return;
  const int t = row / p.num_heads, h = row - t * p.num_heads;
  const int splits = p.num_splits;
  const int64_t split_rows = int64_t(p.num_actual_tokens) * p.num_heads;  // rows per split

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

  // Columns: lane owns float4 chunk `lane` (and `lane + 32` when v_head_size > 128).
  const int chunks = p.v_head_size / 4;
  float acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float wgt = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31);
    if (wgt == 0.0f) continue;  // warp-uniform: a split without keys is never read
    const float* src = p.partial_o + (s * split_rows + row) * p.v_head_size;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = lane + 32 * k;
      if (c < chunks) {
        const float4 v = reinterpret_cast<const float4*>(src)[c];
        acc[k][0] += wgt * v.x, acc[k][1] += wgt * v.y, acc[k][2] += wgt * v.z;
        acc[k][3] += wgt * v.w;
      }
    }
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float lse2 = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
  float sink_factor = 1.0f, lse2_out = lse2;
  if (p.sinks != nullptr) {
    const float sink2 = p.sinks[h] * kLog2e;
    const float m2 = fmaxf(lse2, sink2);
    lse2_out = m2 + log2f(exp2f(lse2 - m2) + exp2f(sink2 - m2));
    sink_factor = exp2f(lse2 - lse2_out);
  }
  char* out = static_cast<char*>(p.out) +
              (int64_t(t) * p.out_stride_token + int64_t(h) * p.out_stride_head) * kElemBytes<kAct>;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = lane + 32 * k;
    if (c < chunks) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        store_from_float<kAct>(out, 4 * c + i, acc[k][i] * inv * sink_factor);
    }
  }
  if (p.lse != nullptr && lane == 0) {
    const int64_t at = int64_t(h) * p.lse_stride_head + int64_t(t) * p.lse_stride_token;
    if (p.lse_is_f64) {
      static_cast<double*>(p.lse)[at] = double(lse2_out * kLn2);
    } else {
      static_cast<float*>(p.lse)[at] = lse2_out * kLn2;
    }
  }
}

template <DType kAct>
void CombineOps<kAct>::launch(const AttnParams& p, cudaStream_t stream) {
  const int rows = p.num_actual_tokens * p.num_heads;
  if (rows == 0 || p.num_splits <= 1) return;
  const int ctas = (rows + kCombineRowsPerCta - 1) / kCombineRowsPerCta;
  launch_with_pdl(combine_kernel<kAct>, dim3(unsigned(ctas)), dim3(32 * kCombineRowsPerCta), 0,
                  stream, p);
}

}  // namespace pagedattn::cuda::attn
