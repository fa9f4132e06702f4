// Parameters of write_kv (vLLM's reshape_and_cache_flash): one POD struct, host -> device.
#pragma once

#include <cstdint>

namespace pagedattn::cuda::cache_ops {

/// Token t of the step goes to slot s = slot_mapping[t] (skipped when s < 0): element
/// (h, d) of its key lands at k_cache[s / block_size][s % block_size][h][d], through the
/// strides below (in elements), converted to the cache dtype. Every tensor's head dimension is
/// contiguous.
/// Per-KV-head scales travel by value in the params (no device buffer to upload, keep alive or
/// capture in a CUDA graph); 2 x 256 floats keep the struct well under the 4 KB parameter limit.
constexpr int kMaxHeadScales = 256;

struct WriteKVParams {
  const void* key;  ///< [>= num_slots, num_kv_heads, head_size], activation dtype
  int64_t key_stride_token, key_stride_head;
  const void* value;  ///< [>= num_slots, num_kv_heads, v_head_size], activation dtype
  int64_t value_stride_token, value_stride_head;
  const int64_t* slot_mapping;  ///< [num_slots], -1 = skip
  int64_t slot_stride;
  void* k_cache;  ///< [num_blocks, block_size, num_kv_heads, head_size], cache dtype
  int64_t k_stride_block, k_stride_page, k_stride_head;
  void* v_cache;  ///< [num_blocks, block_size, num_kv_heads, v_head_size], cache dtype
  int64_t v_stride_block, v_stride_page, v_stride_head;
  int num_slots, num_kv_heads, head_size, block_size;
  int v_head_size;         ///< V's columns (<= head_size)
  float k_scale, v_scale;  ///< fp8 caches store saturate(x / scale); ignored otherwise
  int per_head_scales;     ///< 1: head h uses k_scales[h] / v_scales[h] instead
  float k_scales[kMaxHeadScales], v_scales[kMaxHeadScales];
  int vectorized;  ///< 1: every row and base is aligned for kVec-element accesses
};

}  // namespace pagedattn::cuda::cache_ops
