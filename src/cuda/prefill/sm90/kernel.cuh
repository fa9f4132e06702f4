// Paged attention for long queries on Hopper (sm_90a): warp-specialised wgmma kernel.
//
// Map
//   computes  what portable/kernel.cuh computes (same rows, routing, splits, masks, features and
//             outputs: prefill_work and softmax_scores are shared; the rows go out through
//             shared memory, epilogue.cuh, or by store_rows), for 16-bit
//             activations over a cache of the same type or fp8 (e4m3 / e5m2, widened by the
//             producer) at head sizes 64 to 256 (multiples of 16; fp8 to 192).
//   grid      1-D over the portable kernel's work tiles (groups of (request, KV head) pairs x
//             q tiles, reversed x pairs of the group, then splits): one CTA per work tile, or a
//             persistent grid (AttnParams::persistent) whose CTAs walk several, each taking
//             the next number from an atomic counter as soon as it is free (tile_counter;
//             draw_tile in walk.h) or by a static snake; kBlockM = 128 packed rows per work
//             tile, 384 threads.
//   warps     warpgroup 0 (producer, 40 or 56 registers): Q per work tile (two buffers where
//             they fit, so the next one's Q loads during this one's tiles; over a 16-bit cache
//             by TMA from one thread where AttnParams::q_tma allows), then the K and the V
//             tile of kBlockN keys into two-stage rings of their own. 16-bit caches: warps 0-1
//             bring K and warps 2-3 V, each half on its own loop. Full tiles (head sizes that are
//             multiples of 64, block sizes powers of two >= 8, or an encoder's key tensor) come by
//             TMA (the default; the cuda option prefill_copy=cp.async turns it off): one box per
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
//   test      backend_ops (cuda, every feature), and the same with --cuda-option prefill=all and
//             the other prefill routes (ctest -L gpu); bench/gpu/bench_prefill; the SASS shows
//             HGMMA (docs/kernels/prefill.md).
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/host.cuh"
#include "cuda/prefill/launch.h"
#include "cuda/prefill/sm90/common.cuh"
#include "cuda/prefill/sm90/consume.cuh"
#include "cuda/prefill/sm90/epilogue.cuh"
#include "cuda/prefill/sm90/produce.cuh"

namespace pagedattn::cuda::prefill {

// kFeatures: soft cap and ALiBi compiled in (a second instance; see softmax_scores).
template <class T, bool kFeatures>
__global__ void __launch_bounds__(T::kThreads, 1)
    prefill_sm90_kernel(const __grid_constant__ AttnParams p) {
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
    attn::Work w;
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
  // (AttnParams::persistent, the backend's default) walks several per CTA: with a counter
  // (AttnParams::tile_counter) each CTA takes the next number as soon as its producer is
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
    attn::Work w;
    TileSeq seq;
    for (int t; (t = warp_uniform(next(seq, w))) >= 0;) {
      w = warp_uniform(w);
      const int n_tiles = ceil_div(w.kv_end - w.kv_begin, T::kBlockN);
      role(w, n_tiles, seq);
      seq.it += n_tiles;
      ++seq.k;
      seq.turns_open |= n_tiles > 0;
    }
  };
  auto work = [&](int t, attn::Work& w) {
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
        [&](const TileSeq& seq, attn::Work& w) {
          const int total = work_tiles(p);
          for (;;) {
            int t;
            if (dynamic_walk<T>(p, total)) {
              // Thread 0 draws and broadcasts through slot 2 + step % 2 (written again only
              // after the next barrier, which every thread reaches after reading it); a number
              // without rows is dropped by all and the next drawn. (Drawing one ahead, by a
              // thread of warp 3 while the rest went on, measured no better.)
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
        [&](const attn::Work& w, int n_tiles, const TileSeq& seq) {
          produce<T>(p, w, smem, bars, n_tiles, seq);
        });
  } else {
    sm90::setmaxnreg_inc<T::kConsumerRegs>();
    int round = 0;
    walk(
        [&](const TileSeq& seq, attn::Work& w) {
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
        [&](const attn::Work& w, int n_tiles, const TileSeq& seq) {
          consume<T, kFeatures>(p, w, smem, bars, n_tiles, seq);
        });
  }
}

template <class T>
void PrefillSm90Ops<T>::launch(const AttnParams& p, cudaStream_t stream) {
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
