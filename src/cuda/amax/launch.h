// Host interface of the amax family.
#pragma once

#include <cuda_runtime.h>

#include "cuda/amax/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::amax {

/// Defined in kernel.cuh, explicitly instantiated by inst/amax.cu (the dtype is a run-time
/// field: calibration runs once, so one instance serves every float type).
struct AmaxOps {
  static void launch(const AmaxParams& params, cudaStream_t stream);
};

/// Whether the compiled instance reads `dtype`.
bool supports(DType dtype);

}  // namespace pagedattn::cuda::amax
