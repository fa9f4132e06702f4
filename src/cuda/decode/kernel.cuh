// Paged attention for requests with few new query tokens (decode, speculative-decode
// verification), with a simple q-tiled path that is also correct for long queries.
//
// Map
//   computes  for every query row (token i of request r, head h) softmax over the visible keys
//             j of scale*q.k (soft cap, ALiBi, causal offset, sliding window, sinks) times V,
//             and the natural-log LSE: spec section 4 / docs/semantics.md, matched against the
//             float64 reference. fp8 K/V are widened exactly; k_scale is folded into the logit
//             scale and v_scale into the output.
//   grid      x = num_seqs * num_kv_heads * num_q_tiles (q tile fastest, so CTAs that read the
//             same KV run side by side), y = num_splits. A CTA owns kRows = 16 packed rows
//             (row p = token p / G, head kv_head * G + p % G: every query head and token of
//             one KV head, so each K/V byte is fetched once for all of them) and the keys of
//             its split.
//   warps     kWarps warps split the CTA's keys tile by tile (warp w takes tiles w, w + kWarps,
//             ...); each runs its own cp.async pipeline of kStages stages of kTileTokens keys
//             with no CTA barrier in the main loop, keeps its own online-softmax state, and the
//             warps merge through shared memory at the end.
//   math      tensor-core instances: S = Q K^T and O += P V with mma.sync m16n8k16 (fp32
//             accumulation), Q and K/V fed by ldmatrix from padded rows, P rounded to the
//             activation dtype as the reference's low-precision model does; an fp8 cache
//             (head sizes that are multiples of 32) is widened in registers from 16/8/4-byte
//             LDS of the stage (Fp8Widen, with Q stored in fragment order). The generic
//             instance does the same in float on CUDA cores. Softmax runs in log2 units (one
//             exp2 per score; log2(e) folded into the scale).
//   loads     16-byte cp.async.cg, whole rows per copy instruction; the row address of every
//             key comes from the block table, looked up one tile ahead by lane (row % 16) and
//             shuffled to the lanes that copy it; rows past the split are zero-filled and
//             masked. Launched with programmatic dependent launch (griddepcontrol).
//   budget    smem: config.h smem_layout (e.g. 106 KB at head size 128 bf16: 2 CTAs per SM,
//             ~128 KB of loads in flight per SM; 58 KB at fp8 d128: 3 CTAs); registers: O is
//             head_size / 2 floats per thread. docs/kernel_notes.md has the ptxas figures.
//   test      tests/cuda and `backend_ops test --device cuda` (every feature against float64);
//             time with bench/gpu/bench_decode (bench/gpu/run.sh runs both).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/bulk_copy.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/fp8.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/decode/config.h"
#include "cuda/decode/launch.h"
#include "cuda/decode/softmax.cuh"
#include "cuda/decode/store.cuh"
#include "cuda/decode/widen.cuh"

namespace pagedattn::cuda::decode {

using attn::AttnParams;
using attn::bf16x2_to_f16x2;
using attn::bf16x8_abs_max_bits;
using attn::ceil_div;
using attn::fp8x2_f16;
using attn::kLog2e;
using attn::kv_elem_bytes;
using attn::pow2f;
using attn::q_row_shift;
using attn::row_range;
using attn::RowRange;
using attn::ThreadRow;
using attn::Work;

/// The shared-memory layout a launch of instance T uses for this problem.
template <class T>
__host__ __device__ constexpr SmemLayout layout_for(int head_size, int kv_dtype) {
  if constexpr (T::kMma) {
    return T::max_layout();
  } else {
    return smem_layout(head_size, kv_elem_bytes(kv_dtype), false, true, T::kWarps, T::kStages);
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm)
    decode_kernel(const __grid_constant__ AttnParams p) {
  static_assert(T::kStages >= 2, "the pipeline needs two stages");
  constexpr int kWarps = T::kWarps;
  // Columns of O per thread: head_size / 8 n tiles of 8 (the generic kernel sizes for the max).
  constexpr int kNt = (T::kMma ? T::head_size : kMaxHeadSize) / 8;
  extern __shared__ __align__(128) unsigned char smem[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;  // fragment row group and thread in group

  // Everything below reads memory that earlier kernels of the stream may write (metadata, Q,
  // the cache): wait for them (programmatic dependent launch; a no-op without the launch
  // attribute), then let the next grid (the split combine, the next layer) be scheduled as our
  // CTAs retire. It waits for our completion before reading anything.
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();

  // ---- which rows and keys this CTA owns ----
  Work w;
  {
    int x = blockIdx.x;
    const int q_tile = x % p.num_q_tiles;
    x /= p.num_q_tiles;
    w.kv_head = x % p.num_kv_heads;
    w.r = x / p.num_kv_heads;
    w.q_begin = p.query_start_loc[w.r];
    w.q_len = p.query_start_loc[w.r + 1] - w.q_begin;
    w.kv_len = p.kv_direct ? 0 : p.seq_lens[w.r];  // loaded beside query_start_loc
    w.row0 = q_tile * kRows;
  }
  const int rows_total = w.q_len * p.group;
  if (w.row0 >= rows_total) return;  // a shorter query than the longest: nothing here
  if (p.route_rows > 0 && rows_total > p.route_rows) return;  // the prefill kernel's request
  w.num_rows = min(kRows, rows_total - w.row0);
  if (p.kv_direct) w.kv_len = w.q_len;
  // Key bounds grow with the row's token, so the first and last rows bound the CTA's range.
  const RowRange first = row_range(p, w, 0), last = row_range(p, w, w.num_rows - 1);
  {
    const int range_lo = first.lo, range_hi = max(last.hi, first.lo);
    const int chunk =
        ceil_div(ceil_div(range_hi - range_lo, p.num_splits), T::kSplitAlign) * T::kSplitAlign;
    w.kv_begin = min(range_lo + int(blockIdx.y) * chunk, range_hi);
    w.kv_end = min(w.kv_begin + chunk, range_hi);
    w.split = int(blockIdx.y);
  }
  // Tiles [lo_max, hi_min) need no mask for any row.
  const int lo_max = max(last.lo, w.kv_begin), hi_min = min(first.hi, w.kv_end);

  const int head_size = T::kMma ? kNt * 8 : p.head_size;
  const int nt_active = head_size / 8;
  const SmemLayout lay = layout_for<T>(p.head_size, p.kv_dtype);
  const int kv_bytes = T::kMma ? T::kKvBytes : kv_elem_bytes(p.kv_dtype);
  const int chunks_per_row = head_size * kv_bytes / 16;

  ThreadRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    if (row < w.num_rows) {
      const RowRange rr = row_range(p, w, row);
      rows[h].lo = max(rr.lo, w.kv_begin);
      rows[h].hi = min(rr.hi, w.kv_end);
      rows[h].pos = rr.pos;
      const int head = w.kv_head * p.group + (w.row0 + row) % p.group;
      rows[h].alibi2 = p.alibi_slopes != nullptr ? p.alibi_slopes[head] * kLog2e : 0.0f;
    } else {
      rows[h] = ThreadRow{0, 0, 0, 0.0f};  // padding row: every key masked
    }
    rows[h].score2 = p.scale_log2;
    rows[h].cap_arg = p.softcap_arg_scale;
  }

  // ---- Q tile: its global loads go out first (registers), the smem stores after the first
  // KV copies are issued, so the two latencies overlap ----
  const int q_chunks = head_size / 8;  // 8 elements per chunk
  // Tensor-core instances: each thread's chunks, raw activation bits (zeros for padding rows).
  constexpr int kQPerThread =
      T::kMma ? ceil_div(kRows * (T::kMma ? T::head_size : 8) / 8, T::kThreads) : 1;
  uint4 q_raw[kQPerThread];
  auto q_src = [&](int row, int col) -> const char* {
    if (row >= w.num_rows) return nullptr;
    const int pr = w.row0 + row;
    const int head = w.kv_head * p.group + pr % p.group;
    return static_cast<const char*>(p.q) + ((int64_t(w.q_begin) + pr / p.group) * p.q_stride_token +
                                            int64_t(head) * p.q_stride_head + col * 8) *
                                               kElemBytes<T::act>;
  };
  if constexpr (T::kMma) {
#pragma unroll
    for (int i = 0; i < kQPerThread; ++i) {
      const int c = int(threadIdx.x) + i * T::kThreads;
      const int row = c / q_chunks, col = c - row * q_chunks;
      const char* src = c < kRows * q_chunks ? q_src(row, col) : nullptr;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (src != nullptr) {
        if (p.vec_q) {
          raw = *reinterpret_cast<const uint4*>(src);
        } else {
          uint16_t* r16 = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
          for (int e = 0; e < 8; ++e) r16[e] = reinterpret_cast<const uint16_t*>(src)[e];
        }
      }
      q_raw[i] = raw;
    }
  }
  // The fp8 kernel's bf16 rows: each row's largest |q| (q_row_shift), in the Q area's padding
  // (the fragments take head_size * 32 of its kRows * q_row_bytes bytes).
  [[maybe_unused]] uint32_t* const q_row_max =
      reinterpret_cast<uint32_t*>(smem + (T::kMma ? T::head_size : 0) * 32);
  static_assert(!T::kRegFp8 || T::head_size * 32 + kRows * 4 <= kRows * (2 * T::head_size + 16));
  // Q bits -> smem. Row-major (ldmatrix reads it) except for the in-register fp8 kernel, whose
  // S = Q K^T reduces over head dims in a lane-contiguous order (see compute): there the tile
  // is stored in A-fragment order, [k step][lane][a0..a3], one 16-byte load per k step.
  auto store_q = [&] {
    if constexpr (T::kMma) {
#pragma unroll
      for (int i = 0; i < kQPerThread; ++i) {
        const int c = int(threadIdx.x) + i * T::kThreads;
        if (c >= kRows * q_chunks) break;
        const int row = c / q_chunks, col = c - row * q_chunks;
        if constexpr (T::kRegFp8) {
          // f16 (bf16 rows scaled by 2^k, q_row_shift). Elements 8*col .. +7 belong to lane
          // (row % 8, t) with t = 8*col / (D/4), k steps ks0 and ks0 + 1; a0/a1 take dims
          // {d, d+1}, a2/a3 dims {d+2, d+3} of the step's d.
          constexpr int kSpan = T::head_size / 4;
          const int t = (8 * col) / kSpan, ks0 = (8 * col - t * kSpan) / 4;
          const int ln = (row & 7) * 4 + t, hi = row >> 3;
          uint32_t q32[4] = {q_raw[i].x, q_raw[i].y, q_raw[i].z, q_raw[i].w};
          if constexpr (T::act == DType::kBF16) {
            const float f = pow2f(q_row_shift(q_row_max[row]));
#pragma unroll
            for (int e = 0; e < 4; ++e) q32[e] = bf16x2_to_f16x2(q32[e], f);
          }
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            uint32_t* dst = reinterpret_cast<uint32_t*>(smem + ((ks0 + k) * 32 + ln) * 16);
            dst[hi] = q32[2 * k];          // {d, d+1}
            dst[2 + hi] = q32[2 * k + 1];  // {d+2, d+3}
          }
        } else {
          *reinterpret_cast<uint4*>(smem + row * lay.q_row_bytes + col * 16) = q_raw[i];
        }
      }
    } else {
      // Generic kernel: float rows.
      for (int c = threadIdx.x; c < kRows * q_chunks; c += T::kThreads) {
        const int row = c / q_chunks, col = c - row * q_chunks;
        const char* src = q_src(row, col);
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (src != nullptr) {
          if (T::act == DType::kF32 && p.vec_q) {
            const float4 a = reinterpret_cast<const float4*>(src)[0];
            const float4 b = reinterpret_cast<const float4*>(src)[1];
            f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
            f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = load_as_float<T::act>(src, e);
          }
        }
        float4* d4 = reinterpret_cast<float4*>(smem + row * lay.q_row_bytes) + col * 2;
        d4[0] = make_float4(f[0], f[1], f[2], f[3]);
        d4[1] = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
  };

  // ---- per-warp pipeline over this warp's tiles ----
  const int n_tiles = ceil_div(w.kv_end - w.kv_begin, kTileTokens);
  const int n_wt = n_tiles > warp ? ceil_div(n_tiles - warp, kWarps) : 0;
  auto tile_start = [&](int k) { return w.kv_begin + (warp + k * kWarps) * kTileTokens; };
  unsigned char* const my_stages = smem + lay.stage_offset + warp * T::kStages * lay.stage_bytes;
  unsigned char* const my_conv =
      smem + lay.conv_offset + warp * 2 * kTileTokens * lay.conv_row_bytes;
  const uint64_t policy = sm80::l2_evict_first_policy();
  const char* const k_base = static_cast<const char*>(p.k);
  const char* const v_base = static_cast<const char*>(p.v);

  // Copy mapping: chunk c (16 bytes) of a tile's K (or V) rows, in row-major order, goes to
  // lane c % 32, so one copy instruction covers whole rows (2 rows of 256 bytes at bf16 d128,
  // 4 of 128 at fp8 d128): full 128-byte lines, the row's bytes requested together. (A
  // version that gave each lane two whole rows, 64 bytes per row per instruction, read at
  // 0.86 of the copy rate instead of 0.99: docs/kernel_notes.md, v2.) Lane l looks up row
  // l % 16 of a tile one tile ahead; the copies fetch its 64-bit offsets by shuffle.
  struct RowRef {
    uint32_t block, offset;
    bool valid;
  };
  // Power-of-two block sizes (all in practice) divide by a shift; others by a division.
  const int bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  const int32_t* const bt_row = p.block_table + int64_t(w.r) * p.block_table_stride_seq;
  auto lookup = [&](int k) {
    RowRef ref{0, 0, false};
    const int pos = tile_start(k) + (lane & 15);
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
  };
  // Byte strides, and the KV head's base, once. K and V share the layout in every cache this
  // library makes: then a V row sits at a fixed distance from its K row and one shuffled
  // address serves both; a view with other V strides shuffles its own.
  const int64_t k_sb = p.k_stride_block * kv_bytes, k_sp = p.k_stride_page * kv_bytes;
  const int64_t v_sb = p.v_stride_block * kv_bytes, v_sp = p.v_stride_page * kv_bytes;
  const bool same_strides = k_sb == v_sb && k_sp == v_sp && p.k_stride_head == p.v_stride_head;
  const char* const k_head = k_base + int64_t(w.kv_head) * p.k_stride_head * kv_bytes;
  const char* const v_head = v_base + int64_t(w.kv_head) * p.v_stride_head * kv_bytes;
  const int64_t kv_delta = v_head - k_head;
  // Chunks per row: a constant for the tensor-core instances, which then also know each
  // lane's column (32 is a multiple of the row's chunks at every head size but 80 and 96).
  const int cpr = T::kMma ? T::head_size * T::kKvBytes / 16 : chunks_per_row;
  const int n_chunks = kTileTokens * cpr;
  constexpr int kCpr = T::kMma ? T::head_size * T::kKvBytes / 16 : 1;
  constexpr bool kFixedCol = T::kMma && 32 % kCpr == 0;
  constexpr int kMaxIters = ceil_div(kTileTokens * (T::kMma ? kCpr : 64), 32);
  auto issue = [&](int stage, int k, const RowRef& ref) {
    if (k >= n_wt) return;  // warp-uniform
    unsigned char* const sk = my_stages + stage * lay.stage_bytes;
    // This lane's row (lane % 16) address; rows past the split read nothing (src size 0) from
    // a valid address and are masked later.
    const char* const kp =
        k_head + (ref.valid ? int64_t(ref.block) * k_sb + int64_t(ref.offset) * k_sp : 0);
    const char* const vp =
        v_head + (ref.valid ? int64_t(ref.block) * v_sb + int64_t(ref.offset) * v_sp : 0);
    const int ts = tile_start(k);
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
        const int bytes = ts + row < w.kv_end ? 16 : 0;
        const uint32_t dst = sm80::smem_addr(sk + row * lay.kv_row_bytes + col * 16);
        sm80::cp_async_16(dst, kr + col * 16, bytes, policy);
        sm80::cp_async_16(dst + kTileTokens * lay.kv_row_bytes, vr + col * 16, bytes, policy);
      }
    }
  };

  // Bulk-copy path (p.bulk_copy, sm_90): lane l copies row l % 16 of the tile's K (lanes
  // 0-15) or V (16-31), the row its own lookup found, with one cp.async.bulk completing on the
  // warp's mbarrier of the stage. Rows past the split copy the tile's first row instead
  // (lane 0 / 16 hold it; it is visible whenever the tile is issued): finite values that the
  // mask gives weight 0, as the zero fill does on the cp.async path.
  uint64_t* const my_bars = reinterpret_cast<uint64_t*>(smem + lay.bar_offset) + warp * T::kStages;
  const uint32_t row_bytes_g = uint32_t(head_size * kv_bytes);
  auto issue_bulk = [&](int stage, int k, const RowRef& ref) {
    if (k >= n_wt) return;  // warp-uniform
    const bool is_v = lane >= 16;
    const char* src =
        is_v ? v_head + (ref.valid ? int64_t(ref.block) * v_sb + int64_t(ref.offset) * v_sp : 0)
             : k_head + (ref.valid ? int64_t(ref.block) * k_sb + int64_t(ref.offset) * k_sp : 0);
    const long long first = __shfl_sync(0xffffffffu, reinterpret_cast<long long>(src), lane & 16);
    if (!ref.valid) src = reinterpret_cast<const char*>(first);
    unsigned char* const dst = my_stages + stage * lay.stage_bytes +
                               ((is_v ? kTileTokens : 0) + (lane & 15)) * lay.kv_row_bytes;
    if (lane == 0) sm90::bulk_arrive_expect(&my_bars[stage], 2 * kTileTokens * row_bytes_g);
    sm90::bulk_copy(dst, src, row_bytes_g, &my_bars[stage]);
  };

  float o[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  // ---- pipeline prologue (kStages - 1 tiles in flight), then Q ----
  RowRef ref = lookup(0);
  if (p.bulk_copy) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < T::kStages; ++s) sm90::bulk_barrier_init(&my_bars[s], 1);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < T::kStages - 1; ++k) {
      issue_bulk(k, k, ref);
      ref = lookup(k + 1);
    }
  } else {
#pragma unroll
    for (int k = 0; k < T::kStages - 1; ++k) {
      issue(k, k, ref);
      ref = lookup(k + 1);
      sm80::cp_async_commit();
    }
  }
  if constexpr (T::kRegFp8 && T::act == DType::kBF16) {
    if (threadIdx.x < kRows) q_row_max[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kQPerThread; ++i) {
      const int c = int(threadIdx.x) + i * T::kThreads;
      if (c < kRows * q_chunks) atomicMax(&q_row_max[c / q_chunks], bf16x8_abs_max_bits(q_raw[i]));
    }
    __syncthreads();
  }
  store_q();
  __syncthreads();
  if constexpr (T::kRegFp8 && T::act == DType::kBF16) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float undo = pow2f(-q_row_shift(q_row_max[g + 8 * h]));
      rows[h].score2 *= undo;
      rows[h].cap_arg *= undo;
    }
  }

  // Lane address parts for ldmatrix (see sm80::ldmatrix_x4): Q as the A operand (matrices
  // rows 0-7 / 8-15 x dims +0 / +8), K as B of S = Q K^T (tokens 0-7 / 8-15 x dims +0 / +8),
  // V as B of O = P V, transposed (tokens 0-7 / 8-15 x dims +0 / +8).
  const int mi = lane >> 3, r8 = lane & 7;
  const int qa_row = (mi & 1) * 8 + r8, qa_col = (mi >> 1) * 8;
  const int kb_row = (mi >> 1) * 8 + r8, kb_col = (mi & 1) * 8;
  const int vb_row = (mi & 1) * 8 + r8, vb_col = (mi >> 1) * 8;
  const uint32_t q_lane_addr = sm80::smem_addr(smem) + qa_row * lay.q_row_bytes + qa_col * 2;
  // The in-register fp8 kernel's Q fragments: [k step][lane] 16 bytes.
  const uint4* const q_frag = reinterpret_cast<const uint4*>(smem) + lane;

  constexpr int kQRegs = T::kQInRegisters ? kNt / 2 : 1;
  uint32_t qf[kQRegs][4];
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
  // kE5m2 (a std::integral_constant): the fp8 kernel's cache format, fixed per launch.
  auto compute = [&](int stage, int ts, [[maybe_unused]] auto kE5m2) {
    const unsigned char* kt = my_stages + stage * lay.stage_bytes;
    const unsigned char* vt = kt + kTileTokens * lay.kv_row_bytes;
    int row_bytes = lay.kv_row_bytes;
    if constexpr (T::kWiden) {
      widen_stage<T>(p, lay, kt, my_conv, chunks_per_row, lane);
      __syncwarp();
      kt = my_conv;
      vt = my_conv + kTileTokens * lay.conv_row_bytes;
      row_bytes = lay.conv_row_bytes;
    }
    const bool need_mask = !(ts >= lo_max && ts + kTileTokens <= hi_min);
    float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    if constexpr (T::kRegFp8) {
      // fp8 widened in registers, f16 math (fp8x2_f16). S = Q K^T: lane (g, t4) takes key
      // 8j + g of n tile j and the D/4 contiguous head dims t4 * D/4 + [0, D/4): k step ks
      // reduces dims d = t4 * D/4 + 4 ks + {0..3}, the B pair b0 = dims {d, d+1} (bytes 0, 1
      // of the word), b1 = {d+2, d+3}; Q's fragments (smem, store_q) use the same order. Sums
      // over a permuted k are the same.
      constexpr bool kE5 = decltype(kE5m2)::value;
      constexpr int D = T::head_size, kSteps = D / 16;
      uint32_t kw[2][D / 16];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        lds_words<D / 4>(kt + (8 * j + g) * row_bytes + t4 * (D / 4), kw[j]);
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        uint32_t a[4];
        if constexpr (T::kQInRegisters) {
          a[0] = qf[ks][0], a[1] = qf[ks][1], a[2] = qf[ks][2], a[3] = qf[ks][3];
        } else {
          const uint4 v = q_frag[ks * 32];
          a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          sm80::mma_16816<false>(s[j], a, fp8x2_f16<kE5, 0>(kw[j][ks]),
                                 fp8x2_f16<kE5, 1>(kw[j][ks]));
        }
      }
      softmax_tile<kNt>(p, s, rows, ts, need_mask, t4, m, l, o);
      // P in f16: at least as fine as the activation dtype for P in [0, 1].
      constexpr DType kF16 = DType::kF16;
      const uint32_t pa[4] = {pack2<kF16>(s[0][0], s[0][1]), pack2<kF16>(s[0][2], s[0][3]),
                              pack2<kF16>(s[1][0], s[1][1]), pack2<kF16>(s[1][2], s[1][3])};
      // O += P V: P's k are keys 2t4, 2t4+1 (b0) and 2t4+8, 2t4+9 (b1). Output column n of n
      // tile nt is head dim n * (D/8) + nt, so lane g's B bytes for every n tile are the D/8
      // contiguous bytes g * D/8 + [0, D/8) of those four keys; prmt pairs two keys' bytes.
      // The merge below writes O back in natural order.
      constexpr int kVBytes = D / 8;
      uint32_t va[4][kVBytes / 4];
      const unsigned char* v0 = vt + (2 * t4) * row_bytes + g * kVBytes;
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
    } else if constexpr (T::kMma) {
      constexpr bool kBF16 = T::act == DType::kBF16;
      const uint32_t k_addr = sm80::smem_addr(kt) + kb_row * row_bytes + kb_col * 2;
#pragma unroll
      for (int ks = 0; ks < kNt / 2; ++ks) {
        uint32_t b[4];
        sm80::ldmatrix_x4(b, k_addr + ks * 32);
        if constexpr (T::kQInRegisters) {
          sm80::mma_16816<kBF16>(s[0], qf[ks], b[0], b[1]);
          sm80::mma_16816<kBF16>(s[1], qf[ks], b[2], b[3]);
        } else {
          uint32_t a[4];
          sm80::ldmatrix_x4(a, q_lane_addr + ks * 32);
          sm80::mma_16816<kBF16>(s[0], a, b[0], b[1]);
          sm80::mma_16816<kBF16>(s[1], a, b[2], b[3]);
        }
      }
      softmax_tile<kNt>(p, s, rows, ts, need_mask, t4, m, l, o);
      const uint32_t pa[4] = {pack2<T::act>(s[0][0], s[0][1]), pack2<T::act>(s[0][2], s[0][3]),
                              pack2<T::act>(s[1][0], s[1][1]), pack2<T::act>(s[1][2], s[1][3])};
      const uint32_t v_addr = sm80::smem_addr(vt) + vb_row * row_bytes + vb_col * 2;
#pragma unroll
      for (int np = 0; np < kNt / 2; ++np) {
        uint32_t b[4];
        sm80::ldmatrix_x4_trans(b, v_addr + np * 32);
        sm80::mma_16816<kBF16>(o[2 * np], pa, b[0], b[1]);
        sm80::mma_16816<kBF16>(o[2 * np + 1], pa, b[2], b[3]);
      }
    } else {
      // Float math in the fragment layout of the tensor-core path: this thread owns rows g,
      // g + 8 and keys 2*t4 + {0, 1} (+ 8) of S, and columns nt * 8 + 2*t4 + {0, 1} of O.
      const float* qf32 = reinterpret_cast<const float*>(smem);
      const int q_ld = lay.q_row_bytes / 4, kv_ld = row_bytes / 4;
      const float* qa = qf32 + g * q_ld;
      const float* qb = qf32 + (g + 8) * q_ld;
      const float* kf = reinterpret_cast<const float*>(kt);
      const float* k0 = kf + (2 * t4) * kv_ld;
      const float* k2 = kf + (8 + 2 * t4) * kv_ld;
      for (int d = 0; d < head_size; d += 4) {
        const float4 a = *reinterpret_cast<const float4*>(qa + d);
        const float4 b = *reinterpret_cast<const float4*>(qb + d);
        const float4 kv[4] = {*reinterpret_cast<const float4*>(k0 + d),
                              *reinterpret_cast<const float4*>(k0 + kv_ld + d),
                              *reinterpret_cast<const float4*>(k2 + d),
                              *reinterpret_cast<const float4*>(k2 + kv_ld + d)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float& sa = s[j >> 1][j & 1];
          float& sb = s[j >> 1][2 + (j & 1)];
          sa = fmaf(a.x, kv[j].x, fmaf(a.y, kv[j].y, fmaf(a.z, kv[j].z, fmaf(a.w, kv[j].w, sa))));
          sb = fmaf(b.x, kv[j].x, fmaf(b.y, kv[j].y, fmaf(b.z, kv[j].z, fmaf(b.w, kv[j].w, sb))));
        }
      }
      softmax_tile<kNt>(p, s, rows, ts, need_mask, t4, m, l, o);
      // P through smem: each thread needs all 16 keys of its two rows.
      float* pt = reinterpret_cast<float*>(smem + lay.p_offset) + warp * kRows * (kTileTokens + 1);
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
        for (int nt = 0; nt < kNt; ++nt) {
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
  };

  auto main_loop = [&](auto kE5m2, auto kBulk) {
    for (int k = 0; k < n_wt; ++k) {
      const int next = k + T::kStages - 1;
      if constexpr (decltype(kBulk)::value) {
        sm90::bulk_wait(&my_bars[k % T::kStages], uint32_t(k / T::kStages) & 1u);
        __syncwarp();  // every lane is done reading the stage refilled below (tile k - 1's)
        issue_bulk(next % T::kStages, next, ref);
      } else {
        sm80::cp_async_wait<T::kStages - 2>();
        __syncwarp();  // the tile's copies by every lane are visible; the freed stage is unread
        issue(next % T::kStages, next, ref);
        sm80::cp_async_commit();
      }
      ref = lookup(next + 1);
      compute(k % T::kStages, tile_start(k), kE5m2);
    }
  };
  auto by_format = [&](auto kBulk) {
    if (T::kRegFp8 && p.kv_dtype == int(DType::kFp8E5M2)) {
      main_loop(std::true_type{}, kBulk);
    } else {
      main_loop(std::false_type{}, kBulk);
    }
  };
  if (p.bulk_copy) {
    by_format(std::true_type{});
  } else {
    by_format(std::false_type{});
  }
  sm80::cp_async_wait<0>();  // (the bulk path waited for every tile it issued)

  // ---- merge the warps' partial states through smem (over the stages) ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  __syncthreads();  // every warp is done with its stages
  float* const mo = reinterpret_cast<float*>(smem + lay.merge_offset);  // [warps][kRows][o_row]
  float* const mml = mo + kWarps * kRows * lay.merge_o_row;             // [warps][kRows][m, l]
  if constexpr (T::kRegFp8) {
    // Column n of n tile nt is head dim n * kNt + nt (compute); this thread holds n = 2 t4 + {0,1}.
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c >> 1), col = (2 * t4 + (c & 1)) * kNt + nt;
        mo[(warp * kRows + row) * lay.merge_o_row + col] = o[nt][c];
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      if (nt < nt_active) {
        float* dst = mo + (warp * kRows + g) * lay.merge_o_row + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(dst) = make_float2(o[nt][0], o[nt][1]);
        *reinterpret_cast<float2*>(dst + 8 * lay.merge_o_row) = make_float2(o[nt][2], o[nt][3]);
      }
    }
  }
  if (t4 == 0) {
    mml[(warp * kRows + g) * 2] = m[0];
    mml[(warp * kRows + g) * 2 + 1] = l[0];
    mml[(warp * kRows + g + 8) * 2] = m[1];
    mml[(warp * kRows + g + 8) * 2 + 1] = l[1];
  }
  __syncthreads();

  const int c8_per_row = head_size / 8;
  for (int item = threadIdx.x; item < kRows * c8_per_row; item += T::kThreads) {
    const int row = item / c8_per_row, c8 = item - row * c8_per_row;
    if (row >= w.num_rows) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) mx = fmaxf(mx, mml[(wi * kRows + row) * 2]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) {
      const float wgt = exp2f(mml[(wi * kRows + row) * 2] - base);
      sum += mml[(wi * kRows + row) * 2 + 1] * wgt;
      if (wgt > 0.0f) {
        const float4* src =
            reinterpret_cast<const float4*>(mo + (wi * kRows + row) * lay.merge_o_row + c8 * 8);
        const float4 a = src[0], b = src[1];
        acc[0] += wgt * a.x, acc[1] += wgt * a.y, acc[2] += wgt * a.z, acc[3] += wgt * a.w;
        acc[4] += wgt * b.x, acc[5] += wgt * b.y, acc[6] += wgt * b.z, acc[7] += wgt * b.w;
      }
    }
    const float inv = sum > 0.0f ? p.v_scale / sum : 0.0f;
    const float lse2 = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= inv;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.group, head = w.kv_head * p.group + pr % p.group;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
      float4* dst = reinterpret_cast<float4*>(p.partial_o + at * head_size + c8 * 8);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      if (c8 == 0) p.partial_lse[at] = lse2;
    } else {
      store_final<T::act>(p, t, head, c8, acc, lse2);
    }
  }
}

// Raises the kernel's dynamic shared memory limit once per device (benign if two threads race).
template <class T>
void prepare_decode(int device) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  PAGEDATTN_CUDA_CHECK(cudaFuncSetAttribute(
      decode_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::max_layout().total));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <class T>
void DecodeOps<T>::launch(const AttnParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid(unsigned(p.num_seqs) * unsigned(p.num_kv_heads) * unsigned(p.num_q_tiles),
                  unsigned(p.num_splits));
  if (grid.x == 0 || grid.y == 0) return;
  int device = 0;
  PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  prepare_decode<T>(device);
  const int smem = layout_for<T>(p.head_size, p.kv_dtype).total;
  launch_with_pdl(decode_kernel<T>, grid, dim3(T::kThreads), smem, stream, p, pdl);
}

template <class T>
int DecodeOps<T>::ctas_per_sm(int device) {
  prepare_decode<T>(device);
  int n = 0;
  PAGEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, decode_kernel<T>, T::kThreads, T::max_layout().total));
  return n;
}

}  // namespace pagedattn::cuda::decode
