// fp8 latent caches, split-S: the consumers widen each raw tile into the 16-bit stage it landed
// in themselves. See kernel.cuh's map.
//
// Why the consumers: the producer's 4 warps took ~1.3 us per tile for it (80 of 247 us
// at h16 b64 c8192; the consumers' chain alone, with neither loads nor widening, 166 us); the
// consumers' 8 warps, each thread with all nine chunks of its row loaded before it converts
// any, made the fp8 cache 15-17% faster. Loading the next tile's chunks while P V runs was 1-2%
// slower than loading them here.
#pragma once

#include <cstdint>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"

namespace pagedattn::cuda::mla {

/// Tile j's raw fp8 rows ([64 keys][576 bytes] natural order, in the back half of stage
/// j % kStages: T::kRawInStage) widened into that stage's nine swizzled panels by the 256
/// consumer threads: thread u (0 .. 255) takes row u / 4, raw chunks u % 4 + 4 k (k < 9; chunk k
/// is in panel k), so warpgroup c writes keys 32 c .. 32 c + 31. The raw tile is overwritten by
/// the widened panels once all 256 threads hold their chunks (named barrier `all_bar`), and the
/// stage is released by its P V.
/// On entry both warpgroups must be past every read of the stage (tile j - kStages's P V). On
/// return the rows are ready for the wgmmas of the `bar_threads` threads synced on named barrier
/// `bar`: 128, one warpgroup, where it reads only its own keys until a later barrier of both
/// (split-S's S); 256 where both read every key.
template <class T>
__device__ __forceinline__ void widen_tile(unsigned char* smem, Barriers<T::kRing, T::kHalves> bars,
                                           int j, int u, int bar, int bar_threads,
                                           int all_bar = -1) {
  static_assert(T::kv == KVKind::kFp8 && T::kRawInStage && T::kRing == T::kStages);
  constexpr Layout lay = T::layout();
  const int slot = j % T::kRing, row = u / 4, lane_col = u % 4;
  mbar_wait(bars.full(slot), uint32_t((j / T::kRing) & 1));
  const unsigned char* const raw =
      smem + lay.raw_offset + slot * lay.raw_stride + row * kEntry + lane_col * 16;
  uint4 v[kPanels];
#pragma unroll
  for (int k = 0; k < kPanels; ++k) v[k] = *reinterpret_cast<const uint4*>(raw + k * 64);
  sm90::named_barrier_sync(all_bar, 256);  // every raw chunk read before any is overwritten

  unsigned char* const stage = smem + lay.stage_offset + (j % T::kStages) * lay.stage_bytes;
#pragma unroll
  for (int k = 0; k < kPanels; ++k) {
    const uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    uint32_t wide[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      wide[2 * q] = fp8x2_to_16bit<T::act>(uint16_t(words[q] & 0xffffu), false);
      wide[2 * q + 1] = fp8x2_to_16bit<T::act>(uint16_t(words[q] >> 16), false);
    }
    // The 16 fp8 values of raw chunk lane_col + 4 k are 16-bit chunks 2 lane_col and
    // 2 lane_col + 1 of the row's 64 columns in panel k.
    unsigned char* const panel = stage + k * lay.kv_panel;
    *reinterpret_cast<uint4*>(panel + sm90::sw128_offset(row, 2 * lane_col)) =
        make_uint4(wide[0], wide[1], wide[2], wide[3]);
    *reinterpret_cast<uint4*>(panel + sm90::sw128_offset(row, 2 * lane_col + 1)) =
        make_uint4(wide[4], wide[5], wide[6], wide[7]);
  }
  // Generic-proxy stores, read next by wgmma (async proxy).
  ptx::fence_proxy_async(ptx::space_shared);
  sm90::named_barrier_sync(bar, bar_threads);
}

}  // namespace pagedattn::cuda::mla
