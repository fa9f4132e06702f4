// amax: max |x| over a device tensor, for KV-scale calibration (Attention's
// calculate_kv_scales).
//
// Map
//   computes  max |x| over every element of a strided tensor of any float type; a NaN anywhere
//             gives NaN (the reference's rule). |x| as float bits orders like the value, and
//             every NaN's bits exceed +inf's, so an unsigned atomicMax does both.
//   grid      grid-stride loop over linear indices (decomposed by the shape for any strides),
//             warp max by shuffles, one atomicMax per warp.
//   budget    no shared memory; one read of the tensor.
//   test      tests/cuda Amax* (vs the reference, strided views, NaN).
#pragma once

#include <cuda_runtime.h>

#include "cuda/amax/config.h"
#include "cuda/amax/launch.h"
#include "cuda/amax/params.h"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"

namespace pagedattn::cuda::amax {

__global__ void __launch_bounds__(kThreads) amax_kernel(const __grid_constant__ AmaxParams p) {
  unsigned int best = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i, offset = 0;
    for (int d = p.ndim - 1; d >= 0; --d) {
      const int64_t idx = rest % p.shape[d];
      rest /= p.shape[d];
      offset += idx * p.strides[d];
    }
    float v;
    if (p.dtype == int(DType::kF64)) {
      v = float(fabs(static_cast<const double*>(p.x)[offset]));
    } else {
      v = fabsf(load_as_float(p.x, offset, DType(p.dtype)));
    }
    best = max(best, __float_as_uint(v));  // v >= 0 or a positive NaN
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
  if ((threadIdx.x & 31) == 0 && best != 0) atomicMax(p.result, best);
}

void AmaxOps::launch(const AmaxParams& p, cudaStream_t stream) {
  PAGEDATTN_CUDA_CHECK(cudaMemsetAsync(p.result, 0, sizeof(unsigned int), stream));
  if (p.numel == 0) return;
  int64_t ctas = (p.numel + kThreads - 1) / kThreads;
  if (ctas > kMaxCtas) ctas = kMaxCtas;
  amax_kernel<<<unsigned(ctas), kThreads, 0, stream>>>(p);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::amax
