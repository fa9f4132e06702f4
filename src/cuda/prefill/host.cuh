// Host side of the two prefill kernels: the shared memory limit, the launches over their grids
// and the occupancy the split planner reads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/attn_common/params.h"
#include "cuda/common/check.h"
#include "cuda/common/launch.cuh"

namespace pagedattn::cuda::prefill {

using attn::AttnParams;

// Host side of a prefill kernel `kKernel` of traits T (T::kThreads, T::layout().total), shared
// by the portable and the Hopper kernels: the dynamic shared memory limit raised once per device
// and kernel (benign if two threads race), the launch over q tiles x requests x KV heads and
// splits, and the occupancy the split planner reads.
template <class T>
struct PrefillHost {
  using Kernel = void (*)(AttnParams);
  template <Kernel kKernel>
  static void prepare(int device) {
    static std::atomic<uint64_t> done{0};  // one per kernel: a bit per device
    const uint64_t bit = uint64_t(1) << (device & 63);
    if (done.load(std::memory_order_acquire) & bit) return;
    PAGEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              T::layout().total));
    done.fetch_or(bit, std::memory_order_acq_rel);
  }
  template <Kernel kKernel>
  static void launch(const AttnParams& p, cudaStream_t stream) {
    const dim3 grid(unsigned(p.num_q_tiles) * unsigned(p.num_seqs) * unsigned(p.num_kv_heads),
                    unsigned(p.num_splits));
    if (grid.x == 0 || grid.y == 0) return;
    int device = 0;
    PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    prepare<kKernel>(device);
    launch_with_pdl(kKernel, grid, dim3(T::kThreads), T::layout().total, stream, p);
  }
  // The Hopper kernel's 1-D grid over the work tiles (x fastest, the split slowest, as the 2-D
  // grid above runs them): one CTA per work tile, or p.persistent CTAs (the backend caps it at
  // the resident count), each walking several work tiles.
  template <Kernel kKernel>
  static void launch_tiles(const AttnParams& p, cudaStream_t stream) {
    const int64_t total = int64_t(p.num_q_tiles) * p.num_seqs * p.num_kv_heads * p.num_splits;
    if (total == 0) return;
    int device = 0;
    PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    prepare<kKernel>(device);
    const int64_t ctas = p.persistent > 0 ? std::min(total, int64_t(p.persistent)) : total;
    launch_with_pdl(kKernel, dim3(unsigned(ctas)), dim3(T::kThreads), T::layout().total, stream, p);
  }
  template <Kernel kKernel>
  static int ctas_per_sm(int device) {
    prepare<kKernel>(device);
    int n = 0;
    PAGEDATTN_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, T::kThreads, T::layout().total));
    return n;
  }
};

}  // namespace pagedattn::cuda::prefill
