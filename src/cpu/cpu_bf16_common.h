// Pieces shared by the AVX512-BF16 kernel files (cpu_bf16_dot.cpp, cpu_bf16_decode.cpp). Only
// those files include this header: they are compiled with the same AVX-512 flags, and every
// function here is static, so no copy of it can reach code built for other CPUs.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/cpu_bf16_dot.h"

namespace pagedattn::cpu::bf16 {

/// Rows of probabilities [rows][kChunk] as bf16 pairs along the keys, rounded to nearest even:
/// out[r * kChunk / 2 + i] = (p[r][2 i], p[r][2 i + 1]).
static inline void probs_to_pairs(const float* p, uint32_t* out, int rows) {
  for (int r = 0; r < rows; ++r) {
    for (int n = 0; n < kChunk; n += 32) {
      // cvtne2ps packs (b, a) as [a0..a15 | b0..b15]: keys n..n+31 in order, so consecutive
      // lanes form the (even, odd) pairs.
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + r * kChunk + n + 16),
                                             _mm512_loadu_ps(p + r * kChunk + n));
      _mm512_storeu_si512(out + r * (kChunk / 2) + n / 2, (__m512i)v);
    }
  }
}

/// Word-interleave indices of two 32-lane rows: low (a0 b0 ... a15 b15) and high halves.
static inline __m512i interleave_lo_index() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}
static inline __m512i interleave_hi_index() {
  return _mm512_add_epi16(interleave_lo_index(), _mm512_set1_epi16(16));
}

}  // namespace pagedattn::cpu::bf16
