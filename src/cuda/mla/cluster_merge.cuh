// The split-KV merge inside a thread-block cluster: the num_splits CTAs of one (request, M tile)
// are one cluster (MlaParams::split_cluster) and merge their normalised rows through distributed
// shared memory instead of float partials in global memory and a second kernel (combine.cuh).
//
// Why: the partials' round trip (2 KB a row a split, written as every CTA ends, read back by a
// kernel that starts when the last CTA is done) and the kernel boundary: this merge is 2.1-2.4%
// faster at 16 heads x 1-2 tokens and 32 x 1, b64, two splits. Split-S's 64-row CTAs (16 heads x
// 4 tokens) hold 4x the rows: there it is 4% faster than the combine kernel at b64, bf16 (and
// within 0-2% of it over fp8). docs/kernels/mla.md has the figures.
//
// Map (kernel.cuh's "split merge")
//   owners   CTA rank r of the cluster (its split, blockIdx.y) owns latent columns [r cpc,
//            (r + 1) cpc) of the output, cpc = merge_cols(s) (a multiple of 4).
//   send     once every CTA of the cluster is past its last tile (cluster barrier 1: their K/V
//            stages are free), each consumer thread stores its normalised O values into the
//            owners' stage area, recv [s][kRows][cpc] float, and one thread per row its LSE into
//            every CTA's lse [s][kRows] (log2 units, -inf = no keys).
//   merge    after cluster barrier 2, the owner's 256 consumer threads merge their columns of
//            every row as combine.cuh does (weights 2^(lse_c - max)), store the output and, at
//            rank 0, the LSE.
//   budget   s kRows cpc + s kRows floats (32-34 KB at 16 rows, 64-68 KB at 32, 128-135 KB at
//            64: split-S) from the first K/V stage on (config.h merge_bytes, checked by Traits).
#pragma once

#include <cooperative_groups.h>

#include <cstdint>
#include <cuda/ptx>

#include "cuda/common/dtypes.cuh"
#include "cuda/mla/common.cuh"
#include "cuda/mla/store.cuh"

namespace pagedattn::cuda::mla {

/// Both cluster barriers, for threads that take no part in the merge (the producer): every
/// thread of the cluster's CTAs arrives at each.
__device__ __forceinline__ void cluster_merge_barriers() {
  ptx::barrier_cluster_arrive(ptx::sem_release);
  ptx::barrier_cluster_wait(ptx::sem_acquire);
  ptx::barrier_cluster_arrive(ptx::sem_release);
  ptx::barrier_cluster_wait(ptx::sem_acquire);
}

template <int kRows>
struct ClusterMerge {
  int s, rank, cpc;
  float* recv;  ///< this CTA's [s][kRows][cpc] (generic address of its shared window)
  float* lse;   ///< this CTA's [s][kRows]

  /// `area`: the first K/V stage, free once barrier 1 is passed.
  /// Harmless to build when p.split_cluster <= 1 (then unused).
  __device__ ClusterMerge(const MlaParams& p, unsigned char* area)
      : s(max(p.split_cluster, 1)),
        rank(int(blockIdx.y)),
        cpc(merge_cols(s)),
        recv(reinterpret_cast<float*>(area)),
        lse(reinterpret_cast<float*>(area) + s * kRows * cpc) {}

  /// Barrier 1: every CTA of the cluster is past its last tile. The stages were last written by
  /// the async proxy (TMA, cp.async) and read by wgmma; the remote stores that follow are generic.
  __device__ void arrive_done() const {
    ptx::fence_proxy_async(ptx::space_shared);
    ptx::barrier_cluster_arrive(ptx::sem_release);
    ptx::barrier_cluster_wait(ptx::sem_acquire);
  }
  /// Row `row`'s normalised value at latent column `col` to its owner.
  __device__ void send(int row, int col, float v) const {
    const int owner = col / cpc;
    float* const dst = cooperative_groups::this_cluster().map_shared_rank(recv, owner);
    dst[(rank * kRows + row) * cpc + (col - owner * cpc)] = v;
  }
  /// Row `row`'s values at the even latent column `col` and col + 1 (one owner: cpc is even).
  __device__ void send2(int row, int col, float v0, float v1) const {
    const int owner = col / cpc;
    float* const dst = cooperative_groups::this_cluster().map_shared_rank(recv, owner);
    *reinterpret_cast<float2*>(dst + (rank * kRows + row) * cpc + (col - owner * cpc)) =
        make_float2(v0, v1);
  }
  /// Row `row`'s LSE (log2 units) to every CTA of the cluster.
  __device__ void send_lse(int row, float lse2) const {
    for (int o = 0; o < s; ++o) {
      cooperative_groups::this_cluster().map_shared_rank(lse, o)[rank * kRows + row] = lse2;
    }
  }
  /// Barrier 2, then this CTA's columns of rows [0, w.num_rows) merged and stored by the 256
  /// consumer threads (u = 0 .. 255).
  template <DType kAct>
  __device__ void merge_store(const MlaParams& p, const Work& w, int u) const {
    ptx::barrier_cluster_arrive(ptx::sem_release);
    ptx::barrier_cluster_wait(ptx::sem_acquire);
    const int col0 = rank * cpc, ncols = min(cpc, kLatent - col0);
    const int chunks = ncols > 0 ? ncols / 4 : 0;  // kLatent and cpc are multiples of 4
    for (int k = u; k < w.num_rows * chunks; k += 256) {
      const int row = k / chunks, c4 = k - row * chunks;
      float mx = -INFINITY;
      for (int c = 0; c < s; ++c) mx = fmaxf(mx, lse[c * kRows + row]);
      const float base = mx == -INFINITY ? 0.0f : mx;
      float sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int c = 0; c < s; ++c) {
        const float wgt = exp2f(lse[c * kRows + row] - base);  // 0 for a split without keys
        sum += wgt;
        if (wgt == 0.0f) continue;
        const float4 v = *reinterpret_cast<const float4*>(recv + (c * kRows + row) * cpc + 4 * c4);
        acc[0] += wgt * v.x, acc[1] += wgt * v.y, acc[2] += wgt * v.z, acc[3] += wgt * v.w;
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int pr = w.row0 + row;
      const int t = w.q_begin + pr / p.num_heads, head = pr % p.num_heads;
      char* const out = static_cast<char*>(p.out) +
                        (int64_t(t) * p.out_stride_token + int64_t(head) * p.out_stride_head) * 2;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = col0 + 4 * c4 + i;
        if (col < p.out_cols) store_from_float<kAct>(out, col, acc[i] * inv);
      }
      if (rank == 0 && c4 == 0 && p.lse != nullptr) {
        store_lse(p, head, t, sum > 0.0f ? mx + log2f(sum) : -INFINITY);
      }
    }
  }
};

// The 64-row consumers' split merge in a cluster (split-S's 512-column instances): this
// thread's rows row_a and row_a + 8, normalised as store_rows does, to the CTAs that own their
// columns, then this CTA's columns merged and stored (ClusterMerge above).
template <class T>
__device__ __forceinline__ void merge_rows_in_cluster(const MlaParams& p, const Work& w,
                                                      unsigned char* area, const float (&o)[32][4],
                                                      const float (&m)[2], const float (&l)[2],
                                                      int row_a, int t4, int cw, int ct) {
  static_assert(T::kClusterMerge && T::kBlockM == kBlockM);
  const ClusterMerge<kBlockM> cm(p, area);
  cm.arrive_done();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowEnd end = row_end(m[h], quad_sum(l[h]), p.v_scale);
    const int row = row_a + 8 * h;
    if (row >= w.num_rows) continue;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      cm.send2(row, 256 * cw + 8 * i + 2 * t4, o[i][2 * h] * end.factor,
               o[i][2 * h + 1] * end.factor);
    }
    if (cw == 0 && t4 == 0) cm.send_lse(row, end.lse2);
  }
  cm.template merge_store<T::act>(p, w, cw * 128 + ct);
}

}  // namespace pagedattn::cuda::mla
