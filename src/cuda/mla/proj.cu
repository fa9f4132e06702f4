#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"
#include "cuda/mla/proj.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda::mla {
namespace {

constexpr int kThreads = 128;

// The dtype travels as a kernel argument (not a template): these kernels are a small share of
// the step, and one instance per kernel keeps the build short.
__device__ float load_f(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default:
      return float(static_cast<const double*>(base)[i]);
  }
}

__device__ void store_f(void* base, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kF32:
      static_cast<float*>(base)[i] = x;
      break;
    case DType::kF16:
      static_cast<__half*>(base)[i] = __float2half_rn(x);
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
      break;
    default:
      static_cast<double*>(base)[i] = double(x);
      break;
  }
}

// grid.x = T; latent [T, E] contiguous.
__global__ void build_latent_kernel(const void* kv_c, DType kv_dt, int64_t kv_s0, int64_t kv_s1,
                                    const void* k_pe, DType pe_dt, int64_t pe_s0, int64_t pe_s1,
                                    void* latent, DType act, int l, int e) {
  const int64_t t = blockIdx.x;
  for (int c = threadIdx.x; c < e; c += blockDim.x) {
    const float x = c < l ? load_f(kv_c, kv_dt, t * kv_s0 + c * kv_s1)
                          : load_f(k_pe, pe_dt, t * pe_s0 + (c - l) * pe_s1);
    store_f(latent, act, t * e + c, x);
  }
}

// grid = (T, N), dynamic shared memory P floats (q_nope of this token and head). Each thread
// owns latent columns li, li + 128, ...: W_UK_T's rows are read coalesced, summed in the host
// path's order (pi ascending).
__global__ void absorb_kernel(const void* q, DType q_dt, int64_t q_s0, int64_t q_s1, int64_t q_s2,
                              const float* w_uk_t, int p, int r, void* q_lat, DType act, int l,
                              const int64_t* rows) {
  extern __shared__ float q_nope[];  // [P]
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, n = gridDim.y, e = l + r;
  const int64_t q_row = (rows != nullptr ? rows[t] : t) * q_s0 + h * q_s1;
  for (int i = threadIdx.x; i < p; i += blockDim.x) q_nope[i] = load_f(q, q_dt, q_row + i * q_s2);
  __syncthreads();
  const float* w = w_uk_t + int64_t(h) * p * l;  // [P, L]
  const int64_t out_row = (t * n + h) * e;
  for (int li = threadIdx.x; li < l; li += blockDim.x) {
    float acc = 0.0f;
    for (int pi = 0; pi < p; ++pi) acc = fmaf(q_nope[pi], w[int64_t(pi) * l + li], acc);
    store_f(q_lat, act, out_row + li, acc);
  }
  for (int ri = threadIdx.x; ri < r; ri += blockDim.x) {
    store_f(q_lat, act, out_row + l + ri, load_f(q, q_dt, q_row + (p + ri) * q_s2));
  }
}

// grid = (T, N), dynamic shared memory L floats (this token and head's latent output).
__global__ void up_kernel(const void* o_lat, DType act, int64_t row_elems, const float* w_uv, int l,
                          int v, void* out, DType out_dt, int64_t o_s0, int64_t o_s1,
                          const int64_t* rows) {
  extern __shared__ float lat[];  // [L]
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, n = gridDim.y;
  const int64_t in_row = (t * n + h) * row_elems;
  for (int i = threadIdx.x; i < l; i += blockDim.x) lat[i] = load_f(o_lat, act, in_row + i);
  __syncthreads();
  const float* w = w_uv + int64_t(h) * l * v;  // [L, V]
  for (int vi = threadIdx.x; vi < v; vi += blockDim.x) {
    float acc = 0.0f;
    for (int li = 0; li < l; ++li) acc = fmaf(lat[li], w[int64_t(li) * v + vi], acc);
    store_f(out, out_dt, (rows != nullptr ? rows[t] : t) * o_s0 + (int64_t(h) * v + vi) * o_s1,
            acc);
  }
}

__global__ void zero_kernel(void* out, DType dt, int64_t s0, int64_t s1, int64_t cols) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store_f(out, dt, t * s0 + c * s1, 0.0f);
}

// grid.x = K keys; latent [K, E] contiguous. keys[2k], keys[2k + 1]: request, position.
__global__ void gather_latent_kernel(const void* cache, DType c_dt, int64_t c_s0, int64_t c_s1,
                                     int64_t c_s3, int block_size, const int32_t* bt, int64_t bt_s0,
                                     int64_t bt_s1, const int32_t* keys, float scale, void* latent,
                                     DType act, int e) {
  const int64_t k = blockIdx.x;
  const int r = keys[2 * k], pos = keys[2 * k + 1];
  const int64_t block = bt[r * bt_s0 + int64_t(pos / block_size) * bt_s1];
  const int64_t row = block * c_s0 + int64_t(pos % block_size) * c_s1;
  for (int c = threadIdx.x; c < e; c += blockDim.x) {
    store_f(latent, act, k * e + c, load_as_float(cache, row + c * c_s3, c_dt) * scale);
  }
}

// grid = (ceil(K / kExpandKeys), N), kThreads x 2 threads: thread c < P + V owns output column
// c (K's c < P, V's c - P) of every key of the tile, the tile's latent rows in shared memory
// (each W row is read once per tile of keys, coalesced: W_UK [N, L, P], W_UV [N, L, V]).
constexpr int kExpandKeys = 32;
__global__ void expand_kernel(const void* latent, DType act, int l, int r, const float* w_uk,
                              const float* w_uv, int p, int v, int64_t num_keys, void* k_out,
                              void* v_out) {
  extern __shared__ float lat[];  // [kExpandKeys][L]
  const int64_t k0 = int64_t(blockIdx.x) * kExpandKeys;
  const int h = blockIdx.y, n = gridDim.y, e = l + r, d = p + r;
  const int keys = num_keys - k0 < kExpandKeys ? int(num_keys - k0) : kExpandKeys;
  for (int i = threadIdx.x; i < keys * l; i += blockDim.x) {
    const int kk = i / l, li = i - kk * l;
    lat[kk * l + li] = load_f(latent, act, (k0 + kk) * e + li);
  }
  __syncthreads();
  const int c = threadIdx.x;
  if (c < p + v) {
    const bool is_k = c < p;
    const float* w = is_k ? w_uk + int64_t(h) * l * p + c : w_uv + int64_t(h) * l * v + (c - p);
    const int w_step = is_k ? p : v;
    float acc[kExpandKeys];
#pragma unroll
    for (int kk = 0; kk < kExpandKeys; ++kk) acc[kk] = 0.0f;
    for (int li = 0; li < l; ++li) {
      const float wv = w[int64_t(li) * w_step];
#pragma unroll
      for (int kk = 0; kk < kExpandKeys; ++kk) acc[kk] = fmaf(lat[kk * l + li], wv, acc[kk]);
    }
    void* const out = is_k ? k_out : v_out;
    const int col = is_k ? c : c - p;
#pragma unroll
    for (int kk = 0; kk < kExpandKeys; ++kk) {
      if (kk < keys) store_f(out, act, ((k0 + kk) * n + h) * d + col, acc[kk]);
    }
  }
  // K's rope columns (the latent's k_pe, shared by the heads) and V's zero padding.
  for (int i = threadIdx.x; i < keys * r; i += blockDim.x) {
    const int kk = i / r, ri = i - kk * r;
    const int64_t o = ((k0 + kk) * n + h) * d;
    store_f(k_out, act, o + p + ri, load_f(latent, act, (k0 + kk) * e + l + ri));
  }
  for (int i = threadIdx.x; i < keys * (d - v); i += blockDim.x) {
    const int kk = i / (d - v), ci = i - kk * (d - v);
    store_f(v_out, act, ((k0 + kk) * n + h) * d + v + ci, 0.0f);
  }
}

// grid = (R, N); element (i, h, c) of [R, N, C] views.
__global__ void copy_heads_kernel(const void* src, DType s_dt, int64_t s0, int64_t s1, int64_t s2,
                                  void* dst, DType d_dt, int64_t d0, int64_t d1, int64_t d2,
                                  int cols) {
  const int64_t i = blockIdx.x, h = blockIdx.y;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    store_f(dst, d_dt, i * d0 + h * d1 + c * d2, load_f(src, s_dt, i * s0 + h * s1 + c * s2));
  }
}

bool float_input(DType dt) {
  return dt == DType::kF32 || dt == DType::kF16 || dt == DType::kBF16;
}

}  // namespace

void build_latent(const TensorView& kv_c, const TensorView& k_pe, const TensorView& latent,
                  void* stream) {
  const int64_t t = latent.size(0);
  const int l = int(kv_c.size(1)), e = int(latent.size(latent.ndim - 1));
  detail::require(float_input(kv_c.dtype) && float_input(k_pe.dtype) &&
                      (latent.dtype == DType::kF16 || latent.dtype == DType::kBF16),
                  "cuda mla build_latent: unsupported dtypes ", describe(kv_c), ", ",
                  describe(k_pe), " -> ", describe(latent));
  if (t == 0) return;
  build_latent_kernel<<<unsigned(t), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      kv_c.data, kv_c.dtype, kv_c.stride(0), kv_c.stride(1), k_pe.data, k_pe.dtype, k_pe.stride(0),
      k_pe.stride(1), latent.data, latent.dtype, l, e);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void absorb_query(const TensorView& q, const float* w_uk_t, int p, const TensorView& q_lat,
                  void* stream, const int64_t* rows) {
  const int64_t t = q_lat.size(0);
  const int n = int(q_lat.size(1)), e = int(q_lat.size(2)), r = int(q.size(2)) - p, l = e - r;
  detail::require(
      float_input(q.dtype) && (q_lat.dtype == DType::kF16 || q_lat.dtype == DType::kBF16),
      "cuda mla absorb_query: unsupported dtypes ", describe(q), " -> ", describe(q_lat));
  if (t == 0) return;
  absorb_kernel<<<dim3(unsigned(t), unsigned(n)), kThreads, size_t(p) * sizeof(float),
                  static_cast<cudaStream_t>(stream)>>>(q.data, q.dtype, q.stride(0), q.stride(1),
                                                       q.stride(2), w_uk_t, p, r, q_lat.data,
                                                       q_lat.dtype, l, rows);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void up_project(const TensorView& o_lat, const float* w_uv, int l, int v, int64_t num_tokens,
                const TensorView& out, void* stream, const int64_t* rows) {
  const int n = int(o_lat.size(1));
  detail::require(float_input(o_lat.dtype) && (float_input(out.dtype) || out.dtype == DType::kF64),
                  "cuda mla up_project: unsupported dtypes ", describe(o_lat), " -> ",
                  describe(out));
  if (num_tokens == 0) return;
  up_kernel<<<dim3(unsigned(num_tokens), unsigned(n)), kThreads, size_t(l) * sizeof(float),
              static_cast<cudaStream_t>(stream)>>>(o_lat.data, o_lat.dtype, o_lat.size(2), w_uv, l,
                                                   v, out.data, out.dtype, out.stride(0),
                                                   out.stride(1), rows);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void gather_latent(const TensorView& cache, const TensorView& block_table, const int32_t* keys,
                   float scale, const TensorView& latent, void* stream) {
  const int64_t k = latent.size(0);
  const int e = int(latent.size(1));
  detail::require(latent.dtype == DType::kF16 || latent.dtype == DType::kBF16,
                  "cuda mla gather_latent: latent must be 16-bit; got ", describe(latent));
  if (k == 0) return;
  gather_latent_kernel<<<unsigned(k), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cache.data, cache.dtype, cache.stride(0), cache.stride(1), cache.stride(3),
      int(cache.size(1)), static_cast<const int32_t*>(block_table.data), block_table.stride(0),
      block_table.stride(1), keys, scale, latent.data, latent.dtype, e);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void expand_kv(const TensorView& latent, const float* w_uk, const float* w_uv, int p, int v,
               const TensorView& k, const TensorView& vv, void* stream) {
  const int64_t keys = latent.size(0);
  const int n = int(k.size(1)), d = int(k.size(2)), r = d - p, l = int(latent.size(1)) - r;
  detail::require(
      p + v <= 2 * kThreads && v <= d, "cuda mla expand_kv: qk_nope_head_dim + v_head_dim (", p + v,
      ") must be <= ", 2 * kThreads, " and v_head_dim <= qk_nope_head_dim + qk_rope_head_dim");
  if (keys == 0) return;
  const size_t smem = size_t(kExpandKeys) * size_t(l) * sizeof(float);
  // 64 KB of latent rows at L = 512: above the 48 KB default (set per call: the current
  // device may change, and this path runs eagerly).
  PAGEDATTN_CUDA_CHECK(
      cudaFuncSetAttribute(expand_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((keys + kExpandKeys - 1) / kExpandKeys), unsigned(n));
  expand_kernel<<<grid, 2 * kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      latent.data, latent.dtype, l, r, w_uk, w_uv, p, v, keys, k.data, vv.data);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void copy_heads(const TensorView& src, const TensorView& dst, void* stream) {
  const int64_t rows = src.size(0);
  if (rows == 0 || src.size(1) == 0 || src.size(2) == 0) return;
  copy_heads_kernel<<<dim3(unsigned(rows), unsigned(src.size(1))), kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(
      src.data, src.dtype, src.stride(0), src.stride(1), src.stride(2), dst.data, dst.dtype,
      dst.stride(0), dst.stride(1), dst.stride(2), int(src.size(2)));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void zero_rows(const TensorView& out, void* stream) {
  if (out.size(0) == 0 || out.size(1) == 0) return;
  zero_kernel<<<unsigned(out.size(0)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out.data, out.dtype, out.stride(0), out.stride(1), out.size(1));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::mla
