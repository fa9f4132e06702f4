// Reference attention (spec section 4 and appendix A). Per request, per KV head: gather the
// keys and values, then for every query head of the group and every query token compute the
// masked, capped, biased softmax over them in float64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pagedattn/error.h"
#include "ref/ref_ops.h"

namespace pagedattn::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double at(const TensorView& v, int64_t i0, int64_t i1, int64_t i2) {
  return load_element(v.data, v.dtype, i0 * v.stride(0) + i1 * v.stride(1) + i2 * v.stride(2));
}
void store(const TensorView& v, int64_t i0, int64_t i1, int64_t i2, double x) {
  store_element(v.data, v.dtype, i0 * v.stride(0) + i1 * v.stride(1) + i2 * v.stride(2), x);
}
int64_t i32_at(const TensorView& v, int64_t i) {
  return static_cast<const int32_t*>(v.data)[i * v.stride(0)];
}

// Rounds to the activation dtype: where a fast kernel rounds P before the P*V product.
float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_float(float_to_bf16(x));
    case DType::kF16:
      return f16_to_float(float_to_f16(x));
    default:
      return x;
  }
}

// P rounded the way a fast kernel rounds it before the P*V product: to e4m3 when the query is
// quantised (the fp8 products take P in e4m3, unscaled: it lies in [0, 1]).
float round_p(const AttentionConfig& cfg, float p) {
  return cfg.query_quant ? fp8_e4m3_to_float(float_to_fp8_e4m3(p)) : round_to(cfg.dtype, p);
}

// Keeps the `bits` most significant bits of x's significand, dropping the rest (toward zero).
double truncate_significand(double x, int bits) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  const double m = std::frexp(x, &e);  // x = m * 2^e, |m| in [0.5, 1)
  return std::ldexp(std::trunc(std::ldexp(m, bits)), e - bits);
}

// query_quant (spec 1.6): q8 = saturate_e4m3(q * (1 / q_scale)) in float, dequantised exactly.
double quantised_query(double q, float q_scale) {
  const float q8 = fp8_e4m3_to_float(float_to_fp8_e4m3(float(q) * (1.0f / q_scale)));
  return double(q8) * double(q_scale);
}

// Keys and values of one KV head of one request, dequantised: [len][head_size] and
// [len][head_size_v].
struct HeadKV {
  int64_t len = 0;
  int head_size = 0, head_size_v = 0;
  std::vector<double> k, v;
  double key(int64_t j, int d) const { return k[size_t(j * head_size + d)]; }
  double val(int64_t j, int d) const { return v[size_t(j * head_size_v + d)]; }
};

// q.k the way fp8 tensor-core products accumulate it (query_quant): the e4m3 x e4m3 products
// are exact, but Hopper's fp8 MMA keeps only about 14 significant bits of the running sum
// (DeepSeek-V3 technical report, 3.3.2; Hopper's fp8 kernel errs that much: docs/testing.md).
// Modelled one bit coarser, as truncation to 13 bits after each k step of 32 products.
float fp8_mma_dot(const std::vector<double>& q, const HeadKV& kv, int64_t j) {
  constexpr int kStep = 32, kBits = 13;
  double acc = 0;
  for (int d0 = 0; d0 < kv.head_size; d0 += kStep) {
    double part = 0;
    for (int d = d0; d < std::min(d0 + kStep, kv.head_size); ++d)
      part += q[size_t(d)] * kv.key(j, d);
    acc = truncate_significand(acc + part, kBits);
  }
  return float(acc);
}

// Keys 0..len-1 of request r from the paged cache: logical position j lives in physical block
// block_table[r][j / block_size] at offset j % block_size. fp8 reads are stored * scale.
HeadKV gather_from_cache(const ForwardArgs& a, const AttentionConfig& cfg, int r, int kv_head,
                         int64_t len) {
  const KVCacheView& c = a.kv_cache;
  const TensorView& bt = a.metadata->block_table;
  const bool fp8 = is_fp8(cfg.kv_cache_dtype);
  const int kv_heads = cfg.num_kv_heads;
  const double ks = fp8 ? a.scales.k_scale_of(r, kv_head, kv_heads) : 1.0;
  const double vs = fp8 ? a.scales.v_scale_of(r, kv_head, kv_heads) : 1.0;
  const int bs = c.block_size(), dk = cfg.head_size, dv = cfg.head_size_v();
  HeadKV kv{len, dk, dv, {}, {}};
  kv.k.resize(size_t(len * dk));
  kv.v.resize(size_t(len * dv));
  for (int64_t j = 0; j < len; ++j) {
    const int64_t block =
        static_cast<const int32_t*>(bt.data)[r * bt.stride(0) + (j / bs) * bt.stride(1)];
    const TensorView kb = c.key.select(0, block), vb = c.value.select(0, block);
    for (int d = 0; d < dk; ++d) kv.k[size_t(j * dk + d)] = at(kb, j % bs, kv_head, d) * ks;
    for (int d = 0; d < dv; ++d) kv.v[size_t(j * dv + d)] = at(vb, j % bs, kv_head, d) * vs;
  }
  return kv;
}

// Encoder types: the request's own current tokens are its keys.
HeadKV gather_from_inputs(const ForwardArgs& a, const AttentionConfig& cfg, int64_t first_row,
                          int kv_head, int64_t len) {
  const int dk = cfg.head_size, dv = cfg.head_size_v();
  HeadKV kv{len, dk, dv, {}, {}};
  kv.k.resize(size_t(len * dk));
  kv.v.resize(size_t(len * dv));
  for (int64_t j = 0; j < len; ++j) {
    for (int d = 0; d < dk; ++d) kv.k[size_t(j * dk + d)] = at(a.key, first_row + j, kv_head, d);
    for (int d = 0; d < dv; ++d) kv.v[size_t(j * dv + d)] = at(a.value, first_row + j, kv_head, d);
  }
  return kv;
}

// Whether key position j is visible to a query at absolute position pos (spec 4.2, 4.3).
bool visible(const AttentionConfig& cfg, int64_t j, int64_t pos) {
  if (cfg.causal() && j > pos) return false;
  const int left = cfg.window_left(), right = cfg.window_right();
  if (left >= 0 && j < pos - left) return false;
  if (right >= 0 && j > pos + right) return false;
  return true;
}

// Scale, then soft cap, then ALiBi (spec 4.1). `dot` is q.k.
template <class T>
T logit_of(const AttentionConfig& cfg, T dot, int h, int64_t j, int64_t pos) {
  T x = T(cfg.scale) * dot;
  if (cfg.logits_soft_cap) {
    const T cap = T(*cfg.logits_soft_cap);
    x = cap * std::tanh(x / cap);
  }
  if (cfg.has_alibi()) x += T(cfg.alibi_slopes[size_t(h)]) * T(j - pos);
  return x;
}

struct RowResult {
  std::vector<double> out;
  double lse;
};

// One query row (head h, absolute position pos) against one head's keys, in float64.
RowResult attend_exact(const AttentionConfig& cfg, const std::vector<double>& q, const HeadKV& kv,
                       int h, int64_t pos) {
  std::vector<double> logits(size_t(kv.len), kNegInf);
  double m = cfg.has_sinks() ? double(cfg.sinks[size_t(h)]) : kNegInf;
  for (int64_t j = 0; j < kv.len; ++j) {
    if (!visible(cfg, j, pos)) continue;
    double dot = 0;
    for (int d = 0; d < cfg.head_size; ++d) dot += q[size_t(d)] * kv.key(j, d);
    logits[size_t(j)] = logit_of<double>(cfg, dot, h, j, pos);
    m = std::max(m, logits[size_t(j)]);
  }
  RowResult res{std::vector<double>(size_t(kv.head_size_v), 0.0), kNegInf};
  if (m == kNegInf) return res;  // nothing visible and no sink: zeros, lse = -inf (spec 4.8)
  double den = cfg.has_sinks() ? std::exp(double(cfg.sinks[size_t(h)]) - m) : 0.0;
  for (int64_t j = 0; j < kv.len; ++j) {
    if (logits[size_t(j)] == kNegInf) continue;
    const double p = std::exp(logits[size_t(j)] - m);
    den += p;
    for (int d = 0; d < kv.head_size_v; ++d) res.out[size_t(d)] += p * kv.val(j, d);
  }
  for (double& o : res.out) o /= den;
  res.lse = m + std::log(den);
  return res;
}

// The same row the way a fast kernel computes it: float32 dot products, exponentials and sums;
// probabilities rounded to the activation dtype before they multiply V.
RowResult attend_low_precision(const AttentionConfig& cfg, const std::vector<double>& q,
                               const HeadKV& kv, int h, int64_t pos) {
  constexpr float kNegInfF = -std::numeric_limits<float>::infinity();
  std::vector<float> logits(size_t(kv.len), kNegInfF);
  float m = cfg.has_sinks() ? cfg.sinks[size_t(h)] : kNegInfF;
  for (int64_t j = 0; j < kv.len; ++j) {
    if (!visible(cfg, j, pos)) continue;
    float dot = 0;
    if (cfg.query_quant) {
      dot = fp8_mma_dot(q, kv, j);
    } else {
      for (int d = 0; d < cfg.head_size; ++d) dot += float(q[size_t(d)]) * float(kv.key(j, d));
    }
    logits[size_t(j)] = logit_of<float>(cfg, dot, h, j, pos);
    m = std::max(m, logits[size_t(j)]);
  }
  RowResult res{std::vector<double>(size_t(kv.head_size_v), 0.0), kNegInf};
  if (m == kNegInfF) return res;
  float den = cfg.has_sinks() ? std::exp(cfg.sinks[size_t(h)] - m) : 0.0f;
  std::vector<float> acc(size_t(kv.head_size_v), 0.0f);
  for (int64_t j = 0; j < kv.len; ++j) {
    if (logits[size_t(j)] == kNegInfF) continue;
    const float p = std::exp(logits[size_t(j)] - m);
    den += p;
    const float p_low = round_p(cfg, p);
    for (int d = 0; d < kv.head_size_v; ++d) acc[size_t(d)] += p_low * float(kv.val(j, d));
  }
  for (int d = 0; d < kv.head_size_v; ++d) res.out[size_t(d)] = acc[size_t(d)] / den;
  res.lse = double(m) + double(std::log(den));
  return res;
}

}  // namespace

void attention(const AttentionConfig& cfg, const ForwardArgs& a, Precision precision) {
  const AttentionMetadata& md = *a.metadata;
  const bool from_cache = uses_kv_cache(cfg.attn_type);
  const int group = cfg.num_queries_per_kv();
  std::vector<double> q(size_t(cfg.head_size));
  for (int r = 0; r < md.num_seqs; ++r) {
    const int64_t q_begin = i32_at(md.query_start_loc_cpu, r);
    const int64_t q_len = i32_at(md.query_start_loc_cpu, r + 1) - q_begin;
    if (q_len == 0) continue;
    const int64_t seq_len = from_cache ? i32_at(md.seq_lens_cpu, r) : q_len;
    const int64_t context_len = seq_len - q_len;
    for (int kv_head = 0; kv_head < cfg.num_kv_heads; ++kv_head) {
      const HeadKV kv = from_cache ? gather_from_cache(a, cfg, r, kv_head, seq_len)
                                   : gather_from_inputs(a, cfg, q_begin, kv_head, seq_len);
      const float q_scale = a.scales.q_scale_of(r, kv_head, cfg.num_kv_heads);
      for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        for (int64_t i = 0; i < q_len; ++i) {
          const int64_t t = q_begin + i;
          for (int d = 0; d < cfg.head_size; ++d) {
            q[size_t(d)] = cfg.query_quant ? quantised_query(at(a.query, t, h, d), q_scale)
                                           : at(a.query, t, h, d);
          }
          const RowResult row = precision == Precision::kFloat64
                                    ? attend_exact(cfg, q, kv, h, context_len + i)
                                    : attend_low_precision(cfg, q, kv, h, context_len + i);
          const int out_cols = int(a.output.size(2));  // head_size_v or a leading part of it
          for (int d = 0; d < out_cols; ++d) store(a.output, t, h, d, row.out[size_t(d)]);
          if (a.lse.defined()) {
            store_element(a.lse.data, a.lse.dtype, h * a.lse.stride(0) + t * a.lse.stride(1),
                          row.lse);
          }
        }
      }
    }
  }
}

}  // namespace pagedattn::ref
