// KV-cache specs (what one layer needs per block) and memory planning (spec section 7).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pagedattn/dtype.h"

namespace pagedattn {

enum class KVCacheSpecKind {
  kFullAttention,   ///< every token of a request stays cached
  kSlidingWindow,   ///< only the last sliding_window - 1 tokens plus the step's new ones
  kMLA,             ///< one latent entry per token (no K/V split), num_kv_heads = 1
  kCrossAttention,  ///< encoder K/V of an encoder-decoder model
};

/// Scheduler limits that bound one request's cache use.
struct SchedulerLimits {
  int64_t max_model_len = 0;                 ///< M
  int64_t max_num_batched_tokens = 0;        ///< new tokens per step
  int64_t max_num_encoder_input_tokens = 0;  ///< cross attention
};

/// What one layer needs from the cache. One page = one block of block_size tokens of one layer.
struct KVCacheSpec {
  KVCacheSpecKind kind = KVCacheSpecKind::kFullAttention;
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;                  ///< MLA: kv_lora_rank + qk_rope_head_dim
  DType dtype = DType::kBF16;         ///< storage type (one byte for fp8)
  std::optional<int> sliding_window;  ///< kSlidingWindow (recorded on kFullAttention too)

  static KVCacheSpec full(int block_size, int num_kv_heads, int head_size, DType dtype);
  static KVCacheSpec sliding(int block_size, int num_kv_heads, int head_size, DType dtype,
                             int sliding_window);
  static KVCacheSpec mla(int block_size, int head_size, DType dtype);
  static KVCacheSpec cross(int block_size, int num_kv_heads, int head_size, DType dtype);

  /// Bytes of one block: 2 * block_size * num_kv_heads * head_size * dtype bytes (no factor 2
  /// for MLA).
  int64_t page_size_bytes() const;
  /// Bytes one request at the maximum length can pin in this layer (spec 7.1).
  int64_t max_memory_usage_bytes(const SchedulerLimits& limits) const;
  /// Throws InvalidArgument naming the field when a size is not positive.
  void validate() const;
  friend bool operator==(const KVCacheSpec&, const KVCacheSpec&) = default;
};

/// A layer and its spec.
struct LayerCacheSpec {
  std::string layer_name;
  KVCacheSpec spec;
};

/// Layers that share one block table (and so one metadata per step).
struct KVCacheGroup {
  std::vector<std::string> layer_names;
  KVCacheSpec spec;  ///< the group's spec (for uniform-type groups, that of its first layer)
};

/// One allocation of page_size * num_blocks bytes, shared by the named layers (one per group
/// in the hybrid case).
struct KVCacheTensorPlan {
  int64_t size_bytes = 0;
  std::vector<std::string> shared_by;
};

struct KVCachePlan {
  int64_t num_blocks = 0;  ///< block 0 is the null block: num_blocks - 1 are usable
  std::vector<KVCacheGroup> groups;
  std::vector<KVCacheTensorPlan> tensors;
  double max_concurrency = 0;  ///< requests of max_model_len that fit at once
};

/// Plans the caches of `layers` for `available_bytes` (spec 7.2): groups the layers (one group
/// when all specs are equal; one uniform-type group when they differ only in sizes; groups of
/// equal page size for hybrid models), then the block count. Throws InvalidArgument when no
/// memory is available or a request of max_model_len does not fit, naming both sizes in GiB
/// and the largest max_model_len that would fit; NotSupported for layouts it cannot group.
KVCachePlan plan_kv_cache(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                          const SchedulerLimits& limits,
                          std::optional<int64_t> num_blocks_override = std::nullopt);

/// Largest max_model_len in [1, limits.max_model_len] whose per-request need fits in
/// `available_bytes` (binary search), or 0 when none does.
int64_t estimate_max_model_len(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                               const SchedulerLimits& limits);

}  // namespace pagedattn
