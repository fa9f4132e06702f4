// The MLA decode kernel's split-S consumer (the default for fp8 caches and up to 64 heads):
// each warpgroup computes S for half the keys of a tile. See kernel.cuh's map.
#pragma once

#include <cstdint>
#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/cluster_merge.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/softmax.cuh"
#include "cuda/mla/store.cuh"
#include "cuda/mla/widen.cuh"

namespace pagedattn::cuda::mla {

template <class T>
__device__ __forceinline__ void consume_split_s(const MlaParams& p, const Work& w,
                                                unsigned char* smem,
                                                Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  constexpr int kStages = T::kStages, kHalf = kBlockN / 2, kSn = kHalf / 8;
  // P k_pe (both warpgroups compute it, warpgroup 0 stores it) only for 576-column outputs: at
  // 512 each warpgroup's P V is m64n256 instead of n256 + n64.
  constexpr bool kPe = T::kOutCols > kLatent;
  constexpr bool kFp8 = T::kv == KVKind::kFp8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  constexpr int kBarConsumers = 2;  // named barrier of the 256 consumer threads (1: producer)
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  const int cw = int(threadIdx.x) / 128 - 1;  // keys 32 cw .. of S; kv_c columns 256 cw ..
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;

  const RowBounds bounds = row_bounds(p, w, row_a);

  float o[32][4];
  float o_pe[kPe ? 8 : 1][4];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < (kPe ? 8 : 1); ++i) o_pe[i][0] = o_pe[i][1] = o_pe[i][2] = o_pe[i][3] = 0.0f;
  // m is the same in both warpgroups (both see both halves' maxima); l counts own keys only.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  float* const xchg = reinterpret_cast<float*>(smem + lay.xchg_offset);  // [2][64]
  unsigned char* const p_tile = smem + lay.p_offset;                     // [64 rows][64 keys]
  const uint32_t p_base = sm80::smem_addr(p_tile);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  mbar_wait(bars.q_full(), 0);
  // fp8 in place (two stages): tile 0 here, tile j + 1 while tile j's P V runs (below).
  if constexpr (T::kRawInStage) {
    if (n_tiles > 0) widen_tile<T>(smem, bars, 0, cw * 128 + ct, 3 + cw, 128, kBarConsumers);
  }
  for (int j = 0; j < n_tiles; ++j) {
    const int s = kStages == 1 ? 0 : j % kStages;
    if constexpr (kFp8 && !T::kRawInStage) {
      // Both warpgroups past tile j - 1's P V: the stage is free to widen tile j into. Each
      // widens the 32 keys its S reads (named barrier 3 + cw); P V reads the other's after the
      // P barrier below, which both pass after their widening.
      if (j > 0) sm90::named_barrier_sync(kBarConsumers, 256);
      widen_tile<T>(smem, bars, j, cw * 128 + ct, 3 + cw, 128);
    } else if constexpr (!kFp8) {
      mbar_wait(bars.full(s), uint32_t((j / kStages) & 1));
      ptx::fence_proxy_async(ptx::space_shared);
    }
    const uint32_t k_base = stage0 + s * lay.stage_bytes;

    // S for this warpgroup's 32 keys: rows 32 cw .. of every K panel (+4096 B).
    float sacc[kSn][4];
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kEntry / 16; ++ks) {
      const uint64_t da =
          sm90::sw128_desc(q_base + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
      const uint64_t db = sm90::sw128_desc(
          k_base + (ks >> 2) * lay.kv_panel + cw * kHalf * 128 + (ks & 3) * 32, 16, 1024);
      sm90::Wgmma<kHalf, kBF16>::template ss<0>(sacc, da, db, ks > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(sacc);

    const int ts = w.kv_begin + j * kBlockN + cw * kHalf;  // first key of this half
    const float f = p.scale_log2;
    if (w.kv_begin + j * kBlockN + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = quad_row_max(sacc, h);
      if (t4 == 0) xchg[cw * kBlockM + row_a + 8 * h] = mx[h];
    }
    // Both halves' maxima are in; both warpgroups are also past the P V of tile j - 1, which
    // read the P panel that this tile overwrites below.
    sm90::named_barrier_sync(kBarConsumers, 256);
    float corr[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = xchg[(1 - cw) * kBlockM + row_a + 8 * h];
      const float m_new = fmaxf(m[h], fmaxf(mx[h], other) * f);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;
      corr[h] = sm80::exp2_approx(m[h] - base[h]);
      m[h] = m_new;
    }
    exp_scores(sacc, f, base, sum);
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
    scale_rows(o, corr);
    if constexpr (kPe) scale_rows(o_pe, corr);
    // This half of P into the panel (K-major A operand: key k of row r is 16-bit element k of
    // the row's 128 bytes): keys 32 cw .. 32 cw + 31 are chunks 4 cw .. 4 cw + 3.
    {
      uint32_t pk[kSn / 2][4];
      pack_p<T::act>(sacc, pk);
      store_p_panel(pk, p_base, warp, lane, 4 * cw);
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_sync(kBarConsumers, 256);

    // O += P V over all 64 keys: P from the panel (+32 B per 16 keys), V MN-major as in consume.
    sm90::fence_operands(o);
    if constexpr (kPe) sm90::fence_operands(o_pe);
    sm90::wgmma_fence();
    const uint32_t v_base = k_base + 4 * cw * lay.kv_panel;
    const uint32_t pe_base = k_base + 8 * lay.kv_panel;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dp = sm90::sw128_desc(p_base + kk * 32, 16, 1024);
      sm90::Wgmma<256, kBF16>::template ss<1>(
          o, dp, sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024), 1);
      if constexpr (kPe) {
        sm90::Wgmma<64, kBF16>::template ss<1>(
            o_pe, dp, sm90::sw128_desc(pe_base + kk * 2048, lay.kv_panel, 1024), 1);
      }
    }
    sm90::wgmma_commit();
    // Tile j + 1 widened into the other stage under this P V: both warpgroups are past tile
    // j - 1's P V, the other stage's last reader (the maxima barrier above).
    if constexpr (T::kRawInStage) {
      if (j + 1 < n_tiles) {
        widen_tile<T>(smem, bars, j + 1, cw * 128 + ct, 3 + cw, 128, kBarConsumers);
      }
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    if constexpr (kPe) sm90::fence_operands(o_pe);
    if constexpr (!kFp8 || T::kRawInStage) ptx::mbarrier_arrive(bars.empty(s));
  }

  // Row sums: thread ct of the other warpgroup holds the same rows' sums over the other half
  // of the keys; exchanged through the P panel, free once both warpgroups are past their last
  // P V (the barrier).
  add_other_row_sums(l, reinterpret_cast<float*>(p_tile), cw, ct);
  if constexpr (kPe) {
    store_rows<T, 8>(p, w, o, o_pe, m, l, row_a, t4, cw);
  } else {
    if constexpr (T::kClusterMerge) {
      if (p.split_cluster > 1) {
        merge_rows_in_cluster<T>(p, w, smem + lay.stage_offset, o, m, l, row_a, t4, cw, ct);
        return;
      }
    }
    store_rows<T>(p, w, o, m, l, row_a, t4, cw);
  }
}

}  // namespace pagedattn::cuda::mla
