// Tensor parallelism for the attention layer (vLLM's head split): which query and KV heads a
// rank owns, its layer options, and the views of a step's tensors that feed it. The exchange
// itself (gathering the ranks' outputs) is the engine's, over its own communicator.
#pragma once

#include <string>
#include <vector>

#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
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

/// Decode context parallelism (vLLM's DCP) for decode steps: every request's KV is spread
/// token by token, global position i on rank i % world at local position i / world; every rank
/// holds the whole query, attends over its share and returns the LSE, and merge_states of the
/// ranks' results gives the single-rank result (spec 4.13). The exchange of the partial
/// results is the engine's (an all-gather over its communicator).
struct DecodeContextParallel {
  int rank = 0, world = 1;
  /// Throws InvalidArgument unless world >= 1 and 0 <= rank < world.
  static DecodeContextParallel of(int rank, int world);
  /// Tokens of a sequence of `seq_len` this rank holds.
  int64_t local_len(int64_t seq_len) const {
    return seq_len > rank ? (seq_len - 1 - rank) / world + 1 : 0;
  }
  bool owns(int64_t pos) const { return pos % world == rank; }
  int64_t local_pos(int64_t pos) const { return pos / world; }
  /// Why `config` cannot run under DCP, or empty: ALiBi and sliding windows need global
  /// positions, sinks must join the denominator once (after the merge), and encoder types have
  /// no cache to spread.
  static std::vector<std::string> unsupported(const AttentionConfig& config);
};

/// One decode request as the engine sees it: `context_len` tokens cached before the step
/// (globally), one new token at position context_len, and this rank's local blocks.
struct DcpDecodeRequest {
  int context_len = 0;
  std::vector<int32_t> local_block_ids;
};

/// This rank's metadata for a decode step: each request attends over its local share (all of
/// it: every cached token precedes the new one) with one query row in the global order; the
/// new token's slot is its owner's local slot, -1 on the other ranks. Throws InvalidArgument
/// naming the request when a rank would hold none of its tokens (seq_len < world).
StepMetadata dcp_decode_metadata(const std::vector<DcpDecodeRequest>& requests, int block_size,
                                 const DecodeContextParallel& dcp);

/// The slots of tokens [0, num_tokens) of one request's prefill on this rank: the owner's local
/// slot, -1 elsewhere (appended to `slots`), for writing a context before DCP decode steps.
void dcp_prefill_slots(int num_tokens, const std::vector<int32_t>& local_block_ids, int block_size,
                       const DecodeContextParallel& dcp, std::vector<int64_t>& slots);

}  // namespace pagedattn
