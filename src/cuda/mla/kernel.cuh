// MLA decode on Hopper (sm_90a): the absorbed latent attention as MQA over one 576-wide latent
// head, warp-specialised wgmma.
//
// Map
//   computes  for every packed row (token t, head h) of a request: S = q K^T over the latent
//             entries it may see (causal: token i of a q_len-token request sees seq_len - q_len +
//             i + 1 keys), softmax in log2 units with P rounded to the activation type, O = P E
//             where E is the same entry, its first p.out_cols columns (512: the latent output
//             MLAAttention up-projects; 576: the generic contract, 512..575 = P k_pe, which the
//             seesaw does not compute); natural-log LSE on request; split-KV partials for the
//             combine (combine.cuh).
//   grid      x = num_seqs * num_m_tiles (M tile fastest), y = num_splits. A CTA owns kBlockM
//             = 64 packed rows (row p = token p / N, head p % N; zero rows past the request) and
//             the keys of its split, whole 64-key tiles.
//   warps     384 threads. Warpgroup 0 (producer, 24 registers) copies Q once and every K tile
//             (64 keys x 576) into nine 128-byte-swizzled panels (the wgmma canonical layout):
//             16-byte cp.async, 8 lanes per row, each lane one chunk of every panel (fixed
//             swizzle, immediate offsets), row offsets from the block table in a smem table whose
//             next tile's lookup is in flight during this tile's copies (looked up in series,
//             the producer set the pace [ncu]); completion arrives on the stage's `full`
//             mbarrier. With p.kv_tma, full tiles of a 16-bit cache come instead by TMA (one box
//             per panel: block sizes that are multiples of 64, so a tile lies in one block;
//             issued by thread 0 with the tile's byte count, L2 evict-first). fp8
//             caches: the raw tile lands in natural order, which the consumers widen into a
//             16-bit stage (widen.cuh): split-S's raw tile in the back half of that stage
//             itself (two stages; tile j + 1 widened while tile j's P V runs); swap AB's in five
//             slots (16 rows) or four (32), chunk q of key r at q ^ raw_chunk_swizzle(r), read
//             by the consumers straight into their A fragments. Warpgroups 1 and 2 consume (240
//             registers each), dividing a tile's work as one of these (the cuda option
//             mla_consumer forces one; auto picks per step, mla_for_step):
//   split-S   (Consumer::kSplitS: the default for fp8 caches and up to 64 heads) warpgroup c
//             computes S only for keys 32 c .. 32 c + 31 (m64n32k16), the two
//             exchange row maxima through shared memory (named barrier 2), each writes its
//             half of P (16-bit) into one swizzled 64 x 64 panel, and both run O += P V with P
//             from shared memory (wgmma SS) over all 64 keys for their columns: S once per
//             tile instead of twice. Row sums stay per warpgroup (same maxima, same
//             rescaling) and are added at the end. Two instances per cache kind: 576 output
//             columns (both warpgroups also compute P k_pe, m64n64k16) and 512 (without it, a
//             fifth less P V per warpgroup; auto's choice wherever the output is the latent).
//   seesaw    (Traits::consumer kSeesaw, 16-bit caches; FlashMLA's schedule) warpgroup c owns the
//   tiles j = c (mod 2): it computes their whole S
//             (m64n64k16 SS, not smem-bound as split-S's n32 is) and softmax and writes P_j to the
//             P panel; it owns O's kv_c columns 256 c .. 256 c + 255 (no k_pe columns: the seesaw's
//             output is the 512 latent columns) for every tile: O += P_j V_j from registers (RS)
//             for its own tiles, from the panel (SS) for the other's. Only the running row maxima
//             are a serial chain through both warpgroups; one warpgroup's softmax runs under the
//             other's products. Handoffs on named barriers 3 + c (m_j in xchg[c]) and 5 + c (P_j in
//             the panel), each arrived by the owner and synced by the other once per tile, in
//             strict alternation (the chain orders them); one P panel suffices because the reader
//             of P_j is the writer of P_{j+1}. Warpgroup 0's P V reads panels 0-3, warpgroup 1's
//             panels 4-7 (panel 8, k_pe, only S reads; it stays in the second half): each half of a
//             stage has its own full / empty barriers, freed by its reader and refilled (owner's
//             half first) while the other half is still read. The default above 64 heads.
//   swap AB   (Consumer::kSwapAB: auto's kernel for steps of at most 16 packed rows a request,
//             i.e. 16 heads x 1 token) CTAs of 16 rows (Q's panels
//             16 rows), the products transposed so that the rows are N = 16: S^T = K Q^T
//             (m64n16k16 SS, the stage and Q as they are), warpgroup c's partial over k steps
//             18 c .. 18 c + 17, the partials swapped through shared memory (thread ct of both
//             holds the same pairs), the same softmax in both on the sums (row maxima over the
//             warps through shared memory), P^T into one 16-row panel (warpgroup c its rows
//             8 c ..), O^T += V^T P^T (m64n16k16 SS with A MN-major: the stage's panels 4 c ..
//             4 c + 3, warpgroup c's 256 output columns). The 512 latent columns only. No padded
//             rows: ~170 KB of shared-memory reads per tile against split-S's ~328 KB, a quarter
//             of the tensor work (consume_swap_ab.cuh). Over fp8 no 16-bit stage: both products
//             are wgmma RS with f16 A fragments converted from the raw tile in registers (K's
//             columns and V's keys and columns in frags_fp8.cuh's orders, Q stored in the same
//             column order, bf16 Q rows scaled into f16 by powers of two), five raw tiles in
//             flight; tile j's S^T fragments are built under tile j - 1's O^T, its O^T fragments
//             under its S^T.
//   swap AB 32 (Consumer::kSwapAB32: auto's kernel for steps of 17-32 packed rows a request,
//             16 heads x 2 tokens or 32 heads x 1) the same with
//             32-row CTAs, warpgroup c's softmax the rows 16 c .. 16 c + 15, each row's rescale
//             passed to the other warpgroup, whose O^T (m64n32k16) holds all 32 rows. 16-bit
//             caches: warpgroup c's S^T those rows over all 36 k steps (no partial sums), P^T in
//             two buffers; fp8: from the raw tile as above, S^T (m64n32k16) split by k steps,
//             each thread sending the other warpgroup's rows' 8 partial sums, its fragments
//             built and issued in two halves (O^T's 64 accumulators leave no room for all 72).
//   split merge (MlaParams::split_cluster; Traits::kClusterMerge: swap AB and split-S's
//             512-column instances, at most kMaxClusterSplits splits) the
//             splits of a (request, M tile) are one cluster: after their last tile the consumers
//             send their normalised rows to the CTA owning each column block through
//             distributed shared memory (the freed first stage) and merge them there
//             (cluster_merge.cuh); otherwise float partials and the combine kernel.
//   sync      mbarriers through CCCL's cuda::ptx: full[s] (128 producer arrivals), empty[s]
//             (256 consumer arrivals) per slot s of the producer's ring (the 16-bit stages, fp8
//             split-S's too, or fp8's raw slots); phases flip every kRing tiles. Consumers fence
//             the async proxy after a `full` wait, before their wgmmas read what the generic proxy
//             (cp.async, st.shared) wrote.
//   budget    smem 218 KB (config.h): Q 72 KB + two 16-bit stages of 72 KB (fp8 split-S too,
//             the raw tiles inside them); swap AB ~210 KB: Q 18 KB + two stages (over fp8 five
//             raw slots) + its exchange buffers; swap AB 32 over fp8 195 KB: Q 36 KB, four raw
//             slots, one 4 KB P^T buffer, 8 KB of partial sums. One CTA per SM.
//   test      backend_ops --device cuda --filter mla (float64 reference, poisoned outputs), with
//             --cuda-option mla_consumer=<each> (ctest -L gpu); bench/gpu/bench_mla;
//             docs/kernels/mla.md.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cuda/ptx>

#include "cuda/arch/sm80/ptx.cuh"
#include "cuda/common/check.h"
#include "cuda/mla/common.cuh"
#include "cuda/mla/config.h"
#include "cuda/mla/consume_seesaw.cuh"
#include "cuda/mla/consume_split_s.cuh"
#include "cuda/mla/consume_swap_ab.cuh"
#include "cuda/mla/launch.h"
#include "cuda/mla/params.h"
#include "cuda/mla/produce.cuh"

namespace pagedattn::cuda::mla {

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
  if (!mla_work(p, T::kBlockM, w)) return;
  const int n_tiles = ceil_div(w.kv_end - w.kv_begin, kBlockN);

  const Barriers<T::kRing, T::kHalves> bars{reinterpret_cast<uint64_t*>(smem + lay.bar_offset)};
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(bars.q_full(), 128);
    for (int s = 0; s < T::kRing; ++s) {
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
    // The consumers' two cluster barriers (cluster_merge.cuh).
    if (T::kClusterMerge && p.split_cluster > 1) cluster_merge_barriers();
  } else if constexpr (T::consumer == Consumer::kSplitS) {
    consume_split_s<T>(p, w, smem, bars, n_tiles);
  } else if constexpr (T::consumer == Consumer::kSeesaw) {
    consume_seesaw<T>(p, w, smem, bars, n_tiles);
  } else {
    static_assert(is_swap_ab(T::consumer));
    consume_swap_ab<T>(p, w, smem, bars, n_tiles);
  }
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
  // A cluster merge puts a (request, M tile)'s splits, the whole of grid y, in one cluster.
  const dim3 cluster(1, p.split_cluster > 1 ? unsigned(p.num_splits) : 1u, 1);
  launch_with_pdl(mla_kernel<T>, grid, dim3(T::kThreads), T::layout().total, stream, p, true,
                  cluster);
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
