// Host interface of the query quantiser (AttentionConfig::query_quant, spec 1.6).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pagedattn::cuda::quant {

/// q8 = saturate_e4m3(q * inv_scale), stored back in the activation dtype (exactly: every e4m3
/// value is a float16 / bfloat16 / float32 value), so that every attention kernel reads the
/// quantised query as it reads any query, and the Hopper fp8 kernel narrows it back losslessly.
struct QueryQuantParams {
  const void* q;  ///< [num_tokens, num_heads, head_size], dtype
  int64_t q_stride_token, q_stride_head;
  void* out;  ///< [num_tokens, num_heads, head_size] contiguous, dtype
  int64_t num_tokens;
  int num_heads, head_size;
  int dtype;        ///< pagedattn::DType of q and out (float32, float16 or bfloat16)
  float inv_scale;  ///< 1 / q_scale
};

void launch_query_quant(const QueryQuantParams& params, cudaStream_t stream);

}  // namespace pagedattn::cuda::quant
