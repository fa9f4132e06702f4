// Host interface of the prefill family: the compiled instances (one flat table) and their
// selection. The kernels take the parameters of every attention kernel (attn_common/params.h):
// they read the same metadata, cache and outputs as the decode kernel, and split partials go
// through the same combine kernel (attn_common/combine.cuh).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "cuda/attn_common/params.h"
#include "cuda/prefill/config.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::prefill {

/// One compiled prefill kernel.
struct PrefillKernel {
  DType act;
  KVKind kv;
  int head_size;
  int sm;       ///< 80: the portable mma.sync kernel; 90: the Hopper wgmma kernel (sm_90 only)
  int block_m;  ///< packed query rows per CTA: num_q_tiles = ceil(max_query_len * G / block_m)
  /// fp8 products (sm 90, e4m3 cache, query_quant): Q narrowed to e4m3, QK^T and P V as fp8
  /// wgmma with P in e4m3.
  bool fp8_math;
  /// > 0: the kernel can take full K/V tiles by TMA (attn::AttnParams::kv_tma): its tile of
  /// keys (the Hopper kernel over a 16-bit cache of its activation dtype, head size a multiple
  /// of 64). 0: cp.async only.
  int tma_tile;
  void (*launch)(const attn::AttnParams& params, cudaStream_t stream);
  int (*ctas_per_sm)(int device);
};

/// Defined in portable/kernel.cuh, explicitly instantiated by inst/*.cu.
template <class TraitsT>
struct PrefillOps {
  static void launch(const attn::AttnParams& params, cudaStream_t stream);
  static int ctas_per_sm(int device);
};

/// Defined in sm90/kernel.cuh, explicitly instantiated by inst/*.cu.
template <class TraitsT>
struct PrefillSm90Ops {
  static void launch(const attn::AttnParams& params, cudaStream_t stream);
  static int ctas_per_sm(int device);
};

const std::vector<PrefillKernel>& prefill_kernels();

/// The compiled kernel for (act, cache, head_size) on a device of compute capability
/// `cc_major`, at the smallest compiled head size >= head_size (its bucket; head sizes as
/// attn::serves_head_size takes them): the Hopper kernel on sm_90 when one is compiled and
/// `portable` is false (its fp8-product instance when `fp8_math`, the cache is e4m3 and one is
/// compiled), else the portable one; nullptr when neither is (float32 activations and mixed
/// 16-bit types stay on the decode family's kernels).
const PrefillKernel* find_prefill(DType act, DType cache, int head_size, int cc_major,
                                  bool portable = false, bool fp8_math = false);

}  // namespace pagedattn::cuda::prefill
