// The Hopper prefill kernel's output rows through shared memory: a warp's 16 rows of O go as
// bf16 / fp16 into its own rows of the work tile's Q buffer (free once the warpgroup's last S
// has read them) by stmatrix, come back as 16-byte chunks of whole rows, and leave as 16-byte
// global stores. store_rows (the portable kernel's) stores 4 bytes per instruction from the
// fragment layout: at d128 1k its stores were 8.7% of the consumers' warp samples [ncu].
#pragma once

#include <cuda/ptx>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/stmatrix.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/common.cuh"

namespace pagedattn::cuda::prefill {

/// Whether store_rows_staged takes the output: one split (no float partial rows) and rows
/// whose base and strides allow 16-byte stores.
__device__ __forceinline__ bool staged_store(const AttnParams& p) {
  return p.num_splits == 1 && p.vec_out;
}

/// o / m / l: the warp's fragment rows wrow0 + g and wrow0 + g + 8 of the work tile (wrow0 a
/// multiple of 16), as store_rows takes them. rows: the shared-window address of row wrow0 in
/// the first 128-byte-swizzled panel, panels panel_bytes apart; every wgmma that read them must
/// be complete. q_empty: the staging buffer's `empty` barrier, arrived on by every lane once
/// its rows are read back (before the global stores, which the proxy fence would otherwise
/// order too).
template <DType kAct, int kNt>
__device__ __forceinline__ void store_rows_staged(const AttnParams& p, const attn::Work& w,
                                                  const float (&o)[kNt][4], const float (&m)[2],
                                                  const float (&l)[2], int wrow0, uint32_t rows,
                                                  uint32_t panel_bytes, int lane,
                                                  uint64_t* q_empty) {
  namespace ptx = ::cuda::ptx;
  constexpr int kChunks = kNt, kPasses = 16 * kChunks / 32;
  static_assert(kNt % 2 == 0 && (16 * kChunks) % 32 == 0);
  const int g = lane >> 2;
  float lse2[2], factor[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    lse2[h] = sum > 0.0f ? m[h] + log2f(sum) : -INFINITY;
    factor[h] = sum > 0.0f ? attn::v_scale_of(p, w.kv_head) / sum : 0.0f;
    if (p.sinks != nullptr) {
      apply_sink(p, w.kv_head * p.group + (w.row0 + wrow0 + g + 8 * h) % p.group, lse2[h],
                 factor[h]);
    }
  }
  // Tiles (column block nt, rows 0-7), (nt, rows 8-15), (nt + 1, 0-7), (nt + 1, 8-15): lane l
  // addresses row l % 8 of tile l / 8. The swizzle keeps the eight rows of a tile on distinct
  // banks.
  {
    const int tile = lane >> 3, r = (tile & 1) * 8 + (lane & 7);
    auto pk = [&](int nt, int h) {
      return pack2<kAct>(o[nt][2 * h] * factor[h], o[nt][2 * h + 1] * factor[h]);
    };
#pragma unroll
    for (int nt = 0; nt < kNt; nt += 2) {
      const int c = nt + (tile >> 1);
      sm90::stmatrix_x4(rows + (c >> 3) * panel_bytes + sm90::sw128_offset(r, c & 7), pk(nt, 0),
                        pk(nt, 1), pk(nt + 1, 0), pk(nt + 1, 1));
    }
  }
  __syncwarp();
  // Pass i: lane l reads chunk idx % kChunks of row idx / kChunks (idx = 32 i + l); a quarter
  // warp's eight 16-byte reads are one row's 128 bytes of a panel.
  uint4 chunk[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int idx = 32 * i + lane, r = idx / kChunks, c = idx - r * kChunks;
    chunk[i] = sm80::lds128(rows + (c >> 3) * panel_bytes + sm90::sw128_offset(r, c & 7));
  }
  // The generic writes and reads of the rows before the producer's next Q (TMA: async proxy)
  // lands in them.
  ptx::fence_proxy_async(ptx::space_shared);
  ptx::mbarrier_arrive(q_empty);

  // Lanes l and l + 16: row wrow0 + l % 16's element offset in out (-1 past the work tile).
  int64_t at = -1;
  int t = 0, head = 0;
  const int row = wrow0 + (lane & 15);
  if (row < w.num_rows) {
    const int pr = w.row0 + row;
    t = w.q_begin + pr / p.group;
    head = w.kv_head * p.group + pr % p.group;
    at = int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head;
  }
  char* const out = static_cast<char*>(p.out);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int idx = 32 * i + lane, r = idx / kChunks, c = idx - r * kChunks;
    const int64_t row_at = __shfl_sync(0xffffffffu, at, r);
    if (row_at >= 0 && c * 8 < p.v_head_size) {  // past it: a bucket's padding columns
      *reinterpret_cast<uint4*>(out + (row_at + c * 8) * kElemBytes<kAct>) = chunk[i];
    }
  }
  if (p.lse != nullptr) {
    // Row r's LSE is lse2[r / 8] of lane 4 (r % 8).
    const float lo = __shfl_sync(0xffffffffu, lse2[0], 4 * (lane & 7));
    const float hi = __shfl_sync(0xffffffffu, lse2[1], 4 * (lane & 7));
    if (lane < 16 && at >= 0) {
      const float v = lane & 8 ? hi : lo;
      const int64_t li = int64_t(head) * p.lse_stride_head + int64_t(t) * p.lse_stride_token;
      if (p.lse_is_f64) {
        static_cast<double*>(p.lse)[li] = double(v * kLn2);
      } else {
        static_cast<float*>(p.lse)[li] = v * kLn2;
      }
    }
  }
}

}  // namespace pagedattn::cuda::prefill
