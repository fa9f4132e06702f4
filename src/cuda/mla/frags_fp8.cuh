// fp8 swap AB (Traits::kFragsFromRaw): the wgmma A fragments of S^T = K Q^T and O^T = V^T P^T
// built in registers from the raw fp8 tile, so no tile is widened into shared memory.
//
// Why: the widened tile cost 72 KB of shared memory per stage, which left room for one 36 KB raw
// tile in flight beside Q and two 16-bit stages (the 16-row fp8 chain ran at 0.57-0.72 of
// the copy rate, ~4500 cycles a tile), plus 72 KB of stores and ~170 KB of wgmma reads a tile.
// Here the ring is five raw slots and each thread reads 272 bytes of a tile; the products run in
// f16 (q_to_f16 below).
//
// The fragments reorder what the sums run over, never what they add up:
//   S^T's k (the 576 entry columns): inside each 64-column group, logical column
//     16 ks + 8 h + 2 t + e (k step ks, fragment half h, quad lane t, element e) is entry column
//     16 t + 4 ks + 2 h + e, so lane t's 16 columns of a group are one 16-byte chunk of the key's
//     row. Q's shared copy is stored in the same order (produce.cuh, config.h q_column).
//   O^T's k (the tile's 64 keys): logical key 16 kk + 8 h + 2 t + e is key 16 kk + 4 (2 h + e) + t,
//     so the four lanes of a quad read four consecutive keys; P^T is written in that order
//     (p_column).
//   O^T's m (the 512 latent columns): warpgroup c's logical row 64 n + 16 w + g + 8 h8 of its 256
//     is column 256 c + 64 w + 8 g + 2 n + h8 (o_column), so a thread's eight columns of every
//     packed row are adjacent: one 8-byte load per key.
// Raw rows are 576 bytes with chunk q of key r at q ^ raw_chunk_swizzle(r): the K loads (8 lanes:
// two keys x four chunks) and the V loads (16 lanes: four keys x two chunks x two halves) each
// touch 32 distinct banks.
#pragma once

#include <cstdint>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/config.h"

namespace pagedattn::cuda::mla {

/// The two e4m3 values in half kHalf of `bits` (low byte first) as the 16-bit math type's pair.
/// f16 reads the half in place (the conversion's operand selects it: no shift).
template <DType kMath, int kHalf>
__device__ __forceinline__ uint32_t cvt2(uint32_t bits) {
  if constexpr (kMath == DType::kF16) {
    uint32_t d;
    if constexpr (kHalf == 0) {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
          : "=r"(d)
          : "r"(bits));
    } else {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
          : "=r"(d)
          : "r"(bits));
    }
    return d;
  } else {
    return fp8x2_to_16bit<kMath>(uint16_t(kHalf ? bits >> 16 : bits & 0xffffu), false);
  }
}

/// S^T's A fragments for kCount of this warpgroup's 18 k steps from its step kFirst (m64nNk16:
/// a[kq] = keys 16 warp + g and +8, steps 18 cw + kFirst + kq). kOff = 2 cw: warpgroup 1's first
/// step is word 2 of group 4. Each key's groups holding the steps are 16-byte loads (all 18 steps:
/// groups 4 cw .. 4 cw + 4, half of the shared group unused).
template <DType kMath, int kOff, int kFirst, int kCount>
__device__ __forceinline__ void k_fragments(const unsigned char* tile, int warp, int g, int t4,
                                            uint32_t (&a)[kCount][4]) {
  constexpr int kG0 = 2 * kOff;  // 0 or 4
  constexpr int kI0 = (kFirst + kOff) >> 2, kLoads = ((kFirst + kCount - 1 + kOff) >> 2) - kI0 + 1;
  const int r0 = 16 * warp + g;
  const int chunk = t4 ^ raw_chunk_swizzle(r0);  // r0 + 8 has the same bit 1
  uint4 k0[kLoads], k1[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int at = 64 * (kG0 + kI0 + i) + 16 * chunk;
    k0[i] = *reinterpret_cast<const uint4*>(tile + r0 * kEntry + at);
    k1[i] = *reinterpret_cast<const uint4*>(tile + (r0 + 8) * kEntry + at);
  }
#pragma unroll
  for (int kq = 0; kq < kCount; ++kq) {
    const int idx = kFirst + kq + kOff, i = (idx >> 2) - kI0, wd = idx & 3;
    const uint32_t x0 = wd == 0 ? k0[i].x : wd == 1 ? k0[i].y : wd == 2 ? k0[i].z : k0[i].w;
    const uint32_t x1 = wd == 0 ? k1[i].x : wd == 1 ? k1[i].y : wd == 2 ? k1[i].z : k1[i].w;
    a[kq][0] = cvt2<kMath, 0>(x0);  // key r0, logical k 2 t4 + {0, 1}
    a[kq][1] = cvt2<kMath, 0>(x1);  // key r0 + 8
    a[kq][2] = cvt2<kMath, 1>(x0);  // key r0, logical k 2 t4 + 8 + {0, 1}
    a[kq][3] = cvt2<kMath, 1>(x1);
  }
}

/// O^T's A fragments (V^T, m64n16k16) of warpgroup cw for the tile's 4 k steps and its 4 m tiles:
/// a[kk][n] = columns o_column(cw, n, warp, g, 0 / 1), keys 16 kk + 4 j + t4 (j = 0..3). Each key's
/// eight columns are one 8-byte load; byte pairs of two keys are interleaved by prmt.
template <DType kMath>
__device__ __forceinline__ void v_fragments(const unsigned char* tile, int cw, int warp, int g,
                                            int t4, uint32_t (&a)[4][4][4]) {
  // Key 16 kk + 4 j + t4 has bit 1 of t4: the swizzle is the thread's for every key.
  const int chunk = (16 * cw + 4 * warp + (g >> 1)) ^ raw_chunk_swizzle(t4);
  const unsigned char* const base = tile + t4 * kEntry + 16 * chunk + 8 * (g & 1);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint2 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = *reinterpret_cast<const uint2*>(base + (16 * kk + 4 * j) * kEntry);
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      // Columns 2 n, 2 n + 1 of the eight: bytes (2 n) & 3 and + 1 of word n / 2.
      const uint32_t sel = (n & 1) ? 0x7362u : 0x5140u;
      const uint32_t lo = sm80::prmt(n < 2 ? v[0].x : v[0].y, n < 2 ? v[1].x : v[1].y, sel);
      const uint32_t hi = sm80::prmt(n < 2 ? v[2].x : v[2].y, n < 2 ? v[3].x : v[3].y, sel);
      a[kk][n][0] = cvt2<kMath, 0>(lo);  // column 2 n, keys j = 0, 1
      a[kk][n][1] = cvt2<kMath, 1>(lo);  // column 2 n + 1
      a[kk][n][2] = cvt2<kMath, 0>(hi);  // column 2 n, keys j = 2, 3
      a[kk][n][3] = cvt2<kMath, 1>(hi);
    }
  }
}

/// bf16 activations over an fp8 cache run the products in f16 (kFp8MathF16): e4m3 widens to f16
/// in one instruction (to bf16 in four: through f32), the values are exact in both, P in [0, 1]
/// is finer in f16, and Q's rows are scaled by a power of two into f16's range. Q's kRows rows
/// ([9 panels][kRows rows][128 B], swizzled; the order inside a row does not matter here) are
/// rewritten in place by the 256 consumer threads u: row u / kLanes, chunks u % kLanes + kLanes i.
/// Row r's largest |q| lands in [2^14, 2^15) and row_scale[r] = the inverse power of two, which
/// the softmax folds into the logit scale. Ends with the writes fenced for wgmma and the 256
/// synced on named barrier `bar`.
template <int kRows>
__device__ __forceinline__ void q_to_f16(unsigned char* q, int u, float* row_scale, int bar) {
  constexpr int kChunks = kEntry / 8;  // 72 chunks of 8 per row
  constexpr int kLanes = 256 / kRows;  // threads per row: 16 or 8, inside one warp
  constexpr int kPer = (kChunks + kLanes - 1) / kLanes;
  const int row = int(unsigned(u) / kLanes), part = int(unsigned(u) % kLanes);
  auto at = [&](int c) {
    return reinterpret_cast<uint4*>(q + (c >> 3) * (kRows * 128) + row * 128 + (c & 7) * 16);
  };
  uint4 v[kPer];
  float most = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = part + kLanes * i;
    v[i] = c < kChunks ? *at(c) : make_uint4(0, 0, 0, 0);
    const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // |bf16| as float: the high half is the bf16 itself, the low one bits below it.
      most = fmaxf(most, fabsf(__uint_as_float(w[k] << 16)));
      most = fmaxf(most, fabsf(__uint_as_float(w[k] & 0xffff0000u)));
    }
  }
#pragma unroll
  for (int x = 1; x < kLanes; x <<= 1) most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, x));
  // most in [2^k, 2^(k + 1)): scale by 2^(14 - k), kept inside float's normal exponents.
  const int k = most > 0.0f ? int((__float_as_uint(most) >> 23) & 0xff) - 127 : 14;
  const int e = min(max(14 - k, -100), 100);
  const float up = __uint_as_float(uint32_t(127 + e) << 23);
  if (part == 0) row_scale[row] = __uint_as_float(uint32_t(127 - e) << 23);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = part + kLanes * i;
    if (c >= kChunks) continue;
    uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = pack2<DType::kF16>(__uint_as_float(w[j] << 16) * up,
                                __uint_as_float(w[j] & 0xffff0000u) * up);
    }
    *at(c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
  sm90::named_barrier_sync(bar, 256);
}

}  // namespace pagedattn::cuda::mla
