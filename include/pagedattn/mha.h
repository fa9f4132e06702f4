// MultiHeadAttention: vLLM's no-cache dense attention for vision encoders (spec section 6).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "pagedattn/backend.h"
#include "pagedattn/config.h"
#include "pagedattn/metadata.h"
#include "pagedattn/registry.h"

namespace pagedattn {

/// vLLM's MultiHeadAttention.__init__ parameters.
struct MultiHeadAttentionOptions {
  int num_heads = 0;
  int head_size = 0;
  float scale = 0.0f;
  std::optional<int> num_kv_heads;          ///< unset = num_heads; must divide num_heads
  std::string prefix;                       ///< kept only so the layer can stand in for Attention
  std::optional<std::string> attn_backend;  ///< force a backend by name
  DType dtype = DType::kBF16;
  Device device{};
};

/// Full bidirectional attention per batch element, no cache, no mask: the backends' encoder-only
/// path with one request per batch element (query b's keys are key rows of batch element b).
class MultiHeadAttention {
 public:
  /// Validates (num_heads divisible by num_kv_heads, ...) and selects a backend, explaining
  /// any refusal.
  explicit MultiHeadAttention(const MultiHeadAttentionOptions& options,
                              const Registry& registry = default_registry());
  ~MultiHeadAttention();
  MultiHeadAttention(const MultiHeadAttention&) = delete;
  MultiHeadAttention& operator=(const MultiHeadAttention&) = delete;

  const AttentionConfig& config() const { return config_; }
  const Backend& backend() const { return *backend_; }

  /// query [B, Sq, Hq*D] or [B, Sq, Hq, D]; key / value [B, Skv, Hkv*D] or 4-D, on the
  /// layer's device in its dtype; output like query. Sq must equal Skv (key lengths other than
  /// the query's are not supported yet: NotSupported). Per-(B, S) metadata is built once and
  /// kept on the device, so repeated shapes launch without host work beyond the plan.
  void forward(const TensorView& query, const TensorView& key, const TensorView& value,
               const TensorView& output, Stream stream = {});
  Tensor forward(const TensorView& query, const TensorView& key, const TensorView& value);

 private:
  struct Step {
    StepMetadata host;
    AttentionMetadata device;
  };
  const Step& step_for(int batch, int seq);

  AttentionConfig config_;
  Device device_;
  const Backend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  std::map<std::pair<int, int>, std::unique_ptr<Step>> steps_;
  Tensor workspace_;
  size_t workspace_bytes_ = 0;
};

}  // namespace pagedattn
