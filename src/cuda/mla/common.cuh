// The MLA decode kernels' shared pieces: what one CTA computes (its request, rows and keys) and
// the CTA's mbarriers (the launch is cuda/common/launch.cuh's). The map is kernel.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/common/check.h"
#include "cuda/common/launch.cuh"
#include "cuda/mla/config.h"
#include "cuda/mla/params.h"

namespace pagedattn::cuda::mla {

namespace ptx = ::cuda::ptx;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// What one CTA computes: request r, packed rows [row0, row0 + num_rows), keys [kv_begin, kv_end).
struct Work {
  int r, row0, num_rows, q_begin, q_len, kv_len, kv_begin, kv_end;
};

// False when the CTA has no rows (an M tile of block_m rows past its request's q_len * N rows).
__device__ __forceinline__ bool mla_work(const MlaParams& p, int block_m, Work& w) {
  // A request's M tiles, which read the same K/V tiles, are adjacent CTAs: 3-4% faster
  // at 128 heads than request-fastest (the pair num_seqs CTAs apart); 16 heads unchanged.
  const int x = int(blockIdx.x);
  w.r = x / p.num_m_tiles;
  const int tile = x - w.r * p.num_m_tiles;
  w.q_begin = p.query_start_loc[w.r];
  w.q_len = p.query_start_loc[w.r + 1] - w.q_begin;
  w.kv_len = p.seq_lens[w.r];
  w.row0 = tile * block_m;
  const int rows_total = w.q_len * p.num_heads;
  if (w.row0 >= rows_total) return false;
  w.num_rows = min(block_m, rows_total - w.row0);
  // The last row sees the most keys; every key before it is in some row's range.
  const int last_token = (w.row0 + w.num_rows - 1) / p.num_heads;
  const int range_hi = max(0, w.kv_len - w.q_len + last_token + 1);
  const int chunk = ceil_div(ceil_div(range_hi, p.num_splits), kSplitAlign) * kSplitAlign;
  w.kv_begin = min(int(blockIdx.y) * chunk, range_hi);
  w.kv_end = min(w.kv_begin + chunk, range_hi);
  return true;
}

// The CTA's mbarriers: q_full, then full[kStages][kHalves] (producer -> consumers) and
// empty[kStages][kHalves] (consumers -> producer); kStages is the producer's ring (Traits::kRing:
// the 16-bit stages, or fp8's raw slots), h the half of a stage (config.h).
template <int kStages, int kHalves>
struct Barriers {
  uint64_t* base;
  __device__ uint64_t* q_full() const { return base; }
  __device__ uint64_t* full(int s, int h = 0) const { return base + 1 + s * kHalves + h; }
  __device__ uint64_t* empty(int s, int h = 0) const {
    return base + 1 + (kStages + s) * kHalves + h;
  }
};

}  // namespace pagedattn::cuda::mla
