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

/// A 3-D tiled TMA load of the box at `coords` of `map` into shared `dst`, counted on `bar` as
/// it lands, with the L2 eviction `policy` (createpolicy's operand) on its reads.
__device__ __forceinline__ void tma_load_3d_hint(void* dst, const void* map,
                                                 const int32_t (&coords)[3], uint64_t* bar,
                                                 uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(map), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "l"(policy)
      : "memory");
#else
  (void)dst, (void)map, (void)coords, (void)bar, (void)policy;
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
