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

bool encode_tiled_sw128(CUtensorMap* map, const void* base, bool bf16, int rank,
                        const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                        const char** why) {
  const EncodeTiled fn = encoder();
  if (fn == nullptr) {
    *why = "the driver has no cuTensorMapEncodeTiled";
    return false;
  }
  if (rank < 2 || rank > 5) {
    *why = "a tiled map has 2 to 5 dimensions";
    return false;
  }
  cuuint64_t g_dims[5], g_strides[4];
  cuuint32_t b[5], elem_strides[5];
  for (int i = 0; i < rank; ++i) {
    g_dims[i] = dims[i];
    b[i] = box[i];
    elem_strides[i] = 1;
    if (i > 0) g_strides[i - 1] = strides[i - 1];
  }
  const CUresult r =
      fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
         cuuint32_t(rank), const_cast<void*>(base), g_dims, g_strides, b, elem_strides,
         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    *why = "cuTensorMapEncodeTiled refused the cache's shape or strides";
    return false;
  }
  return true;
}

}  // namespace pagedattn::cuda
