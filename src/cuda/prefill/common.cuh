// What the two prefill kernels (portable/kernel.cuh, mma.sync; sm90/kernel.cuh, wgmma) share on
// the device: a CTA's work tile and the keys its rows see, where the K/V rows live, the Q
// chunk copy, and the rows out (sinks, output and LSE, or the split partials) from the mma
// accumulator layout both kernels' consumers hold. The maps are the kernels'.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/prefill/config.h"
#include "cuda/prefill/walk.h"

namespace pagedattn::cuda::prefill {

using attn::AttnParams;
using attn::ceil_div;
using attn::kLn2;
using attn::kLog2e;
using attn::ThreadRow;

// This thread's row `row` (CTA-local) as the mask and ALiBi see it; built only inside the
// branches that need it, so that no register holds it through the main loop.
__device__ __forceinline__ ThreadRow thread_row(const AttnParams& p, const attn::Work& w, int row) {
  if (row >= w.num_rows) return ThreadRow{0, 0, 0, 0.0f};  // padding row: every key masked
  const attn::RowRange rr = attn::row_range(p, w, row);
  ThreadRow t;
  t.lo = max(rr.lo, w.kv_begin);
  t.hi = min(rr.hi, w.kv_end);
  t.pos = rr.pos;
  const int head = w.kv_head * p.group + (w.row0 + row) % p.group;
  t.alibi2 = p.alibi_slopes != nullptr ? p.alibi_slopes[head] * kLog2e : 0.0f;
  return t;
}

// Where the keys of the CTA's request and KV head live, for both prefill kernels' producers:
// the K and V head bases and each key's row byte offsets from them (paged through the block
// table, or the query's own token rows when kv_direct).
struct KvRows {
  const char* k_head;
  const char* v_head;
  int64_t k_sb, k_sp, v_sb, v_sp;  // bytes per block and per in-block row
  const int32_t* bt_row;
  int bs_shift;  // log2(block_size) when a power of two, else -1
  __device__ __forceinline__ KvRows(const AttnParams& p, const attn::Work& w, int kv_bytes) {
    k_head = static_cast<const char*>(p.k) + int64_t(w.kv_head) * p.k_stride_head * kv_bytes;
    v_head = static_cast<const char*>(p.v) + int64_t(w.kv_head) * p.v_stride_head * kv_bytes;
    k_sb = p.k_stride_block * kv_bytes;
    k_sp = p.k_stride_page * kv_bytes;
    v_sb = p.v_stride_block * kv_bytes;
    v_sp = p.v_stride_page * kv_bytes;
    bt_row = p.block_table + int64_t(w.r) * p.block_table_stride_seq;
    bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  }
  // Key `pos` (< w.kv_end) of the request.
  __device__ __forceinline__ void offsets(const AttnParams& p, const attn::Work& w, int pos,
                                          int64_t& k_off, int64_t& v_off) const {
    if (p.kv_direct) {
      k_off = (int64_t(w.q_begin) + pos) * k_sb;
      v_off = (int64_t(w.q_begin) + pos) * v_sb;
    } else {
      const int lb = bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size;
      const int off = pos - lb * p.block_size;
      const int64_t block = bt_row[int64_t(lb) * p.block_table_stride_block];
      k_off = block * k_sb + off * k_sp;
      v_off = block * v_sb + off * v_sp;
    }
  }
};

// The CTA's request, KV head, rows and split of keys from its work tile (x: grid.x, groups of
// p.pair_group (request, KV head) pairs slowest, then the q tile, reversed so that the tiles
// with the most causal keys start first, then the pair; split: grid.y; the
// Hopper kernel passes the indices of each work tile it takes). False when the tile
// has no rows: a request of the decode kernel's (q_len * G <= route_rows) or a q tile past
// the request's query.
__device__ __forceinline__ bool prefill_work(const AttnParams& p, int block_m, int split_align,
                                             int x, int split, attn::Work& w) {
  const WalkIndex at = walk_index(x, p.num_seqs * p.num_kv_heads, p.pair_group, p.num_q_tiles);
  const int tile_rank = at.tile_rank;
  w.r = at.pair / p.num_kv_heads;
  w.kv_head = at.pair - w.r * p.num_kv_heads;
  w.q_begin = p.query_start_loc[w.r];
  w.q_len = p.query_start_loc[w.r + 1] - w.q_begin;
  w.kv_len = p.kv_direct ? w.q_len : p.seq_lens[w.r];
  w.row0 = (p.num_q_tiles - 1 - tile_rank) * block_m;
  const int rows_total = w.q_len * p.group;
  if (rows_total <= p.route_rows || w.row0 >= rows_total) return false;
  w.num_rows = min(block_m, rows_total - w.row0);
  const attn::RowRange first = attn::row_range(p, w, 0);
  const attn::RowRange last = attn::row_range(p, w, w.num_rows - 1);
  const int range_lo = first.lo, range_hi = max(last.hi, first.lo);
  const int chunk =
      ceil_div(ceil_div(range_hi - range_lo, p.num_splits), split_align) * split_align;
  w.kv_begin = min(range_lo + split * chunk, range_hi);
  w.kv_end = min(w.kv_begin + chunk, range_hi);
  w.split = split;
  return true;
}

// Chunk `col` (8 elements, 16 bytes) of packed query row `row` (CTA-local: token row / G, head
// kv_head * G + row % G) into shared memory at `dst`: by cp.async when the rows allow 16-byte
// copies (zeros past the rows), else by 16-bit loads and one 16-byte store.
template <DType kAct>
__device__ __forceinline__ void copy_q_chunk(const AttnParams& p, const attn::Work& w, int row,
                                             int col, unsigned char* dst) {
  const char* src = nullptr;
  if (row < w.num_rows && col * 8 < p.head_size) {  // zeros past the rows and the head size
    const int pr = w.row0 + row;
    const int head = w.kv_head * p.group + pr % p.group;
    src = static_cast<const char*>(p.q) + ((int64_t(w.q_begin) + pr / p.group) * p.q_stride_token +
                                           int64_t(head) * p.q_stride_head + col * 8) *
                                              kElemBytes<kAct>;
  }
  if (p.vec_q) {
    sm80::cp_async_16(sm80::smem_addr(dst), src != nullptr ? src : p.q, src != nullptr ? 16 : 0, 0);
    return;
  }
  uint4 raw = make_uint4(0, 0, 0, 0);
  if (src != nullptr) {
    uint16_t* r16 = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) r16[e] = reinterpret_cast<const uint16_t*>(src)[e];
  }
  *reinterpret_cast<uint4*>(dst) = raw;
}

// A 16-byte chunk `col` of a K/V row of `cols` elements (p.head_size for K, p.v_head_size for
// V) of kv_bytes each: its byte offset in the row and the bytes to copy (16, or 0 past the
// row: the chunk is zero-filled from the row's start). An instance of a larger head size than
// the problem's (its bucket) keeps zeros in the columns past it, so they add nothing to any
// score (K) and give output columns that are never stored (V).
struct RowChunk {
  int offset, bytes;
};
__device__ __forceinline__ RowChunk row_chunk(int cols, int col, int kv_bytes) {
  const bool in_row = col * 16 < cols * kv_bytes;
  return RowChunk{in_row ? col * 16 : 0, in_row ? 16 : 0};
}

// Keys that rows [row_first, row_last] (CTA-local) can see, clamped to the split: tiles
// outside [lo, hi) are skipped; tiles inside [mask_lo, mask_hi) need no mask.
struct RowsSpan {
  int lo = 0, hi = 0, mask_lo = 0, mask_hi = 0;
};
__device__ __forceinline__ RowsSpan rows_span(const AttnParams& p, const attn::Work& w,
                                              int row_first, int row_last) {
  const attn::RowRange a = attn::row_range(p, w, row_first);
  const attn::RowRange b = attn::row_range(p, w, row_last);
  return RowsSpan{max(a.lo, w.kv_begin), min(b.hi, w.kv_end), max(b.lo, w.kv_begin),
                  min(a.hi, w.kv_end)};
}

// A row's sink (spec 4.12): it joins the softmax's denominator only, so the row's log2-sum-exp
// lse2 takes it in and the output factor shrinks by the same ratio.
__device__ __forceinline__ void apply_sink(const AttnParams& p, int head, float& lse2,
                                           float& factor) {
  const float sink2 = p.sinks[head] * kLog2e;
  const float mx = fmaxf(lse2, sink2);
  const float total = mx + log2f(exp2f(lse2 - mx) + exp2f(sink2 - mx));
  factor *= exp2f(lse2 - total);
  lse2 = total;
}

// Rows row_a and row_a + 8 (CTA-local) of one m16 tile out: normalise, v scale, sinks; the
// output and LSE, or the split partials. o, m, l are this thread's accumulator fragment.
template <DType kAct, int kNt>
__device__ __forceinline__ void store_rows(const AttnParams& p, const attn::Work& w,
                                           const float (&o)[kNt][4], const float (&m)[2],
                                           const float (&l)[2], int row_a, int t4) {
  const int D = p.v_head_size;  // <= kNt * 8: the instance's columns past it are padding
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row_a + 8 * h;
    if (row >= w.num_rows) continue;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.group, head = w.kv_head * p.group + pr % p.group;
    float lse2 = sum > 0.0f ? m[h] + log2f(sum) : -INFINITY;
    float factor = sum > 0.0f ? attn::v_scale_of(p, w.kv_head) / sum : 0.0f;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(w.split) * p.num_actual_tokens + t) * p.num_heads + head;
      float* dst = p.partial_o + at * D + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        if (nt * 8 < D) {
          *reinterpret_cast<float2*>(dst + nt * 8) =
              make_float2(o[nt][2 * h] * factor, o[nt][2 * h + 1] * factor);
        }
      }
      if (t4 == 0) p.partial_lse[at] = lse2;
      continue;
    }
    if (p.sinks != nullptr) apply_sink(p, head, lse2, factor);
    char* out =
        static_cast<char*>(p.out) +
        (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * kElemBytes<kAct>;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      if (nt * 8 >= D) break;
      const float x0 = o[nt][2 * h] * factor, x1 = o[nt][2 * h + 1] * factor;
      const int col = nt * 8 + 2 * t4;
      if (p.vec_out) {
        *reinterpret_cast<uint32_t*>(out + col * 2) = pack2<kAct>(x0, x1);
      } else {
        store_from_float<kAct>(out, col, x0);
        store_from_float<kAct>(out, col + 1, x1);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      const int64_t at = int64_t(head) * p.lse_stride_head + int64_t(t) * p.lse_stride_token;
      if (p.lse_is_f64) {
        static_cast<double*>(p.lse)[at] = double(lse2 * kLn2);
      } else {
        static_cast<float*>(p.lse)[at] = lse2 * kLn2;
      }
    }
  }
}

}  // namespace pagedattn::cuda::prefill
