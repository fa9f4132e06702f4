// AVX512-BF16 tile kernels (see cpu_bf16_dot.h). This file is compiled with the AVX-512 BF16
// flags; nothing in it runs unless available() said the CPU has them.
#include "cpu/cpu_bf16_dot.h"

// Everything in this file is compiled with AVX-512 flags: it must not instantiate templates or
// inline functions from headers, whose out-of-line copies the linker could pick for callers
// on CPUs without AVX-512. Only intrinsics and local code.

#if defined(__x86_64__) && defined(PAGEDATTN_CPU_BF16_KERNELS)
#include <immintrin.h>

#include <cstring>

#include "cpu/cpu_bf16_common.h"

namespace pagedattn::cpu::bf16 {

bool available() {
  static const bool ok = __builtin_cpu_supports("avx512bf16") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
  return ok;
}

void pack_keys(const uint16_t* const* rows, int nc, int head_size, uint32_t* kp) {
  const int pairs = head_size / 2;
  for (int n = 0; n < nc; ++n) {
    const auto* r = reinterpret_cast<const uint32_t*>(rows[n]);
    for (int d2 = 0; d2 < pairs; ++d2) kp[d2 * kChunk + n] = r[d2];
  }
  for (int n = nc; n < kChunk; ++n)
    for (int d2 = 0; d2 < pairs; ++d2) kp[d2 * kChunk + n] = 0;
}

void pack_values(const uint16_t* const* rows, int nc, int head_size, uint32_t* vp) {
  const __m512i lo_idx = interleave_lo_index();
  const __m512i hi_idx = interleave_hi_index();
  for (int n = 0; n < nc; n += 2) {
    const uint16_t* a = rows[n];
    const uint16_t* b = n + 1 < nc ? rows[n + 1] : nullptr;
    uint32_t* out = vp + (n / 2) * head_size;
    for (int d = 0; d < head_size; d += 32) {
      // Head sizes that are a multiple of 16 but not of 32 (80, 112) end with a half vector:
      // masked loads, and only the low half stored.
      const int w = head_size - d;
      const __mmask32 m = w >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << w) - 1);
      const __m512i va = _mm512_maskz_loadu_epi16(m, a + d);
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(va, lo_idx, vb));
      if (w > 16) _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
}

namespace {

template <int kRows>
inline void scores_tile(const uint16_t* q, const uint32_t* kp, float* s, int head_size,
                        float scale) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int pairs = head_size / 2;
  for (int d2 = 0; d2 < pairs; ++d2) {
    const uint32_t* kd = kp + d2 * kChunk;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kd + 16);
    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kd + 32);
    const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
    for (int r = 0; r < kRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * head_size + 2 * d2, 4);
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qv, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qv, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(s + r * kChunk + c * 16, _mm512_mul_ps(acc[r][c], sc));
}

template <int kRows, int kCols>
inline void accumulate_tile(const uint32_t* pp, const float* alpha, const uint32_t* vp, float* o,
                            int pairs, int head_size, int c0) {
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < kCols; ++c) {
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * head_size + c0 + c * 16), a);
    }
  }
  for (int n2 = 0; n2 < pairs; ++n2) {
    const uint32_t* vn = vp + n2 * head_size + c0;
    __m512bh v[kCols];
    for (int c = 0; c < kCols; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vn + c * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pp[r * (kChunk / 2) + n2]));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, v[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(o + r * head_size + c0 + c * 16, acc[r][c]);
}

template <int kRows>
inline void accumulate_rows(const uint32_t* pp, const float* alpha, const uint32_t* vp, float* o,
                            int pairs, int head_size) {
  const int vecs = head_size / 16;
  int c = 0;
  for (; c + 4 <= vecs; c += 4)
    accumulate_tile<kRows, 4>(pp, alpha, vp, o, pairs, head_size, c * 16);
  switch (vecs - c) {
    case 3:
      accumulate_tile<kRows, 3>(pp, alpha, vp, o, pairs, head_size, c * 16);
      break;
    case 2:
      accumulate_tile<kRows, 2>(pp, alpha, vp, o, pairs, head_size, c * 16);
      break;
    case 1:
      accumulate_tile<kRows, 1>(pp, alpha, vp, o, pairs, head_size, c * 16);
      break;
    default:
      break;
  }
}

}  // namespace

void scores(const uint16_t* q, const uint32_t* kp, float* s, int rows, int head_size, float scale) {
  int r = 0;
  for (; r + 6 <= rows; r += 6)
    scores_tile<6>(q + r * head_size, kp, s + r * kChunk, head_size, scale);
  for (; r + 2 <= rows; r += 2)
    scores_tile<2>(q + r * head_size, kp, s + r * kChunk, head_size, scale);
  if (r < rows) scores_tile<1>(q + r * head_size, kp, s + r * kChunk, head_size, scale);
}

void accumulate(const float* p, const float* alpha, const uint32_t* vp, float* o, int rows, int nc,
                int head_size) {
  alignas(64) uint32_t pp[6 * kChunk / 2];
  const int pairs = (nc + 1) / 2;
  int r = 0;
  for (; r + 6 <= rows; r += 6) {
    probs_to_pairs(p + r * kChunk, pp, 6);
    accumulate_rows<6>(pp, alpha + r, vp, o + r * head_size, pairs, head_size);
  }
  for (; r < rows; ++r) {
    probs_to_pairs(p + r * kChunk, pp, 1);
    accumulate_rows<1>(pp, alpha + r, vp, o + r * head_size, pairs, head_size);
  }
}

}  // namespace pagedattn::cpu::bf16

#else  // no AVX512-BF16 kernels in this build

namespace pagedattn::cpu::bf16 {
bool available() {
  return false;
}
void pack_keys(const uint16_t* const*, int, int, uint32_t*) {}
void pack_values(const uint16_t* const*, int, int, uint32_t*) {}
void scores(const uint16_t*, const uint32_t*, float*, int, int, float) {}
void accumulate(const float*, const float*, const uint32_t*, float*, int, int, int) {}
}  // namespace pagedattn::cpu::bf16

#endif
