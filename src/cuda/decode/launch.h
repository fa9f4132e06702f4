// Host interface of the decode family: the compiled instances (one flat table, which the
// backend's check() also reads), their selection and their launches.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/decode/config.h"
#include "cuda/decode/params.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::decode {

/// One compiled attention kernel.
struct DecodeKernel {
  DType act;
  KVKind kv;
  int head_size;  ///< 0: any multiple of 16 up to kMaxHeadSize (the generic kernel)
  /// pdl: overlap with the previous kernel of the stream (false behind the prefill kernel).
  void (*launch)(const DecodeParams& params, cudaStream_t stream, bool pdl);
  /// CTAs of this kernel one SM holds (for the split planner); prepares the kernel's shared
  /// memory limit on `device` first.
  int (*ctas_per_sm)(int device);
};

/// One compiled split combine (the second kernel of a split-KV launch), per activation dtype.
struct CombineKernel {
  DType act;
  void (*launch)(const DecodeParams& params, cudaStream_t stream);
};

/// Defined in kernel.cuh / combine.cuh, explicitly instantiated by inst/*.cu.
template <class TraitsT>
struct DecodeOps {
  static void launch(const DecodeParams& params, cudaStream_t stream, bool pdl);
  static int ctas_per_sm(int device);
};
template <DType kAct>
struct CombineOps {
  static void launch(const DecodeParams& params, cudaStream_t stream);
};

const std::vector<DecodeKernel>& decode_kernels();
const std::vector<CombineKernel>& combine_kernels();

/// Which kind of kernel serves activations `act` over a cache of `cache`: kSame (16-bit, same
/// type), kFp8 (16-bit activations, fp8 cache) or kAny (everything else).
KVKind kv_kind_for(DType act, DType cache);
/// The compiled kernel for (act, cache, head_size), or nullptr.
const DecodeKernel* find_decode(DType act, DType cache, int head_size);
const CombineKernel* find_combine(DType act);
/// The compiled head sizes of the tensor-core kernel of (act, kv), ascending.
std::vector<int> compiled_head_sizes(DType act, KVKind kv);

}  // namespace pagedattn::cuda::decode
