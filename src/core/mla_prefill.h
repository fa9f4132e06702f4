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

/// One prefill request of the step.
struct PrefillRequest {
  int index;          ///< in the step's metadata
  int64_t q_begin;    ///< the step's first row of it
  int64_t q_len;      ///< new tokens
  int64_t context;    ///< cached tokens before the step
  int64_t row_begin;  ///< its first row among the prefill rows
};

/// The prefill requests of a step (from the metadata's host mirrors) and the context chunks
/// over them, shared by the host and the device paths.
struct PrefillPlan {
  std::vector<PrefillRequest> reqs;
  int64_t num_rows = 0;     ///< Tp, the prefill rows
  int64_t max_context = 0;  ///< the longest cached context
  int with_context = 0;     ///< requests with a cached context
  /// Context tokens per request and chunk: an equal share of `chunk_tokens` latent entries per
  /// request with context (whole blocks when a block fits, as vLLM rounds it).
  int64_t context_share(int64_t chunk_tokens, int block_size) const;
  /// Chunk c's context positions [begin[i], begin[i] + key_len[i]) of each request, placed at
  /// key rows key_begin[i]; returns the chunk's keys. A request whose context is used up has no
  /// keys in it (output 0, LSE -inf, which the merges skip).
  int64_t chunk(int64_t c, int64_t share, std::vector<int64_t>& begin,
                std::vector<int64_t>& key_begin, std::vector<int64_t>& key_len) const;
};
PrefillPlan plan_prefill(const AttentionMetadata& md, const std::vector<int>& requests);

/// One pass's metadata over expanded rows seen as one-token blocks: request i's queries are its
/// prefill rows, its keys the key_len[i] rows from key_begin[i] (block b = expanded row b).
/// Causal, a request's keys are its own new tokens (context 0 as the pass sees it).
StepMetadata one_token_block_step(const std::vector<PrefillRequest>& reqs,
                                  const std::vector<int64_t>& key_begin,
                                  const std::vector<int64_t>& key_len, bool causal);

/// The absorbed weights' device copies the device path reads (float32, on the layer's device).
struct MLADeviceWeightsView {
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
  /// is read from it). `stream` goes to the backend's calls (host tensors: unused).
  void forward(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe,
               const AttentionMetadata& md, const std::vector<int>& requests,
               const KVCacheView& cache, float k_scale, const MLAWeights& weights,
               ForwardContext& context, const TensorView& output, Stream stream);

  /// The same on device tensors (mla_prefill_device.cpp), every step enqueued on `stream`: the
  /// gathers, expansions and output rows by the backend's MLADeviceOps, the attention and
  /// merges by the backend. Eager only: it allocates its buffers and uploads the passes'
  /// metadata and key lists, so a step with prefill requests cannot be graph-captured (vLLM
  /// captures decode-only steps in full graphs for the same reason). `md` is the step's device
  /// metadata with its host mirrors.
  void forward_device(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe,
                      const AttentionMetadata& md, const std::vector<int>& requests,
                      const KVCacheView& cache, float k_scale, const MLADeviceWeightsView& weights,
                      ForwardContext& context, const TensorView& output, Stream stream);

 private:
  // One attention call over expanded K/V rows [num_keys, N, P + R] as one-token blocks; output
  // [Tp, N, P + R] and lse [N, Tp]; scratch from the context's workspace; `md` is validated on
  // the host and copied to the query's device.
  void attend(const AttentionConfig& config, AttentionImpl& impl, StepMetadata& md,
              const TensorView& query, const TensorView& key, const TensorView& value,
              ForwardContext& context, const TensorView& output, const TensorView& lse,
              Stream stream);

  MLAOptions options_;
  const Backend* backend_ = nullptr;
  AttentionConfig causal_config_, context_config_;
  // Width of the expanded V rows and of the attention output: v_head_dim where the backend
  // serves a V head size of its own, else P + R (V zero-padded up to the Q/K size).
  int v_width_ = 0;
  std::unique_ptr<AttentionImpl> causal_impl_, context_impl_;
};

}  // namespace pagedattn::detail
