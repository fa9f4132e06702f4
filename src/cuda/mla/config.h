// Tile sizes and shared-memory layout of the MLA decode family, each with its reason. Host and
// device code both read these.
#pragma once

#include <cstdint>

#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla {

/// The latent cache is the activation type (kSame) or fp8 e4m3 (kFp8, widened exactly to the
/// activation type in shared memory by the consumers; k_scale folded into the logit scale).
enum class KVKind : uint8_t { kSame, kFp8 };

/// How the two consumer warpgroups share a tile's work (kernel.cuh's map has the details).
///   kSplitS: each computes S for half of the keys, P goes through shared memory;
///   kSeesaw: each owns alternate tiles (whole S, softmax, P to shared memory) and half of O;
///     16-bit caches only (it needs two stages);
///   kSwapAB: CTAs of 16 packed rows, S^T = K Q^T and O^T = V^T P^T (keys and latent columns
///     on wgmma's M side, the rows on N = 16: no padded rows), S^T's k steps split between the
///     warpgroups, O^T's columns too;
///   kSwapAB32: the same with CTAs of 32 rows (16 heads x 2 tokens, 32 heads x 1), each
///     warpgroup the softmax of 16 of them, S^T's rows split between the warpgroups over a
///     16-bit cache (no partial sums to exchange), its k steps over fp8; O^T's columns too;
///   kAuto: what find_mla() picks for the cache kind and head count (never a Traits parameter).
enum class Consumer : uint8_t { kAuto, kSplitS, kSeesaw, kSwapAB, kSwapAB32 };
constexpr bool is_swap_ab(Consumer c) {
  return c == Consumer::kSwapAB || c == Consumer::kSwapAB32;
}

/// The one latent head: kv_lora_rank 512 (kv_c, also the value) + qk_rope_head_dim 64 (k_pe).
inline constexpr int kEntry = 576;
/// 128-byte swizzled panels of 64 16-bit columns: 9 per entry, the first 8 hold kv_c.
inline constexpr int kPanels = kEntry / 64;
/// The kv_c columns: MLAAttention's output (it up-projects these), the seesaw's whole output.
inline constexpr int kLatent = 512;
/// Packed rows (q_len * N) per CTA: one wgmma M tile. 16 heads x 1 token fill a quarter of it
/// (the zero rows cost tensor-core time and shared-memory reads: at 16 heads the consumers'
/// chain, not the copies, binds an fp8 cache, and more bandwidth (~4.2 TB/s) would make it
/// bind a 16-bit one). kSwapAB / kSwapAB32 put the rows on wgmma's N side instead: 16 / 32 per CTA.
inline constexpr int kBlockM = 64;
constexpr int block_m_for(Consumer c) {
  return c == Consumer::kSwapAB ? 16 : c == Consumer::kSwapAB32 ? 32 : kBlockM;
}
/// Keys per stage: 64 rows of 1152 bytes (72 KB at 16 bits), S = 64 x 64 per warpgroup.
inline constexpr int kBlockN = 64;
/// Split boundaries fall on whole tiles; a split keeps >= this many keys (the decode family's
/// kMinSplitTokens, so the planner's s_max rule means the same here).
inline constexpr int kSplitAlign = kBlockN;
inline constexpr int kMaxSplits = 64;  ///< the combine reads one LSE per lane, two lanes' worth
/// Splits that merge inside one cluster at most (the portable cluster size).
inline constexpr int kMaxClusterSplits = 8;
/// The latent output columns each CTA of an s-CTA merge cluster owns (cluster_merge.cuh): a
/// multiple of 4 (float4 reads), s of them covering the 512.
constexpr int merge_cols(int s) {
  return ((kLatent + s - 1) / s + 3) / 4 * 4;
}
inline constexpr int kMaxSmemPerCta = 227 * 1024;
/// Shared memory a cluster merge of `rows`-row CTAs takes at most over 2..kMaxClusterSplits
/// splits (cluster_merge.cuh: [s][rows][merge_cols(s)] floats and [s][rows] LSEs).
constexpr int merge_bytes(int rows) {
  int most = 0;
  for (int s = 2; s <= kMaxClusterSplits; ++s) {
    const int b = s * rows * (merge_cols(s) + 1) * 4;
    most = b > most ? b : most;
  }
  return most;
}
/// The output columns a consumer computes unless its instance says otherwise: the seesaw and
/// swap AB the 512 latent columns (what MLAAttention up-projects), split-S all 576 (the
/// generic contract: 512..575 = P k_pe).
constexpr int default_out_cols(Consumer c) {
  return c == Consumer::kSeesaw || is_swap_ab(c) ? kLatent : kEntry;
}

/// Byte offsets of the dynamic shared memory (after aligning the base to 1024 bytes).
struct Layout {
  int q_panel = kBlockM * 128;   ///< one Q panel: block_m_for() rows x 128 B
  int kv_panel = kBlockN * 128;  ///< one K/V panel: 64 keys x 128 B
  int q_offset = 0;              ///< Q [9 panels][block m rows][64 cols] 16-bit, swizzled
  int stage_offset = 0;          ///< [stages] 16-bit K/V tiles [9 panels][64 keys][64 cols]
  int stage_bytes = 0;
  int raw_offset = 0;  ///< fp8 only: [ring][64 keys][576] bytes as copied (natural order): own
                       ///< slots after the stages, or the back half of each stage (in place)
  int raw_bytes = 0;
  int raw_stride = 0;    ///< bytes from one raw tile to the next (raw_bytes, or stage_bytes)
  int table_offset = 0;  ///< [2][64] int64 byte offsets of a tile's rows (producer)
  int p_offset = 0;      ///< split-S, seesaw: P [64 rows][64 keys] 16-bit, one swizzled panel
                         ///< (swap AB: P^T [16 or 32 rows][64 keys]; 32 over a 16-bit
                         ///< cache: two such buffers)
  int xchg_offset = 0;   ///< split-S, seesaw: [2 warpgroups][64 rows] float row maxima / sums;
                         ///< swap AB: swap_xchg_for()
  int bar_offset = 0;    ///< mbarriers: q_full, full[ring][halves], empty[ring][halves]
  int total = 0;         ///< including 1024 bytes to align the dynamic base
};

/// fp8, split-S: the raw tile lands in the back half of the 16-bit stage it is widened into
/// (the consumers load all of it into registers, sync, then store the widened panels over it), so
/// two 16-bit stages fit beside the 72 KB Q and tile j + 1 is widened while tile j's P V runs,
/// at the cost of one raw tile in flight (the copy of tile j + 2 waits for tile j's P V).
constexpr bool raw_in_stage_for(KVKind kv, Consumer c) {
  return kv == KVKind::kFp8 && c == Consumer::kSplitS;
}
/// fp8, swap AB (16 and 32 rows): no 16-bit stage at all. The consumers build their wgmma A
/// fragments (K for S^T, V^T for O^T) from the raw tile in registers (consume_swap_ab.cuh), so
/// the ring is five raw slots with 16 rows (Q 18 KB + 5 x 36 KB), four with 32 (Q 36 KB + 4 x
/// 36 KB + 8 KB of partial sums): that many tiles in flight instead of one, and no widened tile
/// written to and read back from shared memory. The raw rows are stored with chunk q of key r at
/// q ^ (r & 2) (raw_chunk_swizzle): both fragment loads are then free of bank conflicts.
constexpr bool frags_from_raw_for(KVKind kv, Consumer c) {
  return kv == KVKind::kFp8 && is_swap_ab(c);
}
/// Swap AB splits S^T's 36 k steps between the warpgroups (18 each, partial sums exchanged) with
/// 16 rows, and with 32 rows over fp8 (72 K-fragment registers a thread, not 144); 32-row CTAs
/// over a 16-bit cache split S^T's rows instead (16 each, no partial sums).
constexpr bool swap_split_k_for(KVKind kv, Consumer c) {
  return c == Consumer::kSwapAB || (c == Consumer::kSwapAB32 && frags_from_raw_for(kv, c));
}
/// The XOR applied to a raw fp8 row's 16-byte chunk index (frags_from_raw_for only).
constexpr int raw_chunk_swizzle(int key) {
  return key & 2;
}
/// frags_fp8.cuh's orders. The logical S^T-fragment position (0..63 inside a 64-column group) of
/// entry column `col` of that group, where Q's shared copy holds it: column 16 t + 4 ks + 2 h + e
/// is k step ks's fragment half h, quad lane t, element e.
constexpr int q_column(int col) {
  const int t = col >> 4, ks = (col >> 2) & 3, h = (col >> 1) & 1, e = col & 1;
  return 16 * ks + 8 * h + 2 * t + e;
}
/// The logical O^T k position (P^T's column) of the tile's key `key` = 16 kk + 4 j + t.
constexpr int p_column(int key) {
  const int kk = key >> 4, j = (key >> 2) & 3, t = key & 3;
  return 16 * kk + 8 * (j >> 1) + 2 * t + (j & 1);
}
/// The latent column of warpgroup `cw`'s O^T accumulator row: m tile n, warp w, lane group g,
/// half h8 (row 16 w + g + 8 h8 of m tile n).
constexpr int o_column(int cw, int n, int w, int g, int h8) {
  return 256 * cw + 64 * w + 8 * g + 2 * n + h8;
}
/// 16-bit cache: two 16-bit stages (Q 72 KB + 2 x 72 KB = 216 KB). fp8: split-S the same two
/// stages with the raw tiles in place (raw_in_stage_for); swap AB no stage, five raw slots (16
/// rows) or four (32 rows; frags_from_raw_for).
constexpr int stages_for(KVKind kv, Consumer c) {
  return frags_from_raw_for(kv, c) ? 0 : 2;
}
constexpr int raw_slots_for(KVKind kv, Consumer c) {
  return frags_from_raw_for(kv, c) ? (c == Consumer::kSwapAB ? 5 : 4) : 0;
}
/// The ring the producer fills and the `full` / `empty` barriers count: the 16-bit stages (also
/// fp8 in place), or for fp8 the raw slots (the consumers widen a slot into a stage themselves:
/// with the producer's 4 warps widening, 80 of the 247 us at h16 b64 c8192 were the
/// widening in series with the consumers, whose chain alone took 166).
constexpr int ring_for(KVKind kv, Consumer c) {
  return kv == KVKind::kSame || raw_in_stage_for(kv, c) ? stages_for(kv, c) : raw_slots_for(kv, c);
}

/// A stage's barriers per part: the seesaw frees and refills each half of a stage on its own
/// (panels 0-3: warpgroup 0's P V; 4-8: warpgroup 1's, of which 8 only S reads), so the next tile's
/// first half lands while the current tile's second half is still read. Everything else: the whole
/// stage.
constexpr int halves_for(Consumer c) {
  return c == Consumer::kSeesaw ? 2 : 1;
}
/// First panel of the seesaw's second half.
inline constexpr int kHalfPanel = 4;

/// Swap AB's exchange area, byte offsets from Layout::xchg_offset: the partial S^T [2][128
/// threads][8] floats (swap_split_k_for: with 16 rows each thread's 8 sums, with 32 its 8 of the
/// other warpgroup's rows), the row values [2][4 warps][16], with 32 rows the rescales [2 tiles]
/// [2][16] and row sums [2][16], then (fp8) the Q row scales [rows] (frags_fp8.cuh q_to_f16).
struct SwapXchg {
  int red = 0, cx = 0, ls = 0, row_scale = 0, bytes = 0;
};
constexpr SwapXchg swap_xchg_for(KVKind kv, Consumer c) {
  const bool rows32 = c == Consumer::kSwapAB32;
  SwapXchg x;
  x.red = swap_split_k_for(kv, c) ? 2 * 128 * 8 * 4 : 0;
  x.cx = x.red + 2 * 4 * 16 * 4;
  x.ls = x.cx + (rows32 ? 2 * 2 * 16 * 4 : 0);
  x.row_scale = x.ls + (rows32 ? 2 * 16 * 4 : 0);
  x.bytes = x.row_scale + (frags_from_raw_for(kv, c) ? block_m_for(c) * 4 : 0);
  return x;
}

constexpr Layout layout_for(KVKind kv, Consumer c) {
  const bool swap32 = c == Consumer::kSwapAB32;
  Layout s;
  s.q_panel = block_m_for(c) * 128;
  s.q_offset = 0;
  s.stage_offset = kPanels * s.q_panel;  // 9 x 2 KB keeps swap AB's stages 1024-aligned
  s.stage_bytes = kPanels * s.kv_panel;
  s.raw_bytes = kv == KVKind::kFp8 ? kBlockN * kEntry : 0;
  const int stages_end = s.stage_offset + stages_for(kv, c) * s.stage_bytes;
  s.raw_offset =
      raw_in_stage_for(kv, c) ? s.stage_offset + s.stage_bytes - s.raw_bytes : stages_end;
  s.raw_stride = raw_in_stage_for(kv, c) ? s.stage_bytes : s.raw_bytes;
  // P stays 1024-aligned: 2 raw tiles or 2 stages leave the running offset a multiple of 8 KB.
  s.p_offset = stages_end + raw_slots_for(kv, c) * s.raw_bytes;
  // 32 rows over a 16-bit cache: P^T in two buffers (a warpgroup may still read tile j - 1's).
  const int p_bufs = swap32 && !frags_from_raw_for(kv, c) ? 2 : 1;
  s.table_offset = s.p_offset + p_bufs * block_m_for(c) * 128;
  s.xchg_offset = s.table_offset + 2 * kBlockN * 8;
  s.bar_offset = s.xchg_offset + (is_swap_ab(c) ? swap_xchg_for(kv, c).bytes : 2 * kBlockM * 4);
  s.total = s.bar_offset + (1 + 2 * ring_for(kv, c) * halves_for(c)) * 8 + 1024;
  return s;
}

/// One compiled MLA kernel. kC = kSplitS (the default for fp8 caches and up to 64 heads): each
/// consumer warpgroup computes S for 32 of the 64 keys, the row maxima and P go through shared
/// memory, and both run P V over the whole tile from there, so S is computed once (FlashMLA's
/// division). kSeesaw (the default for 16-bit caches above 64 heads, see default_consumer()):
/// FlashMLA's schedule; kSwapAB / kSwapAB32: auto's kernels for steps of few rows a request
/// (mla_for_step); see kernel.cuh.
template <DType kAct, KVKind kKV, Consumer kC, int kOutColsT = default_out_cols(kC)>
struct Traits {
  static constexpr DType act = kAct;
  static constexpr KVKind kv = kKV;
  static constexpr Consumer consumer = kC;
  static_assert(kAct == DType::kF16 || kAct == DType::kBF16);
  static_assert(kC != Consumer::kAuto, "find_mla() resolves kAuto");
  static_assert(kC != Consumer::kSeesaw || kKV == KVKind::kSame, "the seesaw needs two stages");
  static constexpr int kStages = stages_for(kKV, kC);
  static constexpr int kRawSlots = raw_slots_for(kKV, kC);
  static constexpr bool kRawInStage = raw_in_stage_for(kKV, kC);
  static constexpr bool kFragsFromRaw = frags_from_raw_for(kKV, kC);
  static constexpr int kRing = ring_for(kKV, kC);
  static constexpr int kHalves = halves_for(kC);
  static constexpr int kBlockM = block_m_for(kC);
  static constexpr int kCacheBytes = kKV == KVKind::kSame ? 2 : 1;
  /// Output columns computed: 512 leaves out P k_pe (the seesaw: 1/9 of its P V work, and
  /// warpgroup 1's half of O no longer larger than warpgroup 0's; split-S: both warpgroups
  /// computed all 64, a fifth of each one's P V), 576 computes it.
  static constexpr int kOutCols = kOutColsT;
  static_assert(kOutCols == kEntry || kOutCols == kLatent);
  static_assert(kOutCols == kLatent || default_out_cols(kC) == kEntry,
                "the seesaw and swap AB compute the 512 latent columns only");
  /// The splits of a (request, M tile) can merge inside a cluster (cluster_merge.cuh: the 512
  /// latent columns, in the freed K/V stages).
  static constexpr bool kClusterMerge =
      kOutCols == kLatent && (is_swap_ab(kC) || kC == Consumer::kSplitS);
  /// Warpgroup 0 produces; warpgroups 1 and 2 consume (the division above).
  static constexpr int kThreads = 384;
  /// setmaxnreg budgets: 128 x 24 + 256 x 240 = 64512 <= 65536 registers.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr Layout layout() { return layout_for(kKV, kC); }
  static_assert(layout().total <= kMaxSmemPerCta);
  static_assert(layout().p_offset % 1024 == 0, "P is a swizzled wgmma operand");
  static_assert(!kClusterMerge || merge_bytes(kBlockM) <= layout().p_offset - layout().stage_offset,
                "the cluster merge lands in the K/V stages (and fp8's raw slots after them)");
};

}  // namespace pagedattn::cuda::mla
