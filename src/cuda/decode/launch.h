// Host interface of the decode family: the compiled instances (one flat table, which the
// backend's check() also reads), their selection and their launches. The parameters and the
// split combine are attn_common's (shared with the prefill kernels).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/attn_common/params.h"
#include "cuda/decode/config.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::decode {

using attn::AttnParams;

/// One compiled attention kernel.
struct DecodeKernel {
  DType act;
  KVKind kv;
  int head_size;  ///< the bucket: problems of head sizes up to it; 0: the generic kernel
  /// pdl: overlap with the previous kernel of the stream (false behind the prefill kernel).
  void (*launch)(const AttnParams& params, cudaStream_t stream, bool pdl);
  /// CTAs of this kernel one SM holds (for the split planner); prepares the kernel's shared
  /// memory limit on `device` first.
  int (*ctas_per_sm)(int device);
};

/// Defined in kernel.cuh, explicitly instantiated by inst/*.cu.
template <class TraitsT>
struct DecodeOps {
  static void launch(const AttnParams& params, cudaStream_t stream, bool pdl);
  static int ctas_per_sm(int device);
};

const std::vector<DecodeKernel>& decode_kernels();

/// The compiled kernel for (act, cache, head_size): the tensor-core instance of the smallest
/// compiled head size >= head_size (run with the problem's head size: a bucket), else the
/// generic instance of (act, cache), else nullptr.
const DecodeKernel* find_decode(DType act, DType cache, int head_size);
/// The compiled head sizes of the tensor-core kernel of (act, kv), ascending.
std::vector<int> compiled_head_sizes(DType act, KVKind kv);

}  // namespace pagedattn::cuda::decode
