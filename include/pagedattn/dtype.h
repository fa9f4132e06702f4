// Element types and exact host conversions between them and float.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace pagedattn {

/// Element type of a tensor. fp8 KV caches are stored as one byte per element; their scale
/// lives beside the cache, never in the type.
enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kF64,
  kFp8E4M3,  ///< float8_e4m3fn: no infinities, NaN = S.1111.111, largest finite 448
  kFp8E5M2,  ///< float8_e5m2: IEEE-like, with infinities, largest finite 57344
  kI32,
  kI64,
  kU8,
};

/// Bytes per element.
size_t dtype_size(DType dtype);
/// Canonical lower-case name ("float32", "bfloat16", "float8_e4m3fn", ...).
std::string_view dtype_name(DType dtype);
/// Parses a canonical name; nullopt when unknown.
std::optional<DType> dtype_from_name(std::string_view name);
bool is_floating(DType dtype);
inline bool is_fp8(DType dtype) {
  return dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2;
}
/// Activation types an attention layer takes (query, key, value, output).
inline bool is_activation_dtype(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// Scalar conversions. float -> narrow rounds to nearest even and keeps NaN a NaN.
// fp16 and bf16 overflow to infinity (IEEE); fp8 saturates to its largest finite value, as
// the CUDA SATFINITE conversions do, infinities included.

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float f);
float fp8_e4m3_to_float(uint8_t bits);
uint8_t float_to_fp8_e4m3(float f);
float fp8_e5m2_to_float(uint8_t bits);
uint8_t float_to_fp8_e5m2(float f);

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

/// Largest finite value of a floating type (fp8, fp16, bf16, f32).
float dtype_max(DType dtype);

/// Reads element `index` of a contiguous array of `dtype` as double (any floating or
/// integer type). Used by slow paths: the reference backend, tests, file tools.
double load_element(const void* base, DType dtype, int64_t index);
/// Writes `value` to element `index`, rounding as the scalar conversions above do (floats go
/// through float first, so the double rounding matches the device conversions).
void store_element(void* base, DType dtype, int64_t index, double value);

}  // namespace pagedattn
