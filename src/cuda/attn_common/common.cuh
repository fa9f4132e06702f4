// What the paged attention kernels (decode, both prefill kernels) share on the device: log2
// units, a CTA's work (request, KV head, rows, keys of its split), the keys a query row may see
// and a thread's row state in the mma fragment layout. The maps are the kernels'
// (decode/kernel.cuh, prefill/portable/kernel.cuh, prefill/sm90/kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/config.h"
#include "cuda/attn_common/params.h"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"

namespace pagedattn::cuda::attn {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

/// Bytes of one element of a cache dtype given as a DType code.
__host__ __device__ constexpr int kv_elem_bytes(int dtype) {
  return dtype == int(DType::kF32)
             ? 4
             : (dtype == int(DType::kF16) || dtype == int(DType::kBF16) ? 2 : 1);
}

// The keys query row `row` (0-based inside the CTA) may see: [lo, hi), at absolute position pos.
struct RowRange {
  int lo = 0, hi = 0, pos = 0;
};

struct Work {
  int r, kv_head, row0, num_rows, q_begin, q_len, kv_len;
  int kv_begin, kv_end;  // this split's keys
  int split;             // which split (the partials' index) (prefill kernels)
};

__device__ __forceinline__ RowRange row_range(const AttnParams& p, const Work& w, int row) {
  RowRange rr;
  const int i = (w.row0 + row) / p.group;  // query token of the packed row
  rr.pos = w.kv_len - w.q_len + i;
  rr.lo = 0;
  rr.hi = w.kv_len;
  if (p.causal) rr.hi = min(rr.hi, rr.pos + 1);
  if (p.window_left >= 0) rr.lo = max(0, rr.pos - p.window_left);
  if (p.window_right >= 0) rr.hi = min(rr.hi, rr.pos + p.window_right + 1);
  return rr;
}

// State of one of the two rows a thread owns in the mma fragment layout (rows g and g + 8).
struct ThreadRow {
  int lo, hi;    // visible keys clamped to the split; lo >= hi for padding rows
  int pos;       // absolute position of the query token
  float alibi2;  // ALiBi slope * log2(e), 0 without ALiBi
  /// Multipliers of the raw q.k of this row: to log2 units (scale * k_scale * log2 e) and to
  /// the soft cap's tanh argument; both also undo the power of two the fp8 kernel scales a
  /// bf16 query row by (decode_kernel, store_q).
  float score2 = 0.0f, cap_arg = 0.0f;
};

}  // namespace pagedattn::cuda::attn
