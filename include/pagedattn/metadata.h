// Per-step attention metadata (vLLM's CommonAttentionMetadata), its builder and validation.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// One step's batch description, shared by every layer of a KV-cache group. Request r owns
/// query rows [query_start_loc[r], query_start_loc[r+1]) and attends over seq_lens[r] keys;
/// its first context_len = seq_lens[r] - query_len tokens were cached by earlier steps, and
/// query row i sits at absolute position context_len + i.
///
/// The tensors live on the compute device; the *_cpu mirrors hold the same values on the host
/// (for a CPU step they are the same views) so that plans never read device memory.
struct AttentionMetadata {
  int num_seqs = 0;           ///< requests, zero-length padding requests included
  int num_actual_tokens = 0;  ///< T_a = query_start_loc[num_seqs]; rows past it are padding
  int max_query_len = 0;      ///< >= every query length
  int max_seq_len = 0;        ///< >= every seq_len (may be max_model_len under graph capture)
  bool causal = true;         ///< false for encoder, encoder-only and cross attention

  TensorView query_start_loc;      ///< int32 [num_seqs + 1], non-decreasing, [0] = 0
  TensorView seq_lens;             ///< int32 [num_seqs], >= query_len[r] but for cross attention
  TensorView block_table;          ///< int32 [num_seqs, max_blocks_per_seq], logical -> physical
  TensorView slot_mapping;         ///< int64 [num_slots >= T_a for decoders]; -1 = do not write
  TensorView query_start_loc_cpu;  ///< host mirror of query_start_loc
  TensorView seq_lens_cpu;         ///< host mirror of seq_lens

  int max_blocks_per_seq() const { return block_table.defined() ? int(block_table.size(1)) : 0; }
  int num_slots() const { return slot_mapping.defined() ? int(slot_mapping.size(0)) : 0; }
};

/// One request of a step, as a scheduler sees it.
struct RequestSpec {
  int context_len = 0;     ///< tokens already in the cache (computed or prefix hit)
  int num_new_tokens = 0;  ///< query tokens this step (0 = a padding request)
  /// Physical blocks in logical order, >= ceil(seq_len / bs); empty for a layer without a
  /// cache (encoder types), whose slots are then -1.
  std::vector<int32_t> block_ids;
};

/// Host-owned metadata built from a list of requests; view() gives the AttentionMetadata.
class StepMetadata {
 public:
  AttentionMetadata view() const;
  /// A copy of the tensors on `device` (host mirrors stay on the host, in this object).
  /// The returned metadata refers to buffers owned by this object.
  AttentionMetadata to_device(Device device);

  std::vector<int32_t> query_start_loc;  // [num_seqs + 1]
  std::vector<int32_t> seq_lens;         // [num_seqs]
  std::vector<int32_t> block_table;      // [num_seqs * max_blocks_per_seq]
  std::vector<int64_t> slot_mapping;     // [num_slots]
  int max_blocks_per_seq = 0;
  int max_query_len = 0;
  int max_seq_len = 0;
  bool causal = true;

 private:
  Tensor device_query_start_loc_, device_seq_lens_, device_block_table_, device_slot_mapping_;
};

/// Builds a step from requests: decode (context = seq - 1, one new token), fresh prefill
/// (context 0), chunked prefill (context > 0), prefix sharing (two requests naming the same
/// physical blocks), padded tokens (slot -1) and zero-length padding requests.
class MetadataBuilder {
 public:
  explicit MetadataBuilder(int block_size);
  /// Appends a request; its new tokens' slots follow from its block ids.
  MetadataBuilder& add(const RequestSpec& request);
  /// Appends `count` zero-length requests (query_start_loc repeats, seq_len 0).
  MetadataBuilder& add_padding_requests(int count);
  /// Pads the slot mapping with -1 to `num_tokens` entries (CUDA-graph padding).
  MetadataBuilder& pad_slots_to(int num_tokens);
  MetadataBuilder& causal(bool causal);
  /// Sets max_seq_len to at least `max_seq_len` (graph capture uses max_model_len).
  MetadataBuilder& max_seq_len_at_least(int max_seq_len);
  StepMetadata build() const;

 private:
  int block_size_;
  std::vector<RequestSpec> requests_;
  int pad_slots_to_ = 0;
  int min_max_seq_len_ = 0;
  bool causal_ = true;
};

/// The cache a metadata is checked against.
struct CacheGeometry {
  int64_t num_blocks = 0;
  int block_size = 0;
};

/// Checks a step's metadata (values read from host-visible memory: the *_cpu mirrors always,
/// which must be given, block_table and slot_mapping when they are on the CPU). Throws
/// InvalidArgument naming the field, the request or token, the value and the bound:
/// - shapes and dtypes; query_start_loc and seq_lens (and their mirrors) contiguous;
///   query_start_loc[0] == 0, non-decreasing, last == num_actual_tokens;
/// - seq_lens[r] >= 0 (a query may outnumber its keys, as FlashAttention allows:
/// docs/semantics.md);
///   max_query_len / max_seq_len >= the real maxima;
/// - for cached types: block_table wide enough for ceil(seq_len / block_size), its used entries
///   inside [0, num_blocks); each slot -1 or inside the cache and, for decoders, inside one of
///   its own request's used blocks; decoders have at least num_actual_tokens slots and -1 past
///   them;
/// - for encoder types (no cache): seq_lens[r] == query_len[r].
void validate_metadata(const AttentionMetadata& metadata, AttentionType attn_type,
                       const CacheGeometry& cache);

}  // namespace pagedattn
