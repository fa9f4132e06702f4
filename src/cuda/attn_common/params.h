// Parameters of the paged attention kernels (decode, both prefill kernels and the split
// combine): one POD struct, host -> device. Strides are in elements; every head dimension is
// contiguous.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pagedattn::cuda::attn {

/// KV heads whose k / v scales the attention parameters carry (AttnParams::head_scales).
inline constexpr int kMaxHeadScales = 256;

/// Request r owns query rows [query_start_loc[r], query_start_loc[r+1]) and attends over
/// kv_len = seq_lens[r] keys (kv_direct: its own q_len tokens); query token i sits at absolute
/// position kv_len - q_len + i. Key j of KV head h lives at
///   k + block_table[r][j / block_size] * k_stride_block + (j % block_size) * k_stride_page
///     + h * k_stride_head                               (paged cache, NHD or HND)
///   k + (query_start_loc[r] + j) * k_stride_page + h * k_stride_head   (kv_direct)
/// Everything per step is read from device memory here, so a captured graph replays with new
/// metadata written into the same buffers.
struct AttnParams;
/// The logit factor (k_scale) and output scale (v_scale) of KV head `kv_head`.
__host__ __device__ inline float k_factor_of(const AttnParams& p, int kv_head);
__host__ __device__ inline float v_scale_of(const AttnParams& p, int kv_head);

struct AttnParams {
  const void* q;  ///< [num_tokens, num_heads, head_size], activation dtype
  int64_t q_stride_token, q_stride_head;
  void* out;  ///< [num_tokens, num_heads, v_head_size], activation dtype
  int64_t out_stride_token, out_stride_head;
  void* lse;  ///< optional [num_heads, num_tokens], natural log; nullptr = not wanted
  int64_t lse_stride_head, lse_stride_token;
  int lse_is_f64;  ///< lse is float64 rather than float32

  const void* k;  ///< [num_blocks, block_size, num_kv_heads, head_size] (kv_direct: [T, Hkv, D])
  const void* v;  ///< as k, with rows of v_head_size
  int64_t k_stride_block, k_stride_page, k_stride_head;
  int64_t v_stride_block, v_stride_page, v_stride_head;
  int kv_direct;  ///< encoder types: keys are the request's own rows of k / v, no block table
  int kv_dtype;   ///< pagedattn::DType of k / v, for instances that decide it at run time

  const int32_t* query_start_loc;  ///< [num_seqs + 1]
  const int32_t* seq_lens;         ///< [num_seqs]
  const int32_t* block_table;      ///< [num_seqs, max_blocks_per_seq]
  int64_t block_table_stride_seq, block_table_stride_block;
  int num_seqs;
  int num_heads, num_kv_heads, group;  ///< group = num_heads / num_kv_heads (G)
  int head_size, block_size;
  /// Columns of V and O (<= head_size; FlashAttention's dv). V's columns past it are zeros in
  /// shared memory, as a bucket's are past head_size, and O stops at it.
  int v_head_size;
  int num_q_tiles;        ///< ceil(max_query_len * G / kRows): grid.x = num_seqs * Hkv * this
  int num_actual_tokens;  ///< T_a: rows of the split partials and of the combine

  float scale_log2;           ///< scale * k_scale * log2(e): q.k -> logit in log2 units
  float softcap;              ///< > 0: cap of cap * tanh(logit / cap); 0 = off
  float softcap_arg_scale;    ///< scale * k_scale / cap: q.k -> tanh argument
  float softcap_log2;         ///< cap * log2(e)
  const float* alibi_slopes;  ///< [num_heads] or nullptr
  const float* sinks;         ///< [num_heads] (natural-log units) or nullptr
  float v_scale;              ///< fp8: multiplies the output; 1 otherwise
  /// fp8 caches with scales per KV head (KVScales' [num_kv_heads] vectors, or per-request ones
  /// equal across requests): 1, and KV head h's logits take scale_log2 * k_factor[h] (its
  /// k_scale; scale_log2 and softcap_arg_scale then leave k_scale out) and its output v_factor[h]
  /// (its v_scale) in place of v_scale. By value, so a captured graph keeps them. 0: per tensor.
  int head_scales;
  float k_factor[kMaxHeadScales], v_factor[kMaxHeadScales];
  int causal;        ///< mask keys after the query position (decoder)
  int window_left;   ///< >= 0: keys j < pos - window_left are masked; -1 = unbounded
  int window_right;  ///< >= 0: keys j > pos + window_right are masked; -1 = unbounded

  int num_splits;      ///< grid.y; > 1: partials go to the workspace, the combine kernel merges
  float* partial_o;    ///< [num_splits, T_a, num_heads, v_head_size] float, normalised, v-scaled
  float* partial_lse;  ///< [num_splits, T_a, num_heads] float, log2 units (-inf = no keys)
  /// > 0: the prefill kernel runs in the same step and takes the requests with more packed
  /// rows (q_len * G) than this; the decode kernel skips them. 0: one kernel takes every row.
  int route_rows;
  int vec_q;    ///< q rows and base allow 16-byte loads
  int vec_out;  ///< out rows and base allow 16-byte stores
  /// K/V rows come in by cp.async.bulk (one per row, an mbarrier per warp and stage; sm_90)
  /// rather than 16-byte cp.async by every lane.
  int bulk_copy;

  /// Hopper prefill only: full K/V tiles of a 16-bit cache come by TMA through k_map / v_map
  /// (4-D maps over {head_size, a, b, blocks}, boxes of 64 columns x kv_tma_rows rows,
  /// 128-byte swizzled as the panels are). 1: a = KV heads, b = rows of a block (NHD); 2: a =
  /// rows, b = heads (HND). kv_direct: "rows" are the key tensor's token rows, one "block".
  /// 0: every tile by cp.async.
  int kv_tma;
  int kv_tma_rows;  ///< rows per box: min(block_size, the kernel's tile) (kv_direct: the tile)
  /// Hopper prefill over a 16-bit cache only (prefill::kQTma): Q tiles by TMA through q_map (3-D
  /// over {head_size, heads, tokens}, one box of {64 columns, group heads, block_m / group tokens}
  /// per panel: a work tile's packed rows in order), when the group divides block_m and the
  /// query's strides allow. 0: Q by cp.async.
  int q_tma;
  /// Hopper prefill only: 0, one CTA per work tile; N > 0, at most N CTAs (the backend passes
  /// at most as many as are resident), each walking several work tiles (the next one's Q and K
  /// load while the current one's rows are stored).
  int persistent;
  /// Prefill kernels: the work tiles walk the (request, KV head) pairs in groups of this many
  /// (0: all in one group), the q tiles longest first within a group, so that the CTAs running
  /// at once share the group's K/V in L2 (prefill_work).
  int pair_group;
  /// Hopper prefill with a persistent grid of fewer CTAs than work tiles: the dynamic walk's
  /// counter (one int, 0 at launch; the launch's last draw stores 0 again: prefill::draw_tile),
  /// so that each CTA takes the next work tile as soon as it is free. A layer's launches share
  /// it and must run in stream order. nullptr: the static snake.
  int* tile_counter;
  CUtensorMap k_map, v_map, q_map;  // 64-byte aligned by their type
};

__host__ __device__ inline float k_factor_of(const AttnParams& p, int kv_head) {
  return p.head_scales ? p.k_factor[kv_head] : 1.0f;
}
__host__ __device__ inline float v_scale_of(const AttnParams& p, int kv_head) {
  return p.head_scales ? p.v_factor[kv_head] : p.v_scale;
}

}  // namespace pagedattn::cuda::attn
