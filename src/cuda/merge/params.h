// Parameters of merge_states (spec 4.12) and merge_ranks: one POD struct each, host -> device.
#pragma once

#include <cstdint>

namespace pagedattn::cuda::merge {

/// Row (t, h) of out merges row (t, h) of the prefix and suffix outputs by their LSEs
/// (natural log, head-major [num_heads, num_tokens]). Strides in elements; the head dimension
/// of every output is contiguous.
struct MergeParams {
  const void* prefix_out;  ///< [num_tokens, num_heads, head_size]
  int64_t prefix_stride_token, prefix_stride_head;
  const void* suffix_out;  ///< [num_tokens, num_heads, head_size]
  int64_t suffix_stride_token, suffix_stride_head;
  void* out;  ///< [num_tokens, num_heads, head_size]
  int64_t out_stride_token, out_stride_head;
  const void* prefix_lse;  ///< [num_heads, num_tokens], float32 or float64
  int64_t prefix_lse_stride_head, prefix_lse_stride_token;
  const void* suffix_lse;  ///< [num_heads, num_tokens]
  int64_t suffix_lse_stride_head, suffix_lse_stride_token;
  void* out_lse;  ///< optional [num_heads, num_tokens]; nullptr = not wanted
  int64_t out_lse_stride_head, out_lse_stride_token;
  int prefix_lse_f64, suffix_lse_f64, out_lse_f64;
  int num_tokens, num_heads, head_size;
  int vectorized;  ///< 1: rows and bases allow kVec-element accesses
};

/// Row (t, h) of out is the rank-order merge of row (t, h) of every rank's partial output by
/// the ranks' LSEs (natural log, head-major), in float32: the running merge starts as "no
/// keys" and merges rank 0, 1, ... in turn with merge_states' formula. Strides in elements; the
/// head dimension of partials and out is contiguous.
struct MergeRanksParams {
  const void* partials;  ///< [num_ranks, num_tokens, num_heads, head_size] of the partial dtype
  int64_t partial_stride_rank, partial_stride_token, partial_stride_head;
  const float* lses;  ///< [num_ranks, num_heads, num_tokens]
  int64_t lse_stride_rank, lse_stride_head, lse_stride_token;
  void* out;  ///< [num_tokens, num_heads, head_size] of the output dtype
  int64_t out_stride_token, out_stride_head;
  float* out_lse;  ///< optional [num_heads, num_tokens]; nullptr = not wanted
  int64_t out_lse_stride_head, out_lse_stride_token;
  int num_ranks, num_tokens, num_heads, head_size;
  int vectorized;  ///< 1: rows and bases allow kVec-element accesses
};

}  // namespace pagedattn::cuda::merge
