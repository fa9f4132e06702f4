#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common/check.h"
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
                              const float* w_uk_t, int p, int r, void* q_lat, DType act, int l) {
  extern __shared__ float q_nope[];  // [P]
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, n = gridDim.y, e = l + r;
  const int64_t q_row = t * q_s0 + h * q_s1;
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
                          int v, void* out, DType out_dt, int64_t o_s0, int64_t o_s1) {
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
    store_f(out, out_dt, t * o_s0 + (int64_t(h) * v + vi) * o_s1, acc);
  }
}

__global__ void zero_kernel(void* out, DType dt, int64_t s0, int64_t s1, int64_t cols) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store_f(out, dt, t * s0 + c * s1, 0.0f);
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
                  void* stream) {
  const int64_t t = q_lat.size(0);
  const int n = int(q_lat.size(1)), e = int(q_lat.size(2)), r = int(q.size(2)) - p, l = e - r;
  detail::require(
      float_input(q.dtype) && (q_lat.dtype == DType::kF16 || q_lat.dtype == DType::kBF16),
      "cuda mla absorb_query: unsupported dtypes ", describe(q), " -> ", describe(q_lat));
  if (t == 0) return;
  absorb_kernel<<<dim3(unsigned(t), unsigned(n)), kThreads, size_t(p) * sizeof(float),
                  static_cast<cudaStream_t>(stream)>>>(q.data, q.dtype, q.stride(0), q.stride(1),
                                                       q.stride(2), w_uk_t, p, r, q_lat.data,
                                                       q_lat.dtype, l);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void up_project(const TensorView& o_lat, const float* w_uv, int l, int v, int64_t num_tokens,
                const TensorView& out, void* stream) {
  const int n = int(o_lat.size(1));
  detail::require(float_input(o_lat.dtype) && (float_input(out.dtype) || out.dtype == DType::kF64),
                  "cuda mla up_project: unsupported dtypes ", describe(o_lat), " -> ",
                  describe(out));
  if (num_tokens == 0) return;
  up_kernel<<<dim3(unsigned(num_tokens), unsigned(n)), kThreads, size_t(l) * sizeof(float),
              static_cast<cudaStream_t>(stream)>>>(o_lat.data, o_lat.dtype, o_lat.size(2), w_uv, l,
                                                   v, out.data, out.dtype, out.stride(0),
                                                   out.stride(1));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

void zero_rows(const TensorView& out, void* stream) {
  if (out.size(0) == 0 || out.size(1) == 0) return;
  zero_kernel<<<unsigned(out.size(0)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out.data, out.dtype, out.stride(0), out.stride(1), out.size(1));
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::mla
