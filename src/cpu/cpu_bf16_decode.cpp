// AVX512-BF16 decode kernels (see cpu_bf16_dot.h): few query rows per KV head, so the keys are
// dotted straight from their bf16 cache rows (pairs along the head dimension need no packing)
// and values are interleaved two rows at a time into pairs along the keys. Compiled with the
// AVX-512 BF16 flags; runs only where bf16::available().
#include "cpu/cpu_bf16_dot.h"

#if defined(__x86_64__) && defined(PAGEDATTN_CPU_BF16_KERNELS)
// GCC 12's _mm512_reduce_add_ps starts from an intentionally undefined vector, which
// -Wmaybe-uninitialized reports inside the header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/cpu_bf16_common.h"
#include "pagedattn/dtype.h"

// As cpu_bf16_dot.cpp: compiled with AVX-512 flags, so no header templates (no std::min,
// std::array): only intrinsics and local code.
namespace pagedattn::cpu::bf16 {
namespace {

inline int min_int(int a, int b) {
  return a < b ? a : b;
}

// The 16-bit lanes [0, n) of a row of bf16 values, zero past n (n <= 32).
inline __m512i load_bf16(const uint16_t* p, int n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
}

template <int kRows>
void scores_rows(const uint16_t* q, const uint16_t* const* k_rows, int64_t head_stride, int heads,
                 int nc, int head_size, float scale, float* s) {
  for (int n = 0; n < nc; ++n) {
    for (int hl = 0; hl < heads; ++hl) {
      const uint16_t* k = k_rows[n] + hl * head_stride;
      const uint16_t* qh = q + hl * kRows * head_size;
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int d = 0; d < head_size; d += 32) {
        const int w = head_size - d;
        const __m512bh kv = (__m512bh)load_bf16(k + d, w);
        for (int r = 0; r < kRows; ++r) {
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)load_bf16(qh + r * head_size + d, w), kv);
        }
      }
      float* sh = s + hl * kRows * kChunk;
      for (int r = 0; r < kRows; ++r) sh[r * kChunk + n] = _mm512_reduce_add_ps(acc[r]) * scale;
    }
  }
}

// o rows [kRows][head_size], columns [c0, c0 + 16 * kCols).
template <int kRows, int kCols>
void accumulate_block(const uint32_t* pp, const float* alpha, const uint16_t* const* v_rows,
                      int64_t head_offset, int nc, int head_size, float* o, int c0) {
  const __m512i lo_idx = interleave_lo_index();
  const __m512i hi_idx = interleave_hi_index();
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < kCols; ++c) {
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * head_size + c0 + 16 * c), a);
    }
  }
  for (int n = 0; n < nc; n += 2) {
    const uint16_t* va = v_rows[n] + head_offset + c0;
    const uint16_t* vb = n + 1 < nc ? v_rows[n + 1] + head_offset + c0 : nullptr;
    __m512bh pairs[kCols];
    for (int c = 0; c < kCols; c += 2) {
      const int w = min_int(32, 16 * (kCols - c));
      const __m512i a = load_bf16(va + 16 * c, w);
      const __m512i b = vb ? load_bf16(vb + 16 * c, w) : _mm512_setzero_si512();
      pairs[c] = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
      if (c + 1 < kCols) pairs[c + 1] = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pp[r * (kChunk / 2) + n / 2]));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, pairs[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(o + r * head_size + c0 + 16 * c, acc[r][c]);
}

template <int kRows>
void accumulate_rows(const uint32_t* pp, const float* alpha, const uint16_t* const* v_rows,
                     int64_t head_offset, int nc, int head_size, float* o) {
  const int vecs = head_size / 16;
  int c = 0;
  for (; c + 8 <= vecs; c += 8) {
    accumulate_block<kRows, 8>(pp, alpha, v_rows, head_offset, nc, head_size, o, 16 * c);
  }
  switch (vecs - c) {
#define PAGEDATTN_BF16_COLS(k)                                                            \
  case k:                                                                                 \
    accumulate_block<kRows, k>(pp, alpha, v_rows, head_offset, nc, head_size, o, 16 * c); \
    break;
    PAGEDATTN_BF16_COLS(1)
    PAGEDATTN_BF16_COLS(2)
    PAGEDATTN_BF16_COLS(3)
    PAGEDATTN_BF16_COLS(4)
    PAGEDATTN_BF16_COLS(5)
    PAGEDATTN_BF16_COLS(6)
    PAGEDATTN_BF16_COLS(7)
#undef PAGEDATTN_BF16_COLS
    default:
      break;
  }
}

// bf16 bits of the 128 non-negative codes of an fp8 format, as four tables of 32 lanes.
struct Fp8Table {
  __m512i t[4];
  explicit Fp8Table(bool e5m2) {
    alignas(64) uint16_t v[128];
    for (int c = 0; c < 128; ++c) {
      const float f = e5m2 ? fp8_e5m2_to_float(uint8_t(c)) : fp8_e4m3_to_float(uint8_t(c));
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      v[c] = uint16_t(bits >> 16);  // exact: bf16 holds every fp8 value (NaN stays NaN)
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(v + 32 * i);
  }
};

}  // namespace

void scores_few(const uint16_t* q, const uint16_t* const* k_rows, int64_t head_stride, int heads,
                int nc, int rows, int head_size, float scale, float* s) {
  switch (rows) {
#define PAGEDATTN_BF16_ROWS(k) \
  case k:                      \
    return scores_rows<k>(q, k_rows, head_stride, heads, nc, head_size, scale, s);
    PAGEDATTN_BF16_ROWS(1)
    PAGEDATTN_BF16_ROWS(2)
    PAGEDATTN_BF16_ROWS(3)
    PAGEDATTN_BF16_ROWS(4)
    PAGEDATTN_BF16_ROWS(5)
    PAGEDATTN_BF16_ROWS(6)
    PAGEDATTN_BF16_ROWS(7)
    PAGEDATTN_BF16_ROWS(8)
#undef PAGEDATTN_BF16_ROWS
    default:
      break;
  }
}

void accumulate_few(const float* p, const float* alpha, const uint16_t* const* v_rows,
                    int64_t head_offset, int nc, int rows, int head_size, float* o) {
  alignas(64) uint32_t pp[2 * kChunk / 2];
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    probs_to_pairs(p + r * kChunk, pp, 2);
    accumulate_rows<2>(pp, alpha + r, v_rows, head_offset, nc, head_size, o + r * head_size);
  }
  if (r < rows) {
    probs_to_pairs(p + r * kChunk, pp, 1);
    accumulate_rows<1>(pp, alpha + r, v_rows, head_offset, nc, head_size, o + r * head_size);
  }
}

void fp8_to_bf16(const uint8_t* src, uint16_t* dst, int64_t n, bool e5m2) {
  static const Fp8Table e4m3_table(false), e5m2_table(true);
  const Fp8Table& tab = e5m2 ? e5m2_table : e4m3_table;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i b =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i idx = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i lo = _mm512_permutex2var_epi16(tab.t[0], idx, tab.t[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab.t[2], idx, tab.t[3]);
    const __mmask32 upper = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40));
    __m512i v = _mm512_mask_blend_epi16(upper, lo, hi);
    v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
    _mm512_storeu_si512(dst + i, v);
  }
  for (; i < n; ++i) {
    const float f = e5m2 ? fp8_e5m2_to_float(src[i]) : fp8_e4m3_to_float(src[i]);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    dst[i] = uint16_t(bits >> 16);
  }
}

}  // namespace pagedattn::cpu::bf16

#else  // no AVX512-BF16 kernels in this build

namespace pagedattn::cpu::bf16 {
void scores_few(const uint16_t*, const uint16_t* const*, int64_t, int, int, int, int, float,
                float*) {}
void accumulate_few(const float*, const float*, const uint16_t* const*, int64_t, int, int, int,
                    float*) {}
void fp8_to_bf16(const uint8_t*, uint16_t*, int64_t, bool) {}
}  // namespace pagedattn::cpu::bf16

#endif
