// Device element types and conversions shared by the kernel families. Conversions from float
// that write a cache or an output are bit-exact with the host ones in src/core/dtype.cpp
// (round to nearest even; fp8 saturates to its largest finite value; NaN keeps its sign), so
// the cache bytes a CUDA kernel writes equal the reference's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "pagedattn/dtype.h"

namespace pagedattn::cuda {

/// The device type that stores one element of `kDType`.
template <DType kDType>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using type = float;
};
template <>
struct Elem<DType::kF16> {
  using type = __half;
};
template <>
struct Elem<DType::kBF16> {
  using type = __nv_bfloat16;
};
template <>
struct Elem<DType::kFp8E4M3> {
  using type = uint8_t;
};
template <>
struct Elem<DType::kFp8E5M2> {
  using type = uint8_t;
};

template <DType kDType>
inline constexpr int kElemBytes = int(sizeof(typename Elem<kDType>::type));

// ---- reading: exact widening to float --------------------------------------------------------

__device__ __forceinline__ float fp8_to_float(uint8_t bits, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(bits, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

template <DType kDType>
__device__ __forceinline__ float load_as_float(const void* base, int64_t i) {
  if constexpr (kDType == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kDType == DType::kF16) {
    return __half2float(static_cast<const __half*>(base)[i]);
  } else if constexpr (kDType == DType::kBF16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  } else {
    return fp8_to_float(static_cast<const uint8_t*>(base)[i], kDType == DType::kFp8E5M2);
  }
}

/// Reads element i of a float32/float16/bfloat16/fp8 array whose type is known only at run
/// time (slow paths: scalar fallbacks and the generic decode kernel's conversion pass).
__device__ __forceinline__ float load_as_float(const void* base, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return load_as_float<DType::kF32>(base, i);
    case DType::kF16:
      return load_as_float<DType::kF16>(base, i);
    case DType::kBF16:
      return load_as_float<DType::kBF16>(base, i);
    case DType::kFp8E4M3:
      return load_as_float<DType::kFp8E4M3>(base, i);
    default:
      return load_as_float<DType::kFp8E5M2>(base, i);
  }
}

// ---- writing: exact narrowing from float -------------------------------------------------------

/// bf16 bits of x, rounded to nearest even; NaN stays a (quiet) NaN with its payload's top bits,
/// exactly as pagedattn::float_to_bf16.
__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

/// fp16 bits of x (nearest even, overflow to infinity); NaN becomes sign | 0x7fff as on the host.
__device__ __forceinline__ uint16_t float_to_f16_bits(float x) {
  if (isnan(x)) return uint16_t((__float_as_uint(x) >> 16) & 0x8000u) | 0x7fffu;
  return __half_as_ushort(__float2half_rn(x));
}

/// fp8 bits of x, saturated to the largest finite value (infinities too); NaN becomes
/// sign | 0x7f as on the host.
__device__ __forceinline__ uint8_t float_to_fp8_bits(float x, bool e5m2) {
  if (isnan(x)) return uint8_t(((__float_as_uint(x) >> 24) & 0x80u) | 0x7fu);
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

/// Stores x into element i of an array of `kDType`.
template <DType kDType>
__device__ __forceinline__ void store_from_float(void* base, int64_t i, float x) {
  if constexpr (kDType == DType::kF32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (kDType == DType::kF16) {
    static_cast<uint16_t*>(base)[i] = float_to_f16_bits(x);
  } else if constexpr (kDType == DType::kBF16) {
    static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(x);
  } else {
    static_cast<uint8_t*>(base)[i] = float_to_fp8_bits(x, kDType == DType::kFp8E5M2);
  }
}

/// The two 16-bit values of a 32-bit register as floats (x = the low half), exactly.
template <DType kDType>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  static_assert(kDType == DType::kF16 || kDType == DType::kBF16);
  if constexpr (kDType == DType::kBF16) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  } else {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = v;
    return __half22float2(h);
  }
}

/// Packs two floats into one 32-bit register of two 16-bit values (lo = first), rounding to
/// nearest even: the operand layout of mma.sync.
template <DType kDType>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(kDType == DType::kF16 || kDType == DType::kBF16);
  if constexpr (kDType == DType::kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

/// Two fp8 values (low byte first) widened exactly to two 16-bit values of kDType packed in
/// one register. Every e4m3 and e5m2 value is exact in fp16, and has at most 4 significant bits
/// and an fp16 exponent, so it is exact in bf16 as well.
template <DType kDType>
__device__ __forceinline__ uint32_t fp8x2_to_16bit(uint16_t two, bool e5m2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, e5m2 ? __NV_E5M2 : __NV_E4M3);
  if constexpr (kDType == DType::kF16) {
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h));
    return pack2<DType::kBF16>(f.x, f.y);
  }
}

}  // namespace pagedattn::cuda
