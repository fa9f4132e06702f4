// The decode kernel's math on one 16-key tile of a warp's stage: S = Q K^T, the online
// softmax (softmax.cuh), O += P V, in the three forms of the instances (fp8 widened in
// registers, tensor cores from ldmatrix, float on CUDA cores). The map is kernel.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/fp8.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/decode/config.h"
#include "cuda/decode/cta.cuh"
#include "cuda/decode/pipeline.cuh"
#include "cuda/decode/softmax.cuh"
#include "cuda/decode/widen.cuh"

namespace pagedattn::cuda::decode {

using attn::fp8x2_f16;

/// This thread's share of its two rows (g, g + 8): O [kNt n tiles][4] in the m16n8k16
/// accumulator layout, and the running max m and sum l (log2 units).
template <int kNt>
struct RowAcc {
  float o[kNt][4];
  float m[2], l[2];
  __device__ __forceinline__ RowAcc() {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }
};

// The operands' lane addresses for ldmatrix (see sm80::ldmatrix_x4): Q as the A operand
// (matrices rows 0-7 / 8-15 x dims +0 / +8), K as B of S = Q K^T (tokens 0-7 / 8-15 x dims
// +0 / +8), V as B of O = P V, transposed (tokens 0-7 / 8-15 x dims +0 / +8); and Q's A
// fragments, in registers up to head size 128 (T::kQInRegisters).
template <class T>
struct Operands {
  static constexpr int kNt = kNtOf<T>;
  static constexpr int kQRegs = T::kQInRegisters ? kNt / 2 : 1;
  int kb_row, kb_col, vb_row, vb_col;
  uint32_t q_lane_addr;
  const uint4* q_frag;  // the in-register fp8 kernel's Q fragments: [k step][lane] 16 bytes
  uint32_t qf[kQRegs][4];
  __device__ __forceinline__ Operands(const SmemLayout& lay) {
    unsigned char* const smem = dyn_smem();
    const int lane = lane_ids().lane;
    const int mi = lane >> 3, r8 = lane & 7;
    const int qa_row = (mi & 1) * 8 + r8, qa_col = (mi >> 1) * 8;
    kb_row = (mi >> 1) * 8 + r8, kb_col = (mi & 1) * 8;
    vb_row = (mi & 1) * 8 + r8, vb_col = (mi >> 1) * 8;
    q_lane_addr = sm80::smem_addr(smem) + qa_row * lay.q_row_bytes + qa_col * 2;
    q_frag = reinterpret_cast<const uint4*>(smem) + lane;
    if constexpr (T::kQInRegisters) {
#pragma unroll
      for (int ks = 0; ks < kNt / 2; ++ks) {
        if constexpr (T::kRegFp8) {
          const uint4 v = q_frag[ks * 32];
          qf[ks][0] = v.x, qf[ks][1] = v.y, qf[ks][2] = v.z, qf[ks][3] = v.w;
        } else {
          sm80::ldmatrix_x4(qf[ks], q_lane_addr + ks * 32);
        }
      }
    }
  }
};

// fp8 widened in registers, f16 math (fp8x2_f16). S = Q K^T: lane (g, t4) takes key
// 8j + g of n tile j and the D/4 contiguous head dims t4 * D/4 + [0, D/4): k step ks
// reduces dims d = t4 * D/4 + 4 ks + {0..3}, the B pair b0 = dims {d, d+1} (bytes 0, 1
// of the word), b1 = {d+2, d+3}; Q's fragments (smem, store_q) use the same order. Sums
// over a permuted k are the same.
template <class T, bool kE5>
__device__ __forceinline__ void s_reg_fp8(const Operands<T>& op, const unsigned char* kt,
                                          int row_bytes, float (&s)[2][4]) {
  const Lane ln = lane_ids();
  constexpr int D = T::head_size, kSteps = D / 16;
  uint32_t kw[2][D / 16];
#pragma unroll
  for (int j = 0; j < 2; ++j)
    lds_words<D / 4>(kt + (8 * j + ln.g) * row_bytes + ln.t4 * (D / 4), kw[j]);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t a[4];
    if constexpr (T::kQInRegisters) {
      a[0] = op.qf[ks][0], a[1] = op.qf[ks][1], a[2] = op.qf[ks][2], a[3] = op.qf[ks][3];
    } else {
      const uint4 v = op.q_frag[ks * 32];
      a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sm80::mma_16816<false>(s[j], a, fp8x2_f16<kE5, 0>(kw[j][ks]), fp8x2_f16<kE5, 1>(kw[j][ks]));
    }
  }
}

// O += P V of the in-register fp8 kernel: P in f16, at least as fine as the activation dtype
// for P in [0, 1]. P's k are keys 2t4, 2t4+1 (b0) and 2t4+8, 2t4+9 (b1). Output column n of n
// tile nt is head dim n * (D/8) + nt, so lane g's B bytes for every n tile are the D/8
// contiguous bytes g * D/8 + [0, D/8) of those four keys; prmt pairs two keys' bytes. The
// merge (store.cuh) writes O back in natural order.
template <class T, bool kE5>
__device__ __forceinline__ void pv_reg_fp8(const float (&s)[2][4], const unsigned char* vt,
                                           int row_bytes, float (&o)[kNtOf<T>][4]) {
  const Lane ln = lane_ids();
  constexpr int D = T::head_size;
  constexpr DType kF16 = DType::kF16;
  const uint32_t pa[4] = {pack2<kF16>(s[0][0], s[0][1]), pack2<kF16>(s[0][2], s[0][3]),
                          pack2<kF16>(s[1][0], s[1][1]), pack2<kF16>(s[1][2], s[1][3])};
  constexpr int kVBytes = D / 8;
  uint32_t va[4][kVBytes / 4];
  const unsigned char* v0 = vt + (2 * ln.t4) * row_bytes + ln.g * kVBytes;
  lds_words<kVBytes>(v0, va[0]);
  lds_words<kVBytes>(v0 + row_bytes, va[1]);
  lds_words<kVBytes>(v0 + 8 * row_bytes, va[2]);
  lds_words<kVBytes>(v0 + 9 * row_bytes, va[3]);
#pragma unroll
  for (int c = 0; c < kVBytes / 4; ++c) {
    // [b1 a1 b0 a0]: the low half pairs column 4c of keys a, b; the high half column 4c + 1.
    const uint32_t ab01 = sm80::prmt(va[0][c], va[1][c], 0x5140);
    const uint32_t ab23 = sm80::prmt(va[0][c], va[1][c], 0x7362);
    const uint32_t cd01 = sm80::prmt(va[2][c], va[3][c], 0x5140);
    const uint32_t cd23 = sm80::prmt(va[2][c], va[3][c], 0x7362);
    sm80::mma_16816<false>(o[4 * c], pa, fp8x2_f16<kE5, 0>(ab01), fp8x2_f16<kE5, 0>(cd01));
    sm80::mma_16816<false>(o[4 * c + 1], pa, fp8x2_f16<kE5, 1>(ab01), fp8x2_f16<kE5, 1>(cd01));
    sm80::mma_16816<false>(o[4 * c + 2], pa, fp8x2_f16<kE5, 0>(ab23), fp8x2_f16<kE5, 0>(cd23));
    sm80::mma_16816<false>(o[4 * c + 3], pa, fp8x2_f16<kE5, 1>(ab23), fp8x2_f16<kE5, 1>(cd23));
  }
}

// S = Q K^T on tensor cores, K (16-bit, or widened in smem) by ldmatrix.
template <class T>
__device__ __forceinline__ void s_mma(const Operands<T>& op, const unsigned char* kt, int row_bytes,
                                      float (&s)[2][4]) {
  constexpr bool kBF16 = T::act == DType::kBF16;
  const uint32_t k_addr = sm80::smem_addr(kt) + op.kb_row * row_bytes + op.kb_col * 2;
#pragma unroll
  for (int ks = 0; ks < kNtOf<T> / 2; ++ks) {
    uint32_t b[4];
    sm80::ldmatrix_x4(b, k_addr + ks * 32);
    if constexpr (T::kQInRegisters) {
      sm80::mma_16816<kBF16>(s[0], op.qf[ks], b[0], b[1]);
      sm80::mma_16816<kBF16>(s[1], op.qf[ks], b[2], b[3]);
    } else {
      uint32_t a[4];
      sm80::ldmatrix_x4(a, op.q_lane_addr + ks * 32);
      sm80::mma_16816<kBF16>(s[0], a, b[0], b[1]);
      sm80::mma_16816<kBF16>(s[1], a, b[2], b[3]);
    }
  }
}

// O += P V on tensor cores: P rounded to the activation dtype, V by transposing ldmatrix.
template <class T>
__device__ __forceinline__ void pv_mma(const Operands<T>& op, const float (&s)[2][4],
                                       const unsigned char* vt, int row_bytes,
                                       float (&o)[kNtOf<T>][4]) {
  constexpr bool kBF16 = T::act == DType::kBF16;
  const uint32_t pa[4] = {pack2<T::act>(s[0][0], s[0][1]), pack2<T::act>(s[0][2], s[0][3]),
                          pack2<T::act>(s[1][0], s[1][1]), pack2<T::act>(s[1][2], s[1][3])};
  const uint32_t v_addr = sm80::smem_addr(vt) + op.vb_row * row_bytes + op.vb_col * 2;
#pragma unroll
  for (int np = 0; np < kNtOf<T> / 2; ++np) {
    uint32_t b[4];
    sm80::ldmatrix_x4_trans(b, v_addr + np * 32);
    sm80::mma_16816<kBF16>(o[2 * np], pa, b[0], b[1]);
    sm80::mma_16816<kBF16>(o[2 * np + 1], pa, b[2], b[3]);
  }
}

// S = Q K^T in float, in the fragment layout of the tensor-core path: this thread owns rows g,
// g + 8 and keys 2*t4 + {0, 1} (+ 8) of S.
template <class T>
__device__ __forceinline__ void s_float(const Shape<T>& sh, const unsigned char* kt, int row_bytes,
                                        float (&s)[2][4]) {
  const unsigned char* const smem = dyn_smem();
  const SmemLayout& lay = sh.lay;
  const int head_size = sh.head_size;
  const Lane ln = lane_ids();
  const float* qf32 = reinterpret_cast<const float*>(smem);
  const int q_ld = lay.q_row_bytes / 4, kv_ld = row_bytes / 4;
  const float* qa = qf32 + ln.g * q_ld;
  const float* qb = qf32 + (ln.g + 8) * q_ld;
  const float* kf = reinterpret_cast<const float*>(kt);
  const float* k0 = kf + (2 * ln.t4) * kv_ld;
  const float* k2 = kf + (8 + 2 * ln.t4) * kv_ld;
  for (int d = 0; d < head_size; d += 4) {
    const float4 a = *reinterpret_cast<const float4*>(qa + d);
    const float4 b = *reinterpret_cast<const float4*>(qb + d);
    const float4 kv[4] = {
        *reinterpret_cast<const float4*>(k0 + d), *reinterpret_cast<const float4*>(k0 + kv_ld + d),
        *reinterpret_cast<const float4*>(k2 + d), *reinterpret_cast<const float4*>(k2 + kv_ld + d)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float& sa = s[j >> 1][j & 1];
      float& sb = s[j >> 1][2 + (j & 1)];
      sa = fmaf(a.x, kv[j].x, fmaf(a.y, kv[j].y, fmaf(a.z, kv[j].z, fmaf(a.w, kv[j].w, sa))));
      sb = fmaf(b.x, kv[j].x, fmaf(b.y, kv[j].y, fmaf(b.z, kv[j].z, fmaf(b.w, kv[j].w, sb))));
    }
  }
}

// O += P V in float: P through the warp's smem tile (each thread needs all 16 keys of its two
// rows); this thread owns columns nt * 8 + 2*t4 + {0, 1} of O.
template <class T>
__device__ __forceinline__ void pv_float(const Shape<T>& sh, const float (&s)[2][4],
                                         const unsigned char* vt, int row_bytes,
                                         float (&o)[kNtOf<T>][4]) {
  unsigned char* const smem = dyn_smem();
  const SmemLayout& lay = sh.lay;
  const int nt_active = sh.nt_active;
  const Lane ln = lane_ids();
  const int g = ln.g, t4 = ln.t4;
  const int kv_ld = row_bytes / 4;
  float* pt = reinterpret_cast<float*>(smem + lay.p_offset) + ln.warp * kRows * (kTileTokens + 1);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int row = g + 8 * (c >> 1), key = 2 * t4 + (c & 1);
    pt[row * (kTileTokens + 1) + key] = s[0][c];
    pt[row * (kTileTokens + 1) + 8 + key] = s[1][c];
  }
  __syncwarp();
  const float* vf = reinterpret_cast<const float*>(vt);
  for (int key = 0; key < kTileTokens; ++key) {
    const float pa = pt[g * (kTileTokens + 1) + key];
    const float pb = pt[(g + 8) * (kTileTokens + 1) + key];
    const float* vrow = vf + key * kv_ld + 2 * t4;
#pragma unroll
    for (int nt = 0; nt < kNtOf<T>; ++nt) {
      if (nt < nt_active) {
        const float2 v = *reinterpret_cast<const float2*>(vrow + nt * 8);
        o[nt][0] = fmaf(pa, v.x, o[nt][0]);
        o[nt][1] = fmaf(pa, v.y, o[nt][1]);
        o[nt][2] = fmaf(pb, v.x, o[nt][2]);
        o[nt][3] = fmaf(pb, v.y, o[nt][3]);
      }
    }
  }
}

// This warp's tile in `stage`, keys [ts, ts + kTileTokens): widened first where the instance
// widens in smem, then S, the softmax and P V. kE5m2: the fp8 kernel's cache format, fixed per
// launch.
template <class T, bool kE5m2>
__device__ __forceinline__ void compute_tile(const AttnParams& p, const Shape<T>& sh,
                                             const KvPipe<T>& kv, const Operands<T>& op,
                                             const ThreadRow (&rows)[2], int lo_max, int hi_min,
                                             int stage, int ts, RowAcc<kNtOf<T>>& acc) {
  constexpr int kNt = kNtOf<T>;
  const Lane ln = lane_ids();
  const SmemLayout& lay = sh.lay;
  const unsigned char* kt = kv.my_stages + stage * lay.stage_bytes;
  const unsigned char* vt = kt + kTileTokens * lay.kv_row_bytes;
  int row_bytes = lay.kv_row_bytes;
  if constexpr (T::kWiden) {
    widen_stage<T>(p, lay, kt, kv.my_conv, sh.chunks_per_row, ln.lane);
    __syncwarp();
    kt = kv.my_conv;
    vt = kv.my_conv + kTileTokens * lay.conv_row_bytes;
    row_bytes = lay.conv_row_bytes;
  }
  const bool need_mask = !(ts >= lo_max && ts + kTileTokens <= hi_min);
  float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
  if constexpr (T::kRegFp8) {
    s_reg_fp8<T, kE5m2>(op, kt, row_bytes, s);
    softmax_tile<kNt>(p, s, rows, ts, need_mask, ln.t4, acc.m, acc.l, acc.o);
    pv_reg_fp8<T, kE5m2>(s, vt, row_bytes, acc.o);
  } else if constexpr (T::kMma) {
    s_mma<T>(op, kt, row_bytes, s);
    softmax_tile<kNt>(p, s, rows, ts, need_mask, ln.t4, acc.m, acc.l, acc.o);
    pv_mma<T>(op, s, vt, row_bytes, acc.o);
  } else {
    s_float<T>(sh, kt, row_bytes, s);
    softmax_tile<kNt>(p, s, rows, ts, need_mask, ln.t4, acc.m, acc.l, acc.o);
    pv_float<T>(sh, s, vt, row_bytes, acc.o);
  }
}

}  // namespace pagedattn::cuda::decode
