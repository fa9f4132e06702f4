// MLA decode on Hopper (sm_90a): the absorbed latent attention as MQA over one 576-wide latent
// head, warp-specialised wgmma.
//
// Map
//   computes  for every packed row (token t, head h) of a request: S = q K^T over the latent
//             entries it may see (causal: token i of a q_len-token request sees seq_len - q_len +
//             i + 1 keys), softmax in log2 units with P rounded to the activation type, O = P E
//             where E is the same entry (all 576 columns: the first 512 are the latent output
//             the layer up-projects, 512..575 are P k_pe so the generic contract, output head
//             size = head size, holds exactly); natural-log LSE on request; split-KV partials
//             for the combine (combine.cuh).
//   grid      x = num_seqs * num_m_tiles (M tile fastest), y = num_splits. A CTA owns kBlockM
//             = 64 packed rows (row p = token p / N, head p % N; zero rows past the request) and
//             the keys of its split, whole 64-key tiles.
//   warps     384 threads. Warpgroup 0 (producer, 24 registers) copies Q once and every K tile
//             (64 keys x 576) into nine 128-byte-swizzled panels (the wgmma canonical layout):
//             16-byte cp.async, 8 lanes per row, each lane one chunk of every panel (fixed
//             swizzle, immediate offsets), row offsets from the block table in a smem table whose
//             next tile's lookup is in flight during this tile's copies (ncu: the producer set
//             the pace before); completion arrives on the stage's `full` mbarrier. With
//             p.kv_tma, full tiles of a 16-bit cache come instead by TMA (one box per panel
//             and block, issued by thread 0 with the tile's byte count, L2 evict-first). fp8
//             caches: the raw tile lands in a natural-order buffer (two of them, so the next tile's
//             copies are in flight), each thread widens the chunks it copied into the 16-bit stage.
//   redundant (PAGEDATTN_CUDA_MLA=redundant, kept as a comparison: 1.2-1.4x slower on the
//             H200) warpgroups 1 and 2 (consumers, 240 registers) both compute the same S (wgmma
//             SS, m64n64k16, 36 k steps) and softmax, then each accumulates O += P V for its 256 of
//             the 512 kv_c columns (wgmma RS, m64n256k16, V MN-major = panels 4 cw .. 4 cw
//             + 3 of the same tile) and for the 64 k_pe columns (m64n64k16, panel 8; both
//             warpgroups, warpgroup 1 stores them): 160 fp32 accumulators per thread.
//   split-S   (Consumer::kSplitS: the default for fp8 caches and up to 64 heads;
//             PAGEDATTN_CUDA_MLA=split-s) warpgroup c
//             computes S only for keys 32 c .. 32 c + 31 (m64n32k16), the two
//             exchange row maxima through shared memory (named barrier 2), each writes its
//             half of P (16-bit) into one swizzled 64 x 64 panel, and both run O += P V with P
//             from shared memory (wgmma SS) over all 64 keys for their columns: S once per
//             tile instead of twice. Row sums stay per warpgroup (same maxima, same
//             rescaling) and are added at the end.
//   seesaw    (Traits::consumer kSeesaw, 16-bit caches; PAGEDATTN_CUDA_MLA=seesaw; FlashMLA's
//             schedule) warpgroup c owns the tiles j = c (mod 2): it computes their whole S
//             (m64n64k16 SS, not smem-bound as split-S's n32 is) and softmax and writes P_j to
//             the P panel; it owns O's kv_c columns 256 c .. and k_pe columns 512 + 32 c ..
//             for every tile: O += P_j V_j from registers (RS) for its own tiles, from the
//             panel (SS) for the other's. Only the running row maxima are a serial chain
//             through both warpgroups; one warpgroup's softmax runs under the other's
//             products. Handoffs on named barriers 3 + c (m_j in xchg[c]) and 5 + c (P_j in
//             the panel), each arrived by the owner and synced by the other once per tile, in
//             strict alternation (the chain orders them); one P panel suffices because the
//             reader of P_j is the writer of P_{j+1}. Warpgroup 0's P V reads panels 0-3,
//             warpgroup 1's panels 4-8 (it owns the k_pe columns): each half of a stage has
//             its own full / empty barriers, freed by its reader and refilled (owner's half
//             first) while the other half is still read. The default above 64 heads.
//   sync      mbarriers through CCCL's cuda::ptx: full[s] (128 producer arrivals), empty[s]
//             (256 consumer arrivals); phases flip every kStages tiles. Consumers fence the
//             async proxy after a `full` wait, before their wgmmas read what the generic proxy
//             (cp.async, st.shared) wrote.
//   budget    smem 218 KB (config.h): Q 72 KB + two 16-bit stages of 72 KB, or (fp8) one stage
//             and two raw fp8 tiles of 36 KB. One CTA per SM.
//   test      backend_ops --device cuda --filter mla (float64 reference, poisoned outputs);
//             bench/gpu/bench_mla; docs/kernel_notes.md "mla decode".
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/bulk_copy.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/config.h"
#include "cuda/mla/launch.h"
#include "cuda/mla/params.h"
#include "cuda/mla/trace.cuh"

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

// False when the CTA has no rows (an M tile past its request's q_len * N rows).
__device__ __forceinline__ bool mla_work(const MlaParams& p, Work& w) {
  // A request's M tiles, which read the same K/V tiles, are adjacent CTAs: [H100] 3-4% faster
  // at 128 heads than request-fastest (the pair num_seqs CTAs apart); 16 heads unchanged.
  const int x = int(blockIdx.x);
  w.r = x / p.num_m_tiles;
  const int tile = x - w.r * p.num_m_tiles;
  w.q_begin = p.query_start_loc[w.r];
  w.q_len = p.query_start_loc[w.r + 1] - w.q_begin;
  w.kv_len = p.seq_lens[w.r];
  w.row0 = tile * kBlockM;
  const int rows_total = w.q_len * p.num_heads;
  if (w.row0 >= rows_total) return false;
  w.num_rows = min(kBlockM, rows_total - w.row0);
  // The last row sees the most keys; every key before it is in some row's range.
  const int last_token = (w.row0 + w.num_rows - 1) / p.num_heads;
  const int range_hi = max(0, w.kv_len - w.q_len + last_token + 1);
  const int chunk = ceil_div(ceil_div(range_hi, p.num_splits), kSplitAlign) * kSplitAlign;
  w.kv_begin = min(int(blockIdx.y) * chunk, range_hi);
  w.kv_end = min(w.kv_begin + chunk, range_hi);
  return true;
}

// The CTA's mbarriers: q_full, then full[kStages][kHalves] (producer -> consumers) and
// empty[kStages][kHalves] (consumers -> producer); h: the half of a stage (config.h).
template <int kStages, int kHalves>
struct Barriers {
  uint64_t* base;
  __device__ uint64_t* q_full() const { return base; }
  __device__ uint64_t* full(int s, int h = 0) const { return base + 1 + s * kHalves + h; }
  __device__ uint64_t* empty(int s, int h = 0) const {
    return base + 1 + (kStages + s) * kHalves + h;
  }
};

template <class T>
__device__ __forceinline__ void produce(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kStages, T::kHalves> bars, int n_tiles);
template <class T>
__device__ __forceinline__ void consume(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kStages, T::kHalves> bars, int n_tiles);
template <class T>
__device__ __forceinline__ void consume_split_s(const MlaParams& p, const Work& w,
                                                unsigned char* smem,
                                                Barriers<T::kStages, T::kHalves> bars, int n_tiles);

template <class T>
__device__ __forceinline__ void consume_seesaw(const MlaParams& p, const Work& w,
                                               unsigned char* smem,
                                               Barriers<T::kStages, T::kHalves> bars, int n_tiles);

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) mla_kernel(const __grid_constant__ MlaParams p) {
  constexpr Layout lay = T::layout();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // An offset from the extern array keeps pointers into it in the shared space (through
  // uintptr_t, accesses compile to generic LD.E / ST.E).
  unsigned char* const smem = smem_raw + ((1024u - (sm80::smem_addr(smem_raw) & 1023u)) & 1023u);

  // Metadata, Q and the cache may come from the previous kernels of the stream (programmatic
  // dependent launch).
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();

  Work w;
  if (!mla_work(p, w)) return;
  const int n_tiles = ceil_div(w.kv_end - w.kv_begin, kBlockN);

  const Barriers<T::kStages, T::kHalves> bars{reinterpret_cast<uint64_t*>(smem + lay.bar_offset)};
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(bars.q_full(), 128);
    for (int s = 0; s < T::kStages; ++s) {
      for (int h = 0; h < T::kHalves; ++h) {
        ptx::mbarrier_init(bars.full(s, h), 128);  // one arrival per producer thread
        // Both consumer warpgroups free a whole stage; a half only its reader (seesaw).
        ptx::mbarrier_init(bars.empty(s, h), 256 / T::kHalves);
      }
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncthreads();
  // One branch per role, as setmaxnreg requires.
  if (threadIdx.x < 128) {
    produce<T>(p, w, smem, bars, n_tiles);
  } else if constexpr (T::consumer == Consumer::kSplitS) {
    consume_split_s<T>(p, w, smem, bars, n_tiles);
  } else if constexpr (T::consumer == Consumer::kSeesaw) {
    consume_seesaw<T>(p, w, smem, bars, n_tiles);
  } else {
    consume<T>(p, w, smem, bars, n_tiles);
  }
}

template <class T>
__device__ __forceinline__ void produce(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kStages, T::kHalves> bars, int n_tiles) {
  constexpr int kStages = T::kStages;
  constexpr int kQChunks = kEntry / 8;                      // 72 chunks of 16 bytes per Q row
  constexpr int kRowChunks = kEntry * T::kCacheBytes / 16;  // 72 (16-bit) or 36 (fp8) per key
  constexpr bool kFp8 = T::kv == KVKind::kFp8;
  constexpr Layout lay = T::layout();
  sm90::setmaxnreg_dec<T::kProducerRegs>();
  const int ct = int(threadIdx.x);

  // Q: packed row i -> token (row0 + i) / N, head (row0 + i) % N; zeros past the rows.
  const uint32_t q_smem = sm80::smem_addr(smem + lay.q_offset);
  for (int c = ct; c < kBlockM * kQChunks; c += 128) {
    const int row = c / kQChunks, col = c - row * kQChunks;
    const char* src = static_cast<const char*>(p.q);
    int bytes = 0;
    if (row < w.num_rows) {
      const int pr = w.row0 + row;
      const int tok = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
      src += (int64_t(tok) * p.q_stride_token + int64_t(head) * p.q_stride_head + col * 8) * 2;
      bytes = 16;
    }
    sm80::cp_async_16(q_smem + (col >> 3) * lay.q_panel + sm90::sw128_offset(row, col & 7), src,
                      bytes, 0);
  }
  if constexpr (kFp8) sm80::cp_async_commit();  // the fp8 path counts its tiles in groups
  ptx::cp_async_mbarrier_arrive_noinc(bars.q_full());

  const int64_t sb = p.kv_stride_block * T::kCacheBytes, sp = p.kv_stride_page * T::kCacheBytes;
  const char* const cache = static_cast<const char*>(p.kv);
  const int bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  const int32_t* const bt_row = p.block_table + int64_t(w.r) * p.block_table_stride_seq;
  int64_t* const tables = reinterpret_cast<int64_t*>(smem + lay.table_offset);

  // Row byte offsets of a tile, in two steps so that the block-table read of tile j + 1 is in
  // flight while tile j's copies are issued (ncu: the producer, not the consumers, set the
  // pace, with that dependent global load on its path every tile). Rows past the split read
  // the split's last key (finite bytes whose scores are masked and whose P is 0), so the
  // copies need no zero-fill predicate.
  // A row is kept as {block id, row in block} (high and low 32 bits): the TMA path needs the
  // pair, the cp.async path its byte offset (row_bytes).
  auto lookup = [&](int j) -> int64_t {
    if (ct >= kBlockN || j >= n_tiles) return 0;
    const int pos = min(w.kv_begin + j * kBlockN + ct, w.kv_end - 1);
    const int lb = bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size;
    const int in_block = pos - lb * p.block_size;
    return int64_t(uint64_t(uint32_t(bt_row[int64_t(lb) * p.block_table_stride_block])) << 32 |
                   uint32_t(in_block));
  };
  auto row_bytes = [&](int64_t row) {
    return int64_t(uint32_t(uint64_t(row) >> 32)) * sb + int64_t(uint32_t(row)) * sp;
  };
  // Slot j % 2; the barrier also tells every thread that tile j - 1's copies, which read the
  // other slot, are issued before that slot is rewritten.
  auto publish = [&](int j, int64_t off) {
    int64_t* const table = tables + (j & 1) * kBlockN;
    if (ct < kBlockN) table[ct] = off;
    sm90::named_barrier_sync(1, 128);
    return static_cast<const int64_t*>(table);
  };
  // Thread ct copies chunks l + kLanes k (k < kPer) of rows ct / kLanes + kRowsPerPass i: its
  // column pattern and swizzle stay fixed, so a chunk is one copy with immediate offsets (the
  // per-chunk division and table read were most of the producer's instructions).
  constexpr int kLanes = kFp8 ? 4 : 8;  // 16-bit: chunk l + 8 k is panel k, column chunk l
  constexpr int kPer = kRowChunks / kLanes;
  constexpr int kRowsPerPass = 128 / kLanes;
  static_assert(kPer * kLanes == kRowChunks && kBlockN % kRowsPerPass == 0);
  const int lane_col = ct % kLanes, lane_row = ct / kLanes;
  // This thread's copies of a tile whose rows `table` holds: chunk k of pass i lands at
  // dst + k * chunk_step + i * pass_step (the swizzled panels, or the fp8 natural order).
  // Chunks k in [k0, k1) of every row: the 16-bit panels of one half (seesaw) or all.
  auto copy_rows = [&](const int64_t* table, uint32_t dst, int chunk_step, int pass_step, auto k0,
                       auto k1) {
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const char* const src = cache + row_bytes(table[lane_row + kRowsPerPass * i]) + lane_col * 16;
#pragma unroll
      for (int k = decltype(k0)::value; k < decltype(k1)::value; ++k) {
        sm80::cp_async_16(dst + k * chunk_step + i * pass_step, src + k * kLanes * 16, 16, 0);
      }
    }
  };

  int64_t next_off = lookup(0);
  if constexpr (!kFp8) {
    const uint32_t chunk_at = uint32_t(((lane_col ^ (lane_row & 7)) << 4) + lane_row * 128);
    // TMA (p.kv_tma): thread 0 brings a whole tile as 9 panels x 64 / box_rows boxes, the
    // others only arrive; the split's last, partial tile still goes by cp.async (its rows past
    // the split read the last key, which a box cannot do).
    const int box_rows = min(p.block_size, kBlockN);
    // A request's lines are read by its M-tile CTAs and then never again: marked evict-first
    // ([H100] 0.5-1.6% faster at 16 and 128 heads; FlashMLA marks its K loads the same way).
    const uint64_t evict_first = sm80::l2_evict_first_policy();
    using P0 = std::integral_constant<int, 0>;
    using PH = std::integral_constant<int, T::kHalves == 2 ? kHalfPanel : kPanels>;
    using P9 = std::integral_constant<int, kPanels>;
    PAGEDATTN_MLA_TRACE_BEGIN(tr, 0);
    for (int j = 0; j < n_tiles; ++j) {
      const int s = j % kStages;
      PAGEDATTN_MLA_TRACE_AT(tr, 0, j);
      const int64_t* table = publish(j, next_off);
      PAGEDATTN_MLA_TRACE_AT(tr, 1, j);
      next_off = lookup(j + 1);
      unsigned char* const stage = smem + lay.stage_offset + s * lay.stage_bytes;
      const bool tma = p.kv_tma && w.kv_begin + (j + 1) * kBlockN <= w.kv_end;
      // Half h = panels [k0, k1) of the tile: wait until its readers freed it, then bring it.
      // The seesaw's owner of tile j (warpgroup j % 2) frees its half of tile j - 2 first.
      auto bring = [&](int h, auto k0, auto k1, [[maybe_unused]] int ev) {
        constexpr int kFirst = decltype(k0)::value, kEnd = decltype(k1)::value;
        mbar_wait(bars.empty(s, h), ((j / kStages) & 1) ^ 1);  // tile j - kStages released
        PAGEDATTN_MLA_TRACE_AT(tr, ev, j);
        if (tma) {
          if (ct == 0) {
            ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                           bars.full(s, h),
                                           uint32_t(kBlockN * (kEnd - kFirst) * 128));
            for (int b = 0; b < kBlockN; b += box_rows) {
              const uint64_t row = uint64_t(table[b]);
              const int32_t block = int32_t(row >> 32), in_block = int32_t(uint32_t(row));
#pragma unroll
              for (int k = kFirst; k < kEnd; ++k) {
                const int32_t at[3] = {64 * k, in_block, block};
                sm90::tma_load_3d_hint(stage + k * lay.kv_panel + b * 128, &p.kv_map, at,
                                       bars.full(s, h), evict_first);
              }
            }
          } else {
            ptx::mbarrier_arrive(bars.full(s, h));
          }
        } else {
          copy_rows(table, sm80::smem_addr(stage) + chunk_at, lay.kv_panel, kRowsPerPass * 128, k0,
                    k1);
          ptx::cp_async_mbarrier_arrive_noinc(bars.full(s, h));
        }
        PAGEDATTN_MLA_TRACE_AT(tr, ev + 1, j);
      };
      if constexpr (T::kHalves == 1) {
        bring(0, P0{}, P9{}, 2);
      } else if ((j & 1) == 0) {
        bring(0, P0{}, PH{}, 2);
        bring(1, PH{}, P9{}, 4);
      } else {
        bring(1, PH{}, P9{}, 2);
        bring(0, P0{}, PH{}, 4);
      }
    }
    sm80::cp_async_wait<0>();  // nothing in flight when the warpgroup exits
    PAGEDATTN_MLA_TRACE_PRINT(tr);
  } else {
    // Raw fp8 rows (576 bytes, 36 chunks) into raw buffer j % 2 in natural order; the thread
    // that copied a chunk widens it, so its own cp.async.wait_group is all the ordering needed.
    auto issue = [&](int j) {
      const int64_t* table = publish(j, next_off);
      next_off = lookup(j + 1);
      const uint32_t raw = sm80::smem_addr(smem + lay.raw_offset + (j & 1) * lay.raw_bytes) +
                           lane_row * kEntry + lane_col * 16;
      copy_rows(table, raw, kLanes * 16, kRowsPerPass * kEntry, std::integral_constant<int, 0>{},
                std::integral_constant<int, kPer>{});
      sm80::cp_async_commit();
    };
    if (n_tiles > 0) issue(0);
    for (int j = 0; j < n_tiles; ++j) {
      if (j + 1 < n_tiles) {
        issue(j + 1);
        sm80::cp_async_wait<1>();
      } else {
        sm80::cp_async_wait<0>();
      }
      mbar_wait(bars.empty(0), (j & 1) ^ 1);  // the consumers are done with tile j - 1
      const unsigned char* raw =
          smem + lay.raw_offset + (j & 1) * lay.raw_bytes + lane_row * kEntry + lane_col * 16;
      unsigned char* const stage = smem + lay.stage_offset;
#pragma unroll
      for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
        const int row = lane_row + kRowsPerPass * i;
#pragma unroll 3
        for (int k = 0; k < kPer; ++k) {
          const uint4 v =
              *reinterpret_cast<const uint4*>(raw + i * kRowsPerPass * kEntry + k * kLanes * 16);
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
          uint32_t wide[8];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            wide[2 * q] = fp8x2_to_16bit<T::act>(uint16_t(words[q] & 0xffffu), false);
            wide[2 * q + 1] = fp8x2_to_16bit<T::act>(uint16_t(words[q] >> 16), false);
          }
          // 16 fp8 values of chunk col = lane_col + 4 k are 16-bit chunks 2 col and 2 col + 1
          // of the row: panel k, chunks 2 lane_col and 2 lane_col + 1 within it.
          unsigned char* const panel = stage + k * lay.kv_panel;
          *reinterpret_cast<uint4*>(panel + sm90::sw128_offset(row, 2 * lane_col)) =
              make_uint4(wide[0], wide[1], wide[2], wide[3]);
          *reinterpret_cast<uint4*>(panel + sm90::sw128_offset(row, 2 * lane_col + 1)) =
              make_uint4(wide[4], wide[5], wide[6], wide[7]);
        }
      }
      // Generic-proxy stores, read next by wgmma (async proxy).
      ptx::fence_proxy_async(ptx::space_shared);
      ptx::mbarrier_arrive(bars.full(0));
    }
    sm80::cp_async_wait<0>();  // Q's copies too, when there was no tile
  }
}

// Keys this thread's rows row_a and row_a + 8 may see: [kv_begin, hi[h]). Rows past the
// request are zero queries that nobody stores: they see the whole split (no mask of their own,
// no NaN). Tiles ending at or before `mask_from` need no mask (CTA-uniform).
struct RowBounds {
  int hi[2];
  int mask_from;
};
__device__ __forceinline__ RowBounds row_bounds(const MlaParams& p, const Work& w, int row_a) {
  RowBounds b;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_a + 8 * h;
    b.hi[h] = row < w.num_rows
                  ? min(w.kv_len - w.q_len + (w.row0 + row) / p.num_heads + 1, w.kv_end)
                  : w.kv_end;
  }
  b.mask_from = min(w.kv_len - w.q_len + w.row0 / p.num_heads + 1, w.kv_end);
  return b;
}

// -inf for the keys past each row's bound in a score tile whose first key is `ts` (columns
// 8 nt + 2 t4 + {0, 1} of the wgmma accumulator layout).
template <int kSn>
__device__ __forceinline__ void mask_scores(float (&sacc)[kSn][4], const RowBounds& b, int ts,
                                            int t4) {
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = ts + nt * 8 + 2 * t4 + (c & 1);
      if (key >= b.hi[c >> 1]) sacc[nt][c] = -INFINITY;
    }
  }
}

// Row h's (row_a + 8 h) maximum over this thread's scores and then its quad's (a quad holds
// a row's keys).
template <int kSn>
__device__ __forceinline__ float quad_row_max(const float (&sacc)[kSn][4], int h) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) mx = fmaxf(mx, fmaxf(sacc[nt][2 * h], sacc[nt][2 * h + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

// Scores to P in place, in log2 units (one FFMA per score: the scale joins the exponent),
// each row's P added to sum[h].
template <int kSn>
__device__ __forceinline__ void exp_scores(float (&sacc)[kSn][4], float f, const float (&base)[2],
                                           float (&sum)[2]) {
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      sacc[nt][c] = sm80::exp2_approx(fmaf(sacc[nt][c], f, -base[c >> 1]));
      sum[c >> 1] += sacc[nt][c];
    }
  }
}

// An accumulator's rows scaled: row_a's columns by s[0], row_a + 8's by s[1].
template <int kN>
__device__ __forceinline__ void scale_rows(float (&o)[kN][4], const float (&s)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i][0] *= s[0], o[i][1] *= s[0], o[i][2] *= s[1], o[i][3] *= s[1];
}

// P as the A fragments of an RS P V (the S accumulator layout is wgmma's register-A layout).
template <DType kAct, int kSn>
__device__ __forceinline__ void pack_p(const float (&sacc)[kSn][4], uint32_t (&pa)[kSn / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kSn / 2; ++kk) {
    pa[kk][0] = pack2<kAct>(sacc[2 * kk][0], sacc[2 * kk][1]);
    pa[kk][1] = pack2<kAct>(sacc[2 * kk][2], sacc[2 * kk][3]);
    pa[kk][2] = pack2<kAct>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
    pa[kk][3] = pack2<kAct>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
  }
}

// The consumer warpgroups that count row sums over different keys (split-S, seesaw) add them:
// thread ct of warpgroup cw swaps its two rows' sums with thread ct of the other through `xs`
// (2 x 128 x 2 floats of shared memory no wgmma reads any more; named barrier 2).
__device__ __forceinline__ void add_other_row_sums(float (&l)[2], float* xs, int cw, int ct) {
  sm90::named_barrier_sync(2, 256);
  xs[(cw * 128 + ct) * 2] = l[0];
  xs[(cw * 128 + ct) * 2 + 1] = l[1];
  sm90::named_barrier_sync(2, 256);
  l[0] += xs[((1 - cw) * 128 + ct) * 2];
  l[1] += xs[((1 - cw) * 128 + ct) * 2 + 1];
}

// This thread's rows row_a and row_a + 8 out: normalise by the row sums (l: this thread's part,
// a row's sum is spread over its quad), v scale; the output and LSE, or the split partials.
// Warpgroup cw writes kv_c columns 256 cw .. 256 cw + 255, and the k_pe columns it holds: all 64
// (kPe = 8: warpgroup 0's are written) or 32 cw .. 32 cw + 31 (kPe = 4); warpgroup 0 the LSE.
template <class T, int kPe, int kPeWg = 0>
__device__ __forceinline__ void store_rows(const MlaParams& p, const Work& w,
                                           const float (&o)[32][4], const float (&o_pe)[kPe][4],
                                           const float (&m)[2], const float (&l)[2], int row_a,
                                           int t4, int cw) {
  static_assert(kPe == 8 || kPe == 4);
  const bool pe_mine = kPe == 4 || cw == kPeWg;
  const int pe0 = kPe == 4 ? 512 + 32 * cw : 512;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = l[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    const int row = row_a + 8 * h;
    if (row >= w.num_rows) continue;
    const int pr = w.row0 + row;
    const int t = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
    const float lse2 = total > 0.0f ? m[h] + log2f(total) : -INFINITY;
    const float factor = total > 0.0f ? p.v_scale / total : 0.0f;
    if (p.num_splits > 1) {
      const int64_t at = (int64_t(blockIdx.y) * p.num_actual_tokens + t) * p.num_heads + head;
      float* const dst = p.partial_o + at * kEntry + 2 * t4;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        *reinterpret_cast<float2*>(dst + 256 * cw + 8 * i) =
            make_float2(o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
      }
      if (pe_mine) {
#pragma unroll
        for (int i = 0; i < kPe; ++i) {
          *reinterpret_cast<float2*>(dst + pe0 + 8 * i) =
              make_float2(o_pe[i][2 * h] * factor, o_pe[i][2 * h + 1] * factor);
        }
      }
      if (cw == 0 && t4 == 0) p.partial_lse[at] = lse2;
      continue;
    }
    char* const out = static_cast<char*>(p.out) +
                      (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * 2;
    auto put = [&](int col, float x0, float x1) {
      if (p.vec_out) {
        *reinterpret_cast<uint32_t*>(out + col * 2) = pack2<T::act>(x0, x1);
      } else {
        store_from_float<T::act>(out, col, x0);
        store_from_float<T::act>(out, col + 1, x1);
      }
    };
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      put(256 * cw + 8 * i + 2 * t4, o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
    }
    if (pe_mine) {
#pragma unroll
      for (int i = 0; i < kPe; ++i) {
        put(pe0 + 8 * i + 2 * t4, o_pe[i][2 * h] * factor, o_pe[i][2 * h + 1] * factor);
      }
    }
    if (cw == 0) {
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
}

template <class T>
__device__ __forceinline__ void consume(const MlaParams& p, const Work& w, unsigned char* smem,
                                        Barriers<T::kStages, T::kHalves> bars, int n_tiles) {
  constexpr int kStages = T::kStages, kSn = kBlockN / 8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  const int cw = int(threadIdx.x) / 128 - 1;  // consumer warpgroup: kv_c columns 256 cw ..
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;  // this thread's rows: row_a and row_a + 8

  const RowBounds bounds = row_bounds(p, w, row_a);

  float o[32][4];    // kv_c columns 256 cw + 8 i + 2 t4 + {0, 1}, rows row_a, row_a + 8
  float o_pe[8][4];  // k_pe columns 512 + 8 i + ...
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) o_pe[i][0] = o_pe[i][1] = o_pe[i][2] = o_pe[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  uint32_t pa[kBlockN / 16][4];  // P of a tile: the A fragments of its P V
  // S = Q K^T of the tile in stage s (both K-major: 16 columns are +32 B inside a panel).
  auto issue_s = [&](float(&sacc)[kSn][4], int s) {
    const uint32_t k_base = stage0 + s * lay.stage_bytes;
    // Q's 36 descriptors are loop-invariant: hoisted, they took 72 registers and spilled (244
    // bytes); made opaque here, they are rebuilt per tile from one register.
    uint32_t q_at = q_base;
    asm volatile("" : "+r"(q_at));
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kEntry / 16; ++ks) {
      const uint64_t da =
          sm90::sw128_desc(q_at + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
      const uint64_t db =
          sm90::sw128_desc(k_base + (ks >> 2) * lay.kv_panel + (ks & 3) * 32, 16, 1024);
      sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, ks > 0);
    }
    sm90::wgmma_commit();
  };
  // O += P V: V is the same tile read MN-major (16 keys are +2048 B; panels kv_panel apart).
  auto issue_pv = [&](int s) {
    const uint32_t k_base = stage0 + s * lay.stage_bytes;
    sm90::fence_operands(o);
    sm90::fence_operands(o_pe);
    sm90::wgmma_fence();
    const uint32_t v_base = k_base + 4 * cw * lay.kv_panel;
    const uint32_t pe_base = k_base + 8 * lay.kv_panel;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      sm90::Wgmma<256, kBF16>::template rs<1>(
          o, pa[kk], sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024), 1);
      sm90::Wgmma<64, kBF16>::template rs<1>(
          o_pe, pa[kk], sm90::sw128_desc(pe_base + kk * 2048, lay.kv_panel, 1024), 1);
    }
    sm90::wgmma_commit();
  };
  // Online softmax of tile j in log2 units (one FFMA per score: the scale joins the exponent);
  // corr is the factor O must be rescaled by before P V of this tile joins it.
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&corr)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const float f = p.scale_log2;
    if (ts + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_row_max(sacc, h) * f);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet: no NaN
      corr[h] = sm80::exp2_approx(m[h] - base[h]);
      m[h] = m_new;
    }
    exp_scores(sacc, f, base, sum);
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
  };
  auto rescale = [&](const float(&corr)[2]) {
    scale_rows(o, corr);
    scale_rows(o_pe, corr);
  };
  // P as the A fragments of P V (the S accumulator layout is wgmma's register-A layout).
  auto pack = [&](const float(&sacc)[kSn][4]) { pack_p<T::act>(sacc, pa); };
  auto full_parity = [](int j) { return uint32_t((j / kStages) & 1); };
  mbar_wait(bars.q_full(), 0);
  // Straight-line wgmma groups (prologue, unconditional loop, epilogue): ptxas serialises the
  // wgmmas (C7514) when a group's issue or wait sits under a condition it cannot prove uniform.
  if constexpr (kStages >= 2) {
    // FlashAttention-3's intra-warpgroup overlap: iteration j issues S_j and then P V of tile
    // j - 1, waits for S_j only and runs its softmax while P V runs. The per-tile chain was S,
    // softmax, P V in series (~5 us per 64-key tile, 0.41-0.47 of the copy rate).
    if (n_tiles > 0) {
      {
        mbar_wait(bars.full(0), 0);
        ptx::fence_proxy_async(ptx::space_shared);
        float sacc[kSn][4], corr[2];
        issue_s(sacc, 0);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(sacc);
        softmax(sacc, 0, corr);  // O is still zero: nothing to rescale
        pack(sacc);
      }
      for (int j = 1; j < n_tiles; ++j) {
        const int s = j % kStages, prev = (j - 1) % kStages;
        mbar_wait(bars.full(s), full_parity(j));
        ptx::fence_proxy_async(ptx::space_shared);
        float sacc[kSn][4], corr[2];
        issue_s(sacc, s);
        issue_pv(prev);
        sm90::wgmma_wait<1>();  // S_j done; P V of tile j - 1 still runs
        sm90::fence_operands(sacc);
        softmax(sacc, j, corr);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(o);
        sm90::fence_operands(o_pe);
        ptx::mbarrier_arrive(bars.empty(prev));
        rescale(corr);
        pack(sacc);
      }
      const int last = (n_tiles - 1) % kStages;
      issue_pv(last);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(o_pe);
      ptx::mbarrier_arrive(bars.empty(last));
    }
  } else {
    // One stage (fp8: the widened tile): P V must finish before the stage is refilled.
    for (int j = 0; j < n_tiles; ++j) {
      mbar_wait(bars.full(0), full_parity(j));
      ptx::fence_proxy_async(ptx::space_shared);
      float sacc[kSn][4], corr[2];
      issue_s(sacc, 0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      softmax(sacc, j, corr);
      rescale(corr);
      pack(sacc);
      issue_pv(0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(o_pe);
      ptx::mbarrier_arrive(bars.empty(0));
    }
  }

  store_rows<T>(p, w, o, o_pe, m, l, row_a, t4, cw);
}

template <class T>
__device__ __forceinline__ void consume_split_s(const MlaParams& p, const Work& w,
                                                unsigned char* smem,
                                                Barriers<T::kStages, T::kHalves> bars,
                                                int n_tiles) {
  constexpr int kStages = T::kStages, kHalf = kBlockN / 2, kSn = kHalf / 8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr Layout lay = T::layout();
  constexpr int kBarConsumers = 2;  // named barrier of the 256 consumer threads (1: producer)
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  const int cw = int(threadIdx.x) / 128 - 1;  // keys 32 cw .. of S; kv_c columns 256 cw ..
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;

  const RowBounds bounds = row_bounds(p, w, row_a);

  float o[32][4];
  float o_pe[8][4];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) o_pe[i][0] = o_pe[i][1] = o_pe[i][2] = o_pe[i][3] = 0.0f;
  // m is the same in both warpgroups (both see both halves' maxima); l counts own keys only.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  float* const xchg = reinterpret_cast<float*>(smem + lay.xchg_offset);  // [2][64]
  unsigned char* const p_tile = smem + lay.p_offset;                     // [64 rows][64 keys]
  const uint32_t p_base = sm80::smem_addr(p_tile);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  mbar_wait(bars.q_full(), 0);
  for (int j = 0; j < n_tiles; ++j) {
    const int s = kStages == 1 ? 0 : j % kStages;
    mbar_wait(bars.full(s), uint32_t((j / kStages) & 1));
    ptx::fence_proxy_async(ptx::space_shared);
    const uint32_t k_base = stage0 + s * lay.stage_bytes;

    // S for this warpgroup's 32 keys: rows 32 cw .. of every K panel (+4096 B).
    float sacc[kSn][4];
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kEntry / 16; ++ks) {
      const uint64_t da =
          sm90::sw128_desc(q_base + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
      const uint64_t db = sm90::sw128_desc(
          k_base + (ks >> 2) * lay.kv_panel + cw * kHalf * 128 + (ks & 3) * 32, 16, 1024);
      sm90::Wgmma<kHalf, kBF16>::template ss<0>(sacc, da, db, ks > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(sacc);

    const int ts = w.kv_begin + j * kBlockN + cw * kHalf;  // first key of this half
    const float f = p.scale_log2;
    if (w.kv_begin + j * kBlockN + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = quad_row_max(sacc, h);
      if (t4 == 0) xchg[cw * kBlockM + row_a + 8 * h] = mx[h];
    }
    // Both halves' maxima are in; both warpgroups are also past the P V of tile j - 1, which
    // read the P panel that this tile overwrites below.
    sm90::named_barrier_sync(kBarConsumers, 256);
    float corr[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = xchg[(1 - cw) * kBlockM + row_a + 8 * h];
      const float m_new = fmaxf(m[h], fmaxf(mx[h], other) * f);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;
      corr[h] = sm80::exp2_approx(m[h] - base[h]);
      m[h] = m_new;
    }
    exp_scores(sacc, f, base, sum);
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
    scale_rows(o, corr);
    scale_rows(o_pe, corr);
    // This half of P into the panel (K-major A operand: key k of row r is 16-bit element k of
    // the row's 128 bytes): keys 32 cw + 8 nt + 2 t4 + {0, 1} are chunk 4 cw + nt, bytes 4 t4.
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_a + 8 * h;
        *reinterpret_cast<uint32_t*>(p_tile + sm90::sw128_offset(row, 4 * cw + nt) + 4 * t4) =
            pack2<T::act>(sacc[nt][2 * h], sacc[nt][2 * h + 1]);
      }
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_sync(kBarConsumers, 256);

    // O += P V over all 64 keys: P from the panel (+32 B per 16 keys), V MN-major as in consume.
    sm90::fence_operands(o);
    sm90::fence_operands(o_pe);
    sm90::wgmma_fence();
    const uint32_t v_base = k_base + 4 * cw * lay.kv_panel;
    const uint32_t pe_base = k_base + 8 * lay.kv_panel;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dp = sm90::sw128_desc(p_base + kk * 32, 16, 1024);
      sm90::Wgmma<256, kBF16>::template ss<1>(
          o, dp, sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024), 1);
      sm90::Wgmma<64, kBF16>::template ss<1>(
          o_pe, dp, sm90::sw128_desc(pe_base + kk * 2048, lay.kv_panel, 1024), 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    sm90::fence_operands(o_pe);
    ptx::mbarrier_arrive(bars.empty(s));
  }

  // Row sums: thread ct of the other warpgroup holds the same rows' sums over the other half
  // of the keys; exchanged through the P panel, free once both warpgroups are past their last
  // P V (the barrier).
  add_other_row_sums(l, reinterpret_cast<float*>(p_tile), cw, ct);
  store_rows<T>(p, w, o, o_pe, m, l, row_a, t4, cw);
}

// The seesaw (see the map), for warpgroup kC: it owns tiles j = kC (mod 2) and O's kv_c columns
// 256 kC .. 256 kC + 255, warpgroup 1 also the 64 k_pe columns; so its P V reads only its half
// of a stage (panels 0-3, or 4-8), which it frees on its own. O and the row sums l (own tiles
// only) are kept at the row maxima m_ref they were last moved to; both warpgroups end at the
// chain's last maxima, so the sums add. Compiled once per warpgroup: every wgmma group sits in
// straight-line code.
template <class T, int kC>
__device__ __forceinline__ void seesaw_warpgroup(const MlaParams& p, const Work& w,
                                                 unsigned char* smem,
                                                 Barriers<T::kStages, T::kHalves> bars,
                                                 int n_tiles) {
  constexpr int kSn = kBlockN / 8, kPe = 8;
  constexpr bool kBF16 = T::act == DType::kBF16;
  constexpr bool kHasPe = kC == 1;
  constexpr Layout lay = T::layout();
  constexpr int kBarMax = 3, kBarP = 5;  // + the owner warpgroup (2: add_other_row_sums)
  constexpr int kOther = 1 - kC;
  // Panels of this warpgroup's half: [kMine0, kMine1); the other half is the rest.
  constexpr int kMine0 = kC == 0 ? 0 : kHalfPanel, kMine1 = kC == 0 ? kHalfPanel : kPanels;
  static_assert(T::kStages == 2 && T::kHalves == 2, "tile j: stage j % 2, owner j % 2");
  const int ct = int(threadIdx.x) % 128;
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  const int row_a = 16 * warp + g;

  const RowBounds bounds = row_bounds(p, w, row_a);
  PAGEDATTN_MLA_TRACE_BEGIN(tr, 1 + kC);

  float o[32][4];      // kv_c columns 256 kC + 8 i + 2 t4 + {0, 1}, rows row_a, row_a + 8
  float o_pe[kPe][4];  // warpgroup 1: k_pe columns 512 + 8 i + ...
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < kPe; ++i) o_pe[i][0] = o_pe[i][1] = o_pe[i][2] = o_pe[i][3] = 0.0f;
  float m_ref[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t pa[kBlockN / 16][4];  // P of the own tile whose P V (RS) may be in flight

  float* const xchg = reinterpret_cast<float*>(smem + lay.xchg_offset);  // [2][64] maxima
  unsigned char* const p_tile = smem + lay.p_offset;                     // [64 rows][64 keys]
  const uint32_t p_base = sm80::smem_addr(p_tile);
  const uint32_t q_base = sm80::smem_addr(smem + lay.q_offset);
  const uint32_t stage0 = sm80::smem_addr(smem + lay.stage_offset);
  auto stage_of = [&](int j) { return stage0 + uint32_t(j & 1) * lay.stage_bytes; };
  auto wait_half = [&](int j, int h) {
    mbar_wait(bars.full(j & 1, h), uint32_t((j >> 1) & 1));
    ptx::fence_proxy_async(ptx::space_shared);  // cp.async tiles are generic-proxy writes
  };

  auto fence_o = [&] {
    sm90::fence_operands(o);
    if constexpr (kHasPe) sm90::fence_operands(o_pe);
  };
  // pa stays allocated until the RS wgmma reading it has completed (waited before this).
  auto keep_pa = [&] {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pa[kk][i])::"memory");
    }
  };
  // S = Q K^T of own tile j, whole 64 keys: this warpgroup's half of the panels first (the
  // producer brings it first), then the other half as it lands; two commit groups. Q's
  // descriptors opaque, as in consume().
  auto issue_s = [&](float(&sacc)[kSn][4], int j) {
    const uint32_t k_base = stage_of(j);
    uint32_t q_at = q_base;
    asm volatile("" : "+r"(q_at));
    auto steps = [&](int ks0, int ks1, bool first) {
#pragma unroll
      for (int ks = ks0; ks < ks1; ++ks) {
        const uint64_t da =
            sm90::sw128_desc(q_at + (ks >> 2) * lay.q_panel + (ks & 3) * 32, 16, 1024);
        const uint64_t db =
            sm90::sw128_desc(k_base + (ks >> 2) * lay.kv_panel + (ks & 3) * 32, 16, 1024);
        sm90::Wgmma<kBlockN, kBF16>::template ss<0>(sacc, da, db, !(first && ks == ks0));
      }
    };
    wait_half(j, kC);
    PAGEDATTN_MLA_TRACE_AT(tr, 5, j);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
    steps(4 * kMine0, 4 * kMine1, true);
    // Two groups: a wait between the wgmmas of one group made ptxas insert its own fence on
    // the wait's divergent path and serialise the wgmmas (C7520).
    sm90::wgmma_commit();
    wait_half(j, kOther);
    PAGEDATTN_MLA_TRACE_AT(tr, 6, j);
    sm90::fence_operands(sacc);
    sm90::wgmma_fence();
    if constexpr (kC == 0) {
      steps(4 * kHalfPanel, 4 * kPanels, false);
    } else {
      steps(0, 4 * kHalfPanel, false);
    }
    sm90::wgmma_commit();
  };
  // O += P_j V_j over this warpgroup's columns: V MN-major (16 keys are +2048 B); warpgroup 1
  // also the k_pe panel. P from registers (own tile) or the panel (the other's).
  auto issue_pv = [&](int j, auto from_regs) {
    const uint32_t v_base = stage_of(j) + 4 * kC * lay.kv_panel;
    const uint32_t pe_base = stage_of(j) + 8 * lay.kv_panel;
    fence_o();
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dv = sm90::sw128_desc(v_base + kk * 2048, lay.kv_panel, 1024);
      const uint64_t dpe = sm90::sw128_desc(pe_base + kk * 2048, lay.kv_panel, 1024);
      if constexpr (decltype(from_regs)::value) {
        sm90::Wgmma<256, kBF16>::template rs<1>(o, pa[kk], dv, 1);
        if constexpr (kHasPe) sm90::Wgmma<64, kBF16>::template rs<1>(o_pe, pa[kk], dpe, 1);
      } else {
        const uint64_t dp = sm90::sw128_desc(p_base + kk * 32, 16, 1024);
        sm90::Wgmma<256, kBF16>::template ss<1>(o, dp, dv, 1);
        if constexpr (kHasPe) sm90::Wgmma<64, kBF16>::template ss<1>(o_pe, dp, dpe, 1);
      }
    }
    sm90::wgmma_commit();
  };
  // This warpgroup's half of tile j's stage is no longer read by it (its P V of j is done).
  auto release = [&](int j) { ptx::mbarrier_arrive(bars.empty(j & 1, kC)); };
  // O and l from m_ref to the maxima m_new (no P V of this warpgroup in flight); warps whose
  // rows' maxima did not move skip the multiplies.
  auto move_to = [&](const float(&m_new)[2]) {
    float sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h] = sm80::exp2_approx(m_ref[h] - (m_new[h] == -INFINITY ? 0.0f : m_new[h]));
      m_ref[h] = m_new[h];
      l[h] *= sc[h];
    }
    if (__any_sync(0xffffffffu, sc[0] != 1.0f || sc[1] != 1.0f)) {
      scale_rows(o, sc);
      if constexpr (kHasPe) scale_rows(o_pe, sc);
    }
  };
  // The other warpgroup's tile j: its maxima (O moved to them), then its P V from the panel
  // over this warpgroup's half (landed: the owner's S waited for it; waited again here, a
  // completed phase, so that this warpgroup itself observes the copies).
  auto join_other = [&](int j) {
    sm90::named_barrier_sync(kBarMax + kOther, 256);
    PAGEDATTN_MLA_TRACE_AT(tr, 2, j + 1);
    const float m_j[2] = {xchg[kOther * kBlockM + row_a], xchg[kOther * kBlockM + row_a + 8]};
    move_to(m_j);
    sm90::named_barrier_sync(kBarP + kOther, 256);
    PAGEDATTN_MLA_TRACE_AT(tr, 3, j + 1);
    wait_half(j, kC);
    PAGEDATTN_MLA_TRACE_AT(tr, 4, j + 1);
    issue_pv(j, std::false_type{});
  };
  // Own tile j, S done: mask, the chain's new maxima (published at once: the other warpgroup's
  // next softmax waits on them), P in log2 units, its row sums.
  auto softmax = [&](float(&sacc)[kSn][4], int j, float(&m_new)[2], float(&sum)[2]) {
    const int ts = w.kv_begin + j * kBlockN;
    const float f = p.scale_log2;
    if (ts + kBlockN > bounds.mask_from) {
      mask_scores(sacc, bounds, ts, t4);
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(m_ref[h], quad_row_max(sacc, h) * f);
      if (t4 == 0) xchg[kC * kBlockM + row_a + 8 * h] = m_new[h];
      base[h] = m_new[h] == -INFINITY ? 0.0f : m_new[h];
      sum[h] = 0.0f;
    }
    sm90::named_barrier_arrive(kBarMax + kC, 256);
    exp_scores(sacc, f, base, sum);
  };
  // After this warpgroup's last P V read the panel: O to the new maxima, P_j into the panel
  // for the other warpgroup and into pa for this one's RS P V.
  auto publish_p = [&](const float(&sacc)[kSn][4], const float(&m_new)[2], const float(&sum)[2]) {
    move_to(m_new);
    l[0] += sum[0];
    l[1] += sum[1];
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint32_t*>(p_tile + sm90::sw128_offset(row_a + 8 * h, nt) + 4 * t4) =
            pack2<T::act>(sacc[nt][2 * h], sacc[nt][2 * h + 1]);
      }
    }
    ptx::fence_proxy_async(ptx::space_shared);  // generic stores, read next by wgmma
    sm90::named_barrier_arrive(kBarP + kC, 256);
    pack_p<T::act>(sacc, pa);
  };

  mbar_wait(bars.q_full(), 0);
  int j = kC;
  if constexpr (kC == 0) {
    if (n_tiles > 0) {  // tile 0: nothing before it joins O
      float sacc[kSn][4], m_new[2], sum[2];
      issue_s(sacc, 0);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(sacc);
      softmax(sacc, 0, m_new, sum);
      publish_p(sacc, m_new, sum);
      issue_pv(0, std::true_type{});
      j = 2;
    }
  }
  for (; j < n_tiles; j += 2) {
    // This warpgroup's P V of tile j - 2 done: its half of the stage is freed before tile j
    // is awaited (the producer refills it only when it is free).
    PAGEDATTN_MLA_TRACE_AT(tr, 0, j);
    sm90::wgmma_wait<0>();
    keep_pa();
    fence_o();
    if (j >= 2) release(j - 2);
    PAGEDATTN_MLA_TRACE_AT(tr, 1, j);
    float sacc[kSn][4], m_new[2], sum[2];
    // The other's P V before S_j: its half of tile j - 1 frees ~one S earlier, and the
    // producer refills it sooner ([H100] 1.5-3.5% at 128 heads over S_j first).
    join_other(j - 1);
    issue_s(sacc, j);
    sm90::wgmma_wait<2>();  // P_{j-1} V done; S_j's two groups still run
    PAGEDATTN_MLA_TRACE_AT(tr, 7, j);
    fence_o();
    release(j - 1);
    sm90::wgmma_wait<0>();
    PAGEDATTN_MLA_TRACE_AT(tr, 8, j);
    sm90::fence_operands(sacc);
    softmax(sacc, j, m_new, sum);
    PAGEDATTN_MLA_TRACE_AT(tr, 9, j);
    publish_p(sacc, m_new, sum);
    PAGEDATTN_MLA_TRACE_AT(tr, 10, j);
    issue_pv(j, std::true_type{});
    PAGEDATTN_MLA_TRACE_AT(tr, 11, j);
  }
  sm90::wgmma_wait<0>();
  keep_pa();
  fence_o();
  if (j >= 2) release(j - 2);                      // the last own tile
  if (n_tiles > 0 && ((n_tiles - 1) & 1) != kC) {  // the last tile is the other's
    join_other(n_tiles - 1);
    sm90::wgmma_wait<0>();
    fence_o();
    release(n_tiles - 1);
  }

  // Row sums of the other warpgroup's tiles (same rows, same final maxima) through the P
  // panel, free once both are past their last P V.
  add_other_row_sums(l, reinterpret_cast<float*>(p_tile), kC, ct);
  store_rows<T, kPe, 1>(p, w, o, o_pe, m_ref, l, row_a, t4, kC);
  PAGEDATTN_MLA_TRACE_PRINT(tr);
}

template <class T>
__device__ __forceinline__ void consume_seesaw(const MlaParams& p, const Work& w,
                                               unsigned char* smem,
                                               Barriers<T::kStages, T::kHalves> bars, int n_tiles) {
  sm90::setmaxnreg_inc<T::kConsumerRegs>();
  if (threadIdx.x < 256) {
    seesaw_warpgroup<T, 0>(p, w, smem, bars, n_tiles);
  } else {
    seesaw_warpgroup<T, 1>(p, w, smem, bars, n_tiles);
  }
}

// Launches `kernel(p)` with programmatic stream serialization allowed (both MLA kernels open
// with the griddepcontrol pair): the combine's CTAs are resident before the attention kernel
// ends, and the next layer's before the combine ends.
inline void launch_with_pdl(void (*kernel)(MlaParams), dim3 grid, dim3 block, int smem,
                            cudaStream_t stream, const MlaParams& p) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  PAGEDATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

// Raises the kernel's dynamic shared memory limit once per device (benign if two threads race).
template <class T>
void prepare_mla(int device) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  PAGEDATTN_CUDA_CHECK(cudaFuncSetAttribute(
      mla_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::layout().total));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <class T>
void MlaOps<T>::launch(const MlaParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.num_m_tiles) * unsigned(p.num_seqs), unsigned(p.num_splits));
  if (grid.x == 0 || grid.y == 0) return;
  int device = 0;
  PAGEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  prepare_mla<T>(device);
  launch_with_pdl(mla_kernel<T>, grid, dim3(T::kThreads), T::layout().total, stream, p);
}

template <class T>
int MlaOps<T>::ctas_per_sm(int device) {
  prepare_mla<T>(device);
  int n = 0;
  PAGEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, mla_kernel<T>, T::kThreads,
                                                                     T::layout().total));
  return n;
}

}  // namespace pagedattn::cuda::mla
