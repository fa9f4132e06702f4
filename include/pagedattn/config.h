// Attention and KV-cache configuration, with validation of every field.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/dtype.h"

namespace pagedattn {

/// vLLM's attn_type values.
enum class AttentionType {
  kDecoder,         ///< "decoder": causal self-attention over the paged cache
  kEncoder,         ///< "encoder": bidirectional, no cache (encoder of an encoder-decoder)
  kEncoderOnly,     ///< "encoder_only": bidirectional, no cache, symmetric window (BERT-like)
  kEncoderDecoder,  ///< "encoder_decoder": cross-attention over a paged cache of encoder K/V
};
std::string_view to_string(AttentionType type);
/// Parses "decoder" | "encoder" | "encoder_only" | "encoder_decoder"; throws InvalidArgument.
AttentionType parse_attn_type(std::string_view name);
/// Types that keep a paged KV cache (decoder, encoder_decoder).
inline bool uses_kv_cache(AttentionType t) {
  return t == AttentionType::kDecoder || t == AttentionType::kEncoderDecoder;
}

/// vLLM's cache_dtype strings. kFp8 means e4m3 (as on CUDA).
enum class KVCacheDType { kAuto, kBFloat16, kFloat16, kFloat32, kFp8, kFp8E4M3, kFp8E5M2 };
std::string_view to_string(KVCacheDType dtype);
/// Parses "auto bfloat16 float16 float32 fp8 fp8_e4m3 fp8_e5m2"; throws InvalidArgument.
KVCacheDType parse_kv_cache_dtype(std::string_view name);
inline bool is_fp8(KVCacheDType d) {
  return d == KVCacheDType::kFp8 || d == KVCacheDType::kFp8E4M3 || d == KVCacheDType::kFp8E5M2;
}
/// Element type the cache stores: "auto" is the model dtype, fp8 names are one byte.
DType kv_cache_storage_dtype(KVCacheDType kv_cache_dtype, DType model_dtype);

/// Physical order inside one cache block. The logical shape is always
/// [num_blocks, 2, block_size, num_kv_heads, head_size]; HND stores each block as
/// [2][num_kv_heads][block_size][head_size] and is seen through permuted strides.
enum class KVCacheLayout { kNHD, kHND };
std::string_view to_string(KVCacheLayout layout);
KVCacheLayout parse_kv_cache_layout(std::string_view name);

/// Everything that defines one attention layer's computation (vLLM's impl arguments).
/// Validated once by validate(); backends then trust it.
struct AttentionConfig {
  int num_heads = 0;                     ///< query heads on this rank
  int head_size = 0;                     ///< Q and K head size (and V's unless v_head_size)
  float scale = 0.0f;                    ///< multiplies q.k before soft cap, mask and softmax
  int num_kv_heads = 0;                  ///< divides num_heads; 1 = MQA
  std::optional<int> sliding_window;     ///< tokens visible, the current one included
  std::optional<float> logits_soft_cap;  ///< cap * tanh(logit / cap); absent = off
  std::vector<float> alibi_slopes;       ///< empty = off, else [num_heads]
  std::vector<float> sinks;              ///< empty = off, else [num_heads], not scaled
  AttentionType attn_type = AttentionType::kDecoder;
  DType dtype = DType::kBF16;  ///< model activation dtype (query/key/value/output)
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  KVCacheLayout kv_cache_layout = KVCacheLayout::kNHD;
  int block_size = 16;  ///< tokens per cache block
  /// The seed's query_quant: the query is quantised per tensor to fp8 e4m3 with
  /// ForwardArgs::scales.q_scale (q8 = saturate_e4m3(q * (1 / q_scale)), spec 1.6) and the
  /// result is attention(q8 * q_scale, K, V). A backend may then also run P V in fp8 (P rounded
  /// to e4m3). Needs an fp8 / fp8_e4m3 cache.
  bool query_quant = false;
  /// V's head size where it differs from Q/K's (FlashAttention's dv, e.g. MLA prefill's 192 / 128):
  /// 1..head_size; 0 = head_size. The output is then [num_tokens, num_heads, v_head_size] and the
  /// cache keeps K and V in separate views (KVCache).
  int v_head_size = 0;

  /// V's (and the output's) head size: v_head_size, or head_size when 0.
  int head_size_v() const { return v_head_size > 0 ? v_head_size : head_size; }
  int num_queries_per_kv() const { return num_kv_heads > 0 ? num_heads / num_kv_heads : 0; }
  DType cache_dtype() const { return kv_cache_storage_dtype(kv_cache_dtype, dtype); }
  bool has_alibi() const { return !alibi_slopes.empty(); }
  bool has_sinks() const { return !sinks.empty(); }
  /// Decoders mask keys after the query position (bottom-right aligned); docs/semantics.md.
  bool causal() const { return attn_type == AttentionType::kDecoder; }
  /// The sliding window as FlashAttention's offsets, the one form every backend reads: key j is
  /// visible from query position pos only if pos - window_left() <= j <= pos + window_right(),
  /// -1 meaning unbounded on that side. sliding_window W gives W - 1 on the left; on the right
  /// W - 1 for encoder_only (symmetric) and -1 for the other types (decoders are bounded there
  /// by the causal mask, causal(), which stays separate); no window gives -1 on both sides
  /// (docs/semantics.md, "Masks").
  int window_left() const { return sliding_window ? *sliding_window - 1 : -1; }
  int window_right() const {
    return sliding_window && attn_type == AttentionType::kEncoderOnly ? *sliding_window - 1 : -1;
  }

  /// Throws InvalidArgument naming the first field out of range, its value and the bound.
  void validate() const;
};

/// Standard ALiBi slopes (BLOOM/MPT) for `total_num_heads` heads.
std::vector<float> alibi_slopes(int total_num_heads);

}  // namespace pagedattn
