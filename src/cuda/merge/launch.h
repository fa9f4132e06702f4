// Host interface of the merge family: the compiled merge_states instances and their launch.
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

}  // namespace pagedattn::cuda::merge
