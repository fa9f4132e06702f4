// The cpu backend's vector conversions are bit-identical to the scalar ones of dtype.h on every
// SIMD target this machine runs (rounding to nearest even, fp8 saturation, NaN, subnormals).
#if PAGEDATTN_WITH_CPU_BACKEND
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"

namespace pagedattn {
namespace {

uint32_t bits_of(double v, DType t) {
  std::vector<uint8_t> buf(8);
  store_element(buf.data(), t, 0, v);
  uint32_t b = 0;
  std::memcpy(&b, buf.data(), dtype_size(t));
  return b;
}

// Probes: every code's value and the midpoints between neighbouring codes (the ties), one
// float either side, random magnitudes across the whole exponent range, and specials.
std::vector<float> probes(DType t) {
  std::vector<float> p;
  const int codes = dtype_size(t) == 1 ? 256 : 65536;
  std::vector<uint8_t> buf(2);
  auto value = [&](int c) {
    buf[0] = uint8_t(c);
    buf[1] = uint8_t(c >> 8);
    return float(load_element(buf.data(), t, 0));
  };
  for (int c = 0; c + 1 < codes; ++c) {
    const float lo = value(c), hi = value(c + 1);
    p.push_back(lo);
    if (!std::isfinite(lo) || !std::isfinite(hi) || std::signbit(lo) != std::signbit(hi)) continue;
    const float mid = float((double(lo) + double(hi)) / 2);
    p.insert(p.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f),
                       std::nextafter(mid, -1e30f)});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-30.0f, 30.0f);
  for (int i = 0; i < 20000; ++i) p.push_back((i % 2 ? 1.0f : -1.0f) * std::exp2(e(rng)));
  const float inf = std::numeric_limits<float>::infinity();
  p.insert(p.end(), {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 1e38f, -1e38f,
                     70000.0f, 65520.0f, 65519.0f, 464.0f, 449.0f, 57344.0f, 61440.0f});
  return p;
}

class CpuConvert : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(cpu::force_target(GetParam())); }
  void TearDown() override { cpu::force_target(""); }
};

TEST_P(CpuConvert, FloatToNarrowIsBitExact) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kFp8E5M2}) {
    const std::vector<float> in = probes(t);
    std::vector<uint8_t> out(in.size() * dtype_size(t));
    cpu::convert_row(in.data(), DType::kF32, out.data(), t, int64_t(in.size()), 1.0f);
    int bad = 0;
    for (size_t i = 0; i < in.size() && bad < 5; ++i) {
      uint32_t got = 0;
      std::memcpy(&got, out.data() + i * dtype_size(t), dtype_size(t));
      if (std::isnan(in[i])) {
        EXPECT_TRUE(std::isnan(load_element(out.data(), t, int64_t(i)))) << dtype_name(t);
        continue;
      }
      if (got != bits_of(in[i], t)) {
        ++bad;
        ADD_FAILURE() << dtype_name(t) << " x=" << in[i] << " got 0x" << std::hex << got
                      << " want 0x" << bits_of(in[i], t);
      }
    }
  }
}

TEST_P(CpuConvert, NarrowToFloatIsExact) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kFp8E5M2}) {
    const int codes = dtype_size(t) == 1 ? 256 : 65536;
    std::vector<uint8_t> in(size_t(codes) * dtype_size(t));
    for (int c = 0; c < codes; ++c) {
      in[size_t(c) * dtype_size(t)] = uint8_t(c);
      if (dtype_size(t) == 2) in[size_t(c) * 2 + 1] = uint8_t(c >> 8);
    }
    std::vector<float> out(static_cast<size_t>(codes));
    cpu::convert_row(in.data(), t, out.data(), DType::kF32, codes, 1.0f);
    for (int c = 0; c < codes; ++c) {
      const double want = load_element(in.data(), t, c);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[size_t(c)])) << dtype_name(t) << " code " << c;
      } else {
        EXPECT_EQ(out[size_t(c)], float(want)) << dtype_name(t) << " code " << c;
      }
    }
  }
}

TEST_P(CpuConvert, Fp8StoresDivideByTheScale) {
  std::vector<float> in = {3.0f, 1000.0f, -0.001f, 7.5f, 1e-9f, 449.0f * 2};
  std::vector<uint8_t> out(in.size());
  cpu::convert_row(in.data(), DType::kF32, out.data(), DType::kFp8E4M3, int64_t(in.size()), 2.0f);
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(out[i], float_to_fp8_e4m3(in[i] / 2.0f)) << i;
}

TEST_P(CpuConvert, Amax) {
  std::vector<float> x = {1, -7, 3, 2, 0.5f, -6.5f, 4, 1, 2, 3, 1, 1, 1, 1, 1, 1, 1, -9, 2};
  EXPECT_EQ(cpu::amax_row(x.data(), DType::kF32, int64_t(x.size())), 9.0f);
  x[4] = std::nanf("");
  EXPECT_TRUE(std::isnan(cpu::amax_row(x.data(), DType::kF32, int64_t(x.size()))));
}

INSTANTIATE_TEST_SUITE_P(Targets, CpuConvert, ::testing::ValuesIn(cpu::available_targets()),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace pagedattn
#endif  // PAGEDATTN_WITH_CPU_BACKEND
