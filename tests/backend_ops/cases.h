// The backend_ops case matrix: every backend runs the same cases and is compared with the
// float64 reference (docs/testing.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/kv_cache.h"

namespace pagedattn::backend_ops {

/// One request of a case. For decoders: context_len cached tokens then query_len new ones.
/// For encoder types: query_len tokens attending to each other. For cross attention:
/// encoder_len cached encoder tokens, written this step when encoder_runs.
struct RequestShape {
  int context_len = 0;
  int query_len = 0;
  int share_prefix_blocks = 0;  ///< reuse the first N physical blocks of the previous request
  int encoder_len = 0;
  bool encoder_runs = false;
  /// Decoders only, with context_len 0: keys when fewer than query_len (FlashAttention's
  /// seqlen_q > seqlen_k; the first query_len - seq_len rows see no key); -1: context + query.
  int seq_len = -1;
};

struct OpCase {
  std::string name;  ///< unique, filterable: "head_size=80 gqa=4 ..."
  AttentionConfig config;
  std::vector<RequestShape> requests;
  int pad_tokens = 0;  ///< extra query rows with slot -1 (CUDA-graph padding)
  float k_scale = 1.0f, v_scale = 1.0f;
  float q_scale = 1.0f;  ///< config.query_quant only
  /// Per-head scales (KVScales' vectors): [num_kv_heads] serve write_kv and forward;
  /// [num_seqs * num_kv_heads] serve forward only (write_kv then takes k_scale / v_scale).
  std::vector<float> k_scales, v_scales, q_scales;
  float input_std = 1.0f;  ///< standard deviation of the random inputs
  /// The query's and the keys' where they differ (0: input_std): magnitudes that a 16-bit path
  /// must carry, e.g. a bf16 query beyond f16's range against small keys with a small k_scale.
  float query_std = 0.0f, key_std = 0.0f;
  /// One cache entry serves as key and value (MLAAttention's latent binding): the value rows
  /// are the key rows, v_scale = k_scale, and kv_cache.value is the same view as .key.
  bool latent = false;
  /// Output columns (0: head_size): fewer gives the first columns of P V, as MLAAttention binds
  /// its latent output (kv_lora_rank = 512 of the 576-wide entry).
  int out_cols = 0;
  uint32_t seed = 0;
};

/// The scales write_kv and forward take for case `k`.
KVScales write_scales(const OpCase& k);
KVScales forward_scales(const OpCase& k);

/// The full matrix (a few hundred cases), deterministic in its shapes; inputs are drawn fresh
/// per case from `seed_base` + case index.
std::vector<OpCase> make_case_matrix(uint32_t seed_base);

}  // namespace pagedattn::backend_ops
