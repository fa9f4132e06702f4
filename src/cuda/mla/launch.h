// Host interface of the MLA decode family: the compiled instances (one flat table, which the
// backend's check() also reads), their selection and their launches.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cuda/mla/config.h"
#include "cuda/mla/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla {

/// One compiled latent attention kernel (sm_90a only).
struct MlaKernel {
  DType act;
  KVKind kv;
  Consumer consumer;  ///< Traits::consumer: how the two consumer warpgroups share a tile
  int max_out_cols;   ///< Traits::kOutCols: the widest output it writes (512 or 576)
  int block_m;        ///< Traits::kBlockM: packed rows per CTA (num_m_tiles = ceil(rows / it))
  /// Its splits can merge in a cluster (MlaParams::split_cluster; Traits::kClusterMerge).
  bool cluster_merge;
  void (*launch)(const MlaParams& params, cudaStream_t stream);
  /// CTAs one SM holds (for the split planner); prepares the shared memory limit first.
  int (*ctas_per_sm)(int device);
};

/// The split combine of 576-column partials, per activation (output) dtype.
struct MlaCombineKernel {
  DType act;
  void (*launch)(const MlaParams& params, cudaStream_t stream);
};

/// Defined in kernel.cuh / combine.cuh, explicitly instantiated by inst/*.cu.
template <class TraitsT>
struct MlaOps {
  static void launch(const MlaParams& params, cudaStream_t stream);
  static int ctas_per_sm(int device);
};
template <DType kAct>
struct MlaCombineOps {
  static void launch(const MlaParams& params, cudaStream_t stream);
};

const std::vector<MlaKernel>& mla_kernels();
const std::vector<MlaCombineKernel>& mla_combine_kernels();

/// The spelling of `c` in the cuda option mla_consumer ("auto", "split-s", "seesaw", "swap-ab",
/// "swap-ab-32").
const char* consumer_name(Consumer c);
/// The consumer division kAuto means for a cache kind and head count (the measured-fastest
/// compiled one): the seesaw where a request's rows span several M tiles whose CTAs share each
/// K/V read through L2 (16-bit caches, more than kBlockM heads), split-S elsewhere.
Consumer default_consumer(KVKind kv, int num_heads);
/// The compiled kernel for activations `act` over a latent cache of `cache` with consumer
/// division `consumer` (kAuto: default_consumer()) whose output holds `out_cols` columns, the
/// narrowest such (split-S has 512- and 576-column instances: the 512 skip P k_pe), or nullptr
/// (float32 activations, mixed 16-bit types, e5m2 caches, the seesaw over fp8 and 576 columns
/// from the seesaw or swap AB are not compiled).
const MlaKernel* find_mla(DType act, DType cache, int num_heads,
                          Consumer consumer = Consumer::kAuto, int out_cols = kLatent);
const MlaCombineKernel* find_mla_combine(DType act);

/// Auto's kernels for steps of few rows a request: swap AB's 16-row and 32-row CTAs (nulls where
/// not compiled or not auto), narrowest first.
using NarrowMla = std::array<const MlaKernel*, 2>;

/// The kernel one step runs: the first of `narrow` whose CTA holds every request's rows
/// (max_query_len * num_heads <= block_m) and whose width holds the output, else the configured
/// kernel when the output fits it, else `wide` (auto's split-S for 576 columns; null otherwise).
/// Null when none fits. The split planner asks with the latent width (it does not know the
/// output's): where that picks swap AB and the forward's wider output picks split-S, both put
/// each request's <= 32 rows on one CTA, so the plan holds for either.
const MlaKernel* mla_for_step(const MlaKernel* configured, const MlaKernel* wide,
                              const NarrowMla& narrow, int64_t max_query_len, int num_heads,
                              int out_cols);

}  // namespace pagedattn::cuda::mla
