// Backend defaults and the argument checks that run before any backend sees a call.
#include "pagedattn/backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::fail;
using detail::require;

std::unique_ptr<Plan> Backend::plan(const AttentionMetadata&, const AttentionConfig&) const {
  return std::make_unique<Plan>();
}

std::vector<BackendOptionInfo> Backend::options() const {
  return {};
}

std::unique_ptr<Backend> Backend::configured(const std::vector<std::string>& settings) const {
  fail("backend '", name(), "' has no options; got '", settings.empty() ? "" : settings.front(),
       "'");
}

std::string Backend::device_info(Device) const {
  return {};
}

void Backend::merge_states(const MergeArgs&) const {
  fail<NotSupported>("backend '", name(), "' does not implement merge_states");
}

void Backend::merge_ranks(const MergeRanksArgs& a) const {
  check_merge_ranks_args(a);
  if (!a.output.device.is_cpu()) {
    fail<NotSupported>("backend '", name(), "' merges ranks on the host only; output is on ",
                       to_string(a.output.device));
  }
  const TensorView &po = a.partial_outputs, &pl = a.partial_lses, &o = a.output;
  const int64_t ranks = po.size(0), n = o.size(0), heads = o.size(1), d = o.size(2);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(size_t(d), 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      // The running merge starts as "no keys" (LSE -inf, output 0); merging rank 0 into it
      // gives rank 0 exactly (weights 0 and 1), so every rank takes the same steps.
      float lse = kNegInf;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < ranks; ++r) {
        float l = float(load_element(pl.data, pl.dtype,
                                     r * pl.stride(0) + h * pl.stride(1) + t * pl.stride(2)));
        if (std::isinf(l)) l = kNegInf;  // +inf (FA2's empty rows) also means "no keys"
        const float m = std::max(lse, l);
        if (m == kNegInf) continue;
        float wp = std::exp(lse - m), ws = std::exp(l - m);
        const float sum = wp + ws;
        lse = std::log(sum) + m;
        wp /= sum;
        ws /= sum;
        const int64_t base = r * po.stride(0) + t * po.stride(1) + h * po.stride(2);
        for (int64_t i = 0; i < d; ++i) {
          // A side of weight 0 is never read: its rows may be garbage for an empty partial.
          const float s = ws == 0.0f ? 0.0f : float(load_element(po.data, po.dtype, base + i));
          acc[size_t(i)] = (wp == 0.0f ? 0.0f : acc[size_t(i)] * wp) + s * ws;
        }
      }
      const int64_t out_base = t * o.stride(0) + h * o.stride(1);
      for (int64_t i = 0; i < d; ++i) store_element(o.data, o.dtype, out_base + i, acc[size_t(i)]);
      if (a.output_lse.defined()) {
        store_element(a.output_lse.data, a.output_lse.dtype,
                      h * a.output_lse.stride(0) + t * a.output_lse.stride(1), lse);
      }
    }
  }
}

float Backend::amax(const TensorView& x) const {
  fail<NotSupported>("backend '", name(), "' cannot compute amax of ", describe(x));
}

namespace {

// Requires `v` to be [dims...] (-1 = any) of `dtype` on `device`, with a contiguous last dim.
void require_tensor(const TensorView& v, std::string_view name, std::initializer_list<int64_t> dims,
                    DType dtype, Device device, std::string_view dims_text) {
  require(v.defined(), name, " is required");
  bool ok = v.ndim == int(dims.size());
  int d = 0;
  for (int64_t want : dims) {
    if (ok && want >= 0 && v.size(d) != want) ok = false;
    ++d;
  }
  require(ok, name, " must be ", dims_text, "; got ", describe(v));
  require(v.dtype == dtype, name, " must be ", dtype_name(dtype), "; got ", describe(v));
  require(v.device == device, name, " is on ", to_string(v.device), "; expected ",
          to_string(device));
  require(v.numel() == 0 || v.stride(v.ndim - 1) == 1, name,
          " must be contiguous in its last dimension; its stride there is ", v.stride(v.ndim - 1));
}

void require_cache(const AttentionConfig& cfg, const KVCacheView& c, Device device) {
  const DType dtype = cfg.cache_dtype();
  require(c.key.defined() && c.value.defined(), "kv_cache is required for ",
          to_string(cfg.attn_type), " attention");
  for (const auto& [view, name, size, size_name] :
       {std::tuple{c.key, "kv_cache.key", cfg.head_size, "head_size"},
        {c.value, "kv_cache.value", cfg.head_size_v(),
         cfg.head_size_v() == cfg.head_size ? "head_size" : "v_head_size"}}) {
    const std::string dims =
        detail::cat("[num_blocks, block_size=", cfg.block_size, ", num_kv_heads=", cfg.num_kv_heads,
                    ", ", size_name, "=", size, "]");
    require_tensor(view, name, {-1, cfg.block_size, cfg.num_kv_heads, size}, dtype, device, dims);
  }
  require(c.key.size(0) == c.value.size(0), "kv_cache.key has ", c.key.size(0),
          " blocks but kv_cache.value has ", c.value.size(0));
  // A cache of zero blocks is legal (every request then has seq_len 0: validate_metadata refuses
  // any block id >= num_blocks).
}

}  // namespace

namespace {

// A scale vector of KVScales: empty, [num_kv_heads] or (attention: num_seqs >= 0)
// [num_seqs * num_kv_heads]; with `positive`, every value finite and > 0.
void require_scales(const std::vector<float>& v, const char* name, int num_kv_heads, int num_seqs,
                    bool positive) {
  if (v.empty()) return;
  const size_t per_head = size_t(num_kv_heads);
  const size_t per_seq = num_seqs >= 0 ? size_t(num_seqs) * per_head : per_head;
  if (v.size() != per_head && v.size() != per_seq) {
    if (num_seqs < 0) {
      fail("scales.", name, " has ", v.size(), " values; write_kv takes none (per tensor) or ",
           "num_kv_heads (", num_kv_heads, ")");
    }
    fail("scales.", name, " has ", v.size(), " values; expected none (per tensor), num_kv_heads (",
         num_kv_heads, ") or num_seqs * num_kv_heads (", num_seqs, " * ", num_kv_heads, " = ",
         per_seq, ")");
  }
  if (!positive) return;
  for (size_t i = 0; i < v.size(); ++i) {
    require(std::isfinite(v[i]) && v[i] > 0.0f, "scales.", name, "[", i, "] (", v[i],
            ") must be finite and > 0");
  }
}

// New keys [num_tokens, num_kv_heads, head_size] and values [..., v_head_size].
void require_kv_inputs(const AttentionConfig& cfg, const TensorView& key, const TensorView& value,
                       Device device) {
  const int dv = cfg.head_size_v();
  require_tensor(key, "key", {-1, cfg.num_kv_heads, cfg.head_size}, cfg.dtype, device,
                 detail::cat("[num_tokens, num_kv_heads=", cfg.num_kv_heads,
                             ", head_size=", cfg.head_size, "]"));
  require_tensor(value, "value", {-1, cfg.num_kv_heads, dv}, cfg.dtype, device,
                 detail::cat("[num_tokens, num_kv_heads=", cfg.num_kv_heads, ", ",
                             dv == cfg.head_size ? "head_size" : "v_head_size", "=", dv, "]"));
}

}  // namespace

void check_forward_args(const AttentionConfig& cfg, const ForwardArgs& a, bool check_metadata) {
  require(a.metadata != nullptr, "metadata is required (a profiling step never reaches a backend)");
  const AttentionMetadata& md = *a.metadata;
  const Device device = a.query.device;
  const std::string q_dims =
      detail::cat("[num_tokens, num_heads=", cfg.num_heads, ", head_size=", cfg.head_size, "]");
  require_tensor(a.query, "query", {-1, cfg.num_heads, cfg.head_size}, cfg.dtype, device, q_dims);
  const int64_t num_tokens = a.query.size(0);
  require(md.num_actual_tokens <= num_tokens, "metadata.num_actual_tokens (", md.num_actual_tokens,
          ") exceeds the query's ", num_tokens, " rows");
  require(a.output.defined(), "output is required");
  const int dv = cfg.head_size_v();
  const char* dv_name = dv == cfg.head_size ? "head_size" : "v_head_size";
  require(a.output.ndim == 3 && a.output.size(0) >= md.num_actual_tokens &&
              a.output.size(1) == cfg.num_heads && a.output.size(2) >= 1 && a.output.size(2) <= dv,
          "output must be [>= num_actual_tokens (", md.num_actual_tokens,
          "), num_heads=", cfg.num_heads, ", ", dv_name, "=", dv, " (or 1..", dv_name,
          " leading columns of P V)]; got ", describe(a.output));
  require(is_floating(a.output.dtype) && !is_fp8(a.output.dtype),
          "output must be a float type; got ", describe(a.output));
  require(a.output.device == device, "output is on ", to_string(a.output.device), "; expected ",
          to_string(device));
  require(a.output.stride(2) == 1, "output must be contiguous in its last dimension");
  if (a.lse.defined()) {
    require(
        a.lse.ndim == 2 && a.lse.size(0) == cfg.num_heads && a.lse.size(1) >= md.num_actual_tokens,
        "lse must be [num_heads=", cfg.num_heads, ", >= num_actual_tokens (", md.num_actual_tokens,
        ")]; got ", describe(a.lse));
    require(a.lse.dtype == DType::kF32 || a.lse.dtype == DType::kF64, "lse must be float32; got ",
            describe(a.lse));
    require(a.lse.device == device, "lse is on ", to_string(a.lse.device), "; expected ",
            to_string(device));
  }
  if (cfg.query_quant) {
    require(std::isfinite(a.scales.q_scale) && a.scales.q_scale > 0.0f, "scales.q_scale (",
            a.scales.q_scale, ") must be finite and > 0: query_quant divides the query by it");
  }
  const bool fp8 = is_fp8(cfg.kv_cache_dtype);
  require_scales(a.scales.k_scales, "k_scales", cfg.num_kv_heads, md.num_seqs, fp8);
  require_scales(a.scales.v_scales, "v_scales", cfg.num_kv_heads, md.num_seqs, fp8);
  require_scales(a.scales.q_scales, "q_scales", cfg.num_kv_heads, md.num_seqs, cfg.query_quant);
  CacheGeometry geometry;
  if (uses_kv_cache(cfg.attn_type)) {
    require_cache(cfg, a.kv_cache, device);
    geometry = {a.kv_cache.num_blocks(), a.kv_cache.block_size()};
  } else {
    require_kv_inputs(cfg, a.key, a.value, device);
    require(a.key.size(0) >= md.num_actual_tokens && a.value.size(0) >= md.num_actual_tokens,
            "key and value need num_actual_tokens (", md.num_actual_tokens, ") rows for ",
            to_string(cfg.attn_type), " attention; got ", a.key.size(0), " and ", a.value.size(0));
  }
  if (check_metadata) validate_metadata(md, cfg.attn_type, geometry);
}

void check_write_kv_args(const AttentionConfig& cfg, const WriteKVArgs& a, bool check_slots) {
  require(uses_kv_cache(cfg.attn_type), to_string(cfg.attn_type),
          " attention has no KV cache to write");
  const Device device = a.kv_cache.key.device;
  require_cache(cfg, a.kv_cache, device);
  require_kv_inputs(cfg, a.key, a.value, device);
  require_tensor(a.slot_mapping, "slot_mapping", {-1}, DType::kI64, device, "[num_slots]");
  const int64_t num_slots = a.slot_mapping.size(0);
  require(a.key.size(0) >= num_slots && a.value.size(0) >= num_slots, "key and value have ",
          a.key.size(0), " and ", a.value.size(0), " rows; slot_mapping writes ", num_slots);
  if (is_fp8(cfg.kv_cache_dtype)) {
    for (const auto& [s, name] :
         {std::pair{a.scales.k_scale, "k_scale"}, {a.scales.v_scale, "v_scale"}}) {
      require(std::isfinite(s) && s > 0.0f, name, " (", s, ") must be finite and > 0");
    }
  }
  const bool fp8 = is_fp8(cfg.kv_cache_dtype);
  require_scales(a.scales.k_scales, "k_scales", cfg.num_kv_heads, -1, fp8);
  require_scales(a.scales.v_scales, "v_scales", cfg.num_kv_heads, -1, fp8);
  require(a.scales.q_scales.empty(), "scales.q_scales has ", a.scales.q_scales.size(),
          " values; write_kv takes no query scales");
  if (!check_slots || !a.slot_mapping.device.is_cpu()) return;  // device slots: see checked mode
  const int64_t capacity = a.kv_cache.num_blocks() * a.kv_cache.block_size();
  for (int64_t t = 0; t < num_slots; ++t) {
    const int64_t slot =
        static_cast<const int64_t*>(a.slot_mapping.data)[t * a.slot_mapping.stride(0)];
    require(slot == -1 || (slot >= 0 && slot < capacity), "slot_mapping[", t, "] (", slot,
            ") is outside the cache's slots [0, ", capacity, ") and not -1");
  }
}

void check_merge_args(const MergeArgs& a) {
  const TensorView& o = a.output;
  require(o.defined() && o.ndim == 3, "output must be [num_tokens, num_heads, head_size]; got ",
          describe(o));
  const int64_t n = o.size(0), h = o.size(1), d = o.size(2);
  for (const auto& [v, name] :
       {std::pair{a.prefix_output, "prefix_output"}, {a.suffix_output, "suffix_output"}}) {
    require(v.defined() && v.ndim == 3 && v.size(0) == n && v.size(1) == h && v.size(2) == d, name,
            " must match output ", shape_string(o), "; got ", describe(v));
    require(v.dtype == o.dtype, name, " is ", dtype_name(v.dtype), "; output is ",
            dtype_name(o.dtype));
    require(v.device == o.device, name, " is on ", to_string(v.device), "; output on ",
            to_string(o.device));
  }
  for (const auto& [v, name] : {std::pair{a.prefix_lse, "prefix_lse"},
                                {a.suffix_lse, "suffix_lse"},
                                {a.output_lse, "output_lse"}}) {
    if (!v.defined() && std::string_view(name) == "output_lse") continue;
    require(v.defined() && v.ndim == 2 && v.size(0) == h && v.size(1) >= n, name,
            " must be float32 [num_heads=", h, ", num_tokens=", n, "]; got ", describe(v));
    require(v.dtype == DType::kF32 || v.dtype == DType::kF64, name, " must be float32; got ",
            describe(v));
    require(v.device == o.device, name, " is on ", to_string(v.device), "; output on ",
            to_string(o.device));
  }
}

namespace {

bool is_merge_dtype(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

}  // namespace

void check_merge_ranks_args(const MergeRanksArgs& a) {
  const TensorView &o = a.output, &po = a.partial_outputs, &pl = a.partial_lses;
  if (!o.defined() || o.ndim != 3 || !is_merge_dtype(o.dtype)) {
    fail(
        "merge_ranks: output must be float32/float16/bfloat16 [num_tokens, num_heads, "
        "head_size]; got ",
        describe(o));
  }
  const int64_t n = o.size(0), h = o.size(1), d = o.size(2);
  if (!po.defined() || po.ndim != 4 || po.size(0) < 1 || po.size(1) != n || po.size(2) != h ||
      po.size(3) != d || !is_merge_dtype(po.dtype)) {
    fail("merge_ranks: partial_outputs must be float32/float16/bfloat16 [num_ranks >= 1, ", n, ", ",
         h, ", ", d, "] (the output's num_tokens, num_heads, head_size); got ", describe(po));
  }
  const int64_t ranks = po.size(0);
  if (!pl.defined() || pl.ndim != 3 || pl.dtype != DType::kF32 || pl.size(0) != ranks ||
      pl.size(1) != h || pl.size(2) < n) {
    fail("merge_ranks: partial_lses must be float32 [num_ranks=", ranks, ", num_heads=", h,
         ", num_tokens >= ", n, "]; got ", describe(pl));
  }
  const TensorView& ol = a.output_lse;
  if (ol.defined() &&
      (ol.ndim != 2 || ol.dtype != DType::kF32 || ol.size(0) != h || ol.size(1) < n)) {
    fail("merge_ranks: output_lse must be float32 [num_heads=", h, ", num_tokens >= ", n, "]; got ",
         describe(ol));
  }
  if ((o.numel() > 0 && o.stride(2) != 1) || (po.numel() > 0 && po.stride(3) != 1)) {
    fail("merge_ranks: output and partial_outputs must be contiguous in head_size; strides ",
         o.numel() > 0 ? o.stride(2) : 1, " and ", po.numel() > 0 ? po.stride(3) : 1);
  }
  for (const TensorView* v : {&po, &pl, &ol}) {
    if (v->defined() && v->device != o.device) {
      fail("merge_ranks: ",
           v == &po   ? "partial_outputs"
           : v == &pl ? "partial_lses"
                      : "output_lse",
           " is on ", to_string(v->device), "; output on ", to_string(o.device));
    }
  }
}

}  // namespace pagedattn
