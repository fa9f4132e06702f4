// The Hopper prefill kernel's producer warpgroup: each work tile's Q, then its K/V tiles into the
// stage ring (TMA boxes or cp.async gathers; the fp8 loops in produce_fp8.cuh). See
// kernel.cuh's map.
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/sm90/common.cuh"
#include "cuda/prefill/sm90/produce_fp8.cuh"

namespace pagedattn::cuda::prefill {

// fp8 products: Q row `row`, 16 e4m3 codes of columns 16 col .. 16 col + 15 from the quantised
// query (activation dtype, every value an e4m3 value: the narrowing is exact), zeros past the
// rows, into the 128-byte-swizzled Q panel.
template <DType kAct>
__device__ __forceinline__ void copy_q_chunk_e4m3(const AttnParams& p, const attn::Work& w, int row,
                                                  int col, unsigned char* panel) {
  uint4 codes = make_uint4(0, 0, 0, 0);
  if (row < w.num_rows && col * 16 < p.head_size) {
    const int pr = w.row0 + row;
    const int head = w.kv_head * p.group + pr % p.group;
    const uint4* src = reinterpret_cast<const uint4*>(
        static_cast<const char*>(p.q) + ((int64_t(w.q_begin) + pr / p.group) * p.q_stride_token +
                                         int64_t(head) * p.q_stride_head + col * 16) *
                                            kElemBytes<kAct>);
    const uint4 lo = src[0], hi = src[1];
    const uint32_t in[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 a = unpack2<kAct>(in[2 * k]), b = unpack2<kAct>(in[2 * k + 1]);
      out[k] = uint32_t(__nv_cvt_float2_to_fp8x2(a, __NV_SATFINITE, __NV_E4M3)) |
               uint32_t(__nv_cvt_float2_to_fp8x2(b, __NV_SATFINITE, __NV_E4M3)) << 16;
    }
    codes = make_uint4(out[0], out[1], out[2], out[3]);
  }
  *reinterpret_cast<uint4*>(panel + sm90::sw128_offset(row, col)) = codes;
}

// bf16 Q over a widened fp8 cache (T::kQRescale): producer thread `row` scales Q row `row` of
// the swizzled panels in place into f16 by 2^k (attn::q_row_shift: its largest |q| into
// [2^14, 2^15); exact for every element down to 2^-28 of it) and leaves 2^-k in undo[row] for
// the consumers' softmax. Lanes take consecutive rows, whose swizzle puts the same chunk of 8
// rows in 8 different 16-byte bank groups.
template <class T>
__device__ __forceinline__ void rescale_q_row(unsigned char* q_smem, float* undo, int row) {
  static_assert(T::kBlockM == 128, "one producer thread per row");
  constexpr int kChunks = T::head_size / 8;
  constexpr int kQPanel = T::layout().q_panel;
  auto chunk = [&](int col) {
    return reinterpret_cast<uint4*>(q_smem + (col >> 3) * kQPanel +
                                    sm90::sw128_offset(row, col & 7));
  };
  uint32_t max_bits = 0;
#pragma unroll 4
  for (int col = 0; col < kChunks; ++col) {
    max_bits = max(max_bits, attn::bf16x8_abs_max_bits(*chunk(col)));
  }
  const int k = attn::q_row_shift(max_bits);
  const float up = attn::pow2f(k);
#pragma unroll 4
  for (int col = 0; col < kChunks; ++col) {
    uint4 v = *chunk(col);
    v.x = attn::bf16x2_to_f16x2(v.x, up);
    v.y = attn::bf16x2_to_f16x2(v.y, up);
    v.z = attn::bf16x2_to_f16x2(v.z, up);
    v.w = attn::bf16x2_to_f16x2(v.w, up);
    *chunk(col) = v;
  }
  undo[row] = attn::pow2f(-k);
}

template <class T>
__device__ __forceinline__ void produce(const AttnParams& p, const attn::Work& w,
                                        unsigned char* smem, Barriers<T::kStages> bars, int n_tiles,
                                        const TileSeq& seq) {
  constexpr int D = T::head_size, kBlockN = T::kBlockN, kBlockM = T::kBlockM;
  constexpr int kStages = T::kStages, kChunks = D / 8;
  constexpr Sm90Layout lay = T::layout();
  const int ct = int(threadIdx.x);
  const int it0 = seq.it;
  const int qb = q_buffer<T>(seq.k);
  unsigned char* const q_smem = smem + lay.q_offset + qb * lay.q_bytes;
  if (ct == 0 && dynamic_walk<T>(p, work_tiles(p))) {
    publish_tile<T>(smem, bars, seq.k, 1, &w, 1);
  }
  // Q: packed row r -> token r / G, head kv_head * G + r % G. The copying threads first wait
  // until the consumers are done reading the Q of the work tile that last used this buffer
  // (the first use passes at once).
  // The 16-bit Q rows by cp.async (or 16-bit loads), once the buffer is free.
  auto copy_q = [&] {
    mbar_wait(bars.q_empty(qb), q_parity<T>(seq.k) ^ 1);
    for (int c = ct; c < kBlockM * kChunks; c += 128) {
      const int row = c / kChunks, col = c - row * kChunks;
      copy_q_chunk<T::act>(p, w, row, col,
                           q_smem + (col >> 3) * lay.q_panel + sm90::sw128_offset(row, col & 7));
    }
  };
  if constexpr (T::kFp8Math) {
    mbar_wait(bars.q_empty(qb), q_parity<T>(seq.k) ^ 1);
    constexpr int kQChunks = D / 16;
    for (int c = ct; c < kBlockM * kQChunks; c += 128) {
      const int row = c / kQChunks;
      copy_q_chunk_e4m3<T::act>(p, w, row, c - row * kQChunks, q_smem);
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
    ptx::mbarrier_arrive(bars.q_full(qb));
  } else if constexpr (T::kQRescale) {
    copy_q();
    sm80::cp_async_commit();           // wait_group covers committed copies only
    sm80::cp_async_wait<0>();          // this thread's chunks landed (K/V's are all done)
    sm90::named_barrier_sync(1, 128);  // ... and every producer thread's
    rescale_q_row<T>(q_smem, reinterpret_cast<float*>(smem + lay.q_undo_offset) + qb * kBlockM, ct);
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
    ptx::mbarrier_arrive(bars.q_full(qb));
  } else {
    if (kQTma<T> && p.q_tma) {
      // One box per panel: {64 columns, G heads, kBlockM / G tokens} is the work tile's packed
      // rows in order. Rows past the request are the next request's (or zeros past the
      // tensor): each row of S, P and O depends on its own Q row only, and store_rows skips
      // them. One thread, so Q costs the producer nothing: its cp.async copy (an integer
      // division by G per chunk) came late enough that the consumers' wait for Q was 3.5% of
      // all warp samples [ncu, d128 4k, f376772].
      if (ct == 0) {
        mbar_wait(bars.q_empty(qb), q_parity<T>(seq.k) ^ 1);
        ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                       bars.q_full(qb), uint32_t(T::kPanels * lay.q_panel));
        const int32_t head = w.kv_head * p.group, token = w.q_begin + w.row0 / p.group;
#pragma unroll
        for (int k = 0; k < T::kPanels; ++k) {
          const int32_t c3[3] = {64 * k, head, token};
          ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, q_smem + k * lay.q_panel,
                                    &p.q_map, c3, bars.q_full(qb));
        }
      }
    } else {
      copy_q();
      ptx::cp_async_mbarrier_arrive_noinc(bars.q_full(qb));
    }
  }

  const KvRows kv(p, w, T::kKvBytes);
  const char* const k_head = kv.k_head;
  const char* const v_head = kv.v_head;
  // Tile j's rows' byte offsets {K, V} into table slot j % kTableSlots, then a barrier of the
  // producer warpgroup. Rows past the split read the split's last key instead (its bytes are
  // finite: its scores are masked and its P is 0), so the copies need no zero-fill predicate.
  // kStages + 1 slots: the V copies of tile j read slot j while tile j + 1's K is already
  // issued, and only the barrier of tile j + 2's fill stands between them and slot j's reuse.
  // The slots follow the CTA's whole stream of tiles (it0 + j), which fills every tile in
  // order, so the same holds from one work tile to the next.
  auto fill_table = [&](int j) {
    int64_t* const table = reinterpret_cast<int64_t*>(smem + lay.table_offset) +
                           ((it0 + j) % T::kTableSlots) * 2 * kBlockN;
    if (ct < kBlockN) {
      const int pos = min(w.kv_begin + j * kBlockN + ct, w.kv_end - 1);
      int64_t k_off, v_off;
      kv.offsets(p, w, pos, k_off, v_off);
      table[2 * ct] = k_off;
      table[2 * ct + 1] = v_off;
    }
    sm90::named_barrier_sync(1, 128);
    return table;
  };
  if constexpr (T::kFp8Math) {
    produce_fp8_math<T>(p, smem, bars, n_tiles, it0, k_head, v_head, fill_table);
    return;
  } else if constexpr (T::kv == KVKind::kFp8) {
    produce_fp8<T>(p, smem, bars, n_tiles, it0, k_head, v_head, fill_table);
    return;
  }
  // 16-bit caches: warps 0-1 bring the K tiles and warps 2-3 the V tiles, each half on its own
  // loop, so a V tile goes out as soon as its stage is free. With one loop (K_{j+1}, then V_j)
  // V waited behind K's `empty` barrier, i.e. for the slower consumer warpgroup's S; ncu
  // [d128 16k, commit 605847d]: the consumers' poll of V's `full` 15% of the samples and the
  // producer's poll of K's `empty` 12%.
  static_assert(2 + T::kConsumers <= 4, "named barriers 4 / 5 follow the consumers' turns");
  const bool v_half = ct >= 64;
  const int ht = ct & 63;
  const int pick = v_half ? 1 : 0;
  const char* const head = v_half ? v_head : k_head;
  // Thread ht copies chunk column ht % kLanes of rows ht / kLanes + i * kRowsPerPass: its
  // column, panel and (for passes of 8 or 16 rows) swizzle stay fixed, so a chunk costs one
  // table read, one add and the copy (the per-chunk index math was most of the producer's
  // ALU work: ncu showed the ALU pipe as the busiest at 36%). Head sizes whose chunk count is
  // not a power of two (80, 96, 192) give each row the next power of two of lanes and leave
  // the extra lanes idle.
  constexpr int kLanes = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = 64 / kLanes;
  static_assert(kChunks <= kLanes && kBlockN % kRowsPerPass == 0);
  const int col = ht % kLanes, r0 = ht / kLanes;
  const bool copies = col < kChunks;
  const uint32_t col_at = (col >> 3) * lay.kv_panel;
  const RowChunk chunk = row_chunk(v_half ? p.v_head_size : p.head_size, col, 2);
  // This half's offsets (K's or V's) of tile j into table slot j % kTableSlots, then a barrier
  // of the half (named barrier 4 or 5). Rows past the split read the split's last key instead
  // (its bytes are finite: its scores are masked and its P is 0), so the copies need no
  // zero-fill predicate. Each half reads only what it wrote. Tile g of the CTA's stream
  // (it0 + j) reuses the slot of tile g - kTableSlots or earlier, whose copies every thread
  // of the half issued (reading the slot) before arriving on that tile's `full`; the fill of
  // tile g comes after the wait for tile g - 1's stage, i.e. for the consumers' release of
  // tile g - 1 - kStages >= g - kTableSlots, which needs those arrivals. So no barrier is
  // needed before the writes, even where TMA tiles (no fill) stand between.
  auto fill_half = [&](int j) {
    int64_t* const table = reinterpret_cast<int64_t*>(smem + lay.table_offset) +
                           ((it0 + j) % T::kTableSlots) * 2 * kBlockN;
    for (int row = ht; row < kBlockN; row += 64) {
      const int pos = min(w.kv_begin + j * kBlockN + row, w.kv_end - 1);
      int64_t k_off, v_off;
      kv.offsets(p, w, pos, k_off, v_off);
      table[2 * row + pick] = v_half ? v_off : k_off;
    }
    sm90::named_barrier_sync(4 + pick, 64);
    return table;
  };
  auto copy_tile = [&](unsigned char* dst, const int64_t* table) {
    if (!copies) return;
    const uint32_t dst0 = sm80::smem_addr(dst) + col_at;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int row = r0 + i * kRowsPerPass;
      sm80::cp_async_16(dst0 + sm90::sw128_offset(row, col & 7),
                        head + table[2 * row + pick] + chunk.offset, chunk.bytes, 0);
    }
  };
  // TMA (p.kv_tma, 16-bit caches at head sizes that are multiples of 64): a full tile whose
  // boxes of kv_tma_rows rows each stay inside one block comes as one box per block and panel,
  // issued by the lanes of the half's first warp (lane b: the tile's rows b * box .. b * box +
  // box - 1); lane 0 arrives with the tile's byte count, the half's other threads plainly, so
  // the `full` barriers keep their 64 arrivals whichever way a tile comes. A split's partial
  // last tile still goes by cp.async (a box would read rows past the split, whose bytes may be
  // NaN; cp.async reads the last key again).
  constexpr bool kTmaCapable = kTmaTiles<T>;
  const int box = p.kv_tma_rows;
  const int n_tma = tma_tiles<T>(p, w);
  auto by_tma = [&](int j) { return j < n_tma; };
  // Lane b's box of tile j: {row coordinate, block coordinate} (kv_direct: token row, 0).
  auto box_at = [&](int j) {
    int2 at = make_int2(0, 0);
    if (ht < kBlockN / box) {
      const int pos = w.kv_begin + j * kBlockN + ht * box;
      if (p.kv_direct) {
        at.x = w.q_begin + pos;
      } else {
        const int lb = kv.bs_shift >= 0 ? pos >> kv.bs_shift : pos / p.block_size;
        at.x = pos - lb * p.block_size;
        at.y = kv.bt_row[int64_t(lb) * p.block_table_stride_block];
      }
    }
    return at;
  };
  auto tma_tile = [&](uint64_t* full, unsigned char* dst, int2 at) {
    if (ht == 0) {
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, full,
                                     uint32_t(kBlockN * D * 2));
    } else {
      ptx::mbarrier_arrive(full);
    }
    if constexpr (kTmaCapable) {
      if (ht < kBlockN / box) {
        const CUtensorMap* const map = v_half ? &p.v_map : &p.k_map;
        const int32_t kvh = w.kv_head;
#pragma unroll
        for (int k = 0; k < T::kPanels; ++k) {
          const int32_t c4[4] = {64 * k, p.kv_tma == 1 ? kvh : at.x, p.kv_tma == 1 ? at.x : kvh,
                                 at.y};
          ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global,
                                    dst + k * lay.kv_panel + ht * box * 128, map, c4, full);
        }
      }
    }
  };
  for (int j = 0; j < n_tiles; ++j) {
    const int s = (it0 + j) % kStages;
    const bool tma = by_tma(j);
    const int64_t* const table = tma ? nullptr : fill_half(j);
    const int2 at = tma ? box_at(j) : make_int2(0, 0);
    uint64_t* const empty = v_half ? bars.v_empty(s) : bars.k_empty(s);
    uint64_t* const full = v_half ? bars.v_full(s) : bars.k_full(s);
    mbar_wait(empty, (((it0 + j) / kStages) & 1) ^ 1);  // tile j - kStages released
    unsigned char* const dst =
        smem + lay.stage_offset + s * lay.stage_bytes + pick * T::kPanels * lay.kv_panel;
    if (tma) {
      tma_tile(full, dst, at);
    } else {
      copy_tile(dst, table);
      ptx::cp_async_mbarrier_arrive_noinc(full);
    }
  }
  sm80::cp_async_wait<0>();  // nothing in flight when the warpgroup exits
}

}  // namespace pagedattn::cuda::prefill
