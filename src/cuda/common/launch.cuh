// The launch every kernel family uses: programmatic dependent launch through
// cudaLaunchKernelEx.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/common/check.h"
#include "cuda/common/device_props.h"

namespace pagedattn::cuda {

/// Launches `kernel(p)` with programmatic stream serialization allowed: its CTAs may be
/// scheduled while the previous kernel of the stream finishes (the kernels call the
/// griddepcontrol pair at their top), which hides the launch gap between an attention kernel and
/// its combine and between layers. Graph capture keeps the edge as a programmatic dependency.
/// `pdl` false launches plainly: behind a long kernel, early CTAs would only sit in
/// griddepcontrol.wait holding SM slots that kernel needs (the decode kernel behind the prefill
/// kernel).
/// `cluster` other than 1 x 1 x 1 launches thread-block clusters of that shape (grid a
/// multiple of it).
template <class Params>
inline void launch_with_pdl(void (*kernel)(Params), dim3 grid, dim3 block, int smem,
                            cudaStream_t stream, const Params& p, bool pdl = true,
                            dim3 cluster = dim3(1, 1, 1)) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  // Code compiled below sm_90 (sm_80 machine code, or compute_80 PTX loaded on a later GPU)
  // has no griddepcontrol.wait: launched with the attribute it could read its producer's
  // output early, so it is launched plainly.
  if (pdl && kernel_has_pdl(reinterpret_cast<const void*>(kernel))) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  PAGEDATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda
