// The MLA decode kernel's redundant consumer (PAGEDATTN_CUDA_MLA=redundant, kept as a
// comparison): both warpgroups compute the same S and softmax. See kernel.cuh's map.
#pragma once

#include <cstdint>
#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/softmax.cuh"
#include "cuda/mla/store.cuh"
#include "cuda/mla/widen.cuh"

namespace pagedattn::cuda::mla {

template <class T>
__device__ __forceinline__ void consume(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  constexpr int kStages = T::kStages, kSn = kBlockN / 8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  const int cw = int(threadIdx.x) / 128 - 1;  // consumer warpgroup: kv_c columns 256 cw ..
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;  // this thread's rows: row_a and row_a + 8

  const RowBounds bounds = row_bounds(p, w, row_a);

  float o[32][4];    // kv_c columns 256 cw + 8 i + 2 t4 + {0, 1}, rows row_a, row_a + 8
  float o_pe[8][4];  // k_pe columns 512 + 8 i + ...
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) o_pe[i][0] = o_pe[i][1] = o_pe[i][2] = o_pe[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  uint32_t pa[kBlockN / 16][4];  // P of a tile: the A fragments of its P V
  // S = Q K^T of the tile in stage s (both K-major: 16 columns are +32 B inside a panel).
  auto issue_s = [&](float(&sacc)[kSn][4], int s) {
    const uint32_t k_base = stage0 + s * lay.stage_bytes;
    // Q's 36 descriptors are loop-invariant: hoisted, they took 72 registers and spilled (244
    // bytes); made opaque here, they are rebuilt per tile from one register.
    uint32_t q_at = q_base;
    asm volatile("" : "+r"(q_at));
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kEntry / 16; ++ks) {
      const uint64_t da =
          sm90::sw128_desc(q_at + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
      const uint64_t db =
          sm90::sw128_desc(k_base + (ks >> 2) * lay.kv_panel + (ks & 3) * 32, 16, 1024);
      sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, ks > 0);
    }
    sm90::wgmma_commit();
  };
  // O += P V: V is the same tile read MN-major (16 keys are +2048 B; panels kv_panel apart).
  auto issue_pv = [&](int s) {
    const uint32_t k_base = stage0 + s * lay.stage_bytes;
    sm90::fence_operands(o);
    sm90::fence_operands(o_pe);
    sm90::wgmma_fence();
    const uint32_t v_base = k_base + 4 * cw * lay.kv_panel;
    const uint32_t pe_base = k_base + 8 * lay.kv_panel;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      sm90::Wgmma<256, kBF16>::template rs<1>(
          o, pa[kk], sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024), 1);
      sm90::Wgmma<64, kBF16>::template rs<1>(
          o_pe, pa[kk], sm90::sw128_desc(pe_base + kk * 2048, lay.kv_panel, 1024), 1);
    }
    sm90::wgmma_commit();
  };
  // Online softmax of tile j in log2 units (one FFMA per score: the scale joins the exponent);
  // corr is the factor O must be rescaled by before P V of this tile joins it.
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&corr)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const float f = p.scale_log2;
    if (ts + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_row_max(sacc, h) * f);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
      corr[h] = sm80::exp2_approx(m[h] - base[h]);
      m[h] = m_new;
    }
    exp_scores(sacc, f, base, sum);
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
  };
  auto rescale = [&](const float(&corr)[2]) {
    scale_rows(o, corr);
    scale_rows(o_pe, corr);
  };
  // P as the A fragments of P V (the S accumulator layout is wgmma's register-A layout).
  auto pack = [&](const float(&sacc)[kSn][4]) { pack_p<T::act>(sacc, pa); };
  auto full_parity = [](int j) { return uint32_t((j / kStages) & 1); };
  mbar_wait(bars.q_full(), 0);
  // Straight-line wgmma groups (prologue, unconditional loop, epilogue): ptxas serialises the
  // wgmmas (C7514) when a group's issue or wait sits under a condition it cannot prove uniform.
  if constexpr (kStages >= 2) {
    // FlashAttention-3's intra-warpgroup overlap: iteration j issues S_j and then P V of tile
    // j - 1, waits for S_j only and runs its softmax while P V runs. The per-tile chain was S,
    // softmax, P V in series (~5 us per 64-key tile, 0.41-0.47 of the copy rate).
    if (n_tiles > 0) {
      {
        mbar_wait(bars.full(0), 0);
        ptx::fence_proxy_async(ptx::space_shared);
        float sacc[kSn][4], corr[2];
        issue_s(sacc, 0);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(sacc);
        softmax(sacc, 0, corr);  // O is still zero: nothing to rescale
        pack(sacc);
      }
      for (int j = 1; j < n_tiles; ++j) {
        const int s = j % kStages, prev = (j - 1) % kStages;
        mbar_wait(bars.full(s), full_parity(j));
        ptx::fence_proxy_async(ptx::space_shared);
        float sacc[kSn][4], corr[2];
        issue_s(sacc, s);
        issue_pv(prev);
        sm90::wgmma_wait<1>();  // S_j done; P V of tile j - 1 still runs
        sm90::fence_operands(sacc);
        softmax(sacc, j, corr);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(o);
        sm90::fence_operands(o_pe);
        ptx::mbarrier_arrive(bars.empty(prev));
        rescale(corr);
        pack(sacc);
      }
      const int last = (n_tiles - 1) % kStages;
      issue_pv(last);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(o_pe);
      ptx::mbarrier_arrive(bars.empty(last));
    }
  } else {
    // One stage (fp8: the widened tile): P V must finish before the stage is refilled.
    static_assert(T::kv == KVKind::kFp8);
    constexpr int kBarConsumers = 2;  // named barrier of the 256 consumer threads
    for (int j = 0; j < n_tiles; ++j) {
      if (j > 0) sm90::named_barrier_sync(kBarConsumers, 256);  // both past tile j - 1's P V
      widen_tile<T>(smem, bars, j, cw * 128 + ct, kBarConsumers, 256);
      float sacc[kSn][4], corr[2];
      issue_s(sacc, 0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      softmax(sacc, j, corr);
      rescale(corr);
      pack(sacc);
      issue_pv(0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(o_pe);
    }
  }

  store_rows<T, 8>(p, w, o, o_pe, m, l, row_a, t4, cw);
}

}  // namespace pagedattn::cuda::mla
