// Model-shape presets for `pagedattn run`: the attention geometry of real models, no weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::sim {

/// The sizes of a multi-head latent attention model (spec 5.1).
struct MLAShape {
  int qk_nope_head_dim = 0;        ///< P
  int qk_rope_head_dim = 0;        ///< R
  int v_head_dim = 0;              ///< V
  int kv_lora_rank = 0;            ///< L: the cached latent (an entry is L + R)
  std::optional<int> q_lora_rank;  ///< recorded only: the model applies q_b_proj before the layer
};

/// What a model's attention layers look like. Layer i uses sliding_window_of(i).
struct ModelPreset {
  std::string name;         ///< "llama-3-8b", ...
  std::string description;  ///< one line for listings
  int num_layers = 0;
  int num_heads = 0;     ///< query heads
  int num_kv_heads = 0;  ///< divides num_heads (MLA: 1, the latent)
  int head_size = 0;     ///< MLA: the latent entry L + R, what the backends attend over
  float scale = 0.0f;    ///< multiplies q.k
  std::optional<float> logits_soft_cap;  ///< tanh cap
  bool sinks = false;                    ///< gpt-oss attention sinks (random per head and seed)
  std::optional<int> sliding_window;     ///< tokens visible (current included); unset = none
  /// The window applies to the even layers only (local/global alternation starting with a
  /// local layer, as in Gemma-2 and gpt-oss); otherwise to every layer (Mistral).
  bool alternating_window = false;
  int64_t max_model_len = 0;  ///< the model's context length
  int vocab_size = 0;         ///< token ids are drawn from [0, vocab_size)
  /// Set: the layers are MLAAttention with these sizes (num_heads, scale above); unset:
  /// Attention.
  std::optional<MLAShape> mla;
  /// The real model's layers and query heads when the preset runs fewer (0 = the same): the
  /// per-head sizes stay the model's, so each layer's kernels see the model's shapes.
  int model_num_layers = 0;
  int model_num_heads = 0;
  /// Non-empty when the preset is scaled down: why, for the report.
  std::string scaled_down_reason;

  /// The window of layer `layer` (nullopt = full attention).
  std::optional<int> sliding_window_of(int layer) const;
  /// "model.layers.<layer>.self_attn.attn", vLLM's prefix.
  static std::string layer_name(int layer);
};

/// Every preset, in listing order: llama-3-8b, qwen2.5-7b, mistral-7b, gemma-2-9b,
/// gpt-oss-20b, deepseek-v3 (MLA, scaled down), tiny.
const std::vector<ModelPreset>& model_presets();
/// The preset called `name`; throws InvalidArgument listing the valid names.
const ModelPreset& find_preset(std::string_view name);
/// "llama-3-8b, qwen2.5-7b, ..." for help texts.
std::string preset_names();

}  // namespace pagedattn::sim
