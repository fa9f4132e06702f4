// Tile sizes of the prefill family (the portable tensor-core kernel for long queries), each
// with its reason. Host and device code both read these.
#pragma once

#include <cstdint>

#include "cuda/attn_common/config.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::prefill {

using attn::KVKind;

/// Requests with at most this many packed query rows (q_len * G) stay on the decode kernel
/// when the prefill kernel runs beside it: four decode CTAs of 16 rows share the KV through
/// L2 and split long contexts, where one 128-row prefill CTA would be half empty.
inline constexpr int kDecodeMaxRows = 64;
/// Stages of the K/V ring: two, as FlashAttention-2 keeps; the second CTA on the SM (d <= 128)
/// hides the rest of the load latency, and d > 128 has no room for a third.
inline constexpr int kStages = 2;

/// Byte offsets of the dynamic shared memory of one CTA. Rows are padded by 16 bytes (the
/// decode family's reason: 8 ldmatrix rows land in 8 bank groups without a swizzle).
struct SmemLayout {
  int q_row_bytes = 0;     ///< Q tile [kBlockM][head_size] 16-bit
  int kv_row_bytes = 0;    ///< raw cache rows of a stage
  int conv_row_bytes = 0;  ///< fp8 only: rows of the widened (16-bit) K and V of a stage
  int stage_bytes = 0;     ///< K tile then V tile, block_n rows each
  int stage_offset = 0;    ///< [kStages] stage tiles
  int conv_offset = 0;     ///< [2][block_n] widened rows
  int rows_offset = 0;     ///< [2 slots][block_n][K, V] int64 byte offsets of a tile's rows
  int total = 0;
};

constexpr SmemLayout smem_layout(int head_size, int kv_elem_bytes, int block_m, int block_n) {
  SmemLayout s;
  s.q_row_bytes = head_size * 2 + 16;
  s.kv_row_bytes = head_size * kv_elem_bytes + 16;
  s.conv_row_bytes = kv_elem_bytes == 1 ? head_size * 2 + 16 : 0;
  s.stage_bytes = 2 * block_n * s.kv_row_bytes;
  s.stage_offset = block_m * s.q_row_bytes;
  s.conv_offset = s.stage_offset + kStages * s.stage_bytes;
  s.rows_offset = s.conv_offset + 2 * block_n * s.conv_row_bytes;
  s.total = s.rows_offset + 2 * block_n * 2 * 8;
  return s;
}

/// One compiled prefill kernel: 16-bit activations over a cache of the same type (kSame) or
/// fp8 (kFp8, widened exactly in shared memory once per stage).
template <DType kAct, KVKind kKV, int kHeadSize>
struct Traits {
  static constexpr DType act = kAct;
  static constexpr KVKind kv = kKV;
  static constexpr int head_size = kHeadSize;
  static_assert(kAct == DType::kF16 || kAct == DType::kBF16);
  static_assert(kKV == KVKind::kSame || kKV == KVKind::kFp8);
  static_assert(kHeadSize % 16 == 0 && kHeadSize <= 256);
  /// m16 row tiles per warp. Two (32 rows) reuse every K / V fragment read from shared memory
  /// for two MMAs, which halves the shared-memory traffic per FLOP (one m16n8k16 per clock
  /// needs 256 B of B fragments with one tile, 128 B/clk is the SM's bandwidth); O then takes
  /// head_size floats per thread, which fits in 255 registers only up to head size 128.
  static constexpr int kMt = kHeadSize <= 128 ? 2 : 1;
  /// 4 warps x 32 rows or 8 warps x 16 rows: 128 packed query rows per CTA either way.
  static constexpr int kWarps = kHeadSize <= 128 ? 4 : 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 16 * kMt;
  static constexpr int kBlockM = kWarps * kRowsPerWarp;
  /// Keys per pipeline stage (kBlockN / 8 n tiles of S per warp): 64 where ptxas fits the
  /// kernel in 255 registers without spilling, else 32. [ptxas, bf16, 64 -> 32 keys] d80: 40
  /// -> 0 bytes spilled, d96: 112 -> 0, d128: 176 -> 32, d256: 336 -> 0; d64 and d192 spill
  /// nothing (4 bytes at d192) with 64.
  static constexpr int kBlockN = kHeadSize == 64 || kHeadSize == 192 ? 64 : 32;
  static constexpr int kKvBytes = kKV == KVKind::kSame ? 2 : 1;
  static constexpr SmemLayout layout() {
    return smem_layout(kHeadSize, kKvBytes, kBlockM, kBlockN);
  }
  /// Two CTAs of 4 warps per SM where the shared memory allows it (d <= 128): the bound caps
  /// registers at 255. 8-warp CTAs take one (two would cap registers at 128: ptxas spilled).
  static constexpr int kMinCtasPerSm =
      kWarps == 4 && layout().total <= attn::kTwoCtaSmemBudget ? 2 : 1;
  static_assert(layout().total <= attn::kMaxSmemPerCta);
  /// Split boundaries fall on whole tiles.
  static constexpr int kSplitAlign = kBlockN;
};

}  // namespace pagedattn::cuda::prefill

namespace pagedattn::cuda::prefill {

/// Sm90Layout::tile_offset's hand-over area: int [4], then an attn::Work slot of
/// kWorkSlotBytes per Q buffer.
inline constexpr int kWorkSlotBytes = 48;
inline constexpr int kTileSlotBytes = 16 + 2 * kWorkSlotBytes;

/// Shared memory of the Hopper kernel: every operand tile in 128-byte-swizzled panels of 64
/// columns (the wgmma canonical layout), each panel base 1024-byte aligned.
struct Sm90Layout {
  int q_panel = 0;   ///< bytes of one Q panel: kBlockM rows x 128 B
  int kv_panel = 0;  ///< bytes of one K (or V) panel: kBlockN rows x 128 B
  int q_offset = 0;  ///< Q [q_stages][panels][kBlockM][64]
  int q_bytes = 0;   ///< bytes of one Q buffer
  /// Q buffers: 2 where they fit (the producer loads the next work tile's Q while the
  /// consumers still read this one's), else 1 (d256, and the fp8 widening at d128).
  int q_stages = 1;
  int stage_offset = 0;  ///< [kStages] { K [panels][kBlockN][64], V the same }
  int stage_bytes = 0;
  int raw_offset = 0;    ///< fp8 caches: [K, V][kBlockN][head_size] raw codes of the next tile
  int table_offset = 0;  ///< [kStages + 1][kBlockN] {K, V} int64 row byte offsets (producer)
  int bar_offset = 0;    ///< mbarriers: q_full [2], K full / V full / K empty / V empty
                         ///< [kStages], q_empty [2]
  /// The dynamic walk's hand-over: int [4], the work-tile numbers per Q buffer (for the
  /// consumers) and two for the producer's own broadcast; then attn::Work [2] (48 bytes
  /// each), the work tile of each Q buffer as the producer computed it
  int tile_offset = 0;
  /// Q rows scaled into f16 (Sm90Traits::kQRescale): float [q_stages][kBlockM], each row's
  /// 2^-k, the factor its scores are multiplied by to undo the scaling
  int q_undo_offset = 0;
  int total = 0;  ///< including 1024 bytes to align the dynamic base
};

constexpr Sm90Layout sm90_layout(int head_size, int block_m, int block_n, int stages,
                                 int kv_elem_bytes, bool q_rescale) {
  Sm90Layout s;
  const int panels = (head_size + 63) / 64;  // a last panel of 16-48 columns is partly unused
  s.q_panel = block_m * 128;
  s.kv_panel = block_n * 128;
  s.q_offset = 0;
  s.q_bytes = panels * s.q_panel;
  for (int q_stages = 2;; --q_stages) {
    s.q_stages = q_stages;
    s.stage_offset = q_stages * s.q_bytes;
    s.stage_bytes = 2 * panels * s.kv_panel;
    s.raw_offset = s.stage_offset + stages * s.stage_bytes;
    s.table_offset = s.raw_offset + (kv_elem_bytes == 1 ? 2 * block_n * head_size : 0);
    s.bar_offset = s.table_offset + (stages + 1) * block_n * 16;  // kTableSlots
    s.tile_offset = s.bar_offset + (4 + 4 * stages) * 8;
    s.q_undo_offset = s.tile_offset + kTileSlotBytes;
    s.total = s.q_undo_offset + (q_rescale ? q_stages * block_m * 4 : 0) + 1024;
    if (s.total <= attn::kMaxSmemPerCta || q_stages == 1) return s;
  }
}

/// Shared memory of the Hopper kernel's fp8-product instances (Sm90Traits::kFp8Math): one
/// 128-byte panel per operand row (head sizes up to 128 bytes of e4m3), V transposed.
constexpr Sm90Layout sm90_fp8_layout(int block_m, int block_n, int stages) {
  Sm90Layout s;
  s.q_panel = block_m * 128;   // Q [kBlockM][head_size] e4m3
  s.kv_panel = block_n * 128;  // K [kBlockN][head_size] e4m3; Vt [head_size][kBlockN] e4m3
  s.q_offset = 0;
  s.q_bytes = s.q_panel;
  s.q_stages = 2;
  s.stage_offset = 2 * s.q_bytes;
  s.stage_bytes = 2 * s.kv_panel;
  s.raw_offset = s.stage_offset + stages * s.stage_bytes;  // [2][kBlockN][128] raw V rows
  s.table_offset = s.raw_offset + 2 * block_n * 128;
  s.bar_offset = s.table_offset + (stages + 1) * block_n * 16;
  s.tile_offset = s.bar_offset + (4 + 4 * stages) * 8;
  s.q_undo_offset = s.tile_offset + kTileSlotBytes;
  s.total = s.q_undo_offset + 1024;
  return s;
}

/// The Hopper (sm_90a) prefill kernel: a producer warpgroup brings K/V tiles (by TMA where it
/// can, else cp.async) into rings on mbarriers, two consumer warpgroups of 64 query rows run
/// S = Q K^T (wgmma, both operands in smem) and O += P V (wgmma, P from registers). fp8 caches
/// (kFp8) land raw in a staging buffer and the producer widens them exactly to f16 (`mma`,
/// whatever the activation type: every e4m3 / e5m2 value is exact in f16, and the hardware
/// widens two codes per instruction where bf16 takes a bit trick and a multiply per pair); a
/// bf16 Q then comes in f16 too, each row scaled by a power of two (kQRescale, the decode
/// kernel's rule: attn::q_row_shift) that the consumers undo in the softmax. Head sizes
/// that are not whole panels (80, 96, 192) leave the last panel's tail unwritten: S's k-steps
/// stop at head_size and P V's n extent is head_size, so neither reads it.
/// kFp8MathT (query_quant over an e4m3 cache): Q narrowed to e4m3 (exactly: the query was
/// quantised before the launch), K raw, V transposed by the producer, S = Q K^T and O += P V as
/// e4m3 wgmma (k32) with P rounded to e4m3.
template <DType kAct, KVKind kKV, int kHeadSize, bool kFp8MathT = false>
struct Sm90Traits {
  static constexpr DType act = kAct;
  static constexpr KVKind kv = kKV;
  static constexpr int head_size = kHeadSize;
  static constexpr bool kFp8Math = kFp8MathT;
  static_assert(!kFp8Math || (kKV == KVKind::kFp8 && kHeadSize % 32 == 0 && kHeadSize <= 128),
                "fp8 products: k steps of 32 within one 128-byte panel");
  static_assert(kAct == DType::kF16 || kAct == DType::kBF16);
  static_assert(kKV == KVKind::kSame || kKV == KVKind::kFp8);
  static constexpr int kKvBytes = kKV == KVKind::kSame ? 2 : 1;
  /// The 16-bit type of the products: f16 over a widened fp8 cache, else the activations'.
  static constexpr DType mma = kKV == KVKind::kFp8 && !kFp8Math ? DType::kF16 : kAct;
  /// Q's rows are scaled into f16 by the producer (bf16 activations over a widened fp8 cache).
  static constexpr bool kQRescale = mma != kAct;
  static_assert(kHeadSize % 16 == 0 && kHeadSize >= 64 && kHeadSize <= 256,
                "wgmma k-steps of 16 and n <= 256");
  /// 128-byte panels of Q, K and V rows (64 16-bit columns; all 128 e4m3 columns)
  static constexpr int kPanels = kFp8Math ? 1 : (kHeadSize + 63) / 64;
  static constexpr int kConsumers = 2;  ///< consumer warpgroups of 64 rows
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBlockM = 64 * kConsumers;
  /// Keys per stage: 128 (FA3's causal d128 tile), 64 above d128 where O takes 96-128
  /// registers.
  static constexpr int kBlockN = kHeadSize <= 128 ? 128 : 64;
  /// Three stages for the 16-bit d64 instances (89 -> 121 KB of shared memory; causal d64
  /// 1k-16k +2-3%, ViT d64 within 1%; two were 0.97-0.98x, four no faster).
  static constexpr int kStages = kHeadSize <= 64 && kKV == KVKind::kSame ? 3 : 2;
  static constexpr int kSplitAlign = kBlockN;
  static constexpr int kTableSlots = kStages + 1;  ///< the producer's row tables (sm90/kernel.cuh)
  /// setmaxnreg budgets: 128 x 40 + 256 x 232 = 64512 <= 65536 registers, or
  /// 56 / 224 (128 x 56 + 256 x 224 = 64512) where the consumers can spare the registers: the
  /// fp8 products (P in half the registers; the producer's V transpose spilled 16 bytes in 40)
  /// and head sizes up to 96 (O in 48 or fewer), whose producer then keeps the work-tile
  /// loop's state without spilling (in 40 it spilled 36-76 bytes, and ViT d80, whose cp.async
  /// producer is the busiest, ran 4-5% slower), and the fp8-widening d128 instances, whose
  /// producer widens in registers (in 40 it spilled 20 bytes; causal e4m3 d128 4k / 8k / 16k
  /// +1.3-1.6% with 56).
  static constexpr bool kWideProducer =
      kFp8Math || kHeadSize <= 96 || (kKV == KVKind::kFp8 && kHeadSize <= 128);
  static constexpr int kProducerRegs = kWideProducer ? 56 : 40;
  static constexpr int kConsumerRegs = kWideProducer ? 224 : 232;
  static constexpr Sm90Layout layout() {
    return kFp8Math ? sm90_fp8_layout(kBlockM, kBlockN, kStages)
                    : sm90_layout(kHeadSize, kBlockM, kBlockN, kStages, kKvBytes, kQRescale);
  }
  static_assert(layout().total <= attn::kMaxSmemPerCta);
};

}  // namespace pagedattn::cuda::prefill
