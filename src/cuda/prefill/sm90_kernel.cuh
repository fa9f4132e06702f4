// Paged attention for long queries on Hopper (sm_90a): warp-specialised wgmma kernel.
//
// Map
//   computes  what prefill/kernel.cuh computes (same rows, routing, splits, masks, features and
//             outputs: prefill_work and softmax_scores are shared; the rows go out through
//             shared memory, sm90_epilogue.cuh, or by store_rows), for 16-bit
//             activations over a cache of the same type or fp8 (e4m3 / e5m2, widened by the
//             producer) at head sizes 64 to 256 (multiples of 16; fp8 to 192).
//   grid      1-D over the portable kernel's work tiles (groups of (request, KV head) pairs x
//             q tiles, reversed x pairs of the group, then splits): one CTA per work tile, or a
//             persistent grid (DecodeParams::persistent) whose CTAs walk several, each taking
//             the next number from an atomic counter as soon as it is free (tile_counter;
//             draw_tile in walk.h) or by a static snake; kBlockM = 128 packed rows per work
//             tile, 384 threads.
//   warps     warpgroup 0 (producer, 40 or 56 registers): Q per work tile (two buffers where
//             they fit, so the next one's Q loads during this one's tiles; over a 16-bit cache
//             by TMA from one thread where DecodeParams::q_tma allows), then the K and the V
//             tile of kBlockN keys into two-stage rings of their own. 16-bit caches: warps 0-1
//             bring K and warps 2-3 V, each half on its own loop. Full tiles (head sizes that are
//             multiples of 64, block sizes powers of two >= 8, or an encoder's key tensor) come by
//             TMA (the default; PAGEDATTN_CUDA_PREFILL_COPY=cp.async turns it off): one box per
//             block and panel, issued by the lanes of the half's first warp, completing on the
//             stage's `full` mbarrier by transaction count. Otherwise: row byte offsets from the
//             block table into a smem table, a named barrier of the half, then 16-byte cp.async of
//             every row's chunks into 128-byte-swizzled panels, whose completion arrives on the
//             same barrier (cp.async.mbarrier.arrive.noinc: the producer never waits for its own
//             copies). fp8 caches: all 128 threads bring K and V (staged raw, then widened to
//             f16, the products' type, with a bf16 Q scaled into f16 row by row; or, for the
//             fp8 products, V transposed). Warpgroups 1-2 (consumers, 232 or 224 registers) own
//             64 rows each and overlap the tensor cores with the softmax as FlashAttention-3 does:
//             iteration j issues S_j = Q K_j^T (wgmma SS) and then O += P_{j-1} V_{j-1} (wgmma RS,
//             V MN-major), waits for S_j only, runs the softmax of S_j (the portable kernel's, on
//             the same fragment layout) while P V runs, then waits for P V, rescales O and packs
//             P_j; the two warpgroups take turns to issue (FA3's pingpong). K_j is released as soon
//             as S_j is done, V_{j-1} after its P V: the producer refills K a whole iteration
//             before it is read.
//   sync      mbarriers through CCCL's cuda::ptx (phases flip every kStages tiles); each
//             consumer thread fences the async proxy after a `full` wait, before its wgmmas
//             read what cp.async (generic proxy) wrote.
//   test      backend_ops (cuda, every feature), and the same with PAGEDATTN_CUDA_PREFILL=all;
//             bench/gpu/bench_prefill; the SASS shows HGMMA (docs/kernel_notes.md).
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/kernel.cuh"
#include "cuda/prefill/sm90_epilogue.cuh"

namespace pagedattn::cuda::prefill {

namespace ptx = ::cuda::ptx;

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// The CTA's mbarriers: per Q buffer its `full` (producer -> consumers, once per work tile),
// per stage the K and V `full` and `empty` (consumers -> producer) barriers, per Q buffer its
// `empty`.
template <int kStages>
struct Barriers {
  uint64_t* base;
  __device__ uint64_t* q_full(int b) const { return base + b; }
  __device__ uint64_t* k_full(int s) const { return base + 2 + s; }
  __device__ uint64_t* v_full(int s) const { return base + 2 + kStages + s; }
  __device__ uint64_t* k_empty(int s) const { return base + 2 + 2 * kStages + s; }
  __device__ uint64_t* v_empty(int s) const { return base + 2 + 3 * kStages + s; }
  __device__ uint64_t* q_empty(int b) const { return base + 2 + 4 * kStages + b; }
};

// Tiles j < tma_tiles<T>(p, w) of work tile w come by TMA (produce: full tiles of a 16-bit
// cache at head sizes that are multiples of 64, where p.kv_tma allows and the boxes stay inside
// blocks). kv_tma_rows is a power of two dividing kBlockN, so every tile start is as aligned as
// kv_begin: one test per work tile, none per tile (the consumers ask it between their K wait
// and their S issue, to skip the proxy fence).
template <class T>
inline constexpr bool kTmaTiles = T::head_size % 64 == 0 && T::kv == KVKind::kSame;
template <class T>
__device__ __forceinline__ int tma_tiles(const DecodeParams& p, const decode::Work& w) {
  const bool aligned = p.kv_direct || (w.kv_begin & (p.kv_tma_rows - 1)) == 0;
  return kTmaTiles<T> && p.kv_tma != 0 && aligned ? (w.kv_end - w.kv_begin) / T::kBlockN : 0;
}

// Instances whose Q may come by TMA (DecodeParams::q_tma): those over a 16-bit cache. The fp8
// widening producer (40 registers, the busiest role there) spilled 56 bytes instead of 12 with
// the TMA branch compiled in and lost 4% at d128 16k [H200, same call; ptxas -v].
template <class T>
inline constexpr bool kQTma = T::kv == KVKind::kSame && !T::kFp8Math;

// Work tile k's Q buffer and the phase of its barriers.
template <class T>
__device__ __forceinline__ int q_buffer(int k) {
  return k % T::layout().q_stages;
}
template <class T>
__device__ __forceinline__ uint32_t q_parity(int k) {
  return uint32_t((k / T::layout().q_stages) & 1);
}

// Where a work tile starts in the CTA's stream of them: `it` K/V tiles came before it through
// the rings (their stage and phase follow on), it is work tile number `k` (Q's phase);
// `pingpong` says its consumers take turns, and `turns_open` that an earlier work tile of the
// CTA took them (so warpgroup 0's turn is already open: the last hand-over of that tile).
struct TileSeq {
  int it = 0, k = 0;
  bool pingpong = false, turns_open = false;
};

// The dynamic walk's hand-over (Sm90Layout::tile_offset): thread 0 of the producer writes 1 (-1:
// the CTA's walk is over) and work tile k's Work into Q buffer k's slots once the
// consumers have released the buffer's last use, and arrives on the buffer's `full` barrier,
// whose release orders the writes before the consumers' wait returns: the consumers read the
// Work from shared memory instead of computing it from global memory after that wait.
// `count` arrivals: one beside Q's own (q_full_arrivals), or all of them for the end, which
// loads no Q.
static_assert(sizeof(decode::Work) <= kWorkSlotBytes, "Sm90Layout's Work slots");
// A value every lane of the warp holds, through a shuffle from lane 0 (the warp converged), so
// that ptxas knows it is uniform: with the walk's number and Work read from shared memory under
// the dynamic walk, they were per-thread values in both walks (one loop), and so were the
// rings' stages and phases and the wgmma descriptors derived from them ([SASS d64] most of the
// consumers' uniform-datapath instructions gone; [H200, call 5 of
// 2026-12-04-h200-dynamic-d908f9c.txt] 16k 2-8% slower than before).
__device__ __forceinline__ int warp_uniform(int v) {
  return __shfl_sync(0xffffffffu, v, 0);
}
__device__ __forceinline__ decode::Work warp_uniform(const decode::Work& w) {
  decode::Work u;
  u.r = warp_uniform(w.r);
  u.kv_head = warp_uniform(w.kv_head);
  u.row0 = warp_uniform(w.row0);
  u.num_rows = warp_uniform(w.num_rows);
  u.q_begin = warp_uniform(w.q_begin);
  u.q_len = warp_uniform(w.q_len);
  u.kv_len = warp_uniform(w.kv_len);
  u.kv_begin = warp_uniform(w.kv_begin);
  u.kv_end = warp_uniform(w.kv_end);
  u.split = warp_uniform(w.split);
  return u;
}
template <class T>
__device__ __forceinline__ decode::Work* work_slot(unsigned char* smem, int qb) {
  return reinterpret_cast<decode::Work*>(smem + T::layout().tile_offset + 16 + kWorkSlotBytes * qb);
}
template <class T>
__device__ __forceinline__ void publish_tile(unsigned char* smem, Barriers<T::kStages> bars, int k,
                                             int more, const decode::Work* w, uint32_t count) {
  const int qb = q_buffer<T>(k);
  mbar_wait(bars.q_empty(qb), q_parity<T>(k) ^ 1);
  reinterpret_cast<volatile int*>(smem + T::layout().tile_offset)[qb] = more;
  if (w != nullptr) *work_slot<T>(smem, qb) = *w;
  ptx::mbarrier_arrive(bars.q_full(qb), count);
}

// fp8 products: the producer's loop. K rows land raw (e4m3) in the K panel by cp.async, as the
// 16-bit kernel copies them. fp8 wgmma reads B only K-major, so V [keys][head dims] is staged
// raw (cp.async into a swizzled buffer, two of them alternating) and transposed by the
// producer into Vt [head dims][keys]: each thread turns a 4-key x 4-dim block of bytes
// (four 32-bit reads) into four 32-bit words with byte permutes. Within each 16 keys the
// transposed row holds keys in the order the consumers' P registers hold them (pack_p_e4m3):
// position 4 t + e <- key 2 t + (e & 1) + 8 (e >> 1), so P needs no shuffle. Lanes split as
// 8 (dims) x 4 (keys), and each rotates which of its four words it stores first, so the reads
// and the stores both hit 32 distinct banks.
template <class T, class FillTable>
__device__ __forceinline__ void produce_fp8_math(unsigned char* smem, Barriers<T::kStages> bars,
                                                 int n_tiles, int it0, const char* k_head,
                                                 const char* v_head, FillTable& fill_table) {
  constexpr int D = T::head_size, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kChunks = D / 16;  // 16-byte chunks of a row's codes
  constexpr int kLanes = kChunks <= 4 ? 4 : 8;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockN % 16 == 0 && kBlockN <= 128);
  constexpr Sm90Layout lay = T::layout();
  const int ct = int(threadIdx.x);
  const int col = ct % kLanes, r0 = ct / kLanes;
  // Every chunk of the tile's rows into a 128-byte-swizzled [kBlockN][128] buffer.
  auto copy_rows = [&](uint32_t dst0, const char* head, const int64_t* table, int pick) {
    if (col >= kChunks) return;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int row = r0 + i * kRowsPerPass;
      sm80::cp_async_16(dst0 + sm90::sw128_offset(row, col),
                        head + table[2 * row + pick] + col * 16, 16, 0);
    }
  };
  const int warp = ct >> 5, wl = ct & 7, t = (ct >> 3) & 3;
  const int rot = (wl >> 1) & 3;
  const uint32_t rot_sel = uint32_t(rot) | uint32_t((rot + 1) & 3) << 4 |
                           uint32_t((rot + 2) & 3) << 8 | uint32_t((rot + 3) & 3) << 12;
  constexpr int kDimGroups = D / 32;        // 8 words (32 dims) each
  constexpr int kKeyGroups = kBlockN / 16;  // 16 keys each: one 16-byte chunk of a Vt row
  // Where 4 divides into dim groups (d64, d128) a warp keeps its dims over the key groups,
  // so every address is a per-thread base plus a constant: ncu showed the producer issue-bound
  // (consumers waiting on V's `full` for 20% of their samples) with the addresses recomputed.
  constexpr bool kFixedDims = 4 % kDimGroups == 0;
  constexpr int kDg = kFixedDims ? 4 / kDimGroups : 1;  // key-group step of a warp
  const int dg0 = kFixedDims ? warp % kDimGroups : 0;
  const int kg0 = kFixedDims && kDimGroups < 4 ? warp / kDimGroups : 0;
  // Read offsets of keys kb + {0, 1, 8, 9} (kb = 16 kg + 2 t: a key's swizzle row is
  // (2 t + e) & 7 whatever kg) and store offsets of dims 4 w + (i + rot) & 3 at chunk 0 (the
  // key group's chunk is XORed in), both relative to key group 0.
  auto offsets = [&](int w, uint32_t(&rd)[4], uint32_t(&st)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      rd[e] = sm90::sw128_offset(2 * t + (e & 1) + 8 * (e >> 1), w >> 2) + (w & 3) * 4;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) st[i] = sm90::sw128_offset(4 * w + ((i + rot) & 3), 0) + 4 * t;
  };
  // One 4-key x 4-dim block of key group kg: byte i of each word <- dim (i + rot) & 3, then a
  // 4 x 4 byte transpose.
  auto one_block = [&](uint32_t raw, uint32_t vt, int kg, const uint32_t(&rd)[4],
                       const uint32_t(&st)[4]) {
    uint32_t r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      r[e] = sm80::prmt(sm80::lds32(raw + kg * 16 * 128 + rd[e]), 0, rot_sel);
    }
    const uint32_t lo01 = sm80::prmt(r[0], r[1], 0x5140), hi01 = sm80::prmt(r[0], r[1], 0x7362);
    const uint32_t lo23 = sm80::prmt(r[2], r[3], 0x5140), hi23 = sm80::prmt(r[2], r[3], 0x7362);
    const uint32_t out[4] = {sm80::prmt(lo01, lo23, 0x5410), sm80::prmt(lo01, lo23, 0x7632),
                             sm80::prmt(hi01, hi23, 0x5410), sm80::prmt(hi01, hi23, 0x7632)};
#pragma unroll
    for (int i = 0; i < 4; ++i) sm80::sts32(vt + (st[i] ^ uint32_t(kg << 4)), out[i]);
  };
  uint32_t rd0[4], st0[4];
  offsets(8 * dg0 + wl, rd0, st0);
  auto transpose_v = [&](const unsigned char* raw_p, unsigned char* vt_p) {
    const uint32_t raw = sm80::smem_addr(raw_p), vt = sm80::smem_addr(vt_p);
    if constexpr (kFixedDims) {
#pragma unroll
      for (int i = 0; i < kKeyGroups / kDg; ++i) one_block(raw, vt, kg0 + i * kDg, rd0, st0);
    } else {
#pragma unroll 2
      for (int j = warp; j < kDimGroups * kKeyGroups; j += 4) {
        const int kg = j / kDimGroups;
        uint32_t rd[4], st[4];
        offsets(8 * (j - kg * kDimGroups) + wl, rd, st);
        one_block(raw, vt, kg, rd, st);
      }
    }
  };
  const uint32_t raw0 = sm80::smem_addr(smem + lay.raw_offset);
  auto copy_k = [&](int j, const int64_t* table) {
    const int s = (it0 + j) % kStages;
    mbar_wait(bars.k_empty(s), (((it0 + j) / kStages) & 1) ^ 1);  // tile j - kStages released
    copy_rows(sm80::smem_addr(smem + lay.stage_offset + s * lay.stage_bytes), k_head, table, 0);
    ptx::cp_async_mbarrier_arrive_noinc(bars.k_full(s));
  };
  auto stage_v = [&](int j, const int64_t* table) {
    copy_rows(raw0 + ((it0 + j) & 1) * kBlockN * 128, v_head, table, 1);
  };
  if (n_tiles > 0) {
    const int64_t* const table = fill_table(0);
    copy_k(0, table);
    stage_v(0, table);
  }
  sm80::cp_async_commit();
  for (int j = 0; j < n_tiles; ++j) {
    // K and the staged V of tile j + 1 go out before tile j's V is transposed. The staging
    // buffer stage_v overwrites was read two tiles ago: fill_table's barrier orders the two.
    if (j + 1 < n_tiles) {
      const int64_t* const table = fill_table(j + 1);
      copy_k(j + 1, table);
      stage_v(j + 1, table);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();          // this thread's V_j rows landed
    sm90::named_barrier_sync(1, 128);  // ... and every producer thread's
    const int s = (it0 + j) % kStages;
    mbar_wait(bars.v_empty(s), (((it0 + j) / kStages) & 1) ^ 1);
    transpose_v(smem + lay.raw_offset + ((it0 + j) & 1) * kBlockN * 128,
                smem + lay.stage_offset + s * lay.stage_bytes + lay.kv_panel);
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
    ptx::mbarrier_arrive(bars.v_full(s));
  }
  sm80::cp_async_wait<0>();  // nothing in flight when the warpgroup exits
}

// fp8 products: Q row `row`, 16 e4m3 codes of columns 16 col .. 16 col + 15 from the quantised
// query (activation dtype, every value an e4m3 value: the narrowing is exact), zeros past the
// rows, into the 128-byte-swizzled Q panel.
template <DType kAct>
__device__ __forceinline__ void copy_q_chunk_e4m3(const DecodeParams& p, const decode::Work& w,
                                                  int row, int col, unsigned char* panel) {
  uint4 codes = make_uint4(0, 0, 0, 0);
  if (row < w.num_rows) {
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
// the swizzled panels in place into f16 by 2^k (decode::q_row_shift: its largest |q| into
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
    max_bits = max(max_bits, decode::bf16x8_abs_max_bits(*chunk(col)));
  }
  const int k = decode::q_row_shift(max_bits);
  const float up = decode::pow2f(k);
#pragma unroll 4
  for (int col = 0; col < kChunks; ++col) {
    uint4 v = *chunk(col);
    v.x = decode::bf16x2_to_f16x2(v.x, up);
    v.y = decode::bf16x2_to_f16x2(v.y, up);
    v.z = decode::bf16x2_to_f16x2(v.z, up);
    v.w = decode::bf16x2_to_f16x2(v.w, up);
    *chunk(col) = v;
  }
  undo[row] = decode::pow2f(-k);
}

template <class T>
__device__ __forceinline__ void produce(const DecodeParams& p, const decode::Work& w,
                                        unsigned char* smem, Barriers<T::kStages> bars, int n_tiles,
                                        const TileSeq& seq);

// P (the accumulator layout of S, keys 8 i + 2 (lane % 4) + {0, 1} in s[i]) as the e4m3 A
// operand of k step c (32 keys): register byte e of a[0] (row g) takes key position 4 t + e,
// which the producer's Vt holds as key 2 t + (e & 1) + 8 (e >> 1) of the step's first 16
// (produce_fp8_math), a[2] the same of its second 16; a[1], a[3] row g + 8. P is in [0, 1]:
// e4m3 without a scale, as FlashAttention-3 rounds it.
template <int kSn>
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[kSn][4], int c, uint32_t (&a)[4]) {
  auto pack4 = [](float k0, float k1, float k8, float k9) {
    return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(k0, k1), __NV_SATFINITE, __NV_E4M3)) |
           uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(k8, k9), __NV_SATFINITE, __NV_E4M3)) << 16;
  };
  a[0] = pack4(s[4 * c][0], s[4 * c][1], s[4 * c + 1][0], s[4 * c + 1][1]);
  a[1] = pack4(s[4 * c][2], s[4 * c][3], s[4 * c + 1][2], s[4 * c + 1][3]);
  a[2] = pack4(s[4 * c + 2][0], s[4 * c + 2][1], s[4 * c + 3][0], s[4 * c + 3][1]);
  a[3] = pack4(s[4 * c + 2][2], s[4 * c + 2][3], s[4 * c + 3][2], s[4 * c + 3][3]);
}
template <class T, bool kFeatures>
__device__ __forceinline__ void consume(const DecodeParams& p, const decode::Work& w,
                                        unsigned char* smem, Barriers<T::kStages> bars, int n_tiles,
                                        const TileSeq& seq);

// Whether the CTAs take their work tiles by the counter (draw_tile): a persistent grid with
// fewer CTAs than work tiles (with as many, each takes its own), in the instances whose K/V
// tiles may come by TMA, the only launches the backend gives a counter (CudaImpl::forward). The
// others compile the walk out: with it, the fp8 products' 56-register producer spilled 16
// instructions in its K/V loop (none without) and d64 lost 11% [SASS; H200, call 6 of
// 2026-12-04-h200-dynamic-d908f9c.txt].
// The launch's work tiles: (request, KV head) pairs x q tiles x splits.
__device__ __forceinline__ int work_tiles(const DecodeParams& p) {
  return p.num_q_tiles * p.num_seqs * p.num_kv_heads * p.num_splits;
}
template <class T>
__device__ __forceinline__ bool dynamic_walk(const DecodeParams& p, int total) {
  return kTmaTiles<T> && p.tile_counter != nullptr && int(gridDim.x) < total;
}

// Arrivals that complete a Q buffer's `full` phase: TMA's one (with the box bytes) or one per
// producer thread, and under the dynamic walk thread 0's publish_tile.
template <class T>
__device__ __forceinline__ uint32_t q_full_arrivals(const DecodeParams& p, bool dynamic) {
  return (kQTma<T> && p.q_tma ? 1u : 128u) + (dynamic ? 1u : 0u);
}

// kFeatures: soft cap and ALiBi compiled in (a second instance; see softmax_scores).
template <class T, bool kFeatures>
__global__ void __launch_bounds__(T::kThreads, 1)
    prefill_sm90_kernel(const __grid_constant__ DecodeParams p) {
  constexpr Sm90Layout lay = T::layout();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Aligned by an offset from the array, not through an integer, so that pointers into it stay
  // shared (LDS / STS) rather than generic.
  unsigned char* const smem = smem_raw + ((1024u - (sm80::smem_addr(smem_raw) & 1023u)) & 1023u);

  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();

  // One work tile per CTA: a CTA whose tile has no rows (most of a grid sized by the longest
  // query of a mixed batch) leaves before any setup.
  {
    const int nx = p.num_q_tiles * p.num_seqs * p.num_kv_heads, b = int(blockIdx.x);
    decode::Work w;
    if (int(gridDim.x) >= nx * p.num_splits &&
        !prefill_work(p, T::kBlockM, T::kSplitAlign, b % nx, b / nx, w)) {
      return;
    }
  }

  const Barriers<T::kStages> bars{reinterpret_cast<uint64_t*>(smem + lay.bar_offset)};
  if (threadIdx.x == 0) {
    const int total = work_tiles(p);
    for (int b = 0; b < lay.q_stages; ++b) {
      ptx::mbarrier_init(bars.q_full(b), q_full_arrivals<T>(p, dynamic_walk<T>(p, total)));
      ptx::mbarrier_init(bars.q_empty(b), 128 * T::kConsumers);
    }
    // One arrival per producer thread that brings the tile: the 16-bit producer splits into a
    // K half and a V half of 64 threads, the fp8 producers bring both with all 128.
    constexpr int kFullArrivals = T::kv == KVKind::kSame && !T::kFp8Math ? 64 : 128;
    for (int s = 0; s < T::kStages; ++s) {
      ptx::mbarrier_init(bars.k_full(s), kFullArrivals);
      ptx::mbarrier_init(bars.v_full(s), kFullArrivals);
      ptx::mbarrier_init(bars.k_empty(s), 128 * T::kConsumers);
      ptx::mbarrier_init(bars.v_empty(s), 128 * T::kConsumers);
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncthreads();
  // Work tiles numbered as the portable kernel's grid runs them (x fastest: within a group of
  // pairs the q tile slowest and reversed, so the longest causal rows come first; the split
  // slowest). A grid of one CTA per work tile takes one each. A persistent grid
  // (DecodeParams::persistent, the backend's default) walks several per CTA: with a counter
  // (DecodeParams::tile_counter) each CTA takes the next number as soon as its producer is
  // free (draw_tile), and the producer hands each number to the consumers beside that work
  // tile's Q (publish_tile); without one, in rounds of gridDim.x, CTA b taking number b of even
  // rounds and number gridDim.x - 1 - b of odd ones (causal work tiles shrink along the
  // numbering, and the snake evens out what each CTA gets). Every role walks the same
  // sequence, so the rings' stages and phases carry over from one work tile to the next and the
  // producer loads the next one's Q and K during this one. Each role computes the walk after
  // its setmaxnreg (values live across it spilled), and inlines its role once, behind one
  // `next` for both walks (two loops doubled the kernel's code); the walk's state is one int per
  // role, the rest recomputed from the parameters (the 56-register producer spilled in its K/V
  // loop while it kept more, and d64 16k lost 8%). next(seq, w): >= 0 with the next work tile's
  // Work in w, or -1.
  auto walk = [&](auto&& next, auto&& role) {
    decode::Work w;
    TileSeq seq;
    for (int t; (t = warp_uniform(next(seq, w))) >= 0;) {
      w = warp_uniform(w);
      const int n_tiles = ceil_div(w.kv_end - w.kv_begin, T::kBlockN);
      seq.pingpong = n_tiles >= p.pingpong_min_tiles;
      role(w, n_tiles, seq);
      seq.it += n_tiles;
      ++seq.k;
      seq.turns_open |= seq.pingpong;
    }
  };
  auto work = [&](int t, decode::Work& w) {
    const int nx = p.num_q_tiles * p.num_seqs * p.num_kv_heads, split = t / nx;
    return prefill_work(p, T::kBlockM, T::kSplitAlign, t - split * nx, split, w);
  };
  // The static snake's next number (< total), or -1.
  auto snake = [&](int& round, int total) {
    const int g = int(gridDim.x), b = int(blockIdx.x);
    for (; round * g < total; ++round) {
      const int t = round * g + (round & 1 ? g - 1 - b : b);
      if (t < total) {
        ++round;
        return t;
      }
    }
    return -1;
  };
  // The hand-over slots (publish_tile), from smem where they are used: a pointer kept across
  // the roles' loops took a register the producer's K/V loop then spilled for.
  auto slots = [&] { return reinterpret_cast<volatile int*>(smem + lay.tile_offset); };
  // One branch per role, as setmaxnreg requires, with the tile loop inside it.
  if (threadIdx.x < 128) {
    sm90::setmaxnreg_dec<T::kProducerRegs>();
    int step = 0;  // the snake's round, or the dynamic walk's draws
    walk(
        [&](const TileSeq& seq, decode::Work& w) {
          const int total = work_tiles(p);
          for (;;) {
            int t;
            if (dynamic_walk<T>(p, total)) {
              // Thread 0 draws and broadcasts through slot 2 + step % 2 (written again only
              // after the next barrier, which every thread reaches after reading it); a number
              // without rows is dropped by all and the next drawn. (Drawing one ahead, by a
              // thread of warp 3 while the rest went on, measured no better [H200, call 2 of
              // bench/results/2026-12-04-h200-dynamic-d908f9c.txt].)
              volatile int* const slot = slots() + 2 + (step & 1);
              if (threadIdx.x == 0) {
                int first = step == 0 ? int(blockIdx.x) : -1;
                *slot = draw_tile(
                    first, int(gridDim.x), total, [&] { return atomicAdd(p.tile_counter, 1); },
                    [&] { atomicExch(p.tile_counter, 0); });
              }
              ++step;
              sm90::named_barrier_sync(1, 128);
              t = *slot;
              if (t < 0 && threadIdx.x == 0) {
                publish_tile<T>(smem, bars, seq.k, -1, nullptr, q_full_arrivals<T>(p, true));
              }
            } else {
              t = snake(step, total);
            }
            if (t < 0 || work(t, w)) return t;
          }
        },
        [&](const decode::Work& w, int n_tiles, const TileSeq& seq) {
          produce<T>(p, w, smem, bars, n_tiles, seq);
        });
  } else {
    sm90::setmaxnreg_inc<T::kConsumerRegs>();
    int round = 0;
    walk(
        [&](const TileSeq& seq, decode::Work& w) {
          const int total = work_tiles(p);
          if (dynamic_walk<T>(p, total)) {
            // The producer publishes only work tiles with rows, each with its Work.
            const int qb = q_buffer<T>(seq.k);
            mbar_wait(bars.q_full(qb), q_parity<T>(seq.k));
            const int more = slots()[qb];
            if (more >= 0) w = *work_slot<T>(smem, qb);
            return more;
          }
          for (;;) {
            const int t = snake(round, total);
            if (t < 0 || work(t, w)) return t;
          }
        },
        [&](const decode::Work& w, int n_tiles, const TileSeq& seq) {
          consume<T, kFeatures>(p, w, smem, bars, n_tiles, seq);
        });
  }
}

// Four e4m3 codes (byte i = code i) to f16 pairs {0, 1} and {2, 3}. The 16-bit halves through
// a mov let ptxas read the upper one as an operand (F2FP.F16.E4M3.UNPACK_B R, R.H1); with a
// shift (decode::fp8x2_f16<.., 1>) each pair cost a SHF more [SASS].
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

template <bool kE5m2>
__device__ __forceinline__ void widen_chunk_f16(const uint4& codes, uint32_t (&out)[8]) {
  const uint32_t wds[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kE5m2) {
      out[2 * k] = sm80::prmt(wds[k], 0u, 0x1404);
      out[2 * k + 1] = sm80::prmt(wds[k], 0u, 0x3424);
    } else {
      e4m3x4_f16(wds[k], out[2 * k], out[2 * k + 1]);
    }
  }
}

// fp8 caches: the producer's loop. Each thread copies its own 16-byte chunks of codes (16
// head dims of one key row) into the staging buffer with cp.async, waits for them, and widens them
// exactly to f16 (T::mma; k_scale and v_scale stay in the softmax scale and the output factor)
// into two 16-byte chunks of the swizzled panels; no other thread reads what it staged, so no
// barrier is needed between copy and widening. The next tile's K is copied while this tile's
// V is widened, and its V while the next K is, so a copy's latency is hidden behind one
// widening. e4m3: cvt.rn.f16x2.e4m3x2, two codes per instruction (the bit trick to bf16,
// decode::Fp8Widen, took ~11 instructions per four codes and set this kernel's pace: fp8 KV at
// 0.57 of the bf16 rate [H200, d908f9c]); e5m2: the code is the f16's top byte.
template <class T, class FillTable>
__device__ __forceinline__ void produce_fp8(const DecodeParams& p, unsigned char* smem,
                                            Barriers<T::kStages> bars, int n_tiles, int it0,
                                            const char* k_head, const char* v_head,
                                            FillTable& fill_table) {
  static_assert(T::mma == DType::kF16);
  constexpr int D = T::head_size, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kRaw = D / 16;  // 16-byte chunks of codes per row
  constexpr int kLanes = kRaw <= 4 ? 4 : kRaw <= 8 ? 8 : 16;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kRaw <= kLanes && kBlockN % kRowsPerPass == 0);
  constexpr Sm90Layout lay = T::layout();
  const int ct = int(threadIdx.x);
  const int col = ct % kLanes, r0 = ct / kLanes;
  const bool copies = col < kRaw;
  // Widened, the chunk is 16-bit chunks 2 col and 2 col + 1 of the row: one panel.
  const int c16 = 2 * col;
  const uint32_t panel_at = (c16 >> 3) * lay.kv_panel;
  const uint32_t raw0 = sm80::smem_addr(smem + lay.raw_offset) + col * 16;
  const bool e5m2 = p.kv_dtype == int(DType::kFp8E5M2);
  auto stage_codes = [&](int which, const char* head, const int64_t* table) {
    if (!copies) return;
    const uint32_t dst0 = raw0 + which * kBlockN * D + r0 * D;
    // The row offsets through the shared window (a generic load each cost an address
    // conversion and a longer latency [ncu]).
    const uint32_t tab = sm80::smem_addr(table) + (2 * r0 + which) * 8;
    const char* const src = head + col * 16;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int64_t off = int64_t(sm80::lds64(tab + i * kRowsPerPass * 16));
      sm80::cp_async_16(dst0 + i * kRowsPerPass * D, src + off, 16, 0);
    }
  };
  // Rows r0 + i kRowsPerPass (kRowsPerPass a multiple of 8) share their swizzle: fixed
  // per-thread shared addresses plus immediates (with generic pointers and the swizzle per row
  // the loop spent 20 of its 28 instructions per chunk on addresses [SASS]).
  static_assert(kRowsPerPass % 8 == 0);
  const uint32_t raw_at = raw0 + r0 * D;
  const uint32_t dst_lo = panel_at + r0 * 128 + (((c16 & 7) ^ (r0 & 7)) << 4);
  const uint32_t dst_hi = panel_at + r0 * 128 + ((((c16 + 1) & 7) ^ (r0 & 7)) << 4);
  // Chunks i + 1 .. i + kAhead are loaded before chunk i is widened and stored: ptxas keeps
  // shared loads and stores it cannot tell apart in order, and one chunk at a time left every
  // widening waiting for its load ([ncu, d128 16k] 41% of the producer's samples on the F2FP,
  // short scoreboard). Two ahead since the producer has 56 registers ([H100, 2026-12-05] fp8
  // e4m3 d128 causal 4k-16k +0.5-1.5% over one).
#ifdef PAGEDATTN_SM90_FP8_AHEAD  // experiments: chunks loaded ahead of the one widened
  constexpr int kAhead = PAGEDATTN_SM90_FP8_AHEAD;
#else
  constexpr int kAhead = 2;
#endif
  auto widen_rows = [&](uint32_t raw, uint32_t panels, auto kE5m2) {
    constexpr int kPasses = kBlockN / kRowsPerPass;
    uint4 ring[kAhead + 1];
#pragma unroll
    for (int a = 0; a < kAhead && a < kPasses; ++a) {
      ring[a] = sm80::lds128(raw + a * kRowsPerPass * D);
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      if (i + kAhead < kPasses) {
        ring[(i + kAhead) % (kAhead + 1)] = sm80::lds128(raw + (i + kAhead) * kRowsPerPass * D);
      }
      const uint4 codes = ring[i % (kAhead + 1)];
      uint32_t out[8];
      widen_chunk_f16<decltype(kE5m2)::value>(codes, out);
      sm80::sts128(panels + dst_lo + i * kRowsPerPass * 128,
                   make_uint4(out[0], out[1], out[2], out[3]));
      sm80::sts128(panels + dst_hi + i * kRowsPerPass * 128,
                   make_uint4(out[4], out[5], out[6], out[7]));
    }
  };
  auto widen_codes = [&](int which, unsigned char* panels) {
    if (copies) {
      const uint32_t raw = raw_at + which * kBlockN * D, dst = sm80::smem_addr(panels);
      if (e5m2) {
        widen_rows(raw, dst, std::true_type{});
      } else {
        widen_rows(raw, dst, std::false_type{});
      }
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, then the wgmmas read them
  };
  if (n_tiles > 0) {
    const int64_t* const table = fill_table(0);
    stage_codes(0, k_head, table);
    sm80::cp_async_commit();
    stage_codes(1, v_head, table);
    sm80::cp_async_commit();
  }
  for (int j = 0; j < n_tiles; ++j) {
    const int s = (it0 + j) % kStages;
    const uint32_t free_parity = (((it0 + j) / kStages) & 1) ^ 1;  // tile j - kStages released
    unsigned char* const sk = smem + lay.stage_offset + s * lay.stage_bytes;
    sm80::cp_async_wait<1>();  // K_j staged (V_j may still be in flight)
    mbar_wait(bars.k_empty(s), free_parity);
    widen_codes(0, sk);
    ptx::mbarrier_arrive(bars.k_full(s));
    const int64_t* const next = j + 1 < n_tiles ? fill_table(j + 1) : nullptr;
    if (next != nullptr) stage_codes(0, k_head, next);
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();  // V_j staged
    mbar_wait(bars.v_empty(s), free_parity);
    widen_codes(1, sk + T::kPanels * lay.kv_panel);
    ptx::mbarrier_arrive(bars.v_full(s));
    if (next != nullptr) stage_codes(1, v_head, next);
    sm80::cp_async_commit();
  }
}

template <class T>
__device__ __forceinline__ void produce(const DecodeParams& p, const decode::Work& w,
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
    produce_fp8_math<T>(smem, bars, n_tiles, it0, k_head, v_head, fill_table);
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
  const int col_bytes = col * 16;
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
                        head + table[2 * row + pick] + col_bytes, 16, 0);
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

template <class T, bool kFeatures>
__device__ __forceinline__ void consume(const DecodeParams& p, const decode::Work& w,
                                        unsigned char* smem, Barriers<T::kStages> bars, int n_tiles,
                                        const TileSeq& seq) {
  constexpr int D = T::head_size, kBlockN = T::kBlockN;
  constexpr int kStages = T::kStages, kNt = D / 8, kSn = kBlockN / 8;
  constexpr bool kBF16 = T::mma == DType::kBF16;  // the products' type (f16 over widened fp8)
  constexpr Sm90Layout lay = T::layout();
  const int it0 = seq.it;
  // The warpgroup index through a shuffle, as CUTLASS does: ptxas then knows it is uniform and
  // builds the wgmma descriptors (Q's base depends on it) in uniform registers, instead of
  // computing them per thread and moving each into uniform registers (48 R2UR per tile).
  // Measured [H200]: d128 / d256 +2-6% (2026-12-03-h200-tma-605847d.txt), d64 +0-3%
  // (2026-12-04-h200-pingpong-cee695b.txt).
  const int wg = warp_uniform(int(threadIdx.x) / 128);
  const int ct = int(threadIdx.x) % 128;
  const int cw = wg - 1;  // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 64 * cw + 16 * warp + g;
  const int wg_row0 = 64 * cw;
  const bool active = wg_row0 < w.num_rows;  // warpgroup-uniform
  const RowsSpan span =
      active ? rows_span(p, w, wg_row0, min(wg_row0 + 64, w.num_rows) - 1) : RowsSpan{};

  float o[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float2 undo = {1.0f, 1.0f};  // rows row_a, row_a + 8: their Q rows' scaling (rescale_q_row)
  // P of the previous tile, the A operand of its P V: k steps of 16 (16-bit) or 32 (e4m3) keys.
  constexpr int kPk = T::kFp8Math ? 32 : 16;
  uint32_t pa[kBlockN / kPk][4];

  const int qb = q_buffer<T>(seq.k);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset + qb * lay.q_bytes) + wg_row0 * 128;
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  auto parity = [&](int j) { return uint32_t(((it0 + j) / kStages) & 1); };
  auto stage = [&](int j) { return (it0 + j) % kStages; };
  // FA3's pingpong: the consumers take turns to issue their wgmmas, so one's softmax runs while
  // the other's products occupy the tensor cores. Named barrier 2 + c is warpgroup c's turn;
  // each takes its turn once per tile (computed or skipped, so the counts always pair up),
  // issues, and hands the turn on; warpgroup 0 holds the first. Per work tile, from the number
  // of its K/V tiles (the same for both warpgroups; DecodeParams::pingpong_min_tiles, by
  // default every tile). Warpgroup 1's last hand-over of a work tile stays pending on barrier
  // 2 and opens warpgroup 0's first turn of the CTA's next work tile with turns; only the
  // first such tile opens it itself.
  const bool pingpong = seq.pingpong;
  auto turn_begin = [&] {
    if (pingpong) sm90::named_barrier_sync(2 + cw, 256);
  };
  auto turn_end = [&] {
    if (pingpong) sm90::named_barrier_arrive(2 + (cw + 1) % T::kConsumers, 256);
  };
  if (pingpong && !seq.turns_open && cw == 0) sm90::named_barrier_arrive(2, 256);
  // The operand descriptors: from head size 128 and for the fp8 products built once per work
  // tile and advanced by constants per k step and by the stage's offset (sm90::desc_advance;
  // [SASS d128] uniform instructions in the consumer loop 111 -> 91; [H200, same call] d256
  // +3-5%, d128 +1%), else built per k step (16-bit d64 lost 3-4% to the advanced ones).
  constexpr bool kAdvance = D >= 128 || T::kFp8Math;
  const uint32_t v0 = stage0 + T::kPanels * lay.kv_panel;
  const uint64_t q_desc = sm90::sw128_desc(q_base, 16, 1024);
  const uint64_t k_desc = sm90::sw128_desc(stage0, 16, 1024);
  const uint64_t v_desc = sm90::sw128_desc(v0, T::kFp8Math ? 16 : lay.kv_panel, 1024);
  // S = Q K^T of the tile in stage s (K-major operands: a k step of 16 16-bit or 32 e4m3
  // columns is +32 B in a panel).
  auto issue_s = [&](float(&sacc)[kSn][4], int s) {
    const uint64_t k_at = sm90::desc_advance(k_desc, s * lay.stage_bytes);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / kPk; ++ks) {
      const uint32_t qo = (ks >> 2) * lay.q_panel + (ks & 3) * 32;
      const uint32_t ko = (ks >> 2) * lay.kv_panel + (ks & 3) * 32;
      const uint64_t da =
          kAdvance ? sm90::desc_advance(q_desc, qo) : sm90::sw128_desc(q_base + qo, 16, 1024);
      const uint64_t db = kAdvance ? sm90::desc_advance(k_at, ko)
                                   : sm90::sw128_desc(stage0 + s * lay.stage_bytes + ko, 16, 1024);
      if constexpr (T::kFp8Math) {
        sm90::WgmmaE4M3<kBlockN>::ss(sacc, da, db, ks > 0);
      } else {
        sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, ks > 0);
      }
    }
    sm90::wgmma_commit();
  };
  // O += P V of the tile in stage s. 16-bit: V is MN-major (16 keys are +2048 B, panels lbo
  // apart). e4m3: Vt is K-major (32 keys are +32 B of its rows).
  auto issue_pv = [&](int s) {
    const uint64_t v_at = sm90::desc_advance(v_desc, s * lay.stage_bytes);
    sm90::fence_operands(o);
    sm90::wgmma_fence();
#pragma unroll
    for (int c = 0; c < kBlockN / kPk; ++c) {
      if constexpr (T::kFp8Math) {
        sm90::WgmmaE4M3<D>::rs(o, pa[c], sm90::desc_advance(v_at, c * 32), 1);
      } else {
        const uint64_t dv =
            kAdvance ? sm90::desc_advance(v_at, c * 2048)
                     : sm90::sw128_desc(v0 + s * lay.stage_bytes + c * 2048, lay.kv_panel, 1024);
        sm90::Wgmma<D, kBF16>::template rs<1>(o, pa[c], dv, 1);
      }
    }
    sm90::wgmma_commit();
  };
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&corr)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const bool need_mask = !(ts >= span.mask_lo && ts + kBlockN <= span.mask_hi);
    softmax_scores<kSn, kFeatures>(p, w, sacc, row_a, ts, need_mask, t4, m, l, corr, undo);
  };
  auto pack = [&](const float(&sacc)[kSn][4]) {
#pragma unroll
    for (int c = 0; c < kBlockN / kPk; ++c) {
      if constexpr (T::kFp8Math) {
        pack_p_e4m3(sacc, c, pa[c]);
      } else {
        pack_p<T::mma>(sacc, c, pa[c]);
      }
    }
  };
  // A tile this warpgroup's rows cannot see: released once landed (the other warpgroup may
  // need it; the producer refills a stage only when both have released it).
  auto skip = [&](int j) {
    const int s = stage(j);
    mbar_wait(bars.k_full(s), parity(j));
    turn_begin();
    turn_end();
    ptx::mbarrier_arrive(bars.k_empty(s));
    mbar_wait(bars.v_full(s), parity(j));
    ptx::mbarrier_arrive(bars.v_empty(s));
  };
  // Whether the consumers must fence the async proxy before their wgmmas read tile j's K (V):
  // only for what cp.async wrote (generic proxy, its completion arriving on the barrier with no
  // fence of the writer's). TMA writes through the async proxy, and the fp8 producers fence
  // their own stores (the widened panels, the transposed V) before arriving. The first tile of
  // a work tile always fences: its Q may have come by cp.async. [SASS] the fence is a
  // MEMBAR.ALL.CTA and a FENCE.VIEW.ASYNC.S.
  const int n_tma = tma_tiles<T>(p, w);
  auto k_fence = [&](int j) { return T::kFp8Math || (T::kv == KVKind::kSame && j >= n_tma); };
  auto v_fence = [&](int j) { return T::kv == KVKind::kSame && j >= n_tma; };
  // The tiles [j_lo, j_hi) this warpgroup computes.
  int j_lo = n_tiles, j_hi = n_tiles;
  if (active && span.lo < span.hi) {
    j_lo = (span.lo - w.kv_begin) / kBlockN;
    j_hi = min(n_tiles, ceil_div(span.hi - w.kv_begin, kBlockN));
  }
  mbar_wait(bars.q_full(qb), q_parity<T>(seq.k));
  if constexpr (T::kQRescale) {
    const float* const u =
        reinterpret_cast<const float*>(smem + lay.q_undo_offset) + qb * T::kBlockM;
    undo = make_float2(u[row_a], u[row_a + 8]);
  }
  for (int j = 0; j < j_lo; ++j) skip(j);
  if (j_lo < j_hi) {
    // Straight-line wgmma groups, no flags: ptxas serialises the wgmmas (C7514 / C7518) when
    // a group's issue or wait sits under a condition it cannot prove warpgroup-uniform.
    {
      const int s = stage(j_lo);
      mbar_wait(bars.k_full(s), parity(j_lo));
      ptx::fence_proxy_async(ptx::space_shared);  // also for Q (cp.async without q_tma)
      float sacc[kSn][4], corr[2];
      turn_begin();
      issue_s(sacc, s);
      turn_end();
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      ptx::mbarrier_arrive(bars.k_empty(s));  // S_j has read K_j: the producer may refill it
      softmax(sacc, j_lo, corr);              // O is still zero: nothing to rescale
      pack(sacc);
    }
    for (int j = j_lo + 1; j < j_hi; ++j) {
      const int s = stage(j), prev = stage(j - 1);
      mbar_wait(bars.k_full(s), parity(j));
      if (k_fence(j)) ptx::fence_proxy_async(ptx::space_shared);
      float sacc[kSn][4], corr[2];
      turn_begin();
      issue_s(sacc, s);
      // V_{j-1} only now: S_j need not wait for it (ncu: the V `full` poll was the consumers'
      // hottest instruction with the cp.async producer).
      mbar_wait(bars.v_full(prev), parity(j - 1));
      if (v_fence(j - 1)) ptx::fence_proxy_async(ptx::space_shared);
      issue_pv(prev);
      turn_end();
      sm90::wgmma_wait<1>();  // S_j done; P V of tile j - 1 still runs
      sm90::fence_operands(sacc);
      ptx::mbarrier_arrive(bars.k_empty(s));
      softmax(sacc, j, corr);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      ptx::mbarrier_arrive(bars.v_empty(prev));
      // Only when some row of the warp has a new max (corr != 1; exactly 1 otherwise), from
      // head size 128 and for the fp8 products: past the first tiles of a long row the max
      // rarely moves, and O's D / 2 multiplies per thread are worth a vote and a branch.
      // Measured [H200, same call, bench/results/2026-12-04-h200-persistent.txt]: d256 16k
      // +11%, d128 16k +2%, fp8 products d64 +2-3%; 16-bit d64 -4-5% (its 32 multiplies cost
      // less than the vote), d80 equal.
      if ((D < 128 && !T::kFp8Math) ||
          __any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
        rescale_o(o, corr);
      }
      pack(sacc);
    }
    const int last = stage(j_hi - 1);
    mbar_wait(bars.v_full(last), parity(j_hi - 1));
    if (v_fence(j_hi - 1)) ptx::fence_proxy_async(ptx::space_shared);
    issue_pv(last);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    ptx::mbarrier_arrive(bars.v_empty(last));
  }
  for (int j = j_hi; j < n_tiles; ++j) skip(j);
  // Every wgmma reading Q has been waited for: from head size 80, O's rows go through the
  // warpgroup's own Q rows, and the producer may load a later work tile's Q into this buffer
  // once they are read back. e4m3 Q rows are half as wide as O's, and d64 was 1-2% slower
  // staged (d80 ViT 4% faster, d128 / d256 equal) [H200, same call, 2026-12-04-h200-epilogue]:
  // those store from the fragments.
  constexpr bool kStaged = !T::kFp8Math && D >= 80;
  if (kStaged && staged_store(p)) {
    store_rows_staged<T::act>(p, w, o, m, l, wg_row0 + 16 * warp, q_base + 16 * warp * 128,
                              lay.q_panel, lane, bars.q_empty(qb));
  } else {
    ptx::mbarrier_arrive(bars.q_empty(qb));
    store_rows<T::act>(p, w, o, m, l, row_a, t4);
  }
}

template <class T>
void PrefillSm90Ops<T>::launch(const DecodeParams& p, cudaStream_t stream) {
  if (p.softcap > 0.0f || p.alibi_slopes != nullptr) {
    PrefillHost<T>::template launch_tiles<prefill_sm90_kernel<T, true>>(p, stream);
  } else {
    PrefillHost<T>::template launch_tiles<prefill_sm90_kernel<T, false>>(p, stream);
  }
}

template <class T>
int PrefillSm90Ops<T>::ctas_per_sm(int device) {
  // Both instances take one CTA per SM (384 threads, the same shared memory).
  return PrefillHost<T>::template ctas_per_sm<prefill_sm90_kernel<T, false>>(device);
}

}  // namespace pagedattn::cuda::prefill
