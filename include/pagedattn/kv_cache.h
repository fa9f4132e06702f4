// One layer's paged KV cache: storage, the K and V views, and the scales of an fp8 cache.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// The K and V halves of a paged cache, each [num_blocks, block_size, num_kv_heads, head_size]
/// with arbitrary strides. Element (block b, offset o, head h, dim d) of K is at
///   key.data + b*key.stride(0) + o*key.stride(1) + h*key.stride(2) + d*key.stride(3)
/// and likewise for V. A token's slot is b * block_size + o. The head dimension is always
/// contiguous (stride(3) == 1); NHD has stride(1) = num_kv_heads*head_size, HND has
/// stride(2) = block_size*head_size. fp8 caches are kFp8E4M3 / kFp8E5M2 (or uint8 bytes seen
/// through the cache dtype).
///
/// With a V head size of its own (AttentionConfig::v_head_size) value is [num_blocks,
/// block_size, num_kv_heads, v_head_size]: K and V are then separate views, never one combined
/// tensor.
struct KVCacheView {
  TensorView key;    ///< [num_blocks, block_size, num_kv_heads, head_size]
  TensorView value;  ///< [num_blocks, block_size, num_kv_heads, head_size (or v_head_size)]

  bool defined() const { return key.defined(); }
  int64_t num_blocks() const { return key.size(0); }
  int block_size() const { return int(key.size(1)); }
  int num_kv_heads() const { return int(key.size(2)); }
  int head_size() const { return int(key.size(3)); }
  int head_size_v() const { return int(value.size(3)); }
  DType dtype() const { return key.dtype; }
  Device device() const { return key.device; }

  /// Splits a combined cache tensor [num_blocks, 2, block_size, num_kv_heads, head_size]
  /// (any strides) into its K and V views.
  static KVCacheView from_combined(const TensorView& kv);
};

/// Scales of an fp8 cache: stored = saturate(x / scale), read = stored * scale. Ignored by
/// non-fp8 caches. Each of K, V and Q has a per-tensor float and an optional vector that, when
/// not empty, replaces it: [num_kv_heads] (one scale per KV head, vLLM's per-head cache
/// quantisation) or, for attention only, [num_seqs * num_kv_heads] (FlashAttention 3's
/// [batch, num_kv_heads] descales, row-major). A Q scale of a KV head applies to the query heads
/// of its group. Host code reads scales only through the *_scale_of accessors; the argument
/// checks (check_forward_args, check_write_kv_args) refuse any other vector length.
struct KVScales {
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  /// AttentionConfig::query_quant only: the query's fp8 scale (q8 = e4m3(q / q_scale)).
  float q_scale = 1.0f;
  std::vector<float> k_scales = {};  ///< empty, [num_kv_heads] or [num_seqs * num_kv_heads]
  std::vector<float> v_scales = {};  ///< likewise
  std::vector<float> q_scales = {};  ///< likewise (query_quant only)

  /// Whether any vector is set.
  bool per_head() const { return !k_scales.empty() || !v_scales.empty() || !q_scales.empty(); }
  /// The scale of KV head `kv_head` of sequence `seq` (a layer's num_kv_heads heads).
  float k_scale_of(int seq, int kv_head, int num_kv_heads) const {
    return pick(k_scales, k_scale, seq, kv_head, num_kv_heads);
  }
  float v_scale_of(int seq, int kv_head, int num_kv_heads) const {
    return pick(v_scales, v_scale, seq, kv_head, num_kv_heads);
  }
  float q_scale_of(int seq, int kv_head, int num_kv_heads) const {
    return pick(q_scales, q_scale, seq, kv_head, num_kv_heads);
  }

 private:
  static float pick(const std::vector<float>& v, float whole, int seq, int kv_head,
                    int num_kv_heads) {
    if (v.empty()) return whole;
    if (v.size() == size_t(num_kv_heads)) return v[size_t(kv_head)];
    return v[size_t(seq) * size_t(num_kv_heads) + size_t(kv_head)];
  }
};

/// An owning cache: one storage of num_blocks pages, viewed in the requested layout.
class KVCache {
 public:
  KVCache() = default;
  /// Allocates (zero-filled) [num_blocks, 2, block_size, num_kv_heads, head_size] of `dtype`
  /// in `layout` on `device`. A v_head_size other than 0 and head_size gives separate K
  /// [..., head_size] and V [..., v_head_size] views of one allocation instead: each block holds
  /// its K page then its V page (block_size * num_kv_heads * (head_size + v_head_size)
  /// elements), each page in `layout`.
  static KVCache allocate(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                          DType dtype, KVCacheLayout layout, Device device = {},
                          int v_head_size = 0);
  /// A cache for `config` with `num_blocks` blocks (V of config.head_size_v()).
  static KVCache allocate(const AttentionConfig& config, int64_t num_blocks, Device device = {});

  /// The logical [num_blocks, 2, block_size, num_kv_heads, head_size] view (strided for HND).
  /// A cache whose V head size differs from K's has no such tensor: throws InvalidArgument
  /// (use view()).
  const TensorView& tensor() const;
  /// K and V views (of tensor(), or the separate ones).
  KVCacheView view() const;
  /// True when V's head size differs from K's (no combined tensor()).
  bool split() const { return split_.defined(); }
  KVCacheLayout layout() const { return layout_; }
  const Tensor& storage() const { return storage_; }
  bool defined() const { return storage_.defined(); }

 private:
  Tensor storage_;
  TensorView combined_;
  KVCacheView split_;  // defined only when V's head size differs from K's
  KVCacheLayout layout_ = KVCacheLayout::kNHD;
};

/// The K and V views of a cache whose V head size differs from K's, from its storage
/// [num_blocks, block_size * num_kv_heads * (head_size + v_head_size)] as KVCache::allocate lays
/// it out: each block's K page, then its V page, each page in `layout`.
KVCacheView split_cache_view(const TensorView& storage, int block_size, int num_kv_heads,
                             int head_size, int v_head_size, KVCacheLayout layout);

/// The layout a cache view's strides describe (HND when the head stride is not head_size).
KVCacheLayout layout_of(const KVCacheView& cache);

}  // namespace pagedattn
