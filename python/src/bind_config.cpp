// AttentionConfig, CacheConfig, KV-cache specs, dtype helpers and build information.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <sstream>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::py {

using detail::require;

namespace {

std::string repr(const AttentionConfig& c) {
  std::ostringstream os;
  os << "AttentionConfig(num_heads=" << c.num_heads << ", head_size=" << c.head_size
     << ", scale=" << c.scale << ", num_kv_heads=" << c.num_kv_heads;
  if (c.sliding_window) os << ", sliding_window=" << *c.sliding_window;
  if (c.logits_soft_cap) os << ", logits_soft_cap=" << *c.logits_soft_cap;
  if (c.has_alibi()) os << ", alibi_slopes=[" << c.alibi_slopes.size() << " values]";
  if (c.has_sinks()) os << ", sinks=[" << c.sinks.size() << " values]";
  os << ", attn_type='" << to_string(c.attn_type) << "', dtype='" << dtype_name(c.dtype)
     << "', kv_cache_dtype='" << to_string(c.kv_cache_dtype) << "', kv_cache_layout='"
     << to_string(c.kv_cache_layout) << "', block_size=" << c.block_size << ")";
  return os.str();
}

// A float copy of any array (host or device) as a contiguous float32 host tensor.
Tensor float32_copy(const TensorView& src, std::optional<DType> as_dtype) {
  TensorView v = src;
  if (as_dtype) {
    require(dtype_size(*as_dtype) == dtype_size(v.dtype), "as_dtype ", dtype_name(*as_dtype),
            " has ", dtype_size(*as_dtype), "-byte elements; the array has ", dtype_size(v.dtype));
    v.dtype = *as_dtype;
  }
  const Tensor host = Tensor::copy_of(v, Device::cpu());
  Tensor out = Tensor::empty(v.shape_vector(), DType::kF32, Device::cpu());
  float* dst = out.data_as<float>();
  for (int64_t i = 0, n = v.numel(); i < n; ++i) {
    dst[i] = float(load_element(host.data(), host.view().dtype, i));
  }
  return out;
}

// A contiguous host copy of `src` converted to `dtype` (rounded as the library rounds).
Tensor cast_copy(const TensorView& src, DType dtype) {
  const Tensor host = Tensor::copy_of(src, Device::cpu());
  Tensor out = Tensor::empty(src.shape_vector(), dtype, Device::cpu());
  for (int64_t i = 0, n = src.numel(); i < n; ++i) {
    store_element(out.data(), dtype, i, load_element(host.data(), host.view().dtype, i));
  }
  return out;
}

// None -> nullopt, else the value (an optional member's setter, for every nanobind version).
template <class T>
std::optional<T> optional_of(nb::handle v) {
  if (v.is_none()) return std::nullopt;
  return nb::cast<T>(v);
}

}  // namespace

void bind_config(nb::module_& m) {
  nb::class_<AttentionConfig>(m, "AttentionConfig",
                              "Everything that defines one attention layer's computation.")
      .def(
          "__init__",
          [](AttentionConfig* self, int num_heads, int head_size, std::optional<float> scale,
             std::optional<int> num_kv_heads, std::optional<int> sliding_window,
             std::optional<float> logits_soft_cap, std::optional<std::vector<float>> alibi_slopes,
             std::optional<std::vector<float>> sinks, const std::string& attn_type,
             nb::handle dtype, const std::string& kv_cache_dtype,
             const std::string& kv_cache_layout, int block_size) {
            auto* c = new (self) AttentionConfig();
            c->num_heads = num_heads;
            c->head_size = head_size;
            c->scale = scale ? *scale : (head_size > 0 ? 1.0f / std::sqrt(float(head_size)) : 0.0f);
            c->num_kv_heads = num_kv_heads.value_or(num_heads);
            c->sliding_window = sliding_window;
            c->logits_soft_cap = logits_soft_cap;
            c->alibi_slopes = alibi_slopes.value_or(std::vector<float>{});
            c->sinks = sinks.value_or(std::vector<float>{});
            c->attn_type = parse_attn_type(attn_type);
            c->dtype = parse_dtype(dtype);
            c->kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
            c->kv_cache_layout = parse_kv_cache_layout(kv_cache_layout);
            c->block_size = block_size;
          },
          nb::arg("num_heads"), nb::arg("head_size"), nb::arg("scale").none() = nb::none(),
          nb::arg("num_kv_heads").none() = nb::none(),
          nb::arg("sliding_window").none() = nb::none(),
          nb::arg("logits_soft_cap").none() = nb::none(),
          nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
          nb::arg("attn_type") = "decoder", nb::arg("dtype") = "bfloat16",
          nb::arg("kv_cache_dtype") = "auto", nb::arg("kv_cache_layout") = "NHD",
          nb::arg("block_size") = 16,
          "scale defaults to head_size**-0.5 and num_kv_heads to num_heads. Not validated until "
          "validate() (or use).")
      .def_rw("num_heads", &AttentionConfig::num_heads)
      .def_rw("head_size", &AttentionConfig::head_size)
      .def_rw("scale", &AttentionConfig::scale)
      .def_rw("num_kv_heads", &AttentionConfig::num_kv_heads)
      .def_prop_rw(
          "sliding_window", [](const AttentionConfig& c) { return c.sliding_window; },
          [](AttentionConfig& c, nb::handle v) { c.sliding_window = optional_of<int>(v); },
          nb::arg("value").none(), "Tokens visible, the current one included; None = no window.")
      .def_prop_rw(
          "logits_soft_cap", [](const AttentionConfig& c) { return c.logits_soft_cap; },
          [](AttentionConfig& c, nb::handle v) { c.logits_soft_cap = optional_of<float>(v); },
          nb::arg("value").none(), "cap * tanh(logit / cap); None = off.")
      .def_rw("alibi_slopes", &AttentionConfig::alibi_slopes)
      .def_rw("sinks", &AttentionConfig::sinks)
      .def_prop_rw(
          "attn_type", [](const AttentionConfig& c) { return std::string(to_string(c.attn_type)); },
          [](AttentionConfig& c, const std::string& s) { c.attn_type = parse_attn_type(s); })
      .def_prop_rw(
          "dtype", [](const AttentionConfig& c) { return std::string(dtype_name(c.dtype)); },
          [](AttentionConfig& c, nb::handle s) { c.dtype = parse_dtype(s); })
      .def_prop_rw(
          "kv_cache_dtype",
          [](const AttentionConfig& c) { return std::string(to_string(c.kv_cache_dtype)); },
          [](AttentionConfig& c, const std::string& s) {
            c.kv_cache_dtype = parse_kv_cache_dtype(s);
          })
      .def_prop_rw(
          "kv_cache_layout",
          [](const AttentionConfig& c) { return std::string(to_string(c.kv_cache_layout)); },
          [](AttentionConfig& c, const std::string& s) {
            c.kv_cache_layout = parse_kv_cache_layout(s);
          })
      .def_rw("block_size", &AttentionConfig::block_size)
      .def_rw("query_quant", &AttentionConfig::query_quant)
      .def_rw("v_head_size", &AttentionConfig::v_head_size,
              "V's head size where it differs from head_size (1..head_size; 0 = head_size).")
      .def_prop_ro("head_size_v", &AttentionConfig::head_size_v)
      .def_prop_ro("num_queries_per_kv", &AttentionConfig::num_queries_per_kv)
      .def_prop_ro(
          "cache_dtype",
          [](const AttentionConfig& c) { return std::string(dtype_name(c.cache_dtype())); },
          "Element type the cache stores ('auto' = dtype; fp8 names are one byte).")
      .def_prop_ro("causal", &AttentionConfig::causal)
      .def("validate", &AttentionConfig::validate,
           "Raises InvalidArgument naming the first field out of range.")
      .def("__repr__", &repr)
      .def("__copy__", [](const AttentionConfig& c) { return c; })
      .def(
          "__deepcopy__", [](const AttentionConfig& c, nb::handle) { return c; }, nb::arg("memo"));

  nb::class_<CacheConfig>(m, "CacheConfig", "vLLM's CacheConfig fields that the layer reads.")
      .def(
          "__init__",
          [](CacheConfig* self, const std::string& cache_dtype, int block_size,
             bool calculate_kv_scales, std::optional<int> sliding_window,
             const std::string& layout) {
            auto* c = new (self) CacheConfig();
            c->cache_dtype = parse_kv_cache_dtype(cache_dtype);
            c->block_size = block_size;
            c->calculate_kv_scales = calculate_kv_scales;
            c->sliding_window = sliding_window;
            c->layout = parse_kv_cache_layout(layout);
          },
          nb::arg("cache_dtype") = "auto", nb::arg("block_size") = 16,
          nb::arg("calculate_kv_scales") = false, nb::arg("sliding_window").none() = nb::none(),
          nb::arg("layout") = "NHD")
      .def_prop_rw(
          "cache_dtype", [](const CacheConfig& c) { return std::string(to_string(c.cache_dtype)); },
          [](CacheConfig& c, const std::string& s) { c.cache_dtype = parse_kv_cache_dtype(s); })
      .def_rw("block_size", &CacheConfig::block_size)
      .def_rw("calculate_kv_scales", &CacheConfig::calculate_kv_scales)
      .def_prop_rw(
          "sliding_window", [](const CacheConfig& c) { return c.sliding_window; },
          [](CacheConfig& c, nb::handle v) { c.sliding_window = optional_of<int>(v); },
          nb::arg("value").none())
      .def_prop_rw(
          "layout", [](const CacheConfig& c) { return std::string(to_string(c.layout)); },
          [](CacheConfig& c, const std::string& s) { c.layout = parse_kv_cache_layout(s); })
      .def("__repr__", [](const CacheConfig& c) {
        std::ostringstream os;
        os << "CacheConfig(cache_dtype='" << to_string(c.cache_dtype)
           << "', block_size=" << c.block_size
           << ", calculate_kv_scales=" << (c.calculate_kv_scales ? "True" : "False")
           << ", sliding_window=";
        if (c.sliding_window) {
          os << *c.sliding_window;
        } else {
          os << "None";
        }
        os << ", layout='" << to_string(c.layout) << "')";
        return os.str();
      });

  nb::class_<KVCacheSpec>(m, "KVCacheSpec", "What one layer needs from the cache per block.")
      .def_prop_ro(
          "kind", [](const KVCacheSpec& s) { return std::string(kv_cache_spec_kind_name(s.kind)); })
      .def_ro("block_size", &KVCacheSpec::block_size)
      .def_ro("num_kv_heads", &KVCacheSpec::num_kv_heads)
      .def_ro("head_size", &KVCacheSpec::head_size)
      .def_prop_ro("dtype", [](const KVCacheSpec& s) { return std::string(dtype_name(s.dtype)); })
      .def_ro("sliding_window", &KVCacheSpec::sliding_window)
      .def_prop_ro("page_size_bytes", &KVCacheSpec::page_size_bytes)
      .def("__repr__", [](const KVCacheSpec& s) { return describe(s); });

  m.def("alibi_slopes", &alibi_slopes, nb::arg("total_num_heads"),
        "Standard ALiBi slopes (BLOOM/MPT) for total_num_heads heads.");
  m.def(
      "kv_cache_storage_dtype",
      [](const std::string& kv_cache_dtype, nb::handle model_dtype) {
        return std::string(dtype_name(kv_cache_storage_dtype(parse_kv_cache_dtype(kv_cache_dtype),
                                                             parse_dtype(model_dtype))));
      },
      nb::arg("kv_cache_dtype"), nb::arg("model_dtype"),
      "Element type a cache of kv_cache_dtype stores for a model of model_dtype.");
  m.def(
      "array_info",
      [](const InArray& a) {
        const TensorView v = to_view(a, "array");
        return std::make_tuple(std::string(dtype_name(v.dtype)), v.shape_vector(),
                               to_string(v.device));
      },
      nb::arg("array"),
      "(dtype name, shape, device) of any array as pagedattn sees it (fp8 bytes read uint8).");
  m.def(
      "to_float32",
      [](const InArray& a, std::optional<nb::handle> as_dtype) {
        std::optional<DType> d;
        if (as_dtype && !as_dtype->is_none()) d = parse_dtype(*as_dtype);
        return export_tensor(float32_copy(to_view(a, "array"), d));
      },
      nb::arg("array"), nb::arg("as_dtype").none() = nb::none(),
      "A float32 numpy copy of any array (host or device, any dtype). as_dtype reinterprets "
      "the elements first, e.g. 'float8_e4m3fn' for an fp8 cache held as uint8.");
  m.def(
      "cast",
      [](const InArray& a, nb::handle dtype) {
        return export_tensor(cast_copy(to_view(a, "array"), parse_dtype(dtype)));
      },
      nb::arg("array"), nb::arg("dtype"),
      "A contiguous host copy converted to dtype with the library's rounding (fp8 saturates). "
      "fp8 results are their uint8 bytes; bfloat16 results are DLPack arrays (numpy has no "
      "bfloat16).");
}

}  // namespace pagedattn::py
