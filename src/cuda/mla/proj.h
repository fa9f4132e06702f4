// Host interface of MLAAttention's per-head projections on the device (the absorbed query, the
// up-projection, the latent entry): simple tiled kernels with fp32 accumulation, no cuBLAS.
// Every call only enqueues work on `stream` (a cudaStream_t; nullptr = the legacy default
// stream): no allocation, no synchronisation, so a forward built on them can be graph-captured.
#pragma once

#include "pagedattn/tensor.h"

namespace pagedattn::cuda::mla {

/// latent [T, 1, L + R] (contiguous, float16 / bfloat16) row t = [kv_c[t] | k_pe[t]] rounded to
/// latent's dtype; kv_c [T, L] and k_pe [T, R] any strides, any float dtype but float64.
void build_latent(const TensorView& kv_c, const TensorView& k_pe, const TensorView& latent,
                  void* stream);

/// q_lat [T, N, L + R] (contiguous, 16-bit): q_lat[t, h, :L] = q[t, h, :P] W_UK_T[h] with fp32
/// accumulation rounded once, q_lat[t, h, L:] = q[t, h, P:]. q [T, N, P + R] any strides;
/// w_uk_t [N, P, L] float32 on the device.
void absorb_query(const TensorView& q, const float* w_uk_t, int p, const TensorView& q_lat,
                  void* stream);

/// out[t, h * V + v] = sum_l o_lat[t, h, l] W_UV[h, l, v] (fp32 accumulation, rounded once to
/// out's dtype: 16-bit, float32 or float64). o_lat [T, N, >= L] contiguous rows (its first L
/// columns are read); w_uv [N, L, V] float32 on the device; out [>= T, N * V] any strides.
void up_project(const TensorView& o_lat, const float* w_uv, int l, int v, int64_t num_tokens,
                const TensorView& out, void* stream);

/// Zeroes out [T, C] (any strides, any float dtype): a profiling step's output.
void zero_rows(const TensorView& out, void* stream);

}  // namespace pagedattn::cuda::mla
