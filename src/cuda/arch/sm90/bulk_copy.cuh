// sm_90 bulk copies (cp.async.bulk, global -> shared) completing on an mbarrier, for kernels
// that also build for older GPUs: on those the wrappers compile to a trap and the host must
// not select the path (the decode kernel's bulk_copy flag is set only on cc >= 9).
#pragma once

#include <cstdint>
#include <cuda/ptx>

namespace pagedattn::cuda::sm90 {

/// Initialises `bar` for `count` arrivals and makes it visible to the async proxy; the caller
/// still orders it before other threads' uses (__syncwarp / __syncthreads).
__device__ __forceinline__ void bulk_barrier_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::mbarrier_init(bar, count);
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
#else
  (void)bar, (void)count;
  __trap();
#endif
}

/// One arrival on `bar` that also expects `bytes` more bytes of bulk copies in this phase.
__device__ __forceinline__ void bulk_arrive_expect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                         ::cuda::ptx::space_shared, bar, bytes);
#else
  (void)bar, (void)bytes;
  __trap();
#endif
}

/// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to
/// shared `dst`, counted on `bar` when they land.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_shared, ::cuda::ptx::space_global, dst, src, bytes,
                             bar);
#else
  (void)dst, (void)src, (void)bytes, (void)bar;
  __trap();
#endif
}

/// Spins until the phase of `bar` with parity `parity` has completed (its copies are visible).
__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
#else
  (void)bar, (void)parity;
  __trap();
#endif
}

}  // namespace pagedattn::cuda::sm90
