// The decode kernel's CTA setup: which rows and keys a CTA owns, a thread's two rows, the
// problem's sizes, and the Q tile (global loads to registers, then shared memory in the order
// the products read it). The map is kernel.cuh's.
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

namespace pagedattn::cuda::decode {

using attn::AttnParams;
using attn::bf16x2_to_f16x2;
using attn::bf16x8_abs_max_bits;
using attn::ceil_div;
using attn::kLog2e;
using attn::kv_elem_bytes;
using attn::pow2f;
using attn::q_row_shift;
using attn::row_range;
using attn::RowRange;
using attn::ThreadRow;
using attn::Work;

/// The shared-memory layout a launch of instance T uses for this problem.
/// `head_size` is the problem's (any multiple of 8 up to kMaxHeadSize on the generic kernel,
/// which lays its rows out at the next multiple of 16).
template <class T>
__host__ __device__ constexpr SmemLayout layout_for(int head_size, int kv_dtype) {
  if constexpr (T::kMma) {
    return T::max_layout();
  } else {
    return smem_layout(padded_head_size(head_size), kv_elem_bytes(kv_dtype), false, true, T::kWarps,
                       T::kStages);
  }
}

/// Columns of O per thread: head_size / 8 n tiles of 8 (the generic kernel sizes for the max).
template <class T>
inline constexpr int kNtOf = (T::kMma ? T::head_size : kMaxHeadSize) / 8;

// The CTA's dynamic shared memory (config.h, smem_layout). Every stage names the one extern
// array instead of taking a pointer to it, so that the compiler folds the layout's constant
// offsets into the addresses as it does in one function.
__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(128) unsigned char smem[];
  return smem;
}

/// This thread's warp and lane, and its place in the mma fragment layout.
struct Lane {
  int warp, lane;
  int g, t4;  // fragment row group and thread in group
};
__device__ __forceinline__ Lane lane_ids() {
  Lane ln;
  ln.warp = threadIdx.x >> 5, ln.lane = threadIdx.x & 31;
  ln.g = ln.lane >> 2, ln.t4 = ln.lane & 3;
  return ln;
}

/// The problem's sizes as this instance sees them: compile-time for the tensor-core instances,
/// read from the parameters by the generic one. `head_size` is the width the kernel computes
/// at (the instance's bucket, or the generic kernel's next multiple of 16); `cols` is the
/// problem's head size (p.head_size <= head_size) and `v_cols` V's (p.v_head_size <= cols).
/// Columns cols .. head_size - 1 of Q and K, and v_cols .. head_size - 1 of V, are zeros in
/// shared memory (never read from global memory): they add 0 to every score and give output
/// columns that are never stored.
template <class T>
struct Shape {
  int head_size;       // columns of the smem rows and of the products
  int cols;            // columns of Q and K in global memory
  int v_cols;          // columns of V and O in global memory
  int nt_active;       // n tiles of 8 columns that the products cover (head_size / 8)
  SmemLayout lay;      // the dynamic shared memory of this launch
  int kv_bytes;        // bytes per cache element
  int chunks_per_row;  // 16-byte chunks per smem cache row
  __device__ __forceinline__ explicit Shape(const AttnParams& p) {
    head_size = T::kMma ? kNtOf<T> * 8 : padded_head_size(p.head_size);
    cols = p.head_size;
    v_cols = p.v_head_size;
    nt_active = head_size / 8;
    lay = layout_for<T>(p.head_size, p.kv_dtype);
    kv_bytes = T::kMma ? T::kKvBytes : kv_elem_bytes(p.kv_dtype);
    chunks_per_row = head_size * kv_bytes / 16;
  }
};

// The CTA's request, KV head and first packed row (grid.x: q tile fastest, then KV head, then
// request).
template <class T>
__device__ __forceinline__ void cta_tile(const AttnParams& p, Work& w) {
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

// The CTA's rows (it has some: cta_tile's row0 < rows_total) and the keys of its split
// (grid.y). lo_max / hi_min: tiles [lo_max, hi_min) need no mask for any row.
template <class T>
__device__ __forceinline__ void cta_split(const AttnParams& p, int rows_total, Work& w, int& lo_max,
                                          int& hi_min) {
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
  lo_max = max(last.lo, w.kv_begin), hi_min = min(first.hi, w.kv_end);
}

// The two rows this thread owns in the fragment layout (g and g + 8): visible keys clamped to
// the split, position, ALiBi slope and score multipliers.
__device__ __forceinline__ void thread_rows(const AttnParams& p, const Work& w,
                                            ThreadRow (&rows)[2]) {
  const int g = lane_ids().g;
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
    const float kf = attn::k_factor_of(p, w.kv_head);  // the KV head's k_scale, or 1
    rows[h].score2 = p.scale_log2 * kf;
    rows[h].cap_arg = p.softcap_arg_scale * kf;
  }
}

/// Q chunks (16 bytes) each thread of a tensor-core instance loads to registers.
template <class T>
inline constexpr int kQPerThread = T::kMma ? ceil_div(kRows*(T::kMma ? T::head_size : 8) / 8,
                                                      T::kThreads)
                                           : 1;

// Chunk `col` (8 elements) of packed row `row` of Q: [num_tokens, num_heads, head_size] at
// token q_begin + (row0 + row) / G, head kv_head * G + (row0 + row) % G; nullptr for padding.
template <class T>
__device__ __forceinline__ const char* q_src(const AttnParams& p, const Work& w, int row, int col) {
  if (row >= w.num_rows || col * 8 >= p.head_size) return nullptr;  // padding: zeros
  const int pr = w.row0 + row;
  const int head = w.kv_head * p.group + pr % p.group;
  return static_cast<const char*>(p.q) + ((int64_t(w.q_begin) + pr / p.group) * p.q_stride_token +
                                          int64_t(head) * p.q_stride_head + col * 8) *
                                             kElemBytes<T::act>;
}

// Tensor-core instances: this thread's chunks of the Q tile [kRows][head_size], raw activation
// bits (zeros for padding rows). They go out first, and reach shared memory (store_q) after the
// first K/V copies are issued, so the two latencies overlap.
template <class T>
__device__ __forceinline__ void load_q(const AttnParams& p, const Work& w, const Shape<T>& sh,
                                       uint4 (&q_raw)[kQPerThread<T>]) {
  const int q_chunks = sh.head_size / 8;  // 8 elements per chunk
  if constexpr (T::kMma) {
#pragma unroll
    for (int i = 0; i < kQPerThread<T>; ++i) {
      const int c = int(threadIdx.x) + i * T::kThreads;
      const int row = c / q_chunks, col = c - row * q_chunks;
      const char* src = c < kRows * q_chunks ? q_src<T>(p, w, row, col) : nullptr;
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
}

// The fp8 kernel's bf16 rows: each row's largest |q| (q_row_shift), in the Q area's padding
// (the fragments take head_size * 32 of its kRows * q_row_bytes bytes).
template <class T>
__device__ __forceinline__ uint32_t* q_row_max_of() {
  unsigned char* const smem = dyn_smem();
  static_assert(!T::kRegFp8 || T::head_size * 32 + kRows * 4 <= kRows * (2 * T::head_size + 16));
  return reinterpret_cast<uint32_t*>(smem + (T::kMma ? T::head_size : 0) * 32);
}

// Q bits -> smem. Row-major (ldmatrix reads it) except for the in-register fp8 kernel, whose
// S = Q K^T reduces over head dims in a lane-contiguous order (tile.cuh): there the tile is
// stored in A-fragment order, [k step][lane][a0..a3], one 16-byte load per k step. The generic
// kernel loads and stores float rows here.
template <class T>
__device__ __forceinline__ void store_q(const AttnParams& p, const Work& w, const Shape<T>& sh,
                                        const uint4 (&q_raw)[kQPerThread<T>],
                                        [[maybe_unused]] const uint32_t* q_row_max) {
  unsigned char* const smem = dyn_smem();
  const SmemLayout& lay = sh.lay;
  const int q_chunks = sh.head_size / 8;
  if constexpr (T::kMma) {
#pragma unroll
    for (int i = 0; i < kQPerThread<T>; ++i) {
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
      const char* src = q_src<T>(p, w, row, col);
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
}

// The Q tile into shared memory, visible to the CTA. The fp8 kernel's bf16 rows first find
// their largest |q| (q_row_shift) and then carry the power of two they were scaled by in their
// score multipliers.
template <class T>
__device__ __forceinline__ void q_to_smem(const AttnParams& p, const Work& w, const Shape<T>& sh,
                                          const uint4 (&q_raw)[kQPerThread<T>],
                                          ThreadRow (&rows)[2]) {
  const int q_chunks = sh.head_size / 8, g = lane_ids().g;
  [[maybe_unused]] uint32_t* const q_row_max = q_row_max_of<T>();
  if constexpr (T::kRegFp8 && T::act == DType::kBF16) {
    if (threadIdx.x < kRows) q_row_max[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kQPerThread<T>; ++i) {
      const int c = int(threadIdx.x) + i * T::kThreads;
      if (c < kRows * q_chunks) atomicMax(&q_row_max[c / q_chunks], bf16x8_abs_max_bits(q_raw[i]));
    }
    __syncthreads();
  }
  store_q<T>(p, w, sh, q_raw, q_row_max);
  __syncthreads();
  if constexpr (T::kRegFp8 && T::act == DType::kBF16) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float undo = pow2f(-q_row_shift(q_row_max[g + 8 * h]));
      rows[h].score2 *= undo;
      rows[h].cap_arg *= undo;
    }
  }
}

}  // namespace pagedattn::cuda::decode
