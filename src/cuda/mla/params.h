// Parameters of the MLA decode family (the latent attention kernel and its split combine): one
// POD struct, host -> device. Strides are in elements; every row is contiguous.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pagedattn::cuda::mla {

/// Absorbed MLA (spec 5.4) as MQA: every query head of a request attends to ONE latent KV
/// head whose entry is kEntry = kv_lora_rank + qk_rope_head_dim = 512 + 64 wide; the same entry
/// is both key and value. Request r owns query rows [query_start_loc[r], query_start_loc[r+1])
/// and seq_lens[r] keys; its query token i sits at position seq_lens[r] - q_len + i and sees
/// keys [0, position]. Key j lives at
///   kv + block_table[r][j / block_size] * kv_stride_block + (j % block_size) * kv_stride_page
/// Everything per step is read from device memory, so a captured graph replays with new
/// metadata written into the same buffers.
struct MlaParams {
  const void* q;  ///< [num_tokens, num_heads, 576], activation dtype, rows 16-byte aligned
  int64_t q_stride_token, q_stride_head;
  void* out;  ///< [num_tokens, num_heads, out_cols], activation dtype: P * entry's first columns
  int64_t out_stride_token, out_stride_head;
  /// Columns of out (1..576): 512 is MLAAttention's latent output (what it up-projects), 576
  /// the generic contract's (512..575 = P k_pe); the seesaw instances serve at most 512.
  int out_cols;
  int vec_out;  ///< out rows allow 4-byte stores of column pairs
  void* lse;    ///< optional [num_heads, num_tokens], natural log; nullptr = not wanted
  int64_t lse_stride_head, lse_stride_token;
  int lse_is_f64;  ///< lse is float64 rather than float32

  const void* kv;  ///< [num_blocks, block_size, 576] latent cache (K and V), cache dtype
  int64_t kv_stride_block, kv_stride_page;

  const int32_t* query_start_loc;  ///< [num_seqs + 1]
  const int32_t* seq_lens;         ///< [num_seqs]
  const int32_t* block_table;      ///< [num_seqs, max_blocks_per_seq]
  int64_t block_table_stride_seq, block_table_stride_block;
  int num_seqs;
  int num_heads;  ///< N: packed row p of a request = (token p / N, head p % N)
  int block_size;
  int num_m_tiles;        ///< ceil(max_query_len * N / 64): grid.x = num_seqs * num_m_tiles
  int num_actual_tokens;  ///< T_a: rows of the split partials and of the combine

  float scale_log2;  ///< scale * k_scale * log2(e): q.k -> logit in log2 units
  float v_scale;     ///< fp8: multiplies the output (the latent's one scale); 1 otherwise

  /// kv_tma: full 64-key tiles come by TMA through kv_map (16-bit cache, block_size a multiple
  /// of 64, so that a tile lies in one block): a 3-D map {576, block_size, num_blocks}, boxes
  /// of 64 columns x 64 rows, 128-byte swizzled as the panels are. 0: every tile by cp.async.
  int kv_tma;
  CUtensorMap kv_map;  // 64-byte aligned by its type

  int num_splits;  ///< grid.y; > 1: partials go to the workspace, the combine merges them
  /// > 1 (= num_splits <= kMaxClusterSplits; swap AB only): the splits of a (request, M tile)
  /// are one cluster and merge through its shared memory (cluster_merge.cuh): no partials, no
  /// combine.
  int split_cluster;
  float* partial_o;    ///< [num_splits, T_a, num_heads, 576] float, normalised, v-scaled
  float* partial_lse;  ///< [num_splits, T_a, num_heads] float, log2 units (-inf = no keys)
};

}  // namespace pagedattn::cuda::mla
