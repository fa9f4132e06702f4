// The MLA decode kernel's producer warpgroup: Q once, then every K tile of the split into the
// ring (16-bit caches into the stages by TMA boxes or cp.async, fp8 caches raw into the slots
// that the consumers widen or read their fragments from). See kernel.cuh's map.
#pragma once

#include <cstdint>
#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/bulk_copy.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"

namespace pagedattn::cuda::mla {

template <class T>
__device__ __forceinline__ void produce(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kRing, T::kHalves> bars, int n_tiles) {
  constexpr int kStages = T::kStages;
  constexpr int kQChunks = kEntry / 8;                      // 72 chunks of 16 bytes per Q row
  constexpr int kRowChunks = kEntry * T::kCacheBytes / 16;  // 72 (16-bit) or 36 (fp8) per key
  constexpr bool kFp8 = T::kv == KVKind::kFp8;
  constexpr Layout lay = T::layout();
  sm90::setmaxnreg_dec<T::kProducerRegs>();
  const int ct = int(threadIdx.x);

  // Q: packed row i -> token (row0 + i) / N, head (row0 + i) % N; zeros past the rows.
  const uint32_t q_smem = sm80::smem_addr(smem + lay.q_offset);
  for (int c = ct; c < T::kBlockM * kQChunks; c += 128) {
    const int row = c / kQChunks, col = c - row * kQChunks;
    const char* src = static_cast<const char*>(p.q);
    int bytes = 0;
    if (row < w.num_rows) {
      const int pr = w.row0 + row;
      const int tok = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
      src += (int64_t(tok) * p.q_stride_token + int64_t(head) * p.q_stride_head) * 2;
      bytes = 16;
    }
    const uint32_t dst = q_smem + (col >> 3) * lay.q_panel + sm90::sw128_offset(row, col & 7);
    if constexpr (T::kFragsFromRaw) {
      // The columns in the order of the consumers' K fragments (config.h q_column):
      // chunk m of 64-column group G holds columns 64 G + 16 t + 2 m + {0, 1},
      // t = 0..3, four 4-byte pieces.
      const int m8 = col & 7, group = col >> 3;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int at = bytes ? (64 * group + 16 * t + 2 * m8) * 2 : 0;  // zeros: read nothing
        sm80::cp_async_4(dst + 4 * t, src + at, bytes / 4);
      }
    } else {
      sm80::cp_async_16(dst, src + (bytes ? col * 16 : 0), bytes, 0);
    }
  }
  ptx::cp_async_mbarrier_arrive_noinc(bars.q_full());

  const int64_t sb = p.kv_stride_block * T::kCacheBytes, sp = p.kv_stride_page * T::kCacheBytes;
  const char* const cache = static_cast<const char*>(p.kv);
  const int bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  const int32_t* const bt_row = p.block_table + int64_t(w.r) * p.block_table_stride_seq;
  int64_t* const tables = reinterpret_cast<int64_t*>(smem + lay.table_offset);

  // Row byte offsets of a tile, in two steps so that the block-table read of tile j + 1 is in
  // flight while tile j's copies are issued (ncu: the producer, not the consumers, set the
  // pace, with that dependent global load on its path every tile). Rows past the split read
  // the split's last key (finite bytes whose scores are masked and whose P is 0), so the
  // copies need no zero-fill predicate.
  // A row is kept as {block id, row in block} (high and low 32 bits): the TMA path needs the
  // pair, the cp.async path its byte offset (row_bytes).
  auto lookup = [&](int j) -> int64_t {
    if (ct >= kBlockN || j >= n_tiles) return 0;
    const int pos = min(w.kv_begin + j * kBlockN + ct, w.kv_end - 1);
    const int lb = bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size;
    const int in_block = pos - lb * p.block_size;
    return int64_t(uint64_t(uint32_t(bt_row[int64_t(lb) * p.block_table_stride_block])) << 32 |
                   uint32_t(in_block));
  };
  auto row_bytes = [&](int64_t row) {
    return int64_t(uint32_t(uint64_t(row) >> 32)) * sb + int64_t(uint32_t(row)) * sp;
  };
  // Slot j % 2; the barrier also tells every thread that tile j - 1's copies, which read the
  // other slot, are issued before that slot is rewritten.
  auto publish = [&](int j, int64_t off) {
    int64_t* const table = tables + (j & 1) * kBlockN;
    if (ct < kBlockN) table[ct] = off;
    sm90::named_barrier_sync(1, 128);
    return static_cast<const int64_t*>(table);
  };
  // Thread ct copies chunks l + kLanes k (k < kPer) of rows ct / kLanes + kRowsPerPass i: its
  // column pattern and swizzle stay fixed, so a chunk is one copy with immediate offsets (the
  // per-chunk division and table read were most of the producer's instructions).
  constexpr int kLanes = kFp8 ? 4 : 8;  // 16-bit: chunk l + 8 k is panel k, column chunk l
  constexpr int kPer = kRowChunks / kLanes;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kPer * kLanes == kRowChunks && kBlockN % kRowsPerPass == 0);
  const int lane_col = ct % kLanes, lane_row = ct / kLanes;
  // This thread's copies of a tile whose rows `table` holds: chunk k of pass i lands at
  // dst + k * chunk_step + i * pass_step (the swizzled panels, or the fp8 natural order).
  // Chunks k in [k0, k1) of every row: the 16-bit panels of one half (seesaw) or all.
  auto copy_rows = [&](const int64_t* table, uint32_t dst, int chunk_step, int pass_step, auto k0,
                       auto k1) {
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const char* const src = cache + row_bytes(table[lane_row + kRowsPerPass * i]) + lane_col * 16;
#pragma unroll
      for (int k = decltype(k0)::value; k < decltype(k1)::value; ++k) {
        sm80::cp_async_16(dst + k * chunk_step + i * pass_step, src + k * kLanes * 16, 16, 0);
      }
    }
  };

  int64_t next_off = lookup(0);
  if constexpr (!kFp8) {
    const uint32_t chunk_at = uint32_t(((lane_col ^ (lane_row & 7)) << 4) + lane_row * 128);
    // TMA (p.kv_tma): thread 0 brings a whole tile as one box per panel (the tile lies in one
    // block: block sizes that are multiples of kBlockN; smaller blocks took a box per block and
    // panel from one thread, 6% slower than cp.async at block size 16), the others only
    // arrive; the split's last, partial tile still goes by cp.async (its rows past the split
    // read the last key, which a box cannot do).
    // A request's lines are read by its M-tile CTAs and then never again: marked evict-first
    // (0.5-1.6% faster at 16 and 128 heads; FlashMLA marks its K loads the same way).
    const uint64_t evict_first = sm80::l2_evict_first_policy();
    using P0 = std::integral_constant<int, 0>;
    using PH = std::integral_constant<int, T::kHalves == 2 ? kHalfPanel : kPanels>;
    using P9 = std::integral_constant<int, kPanels>;
    for (int j = 0; j < n_tiles; ++j) {
      const int s = j % kStages;
      const int64_t* table = publish(j, next_off);
      next_off = lookup(j + 1);
      unsigned char* const stage = smem + lay.stage_offset + s * lay.stage_bytes;
      const bool tma = p.kv_tma && w.kv_begin + (j + 1) * kBlockN <= w.kv_end;
      // Half h = panels [k0, k1) of the tile: wait until its readers freed it, then bring it.
      // The seesaw's owner of tile j (warpgroup j % 2) frees its half of tile j - 2 first.
      auto bring = [&](int h, auto k0, auto k1) {
        constexpr int kFirst = decltype(k0)::value, kEnd = decltype(k1)::value;
        mbar_wait(bars.empty(s, h), ((j / kStages) & 1) ^ 1);  // tile j - kStages released
        if (tma) {
          if (ct == 0) {
            ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                           bars.full(s, h),
                                           uint32_t(kBlockN * (kEnd - kFirst) * 128));
            const uint64_t row = uint64_t(table[0]);
            const int32_t block = int32_t(row >> 32), in_block = int32_t(uint32_t(row));
#pragma unroll
            for (int k = kFirst; k < kEnd; ++k) {
              const int32_t at[3] = {64 * k, in_block, block};
              sm90::tma_load_3d_hint(stage + k * lay.kv_panel, &p.kv_map, at, bars.full(s, h),
                                     evict_first);
            }
          } else {
            ptx::mbarrier_arrive(bars.full(s, h));
          }
        } else {
          copy_rows(table, sm80::smem_addr(stage) + chunk_at, lay.kv_panel, kRowsPerPass * 128, k0,
                    k1);
          ptx::cp_async_mbarrier_arrive_noinc(bars.full(s, h));
        }
      };
      if constexpr (T::kHalves == 1) {
        bring(0, P0{}, P9{});
      } else if ((j & 1) == 0) {
        bring(0, P0{}, PH{});
        bring(1, PH{}, P9{});
      } else {
        bring(1, PH{}, P9{});
        bring(0, P0{}, PH{});
      }
    }
    sm80::cp_async_wait<0>();  // nothing in flight when the warpgroup exits
  } else {
    // Raw fp8 rows (576 bytes, 36 chunks) into slot j % kRing in natural order (its own slot,
    // or the back half of stage j % kRing: T::kRawInStage), once the consumers are done with the
    // slot's previous tile (widen.cuh: they widen it; in place, its P V read it).
    constexpr int kSlots = T::kRing;
    for (int j = 0; j < n_tiles; ++j) {
      const int slot = j % kSlots;
      mbar_wait(bars.empty(slot), ((j / kSlots) & 1) ^ 1);
      const int64_t* table = publish(j, next_off);
      next_off = lookup(j + 1);
      // Chunk q of key r lands at q ^ raw_chunk_swizzle(r) where the consumers load fragments
      // from the raw tile (r's bit 1 is lane_row's: rows step by 32).
      const int chunk = T::kFragsFromRaw ? lane_col ^ raw_chunk_swizzle(lane_row) : lane_col;
      const uint32_t raw = sm80::smem_addr(smem + lay.raw_offset + slot * lay.raw_stride) +
                           lane_row * kEntry + chunk * 16;
      copy_rows(table, raw, kLanes * 16, kRowsPerPass * kEntry, std::integral_constant<int, 0>{},
                std::integral_constant<int, kPer>{});
      ptx::cp_async_mbarrier_arrive_noinc(bars.full(slot));
    }
    sm80::cp_async_wait<0>();  // Q's copies too, when there was no tile
  }
}

}  // namespace pagedattn::cuda::mla
