// Host interface of the MLA decode family: the compiled instances (one flat table, which the
// backend's check() also reads), their selection and their launches.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/mla/config.h"
#include "cuda/mla/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::mla {

/// One compiled latent attention kernel (sm_90a only).
struct MlaKernel {
  DType act;
  KVKind kv;
  bool split_s;  ///< Traits::split_s (experimental: S split between the consumer warpgroups)
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

/// The compiled kernel for activations `act` over a latent cache of `cache` (`split_s`: the
/// experimental variant), or nullptr (float32 activations, mixed 16-bit types and e5m2 caches
/// are not compiled).
const MlaKernel* find_mla(DType act, DType cache, bool split_s = false);
const MlaCombineKernel* find_mla_combine(DType act);

}  // namespace pagedattn::cuda::mla
