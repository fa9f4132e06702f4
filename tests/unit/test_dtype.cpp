// fp8 / fp16 / bf16 host conversions: every code, hand-checked values, and a brute-force
// nearest-value oracle for rounding (ties to even) and saturation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "pagedattn/dtype.h"

namespace pagedattn {
namespace {

struct Fp8Format {
  const char* name;
  float (*decode)(uint8_t);
  uint8_t (*encode)(float);
  float max;
};
const Fp8Format kE4M3{"e4m3", fp8_e4m3_to_float, float_to_fp8_e4m3, 448.0f};
const Fp8Format kE5M2{"e5m2", fp8_e5m2_to_float, float_to_fp8_e5m2, 57344.0f};

// The oracle: the finite non-negative code nearest to |x| (ties to the even code), with the
// sign copied and magnitudes past the largest finite value saturated.
uint8_t nearest_code(const Fp8Format& f, float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    const float v = f.decode(uint8_t(c));
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(double(v) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return uint8_t(sign | best);
}

class Fp8Test : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8Test, EveryCodeRoundTrips) {
  const Fp8Format& f = GetParam();
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = f.decode(uint8_t(c));
    if (std::isnan(v)) {
      ++nans;
      EXPECT_TRUE(std::isnan(f.decode(f.encode(v)))) << f.name << " code " << c;
      continue;
    }
    if (std::isinf(v)) {
      // e5m2 infinities saturate on the way back (SATFINITE).
      EXPECT_EQ(f.encode(v), (c & 0x80) | 0x7b) << f.name << " code " << c;
      continue;
    }
    EXPECT_EQ(f.encode(v), c) << f.name << " code " << c << " value " << v;
  }
  EXPECT_EQ(nans, std::string(f.name) == "e4m3" ? 2 : 6);
}

TEST_P(Fp8Test, MatchesNearestValueOracle) {
  const Fp8Format& f = GetParam();
  std::vector<float> probes;
  // Midpoints between neighbouring codes (the ties) and one float either side of each.
  for (int c = 0; c < 0x7f; ++c) {
    const float lo = f.decode(uint8_t(c)), hi = f.decode(uint8_t(c + 1));
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    const float mid = float((double(lo) + double(hi)) / 2);
    for (float p : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), lo, hi}) {
      probes.push_back(p);
      probes.push_back(-p);
    }
  }
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> exponent(-24.0f, 20.0f);
  for (int i = 0; i < 20000; ++i) {
    const float v = std::exp2(exponent(rng));
    probes.push_back(i % 2 ? v : -v);
  }
  for (float p : probes) {
    EXPECT_EQ(f.encode(p), nearest_code(f, p)) << f.name << " x=" << p;
  }
}

TEST_P(Fp8Test, SaturatesAndKeepsNaN) {
  const Fp8Format& f = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  for (float big : {f.max * 1.5f, 1e30f, inf}) {
    EXPECT_EQ(f.decode(f.encode(big)), f.max) << f.name;
    EXPECT_EQ(f.decode(f.encode(-big)), -f.max) << f.name;
  }
  EXPECT_TRUE(std::isnan(f.decode(f.encode(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f.encode(-0.0f), 0x80);
  EXPECT_EQ(f.encode(0.0f), 0x00);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Test, ::testing::Values(kE4M3, kE5M2),
                         [](const auto& p) { return std::string(p.param.name); });

TEST(Fp8, HandCheckedE4M3) {
  EXPECT_EQ(float_to_fp8_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3(-2.0f), 0xc0);
  EXPECT_EQ(float_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(0.015625f), 0x08);              // 2^-6, smallest normal
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie -> even (zero)
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 units -> 2 (even)
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);                // tie between 1.0 and 1.125 -> 1.0
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);                // tie between 1.125 and 1.25 -> 1.25
  EXPECT_EQ(float_to_fp8_e4m3(1.07f), 0x39);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7e);  // beyond 448 saturates
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(0x3c), 1.5f);
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(0x78), 256.0f);  // exponent field 15 is finite in e4m3fn
}

TEST(Fp8, HandCheckedE5M2) {
  EXPECT_EQ(float_to_fp8_e5m2(1.0f), 0x3c);
  EXPECT_EQ(float_to_fp8_e5m2(-1.5f), 0xbe);
  EXPECT_EQ(float_to_fp8_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(60000.0f), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(std::numeric_limits<float>::infinity()), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(std::ldexp(1.0f, -16)), 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_fp8_e5m2(std::ldexp(1.0f, -14)), 0x04);  // smallest normal
  EXPECT_EQ(float_to_fp8_e5m2(1.125f), 0x3c);                 // tie between 1.0 and 1.25 -> 1.0
  EXPECT_EQ(float_to_fp8_e5m2(1.375f), 0x3e);                 // tie between 1.25 and 1.5 -> 1.5
  EXPECT_TRUE(std::isinf(fp8_e5m2_to_float(0x7c)));
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_float(0x7d)));
  EXPECT_FLOAT_EQ(fp8_e5m2_to_float(0x7b), 57344.0f);
}

TEST(Half, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = f16_to_float(uint16_t(c));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(v))));
    } else {
      EXPECT_EQ(float_to_f16(v), c) << c;
    }
  }
}

TEST(Half, HandChecked) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // rounds past the max: infinity (IEEE)
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_FLOAT_EQ(f16_to_float(0xc000), -2.0f);
}

TEST(BFloat16, EveryCodeRoundTripsAndRoundsToEven) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = bf16_to_float(uint16_t(c));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(v))));
    } else {
      EXPECT_EQ(float_to_bf16(v), c) << c;
    }
  }
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);        // tie -> even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);    // tie -> even (up)
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow -> inf
}

TEST(DType, NamesAndSizes) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kFp8E4M3,
                  DType::kFp8E5M2, DType::kI32, DType::kI64, DType::kU8}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  }
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFp8E5M2), 1u);
  EXPECT_FALSE(dtype_from_name("float8").has_value());
}

}  // namespace
}  // namespace pagedattn
