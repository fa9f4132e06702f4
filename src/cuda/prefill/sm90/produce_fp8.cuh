// The Hopper prefill kernel's producer loops over fp8 caches: widened to f16 in the stage
// (produce_fp8), or kept e4m3 for fp8 products with V transposed (produce_fp8_math). See
// kernel.cuh's map.
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/attn_common/fp8.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/sm90/common.cuh"

namespace pagedattn::cuda::prefill {

// fp8 products: the producer's loop. K rows land raw (e4m3) in the K panel by cp.async, as the
// 16-bit kernel copies them. fp8 wgmma reads B only K-major, so V [keys][head dims] is staged
// raw (cp.async into a swizzled buffer, two of them alternating) and transposed by the
// producer into Vt [head dims][keys]: each thread turns a 4-key x 4-dim block of bytes
// (four 32-bit reads) into four 32-bit words with byte permutes. Within each 16 keys the
// transposed row holds keys in the order the consumers' P registers hold them (pack_p_e4m3):
// position 4 t + e <- key 2 t + (e & 1) + 8 (e >> 1), so P needs no shuffle. Lanes split as
// 8 (dims) x 4 (keys), and each rotates which of its four words it stores first, so the reads
// and the stores both hit 32 distinct banks.
template <class T, class FillTable>
__device__ __forceinline__ void produce_fp8_math(const AttnParams& p, unsigned char* smem,
                                                 Barriers<T::kStages> bars, int n_tiles, int it0,
                                                 const char* k_head, const char* v_head,
                                                 FillTable& fill_table) {
  constexpr int D = T::head_size, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kChunks = D / 16;  // 16-byte chunks of a row's codes
  constexpr int kLanes = kChunks <= 4 ? 4 : 8;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockN % 16 == 0 && kBlockN <= 128);
  constexpr Sm90Layout lay = T::layout();
  const int ct = int(threadIdx.x);
  const int col = ct % kLanes, r0 = ct / kLanes;
  // K's chunk and V's (narrower where v_head_size < head_size).
  const RowChunk chunks[2] = {row_chunk(p.head_size, col, 1), row_chunk(p.v_head_size, col, 1)};
  // Every chunk of the tile's rows into a 128-byte-swizzled [kBlockN][128] buffer.
  auto copy_rows = [&](uint32_t dst0, const char* head, const int64_t* table, int pick) {
    if (col >= kChunks) return;
    const RowChunk chunk = chunks[pick];
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int row = r0 + i * kRowsPerPass;
      sm80::cp_async_16(dst0 + sm90::sw128_offset(row, col),
                        head + table[2 * row + pick] + chunk.offset, chunk.bytes, 0);
    }
  };
  const int warp = ct >> 5, wl = ct & 7, t = (ct >> 3) & 3;
  const int rot = (wl >> 1) & 3;
  const uint32_t rot_sel = uint32_t(rot) | uint32_t((rot + 1) & 3) << 4 |
                           uint32_t((rot + 2) & 3) << 8 | uint32_t((rot + 3) & 3) << 12;
  constexpr int kDimGroups = D / 32;        // 8 words (32 dims) each
  constexpr int kKeyGroups = kBlockN / 16;  // 16 keys each: one 16-byte chunk of a Vt row
  // Where 4 divides into dim groups (d64, d128) a warp keeps its dims over the key groups,
  // so every address is a per-thread base plus a constant: ncu showed the producer issue-bound
  // (consumers waiting on V's `full` for 20% of their samples) with the addresses recomputed.
  constexpr bool kFixedDims = 4 % kDimGroups == 0;
  constexpr int kDg = kFixedDims ? 4 / kDimGroups : 1;  // key-group step of a warp
  const int dg0 = kFixedDims ? warp % kDimGroups : 0;
  const int kg0 = kFixedDims && kDimGroups < 4 ? warp / kDimGroups : 0;
  // Read offsets of keys kb + {0, 1, 8, 9} (kb = 16 kg + 2 t: a key's swizzle row is
  // (2 t + e) & 7 whatever kg) and store offsets of dims 4 w + (i + rot) & 3 at chunk 0 (the
  // key group's chunk is XORed in), both relative to key group 0.
  auto offsets = [&](int w, uint32_t(&rd)[4], uint32_t(&st)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      rd[e] = sm90::sw128_offset(2 * t + (e & 1) + 8 * (e >> 1), w >> 2) + (w & 3) * 4;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) st[i] = sm90::sw128_offset(4 * w + ((i + rot) & 3), 0) + 4 * t;
  };
  // One 4-key x 4-dim block of key group kg: byte i of each word <- dim (i + rot) & 3, then a
  // 4 x 4 byte transpose.
  auto one_block = [&](uint32_t raw, uint32_t vt, int kg, const uint32_t(&rd)[4],
                       const uint32_t(&st)[4]) {
    uint32_t r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      r[e] = sm80::prmt(sm80::lds32(raw + kg * 16 * 128 + rd[e]), 0, rot_sel);
    }
    const uint32_t lo01 = sm80::prmt(r[0], r[1], 0x5140), hi01 = sm80::prmt(r[0], r[1], 0x7362);
    const uint32_t lo23 = sm80::prmt(r[2], r[3], 0x5140), hi23 = sm80::prmt(r[2], r[3], 0x7362);
    const uint32_t out[4] = {sm80::prmt(lo01, lo23, 0x5410), sm80::prmt(lo01, lo23, 0x7632),
                             sm80::prmt(hi01, hi23, 0x5410), sm80::prmt(hi01, hi23, 0x7632)};
#pragma unroll
    for (int i = 0; i < 4; ++i) sm80::sts32(vt + (st[i] ^ uint32_t(kg << 4)), out[i]);
  };
  uint32_t rd0[4], st0[4];
  offsets(8 * dg0 + wl, rd0, st0);
  auto transpose_v = [&](const unsigned char* raw_p, unsigned char* vt_p) {
    const uint32_t raw = sm80::smem_addr(raw_p), vt = sm80::smem_addr(vt_p);
    if constexpr (kFixedDims) {
#pragma unroll
      for (int i = 0; i < kKeyGroups / kDg; ++i) one_block(raw, vt, kg0 + i * kDg, rd0, st0);
    } else {
#pragma unroll 2
      for (int j = warp; j < kDimGroups * kKeyGroups; j += 4) {
        const int kg = j / kDimGroups;
        uint32_t rd[4], st[4];
        offsets(8 * (j - kg * kDimGroups) + wl, rd, st);
        one_block(raw, vt, kg, rd, st);
      }
    }
  };
  const uint32_t raw0 = sm80::smem_addr(smem + lay.raw_offset);
  auto copy_k = [&](int j, const int64_t* table) {
    const int s = (it0 + j) % kStages;
    mbar_wait(bars.k_empty(s), (((it0 + j) / kStages) & 1) ^ 1);  // tile j - kStages released
    copy_rows(sm80::smem_addr(smem + lay.stage_offset + s * lay.stage_bytes), k_head, table, 0);
    ptx::cp_async_mbarrier_arrive_noinc(bars.k_full(s));
  };
  auto stage_v = [&](int j, const int64_t* table) {
    copy_rows(raw0 + ((it0 + j) & 1) * kBlockN * 128, v_head, table, 1);
  };
  if (n_tiles > 0) {
    const int64_t* const table = fill_table(0);
    copy_k(0, table);
    stage_v(0, table);
  }
  sm80::cp_async_commit();
  for (int j = 0; j < n_tiles; ++j) {
    // K and the staged V of tile j + 1 go out before tile j's V is transposed. The staging
    // buffer stage_v overwrites was read two tiles ago: fill_table's barrier orders the two.
    if (j + 1 < n_tiles) {
      const int64_t* const table = fill_table(j + 1);
      copy_k(j + 1, table);
      stage_v(j + 1, table);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();          // this thread's V_j rows landed
    sm90::named_barrier_sync(1, 128);  // ... and every producer thread's
    const int s = (it0 + j) % kStages;
    mbar_wait(bars.v_empty(s), (((it0 + j) / kStages) & 1) ^ 1);
    transpose_v(smem + lay.raw_offset + ((it0 + j) & 1) * kBlockN * 128,
                smem + lay.stage_offset + s * lay.stage_bytes + lay.kv_panel);
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
    ptx::mbarrier_arrive(bars.v_full(s));
  }
  sm80::cp_async_wait<0>();  // nothing in flight when the warpgroup exits
}

// Four e4m3 codes (byte i = code i) to f16 pairs {0, 1} and {2, 3}. The 16-bit halves through
// a mov let ptxas read the upper one as an operand (F2FP.F16.E4M3.UNPACK_B R, R.H1); with a
// shift (attn::fp8x2_f16<.., 1>) each pair cost a SHF more [SASS].
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

template <bool kE5m2>
__device__ __forceinline__ void widen_chunk_f16(const uint4& codes, uint32_t (&out)[8]) {
  const uint32_t wds[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kE5m2) {
      out[2 * k] = sm80::prmt(wds[k], 0u, 0x1404);
      out[2 * k + 1] = sm80::prmt(wds[k], 0u, 0x3424);
    } else {
      e4m3x4_f16(wds[k], out[2 * k], out[2 * k + 1]);
    }
  }
}

// fp8 caches: the producer's loop. Each thread copies its own 16-byte chunks of codes (16
// head dims of one key row) into the staging buffer with cp.async, waits for them, and widens them
// exactly to f16 (T::mma; k_scale and v_scale stay in the softmax scale and the output factor)
// into two 16-byte chunks of the swizzled panels; no other thread reads what it staged, so no
// barrier is needed between copy and widening. The next tile's K is copied while this tile's
// V is widened, and its V while the next K is, so a copy's latency is hidden behind one
// widening. e4m3: cvt.rn.f16x2.e4m3x2, two codes per instruction (the bit trick to bf16,
// attn::Fp8Widen, took ~11 instructions per four codes and set this kernel's pace: fp8 KV at
// 0.57 of the bf16 rate); e5m2: the code is the f16's top byte.
template <class T, class FillTable>
__device__ __forceinline__ void produce_fp8(const AttnParams& p, unsigned char* smem,
                                            Barriers<T::kStages> bars, int n_tiles, int it0,
                                            const char* k_head, const char* v_head,
                                            FillTable& fill_table) {
  static_assert(T::mma == DType::kF16);
  constexpr int D = T::head_size, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kRaw = D / 16;  // 16-byte chunks of codes per row
  constexpr int kLanes = kRaw <= 4 ? 4 : kRaw <= 8 ? 8 : 16;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kRaw <= kLanes && kBlockN % kRowsPerPass == 0);
  constexpr Sm90Layout lay = T::layout();
  const int ct = int(threadIdx.x);
  const int col = ct % kLanes, r0 = ct / kLanes;
  const bool copies = col < kRaw;
  const RowChunk chunks[2] = {row_chunk(p.head_size, col, 1), row_chunk(p.v_head_size, col, 1)};
  // Widened, the chunk is 16-bit chunks 2 col and 2 col + 1 of the row: one panel.
  const int c16 = 2 * col;
  const uint32_t panel_at = (c16 >> 3) * lay.kv_panel;
  const uint32_t raw0 = sm80::smem_addr(smem + lay.raw_offset) + col * 16;
  const bool e5m2 = p.kv_dtype == int(DType::kFp8E5M2);
  auto stage_codes = [&](int which, const char* head, const int64_t* table) {
    if (!copies) return;
    const uint32_t dst0 = raw0 + which * kBlockN * D + r0 * D;
    // The row offsets through the shared window (a generic load each cost an address
    // conversion and a longer latency [ncu]).
    const uint32_t tab = sm80::smem_addr(table) + (2 * r0 + which) * 8;
    const RowChunk chunk = chunks[which];  // which: 0 K, 1 V
    const char* const src = head + chunk.offset;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int64_t off = int64_t(sm80::lds64(tab + i * kRowsPerPass * 16));
      sm80::cp_async_16(dst0 + i * kRowsPerPass * D, src + off, chunk.bytes, 0);
    }
  };
  // Rows r0 + i kRowsPerPass (kRowsPerPass a multiple of 8) share their swizzle: fixed
  // per-thread shared addresses plus immediates (with generic pointers and the swizzle per row
  // the loop spent 20 of its 28 instructions per chunk on addresses [SASS]).
  static_assert(kRowsPerPass % 8 == 0);
  const uint32_t raw_at = raw0 + r0 * D;
  const uint32_t dst_lo = panel_at + r0 * 128 + (((c16 & 7) ^ (r0 & 7)) << 4);
  const uint32_t dst_hi = panel_at + r0 * 128 + ((((c16 + 1) & 7) ^ (r0 & 7)) << 4);
  // Chunks i + 1 .. i + kAhead are loaded before chunk i is widened and stored: ptxas keeps
  // shared loads and stores it cannot tell apart in order, and one chunk at a time left every
  // widening waiting for its load ([ncu, d128 16k] 41% of the producer's samples on the F2FP,
  // short scoreboard). Two ahead since the producer has 56 registers (fp8 e4m3 d128 causal
  // 4k-16k +0.5-1.5% over one).
  constexpr int kAhead = 2;
  auto widen_rows = [&](uint32_t raw, uint32_t panels, auto kE5m2) {
    constexpr int kPasses = kBlockN / kRowsPerPass;
    uint4 ring[kAhead + 1];
#pragma unroll
    for (int a = 0; a < kAhead && a < kPasses; ++a) {
      ring[a] = sm80::lds128(raw + a * kRowsPerPass * D);
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      if (i + kAhead < kPasses) {
        ring[(i + kAhead) % (kAhead + 1)] = sm80::lds128(raw + (i + kAhead) * kRowsPerPass * D);
      }
      const uint4 codes = ring[i % (kAhead + 1)];
      uint32_t out[8];
      widen_chunk_f16<decltype(kE5m2)::value>(codes, out);
      sm80::sts128(panels + dst_lo + i * kRowsPerPass * 128,
                   make_uint4(out[0], out[1], out[2], out[3]));
      sm80::sts128(panels + dst_hi + i * kRowsPerPass * 128,
                   make_uint4(out[4], out[5], out[6], out[7]));
    }
  };
  auto widen_codes = [&](int which, unsigned char* panels) {
    if (copies) {
      const uint32_t raw = raw_at + which * kBlockN * D, dst = sm80::smem_addr(panels);
      if (e5m2) {
        widen_rows(raw, dst, std::true_type{});
      } else {
        widen_rows(raw, dst, std::false_type{});
      }
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
  };
  if (n_tiles > 0) {
    const int64_t* const table = fill_table(0);
    stage_codes(0, k_head, table);
    sm80::cp_async_commit();
    stage_codes(1, v_head, table);
    sm80::cp_async_commit();
  }
  for (int j = 0; j < n_tiles; ++j) {
    const int s = (it0 + j) % kStages;
    const uint32_t free_parity = (((it0 + j) / kStages) & 1) ^ 1;  // tile j - kStages released
    unsigned char* const sk = smem + lay.stage_offset + s * lay.stage_bytes;
    sm80::cp_async_wait<1>();  // K_j staged (V_j may still be in flight)
    mbar_wait(bars.k_empty(s), free_parity);
    widen_codes(0, sk);
    ptx::mbarrier_arrive(bars.k_full(s));
    const int64_t* const next = j + 1 < n_tiles ? fill_table(j + 1) : nullptr;
    if (next != nullptr) stage_codes(0, k_head, next);
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();  // V_j staged
    mbar_wait(bars.v_empty(s), free_parity);
    widen_codes(1, sk + T::kPanels * lay.kv_panel);
    ptx::mbarrier_arrive(bars.v_full(s));
    if (next != nullptr) stage_codes(1, v_head, next);
    sm80::cp_async_commit();
  }
}

}  // namespace pagedattn::cuda::prefill
