// CPU attention kernels, compiled once per SIMD target (Highway's foreach_target re-includes
// this file) and dispatched at run time.
//
// Work decomposition (see cpu_plan.cpp): one WorkItem = a range of query tokens of one request
// for all G query heads that share one KV head, against a range of keys. Its rows are the
// (token, head) pairs, so every K/V row is read once for all of them (GQA head packing).
// Keys are processed in chunks of kChunk:
//   S = Q K^T   few rows (decode): dot products straight from the cache rows, converted in
//               registers; many rows (prefill): the chunk is packed transposed (Kt[d][n]) and
//               a 4-row x 4-vector register tile accumulates S.
//   softmax     online, base 2 (log2(e) is folded into the query scale), per row.
//   O += P V    the V chunk is converted once into a float buffer; a 2-row x 8-vector register
//               tile accumulates O (rescaled by the running-max correction as it is loaded).
// fp8 and bf16 values are converted in registers (bf16: shift; fp8: byte -> fp16 bits ->
// float); the k scale is folded into the query scale and the v scale into the final division.
// Scratch per thread: Q, O [rows x head_size], S [rows x kChunk], Kt/V [kChunk x head_size].

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/cpu_kernels.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/cpu_bf16_dot.h"
#include "cpu/cpu_kernels.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "pagedattn/error.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kChunk = 64;  // keys per chunk: a multiple of every target's lane count (<= 16)

// Tag types for the one-byte formats.
struct E4M3 {};
struct E5M2 {};

// NaN lanes. Highway 1.0's float Ne() is an ordered compare (false for NaN) on AVX2/AVX-512.
HWY_INLINE auto NaNMask(VF v) {
  return hn::Not(hn::Eq(v, v));
}

// Half -> float from the bits in u16 lanes. F16C targets use the instruction; Highway's
// emulation elsewhere turns infinities and NaN into finite numbers, so those targets decode
// here (exponent 31 -> 255, subnormals through an exact integer-to-float conversion).
HWY_INLINE VF HalfToF32(DF df, hn::Vec<hn::Rebind<uint16_t, DF>> h) {
#if HWY_TARGET <= HWY_AVX2 || HWY_ARCH_ARM
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::BitCast(dh, h));
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::PromoteTo(du, h);
  const auto sign = hn::ShiftLeft<31>(hn::ShiftRight<15>(bits));
  const auto exp = hn::And(hn::ShiftRight<10>(bits), hn::Set(du, 0x1f));
  const auto man = hn::And(bits, hn::Set(du, 0x3ff));
  const auto sub = hn::BitCast(
      du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, man)), hn::Set(df, std::ldexp(1.0f, -24))));
  const auto normal =
      hn::Or(hn::ShiftLeft<23>(hn::Add(exp, hn::Set(du, 127 - 15))), hn::ShiftLeft<13>(man));
  const auto special = hn::Or(hn::Set(du, 0x7f800000u), hn::ShiftLeft<13>(man));
  auto out = hn::IfThenElse(hn::Eq(exp, hn::Zero(du)), sub, normal);
  out = hn::IfThenElse(hn::Eq(exp, hn::Set(du, 0x1f)), special, out);
  return hn::BitCast(df, hn::Or(out, sign));
#endif
}

// ---------------------------------------------------------------------------------------------
// Loads of Lanes(df) elements, converted to float.

HWY_INLINE VF LoadF32(DF df, const float* p) {
  return hn::LoadU(df, p);
}
HWY_INLINE VF LoadF32(DF df, const hwy::bfloat16_t* p) {
  const hn::Rebind<hwy::bfloat16_t, DF> dbf;
  return hn::PromoteTo(df, hn::LoadU(dbf, p));
}
HWY_INLINE VF LoadF32(DF df, const hwy::float16_t* p) {
  const hn::Rebind<uint16_t, DF> d16;
  return HalfToF32(df, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p)));
}
// e5m2 is the upper byte of an IEEE half: shift it into place and let the half conversion
// handle subnormals, infinities and NaN exactly.
HWY_INLINE VF LoadF32(DF df, const E5M2* p) {
  const hn::Rebind<uint8_t, DF> d8;
  const hn::Rebind<uint16_t, DF> d16;
  const auto b = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const uint8_t*>(p)));
  return HalfToF32(df, hn::ShiftLeft<8>(b));
}
// e4m3fn: sign-extend the byte to 16 bits, shift left by 7 and keep the sign and bits 7..13:
// a half whose exponent and mantissa are the e4m3 ones, i.e. the value / 2^8 (the bias
// difference 15 - 7), exact for normals and subnormals. The one NaN code (S.1111.111) would
// read 1.875 * 2^8 = 480, which no finite e4m3 equals: its exponent is forced to 31 (NaN).
HWY_INLINE VF LoadF32(DF df, const E4M3* p) {
  const hn::Rebind<int8_t, DF> d8;
  const hn::Rebind<int16_t, DF> d16;
  const hn::Rebind<uint16_t, DF> du16;
  const auto b = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
  auto h = hn::And(hn::ShiftLeft<7>(b), hn::Set(d16, int16_t(0xBF80)));
  const auto nan = hn::Eq(hn::And(b, hn::Set(d16, 0x7f)), hn::Set(d16, 0x7f));
  h = hn::IfThenElse(nan, hn::Or(h, hn::Set(d16, 0x7c00)), h);
  return hn::Mul(HalfToF32(df, hn::BitCast(du16, h)), hn::Set(df, 256.0f));
}

// ---------------------------------------------------------------------------------------------
// Stores of a float vector, rounding to nearest even.

HWY_INLINE void StoreF32(DF df, VF v, float* p) {
  hn::StoreU(v, df, p);
}

// Highway's bf16 demotion truncates; round to nearest even by hand, keeping NaN quiet.
HWY_INLINE void StoreF32(DF, VF v, hwy::bfloat16_t* p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> d16;
  const auto u = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1));
  auto r = hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7fff)), lsb));
  const auto nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40));
  r = hn::IfThenElse(hn::RebindMask(du, NaNMask(v)), nan, r);
  const hn::RebindToSigned<DF> di;
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, r)), d16, reinterpret_cast<uint16_t*>(p));
}

// Encodes x into a small float format (sign, exponent, kManBits mantissa bits, IEEE bias and
// subnormals), rounding to nearest even; returns the code in the low bits of each u32 lane.
// kSaturate: magnitudes past the largest finite value give it (fp8 SATFINITE); otherwise they
// give infinity (IEEE half). NaN stays NaN. Bit-identical to the scalar encoders of dtype.cpp.
template <int kExpBits, int kManBits, bool kSaturate>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> EncodeSmallFloat(DF df, VF x, float max_finite,
                                                              uint32_t nan_code) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kMinExp = 1 - kBias;
  constexpr int kSignShift = 31 - (kExpBits + kManBits);
  const auto sign =
      hn::ShiftRight<kSignShift>(hn::And(hn::BitCast(du, x), hn::Set(du, 0x80000000u)));
  // Saturating formats clamp to the largest finite value; IEEE ones to the first power of two
  // past it, which encodes as infinity (and anything that rounds that far does too).
  const float clamp = kSaturate ? max_finite : std::ldexp(1.0f, kBias + 1);
  const VF a = hn::Min(hn::Abs(x), hn::Set(df, clamp));
  // Normal numbers: round the float mantissa to kManBits bits (a carry bumps the exponent).
  const auto bits = hn::BitCast(du, a);
  constexpr int kDrop = 23 - kManBits;
  const auto lsb = hn::And(hn::ShiftRight<kDrop>(bits), hn::Set(du, 1));
  const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, (1u << (kDrop - 1)) - 1), lsb));
  const auto exp = hn::Sub(hn::ShiftRight<23>(rounded), hn::Set(du, uint32_t(127 - kBias)));
  const auto man = hn::And(hn::ShiftRight<kDrop>(rounded), hn::Set(du, (1u << kManBits) - 1));
  const auto normal = hn::Or(hn::ShiftLeft<kManBits>(exp), man);
  // Subnormals: whole units of 2^(kMinExp - kManBits), rounded to nearest even.
  const VF units = hn::Round(hn::Mul(a, hn::Set(df, std::ldexp(1.0f, kManBits - kMinExp))));
  const auto sub = hn::BitCast(du, hn::ConvertTo(di, units));
  auto code = hn::IfThenElse(hn::RebindMask(du, hn::Lt(a, hn::Set(df, std::ldexp(1.0f, kMinExp)))),
                             sub, normal);
  code = hn::IfThenElse(hn::RebindMask(du, NaNMask(x)), hn::Set(du, nan_code), code);
  return hn::Or(code, sign);
}

// fp8 stores of x (already divided by the scale).
template <int kExpBits, int kManBits>
HWY_INLINE void StoreFp8(DF df, VF x, uint8_t* p, float max_finite) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  const auto code = EncodeSmallFloat<kExpBits, kManBits, true>(df, x, max_finite, 0x7f);
  hn::StoreU(hn::DemoteTo(d8, hn::BitCast(di, code)), d8, p);
}
// Half stores: the F16C instruction where the target has it (it rounds to nearest even);
// Highway's emulation on older targets truncates, so those use the exact encoder.
HWY_INLINE void StoreF32(DF df, VF v, hwy::float16_t* p) {
#if HWY_TARGET <= HWY_AVX2 || HWY_ARCH_ARM
  (void)df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  hn::StoreU(hn::DemoteTo(dh, v), dh, p);
#else
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const auto code = EncodeSmallFloat<5, 10, false>(df, v, 65504.0f, 0x7fff);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, code)), d16, reinterpret_cast<uint16_t*>(p));
#endif
}
HWY_INLINE void StoreF32(DF df, VF v, E4M3* p) {
  StoreFp8<4, 3>(df, v, reinterpret_cast<uint8_t*>(p), 448.0f);
}
HWY_INLINE void StoreF32(DF df, VF v, E5M2* p) {
  StoreFp8<5, 2>(df, v, reinterpret_cast<uint8_t*>(p), 57344.0f);
}

// Calls f(type tag pointer) for a float dtype.
template <class F>
HWY_INLINE void VisitFloatType(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(static_cast<float*>(nullptr));
    case DType::kF16:
      return f(static_cast<hwy::float16_t*>(nullptr));
    case DType::kBF16:
      return f(static_cast<hwy::bfloat16_t*>(nullptr));
    case DType::kFp8E4M3:
      return f(static_cast<E4M3*>(nullptr));
    case DType::kFp8E5M2:
      return f(static_cast<E5M2*>(nullptr));
    default:
      detail::fail("cpu: unsupported element type ", dtype_name(t));
  }
}

// Loads the n < Lanes elements at p, the lanes past them zero: a row's tail, read without
// touching memory past its end (the next row, or the end of the cache).
template <class T>
HWY_INLINE VF LoadTailF32(DF df, const T* p, int n) {
  T buf[hn::MaxLanes(DF())];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * size_t(n));
  return LoadF32(df, buf);
}

// n rounded up to whole vectors: the row stride of float scratch, whose padding lanes are zero.
HWY_INLINE int PaddedCols(int n) {
  const int N = int(hn::Lanes(DF()));
  return (n + N - 1) / N * N;
}

// Converts n elements to float: dst[i] = src[i] * mul, and zeros up to PaddedCols(n).
template <class T>
HWY_INLINE void ToFloat(const T* src, float* dst, int n, float mul) {
  const DF df;
  const int N = int(hn::Lanes(df));
  const VF m = hn::Set(df, mul);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(LoadF32(df, src + i), m), df, dst + i);
  if (i < n) hn::StoreU(hn::Mul(LoadTailF32(df, src + i, n - i), m), df, dst + i);
}

// ---------------------------------------------------------------------------------------------
// Conversion of whole rows (write_kv, output stores).

void ConvertRow(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                float scale) {
  const DF df;
  const int64_t N = int64_t(hn::Lanes(df));
  const bool fp8 = is_fp8(dst_dtype);
  const VF inv = hn::Set(df, scale);
  VisitFloatType(src_dtype, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    VisitFloatType(dst_dtype, [&](auto* d_tag) {
      using T = std::remove_pointer_t<decltype(d_tag)>;
      const S* s = static_cast<const S*>(src);
      T* d = static_cast<T*>(dst);
      int64_t i = 0;
      for (; i + N <= n; i += N) {
        VF x = LoadF32(df, s + i);
        if (fp8) x = hn::Div(x, inv);  // division, as the reference and the CUDA kernel do
        StoreF32(df, x, d + i);
      }
      for (; i < n; ++i) {  // tail: the scalar conversions (same rounding)
        float x = float(load_element(src, src_dtype, i));
        if (fp8) x /= scale;
        store_element(dst, dst_dtype, i, x);
      }
    });
  });
}

float AmaxRow(const void* src, DType dtype, int64_t n) {
  const DF df;
  const int64_t N = int64_t(hn::Lanes(df));
  VF m = hn::Zero(df);
  bool nan = false;
  int64_t i = 0;
  VisitFloatType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* s = static_cast<const T*>(src);
    for (; i + N <= n; i += N) {
      const VF x = LoadF32(df, s + i);
      nan |= !hn::AllFalse(df, NaNMask(x));
      m = hn::Max(m, hn::Abs(x));
    }
  });
  float r = hn::GetLane(hn::MaxOfLanes(df, m));
  for (; i < n; ++i) {
    const float x = float(load_element(src, dtype, i));
    nan |= std::isnan(x);
    r = std::max(r, std::fabs(x));
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : r;
}

// ---------------------------------------------------------------------------------------------
// Attention.

// Per-thread scratch, grown on demand (never shrunk).
struct Scratch {
  std::vector<float> q, o, s, kt, v, row_max, row_sum, row_alpha;
  // The bf16 path: queries, packed keys and values, and fp8 rows converted to bf16.
  std::vector<uint16_t> qb, kv16;
  std::vector<uint32_t> kp, vp;
  void reserve(int rows, int head_size) {
    auto grow = [](std::vector<float>& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
    grow(q, size_t(rows) * head_size);
    grow(o, size_t(rows) * head_size);
    grow(s, size_t(rows) * kChunk);
    grow(kt, size_t(head_size) * kChunk);
    grow(v, size_t(kChunk) * head_size);
    grow(row_max, size_t(rows));
    grow(row_sum, size_t(rows));
    grow(row_alpha, size_t(rows));
  }
  void reserve_bf16(int rows, int head_size, int heads) {
    auto grow = [](auto& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
    grow(qb, size_t(rows) * head_size);
    grow(kv16, size_t(2 * kChunk) * size_t(heads) * head_size);
    grow(kp, size_t(head_size / 2) * kChunk);
    grow(vp, size_t(kChunk / 2) * head_size);
  }
};

Scratch& ThreadScratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// Where one request's keys and values are: key(j, h) is key position j of KV head h.
struct KeySource {
  const uint8_t* k;
  const uint8_t* v;
  size_t elem;
  int64_t k_row0, v_row0;  // unpaged: element offset of the request's first row
  const int32_t* blocks;   // the request's block table row (stride p->block_table_stride_block)
  const AttentionParams* p;
};

// The K and V token rows (KV head 0) of one chunk of keys, resolved once through the block
// table: walking the chunk in order needs one division, not one per key and head.
struct ChunkRows {
  const uint8_t* k[64];
  const uint8_t* v[64];
  void resolve(const KeySource& src, int64_t j0, int nc) {
    const AttentionParams& p = *src.p;
    const int64_t ek = int64_t(src.elem);
    if (!src.blocks) {
      for (int n = 0; n < nc; ++n) {
        k[n] = src.k + ek * (src.k_row0 + (j0 + n) * p.k_stride_token);
        v[n] = src.v + ek * (src.v_row0 + (j0 + n) * p.v_stride_token);
      }
      return;
    }
    const int bs = p.block_size;
    int64_t block = j0 / bs, off = j0 % bs;
    for (int n = 0; n < nc; ++n) {
      const int64_t b = src.blocks[block * p.block_table_stride_block];
      k[n] = src.k + ek * (b * p.k_stride_block + off * p.k_stride_token);
      v[n] = src.v + ek * (b * p.v_stride_block + off * p.v_stride_token);
      if (++off == bs) {
        off = 0;
        ++block;
      }
    }
  }
};

// S[r][n] for kRows rows per KV head (decode): key row n of each head is converted once in
// registers and dotted with the rows of that head. Heads are the inner loop so that a token's
// K rows are read in address order (an NHD token row holds every head). Q and S rows of head
// hl start at hl * kRows. Q rows have stride ld (PaddedCols(d_size), zero past d_size).
template <int kRows, class T>
HWY_NOINLINE void ScoresFewRows(const ChunkRows& rows, int64_t head_stride, int nc, int h0,
                                int heads, int d_size, int ld, const float* q, float* s) {
  const DF df;
  const int N = int(hn::Lanes(df));
  for (int n = 0; n < nc; ++n) {
    const T* k_row = reinterpret_cast<const T*>(rows.k[n]) + h0 * head_stride;
    for (int hl = 0; hl < heads; ++hl) {
      const T* k = k_row + hl * head_stride;
      const float* qh = q + hl * kRows * ld;
      // Two accumulators per row halve the dependent FMA chain along the head dimension.
      VF acc0[kRows], acc1[kRows];
      for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = hn::Zero(df);
      int d = 0;
      for (; d + 2 * N <= d_size; d += 2 * N) {
        const VF k0 = LoadF32(df, k + d), k1 = LoadF32(df, k + d + N);
        for (int r = 0; r < kRows; ++r) {
          acc0[r] = hn::MulAdd(hn::LoadU(df, qh + r * ld + d), k0, acc0[r]);
          acc1[r] = hn::MulAdd(hn::LoadU(df, qh + r * ld + d + N), k1, acc1[r]);
        }
      }
      // The rest: up to one whole vector, then a partial one (its Q lanes are zero).
      for (; d < d_size; d += N) {
        const VF k0 = d + N <= d_size ? LoadF32(df, k + d) : LoadTailF32(df, k + d, d_size - d);
        for (int r = 0; r < kRows; ++r) {
          acc0[r] = hn::MulAdd(hn::LoadU(df, qh + r * ld + d), k0, acc0[r]);
        }
      }
      float* sh = s + hl * kRows * kChunk;
      for (int r = 0; r < kRows; ++r) {
        sh[r * kChunk + n] = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0[r], acc1[r])));
      }
    }
  }
}

// Packs the chunk's keys transposed: kt[d][n] (float), for the register-tiled product.
template <class T>
HWY_NOINLINE void PackKeysTransposed(const ChunkRows& rows, int64_t head_offset, int nc, int d_size,
                                     float* kt, float* row) {
  for (int n = 0; n < nc; ++n) {
    ToFloat(reinterpret_cast<const T*>(rows.k[n]) + head_offset, row, d_size, 1.0f);
    for (int d = 0; d < d_size; ++d) kt[d * kChunk + n] = row[d];
  }
  for (int n = nc; n < kChunk; ++n)
    for (int d = 0; d < d_size; ++d) kt[d * kChunk + n] = 0.0f;
}

// S[r][:] for kRows rows from the packed keys, 4 vectors of keys at a time.
template <int kRows>
HWY_INLINE void ScoresTile(const float* q, const float* kt, float* s, int d_size, int ld) {
  const DF df;
  const int N = int(hn::Lanes(df));
  for (int nb = 0; nb < kChunk; nb += 4 * N) {
    VF acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = hn::Zero(df);
    for (int d = 0; d < d_size; ++d) {
      const float* kd = kt + d * kChunk + nb;
      const VF k0 = hn::LoadU(df, kd), k1 = hn::LoadU(df, kd + N);
      const VF k2 = hn::LoadU(df, kd + 2 * N), k3 = hn::LoadU(df, kd + 3 * N);
      for (int r = 0; r < kRows; ++r) {
        const VF qv = hn::Set(df, q[r * ld + d]);
        acc[r][0] = hn::MulAdd(qv, k0, acc[r][0]);
        acc[r][1] = hn::MulAdd(qv, k1, acc[r][1]);
        acc[r][2] = hn::MulAdd(qv, k2, acc[r][2]);
        acc[r][3] = hn::MulAdd(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) hn::StoreU(acc[r][c], df, s + r * kChunk + nb + c * N);
  }
}

// Q rows have stride ld.
HWY_NOINLINE void ScoresManyRows(const float* q, const float* kt, float* s, int rows, int d_size,
                                 int ld) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) ScoresTile<4>(q + r * ld, kt, s + r * kChunk, d_size, ld);
  switch (rows - r) {
    case 3:
      ScoresTile<3>(q + r * ld, kt, s + r * kChunk, d_size, ld);
      break;
    case 2:
      ScoresTile<2>(q + r * ld, kt, s + r * kChunk, d_size, ld);
      break;
    case 1:
      ScoresTile<1>(q + r * ld, kt, s + r * kChunk, d_size, ld);
      break;
    default:
      break;
  }
}

// o[r][:] = o[r][:] * alpha[r] + sum_n p[r][n] * v[n][:] for kRows rows and kCols vectors of
// columns starting at column c0.
template <int kRows, int kCols>
HWY_INLINE void AccumulateTile(const float* p, const float* alpha, const float* v, float* o, int nc,
                               int d_size, int c0) {
  const DF df;
  const int N = int(hn::Lanes(df));
  VF acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    const VF a = hn::Set(df, alpha[r]);
    for (int c = 0; c < kCols; ++c)
      acc[r][c] = hn::Mul(hn::LoadU(df, o + r * d_size + c0 + c * N), a);
  }
  for (int n = 0; n < nc; ++n) {
    const float* vn = v + n * d_size + c0;
    for (int r = 0; r < kRows; ++r) {
      const VF pv = hn::Set(df, p[r * kChunk + n]);
      for (int c = 0; c < kCols; ++c)
        acc[r][c] = hn::MulAdd(pv, hn::LoadU(df, vn + c * N), acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) hn::StoreU(acc[r][c], df, o + r * d_size + c0 + c * N);
}

template <int kRows>
HWY_INLINE void AccumulateRows(const float* p, const float* alpha, const float* v, float* o, int nc,
                               int d_size) {
  const int N = int(hn::Lanes(DF()));
  const int vecs = d_size / N;
  int c = 0;
  for (; c + 8 <= vecs; c += 8) AccumulateTile<kRows, 8>(p, alpha, v, o, nc, d_size, c * N);
  switch (vecs - c) {
#define PAGEDATTN_CPU_COLS(k)                                    \
  case k:                                                        \
    AccumulateTile<kRows, k>(p, alpha, v, o, nc, d_size, c * N); \
    break;
    PAGEDATTN_CPU_COLS(1)
    PAGEDATTN_CPU_COLS(2)
    PAGEDATTN_CPU_COLS(3)
    PAGEDATTN_CPU_COLS(4)
    PAGEDATTN_CPU_COLS(5)
    PAGEDATTN_CPU_COLS(6)
    PAGEDATTN_CPU_COLS(7)
#undef PAGEDATTN_CPU_COLS
    default:
      break;
  }
}

HWY_NOINLINE void Accumulate(const float* p, const float* alpha, const float* v, float* o, int rows,
                             int nc, int d_size) {
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    AccumulateRows<2>(p + r * kChunk, alpha + r, v, o + r * d_size, nc, d_size);
  }
  if (r < rows) AccumulateRows<1>(p + r * kChunk, alpha + r, v, o + r * d_size, nc, d_size);
}

// Turns one row of raw scores into probabilities relative to the running max (updated), and
// returns the correction factor for what was accumulated before. Scores arrive in
// "scale * q.k" units (times log2 e unless a soft cap is applied here first).
HWY_INLINE float SoftmaxRow(const AttentionParams& p, float* s, int nc, int64_t j0, int64_t pos,
                            int head, float* row_max, float* row_sum) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const int N = int(hn::Lanes(df));
  const VF neg_inf = hn::Set(df, kNegInf);
  const bool cap = p.soft_cap > 0.0f;
  const VF cap_v = hn::Set(df, p.soft_cap), inv_cap = hn::Set(df, 1.0f / p.soft_cap);
  const VF log2e = hn::Set(df, kLog2e);
  const float slope = p.alibi ? p.alibi[head] * kLog2e : 0.0f;
  // Key positions of the chunk, relative to the query: j - pos.
  const auto iota = hn::Iota(di, 0);
  const int64_t rel0 = j0 - pos;
  VF mx = neg_inf;
  for (int n = 0; n < kChunk; n += N) {
    VF x = hn::LoadU(df, s + n);
    if (cap) x = hn::Mul(hn::Mul(cap_v, hn::Tanh(df, hn::Mul(x, inv_cap))), log2e);
    const auto rel_i = hn::Add(iota, hn::Set(di, int32_t(rel0 + n)));
    const VF rel = hn::ConvertTo(df, rel_i);
    if (p.alibi) x = hn::MulAdd(hn::Set(df, slope), rel, x);
    auto visible = hn::Lt(hn::Add(iota, hn::Set(di, n)), hn::Set(di, nc));
    // Highway 1.0 has only strict integer comparisons: j - pos <= b  <=>  j - pos < b + 1.
    if (p.causal) visible = hn::And(visible, hn::Lt(rel_i, hn::Set(di, 1)));
    if (p.window_left >= 0) {
      visible = hn::And(visible, hn::Gt(rel_i, hn::Set(di, -p.window_left - 1)));
    }
    if (p.window_right >= 0) {
      visible = hn::And(visible, hn::Lt(rel_i, hn::Set(di, p.window_right + 1)));
    }
    x = hn::IfThenElse(hn::RebindMask(df, visible), x, neg_inf);
    hn::StoreU(x, df, s + n);
    mx = hn::Max(mx, x);
  }
  const float chunk_max = hn::GetLane(hn::MaxOfLanes(df, mx));
  const float old_max = *row_max;
  const float new_max = std::max(old_max, chunk_max);
  if (new_max == kNegInf) {  // nothing visible yet: keep zeros
    for (int n = 0; n < kChunk; n += N) hn::StoreU(hn::Zero(df), df, s + n);
    return 1.0f;
  }
  const VF m = hn::Set(df, new_max);
  VF sum = hn::Zero(df);
  for (int n = 0; n < kChunk; n += N) {
    // exp2(x - m) as exp((x - m) ln 2); masked keys give exp(-inf) = 0.
    const VF e = hn::Exp(df, hn::Mul(hn::Sub(hn::LoadU(df, s + n), m), hn::Set(df, kLn2)));
    const VF pr = hn::IfThenZeroElse(hn::Eq(hn::LoadU(df, s + n), neg_inf), e);
    hn::StoreU(pr, df, s + n);
    sum = hn::Add(sum, pr);
  }
  const float alpha = old_max == kNegInf ? 0.0f : std::exp2(old_max - new_max);
  *row_sum = *row_sum * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  *row_max = new_max;
  return alpha;
}

// Asks for the K and V rows of keys [j0, j1) and KV heads [h0, h0 + heads) (every cache line),
// one chunk ahead of their use: paged blocks are scattered, so the hardware prefetchers see only
// short runs. Heads adjacent in memory (NHD) are fetched as one span.
template <class T>
HWY_INLINE void PrefetchRows(const KeySource& src, const ChunkRows& rows, int nc, int h0, int heads,
                             int d_size) {
  const AttentionParams& p = *src.p;
  const bool adjacent = p.k_stride_head == d_size && p.v_stride_head == d_size;
  const int spans = adjacent ? 1 : heads;
  const int span_bytes = (adjacent ? heads : 1) * d_size * int(sizeof(T));
  for (int n = 0; n < nc; ++n) {
    for (int i = 0; i < spans; ++i) {
      const char* k =
          reinterpret_cast<const char*>(rows.k[n]) + sizeof(T) * size_t((h0 + i) * p.k_stride_head);
      const char* v =
          reinterpret_cast<const char*>(rows.v[n]) + sizeof(T) * size_t((h0 + i) * p.v_stride_head);
      for (int b = 0; b < span_bytes; b += 64) {
        hwy::Prefetch(k + b);
        hwy::Prefetch(v + b);
      }
    }
  }
}

// Writes one finished row (float, normalised) to the output and its LSE.
HWY_INLINE void StoreOutputRow(const AttentionParams& p, int64_t token, int head, const float* row,
                               float lse) {
  char* op =
      static_cast<char*>(p.out) +
      dtype_size(p.out_dtype) * size_t(token * p.out_stride_token + head * p.out_stride_head);
  if (p.out_dtype == DType::kF64) {
    for (int d = 0; d < p.out_cols; ++d) reinterpret_cast<double*>(op)[d] = row[d];
  } else {
    ConvertRow(row, DType::kF32, op, p.out_dtype, p.out_cols, 1.0f);
  }
  if (p.lse) {
    store_element(p.lse, p.lse_dtype, head * p.lse_stride_head + token * p.lse_stride_token, lse);
  }
}

// Rows of an item: (KV head hl, token t, query head g) -> hl * tokens * group + t * group + g.
struct RowMap {
  int group, tokens, kv_head0;
  int rows_per_head() const { return tokens * group; }
  int head(int row) const { return (kv_head0 + row / rows_per_head()) * group + row % group; }
  int token(int row) const { return (row % rows_per_head()) / group; }
};

// The bf16 pair-dot path (x86 AVX512-BF16): bf16 queries against bf16 or fp8 caches, whose
// values bf16 holds exactly. Row pointers of one head's chunk, as bf16 (fp8 rows are converted
// into `tmp` first).
template <class KV>
HWY_INLINE void ChunkRowsBf16(const uint8_t* const* rows, int64_t head_offset, int nc, int d_size,
                              uint16_t* tmp, const uint16_t** out) {
  for (int n = 0; n < nc; ++n) {
    const KV* r = reinterpret_cast<const KV*>(rows[n]) + head_offset;
    if constexpr (std::is_same_v<KV, hwy::bfloat16_t>) {
      out[n] = reinterpret_cast<const uint16_t*>(r);
    } else {
      bf16::fp8_to_bf16(reinterpret_cast<const uint8_t*>(r), tmp + n * d_size, d_size,
                        std::is_same_v<KV, E5M2>);
      out[n] = tmp + n * d_size;
    }
  }
}

// As ChunkRowsBf16 for KV heads [h0, h0 + heads) at once (decode items): out[n] points at head
// h0 of key n; *head_stride is the distance to the next head (converted rows are packed).
template <class KV>
HWY_INLINE void ChunkRowsBf16Heads(const uint8_t* const* rows, int64_t stride_head, int h0,
                                   int heads, int nc, int d_size, uint16_t* tmp,
                                   const uint16_t** out, int64_t* head_stride) {
  if constexpr (std::is_same_v<KV, hwy::bfloat16_t>) {
    for (int n = 0; n < nc; ++n)
      out[n] = reinterpret_cast<const uint16_t*>(rows[n]) + h0 * stride_head;
    *head_stride = stride_head;
  } else {
    const bool adjacent = stride_head == d_size;
    for (int n = 0; n < nc; ++n) {
      const uint8_t* r = rows[n] + h0 * stride_head;
      uint16_t* dst = tmp + int64_t(n) * heads * d_size;
      if (adjacent) {
        bf16::fp8_to_bf16(r, dst, int64_t(heads) * d_size, std::is_same_v<KV, E5M2>);
      } else {
        for (int hl = 0; hl < heads; ++hl) {
          bf16::fp8_to_bf16(r + hl * stride_head, dst + hl * d_size, d_size,
                            std::is_same_v<KV, E5M2>);
        }
      }
      out[n] = dst;
    }
    *head_stride = d_size;
  }
}

template <class KV>
constexpr bool kBf16Exact =
    std::is_same_v<KV, hwy::bfloat16_t> || std::is_same_v<KV, E4M3> || std::is_same_v<KV, E5M2>;

template <class KV>
void AttendTyped(const AttentionParams& p, const WorkItem& w, const PartialBuffers& partials) {
  const DF df;
  const int d_size = p.head_size;
  const int dv = p.v_head_size > 0 ? p.v_head_size : d_size;
  const int group = p.num_heads / p.num_kv_heads;
  const int r = w.request;
  const int64_t q0 = p.query_start_loc[r];
  const int64_t q_len = p.query_start_loc[r + 1] - q0;
  const int64_t seq_len = p.paged ? p.seq_lens[r] : q_len;
  const int64_t context = seq_len - q_len;
  const RowMap map{group, w.q_end - w.q_begin, w.kv_head};
  const int per_head = map.rows_per_head();
  const int heads = w.num_kv_heads;
  const int rows = per_head * heads;
  // Float scratch rows are padded to whole vectors with zeros, so that every head size runs the
  // vector loops: ld for Q, ldv for O and the converted V rows.
  const int ld = PaddedCols(d_size), ldv = PaddedCols(dv);
  Scratch& sc = ThreadScratch();
  sc.reserve(rows, ld);
  float* q = sc.q.data();
  float* o = sc.o.data();
  float* s = sc.s.data();

  KeySource src{static_cast<const uint8_t*>(p.k),
                static_cast<const uint8_t*>(p.v),
                dtype_size(p.kv_dtype),
                0,
                0,
                p.paged ? p.block_table + int64_t(r) * p.block_table_stride : nullptr,
                &p};
  if (!p.paged) {
    src.k_row0 = q0 * p.k_stride_token;
    src.v_row0 = q0 * p.v_stride_token;
  }

  // Queries, scaled so that q.k comes out in base-2 logit units (or scale units under a cap).
  const float qscale = (p.soft_cap > 0.0f ? p.scale : p.scale * kLog2e) * p.k_scale;
  const bool with_sink = p.sinks && w.include_sink;
  // Per-head k scales fold into each query row (so scores need no per-head factor).
  auto k_scale_of = [&](int head) {
    return p.head_scales ? p.head_scales->k_scale_of(r, head / group, p.num_kv_heads) : 1.0f;
  };
  for (int row = 0; row < rows; ++row) {
    const int head = map.head(row);
    const float row_qscale = qscale * k_scale_of(head);
    const int64_t token = q0 + w.q_begin + map.token(row);
    const char* qp =
        static_cast<const char*>(p.q) +
        dtype_size(p.q_dtype) * size_t(token * p.q_stride_token + head * p.q_stride_head);
    VisitFloatType(p.q_dtype, [&](auto* tag) {
      using Q = std::remove_pointer_t<decltype(tag)>;
      ToFloat(reinterpret_cast<const Q*>(qp), q + row * ld, d_size, row_qscale);
    });
    std::fill(o + row * ldv, o + (row + 1) * ldv, 0.0f);
    // A sink starts the running max and contributes exp2(sink - max) to the sum.
    sc.row_max[size_t(row)] = with_sink ? p.sinks[head] * kLog2e : kNegInf;
    sc.row_sum[size_t(row)] = with_sink ? 1.0f : 0.0f;
  }

  // Rows of the current chunk and of the next one (prefetched while this one is computed).
  ChunkRows cur, next;
  cur.resolve(src, w.k_begin, int(std::min<int64_t>(kChunk, w.k_end - w.k_begin)));
  PrefetchRows<KV>(src, cur, int(std::min<int64_t>(kChunk, w.k_end - w.k_begin)), w.kv_head, heads,
                   d_size);
  // bf16 queries over bf16 or fp8 caches (exact in bf16) go through the AVX512-BF16 pair-dot
  // kernels where the CPU has them, decode and prefill alike; qscale is applied to their scores.
  bool use_bf16 = false;
#if HWY_TARGET == HWY_AVX3
  // The pair-dot kernels scale whole chunks by one qscale: per-head scales take the float path.
  // Their register tiles are whole 16-float vectors wide (so ldv == dv there).
  use_bf16 = kBf16Exact<KV> && p.q_dtype == DType::kBF16 && bf16::enabled() && !p.head_scales &&
             d_size % 16 == 0 && dv % 16 == 0;
#endif
  const bool few_rows = per_head <= 8;
  if (use_bf16) {
    sc.reserve_bf16(rows, d_size, heads);
    for (int row = 0; row < rows; ++row) {
      const int64_t token = q0 + w.q_begin + map.token(row);
      std::memcpy(sc.qb.data() + row * d_size,
                  static_cast<const uint16_t*>(p.q) + token * p.q_stride_token +
                      map.head(row) * p.q_stride_head,
                  sizeof(uint16_t) * size_t(d_size));
    }
  }
  const uint16_t* rows16[kChunk];
  int64_t head_stride16 = 0;

  for (int64_t j0 = w.k_begin; j0 < w.k_end; j0 += kChunk) {
    const int nc = int(std::min<int64_t>(kChunk, w.k_end - j0));
    const int next_nc = int(std::clamp<int64_t>(w.k_end - (j0 + kChunk), 0, kChunk));
    if (next_nc > 0) {
      next.resolve(src, j0 + kChunk, next_nc);
      PrefetchRows<KV>(src, next, next_nc, w.kv_head, heads, d_size);
    }
    if (use_bf16 && few_rows) {
      ChunkRowsBf16Heads<KV>(cur.k, p.k_stride_head, w.kv_head, heads, nc, d_size, sc.kv16.data(),
                             rows16, &head_stride16);
      bf16::scores_few(sc.qb.data(), rows16, head_stride16, heads, nc, per_head, d_size, qscale, s);
    } else
      switch (per_head) {
#define PAGEDATTN_CPU_FEW(k)                                                            \
  case k:                                                                               \
    ScoresFewRows<k, KV>(cur, p.k_stride_head, nc, w.kv_head, heads, d_size, ld, q, s); \
    break;
        PAGEDATTN_CPU_FEW(1)
        PAGEDATTN_CPU_FEW(2)
        PAGEDATTN_CPU_FEW(3)
        PAGEDATTN_CPU_FEW(4)
        PAGEDATTN_CPU_FEW(5)
        PAGEDATTN_CPU_FEW(6)
        PAGEDATTN_CPU_FEW(7)
        PAGEDATTN_CPU_FEW(8)
#undef PAGEDATTN_CPU_FEW
        default:
          for (int hl = 0; hl < heads; ++hl) {
            if (use_bf16) {
              ChunkRowsBf16<KV>(cur.k, (w.kv_head + hl) * p.k_stride_head, nc, d_size,
                                sc.kv16.data(), rows16);
              bf16::pack_keys(rows16, nc, d_size, sc.kp.data());
              bf16::scores(sc.qb.data() + hl * per_head * d_size, sc.kp.data(),
                           s + hl * per_head * kChunk, per_head, d_size, qscale);
              continue;
            }
            PackKeysTransposed<KV>(cur, (w.kv_head + hl) * p.k_stride_head, nc, d_size,
                                   sc.kt.data(), sc.v.data());
            ScoresManyRows(q + hl * per_head * ld, sc.kt.data(), s + hl * per_head * kChunk,
                           per_head, d_size, ld);
          }
          break;
      }
    for (int row = 0; row < rows; ++row) {
      sc.row_alpha[size_t(row)] =
          SoftmaxRow(p, s + row * kChunk, nc, j0, context + w.q_begin + map.token(row),
                     map.head(row), &sc.row_max[size_t(row)], &sc.row_sum[size_t(row)]);
    }
    if (use_bf16 && few_rows) {
      ChunkRowsBf16Heads<KV>(cur.v, p.v_stride_head, w.kv_head, heads, nc, dv,
                             sc.kv16.data() + int64_t(kChunk) * heads * d_size, rows16,
                             &head_stride16);
      for (int hl = 0; hl < heads; ++hl) {
        bf16::accumulate_few(s + hl * per_head * kChunk, sc.row_alpha.data() + hl * per_head,
                             rows16, hl * head_stride16, nc, per_head, dv, o + hl * per_head * ldv);
      }
      std::swap(cur, next);
      continue;
    }
    for (int hl = 0; hl < heads; ++hl) {
      const int64_t v_head = (w.kv_head + hl) * p.v_stride_head;
      if (use_bf16) {
        ChunkRowsBf16<KV>(cur.v, v_head, nc, dv, sc.kv16.data() + kChunk * d_size, rows16);
        bf16::pack_values(rows16, nc, dv, sc.vp.data());
        bf16::accumulate(s + hl * per_head * kChunk, sc.row_alpha.data() + hl * per_head,
                         sc.vp.data(), o + hl * per_head * ldv, per_head, nc, dv);
        continue;
      }
      for (int n = 0; n < nc; ++n) {
        ToFloat(reinterpret_cast<const KV*>(cur.v[n]) + v_head, sc.v.data() + n * ldv, dv, 1.0f);
      }
      Accumulate(s + hl * per_head * kChunk, sc.row_alpha.data() + hl * per_head, sc.v.data(),
                 o + hl * per_head * ldv, per_head, nc, ldv);
    }
    std::swap(cur, next);
  }

  // Normalise and store: the final output, or this split's partial result.
  for (int row = 0; row < rows; ++row) {
    const float l = sc.row_sum[size_t(row)];
    const float v_scale = p.head_scales
                              ? p.head_scales->v_scale_of(r, map.head(row) / group, p.num_kv_heads)
                              : p.v_scale;
    const float inv = l > 0.0f ? v_scale / l : 0.0f;
    const float lse = l > 0.0f ? (sc.row_max[size_t(row)] + std::log2(l)) * kLn2 : kNegInf;
    float* orow = o + row * ldv;
    for (int d = 0; d < ldv; d += int(hn::Lanes(df))) {
      hn::StoreU(hn::Mul(hn::LoadU(df, orow + d), hn::Set(df, inv)), df, orow + d);
    }
    if (w.split >= 0) {
      const int64_t slot = int64_t(w.split) * partials.rows_stride + row;
      std::memcpy(partials.out + slot * dv, orow, sizeof(float) * size_t(dv));
      partials.lse[slot] = lse;
      continue;
    }
    StoreOutputRow(p, q0 + w.q_begin + map.token(row), map.head(row), orow, lse);
  }
}

void AttendItem(const AttentionParams& p, const WorkItem& w, const PartialBuffers& partials) {
  switch (p.kv_dtype) {
    case DType::kF32:
      return AttendTyped<float>(p, w, partials);
    case DType::kF16:
      return AttendTyped<hwy::float16_t>(p, w, partials);
    case DType::kBF16:
      return AttendTyped<hwy::bfloat16_t>(p, w, partials);
    case DType::kFp8E4M3:
      return AttendTyped<E4M3>(p, w, partials);
    case DType::kFp8E5M2:
      return AttendTyped<E5M2>(p, w, partials);
    default:
      detail::fail("cpu: unsupported KV cache type ", dtype_name(p.kv_dtype));
  }
}

void MergeSplits(const AttentionParams& p, const WorkItem& w, int first, int count,
                 const PartialBuffers& partials) {
  const DF df;
  const int N = int(hn::Lanes(df));
  const int d_size = p.v_head_size > 0 ? p.v_head_size : p.head_size;  // the partials' width
  const int group = p.num_heads / p.num_kv_heads;
  const RowMap map{group, w.q_end - w.q_begin, w.kv_head};
  const int rows = map.rows_per_head() * w.num_kv_heads;
  const int64_t q0 = p.query_start_loc[w.request];
  std::vector<float> acc(static_cast<size_t>(d_size));
  for (int row = 0; row < rows; ++row) {
    float m = kNegInf;
    for (int i = 0; i < count; ++i)
      m = std::max(m, partials.lse[(first + i) * partials.rows_stride + row]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    if (m != kNegInf) {
      for (int i = 0; i < count; ++i) {
        const int64_t slot = (first + i) * partials.rows_stride + row;
        const float wgt = std::exp(partials.lse[slot] - m);
        if (wgt == 0.0f) continue;  // an empty split's output is never read
        total += wgt;
        const VF wv = hn::Set(df, wgt);
        const float* part = partials.out + slot * d_size;
        int d = 0;
        for (; d + N <= d_size; d += N) {
          hn::StoreU(hn::MulAdd(wv, hn::LoadU(df, part + d), hn::LoadU(df, acc.data() + d)), df,
                     acc.data() + d);
        }
        for (; d < d_size; ++d) acc[size_t(d)] += wgt * part[d];
      }
      for (float& x : acc) x /= total;
    }
    const float lse = m == kNegInf ? kNegInf : m + std::log(total);
    StoreOutputRow(p, q0 + w.q_begin + map.token(row), map.head(row), acc.data(), lse);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pagedattn::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagedattn::cpu {

HWY_EXPORT(AttendItem);
HWY_EXPORT(MergeSplits);
HWY_EXPORT(ConvertRow);
HWY_EXPORT(AmaxRow);

void attend_item(const AttentionParams& p, const WorkItem& item, const PartialBuffers& partials) {
  HWY_DYNAMIC_DISPATCH(AttendItem)(p, item, partials);
}
void merge_splits(const AttentionParams& p, const WorkItem& item, int first_split, int num_splits,
                  const PartialBuffers& partials) {
  HWY_DYNAMIC_DISPATCH(MergeSplits)(p, item, first_split, num_splits, partials);
}
void convert_row(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                 float scale) {
  HWY_DYNAMIC_DISPATCH(ConvertRow)(src, src_dtype, dst, dst_dtype, n, scale);
}
float amax_row(const void* src, DType dtype, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(AmaxRow)(src, dtype, n);
}

// Highway's targets, plus "AVX3_BF16": AVX-512 with the bf16 pair-dot prefill kernels (the
// default where the CPU has them; "AVX3" then means AVX-512 without them).
std::vector<std::string> available_targets() {
  std::vector<std::string> names;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (t == HWY_AVX3 && bf16::available()) names.emplace_back("AVX3_BF16");
    names.emplace_back(hwy::TargetName(t));
  }
  return names;
}

bool force_target(const std::string& name) {
  hwy::SetSupportedTargetsForTest(0);
  bf16::set_enabled(true);
  if (name.empty()) return true;
  const bool with_bf16 = name == "AVX3_BF16";
  if (with_bf16 && !bf16::available()) return false;
  const std::string hwy_name = with_bf16 ? "AVX3" : name;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (hwy_name == hwy::TargetName(t)) {
      hwy::SetSupportedTargetsForTest(t);
      bf16::set_enabled(with_bf16);
      return true;
    }
  }
  return false;
}

std::string current_target() {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  if (targets.empty()) return "none";
  if (targets.front() == HWY_AVX3 && bf16::enabled()) return "AVX3_BF16";
  return hwy::TargetName(targets.front());
}

}  // namespace pagedattn::cpu
#endif  // HWY_ONCE
