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
//             (head sizes that are multiples of 32) is converted to f16 in registers from
//             16/8/4-byte LDS of the stage, two codes per cvt (fp8x2_f16), and multiplied in
//             f16 whatever the activation type (a bf16 Q scaled into f16 row by row,
//             q_row_shift; Q stored in fragment order); at head size 80 the stage is widened in
//             smem to the activation type (widen.cuh). The generic
//             instance does the same in float on CUDA cores. Softmax runs in log2 units (one
//             exp2 per score; log2(e) folded into the scale).
//   loads     16-byte cp.async.cg, whole rows per copy instruction; the row address of every
//             key comes from the block table, looked up one tile ahead by lane (row % 16) and
//             shuffled to the lanes that copy it; rows past the split are zero-filled and
//             masked. Launched with programmatic dependent launch (griddepcontrol).
//   budget    smem: config.h smem_layout (e.g. 106 KB at head size 128 bf16: 2 CTAs per SM,
//             ~128 KB of loads in flight per SM; 58 KB at fp8 d128: 3 CTAs); registers: O is
//             head_size / 2 floats per thread. docs/kernels/decode.md has the ptxas figures.
//   test      tests/cuda and `backend_ops test --device cuda` (every feature against float64);
//             time with bench/gpu/bench_decode (bench/gpu/run.sh runs both).
//   stages    cta.cuh (the CTA's work and rows, the Q tile), pipeline.cuh (each warp's block-
//             table lookups and K/V copies), tile.cuh (S = Q K^T, softmax.cuh's online softmax,
//             O += P V), store.cuh (the warps' merge and the rows out); decode_kernel below
//             runs them in order.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/arch/sm90/bulk_copy.cuh"
#include "cuda/attn_common/common.cuh"
#include "cuda/attn_common/params.h"
#include "cuda/common/check.h"
#include "cuda/common/launch.cuh"
#include "cuda/decode/config.h"
#include "cuda/decode/cta.cuh"
#include "cuda/decode/launch.h"
#include "cuda/decode/pipeline.cuh"
#include "cuda/decode/store.cuh"
#include "cuda/decode/tile.cuh"

namespace pagedattn::cuda::decode {

// The main loop over this warp's tiles: wait for tile k, refill the stage tile k - 1 freed
// with tile k + kStages - 1, look the next tile's rows up, compute tile k. kBulk: the copies
// are cp.async.bulk on the stages' mbarriers (p.bulk_copy), else cp.async groups.
template <class T, bool kE5m2, bool kBulk>
__device__ __forceinline__ void main_loop(const AttnParams& p, const Work& w, const Shape<T>& sh,
                                          const KvPipe<T>& kv, RowRef& ref, const Operands<T>& op,
                                          const ThreadRow (&rows)[2], int lo_max, int hi_min,
                                          RowAcc<kNtOf<T>>& acc) {
  const SmemLayout& lay = sh.lay;
  for (int k = 0; k < kv.n_wt; ++k) {
    const int next = k + T::kStages - 1;
    if constexpr (kBulk) {
      sm90::bulk_wait(&kv.my_bars[k % T::kStages], uint32_t(k / T::kStages) & 1u);
      __syncwarp();  // every lane is done reading the stage refilled below (tile k - 1's)
      kv.issue_bulk(lay, next % T::kStages, next, ref);
    } else {
      sm80::cp_async_wait<T::kStages - 2>();
      __syncwarp();  // the tile's copies by every lane are visible; the freed stage is unread
      kv.issue(w, lay, next % T::kStages, next, ref);
      sm80::cp_async_commit();
    }
    ref = kv.lookup(p, w, next + 1);
    compute_tile<T, kE5m2>(p, sh, kv, op, rows, lo_max, hi_min, k % T::kStages, kv.tile_start(w, k),
                           acc);
  }
}

// The main loop compiled once per copy path and (in-register fp8) cache format.
template <class T, bool kBulk>
__device__ __forceinline__ void by_format(const AttnParams& p, const Work& w, const Shape<T>& sh,
                                          const KvPipe<T>& kv, RowRef& ref, const Operands<T>& op,
                                          const ThreadRow (&rows)[2], int lo_max, int hi_min,
                                          RowAcc<kNtOf<T>>& acc) {
  if (T::kRegFp8 && p.kv_dtype == int(DType::kFp8E5M2)) {
    main_loop<T, true, kBulk>(p, w, sh, kv, ref, op, rows, lo_max, hi_min, acc);
  } else {
    main_loop<T, false, kBulk>(p, w, sh, kv, ref, op, rows, lo_max, hi_min, acc);
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm)
    decode_kernel(const __grid_constant__ AttnParams p) {
  static_assert(T::kStages >= 2, "the pipeline needs two stages");

  // Everything below reads memory that earlier kernels of the stream may write (metadata, Q,
  // the cache): wait for them (programmatic dependent launch; a no-op without the launch
  // attribute), then let the next grid (the split combine, the next layer) be scheduled as our
  // CTAs retire. It waits for our completion before reading anything.
  sm80::grid_dependency_wait();
  sm80::launch_dependent_grids();

  Work w;
  cta_tile<T>(p, w);
  const int rows_total = w.q_len * p.group;
  if (w.row0 >= rows_total) return;  // a shorter query than the longest: nothing here
  if (p.route_rows > 0 && rows_total > p.route_rows) return;  // the prefill kernel's request
  int lo_max, hi_min;  // tiles [lo_max, hi_min) need no mask for any row
  cta_split<T>(p, rows_total, w, lo_max, hi_min);
  const Shape<T> sh(p);
  ThreadRow rows[2];
  thread_rows(p, w, rows);
  uint4 q_raw[kQPerThread<T>];
  load_q<T>(p, w, sh, q_raw);  // global loads first: they overlap the first K/V copies

  KvPipe<T> kv(p, w, sh);
  RowAcc<kNtOf<T>> acc;
  RowRef ref = kv.prologue(p, w, sh.lay);
  q_to_smem<T>(p, w, sh, q_raw, rows);
  const Operands<T> op(sh.lay);

  if (p.bulk_copy) {
    by_format<T, true>(p, w, sh, kv, ref, op, rows, lo_max, hi_min, acc);
  } else {
    by_format<T, false>(p, w, sh, kv, ref, op, rows, lo_max, hi_min, acc);
  }
  sm80::cp_async_wait<0>();  // (the bulk path waited for every tile it issued)

  merge_warps<T>(sh, acc);
  store_rows<T>(p, w, sh);
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
