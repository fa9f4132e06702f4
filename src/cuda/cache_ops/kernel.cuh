// write_kv: scatter of a step's new K/V rows into the paged cache (vLLM's
// reshape_and_cache_flash), converting to the cache dtype.
//
// Map
//   computes  k_cache[slot / bs][slot % bs][h][:] = convert(key[t][h][:]) for each token t with
//             slot = slot_mapping[t] >= 0 (V likewise). fp8 stores saturate(x / scale), computed
//             in float and rounded to nearest even: bit-exact with the host reference, because
//             the harness compares the cache bytes.
//   grid      one CTA per slot_mapping entry; threads stride over the token's
//             num_kv_heads * head_size / kVec chunks (one 16-byte load of 16-bit activations).
//   layout    NHD and HND are both just strides; the head dimension is contiguous.
//   budget    no shared memory; ~30 registers. Bytes: one read of K/V, one write of the cache.
//   test      tests/cuda (write_kv vs ref, byte-equal) and `backend_ops test --device cuda`,
//             which checks the cache bytes of every case.
#pragma once

#include <cuda_runtime.h>

#include "cuda/cache_ops/config.h"
#include "cuda/cache_ops/launch.h"
#include "cuda/cache_ops/params.h"
#include "cuda/common/check.h"
#include "cuda/common/dtypes.cuh"

namespace pagedattn::cuda::cache_ops {

// kVec elements of kAct starting at `src` (aligned), as floats.
template <DType kAct>
__device__ __forceinline__ void load_vec(const void* src, float (&x)[kVec]) {
  if constexpr (kAct == DType::kF32) {
    const float4 a = static_cast<const float4*>(src)[0], b = static_cast<const float4*>(src)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 raw = *static_cast<const uint4*>(src);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if constexpr (kAct == DType::kF16) {
        x[i] = __half2float(__ushort_as_half(h[i]));
      } else {
        x[i] = __bfloat162float(__ushort_as_bfloat16(h[i]));
      }
    }
  }
}

// kVec floats converted to kCache and stored at `dst` (aligned) with one or two vector stores.
template <DType kCache>
__device__ __forceinline__ void store_vec(void* dst, const float (&x)[kVec]) {
  if constexpr (kCache == DType::kF32) {
    static_cast<float4*>(dst)[0] = make_float4(x[0], x[1], x[2], x[3]);
    static_cast<float4*>(dst)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else if constexpr (kCache == DType::kF16 || kCache == DType::kBF16) {
    uint4 raw;
    uint16_t* h = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      h[i] = kCache == DType::kF16 ? float_to_f16_bits(x[i]) : float_to_bf16_bits(x[i]);
    }
    *static_cast<uint4*>(dst) = raw;
  } else {
    uint2 raw;
    uint8_t* b = reinterpret_cast<uint8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) b[i] = float_to_fp8_bits(x[i], kCache == DType::kFp8E5M2);
    *static_cast<uint2*>(dst) = raw;
  }
}

template <DType kAct, DType kCache>
__device__ __forceinline__ void write_chunk(const void* src, void* dst, float scale) {
  constexpr bool kFp8 = kCache == DType::kFp8E4M3 || kCache == DType::kFp8E5M2;
  if constexpr (kAct == kCache) {
    // Same type: the bits move unchanged (the reference's float round trip is exact).
    constexpr int kBytes = kVec * kElemBytes<kAct>;
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = static_cast<uint4*>(dst);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) d[i] = s[i];
  } else {
    float x[kVec];
    load_vec<kAct>(src, x);
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) x[i] = x[i] / scale;  // a true division, as the reference
    }
    store_vec<kCache>(dst, x);
  }
}

template <DType kAct, DType kCache>
__global__ void __launch_bounds__(kMaxThreads)
    write_kv_kernel(const __grid_constant__ WriteKVParams p) {
  constexpr bool kFp8 = kCache == DType::kFp8E4M3 || kCache == DType::kFp8E5M2;
  const int t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t * p.slot_stride];
  if (slot < 0) return;  // padded token
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  char* const k_row = static_cast<char*>(p.k_cache) +
                      (block * p.k_stride_block + offset * p.k_stride_page) * kElemBytes<kCache>;
  char* const v_row = static_cast<char*>(p.v_cache) +
                      (block * p.v_stride_block + offset * p.v_stride_page) * kElemBytes<kCache>;
  const char* const key =
      static_cast<const char*>(p.key) + t * p.key_stride_token * kElemBytes<kAct>;
  const char* const value =
      static_cast<const char*>(p.value) + t * p.value_stride_token * kElemBytes<kAct>;
  if (p.vectorized) {
    // Chunk c of a head's K row and of its V row (which stops at v_head_size) together.
    const int chunks_per_head = p.head_size / kVec, v_chunks = p.v_head_size / kVec;
    const int n = p.num_kv_heads * chunks_per_head;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const int h = c / chunks_per_head, chunk = c - h * chunks_per_head, d = chunk * kVec;
      write_chunk<kAct, kCache>(key + (h * p.key_stride_head + d) * kElemBytes<kAct>,
                                k_row + (h * p.k_stride_head + d) * kElemBytes<kCache>,
                                p.per_head_scales ? p.k_scales[h] : p.k_scale);
      if (chunk < v_chunks) {
        write_chunk<kAct, kCache>(value + (h * p.value_stride_head + d) * kElemBytes<kAct>,
                                  v_row + (h * p.v_stride_head + d) * kElemBytes<kCache>,
                                  p.per_head_scales ? p.v_scales[h] : p.v_scale);
      }
    }
    return;
  }
  // Unaligned views: one element at a time, same arithmetic.
  const int n = p.num_kv_heads * p.head_size;
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int h = c / p.head_size, d = c - h * p.head_size;
    float k = load_as_float<kAct>(key, h * p.key_stride_head + d);
    if constexpr (kFp8) k = k / (p.per_head_scales ? p.k_scales[h] : p.k_scale);
    store_from_float<kCache>(k_row, h * p.k_stride_head + d, k);
    if (d < p.v_head_size) {
      float v = load_as_float<kAct>(value, h * p.value_stride_head + d);
      if constexpr (kFp8) v = v / (p.per_head_scales ? p.v_scales[h] : p.v_scale);
      store_from_float<kCache>(v_row, h * p.v_stride_head + d, v);
    }
  }
}

template <DType kAct, DType kCache>
void WriteKVOps<kAct, kCache>::launch(const WriteKVParams& p, cudaStream_t stream) {
  if (p.num_slots <= 0) return;
  const int work = p.num_kv_heads * (p.vectorized ? p.head_size / kVec : p.head_size);
  int threads = (work + 31) / 32 * 32;
  threads = threads < 32 ? 32 : (threads > kMaxThreads ? kMaxThreads : threads);
  write_kv_kernel<kAct, kCache><<<p.num_slots, threads, 0, stream>>>(p);
  PAGEDATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedattn::cuda::cache_ops
