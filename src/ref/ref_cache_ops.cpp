// Reference cache write, state merge and amax.
#include <array>
#include <cmath>
#include <limits>

#include "pagedattn/error.h"
#include "ref/ref_ops.h"

namespace pagedattn::ref {

void write_kv(const AttentionConfig& config, const WriteKVArgs& a) {
  const KVCacheView& c = a.kv_cache;
  const bool fp8 = is_fp8(config.kv_cache_dtype);
  const int bs = c.block_size();
  const int64_t num_slots = a.slot_mapping.size(0);
  // Inputs are f32/f16/bf16, exact in float; fp8 stores saturate(x / scale) computed in float,
  // as the CUDA kernels do. K and V rows may differ in size (v_head_size).
  auto write = [&](const TensorView& in, const TensorView& cache, float scale, int64_t t,
                   int64_t block, int64_t offset, int h) {
    for (int64_t d = 0; d < cache.size(3); ++d) {
      float x = float(
          load_element(in.data, in.dtype, t * in.stride(0) + h * in.stride(1) + d * in.stride(2)));
      if (fp8) x /= scale;
      store_element(cache.data, cache.dtype,
                    block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2) +
                        d * cache.stride(3),
                    x);
    }
  };
  for (int64_t t = 0; t < num_slots; ++t) {
    const int64_t slot =
        static_cast<const int64_t*>(a.slot_mapping.data)[t * a.slot_mapping.stride(0)];
    if (slot < 0) continue;  // padded token
    const int64_t block = slot / bs, offset = slot % bs;
    for (int h = 0; h < c.num_kv_heads(); ++h) {
      write(a.key, c.key, a.scales.k_scale_of(0, h, c.num_kv_heads()), t, block, offset, h);
      write(a.value, c.value, a.scales.v_scale_of(0, h, c.num_kv_heads()), t, block, offset, h);
    }
  }
}

void merge_states(const MergeArgs& a) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const int64_t num_tokens = a.output.size(0), num_heads = a.output.size(1);
  const int64_t head_size = a.output.size(2);
  auto lse_at = [](const TensorView& v, int64_t h, int64_t t) {
    return load_element(v.data, v.dtype, h * v.stride(0) + t * v.stride(1));
  };
  auto elem = [](const TensorView& v, int64_t t, int64_t h, int64_t d) {
    return t * v.stride(0) + h * v.stride(1) + d * v.stride(2);
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      double p = lse_at(a.prefix_lse, h, t), s = lse_at(a.suffix_lse, h, t);
      if (std::isinf(p)) p = kNegInf;  // FA2 reports +inf for empty rows: both mean "no keys"
      if (std::isinf(s)) s = kNegInf;
      const double mx = std::max(p, s);
      double wp = 1.0, ws = 0.0, out_lse = kNegInf;
      if (mx != kNegInf) {
        wp = std::exp(p - mx);
        ws = std::exp(s - mx);
        out_lse = std::log(wp + ws) + mx;
        const double total = wp + ws;
        wp /= total;
        ws /= total;
      }
      for (int64_t d = 0; d < head_size; ++d) {
        // A side with weight 0 is never read: its output may be garbage for an empty row.
        const double po = wp == 0.0 ? 0.0
                                    : load_element(a.prefix_output.data, a.prefix_output.dtype,
                                                   elem(a.prefix_output, t, h, d));
        const double so = ws == 0.0 ? 0.0
                                    : load_element(a.suffix_output.data, a.suffix_output.dtype,
                                                   elem(a.suffix_output, t, h, d));
        store_element(a.output.data, a.output.dtype, elem(a.output, t, h, d), po * wp + so * ws);
      }
      if (a.output_lse.defined()) {
        store_element(a.output_lse.data, a.output_lse.dtype,
                      h * a.output_lse.stride(0) + t * a.output_lse.stride(1), out_lse);
      }
    }
  }
}

float amax(const TensorView& x) {
  detail::require(x.device.is_cpu(), "amax: ", describe(x), " is not on the CPU");
  double m = 0.0;
  const int nd = x.ndim;
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t k = 0, n = x.numel(); k < n; ++k) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[size_t(d)] * x.stride(d);
    const double v = std::fabs(load_element(x.data, x.dtype, off));
    if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, v);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < x.size(d)) break;
      idx[size_t(d)] = 0;
    }
  }
  return float(m);
}

}  // namespace pagedattn::ref
