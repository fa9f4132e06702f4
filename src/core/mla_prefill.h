// MLA's prefill formulation on the host (spec 5.4's prefill path), and the split of a step's
// requests between it and the absorbed formulation. Internal to src/core (mla.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/mla.h"

namespace pagedattn::detail {

/// A step's requests by formulation, as indices into the metadata, each list in batch order.
/// Zero-length requests are in neither.
struct MLARequestSplit {
  std::vector<int> decodes;
  std::vector<int> prefills;
};
MLARequestSplit split_mla_requests(const AttentionMetadata& md, MLAFormulation formulation,
                                   int decode_threshold);

/// The host metadata of `requests` alone, in that order, their query rows renumbered from 0;
/// `rows[i]` receives the step's row of new row i. Block tables and seq_lens are kept; slots
/// are -1 (the step's writes are done by then).
StepMetadata subset_metadata(const AttentionMetadata& md, const std::vector<int>& requests,
                             std::vector<int64_t>& rows);

/// The absorbed weights the expansion reads, as the layer keeps them (activation-dtype values).
struct MLAWeights {
  const float* w_uk = nullptr;  // [N, L, P]
  const float* w_uv = nullptr;  // [N, L, V]
};

/// The prefill formulation of one layer: two attention impls of the layer's backend over
/// expanded K/V seen as one-token blocks (MultiHeadAttention's trick), N heads of P + R, block
/// size 1: a causal decoder one for the new tokens and a non-causal encoder_decoder one for the
/// context chunks; their results merged by LSE with the backend's merge_states.
class MLAPrefill {
 public:
  /// Throws NotSupported, with the backend's reasons, when it cannot run those shapes.
  MLAPrefill(const MLAOptions& options, const Backend& backend);
  ~MLAPrefill();

  /// Writes output rows [T, N * V] of the prefill `requests` of `md`. q [T, N, P + R],
  /// kv_c [T, L], k_pe [T, R]; `cache` the latent cache ([num_blocks, block_size, 1, L + R]),
  /// already holding the step's entries (only the context, positions < seq_len - query_len,
  /// is read from it).
  void forward(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe,
               const AttentionMetadata& md, const std::vector<int>& requests,
               const KVCacheView& cache, float k_scale, const MLAWeights& weights,
               ForwardContext& context, const TensorView& output);

 private:
  // One attention call over expanded K/V rows [num_keys, N, P + R] as one-token blocks; output
  // [Tp, N, P + R] and lse [N, Tp]; scratch from the context's workspace.
  void attend(const AttentionConfig& config, AttentionImpl& impl, const StepMetadata& md,
              const TensorView& query, const TensorView& key, const TensorView& value,
              ForwardContext& context, const TensorView& output, const TensorView& lse);

  MLAOptions options_;
  const Backend* backend_ = nullptr;
  AttentionConfig causal_config_, context_config_;
  std::unique_ptr<AttentionImpl> causal_impl_, context_impl_;
};

}  // namespace pagedattn::detail
