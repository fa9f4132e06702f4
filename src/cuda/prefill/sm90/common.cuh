// The Hopper prefill kernel's shared pieces: the CTA's mbarriers, which tiles come by TMA, the
// Q buffers' rotation, the dynamic walk's hand-over of work tiles. The map is kernel.cuh's.
#pragma once

#include <cuda/ptx>
#include <type_traits>

#include "cuda/arch/sm80/shared.cuh"
#include "cuda/arch/sm90/wgmma.cuh"
#include "cuda/prefill/common.cuh"

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
__device__ __forceinline__ int tma_tiles(const AttnParams& p, const attn::Work& w) {
  const bool aligned = p.kv_direct || (w.kv_begin & (p.kv_tma_rows - 1)) == 0;
  return kTmaTiles<T> && p.kv_tma != 0 && aligned ? (w.kv_end - w.kv_begin) / T::kBlockN : 0;
}

// Instances whose Q may come by TMA (AttnParams::q_tma): those over a 16-bit cache. The fp8
// widening producer (40 registers, the busiest role there) spilled 56 bytes instead of 12 with
// the TMA branch compiled in and lost 4% at d128 16k [ptxas -v].
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
// `turns_open` says an earlier work tile of the CTA had K/V tiles, whose consumers took turns
// (so warpgroup 0's turn is already open: the last hand-over of that tile).
struct TileSeq {
  int it = 0, k = 0;
  bool turns_open = false;
};

// The dynamic walk's hand-over (Sm90Layout::tile_offset): thread 0 of the producer writes 1 (-1:
// the CTA's walk is over) and work tile k's Work into Q buffer k's slots once the
// consumers have released the buffer's last use, and arrives on the buffer's `full` barrier,
// whose release orders the writes before the consumers' wait returns: the consumers read the
// Work from shared memory instead of computing it from global memory after that wait.
// `count` arrivals: one beside Q's own (q_full_arrivals), or all of them for the end, which
// loads no Q.
static_assert(sizeof(attn::Work) <= kWorkSlotBytes, "Sm90Layout's Work slots");
// A value every lane of the warp holds, through a shuffle from lane 0 (the warp converged), so
// that ptxas knows it is uniform: with the walk's number and Work read from shared memory under
// the dynamic walk, they were per-thread values in both walks (one loop), and so were the
// rings' stages and phases and the wgmma descriptors derived from them (without the shuffle,
// [SASS d64] most of the consumers' uniform-datapath instructions were gone and 16k ran 2-8%
// slower).
__device__ __forceinline__ int warp_uniform(int v) {
  return __shfl_sync(0xffffffffu, v, 0);
}
__device__ __forceinline__ attn::Work warp_uniform(const attn::Work& w) {
  attn::Work u;
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
__device__ __forceinline__ attn::Work* work_slot(unsigned char* smem, int qb) {
  return reinterpret_cast<attn::Work*>(smem + T::layout().tile_offset + 16 + kWorkSlotBytes * qb);
}
template <class T>
__device__ __forceinline__ void publish_tile(unsigned char* smem, Barriers<T::kStages> bars, int k,
                                             int more, const attn::Work* w, uint32_t count) {
  const int qb = q_buffer<T>(k);
  mbar_wait(bars.q_empty(qb), q_parity<T>(k) ^ 1);
  reinterpret_cast<volatile int*>(smem + T::layout().tile_offset)[qb] = more;
  if (w != nullptr) *work_slot<T>(smem, qb) = *w;
  ptx::mbarrier_arrive(bars.q_full(qb), count);
}

// Whether the CTAs take their work tiles by the counter (draw_tile): a persistent grid with
// fewer CTAs than work tiles (with as many, each takes its own), in the instances whose K/V
// tiles may come by TMA, the only launches the backend gives a counter (CudaImpl::forward). The
// others compile the walk out: with it, the fp8 products' 56-register producer spilled 16
// instructions in its K/V loop (none without) and d64 lost 11% [SASS].
// The launch's work tiles: (request, KV head) pairs x q tiles x splits.
__device__ __forceinline__ int work_tiles(const AttnParams& p) {
  return p.num_q_tiles * p.num_seqs * p.num_kv_heads * p.num_splits;
}
template <class T>
__device__ __forceinline__ bool dynamic_walk(const AttnParams& p, int total) {
  return kTmaTiles<T> && p.tile_counter != nullptr && int(gridDim.x) < total;
}

// Arrivals that complete a Q buffer's `full` phase: TMA's one (with the box bytes) or one per
// producer thread, and under the dynamic walk thread 0's publish_tile.
template <class T>
__device__ __forceinline__ uint32_t q_full_arrivals(const AttnParams& p, bool dynamic) {
  return (kQTma<T> && p.q_tma ? 1u : 128u) + (dynamic ? 1u : 0u);
}

}  // namespace pagedattn::cuda::prefill
