// Paged attention for long queries (prefill, chunked prefill, prefix-cached prompts, encoder
// attention): the portable tensor-core kernel (mma.sync, sm_80 and later).
//
// Map
//   computes  what the decode kernel computes (spec section 4 / docs/semantics.md: soft cap,
//             ALiBi, causal offset, sliding window, sinks, fp8 K/V with k_scale folded into
//             the logit scale and v_scale into the output, natural-log LSE), for the requests
//             whose packed rows q_len * G exceed p.route_rows; the decode kernel takes the
//             others in the same step (no host synchronisation decides the split).
//   grid      x = num_q_tiles * num_seqs * num_kv_heads: groups of p.pair_group (request, KV
//             head) pairs slowest (the CTAs running at once share their K/V in L2), then the q
//             tile, reversed so the tiles with the most causal keys start first, then the pair
//             (prefill_work); y = num_splits (the decode
//             family's split-KV partials and combine). A CTA owns kBlockM = 128 packed rows
//             (row p = token p / G, head kv_head * G + p % G: one K/V tile feeds every query
//             head of its KV head) and the keys of its split.
//   warps     4 warps x 32 rows (d <= 128) or 8 warps x 16 rows; each warp owns its rows
//             whole (FlashAttention-2's split of Q across warps: no merge at the end) and
//             skips the tiles that its rows cannot see (causal diagonal, window edges).
//   loads     Q once by cp.async; K and V of kBlockN = 32-64 keys (config.h) per stage into a
//             two-stage ring by 16-byte cp.async.cg from the rows the block table names
//             (zero-filled past the split), one CTA barrier per tile. The rows' byte offsets come
//             from a smem table that kBlockN threads fill two tiles ahead (one block-table read per
//             row, not per 16-byte chunk: a per-chunk lookup costs ~115 instructions per
//             copy pair [SASS]). fp8 stages are widened exactly to the
//             activation type in shared memory (attn::Fp8Widen) before the MMAs read them.
//   math      S = Q K^T and O += P V by mma.sync m16n8k16 with fp32 accumulation, operands by
//             ldmatrix from padded rows; online softmax in log2 units with P rounded to the
//             activation type (the reference's low-precision model).
//   budget    smem: config.h (104 KB at d128 bf16: two CTAs per SM; 198 KB at d256); registers:
//             O is kMt * head_size / 2 floats and S kMt * 32 floats per thread.
//   test      `backend_ops test --device cuda` (every feature against float64) with
//             --cuda-option prefill=all --cuda-option prefill_kernel=portable (ctest -L gpu),
//             tests/cuda; time with bench/gpu/bench_prefill --cuda-option
//             prefill_kernel=portable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/fp8.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/config.h"
#include "cuda/prefill/host.cuh"
#include "cuda/prefill/launch.h"
#include "cuda/prefill/softmax.cuh"

namespace pagedattn::cuda::prefill {

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm)
    prefill_kernel(const __grid_constant__ AttnParams p) {
  constexpr int D = T::head_size;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kNt = D / 8, kKs = D / 16, kSn = kBlockN / 8, kMt = T::kMt;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr bool kFp8 = T::kv == KVKind::kFp8;
  constexpr SmemLayout lay = T::layout();
  constexpr int kCpr = D * T::kKvBytes / 16;  // 16-byte chunks per cache row
  extern __shared__ __align__(128) unsigned char smem[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;

  // Metadata, Q and the cache may come from the previous kernels of the stream
  // (programmatic dependent launch, as the decode kernel).
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();

  attn::Work w;
  if (!prefill_work(p, T::kBlockM, T::kSplitAlign, int(blockIdx.x), int(blockIdx.y), w)) return;

  // This warp's rows and the keys they can see (tiles outside span.lo..hi are skipped).
  const int wrow0 = warp * T::kRowsPerWarp;
  const float kf = attn::k_factor_of(p, w.kv_head);  // the KV head's k_scale, or 1
  const bool warp_active = wrow0 < w.num_rows;
  const RowsSpan span = warp_active
                            ? rows_span(p, w, wrow0, min(wrow0 + T::kRowsPerWarp, w.num_rows) - 1)
                            : RowsSpan{};

  // ---- Q tile (first copy group, with K/V tile 0) ----
  {
    constexpr int kQChunks = D / 8;
    for (int c = threadIdx.x; c < T::kBlockM * kQChunks; c += T::kThreads) {
      const int row = c / kQChunks, col = c - row * kQChunks;
      copy_q_chunk<T::act>(p, w, row, col, smem + row * lay.q_row_bytes + col * 16);
    }
  }

  // ---- K/V stage copies: chunk c of a tile's rows goes to thread c % kThreads ----
  const KvRows kv(p, w, T::kKvBytes);
  const char* const k_head = kv.k_head;
  const char* const v_head = kv.v_head;
  const int n_tiles = ceil_div(w.kv_end - w.kv_begin, kBlockN);
  // Row offsets of tile k into slot k % 2 of the table: one row per thread of the first
  // kBlockN; -1 marks a row past the split (zero-filled, masked).
  int64_t* const row_table = reinterpret_cast<int64_t*>(smem + lay.rows_offset);
  auto lookup = [&](int k) {
    if (int(threadIdx.x) >= kBlockN || k >= n_tiles) return;
    const int pos = w.kv_begin + k * kBlockN + int(threadIdx.x);
    int64_t k_off = -1, v_off = -1;
    if (pos < w.kv_end) kv.offsets(p, w, pos, k_off, v_off);
    int64_t* slot = row_table + (k & 1) * 2 * kBlockN;
    slot[2 * threadIdx.x] = k_off;
    slot[2 * threadIdx.x + 1] = v_off;
  };
  auto issue = [&](int stage, int k) {
    unsigned char* const sk = smem + lay.stage_offset + stage * lay.stage_bytes;
    unsigned char* const sv = sk + kBlockN * lay.kv_row_bytes;
    const int64_t* const slot = row_table + (k & 1) * 2 * kBlockN;
#pragma unroll
    for (int i = 0; i < ceil_div(kBlockN * kCpr, T::kThreads); ++i) {
      const int c = i * T::kThreads + int(threadIdx.x);
      if (kBlockN * kCpr % T::kThreads != 0 && c >= kBlockN * kCpr) break;
      const int row = c / kCpr, col = c - row * kCpr;
      const longlong2 offs = reinterpret_cast<const longlong2*>(slot)[row];
      const RowChunk kc = row_chunk(p.head_size, col, T::kKvBytes);
      const RowChunk vc = row_chunk(p.v_head_size, col, T::kKvBytes);
      const bool k_ok = offs.x >= 0 && kc.bytes > 0, v_ok = offs.x >= 0 && vc.bytes > 0;
      const int64_t k_off = k_ok ? offs.x + kc.offset : 0, v_off = v_ok ? offs.y + vc.offset : 0;
      const uint32_t dk = sm80::smem_addr(sk + row * lay.kv_row_bytes + col * 16);
      const uint32_t dv = sm80::smem_addr(sv + row * lay.kv_row_bytes + col * 16);
      sm80::cp_async_16(dk, k_head + k_off, k_ok ? 16 : 0, 0);
      sm80::cp_async_16(dv, v_head + v_off, v_ok ? 16 : 0, 0);
    }
  };

  float o[kMt][kNt][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0;
  }
  float m[kMt][2], l[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

  // ldmatrix lane addresses (decode/kernel.cuh has the matrix order): Q as A, K as B of
  // S = Q K^T, V as B of O = P V (transposed).
  const int mi = lane >> 3, r8 = lane & 7;
  const uint32_t q_lane =
      sm80::smem_addr(smem) + (wrow0 + (mi & 1) * 8 + r8) * lay.q_row_bytes + (mi >> 1) * 16;
  const int kb_row = (mi >> 1) * 8 + r8, kb_col = (mi & 1) * 8;
  const int vb_row = (mi & 1) * 8 + r8, vb_col = (mi >> 1) * 8;
  [[maybe_unused]] const attn::Fp8Widen<T::act> fp8(p.kv_dtype == int(DType::kFp8E5M2));

  lookup(0);
  lookup(1);
  __syncthreads();
  if (n_tiles > 0) issue(0, 0);
  sm80::cp_async_commit();
  for (int k = 0; k < n_tiles; ++k) {
    if (k + 1 < n_tiles) issue((k + 1) % kStages, k + 1);
    sm80::cp_async_commit();
    // Slot k % 2 was read by issue(k) in the previous iteration, before its closing barrier;
    // tile k + 2 is read by issue(k + 2) after this iteration's closing barrier.
    lookup(k + 2);
    sm80::cp_async_wait<1>();
    __syncthreads();  // tile k (and Q) visible to every warp
    const unsigned char* kt = smem + lay.stage_offset + (k % kStages) * lay.stage_bytes;
    int row_bytes = lay.kv_row_bytes;
    if constexpr (kFp8) {
      // 16 fp8 codes -> 16 16-bit values per chunk, K rows then V rows.
      unsigned char* const conv = smem + lay.conv_offset;
      for (int c = threadIdx.x; c < 2 * kBlockN * (D / 16); c += T::kThreads) {
        const int row = c / (D / 16), col = c - row * (D / 16);
        const uint4 raw = *reinterpret_cast<const uint4*>(kt + row * lay.kv_row_bytes + col * 16);
        const uint32_t wds[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t out[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t lo = fp8.lo(wds[i]), hi = fp8.hi(wds[i]);  // bytes {0, 2}, {1, 3}
          out[2 * i] = sm80::prmt(lo, hi, 0x5410);
          out[2 * i + 1] = sm80::prmt(lo, hi, 0x7632);
        }
        uint4* dst = reinterpret_cast<uint4*>(conv + row * lay.conv_row_bytes + col * 32);
        dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
        dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
      }
      __syncthreads();
      kt = conv;
      row_bytes = lay.conv_row_bytes;
    }
    const int ts = w.kv_begin + k * kBlockN;
    if (warp_active && ts < span.hi && ts + kBlockN > span.lo) {  // warp-uniform
      const bool need_mask = !(ts >= span.mask_lo && ts + kBlockN <= span.mask_hi);
      float s[kMt][kSn][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kSn; ++nt)
          s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0;
      }
      const uint32_t k_lane = sm80::smem_addr(kt) + kb_row * row_bytes + kb_col * 2;
#pragma unroll
      for (int ks = 0; ks < kKs; ++ks) {
        uint32_t a[kMt][4];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
          sm80::ldmatrix_x4(a[mt], q_lane + mt * 16 * lay.q_row_bytes + ks * 32);
#pragma unroll
        for (int np = 0; np < kSn / 2; ++np) {
          uint32_t b[4];
          sm80::ldmatrix_x4(b, k_lane + np * 16 * row_bytes + ks * 32);
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) {
            sm80::mma_16816<kBF16>(s[mt][2 * np], a[mt], b[0], b[1]);
            sm80::mma_16816<kBF16>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        float corr[2];
        softmax_scores<kSn>(p, w, s[mt], wrow0 + mt * 16 + g, ts, need_mask, t4, m[mt], l[mt], corr,
                            make_float2(kf, kf));
        rescale_o(o[mt], corr);
      }
      const uint32_t v_lane =
          sm80::smem_addr(kt + kBlockN * row_bytes) + vb_row * row_bytes + vb_col * 2;
#pragma unroll
      for (int kk = 0; kk < kSn / 2; ++kk) {
        uint32_t pa[kMt][4];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) pack_p<T::act>(s[mt], kk, pa[mt]);
#pragma unroll
        for (int np = 0; np < kNt / 2; ++np) {
          uint32_t b[4];
          sm80::ldmatrix_x4_trans(b, v_lane + kk * 16 * row_bytes + np * 32);
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) {
            sm80::mma_16816<kBF16>(o[mt][2 * np], pa[mt], b[0], b[1]);
            sm80::mma_16816<kBF16>(o[mt][2 * np + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  sm80::cp_async_wait<0>();

  // ---- rows out ----
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
    store_rows<T::act>(p, w, o[mt], m[mt], l[mt], wrow0 + mt * 16 + g, t4);
}

template <class T>
void PrefillOps<T>::launch(const AttnParams& p, cudaStream_t stream) {
  PrefillHost<T>::template launch<prefill_kernel<T>>(p, stream);
}

template <class T>
int PrefillOps<T>::ctas_per_sm(int device) {
  return PrefillHost<T>::template ctas_per_sm<prefill_kernel<T>>(device);
}

}  // namespace pagedattn::cuda::prefill
