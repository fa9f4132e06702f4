#include "sim/presets.h"

#include <cmath>

#include "pagedattn/error.h"

namespace pagedattn::sim {

std::optional<int> ModelPreset::sliding_window_of(int layer) const {
  if (!sliding_window) return std::nullopt;
  if (alternating_window && layer % 2 != 0) return std::nullopt;
  return sliding_window;
}

std::string ModelPreset::layer_name(int layer) {
  return detail::cat("model.layers.", layer, ".self_attn.attn");
}

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = [] {
    std::vector<ModelPreset> p;
    auto add = [&p](std::string name, std::string description, int layers, int heads, int kv_heads,
                    int head_size, int64_t max_model_len, int vocab) -> ModelPreset& {
      ModelPreset m;
      m.name = std::move(name);
      m.description = std::move(description);
      m.num_layers = layers;
      m.num_heads = heads;
      m.num_kv_heads = kv_heads;
      m.head_size = head_size;
      m.scale = 1.0f / std::sqrt(float(head_size));
      m.max_model_len = max_model_len;
      m.vocab_size = vocab;
      p.push_back(std::move(m));
      return p.back();
    };
    add("llama-3-8b", "Llama-3-8B: 32 layers, GQA 32/8, head 128", 32, 32, 8, 128, 8192, 128256);
    add("qwen2.5-7b", "Qwen2.5-7B: 28 layers, GQA 28/4, head 128", 28, 28, 4, 128, 32768, 152064);
    ModelPreset& mistral = add("mistral-7b", "Mistral-7B: 32 layers, GQA 32/8, window 4096", 32, 32,
                               8, 128, 32768, 32000);
    mistral.sliding_window = 4096;
    ModelPreset& gemma = add(
        "gemma-2-9b", "Gemma-2-9B: 42 layers, GQA 16/8, head 256, soft cap 50, local 4096 / global",
        42, 16, 8, 256, 8192, 256000);
    gemma.scale = 1.0f / 16.0f;  // query_pre_attn_scalar 256
    gemma.logits_soft_cap = 50.0f;
    gemma.sliding_window = 4096;
    gemma.alternating_window = true;
    ModelPreset& oss =
        add("gpt-oss-20b", "gpt-oss-20b: 24 layers, GQA 64/8, head 64, sinks, window 128 / full",
            24, 64, 8, 64, 131072, 201088);
    oss.sinks = true;
    oss.sliding_window = 128;
    oss.alternating_window = true;
    // DeepSeek-V3's MLA (spec 5.1): 128 heads, qk_nope 128, qk_rope 64, v_head 128,
    // kv_lora_rank 512, q_lora_rank 1536; the backends see 1 KV head of 512 + 64. The softmax
    // scale is (qk_nope + qk_rope)^-0.5 times YaRN's mscale^2, mscale = 0.1 * ln(40) + 1 for
    // rope factor 40 (mscale_all_dim 1), as the model computes it. MLAAttention computes its
    // projections on the host in this version, so the preset runs 4 of the 61 layers and 16 of
    // the 128 heads: the per-head sizes, the latent cache and the kernels' shapes are the
    // model's; the work per layer is an eighth.
    ModelPreset& dsv3 = add("deepseek-v3",
                            "DeepSeek-V3 (MLA, scaled to 4 of 61 layers and 16 of 128 heads): "
                            "latent 512 + rope 64, qk_nope 128, v_head 128",
                            4, 16, 1, 512 + 64, 163840, 129280);
    const float mscale = 0.1f * std::log(40.0f) + 1.0f;
    dsv3.scale = mscale * mscale / std::sqrt(float(128 + 64));
    dsv3.mla = MLAShape{128, 64, 128, 512, 1536};
    dsv3.model_num_layers = 61;
    dsv3.model_num_heads = 128;
    dsv3.scaled_down_reason =
        "MLAAttention's projections run on the host in this version; per-head sizes, latent "
        "cache and kernel shapes are the model's";
    ModelPreset& tiny = add("tiny", "tiny (tests): 2 layers, GQA 4/2, head 32, window 64 / full", 2,
                            4, 2, 32, 2048, 1000);
    tiny.sliding_window = 64;
    tiny.alternating_window = true;
    return p;
  }();
  return presets;
}

std::string preset_names() {
  std::string names;
  for (const ModelPreset& p : model_presets()) names += (names.empty() ? "" : ", ") + p.name;
  return names;
}

const ModelPreset& find_preset(std::string_view name) {
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) return p;
  }
  detail::fail("--preset '", name, "' is not a model preset; valid presets: ", preset_names());
}

}  // namespace pagedattn::sim
