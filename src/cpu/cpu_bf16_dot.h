// Prefill tiles on x86 CPUs with AVX512-BF16: the two matrix products of attention as bf16
// pair dot products (vdpbf16ps: 32 multiply-adds per instruction, twice the float FMA rate),
// accumulating in float. Used for bf16 queries with bf16 or fp8 caches, whose values bf16
// holds exactly; probabilities are rounded to bf16 (nearest even) before they multiply V, as
// the low-precision reference does.
#pragma once

#include <cstdint>

namespace pagedattn::cpu::bf16 {

/// Keys per chunk (kChunk of cpu_kernels.cpp).
inline constexpr int kChunk = 64;

/// True when this build has the kernels and the CPU runs them.
bool available();
/// available() and not switched off by set_enabled(false) (tests compare both paths).
bool enabled();
void set_enabled(bool on);

/// Packs bf16 key rows (rows[n] -> head_size values, n < nc) as pairs along the head dimension,
/// transposed: kp[d2 * kChunk + n] = (k[n][2 d2], k[n][2 d2 + 1]). Keys past nc are zero.
void pack_keys(const uint16_t* const* rows, int nc, int head_size, uint32_t* kp);

/// Packs bf16 value rows as pairs along the keys: vp[n2 * head_size + d] = (v[2 n2][d],
/// v[2 n2 + 1][d]). A missing odd key is zero.
void pack_values(const uint16_t* const* rows, int nc, int head_size, uint32_t* vp);

/// s[r][n] = scale * sum_d q[r][d] k[n][d] for `rows` rows; q is bf16 [rows][head_size] (seen
/// as pairs), s is [rows][kChunk].
void scores(const uint16_t* q, const uint32_t* kp, float* s, int rows, int head_size, float scale);

/// o[r][:] = o[r][:] * alpha[r] + sum_n bf16(p[r][n]) v[n][:] for `rows` rows; p is float
/// [rows][kChunk] (keys past nc must be zero), o is float [rows][head_size].
void accumulate(const float* p, const float* alpha, const uint32_t* vp, float* o, int rows, int nc,
                int head_size);

// Decode (a few query rows per KV head), straight from bf16 cache rows: no packing.

/// s[hl * rows + r][n] = scale * q[hl * rows + r] . k(n, hl) for KV heads hl < heads and rows
/// r < rows (<= 8), keys n < nc; k(n, hl) = k_rows[n] + hl * head_stride (bf16 values).
/// q is bf16 [heads * rows][head_size]; s is [heads * rows][kChunk].
void scores_few(const uint16_t* q, const uint16_t* const* k_rows, int64_t head_stride, int heads,
                int nc, int rows, int head_size, float scale, float* s);

/// o[r][:] = o[r][:] * alpha[r] + sum_n bf16(p[r][n]) v(n)[:] for r < rows, n < nc, with
/// v(n) = v_rows[n] + head_offset (bf16 values); p is [rows][kChunk], o [rows][head_size].
void accumulate_few(const float* p, const float* alpha, const uint16_t* const* v_rows,
                    int64_t head_offset, int nc, int rows, int head_size, float* o);

/// Exact fp8 (e4m3fn, or e5m2) -> bf16 of n values, infinities and NaN included (bf16 holds
/// every fp8 value).
void fp8_to_bf16(const uint8_t* src, uint16_t* dst, int64_t n, bool e5m2);

}  // namespace pagedattn::cpu::bf16
