// Tensor parallelism for the attention layer (vLLM's head split): which query and KV heads a
// rank owns, its layer options, and the views of a step's tensors that feed it; and decode
// context parallelism (the KV cache spread token by token, partial results merged by LSE).
// The exchanges themselves (gathering the ranks' results) are the engine's, over its own
// communicator.
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

/// The rank's layer configuration (backend-level twin of shard_options): its head counts and
/// its slices of alibi_slopes and sinks. Throws InvalidArgument when `shard` was made for
/// another head configuration or a slice's source does not have num_heads entries.
AttentionConfig shard_config(const AttentionConfig& config, const TensorParallelShard& shard);

/// The rank's columns of a [T, heads * head_size] (or [T, heads, head_size]) tensor: query and
/// output take the query-head range, key and value the KV-head range. Views, no copies.
TensorView shard_query(const TensorView& query, const TensorParallelShard& s, int head_size);
TensorView shard_kv(const TensorView& key_or_value, const TensorParallelShard& s, int head_size);

/// Decode context parallelism (vLLM's DCP) for decode steps and prefill chunks over a cached
/// context (docs/parallel.md): every request's KV is spread token by token, global position i
/// on rank i % world at local position i / world; every rank holds the whole query, attends
/// over its share and returns the LSE, and merge_states of the ranks' results gives the
/// single-rank result (spec 4.13). The exchange of the partial results is the engine's (an
/// all-gather over its communicator).
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
  /// positions, encoder and encoder-only types have no cache to spread, and cross attention
  /// (encoder_decoder) keeps its encoder keys whole. Sinks are supported (see dcp_config).
  static std::vector<std::string> unsupported(const AttentionConfig& config);
};

/// The rank's layer configuration under DCP: `config` with its sinks kept on rank 0 only (a
/// sink joins the softmax denominator once; rank 0's LSE carries it into the merge). Throws
/// InvalidArgument listing DecodeContextParallel::unsupported(config) when it is not empty.
AttentionConfig dcp_config(const AttentionConfig& config, const DecodeContextParallel& dcp);
/// The same for the layer's options (the window checked is the layer's: the per-layer window,
/// else the cache config's).
AttentionOptions dcp_options(const AttentionOptions& options, const DecodeContextParallel& dcp);

/// One request of a DCP step as the engine sees it: `context_len` tokens cached before the step
/// (globally, spread as DecodeContextParallel says), `num_new_tokens` new ones at positions
/// context_len .. context_len + num_new_tokens - 1 (1 for a decode, more for a prefill chunk
/// or a speculative-decode verification, 0 for nothing), and this rank's local blocks in
/// logical order, at least ceil(local_len(context_len + num_new_tokens) / block_size) of them.
struct DcpRequest {
  int context_len = 0;
  int num_new_tokens = 0;
  std::vector<int32_t> local_block_ids;
};

/// This rank's share of a step, from dcp_step_metadata.
struct DcpStep {
  /// One request per query row, in the step's row order: the row of global position p attends
  /// over the rank's local keys at positions <= p, which are the first local_len(p + 1) local
  /// positions (exactly its visible keys under the causal mask, as the rank's positions keep
  /// their global order). Its slot is its new token's local slot on the owner, -1 elsewhere.
  StepMetadata metadata;
  /// Rows of positions p < rank: this rank holds none of their keys. They read one key of
  /// block 0 (the null block) to stay valid metadata; dcp_clear_empty_rows turns their result
  /// into "no keys" (output 0, LSE -inf) before the merge.
  std::vector<int32_t> empty_rows;
};

/// This rank's metadata for a step of decodes and prefill chunks over a spread cache. Writing
/// the step's K/V with it puts each new token in its owner's cache at its local slot (so later
/// steps see it); each rank's forward with an LSE output, dcp_clear_empty_rows, then
/// merge_states of the ranks' (output, LSE) in rank order give the single-rank result of the
/// step (causal; see dcp_config for what the layer may use). Merge in float32: partials
/// rounded to bfloat16 and merged in bfloat16 exceed the accuracy rule (docs/parallel.md).
/// Rows cost one decode row each: a chunk of q tokens is read as q rows over the rank's
/// share. Throws InvalidArgument naming
/// the request when block_size < 1, a length is negative, or local_block_ids has fewer than
/// ceil(local_len(context_len + num_new_tokens) / block_size) blocks.
DcpStep dcp_step_metadata(const std::vector<DcpRequest>& requests, int block_size,
                          const DecodeContextParallel& dcp);

/// Writes "no keys" into this rank's result for step.empty_rows: output rows 0 ([T, H, D] or
/// [T, H*D]), LSE columns -inf ([H, T] float32). On the CPU in place; on another device by
/// small synchronous copies from the host (one per empty row and head), so it is not
/// graph-capturable. Only new tokens at positions below world - 1 (a sequence's first tokens)
/// make empty rows; decode steps of sequences of >= world tokens have none. Throws InvalidArgument
/// when a row is past the tensors' rows or the output rows are not contiguous on a device.
void dcp_clear_empty_rows(const DcpStep& step, const TensorView& output, const TensorView& lse);

/// One decode request as the engine sees it: `context_len` tokens cached before the step
/// (globally), one new token at position context_len, and this rank's local blocks.
struct DcpDecodeRequest {
  int context_len = 0;
  std::vector<int32_t> local_block_ids;
};

/// This rank's metadata for a decode step (dcp_step_metadata with one new token per request):
/// each request attends over its local share (all of it: every cached token precedes the new
/// one) with one query row in the global order; the new token's slot is its owner's local slot,
/// -1 on the other ranks. Throws InvalidArgument naming the request when a rank would hold
/// none of its tokens (seq_len < world), so that a decode step never has empty rows.
StepMetadata dcp_decode_metadata(const std::vector<DcpDecodeRequest>& requests, int block_size,
                                 const DecodeContextParallel& dcp);

/// The slots of tokens [0, num_tokens) of one request's prefill on this rank: the owner's local
/// slot, -1 elsewhere (appended to `slots`), for writing a context before DCP decode steps.
void dcp_prefill_slots(int num_tokens, const std::vector<int32_t>& local_block_ids, int block_size,
                       const DecodeContextParallel& dcp, std::vector<int64_t>& slots);

}  // namespace pagedattn
