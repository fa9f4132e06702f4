// The MLA decode kernel's seesaw consumer (16-bit caches, the default above 64 heads): each
// warpgroup owns alternate tiles and half of O. See kernel.cuh's map.
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

namespace pagedattn::cuda::mla {

// The seesaw (see the map), for warpgroup kC: it owns tiles j = kC (mod 2) and O's kv_c columns
// 256 kC .. 256 kC + 255 (no P k_pe: the output is the 512 latent columns), so its P V reads only
// its half of a stage (panels 0-3, or 4-7; panel 8 is read by S only), which it frees on its own. O
// and the row sums l (own tiles only) are kept at the row maxima m_ref they were last moved to;
// both warpgroups end at the chain's last maxima, so the sums add. Compiled once per warpgroup:
// every wgmma group sits in straight-line code.
template <class T, int kC>
__device__ __forceinline__ void seesaw_warpgroup(const MlaParams& p, const Work& w,
                                                 unsigned char* smem,
                                                 Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  constexpr int kSn = kBlockN / 8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  static_assert(T::kOutCols == kLatent, "the seesaw computes the kv_c columns only");
  constexpr Layout lay = T::layout();
  constexpr int kBarMax = 3, kBarP = 5;  // + the owner warpgroup (2: add_other_row_sums)
  constexpr int kOther = 1 - kC;
  // Panels of this warpgroup's half: [kMine0, kMine1); the other half is the rest.
  constexpr int kMine0 = kC == 0 ? 0 : kHalfPanel, kMine1 = kC == 0 ? kHalfPanel : kPanels;
  static_assert(T::kStages == 2 && T::kHalves == 2, "tile j: stage j % 2, owner j % 2");
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;

  const RowBounds bounds = row_bounds(p, w, row_a);

  float o[32][4];  // kv_c columns 256 kC + 8 i + 2 t4 + {0, 1}, rows row_a, row_a + 8
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_ref[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t pa[kBlockN / 16][4];  // P of the own tile whose P V (RS) may be in flight

  float* const xchg = reinterpret_cast<float*>(smem + lay.xchg_offset);  // [2][64] maxima
  unsigned char* const p_tile = smem + lay.p_offset;                     // [64 rows][64 keys]
  const uint32_t p_base = sm80::smem_addr(p_tile);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  auto stage_of = [&](int j) { return stage0 + uint32_t(j & 1) * lay.stage_bytes; };
  auto wait_half = [&](int j, int h) {
    mbar_wait(bars.full(j & 1, h), uint32_t((j >> 1) & 1));
    ptx::fence_proxy_async(ptx::space_shared);  // cp.async tiles are generic-proxy writes
  };

  auto fence_o = [&] { sm90::fence_operands(o); };
  // pa stays allocated until the RS wgmma reading it has completed (waited before this).
  auto keep_pa = [&] {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pa[kk][i])::"memory");
    }
  };
  // S = Q K^T of own tile j, whole 64 keys: this warpgroup's half of the panels first (the
  // producer brings it first), then the other half as it lands; two commit groups. Q's
  // descriptors opaque, as in consume().
  auto issue_s = [&](float(&sacc)[kSn][4], int j) {
    const uint32_t k_base = stage_of(j);
    uint32_t q_at = q_base;
    asm volatile("" : "+r"(q_at));
    auto steps = [&](int ks0, int ks1, bool first) {
#pragma unroll
      for (int ks = ks0; ks < ks1; ++ks) {
        const uint64_t da =
            sm90::sw128_desc(q_at + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
        const uint64_t db =
            sm90::sw128_desc(k_base + (ks >> 2) * lay.kv_panel + (ks & 3) * 32, 16, 1024);
        sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, !(first && ks == ks0));
      }
    };
    wait_half(j, kC);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
    steps(4 * kMine0, 4 * kMine1, true);
    // Two groups: a wait between the wgmmas of one group made ptxas insert its own fence on
    // the wait's divergent path and serialise the wgmmas (C7520).
    sm90::wgmma_commit();
    wait_half(j, kOther);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
    if constexpr (kC == 0) {
      steps(4 * kHalfPanel, 4 * kPanels, false);
    } else {
      steps(0, 4 * kHalfPanel, false);
    }
    sm90::wgmma_commit();
  };
  // O += P_j V_j over this warpgroup's columns: V MN-major (16 keys are +2048 B). P from
  // registers (own tile) or the panel (the other's).
  auto issue_pv = [&](int j, auto from_regs) {
    const uint32_t v_base = stage_of(j) + 4 * kC * lay.kv_panel;
    fence_o();
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dv = sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024);
      if constexpr (decltype(from_regs)::value) {
        sm90::Wgmma<256, kBF16>::template rs<1>(o, pa[kk], dv, 1);
      } else {
        const uint64_t dp = sm90::sw128_desc(p_base + kk * 32, 16, 1024);
        sm90::Wgmma<256, kBF16>::template ss<1>(o, dp, dv, 1);
      }
    }
    sm90::wgmma_commit();
  };
  // This warpgroup's half of tile j's stage is no longer read by it (its P V of j is done).
  auto release = [&](int j) { ptx::mbarrier_arrive(bars.empty(j & 1, kC)); };
  // O and l from m_ref to the maxima m_new (no P V of this warpgroup in flight); warps whose
  // rows' maxima did not move skip the multiplies.
  auto move_to = [&](const float(&m_new)[2]) {
    float sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h] = sm80::exp2_approx(m_ref[h] - (m_new[h] == -INFINITY ? 0.0f : m_new[h]));
      m_ref[h] = m_new[h];
      l[h] *= sc[h];
    }
    if (__any_sync(0xffffffffu, sc[0] != 1.0f || sc[1] != 1.0f)) scale_rows(o, sc);
  };
  // The other warpgroup's tile j: its maxima (O moved to them), then its P V from the panel
  // over this warpgroup's half (landed: the owner's S waited for it; waited again here, a
  // completed phase, so that this warpgroup itself observes the copies).
  auto join_other = [&](int j) {
    sm90::named_barrier_sync(kBarMax + kOther, 256);
    const float m_j[2] = {xchg[kOther * kBlockM + row_a], xchg[kOther * kBlockM + row_a + 8]};
    move_to(m_j);
    sm90::named_barrier_sync(kBarP + kOther, 256);
    wait_half(j, kC);
    issue_pv(j, std::false_type{});
  };
  // Own tile j, S done: mask, the chain's new maxima (published at once: the other warpgroup's
  // next softmax waits on them), P in log2 units, its row sums.
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&m_new)[2], float(&sum)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const float f = p.scale_log2;
    if (ts + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(m_ref[h], quad_row_max(sacc, h) * f);
      if (t4 == 0) xchg[kC * kBlockM + row_a + 8 * h] = m_new[h];
      base[h] = m_new[h] == -INFINITY ? 0.0f : m_new[h];
      sum[h] = 0.0f;
    }
    sm90::named_barrier_arrive(kBarMax + kC, 256);
    exp_scores(sacc, f, base, sum);
  };
  // After this warpgroup's last P V read the panel: P_j into pa for this one's RS P V and into
  // the panel for the other warpgroup, then O to the new maxima (after P is out: the other's P V
  // waits for P, not for this rescale).
  auto publish_p = [&](const float(&sacc)[kSn][4], const float(&m_new)[2], const float(&sum)[2]) {
    pack_p<T::act>(sacc, pa);
    store_p_panel(pa, p_base, warp, lane, 0);
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_arrive(kBarP + kC, 256);
    move_to(m_new);
    l[0] += sum[0];
    l[1] += sum[1];
  };

  mbar_wait(bars.q_full(), 0);
  int j = kC;
  if constexpr (kC == 0) {
    if (n_tiles > 0) {  // tile 0: nothing before it joins O
      float sacc[kSn][4], m_new[2], sum[2];
      issue_s(sacc, 0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      softmax(sacc, 0, m_new, sum);
      publish_p(sacc, m_new, sum);
      issue_pv(0, std::true_type{});
      j = 2;
    }
  }
  for (; j < n_tiles; j += 2) {
    // This warpgroup's P V of tile j - 2 done: its half of the stage is freed before tile j
    // is awaited (the producer refills it only when it is free).
    sm90::wgmma_wait<0>();
    keep_pa();
    fence_o();
    if (j >= 2) release(j - 2);
    float sacc[kSn][4], m_new[2], sum[2];
    // The other's P V before S_j: its half of tile j - 1 frees ~one S earlier, and the
    // producer refills it sooner (1.5-3.5% at 128 heads over S_j first).
    join_other(j - 1);
    issue_s(sacc, j);
    sm90::wgmma_wait<2>();  // P_{j-1} V done; S_j's two groups still run
    fence_o();
    release(j - 1);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(sacc);
    softmax(sacc, j, m_new, sum);
    publish_p(sacc, m_new, sum);
    issue_pv(j, std::true_type{});
  }
  sm90::wgmma_wait<0>();
  keep_pa();
  fence_o();
  if (j >= 2) release(j - 2);                      // the last own tile
  if (n_tiles > 0 && ((n_tiles - 1) & 1) != kC) {  // the last tile is the other's
    join_other(n_tiles - 1);
    sm90::wgmma_wait<0>();
    fence_o();
    release(n_tiles - 1);
  }

  // Row sums of the other warpgroup's tiles (same rows, same final maxima) through the P
  // panel, free once both are past their last P V.
  add_other_row_sums(l, reinterpret_cast<float*>(p_tile), kC, ct);
  store_rows<T>(p, w, o, m_ref, l, row_a, t4, kC);
}

template <class T>
__device__ __forceinline__ void consume_seesaw(const MlaParams& p, const Work& w,
                                               unsigned char* smem,
                                               Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  if (threadIdx.x < 256) {
    seesaw_warpgroup<T, 0>(p, w, smem, bars, n_tiles);
  } else {
    seesaw_warpgroup<T, 1>(p, w, smem, bars, n_tiles);
  }
}

}  // namespace pagedattn::cuda::mla
