// Tensor parallelism for the attention layer (vLLM's head split): which query and KV heads a
// rank owns, its layer options, and the views of a step's tensors that feed it. The exchange
// itself (gathering the ranks' outputs) is the engine's, over its own communicator.
#pragma once

#include "pagedattn/layer.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// Rank `rank` of `world` tensor-parallel ranks of a layer with `num_heads` query heads and
/// `num_kv_heads` KV heads (vLLM's rule): query heads split evenly; KV heads split evenly when
/// there are at least as many as ranks, else each KV head is replicated on world / num_kv_heads
/// consecutive ranks. The rank's query heads keep their KV heads (head h uses KV head
/// h / (num_heads / num_kv_heads) globally).
struct TensorParallelShard {
  int rank = 0, world = 1;
  int head_begin = 0, num_heads = 0;        ///< query heads [head_begin, head_begin + num_heads)
  int kv_head_begin = 0, num_kv_heads = 0;  ///< KV heads this rank holds and reads
  /// Throws InvalidArgument naming the bound: world >= 1, 0 <= rank < world, num_heads
  /// divisible by world, num_kv_heads divisible by world or world by num_kv_heads.
  static TensorParallelShard of(int num_heads, int num_kv_heads, int rank, int world);
};

/// The rank's layer options: its head counts, its slices of alibi_slopes and sinks, and a prefix
/// unchanged (each rank has its own ForwardContext).
AttentionOptions shard_options(const AttentionOptions& options, const TensorParallelShard& shard);

/// The rank's columns of a [T, heads * head_size] (or [T, heads, head_size]) tensor: query and
/// output take the query-head range, key and value the KV-head range. Views, no copies.
TensorView shard_query(const TensorView& query, const TensorParallelShard& s, int head_size);
TensorView shard_kv(const TensorView& key_or_value, const TensorParallelShard& s, int head_size);

}  // namespace pagedattn
