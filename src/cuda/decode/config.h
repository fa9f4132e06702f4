// Tile sizes and pipeline depth of the decode family, each with its reason. Host and device
// code both read these (smem_layout sizes the dynamic shared memory on both sides).
#pragma once

#include <cstdint>

#include "cuda/attn_common/config.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::decode {

using attn::kMaxSmemPerCta;
using attn::kTwoCtaSmemBudget;
using attn::KVKind;

/// Packed query rows per CTA (row p = query token p / G, head kv_head * G + p % G): one
/// m16n8k16 M tile. Decode has G * q_len rows (4 for GQA 32/8, 16 for GQA 32/8 with 4-token
/// queries); more rows become more CTAs over the same KV, which L2 then serves.
inline constexpr int kRows = 16;
/// KV tokens a warp takes per pipeline stage: the k extent of one P*V mma and two n tiles of S.
inline constexpr int kTileTokens = 16;
/// Largest head size any instance serves (the generic kernel sizes its registers for it).
using attn::kMaxHeadSize;
/// The generic kernel's row width for a problem head size (a multiple of 8): the next multiple
/// of 16, which its float rows and 16-byte chunks need. The extra columns are zeros.
constexpr int padded_head_size(int head_size) {
  return (head_size + 15) / 16 * 16;
}
/// Shared memory a CTA may take and still share the SM with two others (attn_common/config.h
/// has the two-CTA budget).
inline constexpr int kThreeCtaSmemBudget = 75 * 1024;

/// Byte offsets of the dynamic shared memory of one CTA.
struct SmemLayout {
  int q_row_bytes = 0;     ///< Q tile [kRows][head_size], 16 bytes of padding per row
  int kv_row_bytes = 0;    ///< raw cache rows of a stage, padded by 16 bytes
  int conv_row_bytes = 0;  ///< rows of the widened copy of a stage (fp8 and generic), or 0
  int stage_bytes = 0;     ///< one warp's stage: K tile then V tile, kTileTokens rows each
  int stage_offset = 0;    ///< [warps][stages] stage tiles
  int conv_offset = 0;     ///< [warps] widened K and V tiles
  int p_offset = 0;        ///< generic only: [warps][kRows][kTileTokens + 1] float P tile
  int merge_offset = 0;    ///< after the main loop, over the stages: per-warp O, m, l
  int merge_o_row = 0;     ///< floats per O row in the merge area (head_size + 4)
  int bar_offset = 0;      ///< [warps][stages] mbarriers of the bulk-copy path, past the rest
  int total = 0;
};

/// The shared-memory layout of one CTA. 16 bytes of padding per row move consecutive rows by 4
/// banks (the row length in 16-byte units is odd for every head size that is a multiple of
/// 16), so the 8 rows one ldmatrix reads hit 8 different bank groups: no conflicts, no
/// swizzle. Device code calls this too (nvcc's --expt-relaxed-constexpr).
constexpr SmemLayout smem_layout(int head_size, int kv_elem_bytes, bool mma, bool widen, int warps,
                                 int stages) {
  SmemLayout s;
  s.q_row_bytes = head_size * (mma ? 2 : 4) + 16;
  s.kv_row_bytes = head_size * kv_elem_bytes + 16;
  s.conv_row_bytes = widen ? head_size * (mma ? 2 : 4) + 16 : 0;
  s.stage_bytes = 2 * kTileTokens * s.kv_row_bytes;
  const int q_bytes = kRows * s.q_row_bytes;
  s.stage_offset = q_bytes;
  s.conv_offset = s.stage_offset + warps * stages * s.stage_bytes;
  s.p_offset = s.conv_offset + warps * 2 * kTileTokens * s.conv_row_bytes;
  const int main_end = s.p_offset + (mma ? 0 : warps * kRows * (kTileTokens + 1) * 4);
  s.merge_offset = q_bytes;
  s.merge_o_row = head_size + 4;
  const int merge_end = s.merge_offset + warps * kRows * (s.merge_o_row + 2) * 4;
  s.bar_offset = ((main_end > merge_end ? main_end : merge_end) + 7) / 8 * 8;
  s.total = s.bar_offset + warps * stages * 8;
  return s;
}

/// Pipeline depth of a tensor-core instance. Decode is bound by bytes in flight (HBM3e needs
/// 32-64 KB per SM outstanding): take 3-4 stages with two CTAs per SM when they fit, else one
/// CTA per SM with as many stages (up to 4) as fit in 227 KB. fp8 widened in registers reads
/// half the bytes per tile and left the issue slots ~55% idle with 2 warps per scheduler: it
/// takes three CTAs (12 warps) per SM with 3-4 stages when they fit, the same bytes in flight
/// as 2 x 4 stages (+5% at batch 64, 4k: docs/kernels/decode.md).
constexpr int mma_stages(int head_size, int kv_elem_bytes, bool widen) {
  if (kv_elem_bytes == 1 && !widen) {
    for (int stages = 4; stages >= 3; --stages) {
      if (smem_layout(head_size, 1, true, false, 4, stages).total <= kThreeCtaSmemBudget) {
        return stages;
      }
    }
  }
  for (int stages = 4; stages >= 3; --stages) {
    if (smem_layout(head_size, kv_elem_bytes, true, widen, 4, stages).total <= kTwoCtaSmemBudget) {
      return stages;
    }
  }
  for (int stages = 4; stages >= 2; --stages) {
    if (smem_layout(head_size, kv_elem_bytes, true, widen, 4, stages).total <= kMaxSmemPerCta) {
      return stages;
    }
  }
  return 1;
}

/// One compiled decode kernel. kHeadSize is 0 for the generic (kAny) kernel, which takes any
/// head size that is a multiple of 16 up to kMaxHeadSize at run time.
template <DType kAct, KVKind kKV, int kHeadSize>
struct Traits {
  static constexpr DType act = kAct;
  static constexpr KVKind kv = kKV;
  static constexpr int head_size = kHeadSize;
  /// Tensor cores (mma.sync m16n8k16, fp32 accumulation) for 16-bit activations with a cache
  /// of the same type or fp8, whose values are exact in that type. Everything else (float32
  /// activations, mixed 16-bit types) runs float math on CUDA cores, which also keeps float32
  /// results within float32 error.
  static constexpr bool kMma = kKV != KVKind::kAny;
  static_assert(kMma == (kHeadSize > 0), "tensor-core instances fix the head size");
  static_assert(!kMma || (kAct == DType::kF16 || kAct == DType::kBF16));
  static_assert(!kMma || (kHeadSize % 16 == 0 && kHeadSize <= kMaxHeadSize));
  /// 4 warps split the KV range of a CTA (tile w, w+4, ...) and merge in smem at the end; the
  /// generic kernel keeps 2 so that its float32 stages fit at head size 256.
  static constexpr int kWarps = kMma ? 4 : 2;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKvBytes = kKV == KVKind::kSame ? 2 : (kKV == KVKind::kFp8 ? 1 : 4);
  /// fp8 widened in registers: each lane reads its B fragments' bytes with 32-bit-or-wider LDS
  /// and converts two codes to f16 per cvt (fp8x2_f16, tile.cuh); the products run in f16
  /// whatever the activation type (a bf16 Q scaled into f16, q_row_shift). It needs head_size /
  /// 32 whole words per lane and token (head sizes that are multiples of 32); head size 80
  /// keeps the smem widening pass.
  static constexpr bool kRegFp8 = kKV == KVKind::kFp8 && kHeadSize % 32 == 0;
  /// A widened copy of each stage in smem (generic kernel; fp8 at head size 80).
  static constexpr bool kWiden = kKV == KVKind::kAny || (kKV == KVKind::kFp8 && !kRegFp8);
  static constexpr int kStages = kMma ? mma_stages(kHeadSize, kKvBytes, kWiden) : 2;
  /// CTAs per SM the instance is built for (__launch_bounds__): 3 for the fp8 instances whose
  /// smem allows it (ptxas then keeps d128 at <= 168 registers); 1 where smem allows only one
  /// (without it ptxas held f16 d192 at 168 registers and spilled); else 0 = not given (a 1
  /// there changes ptxas's register choices: bf16 d128 168 -> 197).
  static constexpr int kMmaSmem =
      kMma ? smem_layout(kHeadSize, kKvBytes, true, kWiden, kWarps, kStages).total : 0;
  static constexpr int kMinCtasPerSm = !kMma                                        ? 0
                                       : kRegFp8 && kMmaSmem <= kThreeCtaSmemBudget ? 3
                                       : kMmaSmem > kTwoCtaSmemBudget               ? 1
                                                                                    : 0;
  /// Split boundaries fall on multiples of this, so every warp of a split gets whole tiles.
  static constexpr int kSplitAlign = kWarps * kTileTokens;
  /// Keep Q's fragments in registers up to head size 128 (32 registers); above, reload them
  /// from smem each tile so O (head_size / 2 floats per thread) fits.
  static constexpr bool kQInRegisters = kMma && kHeadSize <= 128;
  /// Shared memory of the largest problem this instance serves.
  static constexpr SmemLayout max_layout() {
    return kMma ? smem_layout(kHeadSize, kKvBytes, true, kWiden, kWarps, kStages)
                : smem_layout(kMaxHeadSize, 4, false, true, kWarps, kStages);
  }
};

}  // namespace pagedattn::cuda::decode
