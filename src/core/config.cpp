#include "pagedattn/config.h"

#include <cmath>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::fail;
using detail::require;

namespace {
template <class E>
struct Named {
  E value;
  std::string_view name;
};
constexpr Named<AttentionType> kAttnTypes[] = {
    {AttentionType::kDecoder, "decoder"},
    {AttentionType::kEncoder, "encoder"},
    {AttentionType::kEncoderOnly, "encoder_only"},
    {AttentionType::kEncoderDecoder, "encoder_decoder"},
};
constexpr Named<KVCacheDType> kCacheDTypes[] = {
    {KVCacheDType::kAuto, "auto"},        {KVCacheDType::kBFloat16, "bfloat16"},
    {KVCacheDType::kFloat16, "float16"},  {KVCacheDType::kFloat32, "float32"},
    {KVCacheDType::kFp8, "fp8"},          {KVCacheDType::kFp8E4M3, "fp8_e4m3"},
    {KVCacheDType::kFp8E5M2, "fp8_e5m2"},
};
constexpr Named<KVCacheLayout> kLayouts[] = {
    {KVCacheLayout::kNHD, "NHD"},
    {KVCacheLayout::kHND, "HND"},
};

template <class E, size_t N>
std::string_view name_of(const Named<E> (&table)[N], E value) {
  for (const auto& e : table)
    if (e.value == value) return e.name;
  return "unknown";
}

template <class E, size_t N>
E parse(const Named<E> (&table)[N], std::string_view name, std::string_view what) {
  std::string valid;
  for (const auto& e : table) {
    if (e.name == name) return e.value;
    valid += valid.empty() ? "" : ", ";
    valid += e.name;
  }
  fail(what, " '", name, "' is not one of: ", valid);
}
}  // namespace

std::string_view to_string(AttentionType type) {
  return name_of(kAttnTypes, type);
}
AttentionType parse_attn_type(std::string_view name) {
  return parse(kAttnTypes, name, "attn_type");
}
std::string_view to_string(KVCacheDType dtype) {
  return name_of(kCacheDTypes, dtype);
}
KVCacheDType parse_kv_cache_dtype(std::string_view name) {
  return parse(kCacheDTypes, name, "kv_cache_dtype");
}
std::string_view to_string(KVCacheLayout layout) {
  return name_of(kLayouts, layout);
}
KVCacheLayout parse_kv_cache_layout(std::string_view name) {
  return parse(kLayouts, name, "kv_cache_layout");
}

DType kv_cache_storage_dtype(KVCacheDType kv_cache_dtype, DType model_dtype) {
  switch (kv_cache_dtype) {
    case KVCacheDType::kAuto:
      return model_dtype;
    case KVCacheDType::kBFloat16:
      return DType::kBF16;
    case KVCacheDType::kFloat16:
      return DType::kF16;
    case KVCacheDType::kFloat32:
      return DType::kF32;
    case KVCacheDType::kFp8:
    case KVCacheDType::kFp8E4M3:
      return DType::kFp8E4M3;
    case KVCacheDType::kFp8E5M2:
      return DType::kFp8E5M2;
  }
  fail("kv_cache_dtype: unknown code ", int(kv_cache_dtype));
}

void AttentionConfig::validate() const {
  require(num_heads > 0, "num_heads (", num_heads, ") must be > 0");
  require(num_kv_heads > 0, "num_kv_heads (", num_kv_heads, ") must be > 0");
  require(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
          ") is not divisible by num_kv_heads (", num_kv_heads, ")");
  require(head_size > 0, "head_size (", head_size, ") must be > 0");
  require(v_head_size >= 0 && v_head_size <= head_size, "v_head_size (", v_head_size,
          ") must be 1..head_size (", head_size, "), or 0 for head_size");
  require(std::isfinite(scale) && scale > 0.0f, "scale (", scale, ") must be finite and > 0");
  if (sliding_window) {
    require(*sliding_window >= 1, "sliding_window (", *sliding_window,
            ") must be >= 1 (it counts the current token); leave it unset for no window");
  }
  if (logits_soft_cap) {
    require(std::isfinite(*logits_soft_cap) && *logits_soft_cap > 0.0f, "logits_soft_cap (",
            *logits_soft_cap, ") must be finite and > 0; leave it unset for no soft cap");
  }
  require(alibi_slopes.empty() || int(alibi_slopes.size()) == num_heads, "alibi_slopes has ",
          alibi_slopes.size(), " entries; expected num_heads (", num_heads, ")");
  for (size_t h = 0; h < alibi_slopes.size(); ++h) {
    require(std::isfinite(alibi_slopes[h]), "alibi_slopes[", h, "] (", alibi_slopes[h],
            ") must be finite");
  }
  require(sinks.empty() || int(sinks.size()) == num_heads, "sinks has ", sinks.size(),
          " entries; expected num_heads (", num_heads, ")");
  for (size_t h = 0; h < sinks.size(); ++h) {
    require(std::isfinite(sinks[h]), "sinks[", h, "] (", sinks[h], ") must be finite");
  }
  require(is_activation_dtype(dtype), "dtype (", dtype_name(dtype),
          ") must be float32, float16 or bfloat16");
  require(block_size > 0, "block_size (", block_size, ") must be > 0");
  require(!query_quant || kv_cache_dtype == KVCacheDType::kFp8 ||
              kv_cache_dtype == KVCacheDType::kFp8E4M3,
          "query_quant quantises the query to fp8 e4m3 for an fp8 e4m3 cache; kv_cache_dtype is ",
          to_string(kv_cache_dtype), " (needs fp8 or fp8_e4m3)");
}

std::vector<float> alibi_slopes(int total_num_heads) {
  require(total_num_heads > 0, "alibi_slopes: total_num_heads (", total_num_heads, ") must be > 0");
  int p = 1;
  while (p * 2 <= total_num_heads) p *= 2;
  const double base = std::pow(2.0, -8.0 / p);
  std::vector<float> slopes;
  for (int k = 1; k <= p; ++k) slopes.push_back(float(std::pow(base, k)));
  const double extra_base = std::pow(2.0, -4.0 / p);
  for (int k = 1; int(slopes.size()) < total_num_heads; k += 2) {
    slopes.push_back(float(std::pow(extra_base, k)));
  }
  return slopes;
}

}  // namespace pagedattn
