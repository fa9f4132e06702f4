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
//             row, not per 16-byte chunk: the per-chunk lookup cost ~115 instructions per
//             copy pair in the SASS of the first version). fp8 stages are widened exactly to the
//             activation type in shared memory (attn::Fp8Widen) before the MMAs read them.
//   math      S = Q K^T and O += P V by mma.sync m16n8k16 with fp32 accumulation, operands by
//             ldmatrix from padded rows; online softmax in log2 units with P rounded to the
//             activation type (the reference's low-precision model).
//   budget    smem: config.h (104 KB at d128 bf16: two CTAs per SM; 198 KB at d256); registers:
//             O is kMt * head_size / 2 floats and S kMt * 32 floats per thread.
//   test      `backend_ops test --device cuda` (every feature against float64, with
//             PAGEDATTN_CUDA_PREFILL=all for every shape), tests/cuda; time with
//             bench/gpu/bench_decode --prefill.
#pragma once

#include <algorithm>
#include <atomic>
#include <cfloat>

#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/fp8.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/device_props.h"
#include "cuda/common/launch.cuh"
#include "cuda/prefill/config.h"
#include "cuda/prefill/launch.h"
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

// Scale, soft cap, ALiBi and mask of one kBlockN-key tile of S for one m16 tile (this
// thread's rows row_a and row_a + 8), then the online-softmax update of m and l: s becomes P
// and corr the factor O must be rescaled by (rescale_o; the Hopper kernel does that only once
// the previous P V has finished). kFeatures false compiles soft cap and ALiBi out: their
// branches alone made ptxas spill 20-100 bytes in the Hopper kernel's main loop. `undo`: the
// factors of rows row_a and row_a + 8 that undo a scaling of their Q rows (1 without one).
template <int kSn, bool kFeatures = true>
__device__ __forceinline__ void softmax_scores(const AttnParams& p, const attn::Work& w,
                                               float (&s)[kSn][4], int row_a, int tile_start,
                                               bool need_mask, int t4, float (&m)[2], float (&l)[2],
                                               float (&corr)[2], float2 undo = {1.0f, 1.0f}) {
  // Without soft cap or ALiBi the scores stay raw and the scale joins the exponent (one FFMA
  // per score instead of a multiply and a subtraction; max(s) * f = max(s * f) for f > 0).
  // At least FLT_MIN: a row scaled up by 2^126 (its largest |q| below 2^-112) under a tiny
  // k_scale would get f = 0 and its masked scores -inf * 0 = NaN. Raising f to 2^-126 moves
  // such a row's scores (|raw| < 2^40 after the scaling) by less than 2^-86.
  float f[2] = {fmaxf(p.scale_log2 * undo.x, FLT_MIN), fmaxf(p.scale_log2 * undo.y, FLT_MIN)};
  if (kFeatures && p.softcap > 0.0f) {
    const float arg[2] = {p.softcap_arg_scale * undo.x, p.softcap_arg_scale * undo.y};
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[nt][c] = p.softcap_log2 * tanhf(s[nt][c] * arg[c >> 1]);
      }
    }
    f[0] = f[1] = 1.0f;
  } else if (kFeatures && p.alibi_slopes != nullptr) {
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nt][c] *= f[c >> 1];
    }
    f[0] = f[1] = 1.0f;
  }
  const bool alibi = kFeatures && p.alibi_slopes != nullptr;
  if (alibi || need_mask) {
    const ThreadRow rows[2] = {thread_row(p, w, row_a), thread_row(p, w, row_a + 8)};
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const ThreadRow& rw = rows[c >> 1];
        const int j = tile_start + nt * 8 + 2 * t4 + (c & 1);
        float x = s[nt][c];
        if (alibi) x += rw.alibi2 * float(j - rw.pos);
        if (need_mask && (j < rw.lo || j >= rw.hi)) x = -INFINITY;
        s[nt][c] = x;
      }
    }
  }
  float base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // a quad holds a row's keys
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx * f[h]);
    base[h] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
    corr[h] = sm80::exp2_approx(m[h] - base[h]);
    m[h] = m_new;
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[nt][c] = sm80::exp2_approx(fmaf(s[nt][c], f[c >> 1], -base[c >> 1]));
      sum[c >> 1] += s[nt][c];
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
}

// P of keys [16 kk, 16 kk + 16) of one m16 tile, packed as the A fragment of the P V product
// (the accumulator layout of S is the A layout of m16n8k16 and of wgmma's register A).
template <DType kAct, int kSn>
__device__ __forceinline__ void pack_p(const float (&s)[kSn][4], int kk, uint32_t (&pa)[4]) {
  pa[0] = pack2<kAct>(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = pack2<kAct>(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = pack2<kAct>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = pack2<kAct>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

template <int kNt>
__device__ __forceinline__ void rescale_o(float (&o)[kNt][4], const float (&corr)[2]) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    o[nt][0] *= corr[0];
    o[nt][1] *= corr[0];
    o[nt][2] *= corr[1];
    o[nt][3] *= corr[1];
  }
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
  if (row < w.num_rows) {
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
  constexpr int D = kNt * 8;
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
    float factor = sum > 0.0f ? p.v_scale / sum : 0.0f;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(w.split) * p.num_actual_tokens + t) * p.num_heads + head;
      float* dst = p.partial_o + at * D + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        *reinterpret_cast<float2*>(dst + nt * 8) =
            make_float2(o[nt][2 * h] * factor, o[nt][2 * h + 1] * factor);
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
      const bool ok = offs.x >= 0;
      const int64_t k_off = ok ? offs.x : 0, v_off = ok ? offs.y : 0;
      const uint32_t dk = sm80::smem_addr(sk + row * lay.kv_row_bytes + col * 16);
      const uint32_t dv = sm80::smem_addr(sv + row * lay.kv_row_bytes + col * 16);
      sm80::cp_async_16(dk, k_head + k_off + col * 16, ok ? 16 : 0, 0);
      sm80::cp_async_16(dv, v_head + v_off + col * 16, ok ? 16 : 0, 0);
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
        softmax_scores<kSn>(p, w, s[mt], wrow0 + mt * 16 + g, ts, need_mask, t4, m[mt], l[mt],
                            corr);
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

// Host side of a prefill kernel `kKernel` of traits T (T::kThreads, T::layout().total), shared
// by the portable and the Hopper kernels: the dynamic shared memory limit raised once per device
// and kernel (benign if two threads race), the launch over q tiles x requests x KV heads and
// splits, and the occupancy the split planner reads.
template <class T>
struct PrefillHost {
  using Kernel = void (*)(AttnParams);
  template <Kernel kKernel>
  static void prepare(int device) {
    static std::atomic<uint64_t> done{0};  // one per kernel: a bit per device
    const uint64_t bit = uint64_t(1) << (device & 63);
    if (done.load(std::memory_order_acquire) & bit) return;
    PAGEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              T::layout().total));
    done.fetch_or(bit, std::memory_order_acq_rel);
  }
  template <Kernel kKernel>
  static void launch(const AttnParams& p, cudaStream_t stream) {
    const dim3 grid(unsigned(p.num_q_tiles) * unsigned(p.num_seqs) * unsigned(p.num_kv_heads),
                    unsigned(p.num_splits));
    if (grid.x == 0 || grid.y == 0) return;
    int device = 0;
    PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    prepare<kKernel>(device);
    launch_with_pdl(kKernel, grid, dim3(T::kThreads), T::layout().total, stream, p);
  }
  // The Hopper kernel's 1-D grid over the work tiles (x fastest, the split slowest, as the 2-D
  // grid above runs them): one CTA per work tile, or p.persistent CTAs (the backend caps it at
  // the resident count), each walking several work tiles.
  template <Kernel kKernel>
  static void launch_tiles(const AttnParams& p, cudaStream_t stream) {
    const int64_t total = int64_t(p.num_q_tiles) * p.num_seqs * p.num_kv_heads * p.num_splits;
    if (total == 0) return;
    int device = 0;
    PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    prepare<kKernel>(device);
    const int64_t ctas = p.persistent > 0 ? std::min(total, int64_t(p.persistent)) : total;
    launch_with_pdl(kKernel, dim3(unsigned(ctas)), dim3(T::kThreads), T::layout().total, stream, p);
  }
  template <Kernel kKernel>
  static int ctas_per_sm(int device) {
    prepare<kKernel>(device);
    int n = 0;
    PAGEDATTN_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, T::kThreads, T::layout().total));
    return n;
  }
};

template <class T>
void PrefillOps<T>::launch(const AttnParams& p, cudaStream_t stream) {
  PrefillHost<T>::template launch<prefill_kernel<T>>(p, stream);
}

template <class T>
int PrefillOps<T>::ctas_per_sm(int device) {
  return PrefillHost<T>::template ctas_per_sm<prefill_kernel<T>>(device);
}

}  // namespace pagedattn::cuda::prefill
