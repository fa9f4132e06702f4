// The dtypes the compiled amax instance reads (it decides the dtype at run time).
#include "cuda/amax/launch.h"
#include "pagedattn/dtype.h"

namespace pagedattn::cuda::amax {

bool supports(DType dtype) {
  return is_floating(dtype);  // float64, float32, float16, bfloat16, fp8 e4m3 / e5m2
}

}  // namespace pagedattn::cuda::amax
