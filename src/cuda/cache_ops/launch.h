// Host interface of the cache_ops family: the compiled write_kv instances and their launch.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/cache_ops/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::cache_ops {

/// One compiled instance: activations of `act` written into a cache of `cache`.
struct WriteKVKernel {
  DType act;
  DType cache;
  void (*launch)(const WriteKVParams& params, cudaStream_t stream);
};

/// Defined in kernel.cuh, explicitly instantiated by inst/*.cu (one per file).
template <DType kAct, DType kCache>
struct WriteKVOps {
  static void launch(const WriteKVParams& params, cudaStream_t stream);
};

/// The flat table of compiled instances (the same one check() reads).
const std::vector<WriteKVKernel>& write_kv_kernels();
/// The instance for (act, cache), or nullptr when it was not compiled.
const WriteKVKernel* find_write_kv(DType act, DType cache);

}  // namespace pagedattn::cuda::cache_ops
