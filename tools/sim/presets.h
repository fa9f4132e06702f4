// Model-shape presets for `pagedattn run`: the attention geometry of real models, no weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::sim {

/// What a model's attention layers look like. Layer i uses sliding_window_of(i).
struct ModelPreset {
  std::string name;         ///< "llama-3-8b", ...
  std::string description;  ///< one line for listings
  int num_layers = 0;
  int num_heads = 0;     ///< query heads
  int num_kv_heads = 0;  ///< divides num_heads
  int head_size = 0;
  float scale = 0.0f;                    ///< multiplies q.k
  std::optional<float> logits_soft_cap;  ///< tanh cap
  bool sinks = false;                    ///< gpt-oss attention sinks (random per head and seed)
  std::optional<int> sliding_window;     ///< tokens visible (current included); unset = none
  /// The window applies to the even layers only (local/global alternation starting with a
  /// local layer, as in Gemma-2 and gpt-oss); otherwise to every layer (Mistral).
  bool alternating_window = false;
  int64_t max_model_len = 0;  ///< the model's context length
  int vocab_size = 0;         ///< token ids are drawn from [0, vocab_size)

  /// The window of layer `layer` (nullopt = full attention).
  std::optional<int> sliding_window_of(int layer) const;
  /// "model.layers.<layer>.self_attn.attn", vLLM's prefix.
  static std::string layer_name(int layer);
};

/// Every preset, in listing order: llama-3-8b, qwen2.5-7b, mistral-7b, gemma-2-9b,
/// gpt-oss-20b, tiny.
const std::vector<ModelPreset>& model_presets();
/// The preset called `name`; throws InvalidArgument listing the valid names.
const ModelPreset& find_preset(std::string_view name);
/// "llama-3-8b, qwen2.5-7b, ..." for help texts.
std::string preset_names();

}  // namespace pagedattn::sim
