// Host interface of MLAAttention's per-head projections on the device (the absorbed query, the
// up-projection, the latent entry): simple tiled kernels with fp32 accumulation, no cuBLAS.
// Every call only enqueues work on `stream` (a cudaStream_t; nullptr = the legacy default
// stream): no allocation, no synchronisation, so a forward built on them can be graph-captured.
#pragma once

#include "pagedattn/mla_device_ops.h"
#include "pagedattn/tensor.h"

namespace pagedattn::cuda::mla {

/// The functions below as the cuda backend's Backend::mla_device_ops() (proj_ops.cpp).
const MLADeviceOps& device_ops();

/// latent [T, 1, L + R] (contiguous, float16 / bfloat16) row t = [kv_c[t] | k_pe[t]] rounded to
/// latent's dtype; kv_c [T, L] and k_pe [T, R] any strides, any float dtype but float64.
void build_latent(const TensorView& kv_c, const TensorView& k_pe, const TensorView& latent,
                  void* stream);

/// q_lat [T, N, L + R] (contiguous, 16-bit): q_lat[t, h, :L] = q[row(t), h, :P] W_UK_T[h] with
/// fp32 accumulation rounded once, q_lat[t, h, L:] = q[row(t), h, P:], row(t) = rows[t] (a device
/// array of T) or t when rows is null. q [>= T, N, P + R] any strides; w_uk_t [N, P, L] float32
/// on the device.
void absorb_query(const TensorView& q, const float* w_uk_t, int p, const TensorView& q_lat,
                  void* stream, const int64_t* rows = nullptr);

/// out[row(t), h * V + v] = sum_l o_lat[t, h, l] W_UV[h, l, v] (fp32 accumulation, rounded once
/// to out's dtype: 16-bit, float32 or float64), row(t) as in absorb_query. o_lat [T, N, >= L]
/// contiguous rows (its first L columns are read); w_uv [N, L, V] float32 on the device; out
/// [rows, N * V] any strides.
void up_project(const TensorView& o_lat, const float* w_uv, int l, int v, int64_t num_tokens,
                const TensorView& out, void* stream, const int64_t* rows = nullptr);

/// The prefill formulation's pieces (spec 5.4), used by core/mla_prefill_device.cpp through
/// device_ops().
///
/// latent [K, L + R] (contiguous, 16-bit) row k = the cache entry of request keys[2k] at
/// position keys[2k + 1] (int32 pairs on the device), through `block_table` (int32 [S, M], any
/// strides, on the device) and the cache's block size; fp8 entries (e4m3 / e5m2) times `scale`,
/// every value rounded once to latent's dtype. cache [num_blocks, block_size, 1, L + R].
void gather_latent(const TensorView& cache, const TensorView& block_table, const int32_t* keys,
                   float scale, const TensorView& latent, void* stream);

/// k, v [K, N, P + R] (contiguous, latent's 16-bit dtype) from latent [K, L + R] (contiguous):
/// k[t, h] = [latent[t, :L] W_UK[h] | latent[t, L:]], v[t, h] = [latent[t, :L] W_UV[h] | 0]
/// (fp32 accumulation, rounded once). w_uk [N, L, P] and w_uv [N, L, V] float32 on the device.
void expand_kv(const TensorView& latent, const float* w_uk, const float* w_uv, int p, int v,
               const TensorView& k, const TensorView& vv, void* stream);

/// dst[i, h, c] = src[i, h, c] for every index of the [R, N, C] views (any strides, float
/// dtypes, converted through float32).
void copy_heads(const TensorView& src, const TensorView& dst, void* stream);

/// Zeroes out [T, C] (any strides, any float dtype): a profiling step's output.
void zero_rows(const TensorView& out, void* stream);

}  // namespace pagedattn::cuda::mla
