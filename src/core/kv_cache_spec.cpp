#include "pagedattn/kv_cache_spec.h"

#include <algorithm>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

namespace {
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

KVCacheSpec KVCacheSpec::full(int block_size, int num_kv_heads, int head_size, DType dtype) {
  return {KVCacheSpecKind::kFullAttention, block_size, num_kv_heads, head_size, dtype, {}};
}
KVCacheSpec KVCacheSpec::sliding(int block_size, int num_kv_heads, int head_size, DType dtype,
                                 int sliding_window) {
  return {
      KVCacheSpecKind::kSlidingWindow, block_size, num_kv_heads, head_size, dtype, sliding_window};
}
KVCacheSpec KVCacheSpec::mla(int block_size, int head_size, DType dtype) {
  return {KVCacheSpecKind::kMLA, block_size, 1, head_size, dtype, {}};
}
KVCacheSpec KVCacheSpec::cross(int block_size, int num_kv_heads, int head_size, DType dtype) {
  return {KVCacheSpecKind::kCrossAttention, block_size, num_kv_heads, head_size, dtype, {}};
}

void KVCacheSpec::validate() const {
  require(block_size > 0, "KVCacheSpec.block_size (", block_size, ") must be > 0");
  require(num_kv_heads > 0, "KVCacheSpec.num_kv_heads (", num_kv_heads, ") must be > 0");
  require(head_size > 0, "KVCacheSpec.head_size (", head_size, ") must be > 0");
  if (kind == KVCacheSpecKind::kSlidingWindow) {
    require(sliding_window && *sliding_window >= 1,
            "KVCacheSpec.sliding_window must be >= 1 for a sliding-window spec");
  }
}

int64_t KVCacheSpec::page_size_bytes() const {
  const int64_t per_token = int64_t(num_kv_heads) * head_size * int64_t(dtype_size(dtype));
  const int64_t kv_factor = kind == KVCacheSpecKind::kMLA ? 1 : 2;  // MLA: one latent entry
  return kv_factor * block_size * per_token;
}

int64_t KVCacheSpec::max_memory_usage_bytes(const SchedulerLimits& limits) const {
  const int64_t page = page_size_bytes();
  switch (kind) {
    case KVCacheSpecKind::kFullAttention:
    case KVCacheSpecKind::kMLA:
      return ceil_div(limits.max_model_len, block_size) * page;
    case KVCacheSpecKind::kSlidingWindow: {
      // The window of the first new token plus this step's new tokens; +1 because the window
      // may start mid-block.
      const int64_t tokens = std::min<int64_t>(
          int64_t(*sliding_window) - 1 + limits.max_num_batched_tokens, limits.max_model_len);
      return (ceil_div(tokens, block_size) + 1) * page;
    }
    case KVCacheSpecKind::kCrossAttention:
      return ceil_div(limits.max_num_encoder_input_tokens, block_size) * page;
  }
  return 0;
}

}  // namespace pagedattn
