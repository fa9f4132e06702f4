// The device operations MLAAttention runs around a backend's attention when its tensors are on
// a device (the latent write's rows, the absorbed query, the up-projection, the prefill
// formulation's gathers and expansions). A backend that serves MLA layers on a device returns
// them from Backend::mla_device_ops(); the layer refuses device tensors when it returns none.
#pragma once

#include <cstdint>

#include "pagedattn/device.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// Every call only enqueues work on `stream` (on the tensors' device): no allocation and no
/// synchronisation, so a forward built on them can be captured in a CUDA graph. Shapes use
/// spec 5.1's symbols: T tokens, N heads, P = qk_nope_head_dim, R = qk_rope_head_dim,
/// V = v_head_dim, L = kv_lora_rank, E = L + R. Weight pointers are float32 on the device.
class MLADeviceOps {
 public:
  virtual ~MLADeviceOps() = default;

  /// latent [T, 1, E] (contiguous, float16 / bfloat16) row t = [kv_c[t] | k_pe[t]] rounded to
  /// latent's dtype; kv_c [T, L] and k_pe [T, R] any strides, any float dtype but float64.
  virtual void build_latent(const TensorView& kv_c, const TensorView& k_pe,
                            const TensorView& latent, Stream stream) const = 0;

  /// q_lat [T, N, E] (contiguous, 16-bit): q_lat[t, h, :L] = q[row(t), h, :P] W_UK_T[h] with
  /// fp32 accumulation rounded once, q_lat[t, h, L:] = q[row(t), h, P:], row(t) = rows[t] (a
  /// device array of T) or t when rows is null. q [>= T, N, P + R] any strides; w_uk_t
  /// [N, P, L].
  virtual void absorb_query(const TensorView& q, const float* w_uk_t, int p,
                            const TensorView& q_lat, const int64_t* rows, Stream stream) const = 0;

  /// out[row(t), h * V + v] = sum_l o_lat[t, h, l] W_UV[h, l, v] for t < num_tokens (fp32
  /// accumulation, rounded once to out's dtype: 16-bit, float32 or float64), row(t) as in
  /// absorb_query. o_lat [T, N, >= L] contiguous rows (its first L columns are read); w_uv
  /// [N, L, V]; out [rows, N * V] any strides.
  virtual void up_project(const TensorView& o_lat, const float* w_uv, int l, int v,
                          int64_t num_tokens, const TensorView& out, const int64_t* rows,
                          Stream stream) const = 0;

  /// latent [K, E] (contiguous, 16-bit) row k = the cache entry of request keys[2k] at position
  /// keys[2k + 1] (int32 pairs on the device), through `block_table` (int32 [S, M], any strides,
  /// on the device) and the cache's block size; fp8 entries (e4m3 / e5m2) times `scale`, every
  /// value rounded once to latent's dtype. cache [num_blocks, block_size, 1, E].
  virtual void gather_latent(const TensorView& cache, const TensorView& block_table,
                             const int32_t* keys, float scale, const TensorView& latent,
                             Stream stream) const = 0;

  /// k, v [K, N, P + R] (contiguous, latent's 16-bit dtype) from latent [K, E] (contiguous):
  /// k[t, h] = [latent[t, :L] W_UK[h] | latent[t, L:]], v[t, h] = [latent[t, :L] W_UV[h] | 0]
  /// (fp32 accumulation, rounded once). w_uk [N, L, P], w_uv [N, L, V].
  virtual void expand_kv(const TensorView& latent, const float* w_uk, const float* w_uv, int p,
                         int v, const TensorView& k, const TensorView& vv, Stream stream) const = 0;

  /// dst[i, h, c] = src[i, h, c] for every index of the [rows, N, C] views (any strides, float
  /// dtypes, converted through float32).
  virtual void copy_heads(const TensorView& src, const TensorView& dst, Stream stream) const = 0;

  /// Zeroes out [T, C] (any strides, any float dtype): a profiling step's output.
  virtual void zero_rows(const TensorView& out, Stream stream) const = 0;
};

}  // namespace pagedattn
