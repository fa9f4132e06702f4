#include "sim/sim_layer.h"

#include <cmath>
#include <cstring>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/mla.h"
#include "pagedattn/mla_check.h"
#include "sim/simulation.h"
#include "sim/workload.h"

namespace pagedattn::sim {

using detail::require;

namespace {

template <class T>
Tensor tensor_of(const std::vector<T>& values, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::empty(shape, dtype);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
  return t;
}

CacheConfig cache_config_of(const SimOptions& o) {
  CacheConfig cache;
  cache.cache_dtype = o.kv_cache_dtype;
  cache.block_size = o.block_size;
  cache.calculate_kv_scales = is_fp8(o.kv_cache_dtype);  // one-shot, on the first real batch
  cache.layout = o.kv_cache_layout;
  return cache;
}

// vLLM's Attention: query, key and value rows in, K/V pages in the cache.
class AttentionSimLayer final : public SimLayer {
 public:
  AttentionSimLayer(ForwardContext& context, const AttentionOptions& options, KVCacheLayout layout,
                    Device device)
      : layer_(context, options), layout_(layout), device_(device) {}

  const std::string& name() const override { return layer_.name(); }
  const Backend& backend() const override { return layer_.backend(); }
  const AttentionConfig& config() const override { return layer_.config(); }
  KVCacheSpec kv_cache_spec() const override { return *layer_.get_kv_cache_spec(); }
  SimCache allocate_cache(int64_t num_blocks) const override {
    const AttentionConfig& c = layer_.run_config();  // a padded head size's cache is padded
    const KVCache cache = KVCache::allocate(num_blocks, c.block_size, c.num_kv_heads, c.head_size,
                                            c.cache_dtype(), layout_, device_);
    return {cache.storage(), cache.tensor()};
  }
  void bind_cache(const SimCache& cache, int group) override {
    layer_.bind_kv_cache({KVCacheView::from_combined(cache.view)}, group);
  }
  std::vector<int64_t> input_widths() const override {
    const AttentionConfig& c = layer_.config();
    const int64_t kv = int64_t(c.num_kv_heads) * c.head_size;
    return {int64_t(c.num_heads) * c.head_size, kv, kv};
  }
  int64_t output_width() const override {
    return int64_t(layer_.config().num_heads) * layer_.config().head_size;
  }
  void forward(const std::vector<TensorView>& in, const TensorView& output) override {
    layer_.forward(in[0], in[1], in[2], output);
  }
  double bytes_per_key() const override {
    const AttentionConfig& c = layer_.config();
    return 2.0 * c.num_kv_heads * c.head_size * double(dtype_size(c.cache_dtype()));
  }
  float k_scale() const override { return layer_.k_scale(); }
  std::optional<float> v_scale() const override { return layer_.v_scale(); }

  LayerCheck verify(const StepRecord& s, const std::string& failure_base) const override {
    const AttentionConfig& cfg = layer_.config();
    const int hq = cfg.num_heads, hk = cfg.num_kv_heads, d = cfg.head_size;
    const int64_t t = s.inputs[0].size(0);
    const StepMetadata& md = *s.metadata;
    // The case holds the step exactly as the backend saw it, with the reduced cache.
    Case c;
    c.config = cfg;
    c.config.kv_cache_layout = KVCacheLayout::kNHD;  // the case's cache is a contiguous copy
    c.scales = layer_.kv_scales();
    c.query = Tensor::copy_of(s.inputs[0].reshape({t, hq, d}), Device::cpu());
    c.key = Tensor::copy_of(s.inputs[1].reshape({t, hk, d}), Device::cpu());
    c.value = Tensor::copy_of(s.inputs[2].reshape({t, hk, d}), Device::cpu());
    c.kv_cache = s.cache_before;
    const int64_t num_seqs = int64_t(md.seq_lens.size());
    c.block_table =
        tensor_of(md.block_table, DType::kI32, {num_seqs, int64_t(md.max_blocks_per_seq)});
    c.seq_lens = tensor_of(md.seq_lens, DType::kI32, {num_seqs});
    c.query_start_loc = tensor_of(md.query_start_loc, DType::kI32, {num_seqs + 1});
    c.slot_mapping = tensor_of(md.slot_mapping, DType::kI64, {int64_t(md.slot_mapping.size())});
    CaseResult result;
    result.output = Tensor::copy_of(s.output, Device::cpu());
    result.kv_cache = s.cache_after;
    LayerCheck out{check_case(c, result), {}};
    if (!out.check.pass()) {
      out.saved_case = failure_base + ".safetensors";
      save_case(out.saved_case, c);
      save_case_result(failure_base + ".result.safetensors", c, result, layer_.backend().name());
    }
    return out;
  }

 private:
  Attention layer_;
  KVCacheLayout layout_;
  Device device_;
};

// vLLM's MLAAttention: q [T, N*(P+R)], kv_c_normed [T, L] and k_pe [T, R] in, one latent page
// entry of L + R per token in the cache, [T, N*V] out.
class MLASimLayer final : public SimLayer {
 public:
  MLASimLayer(ForwardContext& context, const MLAOptions& options, Tensor kv_b_proj)
      : options_(options), layer_(context, options), kv_b_proj_(std::move(kv_b_proj)) {
    layer_.load_kv_b_proj(kv_b_proj_.view());
  }

  const std::string& name() const override { return options_.prefix; }
  const Backend& backend() const override { return layer_.backend(); }
  const AttentionConfig& config() const override { return layer_.config(); }
  KVCacheSpec kv_cache_spec() const override { return layer_.get_kv_cache_spec(); }
  SimCache allocate_cache(int64_t num_blocks) const override {
    const AttentionConfig& c = layer_.config();
    Tensor t =
        Tensor::zeros({num_blocks, c.block_size, c.head_size}, c.cache_dtype(), options_.device);
    const TensorView view = t.view();
    return {std::move(t), view};
  }
  void bind_cache(const SimCache& cache, int group) override {
    require<Error>(group == 0, "layer ", options_.prefix,
                   ": MLAAttention reads KV-cache group 0; the plan put it in group ", group);
    layer_.bind_kv_cache(cache.view);
  }
  std::vector<int64_t> input_widths() const override {
    const MLAOptions& o = options_;
    return {int64_t(o.num_heads) * (o.qk_nope_head_dim + o.qk_rope_head_dim), o.kv_lora_rank,
            o.qk_rope_head_dim};
  }
  int64_t output_width() const override {
    return int64_t(options_.num_heads) * options_.v_head_dim;
  }
  void forward(const std::vector<TensorView>& in, const TensorView& output) override {
    layer_.forward(q_view(in[0]), in[1], in[2], output);
  }
  double bytes_per_key() const override {
    const AttentionConfig& c = layer_.config();  // one latent entry serves as K and V
    return double(c.head_size) * double(dtype_size(c.cache_dtype()));
  }
  float k_scale() const override { return layer_.k_scale(); }
  std::optional<float> v_scale() const override { return std::nullopt; }

  LayerCheck verify(const StepRecord& s, const std::string&) const override {
    // MLA steps have no case-file format: a failure is reported, not saved.
    const Tensor q = Tensor::copy_of(q_view(s.inputs[0]), Device::cpu());
    const Tensor kv_c = Tensor::copy_of(s.inputs[1], Device::cpu());
    const Tensor k_pe = Tensor::copy_of(s.inputs[2], Device::cpu());
    const Tensor output = Tensor::copy_of(s.output, Device::cpu());
    MLAStepCase c;
    c.options = options_;
    c.kv_b_proj = kv_b_proj_.view();
    c.k_scale = layer_.k_scale();
    c.latent_cache = s.cache_before.view();
    c.metadata = s.metadata->view();
    c.q = q.view();
    c.kv_c_normed = kv_c.view();
    c.k_pe = k_pe.view();
    return {check_mla_step(c, output.view(), s.cache_after.view()), {}};
  }

 private:
  TensorView q_view(const TensorView& q) const {
    const MLAOptions& o = options_;
    return q.reshape({q.size(0), o.num_heads, o.qk_nope_head_dim + o.qk_rope_head_dim});
  }

  MLAOptions options_;
  MLAAttention layer_;
  Tensor kv_b_proj_;  // [L, N*(P+V)] float32, on the host
};

std::unique_ptr<SimLayer> make_mla_layer(const ModelPreset& preset, const SimOptions& o,
                                         ForwardContext& context, int index) {
  const MLAShape& m = *preset.mla;
  MLAOptions a;
  a.num_heads = preset.num_heads;
  a.scale = preset.scale;
  a.qk_nope_head_dim = m.qk_nope_head_dim;
  a.qk_rope_head_dim = m.qk_rope_head_dim;
  a.v_head_dim = m.v_head_dim;
  a.q_lora_rank = m.q_lora_rank;
  a.kv_lora_rank = m.kv_lora_rank;
  a.cache_config = cache_config_of(o);
  a.prefix = ModelPreset::layer_name(index);
  if (!o.backend.empty()) a.attn_backend = o.backend;
  a.dtype = o.dtype;
  a.device = o.device;
  a.formulation = o.mla_formulation;
  a.context_chunk_tokens = o.mla_context_chunk_tokens;
  // The model's kv_b_proj: random here, fixed per seed and layer, N(0, 1/L) so that the
  // absorbed logits and the up-projected output stay of order one.
  const int64_t cols = int64_t(a.num_heads) * (m.qk_nope_head_dim + m.v_head_dim);
  Tensor w = Tensor::empty({m.kv_lora_rank, cols}, DType::kF32);
  Rng rng(o.workload.seed * 0xd1342543de82ef95ull + uint64_t(index) + 1);
  const double sigma = 1.0 / std::sqrt(double(m.kv_lora_rank));
  auto* wp = static_cast<float*>(w.data());
  for (int64_t i = 0; i < w.view().numel(); ++i) wp[i] = float(sigma * rng.normal());
  return std::make_unique<MLASimLayer>(context, a, std::move(w));
}

std::unique_ptr<SimLayer> make_attention_layer(const ModelPreset& preset, const SimOptions& o,
                                               ForwardContext& context, int index) {
  AttentionOptions a;
  a.num_heads = preset.num_heads;
  a.num_kv_heads = preset.num_kv_heads;
  a.head_size = preset.head_size;
  a.scale = preset.scale;
  a.cache_config = cache_config_of(o);
  a.logits_soft_cap = preset.logits_soft_cap;
  a.per_layer_sliding_window = preset.sliding_window_of(index);
  a.prefix = ModelPreset::layer_name(index);
  if (!o.backend.empty()) a.attn_backend = o.backend;
  a.dtype = o.dtype;
  a.device = o.device;
  if (preset.sinks) {
    // Learned per-head logits in the model; here random, fixed per seed and layer.
    Rng rng(o.workload.seed * 0x9e3779b97f4a7c15ull + uint64_t(index) + 1);
    for (int h = 0; h < preset.num_heads; ++h) a.sinks.push_back(float(1.5 * rng.normal()));
  }
  return std::make_unique<AttentionSimLayer>(context, a, o.kv_cache_layout, o.device);
}

}  // namespace

std::vector<std::unique_ptr<SimLayer>> make_sim_layers(const ModelPreset& preset,
                                                       const SimOptions& o,
                                                       ForwardContext& context) {
  if (preset.mla) {
    require<NotSupported>(o.device.is_cpu(), "--device ", to_string(o.device), ": preset ",
                          preset.name,
                          " runs MLAAttention layers, which take host tensors in this version; "
                          "use --device cpu");
    require(o.kv_cache_layout == KVCacheLayout::kNHD, "--kv-cache-layout ",
            to_string(o.kv_cache_layout), " does not apply to preset ", preset.name,
            ": an MLA latent cache has one layout, [num_blocks, block_size, ", preset.head_size,
            "]");
  } else {
    require(o.mla_formulation == MLAFormulation::kSplit &&
                o.mla_context_chunk_tokens == MLAOptions{}.context_chunk_tokens,
            "--mla-formulation ", to_string(o.mla_formulation), " / --mla-context-chunk-tokens ",
            o.mla_context_chunk_tokens, " apply to MLA presets only; preset ", preset.name,
            " runs Attention layers");
  }
  std::vector<std::unique_ptr<SimLayer>> layers;
  for (int i = 0; i < preset.num_layers; ++i) {
    layers.push_back(preset.mla ? make_mla_layer(preset, o, context, i)
                                : make_attention_layer(preset, o, context, i));
  }
  return layers;
}

}  // namespace pagedattn::sim
