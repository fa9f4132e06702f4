#include "cuda/backend/mla_route.h"

#include "cuda/mla/launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

using detail::cat;

bool is_mla_shape(const AttentionConfig& c) {
  return c.head_size == mla::kEntry;
}

std::vector<std::string> mla_reasons(const AttentionConfig& c) {
  std::vector<std::string> r;
  const std::string what = "head_size 576 runs on the MLA latent kernel, which ";
  if (c.num_kv_heads != 1) {
    r.push_back(cat(what, "needs num_kv_heads 1 (one latent head); got ", c.num_kv_heads));
  }
  if (c.attn_type != AttentionType::kDecoder) {
    r.push_back(cat(what, "serves decoder attention only; got ", to_string(c.attn_type)));
  }
  if (c.has_alibi()) r.push_back(cat(what, "has no ALiBi"));
  if (c.logits_soft_cap && *c.logits_soft_cap > 0.0f) r.push_back(cat(what, "has no soft cap"));
  if (c.sliding_window) r.push_back(cat(what, "has no sliding window"));
  if (c.has_sinks()) r.push_back(cat(what, "has no attention sinks"));
  const DType cache = c.cache_dtype();
  if (mla::find_mla(c.dtype, cache, c.num_heads) == nullptr) {
    r.push_back(cat(what,
                    "is compiled for float16 / bfloat16 activations over a cache of the "
                    "same type or fp8 e4m3; got ",
                    dtype_name(c.dtype), " over ", dtype_name(cache)));
  } else if (mla::find_mla_combine(c.dtype) == nullptr) {
    r.push_back(cat(what, "has no split combine compiled for ", dtype_name(c.dtype)));
  }
  return r;
}

}  // namespace pagedattn::cuda
