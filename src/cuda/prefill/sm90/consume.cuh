// The Hopper prefill kernel's consumer warpgroups: S = Q K^T and P V by wgmma, the softmax
// between them, O out through the epilogue. See kernel.cuh's map.
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/sm90/common.cuh"
#include "cuda/prefill/sm90/epilogue.cuh"
#include "cuda/prefill/softmax.cuh"

namespace pagedattn::cuda::prefill {

// P (the accumulator layout of S, keys 8 i + 2 (lane % 4) + {0, 1} in s[i]) as the e4m3 A
// operand of k step c (32 keys): register byte e of a[0] (row g) takes key position 4 t + e,
// which the producer's Vt holds as key 2 t + (e & 1) + 8 (e >> 1) of the step's first 16
// (produce_fp8_math), a[2] the same of its second 16; a[1], a[3] row g + 8. P is in [0, 1]:
// e4m3 without a scale, as FlashAttention-3 rounds it.
template <int kSn>
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[kSn][4], int c, uint32_t (&a)[4]) {
  auto pack4 = [](float k0, float k1, float k8, float k9) {
    return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(k0, k1), __NV_SATFINITE, __NV_E4M3)) |
           uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(k8, k9), __NV_SATFINITE, __NV_E4M3)) << 16;
  };
  a[0] = pack4(s[4 * c][0], s[4 * c][1], s[4 * c + 1][0], s[4 * c + 1][1]);
  a[1] = pack4(s[4 * c][2], s[4 * c][3], s[4 * c + 1][2], s[4 * c + 1][3]);
  a[2] = pack4(s[4 * c + 2][0], s[4 * c + 2][1], s[4 * c + 3][0], s[4 * c + 3][1]);
  a[3] = pack4(s[4 * c + 2][2], s[4 * c + 2][3], s[4 * c + 3][2], s[4 * c + 3][3]);
}

template <class T, bool kFeatures>
__device__ __forceinline__ void consume(const AttnParams& p, const attn::Work& w,
                                        unsigned char* smem, Barriers<T::kStages> bars, int n_tiles,
                                        const TileSeq& seq) {
  constexpr int D = T::head_size, kBlockN = T::kBlockN;
  constexpr int kStages = T::kStages, kNt = D / 8, kSn = kBlockN / 8;
  constexpr bool kBF16 = T::mma == DType::kBF16;  // the products' type (f16 over widened fp8)
  constexpr Sm90Layout lay = T::layout();
  const int it0 = seq.it;
  // The warpgroup index through a shuffle, as CUTLASS does: ptxas then knows it is uniform and
  // builds the wgmma descriptors (Q's base depends on it) in uniform registers, instead of
  // computing them per thread and moving each into uniform registers (48 R2UR per tile).
  // d128 / d256 +2-6%, d64 +0-3%.
  const int wg = warp_uniform(int(threadIdx.x) / 128);
  const int ct = int(threadIdx.x) % 128;
  const int cw = wg - 1;  // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 64 * cw + 16 * warp + g;
  const int wg_row0 = 64 * cw;
  const bool active = wg_row0 < w.num_rows;  // warpgroup-uniform
  const RowsSpan span =
      active ? rows_span(p, w, wg_row0, min(wg_row0 + 64, w.num_rows) - 1) : RowsSpan{};

  float o[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  // Rows row_a, row_a + 8: the KV head's k_scale (AttnParams::head_scales, else 1) times their
  // Q rows' scaling (rescale_q_row), factors of the logit scale.
  const float kf = attn::k_factor_of(p, w.kv_head);
  float2 undo = {kf, kf};
  // P of the previous tile, the A operand of its P V: k steps of 16 (16-bit) or 32 (e4m3) keys.
  constexpr int kPk = T::kFp8Math ? 32 : 16;
  uint32_t pa[kBlockN / kPk][4];

  const int qb = q_buffer<T>(seq.k);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset + qb * lay.q_bytes) + wg_row0 * 128;
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  auto parity = [&](int j) { return uint32_t(((it0 + j) / kStages) & 1); };
  auto stage = [&](int j) { return (it0 + j) % kStages; };
  // FA3's pingpong, in every work tile: the consumers take turns to issue their wgmmas, so
  // one's softmax runs while the other's products occupy the tensor cores (best or equal against
  // taking turns only in work tiles of at least 32, 64 or 128 K/V tiles, and against never, but
  // for the fp8-widening instances, 1-2% faster without it: docs/kernels/prefill.md). Named
  // barrier 2 + c is warpgroup c's turn; each takes its turn once per tile (computed or skipped,
  // so the counts always pair up), issues, and hands the turn on; warpgroup 0 holds the first.
  // Warpgroup 1's last hand-over of a work tile stays pending on barrier 2 and opens warpgroup
  // 0's first turn of the CTA's next work tile with K/V tiles; only the first such tile opens it
  // itself.
  auto turn_begin = [&] { sm90::named_barrier_sync(2 + cw, 256); };
  auto turn_end = [&] { sm90::named_barrier_arrive(2 + (cw + 1) % T::kConsumers, 256); };
  if (n_tiles > 0 && !seq.turns_open && cw == 0) sm90::named_barrier_arrive(2, 256);
  // The operand descriptors: from head size 128 and for the fp8 products built once per work
  // tile and advanced by constants per k step and by the stage's offset (sm90::desc_advance;
  // [SASS d128] uniform instructions in the consumer loop 111 -> 91; d256 +3-5%, d128 +1%),
  // else built per k step (16-bit d64 lost 3-4% to the advanced ones).
  constexpr bool kAdvance = D >= 128 || T::kFp8Math;
  const uint32_t v0 = stage0 + T::kPanels * lay.kv_panel;
  const uint64_t q_desc = sm90::sw128_desc(q_base, 16, 1024);
  const uint64_t k_desc = sm90::sw128_desc(stage0, 16, 1024);
  const uint64_t v_desc = sm90::sw128_desc(v0, T::kFp8Math ? 16 : lay.kv_panel, 1024);
  // S = Q K^T of the tile in stage s (K-major operands: a k step of 16 16-bit or 32 e4m3
  // columns is +32 B in a panel).
  auto issue_s = [&](float(&sacc)[kSn][4], int s) {
    const uint64_t k_at = sm90::desc_advance(k_desc, s * lay.stage_bytes);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / kPk; ++ks) {
      const uint32_t qo = (ks >> 2) * lay.q_panel + (ks & 3) * 32;
      const uint32_t ko = (ks >> 2) * lay.kv_panel + (ks & 3) * 32;
      const uint64_t da =
          kAdvance ? sm90::desc_advance(q_desc, qo) : sm90::sw128_desc(q_base + qo, 16, 1024);
      const uint64_t db = kAdvance ? sm90::desc_advance(k_at, ko)
                                   : sm90::sw128_desc(stage0 + s * lay.stage_bytes + ko, 16, 1024);
      if constexpr (T::kFp8Math) {
        sm90::WgmmaE4M3<kBlockN>::ss(sacc, da, db, ks > 0);
      } else {
        sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, ks > 0);
      }
    }
    sm90::wgmma_commit();
  };
  // O += P V of the tile in stage s. 16-bit: V is MN-major (16 keys are +2048 B, panels lbo
  // apart). e4m3: Vt is K-major (32 keys are +32 B of its rows).
  auto issue_pv = [&](int s) {
    const uint64_t v_at = sm90::desc_advance(v_desc, s * lay.stage_bytes);
    sm90::fence_operands(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int c = 0; c < kBlockN / kPk; ++c) {
      if constexpr (T::kFp8Math) {
        sm90::WgmmaE4M3<D>::rs(o, pa[c], sm90::desc_advance(v_at, c * 32), 1);
      } else {
        const uint64_t dv =
            kAdvance ? sm90::desc_advance(v_at, c * 2048)
                     : sm90::sw128_desc(v0 + s * lay.stage_bytes + c * 2048, lay.kv_panel, 1024);
        sm90::Wgmma<D, kBF16>::template rs<1>(o, pa[c], dv, 1);
      }
    }
    sm90::wgmma_commit();
  };
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&corr)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const bool need_mask = !(ts >= span.mask_lo && ts + kBlockN <= span.mask_hi);
    softmax_scores<kSn, kFeatures>(p, w, sacc, row_a, ts, need_mask, t4, m, l, corr, undo);
  };
  auto pack = [&](const float(&sacc)[kSn][4]) {
#pragma unroll
    for (int c = 0; c < kBlockN / kPk; ++c) {
      if constexpr (T::kFp8Math) {
        pack_p_e4m3(sacc, c, pa[c]);
      } else {
        pack_p<T::mma>(sacc, c, pa[c]);
      }
    }
  };
  // A tile this warpgroup's rows cannot see: released once landed (the other warpgroup may
  // need it; the producer refills a stage only when both have released it).
  auto skip = [&](int j) {
    const int s = stage(j);
    mbar_wait(bars.k_full(s), parity(j));
    turn_begin();
    turn_end();
    ptx::mbarrier_arrive(bars.k_empty(s));
    mbar_wait(bars.v_full(s), parity(j));
    ptx::mbarrier_arrive(bars.v_empty(s));
  };
  // Whether the consumers must fence the async proxy before their wgmmas read tile j's K (V):
  // only for what cp.async wrote (generic proxy, its completion arriving on the barrier with no
  // fence of the writer's). TMA writes through the async proxy, and the fp8 producers fence
  // their own stores (the widened panels, the transposed V) before arriving. The first tile of
  // a work tile always fences: its Q may have come by cp.async. [SASS] the fence is a
  // MEMBAR.ALL.CTA and a FENCE.VIEW.ASYNC.S.
  const int n_tma = tma_tiles<T>(p, w);
  auto k_fence = [&](int j) { return T::kFp8Math || (T::kv == KVKind::kSame && j >= n_tma); };
  auto v_fence = [&](int j) { return T::kv == KVKind::kSame && j >= n_tma; };
  // The tiles [j_lo, j_hi) this warpgroup computes.
  int j_lo = n_tiles, j_hi = n_tiles;
  if (active && span.lo < span.hi) {
    j_lo = (span.lo - w.kv_begin) / kBlockN;
    j_hi = min(n_tiles, ceil_div(span.hi - w.kv_begin, kBlockN));
  }
  mbar_wait(bars.q_full(qb), q_parity<T>(seq.k));
  if constexpr (T::kQRescale) {
    const float* const u =
        reinterpret_cast<const float*>(smem + lay.q_undo_offset) + qb * T::kBlockM;
    undo = make_float2(u[row_a] * kf, u[row_a + 8] * kf);
  }
  for (int j = 0; j < j_lo; ++j) skip(j);
  if (j_lo < j_hi) {
    // Straight-line wgmma groups, no flags: ptxas serialises the wgmmas (C7514 / C7518) when
    // a group's issue or wait sits under a condition it cannot prove warpgroup-uniform.
    {
      const int s = stage(j_lo);
      mbar_wait(bars.k_full(s), parity(j_lo));
      ptx::fence_proxy_async(ptx::space_shared);  // also for Q (cp.async without q_tma)
      float sacc[kSn][4], corr[2];
      turn_begin();
      issue_s(sacc, s);
      turn_end();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      ptx::mbarrier_arrive(bars.k_empty(s));  // S_j has read K_j: the producer may refill it
      softmax(sacc, j_lo, corr);              // O is still zero: nothing to rescale
      pack(sacc);
    }
    for (int j = j_lo + 1; j < j_hi; ++j) {
      const int s = stage(j), prev = stage(j - 1);
      mbar_wait(bars.k_full(s), parity(j));
      if (k_fence(j)) ptx::fence_proxy_async(ptx::space_shared);
      float sacc[kSn][4], corr[2];
      turn_begin();
      issue_s(sacc, s);
      // V_{j-1} only now: S_j need not wait for it (ncu: the V `full` poll was the consumers'
      // hottest instruction with the cp.async producer).
      mbar_wait(bars.v_full(prev), parity(j - 1));
      if (v_fence(j - 1)) ptx::fence_proxy_async(ptx::space_shared);
      issue_pv(prev);
      turn_end();
      sm90::wgmma_wait<1>();  // S_j done; P V of tile j - 1 still runs
      sm90::fence_operands(sacc);
      ptx::mbarrier_arrive(bars.k_empty(s));
      softmax(sacc, j, corr);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      ptx::mbarrier_arrive(bars.v_empty(prev));
      // Only when some row of the warp has a new max (corr != 1; exactly 1 otherwise), from
      // head size 128 and for the fp8 products: past the first tiles of a long row the max
      // rarely moves, and O's D / 2 multiplies per thread are worth a vote and a branch.
      // d256 16k +11%, d128 16k +2%, fp8 products d64 +2-3%; 16-bit d64 -4-5% (its 32
      // multiplies cost less than the vote), d80 equal.
      if ((D < 128 && !T::kFp8Math) ||
          __any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
        rescale_o(o, corr);
      }
      pack(sacc);
    }
    const int last = stage(j_hi - 1);
    mbar_wait(bars.v_full(last), parity(j_hi - 1));
    if (v_fence(j_hi - 1)) ptx::fence_proxy_async(ptx::space_shared);
    issue_pv(last);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    ptx::mbarrier_arrive(bars.v_empty(last));
  }
  for (int j = j_hi; j < n_tiles; ++j) skip(j);
  // Every wgmma reading Q has been waited for: from head size 80, O's rows go through the
  // warpgroup's own Q rows, and the producer may load a later work tile's Q into this buffer
  // once they are read back. e4m3 Q rows are half as wide as O's, and d64 was 1-2% slower
  // staged (d80 ViT 4% faster, d128 / d256 equal): those store from the fragments.
  constexpr bool kStaged = !T::kFp8Math && D >= 80;
  if (kStaged && staged_store(p)) {
    store_rows_staged<T::act>(p, w, o, m, l, wg_row0 + 16 * warp, q_base + 16 * warp * 128,
                              lay.q_panel, lane, bars.q_empty(qb));
  } else {
    ptx::mbarrier_arrive(bars.q_empty(qb));
    store_rows<T::act>(p, w, o, m, l, row_a, t4);
  }
}

}  // namespace pagedattn::cuda::prefill
