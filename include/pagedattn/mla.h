// MLAAttention: DeepSeek-V2/V3 multi-head latent attention (spec section 5) over a paged
// latent cache, in the absorbed (decode) formulation for every token.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/case_file.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/layer.h"
#include "pagedattn/registry.h"

namespace pagedattn {

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
};

/// The layer. Every token runs the absorbed formulation (spec 5.4's decode path): the query's
/// no-RoPE part is multiplied by W_UK^T into the latent space, attention runs as MQA of all N
/// heads against one latent KV head of L + R (the cache entry, also used as V: the output's
/// last R columns are dropped), and the latent output is projected by W_UV. It equals the
/// prefill formulation exactly in real arithmetic (q_nope . W_UK kv_c = (q_nope W_UK^T) . kv_c,
/// P (kv_c W_UV) = (P kv_c) W_UV). This version computes the projections on the host: CPU
/// tensors only (the CUDA MLA kernels are issue 7's next part); the attention itself runs on the
/// selected backend (cpu or ref), every fp8 latent cache included.
class MLAAttention {
 public:
  MLAAttention(ForwardContext& context, const MLAOptions& options,
               const Registry& registry = default_registry());

  /// The latent attention as the backends see it: N heads, 1 KV head, head_size L + R, causal.
  const AttentionConfig& config() const { return config_; }
  const Backend& backend() const { return *backend_; }
  int v_head_dim() const { return options_.v_head_dim; }
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
  /// [T, 1, R]; output [T, N * V] in the activation dtype (float32 / float64 also accepted, for
  /// checks), rows [0, num_actual_tokens) written. Writes the step's
  /// latent entries (slot -1 skipped), then attends; reads the step's metadata (KV-cache group
  /// 0) from the context; a profiling step zeroes the output.
  void forward(const TensorView& q, const TensorView& kv_c_normed, const TensorView& k_pe,
               const TensorView& output);

 private:
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
};

/// One step of an MLAAttention layer as it ran, for check_mla_step. Host tensors and views.
struct MLAStepCase {
  MLAOptions options;          ///< the layer's (attn_backend, device and calibration are ignored)
  TensorView kv_b_proj;        ///< [L, N * (P + V)], as given to load_kv_b_proj
  float k_scale = 1.0f;        ///< the latent scale the step ran with (fp8 caches)
  TensorView latent_cache;     ///< before the step: [num_blocks, block_size, L + R], cache dtype
  AttentionMetadata metadata;  ///< the step (KV-cache group 0), host views
  TensorView q;                ///< [T, N, P + R]
  TensorView kv_c_normed;      ///< [T, L]
  TensorView k_pe;             ///< [T, R]
};

/// Checks an MLA step's `output` [T, N * V] and `latent_cache_after` (host) against the same
/// layer with its attention on the float64 reference backend, output in float64 (the oracle),
/// within the budget of the low-precision reference (accuracy.h, default_tolerance(dtype)); the
/// latent cache must be bit-identical to the reference's write. The layer's own projections
/// (absorption, up-projection) run in all three, so this checks what the backend computes;
/// tests/unit/test_mla.cpp checks the projections against the non-absorbed formulation.
CaseCheck check_mla_step(const MLAStepCase& step, const TensorView& output,
                         const TensorView& latent_cache_after);

}  // namespace pagedattn
