// Host interface of the merge family: the compiled merge_states and merge_ranks instances and
// their launches.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/merge/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::merge {

/// One compiled instance: outputs of `dtype` (float32, float16 or bfloat16).
struct MergeKernel {
  DType dtype;
  void (*launch)(const MergeParams& params, cudaStream_t stream);
};

/// Defined in kernel.cuh, explicitly instantiated by inst/*.cu.
template <DType kDType>
struct MergeOps {
  static void launch(const MergeParams& params, cudaStream_t stream);
};

const std::vector<MergeKernel>& merge_kernels();
const MergeKernel* find_merge(DType dtype);

/// One compiled merge_ranks instance: partials of `partial_dtype` into an output of
/// `output_dtype` (each float32, float16 or bfloat16).
struct MergeRanksKernel {
  DType partial_dtype, output_dtype;
  void (*launch)(const MergeRanksParams& params, cudaStream_t stream);
};

/// Defined in kernel.cuh, explicitly instantiated by inst/merge_ranks_*.cu.
template <DType kPartial, DType kOut>
struct MergeRanksOps {
  static void launch(const MergeRanksParams& params, cudaStream_t stream);
};

const std::vector<MergeRanksKernel>& merge_ranks_kernels();
const MergeRanksKernel* find_merge_ranks(DType partial_dtype, DType output_dtype);

}  // namespace pagedattn::cuda::merge
