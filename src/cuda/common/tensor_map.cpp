#include "cuda/common/tensor_map.h"

#include <cuda_runtime.h>

#include <mutex>

namespace pagedattn::cuda {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    // The 12.0 ABI of the function, whatever the driver's version.
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<EncodeTiled>(p);
    }
  });
  return fn;
}

}  // namespace

bool encode_tiled_3d_sw128(CUtensorMap* map, const void* base, bool bf16, const uint64_t dims[3],
                           const uint64_t strides[2], const uint32_t box[3], const char** why) {
  const EncodeTiled fn = encoder();
  if (fn == nullptr) {
    *why = "the driver has no cuTensorMapEncodeTiled";
    return false;
  }
  const cuuint64_t g_dims[3] = {dims[0], dims[1], dims[2]};
  const cuuint64_t g_strides[2] = {strides[0], strides[1]};
  const cuuint32_t b[3] = {box[0], box[1], box[2]};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r =
      fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
         const_cast<void*>(base), g_dims, g_strides, b, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    *why = "cuTensorMapEncodeTiled refused the latent cache's shape or strides";
    return false;
  }
  return true;
}

}  // namespace pagedattn::cuda
