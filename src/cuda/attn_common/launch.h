// Host interface of what the paged attention kernels share on the host: which kind of kernel
// serves a cache, and the compiled split combines (one flat table, which the backend's check()
// also reads) with their selection.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/attn_common/config.h"
#include "cuda/attn_common/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::attn {

/// One compiled split combine (the second kernel of a split-KV launch), per activation dtype.
struct CombineKernel {
  DType act;
  void (*launch)(const AttnParams& params, cudaStream_t stream);
};

/// Defined in combine.cuh, explicitly instantiated by inst/*.cu.
template <DType kAct>
struct CombineOps {
  static void launch(const AttnParams& params, cudaStream_t stream);
};

const std::vector<CombineKernel>& combine_kernels();

/// Which kind of kernel serves activations `act` over a cache of `cache`: kSame (16-bit, same
/// type), kFp8 (16-bit activations, fp8 cache) or kAny (everything else).
KVKind kv_kind_for(DType act, DType cache);
const CombineKernel* find_combine(DType act);

}  // namespace pagedattn::cuda::attn
