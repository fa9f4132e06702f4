// The decode kernel's per-warp K/V pipeline: the block-table lookups of a tile's rows and the
// copies of its K and V rows into the warp's stage ring, by 16-byte cp.async or by
// cp.async.bulk on mbarriers. The map is kernel.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/bulk_copy.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/decode/config.h"
#include "cuda/decode/cta.cuh"

namespace pagedattn::cuda::decode {

// Copy mapping: chunk c (16 bytes) of a tile's K (or V) rows, in row-major order, goes to
// lane c % 32, so one copy instruction covers whole rows (2 rows of 256 bytes at bf16 d128,
// 4 of 128 at fp8 d128): full 128-byte lines, the row's bytes requested together. (Two
// whole rows per lane, 64 bytes per row per instruction, read at 0.86 of the copy rate
// instead of 0.99: docs/kernels/decode.md.) Lane l looks up row
// l % 16 of a tile one tile ahead; the copies fetch its 64-bit offsets by shuffle.
struct RowRef {
  uint32_t block, offset;
  bool valid;
};

// One warp's pipeline over its tiles (warp w takes tiles w, w + kWarps, ... of the split):
// kStages stages of [K tile, V tile] of kTileTokens rows each in shared memory.
template <class T>
struct KvPipe {
  static constexpr int kWarps = T::kWarps;
  int warp, lane;
  int n_wt;                        // tiles of this warp
  unsigned char* my_stages;        // [kStages] { K [kTileTokens][kv_row_bytes], V the same }
  unsigned char* my_conv;          // widened K then V tile (kWiden)
  uint64_t policy;                 // L2 evict-first: each K/V byte is read once
  int bs_shift;                    // log2(block_size) when a power of two, else -1
  const int32_t* bt_row;           // the request's row of block_table
  int64_t k_sb, k_sp, v_sb, v_sp;  // bytes per block and per in-block row
  bool same_strides;               // V rows at a fixed distance from K rows
  const char* k_head;              // the KV head's K and V bases
  const char* v_head;
  int64_t kv_delta;      // v_head - k_head
  int cpr, n_chunks;     // 16-byte chunks per row and per tile
  uint64_t* my_bars;     // [kStages] mbarriers of the bulk-copy path
  uint32_t row_bytes_g;  // bytes of a K row in global memory (p.head_size columns)
  uint32_t v_bytes_g;    // bytes of a V row in global memory (p.v_head_size columns)

  // Sizes and lanes are derived here rather than passed in, so that the compiler sees them as
  // it did in one function (constants of the tensor-core instances, lane ranges).
  __device__ __forceinline__ KvPipe(const AttnParams& p, const Work& w, const Shape<T>& sh) {
    unsigned char* const smem = dyn_smem();
    const Lane ln = lane_ids();
    const SmemLayout& lay = sh.lay;
    warp = ln.warp, lane = ln.lane;
    const int n_tiles = ceil_div(w.kv_end - w.kv_begin, kTileTokens);
    n_wt = n_tiles > warp ? ceil_div(n_tiles - warp, kWarps) : 0;
    my_stages = smem + lay.stage_offset + warp * T::kStages * lay.stage_bytes;
    my_conv = smem + lay.conv_offset + warp * 2 * kTileTokens * lay.conv_row_bytes;
    policy = sm80::l2_evict_first_policy();
    const char* const k_base = static_cast<const char*>(p.k);
    const char* const v_base = static_cast<const char*>(p.v);
    // Power-of-two block sizes (all in practice) divide by a shift; others by a division.
    bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
    bt_row = p.block_table + int64_t(w.r) * p.block_table_stride_seq;
    // Byte strides, and the KV head's base, once. K and V share the layout in every cache this
    // library makes: then a V row sits at a fixed distance from its K row and one shuffled
    // address serves both; a view with other V strides shuffles its own.
    const int kv_bytes = sh.kv_bytes;
    k_sb = p.k_stride_block * kv_bytes, k_sp = p.k_stride_page * kv_bytes;
    v_sb = p.v_stride_block * kv_bytes, v_sp = p.v_stride_page * kv_bytes;
    same_strides = k_sb == v_sb && k_sp == v_sp && p.k_stride_head == p.v_stride_head;
    k_head = k_base + int64_t(w.kv_head) * p.k_stride_head * kv_bytes;
    v_head = v_base + int64_t(w.kv_head) * p.v_stride_head * kv_bytes;
    kv_delta = v_head - k_head;
    // Chunks per row: a constant for the tensor-core instances, which then also know each
    // lane's column (32 is a multiple of the row's chunks at every head size but 80 and 96).
    cpr = T::kMma ? T::head_size * T::kKvBytes / 16 : sh.chunks_per_row;
    n_chunks = kTileTokens * cpr;
    my_bars = reinterpret_cast<uint64_t*>(smem + lay.bar_offset) + warp * T::kStages;
    row_bytes_g = uint32_t(sh.cols * kv_bytes);
    v_bytes_g = uint32_t(sh.v_cols * kv_bytes);
  }

  // The first key of this warp's tile k.
  __device__ __forceinline__ int tile_start(const Work& w, int k) const {
    return w.kv_begin + (warp + k * kWarps) * kTileTokens;
  }

  // Row lane % 16 of this warp's tile k: its block and row in the block (kv_direct: its token).
  __device__ __forceinline__ RowRef lookup(const AttnParams& p, const Work& w, int k) const {
    RowRef ref{0, 0, false};
    const int pos = tile_start(w, k) + (lane & 15);
    ref.valid = k < n_wt && pos < w.kv_end;
    if (ref.valid) {
      if (p.kv_direct) {
        ref.block = uint32_t(w.q_begin + pos);
      } else {
        const uint32_t lb =
            bs_shift >= 0 ? uint32_t(pos) >> bs_shift : uint32_t(pos) / uint32_t(p.block_size);
        ref.offset = uint32_t(pos) - lb * uint32_t(p.block_size);
        ref.block = uint32_t(bt_row[int64_t(lb) * p.block_table_stride_block]);
      }
    }
    return ref;
  }

  // Tile k's K and V rows into `stage` by 16-byte cp.async (the caller commits the group).
  __device__ __forceinline__ void issue(const Work& w, const SmemLayout& lay, int stage, int k,
                                        const RowRef& ref) const {
    constexpr int kCpr = T::kMma ? T::head_size * T::kKvBytes / 16 : 1;
    constexpr bool kFixedCol = T::kMma && 32 % kCpr == 0;
    constexpr int kMaxIters = ceil_div(kTileTokens * (T::kMma ? kCpr : 64), 32);
    if (k >= n_wt) return;  // warp-uniform
    unsigned char* const sk = my_stages + stage * lay.stage_bytes;
    // This lane's row (lane % 16) address; rows past the split read nothing (src size 0) from
    // a valid address and are masked later.
    const char* const kp =
        k_head + (ref.valid ? int64_t(ref.block) * k_sb + int64_t(ref.offset) * k_sp : 0);
    const char* const vp =
        v_head + (ref.valid ? int64_t(ref.block) * v_sb + int64_t(ref.offset) * v_sp : 0);
    const int ts = tile_start(w, k);
#pragma unroll
    for (int i = 0; i < kMaxIters; ++i) {
      if (32 * i >= n_chunks) break;  // compile-time for the tensor-core instances
      // Every lane runs the shuffles (the whole warp must); the copies are predicated.
      const int c = 32 * i + lane;
      int row, col;
      if constexpr (kFixedCol) {
        row = i * (32 / kCpr) + lane / kCpr;
        col = lane % kCpr;
      } else {
        row = min(c, n_chunks - 1) / cpr;
        col = c - row * cpr;
      }
      const char* const kr = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<long long>(kp), row));
      const char* const vr = same_strides ? kr + kv_delta
                                          : reinterpret_cast<const char*>(__shfl_sync(
                                                0xffffffffu, reinterpret_cast<long long>(vp), row));
      if (kFixedCol || c < n_chunks) {
        // Chunks past the row's bytes (a head size below the instance's, a V narrower than K)
        // are zero-filled too; they read nothing, from the row's start.
        const bool key = ts + row < w.kv_end;
        const bool k_in = uint32_t(col * 16) < row_bytes_g, v_in = uint32_t(col * 16) < v_bytes_g;
        const uint32_t dst = sm80::smem_addr(sk + row * lay.kv_row_bytes + col * 16);
        sm80::cp_async_16(dst, kr + (k_in ? col * 16 : 0), key && k_in ? 16 : 0, policy);
        sm80::cp_async_16(dst + kTileTokens * lay.kv_row_bytes, vr + (v_in ? col * 16 : 0),
                          key && v_in ? 16 : 0, policy);
      }
    }
  }

  // Bulk-copy path (p.bulk_copy, sm_90): lane l copies row l % 16 of the tile's K (lanes
  // 0-15) or V (16-31), the row its own lookup found, with one cp.async.bulk completing on the
  // warp's mbarrier of the stage. Rows past the split copy the tile's first row instead
  // (lane 0 / 16 hold it; it is visible whenever the tile is issued): finite values that the
  // mask gives weight 0, as the zero fill does on the cp.async path.
  __device__ __forceinline__ void issue_bulk(const SmemLayout& lay, int stage, int k,
                                             const RowRef& ref) const {
    if (k >= n_wt) return;  // warp-uniform
    const bool is_v = lane >= 16;
    const char* src =
        is_v ? v_head + (ref.valid ? int64_t(ref.block) * v_sb + int64_t(ref.offset) * v_sp : 0)
             : k_head + (ref.valid ? int64_t(ref.block) * k_sb + int64_t(ref.offset) * k_sp : 0);
    const long long first = __shfl_sync(0xffffffffu, reinterpret_cast<long long>(src), lane & 16);
    if (!ref.valid) src = reinterpret_cast<const char*>(first);
    unsigned char* const dst = my_stages + stage * lay.stage_bytes +
                               ((is_v ? kTileTokens : 0) + (lane & 15)) * lay.kv_row_bytes;
    if (lane == 0) {
      sm90::bulk_arrive_expect(&my_bars[stage], kTileTokens * (row_bytes_g + v_bytes_g));
    }
    sm90::bulk_copy(dst, src, is_v ? v_bytes_g : row_bytes_g, &my_bars[stage]);
  }

  // Bulk copies write row_bytes_g (K) or v_bytes_g (V) bytes of each smem row: below the
  // instance's head size the rest of every row of the warp's stages is zeroed once, here, by
  // the warp's own stores (visible to its lanes after __syncwarp; the copies never touch those
  // bytes). V's row tails start at V's own width.
  __device__ __forceinline__ void zero_row_tails(const SmemLayout& lay) const {
    const int v_first = int(v_bytes_g / 16);  // V's first tail chunk (<= K's)
    const int tail_chunks = cpr - v_first;
    if (tail_chunks <= 0) return;
    const int rows = T::kStages * 2 * kTileTokens;  // stages' K and V rows are contiguous
    for (int i = lane; i < rows * tail_chunks; i += 32) {
      const int row = i / tail_chunks, chunk = v_first + i % tail_chunks;
      const bool is_v = (row / kTileTokens) & 1;  // each stage: kTileTokens K rows, then V's
      if (!is_v && chunk * 16 < int(row_bytes_g)) continue;
      *reinterpret_cast<uint4*>(my_stages + row * lay.kv_row_bytes + chunk * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }

  // kStages - 1 tiles in flight; returns the lookup of the next tile.
  __device__ __forceinline__ RowRef prologue(const AttnParams& p, const Work& w,
                                             const SmemLayout& lay) const {
    RowRef ref = lookup(p, w, 0);
    if (p.bulk_copy) {
      zero_row_tails(lay);
      if (lane == 0) {
#pragma unroll
        for (int s = 0; s < T::kStages; ++s) sm90::bulk_barrier_init(&my_bars[s], 1);
      }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < T::kStages - 1; ++k) {
        issue_bulk(lay, k, k, ref);
        ref = lookup(p, w, k + 1);
      }
    } else {
#pragma unroll
      for (int k = 0; k < T::kStages - 1; ++k) {
        issue(w, lay, k, k, ref);
        ref = lookup(p, w, k + 1);
        sm80::cp_async_commit();
      }
    }
    return ref;
  }
};

}  // namespace pagedattn::cuda::decode
