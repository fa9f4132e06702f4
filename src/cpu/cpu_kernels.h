// The CPU backend's kernels: one POD parameter struct, the unit of parallel work, and entry
// points that dispatch at run time to the best SIMD target this CPU has (Google Highway:
// AVX-512, AVX2, SSE4, NEON, or a portable 128-bit emulation).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedattn/dtype.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn::cpu {

/// Everything a work item reads. Strides are in elements. For a paged cache, key position j of
/// request r lives in block block_table[r * block_table_stride + (j / block_size) *
/// block_table_stride_block] at offset j % block_size; for encoder types (paged = false) it is
/// row query_start_loc[r] + j of the key/value inputs (k_stride_token is then the input's row
/// stride).
struct AttentionParams {
  const void* q = nullptr;  // [num_tokens, num_heads, head_size]
  int64_t q_stride_token = 0, q_stride_head = 0;
  DType q_dtype = DType::kF32;
  void* out = nullptr;  // [num_tokens, num_heads, out_cols]
  int64_t out_stride_token = 0, out_stride_head = 0;
  DType out_dtype = DType::kF32;
  int out_cols = 0;     // v_head_size or fewer: the leading columns of each output row
  void* lse = nullptr;  // [num_heads, num_tokens] or null
  int64_t lse_stride_head = 0, lse_stride_token = 0;
  DType lse_dtype = DType::kF32;

  const void* k = nullptr;  // cache [num_blocks, block_size, num_kv_heads, head_size] or input rows
  const void* v = nullptr;
  DType kv_dtype = DType::kF32;
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_token = 0, v_stride_head = 0;
  bool paged = true;
  const int32_t* block_table = nullptr;  // [num_seqs, max_blocks_per_seq], any strides
  int64_t block_table_stride = 0, block_table_stride_block = 1;
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  const int32_t* seq_lens = nullptr;         // [num_seqs]
  int block_size = 1;

  int num_heads = 0, num_kv_heads = 0, head_size = 0;
  int v_head_size = 0;  // V's (and the output's) head size, <= head_size; 0 = head_size
  float scale = 1.0f;
  float soft_cap = 0.0f;         // 0 = off
  const float* alibi = nullptr;  // [num_heads] or null
  const float* sinks = nullptr;  // [num_heads] or null
  bool causal = true;
  // The window as AttentionConfig::window_left() / window_right() give it:
  int window_left = -1;                  // keys j < pos - window_left are masked; -1 = unbounded
  int window_right = -1;                 // keys j > pos + window_right are masked; -1 = unbounded
  float k_scale = 1.0f, v_scale = 1.0f;  // fp8 caches; 1 otherwise
  // fp8 caches with per-head scales (they replace k_scale / v_scale), else null.
  const KVScales* head_scales = nullptr;
};

/// One unit of parallel work: query tokens [q_begin, q_end) of a request (relative to its first
/// query row) for all query heads of KV heads [kv_head, kv_head + num_kv_heads), against keys
/// [k_begin, k_end). A split item (split >= 0) writes a partial result to the partial buffers
/// instead of the output. Rows are ordered (kv head, token, query head of its group).
struct WorkItem {
  int request = 0;
  int kv_head = 0;
  int num_kv_heads = 1;
  int q_begin = 0, q_end = 0;
  int64_t k_begin = 0, k_end = 0;
  int split = -1;            ///< index of this item's partial slot, or -1
  bool include_sink = true;  ///< false for all but one split of a row group (sinks count once)
  int64_t cost = 0;          ///< estimated work, for ordering (largest first)
};

/// Partial results of split items: [num_partials][rows][v_head_size] and [num_partials][rows].
struct PartialBuffers {
  float* out = nullptr;
  float* lse = nullptr;     ///< natural log
  int64_t rows_stride = 0;  ///< max rows (tokens x query heads) of any split item
};

/// Runs one item with the dispatched SIMD target.
void attend_item(const AttentionParams& p, const WorkItem& item, const PartialBuffers& partials);

/// Merges the partial results of one (request, kv_head, query range) split `num_splits` ways
/// (partial slots first_split .. first_split + num_splits - 1) into the output and LSE.
void merge_splits(const AttentionParams& p, const WorkItem& item, int first_split, int num_splits,
                  const PartialBuffers& partials);

/// Converts n elements of `src_dtype` to `dst_dtype` (float types, fp8 included). fp8
/// destinations store saturate(x / scale) rounded to nearest even, bit-identical to
/// float_to_fp8_*; 16-bit destinations round to nearest even.
void convert_row(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                 float scale);

/// max |x| over n contiguous elements (NaN propagates).
float amax_row(const void* src, DType dtype, int64_t n);

/// The SIMD targets this binary can run on this CPU, best first ("AVX3", "AVX2", ...).
std::vector<std::string> available_targets();
/// Restricts dispatch to one target by name (tests); "" restores the best one. Returns false
/// when the name is not available here.
bool force_target(const std::string& name);
/// The target dispatch currently uses.
std::string current_target();

}  // namespace pagedattn::cpu
