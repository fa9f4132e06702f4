// The MLA decode kernel's swap-AB consumer (Consumer::kSwapAB): CTAs of 16 packed rows, the
// products transposed so that the rows are wgmma's N side. See kernel.cuh's map.
//
// Why: with 16 heads x 1 token a 64-row M tile is three quarters zero rows, and split-S's
// products read Q's 64 rows (2 KB per k step) and P's from shared memory for every tile: ~328 KB
// of shared-memory reads per 64-key tile and four times the tensor work. Here
//   S^T [64 keys][16 rows] = K [64 keys][576] . Q^T  (m64n16k16 SS, K-major both: the stage
//       and Q's 16-row panels as they are), its 36 k steps split between the warpgroups (18 each)
//       and the partial sums exchanged through shared memory;
//   O^T [512 cols][16 rows] += V^T [512][64 keys] . P^T  (m64n16k16 SS, V^T the stage's panels
//       read MN-major, P^T one 16-row panel), warpgroup c the columns 256 c .. 256 c + 255;
// ~170 KB of shared-memory reads per tile. Both warpgroups run the same softmax on the summed
// S^T (8 scores per thread); each writes half of P^T's rows. Q's 18 KB leave room for two 16-bit
// stages over an fp8 cache too: the consumers widen tile j + 1 into the other stage while tile
// j's P V runs ([H100] +9-11% over one stage, 2026-12-06-h100-mla-swap-ab-fp8-stages.txt).
#pragma once

#include <cstdint>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/softmax.cuh"
#include "cuda/mla/store.cuh"
#include "cuda/mla/widen.cuh"

namespace pagedattn::cuda::mla {

template <class T>
__device__ __forceinline__ void consume_swap_ab(const MlaParams& p, const Work& w,
                                                unsigned char* smem,
                                                Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  static_assert(T::kBlockM == 16 && T::kOutCols == kLatent);
  constexpr int kStages = T::kStages;
  constexpr bool kFp8 = T::kv == KVKind::kFp8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  constexpr int kBarBoth = 2;  // named barrier of the 256 consumer threads (1: producer)
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  const int cw = int(threadIdx.x) / 128 - 1;  // k steps 18 cw ..; columns 256 cw ..
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int bar_own = 3 + cw;  // named barrier of this warpgroup

  // This thread's scores st[i][c] (m64n16 accumulator): key 16 warp + g + 8 (c >> 1), row
  // 8 i + 2 t4 + (c & 1); its four rows are indexed rr = 2 i + (c & 1). O^T's ot[n][i][c]:
  // column 256 cw + 64 n + 16 warp + g + 8 (c >> 1), the same rows.
  auto row_of = [&](int rr) { return 8 * (rr >> 1) + 2 * t4 + (rr & 1); };
  int hi[4];  // keys row rr may see: [kv_begin, hi[rr]); rows past the request see the split
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) hi[rr] = row_key_end(p, w, row_of(rr));
  const int mask_from = row_key_end(p, w, 0);  // the first row sees the fewest keys

  float ot[4][2][4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int i = 0; i < 2; ++i) ot[n][i][0] = ot[n][i][1] = ot[n][i][2] = ot[n][i][3] = 0.0f;
  }
  // m: running row maxima (log2 units), the same in both warpgroups; l: this thread's share of
  // the row sums (its two keys of every tile), added over the CTA at the end.
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  float4* const xs = reinterpret_cast<float4*>(smem + lay.xchg_offset);  // [2][128][2]
  float* const red = reinterpret_cast<float*>(smem + lay.xchg_offset + 2 * 128 * 8 * 4);
  unsigned char* const p_tile = smem + lay.p_offset;  // P^T [16 rows][64 keys]
  const uint32_t p_base = sm80::smem_addr(p_tile);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  // Row maxima or sums of this warpgroup's four warps for the thread's rows: each warp's quad
  // lanes (g = 0) publish, the warpgroup syncs, every thread reads its rows' four values.
  auto over_warps = [&](float(&v)[4], bool is_max) {
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v[rr], x);
        v[rr] = is_max ? fmaxf(v[rr], o) : v[rr] + o;
      }
      if (g == 0) red[(cw * 4 + warp) * 16 + row_of(rr)] = v[rr];
    }
    sm90::named_barrier_sync(bar_own, 128);
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      float a = red[(cw * 4) * 16 + row_of(rr)];
#pragma unroll
      for (int k = 1; k < 4; ++k) {
        const float b = red[(cw * 4 + k) * 16 + row_of(rr)];
        a = is_max ? fmaxf(a, b) : a + b;
      }
      v[rr] = a;
    }
  };

  static_assert(kStages == 2, "fp8: tile j + 1 is widened while tile j's P V reads the other");
  mbar_wait(bars.q_full(), 0);
  // fp8: both warpgroups read every key of a widened tile (barrier of both). Tile j + 1 is
  // widened below while tile j's P V runs.
  if constexpr (kFp8) {
    if (n_tiles > 0) widen_tile<T>(smem, bars, 0, cw * 128 + ct, kBarBoth, 256);
  }
  for (int j = 0; j < n_tiles; ++j) {
    const int s = j % kStages;
    if constexpr (!kFp8) {
      mbar_wait(bars.full(s), uint32_t((j / kStages) & 1));
      ptx::fence_proxy_async(ptx::space_shared);
    }
    const uint32_t k_base = stage0 + s * lay.stage_bytes;

    // This warpgroup's half of S^T's k steps: 16 columns are +32 B inside a 64-column panel.
    float st[2][4];
    sm90::fence_operands(st);
    sm90::wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < kEntry / 32; ++kq) {
      const int ks = cw * (kEntry / 32) + kq;
      const uint32_t at = (ks >> 2) * lay.kv_panel + (ks & 3) * 32;
      const uint64_t da = sm90::sw128_desc(k_base + at, 16, 1024);
      const uint64_t db =
          sm90::sw128_desc(q_base + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
      sm90::Wgmma<16, kBF16>::template ss<0>(st, da, db, kq > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(st);
    // The other warpgroup's partial sums: thread ct of both holds the same (key, row) pairs.
    // Both warpgroups are past tile j - 1's P V here, which read P^T.
    xs[(cw * 128 + ct) * 2] = make_float4(st[0][0], st[0][1], st[0][2], st[0][3]);
    xs[(cw * 128 + ct) * 2 + 1] = make_float4(st[1][0], st[1][1], st[1][2], st[1][3]);
    sm90::named_barrier_sync(kBarBoth, 256);
    {
      const float4 a = xs[((1 - cw) * 128 + ct) * 2], b = xs[((1 - cw) * 128 + ct) * 2 + 1];
      // a + b in both warpgroups is b + a in the other: the same bits, the same softmax.
      st[0][0] += a.x, st[0][1] += a.y, st[0][2] += a.z, st[0][3] += a.w;
      st[1][0] += b.x, st[1][1] += b.y, st[1][2] += b.z, st[1][3] += b.w;
    }

    const int ts = w.kv_begin + j * kBlockN;
    if (ts + kBlockN > mask_from) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (ts + 16 * warp + g + 8 * (c >> 1) >= hi[2 * i + (c & 1)]) st[i][c] = -INFINITY;
        }
      }
    }
    const float f = p.scale_log2;
    float mx[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) mx[rr] = fmaxf(st[rr >> 1][rr & 1], st[rr >> 1][2 + (rr & 1)]);
    over_warps(mx, true);
    float corr[4], base[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      const float m_new = fmaxf(m[rr], mx[rr] * f);
      base[rr] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
      corr[rr] = sm80::exp2_approx(m[rr] - base[rr]);
      m[rr] = m_new;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int rr = 2 * i + (c & 1);
        st[i][c] = sm80::exp2_approx(fmaf(st[i][c], f, -base[rr]));
      }
    }
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      l[rr] = l[rr] * corr[rr] + st[rr >> 1][rr & 1] + st[rr >> 1][2 + (rr & 1)];
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) ot[n][i][c] *= corr[2 * i + (c & 1)];
      }
    }
    // P^T rows 8 cw .. 8 cw + 7 (i = cw): row r's 64 keys are its 128 swizzled bytes.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = 8 * cw + 2 * t4 + (c & 1), key = 16 * warp + g + 8 * (c >> 1);
      const float v = cw == 0 ? st[0][c] : st[1][c];
      *reinterpret_cast<uint16_t*>(p_tile + sm90::sw128_offset(row, key >> 3) + (key & 7) * 2) =
          uint16_t(pack2<T::act>(v, 0.0f) & 0xffffu);
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_sync(kBarBoth, 256);

    // O^T += V^T P^T for this warpgroup's four column panels: 16 keys are +2048 B in a panel.
    sm90::fence_operands(ot[0]);
    sm90::fence_operands(ot[1]);
    sm90::fence_operands(ot[2]);
    sm90::fence_operands(ot[3]);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dp = sm90::sw128_desc(p_base + kk * 32, 16, 1024);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const uint64_t dv =
            sm90::sw128_desc(k_base + (4 * cw + n) * lay.kv_panel + kk * 2048, lay.kv_panel, 1024);
        sm90::Wgmma<16, kBF16>::template ss<0, 1>(ot[n], dv, dp, 1);
      }
    }
    sm90::wgmma_commit();
    if constexpr (kFp8) {
      // The other stage was last read by tile j - 1's P V, which both warpgroups waited for
      // before this tile's exchange barrier.
      if (j + 1 < n_tiles) widen_tile<T>(smem, bars, j + 1, cw * 128 + ct, kBarBoth, 256);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(ot[0]);
    sm90::fence_operands(ot[1]);
    sm90::fence_operands(ot[2]);
    sm90::fence_operands(ot[3]);
    if constexpr (!kFp8) ptx::mbarrier_arrive(bars.empty(s));
  }

  // Row sums over the CTA (both warpgroups hold the same), then the rows out.
  over_warps(l, false);
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int row = row_of(rr);
    if (row >= w.num_rows) continue;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
    const float total = l[rr];
    const float lse2 = total > 0.0f ? m[rr] + log2f(total) : -INFINITY;
    const float factor = total > 0.0f ? p.v_scale / total : 0.0f;
    const int i = rr >> 1, c0 = rr & 1;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
      float* const dst = p.partial_o + at * kEntry;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int col = 256 * cw + 64 * n + 16 * warp + g;
        dst[col] = ot[n][i][c0] * factor;
        dst[col + 8] = ot[n][i][c0 + 2] * factor;
      }
      if (cw == 0 && warp == 0 && g == 0) p.partial_lse[at] = lse2;
      continue;
    }
    char* const out = static_cast<char*>(p.out) +
                      (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * 2;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int col = 256 * cw + 64 * n + 16 * warp + g;
      if (col < p.out_cols) store_from_float<T::act>(out, col, ot[n][i][c0] * factor);
      if (col + 8 < p.out_cols) store_from_float<T::act>(out, col + 8, ot[n][i][c0 + 2] * factor);
    }
    if (cw == 0 && warp == 0 && g == 0 && p.lse != nullptr) store_lse(p, head, t, lse2);
  }
}

}  // namespace pagedattn::cuda::mla
