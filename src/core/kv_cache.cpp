#include "pagedattn/kv_cache.h"

#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

KVCacheView KVCacheView::from_combined(const TensorView& kv) {
  require(kv.ndim == 5 && kv.size(1) == 2,
          "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size]; got ",
          describe(kv));
  KVCacheView v;
  v.key = kv.select(1, 0);
  v.value = kv.select(1, 1);
  return v;
}

KVCache KVCache::allocate(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                          DType dtype, KVCacheLayout layout, Device device) {
  require(num_blocks >= 0, "num_blocks (", num_blocks, ") must be >= 0");
  require(block_size > 0, "block_size (", block_size, ") must be > 0");
  require(num_kv_heads > 0, "num_kv_heads (", num_kv_heads, ") must be > 0");
  require(head_size > 0, "head_size (", head_size, ") must be > 0");
  KVCache c;
  c.layout_ = layout;
  if (layout == KVCacheLayout::kNHD) {
    c.storage_ = Tensor::zeros({num_blocks, 2, block_size, num_kv_heads, head_size}, dtype, device);
    c.combined_ = c.storage_.view();
  } else {
    // Physical [num_blocks, 2, num_kv_heads, block_size, head_size], seen as the logical order.
    c.storage_ = Tensor::zeros({num_blocks, 2, num_kv_heads, block_size, head_size}, dtype, device);
    c.combined_ = c.storage_.view().permute({0, 1, 3, 2, 4});
  }
  return c;
}

KVCache KVCache::allocate(const AttentionConfig& config, int64_t num_blocks, Device device) {
  return allocate(num_blocks, config.block_size, config.num_kv_heads, config.head_size,
                  config.cache_dtype(), config.kv_cache_layout, device);
}

KVCacheLayout layout_of(const KVCacheView& cache) {
  return cache.key.stride(2) == cache.head_size() || cache.num_kv_heads() == 1
             ? KVCacheLayout::kNHD
             : KVCacheLayout::kHND;
}

}  // namespace pagedattn
