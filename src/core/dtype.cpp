#include "pagedattn/dtype.h"

#include <cmath>
#include <limits>

#include "pagedattn/error.h"

namespace pagedattn {
namespace {

// A small binary float format: sign, kExpBits exponent bits, kManBits mantissa bits, IEEE-style
// bias and subnormals. kFn marks the "finite, NaN only" variant (e4m3fn), whose all-ones
// exponent still holds normal numbers except for the single NaN mantissa.
template <int kExpBits, int kManBits, bool kFn>
struct MiniFloat {
  static constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  static constexpr int kMinExp = 1 - kBias;  // exponent of the smallest normal
  static constexpr uint32_t kExpMask = (1u << kExpBits) - 1;
  static constexpr uint32_t kManMask = (1u << kManBits) - 1;
  static constexpr uint32_t kSign = 1u << (kExpBits + kManBits);
  // Largest finite code without the sign.
  static constexpr uint32_t kMaxCode =
      kFn ? ((kExpMask << kManBits) | (kManMask - 1)) : (((kExpMask - 1) << kManBits) | kManMask);
  static constexpr uint32_t kInfCode = kExpMask << kManBits;  // not for kFn
  static constexpr uint32_t kNanCode = (kExpMask << kManBits) | kManMask;

  static float decode(uint32_t bits) {
    const bool neg = bits & kSign;
    const uint32_t e = (bits >> kManBits) & kExpMask;
    const uint32_t m = bits & kManMask;
    float mag;
    if (kFn && e == kExpMask && m == kManMask) {
      return std::numeric_limits<float>::quiet_NaN();
    } else if (!kFn && e == kExpMask) {
      if (m != 0) return std::numeric_limits<float>::quiet_NaN();
      mag = std::numeric_limits<float>::infinity();
    } else if (e == 0) {
      mag = std::ldexp(float(m), kMinExp - kManBits);
    } else {
      mag = std::ldexp(float(m | (1u << kManBits)), int(e) - kBias - kManBits);
    }
    return neg ? -mag : mag;
  }

  // Rounds |x| to the format's grid (nearest, ties to even), then packs it. Every step is exact
  // in float: the quantum is a power of two and |x|/quantum < 2^(kManBits+2).
  static uint32_t encode(float x, bool saturate) {
    const uint32_t sign = std::signbit(x) ? kSign : 0;
    if (std::isnan(x)) return sign | kNanCode;
    const float a = std::fabs(x);
    const float max_finite = decode(kMaxCode);
    if (std::isinf(a)) return sign | (saturate ? kMaxCode : kInfCode);
    if (a == 0.0f) return sign;
    int exp2;
    std::frexp(a, &exp2);  // a = f * 2^exp2, f in [0.5, 1)
    const int e = std::max(exp2 - 1, kMinExp);
    const float quantum = std::ldexp(1.0f, e - kManBits);
    const float units = std::nearbyint(a / quantum);  // default rounding mode: nearest-even
    const float r = units * quantum;
    if (r > max_finite) return sign | (saturate ? kMaxCode : kInfCode);
    if (r < std::ldexp(1.0f, kMinExp)) return sign | uint32_t(units);  // subnormal (or zero)
    int rexp2;
    std::frexp(r, &rexp2);
    const int re = rexp2 - 1;  // may be e + 1 after rounding up
    const uint32_t man = uint32_t(std::ldexp(r, kManBits - re)) & kManMask;
    return sign | (uint32_t(re + kBias) << kManBits) | man;
  }
};

using E4M3 = MiniFloat<4, 3, true>;
using E5M2 = MiniFloat<5, 2, false>;
using F16 = MiniFloat<5, 10, false>;

}  // namespace

float f16_to_float(uint16_t bits) {
  return F16::decode(bits);
}
uint16_t float_to_f16(float f) {
  return uint16_t(F16::encode(f, false));
}
float fp8_e4m3_to_float(uint8_t bits) {
  return E4M3::decode(bits);
}
uint8_t float_to_fp8_e4m3(float f) {
  return uint8_t(E4M3::encode(f, true));
}
float fp8_e5m2_to_float(uint8_t bits) {
  return E5M2::decode(bits);
}
uint8_t float_to_fp8_e5m2(float f) {
  return uint8_t(E5M2::encode(f, true));
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
    case DType::kU8:
      return 1;
  }
  detail::fail("dtype_size: unknown dtype code ", int(dtype));
}

namespace {
struct NamedDType {
  DType dtype;
  std::string_view name;
};
constexpr NamedDType kNames[] = {
    {DType::kF32, "float32"},
    {DType::kF16, "float16"},
    {DType::kBF16, "bfloat16"},
    {DType::kF64, "float64"},
    {DType::kFp8E4M3, "float8_e4m3fn"},
    {DType::kFp8E5M2, "float8_e5m2"},
    {DType::kI32, "int32"},
    {DType::kI64, "int64"},
    {DType::kU8, "uint8"},
};
}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& n : kNames)
    if (n.dtype == dtype) return n.name;
  return "unknown";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& n : kNames)
    if (n.name == name) return n.dtype;
  return std::nullopt;
}

bool is_floating(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF64:
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return true;
    default:
      return false;
  }
}

float dtype_max(DType dtype) {
  switch (dtype) {
    case DType::kFp8E4M3:
      return kFp8E4M3Max;
    case DType::kFp8E5M2:
      return kFp8E5M2Max;
    case DType::kF16:
      return 65504.0f;
    case DType::kBF16:
      return bf16_to_float(0x7f7f);
    case DType::kF32:
      return std::numeric_limits<float>::max();
    default:
      detail::fail("dtype_max: ", dtype_name(dtype), " is not a float type of at most 32 bits");
  }
}

double load_element(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF64:
      return static_cast<const double*>(base)[i];
    case DType::kF16:
      return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp8E4M3:
      return fp8_e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kFp8E5M2:
      return fp8_e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(base)[i];
    case DType::kI64:
      return double(static_cast<const int64_t*>(base)[i]);
    case DType::kU8:
      return static_cast<const uint8_t*>(base)[i];
  }
  detail::fail("load_element: unknown dtype code ", int(dtype));
}

void store_element(void* base, DType dtype, int64_t i, double value) {
  const float f = float(value);
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[i] = f;
      return;
    case DType::kF64:
      static_cast<double*>(base)[i] = value;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = float_to_f16(f);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(f);
      return;
    case DType::kFp8E4M3:
      static_cast<uint8_t*>(base)[i] = float_to_fp8_e4m3(f);
      return;
    case DType::kFp8E5M2:
      static_cast<uint8_t*>(base)[i] = float_to_fp8_e5m2(f);
      return;
    case DType::kI32:
      static_cast<int32_t*>(base)[i] = int32_t(value);
      return;
    case DType::kI64:
      static_cast<int64_t*>(base)[i] = int64_t(value);
      return;
    case DType::kU8:
      static_cast<uint8_t*>(base)[i] = uint8_t(value);
      return;
  }
  detail::fail("store_element: unknown dtype code ", int(dtype));
}

}  // namespace pagedattn
