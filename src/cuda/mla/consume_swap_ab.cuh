// The MLA decode kernel's swap-AB consumers (Consumer::kSwapAB, kSwapAB32): CTAs of 16 or 32
// packed rows, the products transposed so that the rows are wgmma's N side. See kernel.cuh's map.
//
// Why: with 16 heads x 1 token a 64-row M tile is three quarters zero rows, and split-S's
// products read Q's 64 rows (2 KB per k step) and P's from shared memory for every tile: ~328 KB
// of shared-memory reads per 64-key tile and four times the tensor work. Here, with 16 rows,
//   S^T [64 keys][16 rows] = K [64 keys][576] . Q^T  (m64n16k16 SS, K-major both: the stage
//       and Q's 16-row panels as they are), its 36 k steps split between the warpgroups (18 each)
//       and the partial sums exchanged through shared memory;
//   O^T [512 cols][16 rows] += V^T [512][64 keys] . P^T  (m64n16k16 SS, V^T the stage's panels
//       read MN-major, P^T one 16-row panel), warpgroup c the columns 256 c .. 256 c + 255;
// ~170 KB of shared-memory reads per tile. Both warpgroups run the same softmax on the summed
// S^T (8 scores per thread); each writes half of P^T's rows.
// With 32 rows (16 heads x 2 tokens, 32 heads x 1; split-S pads them to 64) over a 16-bit cache,
// warpgroup c computes S^T for rows 16 c .. 16 c + 15 over all 36 k steps (the same m64n16k16)
// and runs its own softmax: no partial sums to exchange, only each row's rescale goes to the
// other warpgroup, whose O^T (m64n32k16) holds all 32 rows. P^T has two buffers, so a warpgroup
// writes tile j's while the other may still read tile j - 1's.
// Over fp8 (Traits::kFragsFromRaw) no tile is widened into shared memory: each thread loads its
// A fragments' bytes from the raw tile and converts them to f16 in registers (wgmma RS;
// frags_fp8.cuh), so the ring is five raw slots with 16 rows (+7-15% over two widened stages
// and one raw slot) and four with 32. With 32 rows S^T's k steps are then split too (m64n32k16,
// 18 a warpgroup: its fragments are half of the tile's K, not all of it), each thread sends the 8
// partial sums of the other warpgroup's rows, and each warpgroup runs the softmax of its own 16
// rows as above.
#pragma once

#include <cstdint>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/cluster_merge.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/frags_fp8.cuh"
#include "cuda/mla/softmax.cuh"
#include "cuda/mla/store.cuh"

namespace pagedattn::cuda::mla {

template <class T>
__device__ __forceinline__ void consume_swap_ab(const MlaParams& p, const Work& w,
                                                unsigned char* smem,
                                                Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  constexpr int kRows = T::kBlockM;      // the CTA's packed rows: wgmma's N in O^T
  constexpr bool kRows32 = kRows == 32;  // each warpgroup's softmax holds 16 of them
  static_assert((kRows == 16 || kRows == 32) && T::kOutCols == kLatent);
  // S^T's k steps split between the warpgroups (partial sums exchanged), else its rows.
  constexpr bool kSplitK = swap_split_k_for(T::kv, T::consumer);
  constexpr int kSN = kSplitK ? kRows : 16;  // S^T's wgmma N
  constexpr int kStages = T::kStages;
  constexpr bool kRegA = T::kFragsFromRaw;  // A fragments from the raw tile (frags_fp8.cuh)
  static_assert(kRegA == (T::kv == KVKind::kFp8), "fp8 swap AB builds its fragments from raw");
  // The products' type: f16 from the raw tile (e4m3 widens to f16 in one instruction, to bf16
  // in four; frags_fp8.cuh q_to_f16), else the activations'.
  constexpr DType kMath = kRegA ? DType::kF16 : T::act;
  constexpr bool kMathBF16 = kMath == DType::kBF16;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  constexpr SwapXchg kX = swap_xchg_for(T::kv, T::consumer);
  constexpr int kBarBoth = 2;    // named barrier of the 256 consumer threads (1: producer)
  constexpr int kI = kRows / 8;  // accumulator row groups of O^T (m64n16: 2, m64n32: 4)
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  // S^T's k steps or rows; O^T's columns 256 cw ... Through lane 0 so that ptxas knows it is
  // warp-uniform and keeps the descriptors it selects in uniform registers (fp8: 16 rows
  // +3-7%, 32 rows +6-12%).
  const int cw = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128 - 1, 0);
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int bar_own = 3 + cw;  // named barrier of this warpgroup
  // The first of the CTA's rows this warpgroup's softmax holds (16 rows from there).
  const int row_s0 = kRows32 ? 16 * cw : 0;

  // This thread's scores st[i][c] (the softmax's; an m64n16 accumulator's layout): key 16 warp
  // + g + 8 (c >> 1), row row_s0 + 8 i + 2 t4 + (c & 1); its four rows are indexed rr = 2 i +
  // (c & 1). S^T's accumulator sacc[i][c] is the same with N = kSN (32: rows 8 i + ..). O^T's
  // ot[n][i][c]: column 256 cw + 64 n + 16 warp + g + 8 (c >> 1), row 8 i + 2 t4 + (c & 1)
  // (i < kI; with 32 rows, i >> 1 is the warpgroup whose softmax holds the row).
  auto row_of = [&](int rr) { return 8 * (rr >> 1) + 2 * t4 + (rr & 1); };
  int hi[4];  // keys row rr may see: [kv_begin, hi[rr]); rows past the request see the split
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) hi[rr] = row_key_end(p, w, row_s0 + row_of(rr));
  const int mask_from = row_key_end(p, w, 0);  // the first row sees the fewest keys

  float ot[4][kI][4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int i = 0; i < kI; ++i) ot[n][i][0] = ot[n][i][1] = ot[n][i][2] = ot[n][i][3] = 0.0f;
  }
  // m: running row maxima (log2 units) of the softmax's rows (with 16 rows the same in both
  // warpgroups); l: this thread's share of their row sums (its two keys of every tile), added
  // over the warpgroup (16 rows: the CTA) at the end.
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  // config.h swap_xchg_for: xs [2][128][2] float4 partial S^T (kSplitK), red [2][4 warps][16],
  // (32 rows) cx [2 tiles][2][16] rescales and ls [2][16] row sums.
  float4* const xs = reinterpret_cast<float4*>(smem + lay.xchg_offset);
  float* const red = reinterpret_cast<float*>(smem + lay.xchg_offset + kX.red);
  float* const cx = reinterpret_cast<float*>(smem + lay.xchg_offset + kX.cx);
  float* const ls = reinterpret_cast<float*>(smem + lay.xchg_offset + kX.ls);
  const uint32_t p_base = sm80::smem_addr(smem + lay.p_offset);  // P^T [kRows rows][64 keys]
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
  // 32 rows: the value v[rr] of this warpgroup's rows for O^T's row group i (8 i + 2 t4 + c0),
  // or the other's from `other` (the same thread layout, read through shared memory).
  auto pick = [&](const float(&v)[4], const float(&other)[4], int i, int c0) {
    const int rr = 2 * (i & 1) + c0;
    return (i >> 1) == cw ? v[rr] : other[rr];
  };

  static_assert(kRegA || kStages == 2, "16-bit: tile j + 1 lands while tile j is read");
  // kRegA: tile j's S^T fragments are built under tile j - 1's O^T, issued at the top of
  // iteration j (every wgmma group is issued and waited for inside one iteration: ptxas
  // serialises every wgmma of the kernel when a group stays in flight across the loop's back
  // edge), and its O^T fragments under its S^T. With 32 rows S^T goes out in two halves of 9
  // k steps, the second half's fragments built under the first's wgmmas: O^T's 64
  // accumulators leave no room for all 72 K-fragment registers beside V^T's 64.
  constexpr int kKParts = kRows32 ? 2 : 1;
  constexpr int kKSteps = 18 / kKParts;
  [[maybe_unused]] uint32_t ka[kKParts][kKSteps][4];
  [[maybe_unused]] uint32_t va[4][4][4];
  const unsigned char* const raw0 = smem + lay.raw_offset;
  [[maybe_unused]] auto wait_raw = [&](int j) {
    const int slot = j % T::kRing;
    mbar_wait(bars.full(slot), uint32_t((j / T::kRing) & 1));
    return raw0 + slot * lay.raw_bytes;
  };
  // This warpgroup's S^T fragments of part `part` from the raw tile.
  [[maybe_unused]] auto build_k = [&]<int kPart>(const unsigned char* tile,
                                                 std::integral_constant<int, kPart>) {
    if (cw == 0) {
      k_fragments<kMath, 0, kPart * kKSteps, kKSteps>(tile, warp, g, t4, ka[kPart]);
    } else {
      k_fragments<kMath, 2, kPart * kKSteps, kKSteps>(tile, warp, g, t4, ka[kPart]);
    }
  };
  float sacc[kSN / 8][4];
  // Issues part `part` of S^T from its fragments: this warpgroup's k steps 18 cw + 9 part ..
  [[maybe_unused]] auto issue_s_raw = [&]<int kPart>(std::integral_constant<int, kPart>) {
    sm90::fence_operands(ka[kPart]);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
    // Q's k step ks: +32 B inside a panel, +q_panel across (a select of two constants per step).
    constexpr int kQPanel = lay.q_panel;
    constexpr auto q_off = [](int ks) { return uint32_t((ks >> 2) * kQPanel + (ks & 3) * 32); };
    const uint64_t dq = sm90::sw128_desc(q_base, 16, 1024);
#pragma unroll
    for (int kq = 0; kq < kKSteps; ++kq) {
      const int ks = kPart * kKSteps + kq;
      const uint64_t db = sm90::desc_advance(dq, cw ? q_off(18 + ks) : q_off(ks));
      sm90::Wgmma<kSN, kMathBF16>::template rs<0>(sacc, ka[kPart][kq], db, ks > 0);
    }
    sm90::wgmma_commit();
  };
  using Part0 = std::integral_constant<int, 0>;
  using Part1 = std::integral_constant<int, kKParts - 1>;
  mbar_wait(bars.q_full(), 0);
  // The logit scale of the thread's four S^T rows (Q's rows scaled into f16: divided back here).
  float fr[4] = {p.scale_log2, p.scale_log2, p.scale_log2, p.scale_log2};
  if constexpr (kRegA && kMath != T::act) {
    float* const row_scale = reinterpret_cast<float*>(smem + lay.xchg_offset + kX.row_scale);
    q_to_f16<kRows>(smem + lay.q_offset, cw * 128 + ct, row_scale, kBarBoth);
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) fr[rr] *= row_scale[row_s0 + row_of(rr)];
  }
  auto fence_ot = [&] {
#pragma unroll
    for (int n = 0; n < 4; ++n) sm90::fence_operands(ot[n]);
  };
  // O^T += V^T P^T for this warpgroup's four column panels (P^T at pj; 16 keys are +32 B): V^T
  // from the fragments (kRegA: tile j's is issued at the top of iteration j + 1, or after the
  // loop) or the stage at k_base (16 keys are +2048 B in a panel).
  auto issue_o = [&](uint32_t pj, [[maybe_unused]] uint32_t k_base) {
    fence_ot();
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dp = sm90::sw128_desc(pj + kk * 32, 16, 1024);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        if constexpr (kRegA) {
          sm90::Wgmma<kRows, kMathBF16>::template rs<0>(ot[n], va[kk][n], dp, 1);
        } else {
          const uint64_t dv = sm90::sw128_desc(k_base + (4 * cw + n) * lay.kv_panel + kk * 2048,
                                               lay.kv_panel, 1024);
          sm90::Wgmma<kRows, kBF16>::template ss<0, 1>(ot[n], dv, dp, 1);
        }
      }
    }
    sm90::wgmma_commit();
  };
  for (int j = 0; j < n_tiles; ++j) {
    const int s = kRegA ? 0 : j % kStages;
    if constexpr (!kRegA) {
      mbar_wait(bars.full(s), uint32_t((j / kStages) & 1));
      ptx::fence_proxy_async(ptx::space_shared);
    }
    const uint32_t k_base = stage0 + s * lay.stage_bytes;
    // 32 rows over a 16-bit cache: P^T of tile j in buffer j & 1 (the other warpgroup may still
    // read tile j - 1's). From the raw tile both are past tile j - 1's O^T at the partial-sum
    // exchange, before either writes tile j's: one buffer.
    const int p_buf = kRows32 && !kRegA ? (j & 1) : 0;
    const uint32_t pj = p_base + p_buf * kRows * 128;

    if constexpr (kRegA) {
      // Tile j - 1's O^T (its P^T written last iteration) and tile j's S^T go out together.
      // After the first wait<1> that O^T is done: its fragment registers take this tile's V^T
      // once S^T's fragments are all built, and then the slot's raw bytes are all read.
      if (j > 0) issue_o(p_base, 0);
      const unsigned char* const tile = wait_raw(j);
      build_k(tile, Part0{});
      issue_s_raw(Part0{});
      sm90::wgmma_wait<1>();
      if constexpr (kKParts == 2) {
        build_k(tile, Part1{});
        issue_s_raw(Part1{});
        sm90::wgmma_wait<1>();  // the first half: its fragments' registers are free
      }
      v_fragments<kMath>(tile, cw, warp, g, t4, va);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) sm90::fence_operands(va[kk]);
      ptx::mbarrier_arrive(bars.empty(j % T::kRing));
    } else {
      // S^T: 16 columns are +32 B inside a 64-column panel; 16 rows +2048 B inside a Q panel.
      sm90::fence_operands(sacc);
      sm90::wgmma_fence();
      constexpr int kSteps = kSplitK ? kEntry / 32 : kEntry / 16;
#pragma unroll
      for (int kq = 0; kq < kSteps; ++kq) {
        const int ks = kSplitK ? cw * (kEntry / 32) + kq : kq;
        const uint32_t at = (ks >> 2) * lay.kv_panel + (ks & 3) * 32;
        const uint64_t da = sm90::sw128_desc(k_base + at, 16, 1024);
        const uint64_t db = sm90::sw128_desc(
            q_base + (ks >> 2) * lay.q_panel + row_s0 * 128 + (ks & 3) * 32, 16, 1024);
        sm90::Wgmma<kSN, kBF16>::template ss<0>(sacc, da, db, kq > 0);
      }
      sm90::wgmma_commit();
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(sacc);
    if constexpr (kRegA) fence_ot();  // O^T of tile j - 1 too
    float st[2][4];
    if constexpr (kSplitK) {
      // The other warpgroup's partial sums. 16 rows: thread ct of both holds the same (key, row)
      // pairs, each sends all 8. 32 rows: thread ct of both holds the same keys of all 32 rows
      // and sends the 8 sums of the other's 16 (sacc[2 (1 - cw) + i]). Both warpgroups are past
      // tile j - 1's O^T here, which read P^T.
      float send[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if constexpr (kRows32) {
            send[i][c] = cw == 0 ? sacc[2 + i][c] : sacc[i][c];
            st[i][c] = cw == 0 ? sacc[i][c] : sacc[2 + i][c];
          } else {
            send[i][c] = st[i][c] = sacc[i][c];
          }
        }
      }
      xs[(cw * 128 + ct) * 2] = make_float4(send[0][0], send[0][1], send[0][2], send[0][3]);
      xs[(cw * 128 + ct) * 2 + 1] = make_float4(send[1][0], send[1][1], send[1][2], send[1][3]);
      sm90::named_barrier_sync(kBarBoth, 256);
      const float4 a = xs[((1 - cw) * 128 + ct) * 2], b = xs[((1 - cw) * 128 + ct) * 2 + 1];
      // 16 rows: a + b in both warpgroups is b + a in the other: the same bits, the same softmax.
      st[0][0] += a.x, st[0][1] += a.y, st[0][2] += a.z, st[0][3] += a.w;
      st[1][0] += b.x, st[1][1] += b.y, st[1][2] += b.z, st[1][3] += b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) st[i][c] = sacc[i][c];
      }
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
    float mx[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) mx[rr] = fmaxf(st[rr >> 1][rr & 1], st[rr >> 1][2 + (rr & 1)]);
    over_warps(mx, true);
    float corr[4], base[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      const float m_new = fmaxf(m[rr], mx[rr] * fr[rr]);
      base[rr] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
      corr[rr] = sm80::exp2_approx(m[rr] - base[rr]);
      m[rr] = m_new;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int rr = 2 * i + (c & 1);
        st[i][c] = sm80::exp2_approx(fmaf(st[i][c], fr[rr], -base[rr]));
      }
    }
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      l[rr] = l[rr] * corr[rr] + st[rr >> 1][rr & 1] + st[rr >> 1][2 + (rr & 1)];
    }
    if constexpr (!kRows32) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int i = 0; i < kI; ++i) {
#pragma unroll
          for (int c = 0; c < 4; ++c) ot[n][i][c] *= corr[2 * i + (c & 1)];
        }
      }
    }
    // P^T: 16 rows, warpgroup cw writes rows 8 cw .. 8 cw + 7 (i = cw) of the same softmax; 32
    // rows, its own 16. Row r's 64 keys are its 128 swizzled bytes.
    unsigned char* const p_tile = smem + lay.p_offset + p_buf * kRows * 128;
#pragma unroll
    for (int i = 0; i < (kRows32 ? 2 : 1); ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int ri = kRows32 ? i : cw;  // 16 rows: i = cw, without indexing st by it
        const int row = row_s0 + 8 * ri + 2 * t4 + (c & 1);
        const int tile_key = 16 * warp + g + 8 * (c >> 1);
        const int key = kRegA ? p_column(tile_key) : tile_key;  // the position O^T's k reads
        const float v = kRows32 ? st[i][c] : cw == 0 ? st[0][c] : st[1][c];
        *reinterpret_cast<uint16_t*>(p_tile + sm90::sw128_offset(row, key >> 3) + (key & 7) * 2) =
            uint16_t(pack2<kMath>(v, 0.0f) & 0xffffu);
      }
    }
    if constexpr (kRows32) {
      // The rescales of this warpgroup's rows for the other's O^T (buffer j & 1: the other read
      // tile j - 2's before the barrier of tile j - 1, which this warpgroup has passed).
      if (warp == 0 && g == 0) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) cx[((j & 1) * 2 + cw) * 16 + row_of(rr)] = corr[rr];
      }
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_sync(kBarBoth, 256);
    if constexpr (kRows32) {
      float other[4];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) other[rr] = cx[((j & 1) * 2 + 1 - cw) * 16 + row_of(rr)];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int i = 0; i < kI; ++i) {
#pragma unroll
          for (int c = 0; c < 4; ++c) ot[n][i][c] *= pick(corr, other, i, c & 1);
        }
      }
    }

    if constexpr (kRegA) continue;  // O^T at the next iteration's top
    issue_o(pj, k_base);
    sm90::wgmma_wait<0>();
    fence_ot();
    ptx::mbarrier_arrive(bars.empty(s));
  }

  if constexpr (kRegA) {  // the last tile's O^T
    if (n_tiles > 0) issue_o(p_base, 0);
    sm90::wgmma_wait<0>();
    fence_ot();
  }
  // Row sums over the warpgroup (16 rows: both hold the same), then the rows out.
  over_warps(l, false);
  // 32 rows: the other warpgroup's row sums (its maxima only its own LSE writers need).
  float l_o[4] = {l[0], l[1], l[2], l[3]};
  if constexpr (kRows32) {
    if (warp == 0 && g == 0) {
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) ls[cw * 16 + row_of(rr)] = l[rr];
    }
    sm90::named_barrier_sync(kBarBoth, 256);
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) l_o[rr] = ls[(1 - cw) * 16 + row_of(rr)];
  }
  // split_cluster > 1: the splits merge through the cluster's shared memory (cluster_merge.cuh).
  const ClusterMerge<kRows> cm(p, smem + lay.stage_offset);
  // The latent column of accumulator ot[n][.][c] with h8 = c >> 1 (frags_fp8.cuh's order for
  // kRegA).
  auto col_of = [&](int n, int h8) {
    return kRegA ? o_column(cw, n, warp, g, h8) : 256 * cw + 64 * n + 16 * warp + g + 8 * h8;
  };
  if (p.split_cluster > 1) cm.arrive_done();
#pragma unroll
  for (int i = 0; i < kI; ++i) {
#pragma unroll
    for (int c0 = 0; c0 < 2; ++c0) {
      const int row = 8 * i + 2 * t4 + c0;
      if (row >= w.num_rows) continue;
      const int pr = w.row0 + row;
      const int t = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
      const float total = kRows32 ? pick(l, l_o, i, c0) : l[2 * i + c0];
      // The row's maximum where this warpgroup's softmax holds it (all its LSE writer needs).
      const RowEnd end = row_end(m[2 * (i & 1) + c0], total, p.v_scale);
      const float lse2 = end.lse2, factor = end.factor;
      // One thread per row writes its LSE: warp 0's quad lane of the warpgroup whose softmax
      // holds the row (16 rows: warpgroup 0).
      const bool lse_writer = warp == 0 && g == 0 && (kRows32 ? (i >> 1) == cw : cw == 0);
      if (p.split_cluster > 1) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          cm.send(row, col_of(n, 0), ot[n][i][c0] * factor);
          cm.send(row, col_of(n, 1), ot[n][i][c0 + 2] * factor);
        }
        if (lse_writer) cm.send_lse(row, lse2);
        continue;
      }
      if (p.num_splits > 1) {
        const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
        float* const dst = p.partial_o + at * kEntry;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          dst[col_of(n, 0)] = ot[n][i][c0] * factor;
          dst[col_of(n, 1)] = ot[n][i][c0 + 2] * factor;
        }
        if (lse_writer) p.partial_lse[at] = lse2;
        continue;
      }
      char* const out = static_cast<char*>(p.out) +
                        (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * 2;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int h8 = 0; h8 < 2; ++h8) {
          const int col = col_of(n, h8);
          if (col < p.out_cols) store_from_float<T::act>(out, col, ot[n][i][c0 + 2 * h8] * factor);
        }
      }
      if (lse_writer && p.lse != nullptr) store_lse(p, head, t, lse2);
    }
  }
  if (p.split_cluster > 1) cm.template merge_store<T::act>(p, w, cw * 128 + ct);
}

}  // namespace pagedattn::cuda::mla
