// MLAAttention: DeepSeek-V2/V3 multi-head latent attention (spec section 5) over a paged
// latent cache: decodes in the absorbed formulation, prefills in the expanded one, as vLLM does.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/layer.h"
#include "pagedattn/registry.h"

namespace pagedattn {

namespace detail {
class MLAPrefill;
struct MLADeviceWeights;
}  // namespace detail

/// Which formulation of spec 5.4 MLAAttention runs a request in.
enum class MLAFormulation {
  kSplit,     ///< vLLM's: query length <= decode_threshold absorbed, longer ones prefill
  kAbsorbed,  ///< every request absorbed (MQA over the latent cache)
  kPrefill,   ///< every request in the prefill formulation (K/V expanded per head)
};
std::string_view to_string(MLAFormulation formulation);
/// Parses "split" | "absorbed" | "prefill"; throws InvalidArgument.
MLAFormulation parse_mla_formulation(std::string_view name);

/// vLLM's MLAAttention.__init__ parameters (N, P, R, V, L in spec 5.1's symbols).
struct MLAOptions {
  int num_heads = 0;               ///< N
  float scale = 0.0f;              ///< (P + R)^-0.5 for DeepSeek (times mscale^2 under YaRN)
  int qk_nope_head_dim = 0;        ///< P
  int qk_rope_head_dim = 0;        ///< R
  int v_head_dim = 0;              ///< V
  std::optional<int> q_lora_rank;  ///< recorded only: the model applies q_b_proj first
  int kv_lora_rank = 0;            ///< L
  std::optional<CacheConfig> cache_config;
  std::string prefix;
  std::optional<std::string> attn_backend;  ///< force a backend by name
  DType dtype = DType::kBF16;
  Device device{};
  /// kSplit is vLLM's; the other two force one formulation on every request (tests, benchmarks).
  MLAFormulation formulation = MLAFormulation::kSplit;
  /// vLLM's reorder_batch_threshold: a request of at most this many new tokens is a decode.
  int decode_threshold = 1;
  /// Latent entries of cached context gathered and expanded at once (the workspace cap; vLLM's
  /// Wt). Each prefill with context gets an equal share per chunk (at least one token).
  int context_chunk_tokens = 4096;
};

/// The layer. Decode requests run the absorbed formulation (spec 5.4's decode path): the query's
/// no-RoPE part is multiplied by W_UK^T into the latent space, attention runs as MQA of all N
/// heads against one latent KV head of L + R (the cache entry, also used as V: the output's
/// last R columns are dropped), and the latent output is projected by W_UV. Prefill requests
/// run the prefill formulation (spec 5.4's prefill path): K = [kv_c W_UK | k_pe] and
/// V = kv_c W_UV per head, ordinary MHA of head size P + R (V zero-padded to it); the step's new
/// tokens attend causally among themselves (from the inputs, as vLLM does: an fp8 cache's
/// rounding does not touch them), the cached context in chunks of at most context_chunk_tokens
/// gathered from the cache (fp8 dequantised with k_scale), non-causal, merged by LSE. Both equal
/// each other in real arithmetic (q_nope . W_UK kv_c = (q_nope W_UK^T) . kv_c,
/// P (kv_c W_UV) = (P kv_c) W_UV); the prefill one costs fewer FLOPs per prefill token at
/// DeepSeek's sizes. Requests are classified one by one, so the batch need not be ordered
/// decodes first. Host tensors: the projections on the host, the attention on the selected
/// backend (cpu or ref), every fp8 latent cache included; the prefill formulation needs the
/// backend to take N heads of P + R with a block size of 1, and its merge_states. Device tensors
/// (layer and cache on that device): every step on the device, the kernels around the attention
/// being the backend's MLADeviceOps (Backend::mla_device_ops(); a backend without them refuses
/// device tensors with NotSupported).
class MLAAttention {
 public:
  MLAAttention(ForwardContext& context, const MLAOptions& options,
               const Registry& registry = default_registry());
  ~MLAAttention();

  /// The latent attention as the backends see it: N heads, 1 KV head, head_size L + R, causal.
  const AttentionConfig& config() const { return config_; }
  const Backend& backend() const { return *backend_; }
  int v_head_dim() const { return options_.v_head_dim; }
  MLAFormulation formulation() const { return options_.formulation; }
  /// MLAAttentionSpec: one latent entry of L + R per token (spec 7.1).
  KVCacheSpec get_kv_cache_spec() const;

  /// kv_b_proj's weight viewed as [L, N * (P + V)] (input-major: row l holds, head by head,
  /// W_UK's P then W_UV's V columns), any float dtype, on the host. Absorbed once, rounded to the
  /// activation dtype as vLLM does: W_UK_T [N, P, L], W_UV [N, L, V].
  void load_kv_b_proj(const TensorView& weight);
  /// The paged latent cache [num_blocks, block_size, L + R] (or [..., 1, L + R]), cache dtype.
  void bind_kv_cache(const TensorView& latent_cache);
  /// fp8 latent caches: stored = saturate(x / k_scale).
  void set_k_scale(float k_scale);
  float k_scale() const { return k_scale_; }
  /// cache_config.calculate_kv_scales: the first forward with real data sets k_scale to
  /// max|kv_c_normed| / 200 (vLLM's calc_kv_scales with k = kv_c_normed, v = k_pe), once.
  bool calculate_kv_scales() const { return calibrate_; }

  /// q [T, N, P + R] (RoPE applied to the last R), kv_c_normed [T, L], k_pe [T, R] or
  /// [T, 1, R], all three in the layer's dtype; output [T, N * V] in the activation dtype
  /// (float32 / float64 also accepted, for checks), rows [0, num_actual_tokens) written. Host
  /// tensors may have any strides. Writes the step's latent entries (slot -1 skipped), then
  /// attends; reads the step's metadata (KV-cache group 0) from the context; a profiling step
  /// zeroes the output. Device tensors: every operation is enqueued on `stream` (a
  /// cudaStream_t; default: the legacy default stream, which a CUDA graph cannot capture); a
  /// decode-only step is capturable after an eager first forward, a step with prefill requests
  /// synchronises `stream` before returning (it frees its buffers). Host tensors: `stream` is
  /// passed to the backend's calls and otherwise unused.
  void forward(const TensorView& q, const TensorView& kv_c_normed, const TensorView& k_pe,
               const TensorView& output, Stream stream = {});

 private:
  // The absorbed formulation for the requests of `md` (rows [0, md.num_actual_tokens)), whose
  // row i is the layer's input and output row rows[i] (empty: the identity).
  void forward_absorbed(const TensorView& q, const AttentionMetadata& md,
                        const std::vector<int64_t>& rows, const Plan& plan,
                        const TensorView& output, Stream stream);
  // forward() on device tensors (mla_device.cpp): every step on the device; md == nullptr is a
  // profiling step.
  void forward_on_device(const TensorView& q, const TensorView& kv_c_normed, const TensorView& k_pe,
                         const AttentionMetadata* md, const TensorView& output, Stream stream);
  // A device step with requests for the prefill formulation (mla_device.cpp): decodes absorbed
  // over metadata of their own, prefills expanded; eager (allocates and synchronises).
  void forward_split_on_device(const TensorView& q, const TensorView& kv_c_normed,
                               const TensorView& k_pe, const AttentionMetadata& md,
                               const std::vector<int>& decodes, const std::vector<int>& prefills,
                               const TensorView& output, Stream stream);

  ForwardContext& context_;
  MLAOptions options_;
  AttentionConfig config_;
  const Backend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  KVCacheView cache_;
  float k_scale_ = 1.0f;
  bool calibrate_ = false;     // a calibration is still owed
  std::vector<float> w_uk_t_;  // [N, P, L]
  std::vector<float> w_uv_;    // [N, L, V]
  std::vector<float> w_uk_;    // [N, L, P]: W_UK_T transposed, the prefill formulation's layout
  std::unique_ptr<detail::MLAPrefill> prefill_;               // built on the first prefill
  std::unique_ptr<detail::MLADeviceWeights> device_weights_;  // on the first device forward
};

}  // namespace pagedattn
