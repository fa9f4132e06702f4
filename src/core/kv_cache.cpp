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

namespace {

// One page ([block_size, num_kv_heads, size] NHD or [num_kv_heads, block_size, size] HND) of
// every block, `offset` elements into each block of `block_stride` elements.
TensorView page_view(const TensorView& storage, int64_t offset, int64_t block_stride,
                     int block_size, int num_kv_heads, int size, KVCacheLayout layout) {
  TensorView v = storage;
  v.data = static_cast<char*>(v.data) + dtype_size(v.dtype) * size_t(offset);
  v.ndim = 4;
  v.shape = {storage.size(0), block_size, num_kv_heads, size, 0, 0};
  if (layout == KVCacheLayout::kNHD) {
    v.strides = {block_stride, int64_t(num_kv_heads) * size, size, 1, 0, 0};
  } else {
    v.strides = {block_stride, size, int64_t(block_size) * size, 1, 0, 0};
  }
  return v;
}

}  // namespace

KVCacheView split_cache_view(const TensorView& storage, int block_size, int num_kv_heads,
                             int head_size, int v_head_size, KVCacheLayout layout) {
  const int64_t k_page = int64_t(block_size) * num_kv_heads * head_size;
  const int64_t block = k_page + int64_t(block_size) * num_kv_heads * v_head_size;
  require(storage.ndim == 2 && storage.size(1) == block && storage.is_contiguous(),
          "a split KV cache's storage must be contiguous [num_blocks, block_size * num_kv_heads * "
          "(head_size + v_head_size) = ",
          block, "]; got ", describe(storage));
  KVCacheView v;
  v.key = page_view(storage, 0, block, block_size, num_kv_heads, head_size, layout);
  v.value = page_view(storage, k_page, block, block_size, num_kv_heads, v_head_size, layout);
  return v;
}

KVCache KVCache::allocate(int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                          DType dtype, KVCacheLayout layout, Device device, int v_head_size) {
  require(num_blocks >= 0, "num_blocks (", num_blocks, ") must be >= 0");
  require(block_size > 0, "block_size (", block_size, ") must be > 0");
  require(num_kv_heads > 0, "num_kv_heads (", num_kv_heads, ") must be > 0");
  require(head_size > 0, "head_size (", head_size, ") must be > 0");
  require(v_head_size >= 0 && v_head_size <= head_size, "v_head_size (", v_head_size,
          ") must be 1..head_size (", head_size, "), or 0 for head_size");
  KVCache c;
  c.layout_ = layout;
  if (v_head_size > 0 && v_head_size != head_size) {
    const int64_t block = int64_t(block_size) * num_kv_heads * (head_size + v_head_size);
    c.storage_ = Tensor::zeros({num_blocks, block}, dtype, device);
    c.split_ = split_cache_view(c.storage_.view(), block_size, num_kv_heads, head_size, v_head_size,
                                layout);
    return c;
  }
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
                  config.cache_dtype(), config.kv_cache_layout, device, config.head_size_v());
}

const TensorView& KVCache::tensor() const {
  require(!split(), "KVCache::tensor(): this cache's V head size (", split_.head_size_v(),
          ") differs from its K head size (", split_.head_size(),
          "), so K and V are separate views with no combined tensor; use view()");
  return combined_;
}

KVCacheView KVCache::view() const {
  return split() ? split_ : KVCacheView::from_combined(combined_);
}

KVCacheLayout layout_of(const KVCacheView& cache) {
  return cache.key.stride(2) == cache.head_size() || cache.num_kv_heads() == 1
             ? KVCacheLayout::kNHD
             : KVCacheLayout::kHND;
}

}  // namespace pagedattn
