// The Attention layer: vLLM's Attention module for C++ engines.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/config.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace detail {
class HeadPad;
}  // namespace detail

/// vLLM's CacheConfig fields that the layer reads.
struct CacheConfig {
  KVCacheDType cache_dtype = KVCacheDType::kAuto;
  int block_size = 16;
  bool calculate_kv_scales = false;   ///< calibrate k/v/q scales on the first real batch
  std::optional<int> sliding_window;  ///< model-level default window
  KVCacheLayout layout = KVCacheLayout::kNHD;
};

/// vLLM's Attention.__init__ parameters (C++ has no keyword arguments, so a struct).
struct AttentionOptions {
  int num_heads = 0;
  int head_size = 0;
  float scale = 0.0f;
  std::optional<int> num_kv_heads;          ///< unset = num_heads
  std::vector<float> alibi_slopes;          ///< empty = no ALiBi, else [num_heads]
  std::optional<CacheConfig> cache_config;  ///< unset: auto dtype, block size 16
  std::optional<float> logits_soft_cap;
  std::optional<int> per_layer_sliding_window;  ///< overrides cache_config.sliding_window
  std::string prefix;                           ///< unique layer name
  AttentionType attn_type = AttentionType::kDecoder;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::optional<std::string> attn_backend;  ///< force a backend by name
  std::vector<float> sinks;                 ///< empty = none, else [num_heads]
  DType dtype = DType::kBF16;               ///< model activation dtype
  Device device{};
  /// The checkpoint carries k/v/q scales (vLLM's quant_config with a KV-cache method); they
  /// start at -1 ("absent") until load_kv_scales().
  bool has_checkpoint_kv_scales = false;
  /// The seed's query_quant (AttentionConfig::query_quant): quantise the query to fp8 e4m3 with
  /// q_scale() and let the backend compute in fp8. Needs an fp8 / fp8_e4m3 cache.
  bool quantize_query = false;
  /// Calibrate one k, v and q scale per KV head (q over the query heads of its group) instead
  /// of one per tensor (calculate_kv_scales); the layer's kv_scales() then carry vectors.
  bool per_head_kv_scales = false;
  /// V's head size where it differs from head_size (AttentionConfig::v_head_size): value and
  /// output rows are num_heads x v_head_size. 0 = head_size.
  int v_head_size = 0;
};

/// Scales from one batch (vLLM's calc_kv_scales): q = max|q| / 200, k = max|k| / 200,
/// v = max|v| / 100 (divisors overridable by $PAGEDATTN_{Q,K,V}_SCALE_CONSTANT), each max taken
/// over the whole tensor by `backend` on the tensor's device. Throws InvalidArgument when a
/// tensor holds NaN or infinity.
struct CalibratedScales {
  float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
  /// calc_kv_scales_per_head: [num_kv_heads] each (the floats then stay 1).
  std::vector<float> q_scales, k_scales, v_scales;
  bool all_zero = false;  ///< some tensor (or head) was all zeros: nothing to calibrate on
};
CalibratedScales calc_kv_scales(const Backend& backend, const TensorView& query,
                                const TensorView& key, const TensorView& value);
/// calc_kv_scales per KV head: query [T, num_heads, head_size], key and value
/// [T, num_kv_heads, head_size]; head h's q scale is over query heads [h * G, (h + 1) * G).
CalibratedScales calc_kv_scales_per_head(const Backend& backend, const TensorView& query,
                                         const TensorView& key, const TensorView& value);

class Attention {
 public:
  /// Resolves the window and cache settings, validates, selects a backend (explaining any
  /// refusal), registers under `options.prefix` in `context` and validates KV sharing.
  Attention(ForwardContext& context, const AttentionOptions& options,
            const Registry& registry = default_registry());
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  const std::string& name() const { return name_; }
  const AttentionConfig& config() const { return config_; }
  /// What the backend runs: config(), or config() at the head size padded to the next multiple
  /// of 8 where no backend takes the caller's but one takes that (q, k, v copied into zero-tailed
  /// rows on the stream, the caller's scale, the output's columns copied back). The cache is
  /// then of the padded head size (get_kv_cache_spec).
  const AttentionConfig& run_config() const { return run_config_; }
  const Backend& backend() const { return *backend_; }
  bool calculate_kv_scales() const { return calculate_kv_scales_; }
  /// "head_size=..., num_heads=..., num_kv_heads=..., scale=..., backend=..."
  std::string extra_repr() const;

  /// The cache this layer needs (none for encoder-only layers and KV-sharing consumers).
  std::optional<KVCacheSpec> get_kv_cache_spec() const;
  const std::optional<std::string>& kv_sharing_target() const { return kv_sharing_target_; }

  /// Binds one cache per virtual engine (pipeline_parallel_size of them) and the KV-cache
  /// group whose metadata this layer reads. Consumers of KV sharing bind nothing: they use
  /// their target's caches and group.
  void bind_kv_cache(std::vector<KVCacheView> caches, int kv_cache_group = 0);
  /// The bound cache for the context's current virtual engine (the target's for a consumer).
  KVCacheView kv_cache() const;
  int kv_cache_group() const;

  /// Scales as loaded or calibrated. Start at 1.0.
  float q_scale() const { return q_scale_; }
  float k_scale() const { return k_scale_; }
  float v_scale() const { return v_scale_; }
  /// Per-KV-head scales ([num_kv_heads]; empty = per tensor, the floats above).
  const std::vector<float>& q_scales() const { return q_scales_; }
  const std::vector<float>& k_scales() const { return k_scales_; }
  const std::vector<float>& v_scales() const { return v_scales_; }
  /// The cache's scales (write_kv's and the attention's K/V): floats, or per-head vectors.
  KVScales kv_scales() const { return {k_scale_, v_scale_, 1.0f, k_scales_, v_scales_, {}}; }
  /// Checkpoint scales after weight loading (vLLM's process_weights_after_loading for the KV
  /// quant method): a negative value means "not in the checkpoint".
  void load_kv_scales(float q_scale, float k_scale, float v_scale);
  /// Per-head checkpoint scales: each [num_kv_heads] or empty ("not in the checkpoint"), every
  /// value finite and > 0; the rules of the float overload apply per head.
  void load_kv_scales(const std::vector<float>& q_scales, const std::vector<float>& k_scales,
                      const std::vector<float>& v_scales);
  /// Warnings raised while loading scales (vLLM logs them).
  const std::vector<std::string>& warnings() const { return warnings_; }

  /// Output-buffer mode: query [T, num_heads*head_size] or [T, num_heads, head_size]; key and
  /// value [T_kv, num_kv_heads*head_size] (or 3-D) or undefined views (None); output like
  /// query. Writes rows [0, T_a); optional lse float32 [num_heads, T]. With a v_head_size,
  /// value and output have that head size instead. Every device operation (the cache write,
  /// the attention, a profiling step's zeroing) is enqueued on `stream` (a cudaStream_t for
  /// CUDA tensors; default: the legacy default stream) and nothing waits for it, so a decode
  /// step can be captured in a CUDA graph once the context's plan and workspace exist (the
  /// step's first forward builds them: run it eagerly first).
  void forward(const TensorView& query, const TensorView& key, const TensorView& value,
               const TensorView& output, const TensorView& lse = {}, Stream stream = {});
  /// Allocating mode: returns output [T, num_heads*head_size_v] in the query dtype, zeroed on
  /// `stream` before the attention (rows [T_a, T) stay 0). Allocates: not for graph capture.
  Tensor forward(const TensorView& query, const TensorView& key, const TensorView& value,
                 Stream stream = {});

 private:
  void calibrate_scales(const TensorView& q, const TensorView& k, const TensorView& v);
  const Attention& cache_owner() const;

  ForwardContext& context_;
  std::string name_;
  AttentionConfig config_;      // the caller's shapes
  AttentionConfig run_config_;  // what the backend runs: config_, or its padded head size
  Device device_;
  const Backend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  std::unique_ptr<detail::HeadPad> pad_;  // set when the backend runs a padded head size
  std::optional<std::string> kv_sharing_target_;
  std::vector<KVCacheView> kv_caches_;
  int kv_cache_group_ = 0;
  bool calculate_kv_scales_ = false;
  bool has_checkpoint_scales_ = false;
  float q_scale_ = 1.0f, k_scale_ = 1.0f, v_scale_ = 1.0f;
  bool per_head_scales_ = false;
  std::vector<float> q_scales_, k_scales_, v_scales_;
  std::vector<std::string> warnings_;
};

}  // namespace pagedattn
