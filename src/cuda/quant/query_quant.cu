// The query quantiser: one thread per element (a prefill's query is a few MB; the attention
// over it takes 100-1000 times longer).
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/quant/launch.h"

namespace pagedattn::cuda::quant {

namespace {

constexpr int kThreads = 256;

template <DType kAct>
__global__ void __launch_bounds__(kThreads)
    query_quant_kernel(const __grid_constant__ QueryQuantParams p) {
  const int64_t row = int64_t(p.num_heads) * p.head_size;
  const int64_t n = p.num_tokens * row;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / row;
    const int hd = int(i - t * row);
    const int h = hd / p.head_size, d = hd - h * p.head_size;
    const float x = load_as_float<kAct>(p.q, t * p.q_stride_token + h * p.q_stride_head + d);
    const float q8 = fp8_to_float(float_to_fp8_bits(x * p.inv_scale, false), false);
    store_from_float<kAct>(p.out, i, q8);
  }
}

}  // namespace

void launch_query_quant(const QueryQuantParams& p, cudaStream_t stream) {
  const int64_t n = p.num_tokens * p.num_heads * p.head_size;
  if (n == 0) return;
  const unsigned ctas = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
  switch (DType(p.dtype)) {
    case DType::kF32:
      query_quant_kernel<DType::kF32><<<ctas, kThreads, 0, stream>>>(p);
      break;
    case DType::kF16:
      query_quant_kernel<DType::kF16><<<ctas, kThreads, 0, stream>>>(p);
      break;
    default:
      query_quant_kernel<DType::kBF16><<<ctas, kThreads, 0, stream>>>(p);
      break;
  }
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::quant
