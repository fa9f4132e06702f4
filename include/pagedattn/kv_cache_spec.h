// KV-cache specs (what one layer needs per block) and memory planning (spec section 7).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/dtype.h"

namespace pagedattn {

/// The kinds of per-layer cache specs (spec 7.1).
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
  KVCacheSpecKind kind = KVCacheSpecKind::kFullAttention;  ///< how the layer uses its blocks
  int block_size = 16;                                     ///< tokens per block
  int num_kv_heads = 0;                                    ///< 1 for MLA
  int head_size = 0;                                       ///< MLA: kv_lora_rank + qk_rope_head_dim
  DType dtype = DType::kBF16;                              ///< storage type (one byte for fp8)
  std::optional<int> sliding_window;  ///< kSlidingWindow (recorded on kFullAttention too)
  /// V's head size where it differs from K's (AttentionConfig::v_head_size): 1..head_size, or
  /// 0 = head_size. Not for MLA.
  int v_head_size = 0;

  /// V's head size: v_head_size, or head_size when 0.
  int head_size_v() const { return v_head_size > 0 ? v_head_size : head_size; }

  /// Full attention (decoder self-attention without a window).
  static KVCacheSpec full(int block_size, int num_kv_heads, int head_size, DType dtype);
  /// Sliding-window attention over the last `sliding_window` tokens.
  static KVCacheSpec sliding(int block_size, int num_kv_heads, int head_size, DType dtype,
                             int sliding_window);
  /// MLA: one latent entry of `head_size` per token, num_kv_heads = 1.
  static KVCacheSpec mla(int block_size, int head_size, DType dtype);
  /// Cross attention: the encoder K/V of an encoder-decoder model.
  static KVCacheSpec cross(int block_size, int num_kv_heads, int head_size, DType dtype);

  /// Bytes of one block: block_size * num_kv_heads * (head_size + head_size_v()) * dtype bytes
  /// (MLA: block_size * head_size * dtype bytes, one latent entry).
  int64_t page_size_bytes() const;
  /// Bytes one request at the maximum length can pin in this layer (spec 7.1).
  int64_t max_memory_usage_bytes(const SchedulerLimits& limits) const;
  /// Throws InvalidArgument naming the field when a size is not positive, an MLA spec has
  /// num_kv_heads != 1, a sliding window is < 1, v_head_size is outside 0..head_size (0 for
  /// MLA) or the dtype is not a cache type (a floating type or uint8).
  void validate() const;
  /// Field-wise equality (the recorded sliding_window included).
  friend bool operator==(const KVCacheSpec&, const KVCacheSpec&) = default;
};

/// "full_attention", "sliding_window", "mla" or "cross_attention".
std::string_view kv_cache_spec_kind_name(KVCacheSpecKind kind);
/// "full_attention(block_size=16, num_kv_heads=8, head_size=128, dtype=bfloat16)" for messages
/// (sliding_window appended when set).
std::string describe(const KVCacheSpec& spec);

/// A layer and its spec.
struct LayerCacheSpec {
  std::string layer_name;  ///< unique, non-empty
  KVCacheSpec spec;
};

/// Layers that share one block table (and so one metadata per step).
struct KVCacheGroup {
  std::vector<std::string> layer_names;  ///< in the order of the input layers
  KVCacheSpec spec;  ///< the group's spec (for uniform-type groups, that of its first layer)
};

/// One allocation of size_bytes = page_size * num_blocks bytes (zero-filled raw bytes that each
/// layer views through its own spec), shared by the named layers: one layer when every layer
/// has its own tensor, one layer per group in the hybrid case (the groups use disjoint blocks
/// through their own block tables).
struct KVCacheTensorPlan {
  int64_t size_bytes = 0;              ///< page_size_bytes * num_blocks
  std::vector<std::string> shared_by;  ///< layers viewing this allocation, one per group
};

/// The result of plan_kv_cache.
///
/// Capacity: block 0 of every tensor is the null block (spec 3.7): it is never allocated to a
/// request, and block-table entries that fell out of a sliding window point at it. So
/// num_blocks - 1 blocks hold data, and a block table never names a block >= num_blocks.
struct KVCachePlan {
  int64_t num_blocks = 0;  ///< blocks per tensor, null block 0 included: num_blocks - 1 usable
  std::vector<KVCacheGroup> groups;        ///< one block table (and metadata) each
  std::vector<KVCacheTensorPlan> tensors;  ///< the allocations
  /// Blocks of the shared pool one request of max_model_len pins at most: the sum over groups
  /// of the largest ceil(max_memory_usage_bytes / page_size_bytes) among the group's layers
  /// (equal to vLLM's ceil(per_request_max_bytes / (page_size * layers_per_group))).
  int64_t num_blocks_per_request = 0;
  /// num_blocks / num_blocks_per_request, as vLLM reports it: requests of max_model_len that
  /// fit at once. It counts the null block, so it can exceed the true count by
  /// 1 / num_blocks_per_request.
  double max_concurrency = 0;
};

/// Plans the caches of `layers` for `available_bytes` (spec 7.2).
///
/// Grouping:
///  - every spec equal: one group; num_blocks = floor(available / page / num_layers); one
///    tensor of page * num_blocks bytes per layer.
///  - same kind and block_size (and, for sliding windows, the same window) but different
///    sizes (vLLM's UniformTypeKVCacheSpecs): one group; num_blocks = floor(available /
///    sum of page sizes); layer i gets its own tensor of page_i * num_blocks bytes.
///  - otherwise, when every page size is equal (hybrid, e.g. sliding window + full): layers are
///    bucketed by spec (in order of first appearance); with m = the fewest layers of any spec,
///    a spec with n layers is split into ceil(n / m) groups by strided assignment (group g of
///    k gets layers g, g + k, g + 2k, ...); with G = the most layers of any group,
///    num_blocks = floor(available / page / G), and tensor i < G is shared by the i-th layer
///    of every group that has one.
/// `num_blocks_override` (>= 1) replaces the computed block count (tensor sizes follow it,
/// even past `available_bytes`); the memory checks below still run first, as in vLLM.
///
/// Errors: InvalidArgument for an empty or duplicate layer name, an invalid spec (naming the
/// layer and field), limits that a layer needs but are not positive, available_bytes <= 0, or
/// when one request of limits.max_model_len needs more than available_bytes (the message gives
/// both sizes in GiB and, when positive, the estimated maximum model length); NotSupported for
/// specs of different kinds and page sizes, naming the specs. An empty `layers` (an
/// attention-free model) gives an empty plan.
KVCachePlan plan_kv_cache(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                          const SchedulerLimits& limits,
                          std::optional<int64_t> num_blocks_override = std::nullopt);

/// Largest max_model_len in [1, limits.max_model_len] for which the sum over `layers` of
/// max_memory_usage_bytes fits in `available_bytes` (binary search; the need grows with the
/// length), or 0 when none does. Validates like plan_kv_cache.
int64_t estimate_max_model_len(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                               const SchedulerLimits& limits);

}  // namespace pagedattn
