// MultiHeadAttention: vLLM's no-cache dense attention for vision encoders (spec section 6).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "pagedattn/backend.h"
#include "pagedattn/config.h"
#include "pagedattn/metadata.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace detail {
class HeadPad;
}  // namespace detail

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

/// Full bidirectional attention per batch element, no cache, no mask. Query b attends to the
/// key rows of batch element b. With as many keys as queries (Skv == Sq, vision encoders) it is
/// the backends' encoder-only path, one request per batch element. With another key length
/// (cross attention over an encoder's output) it is the backends' cross-attention path: the
/// key / value rows are read in place as a paged cache of one token per block whose block table
/// lists batch element b's rows, so every backend that serves encoder_decoder attention for
/// these sizes serves it, with no copy of K/V.
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

  /// query [B, Sq, Hq*D] or [B, Sq, Hq, D]; key / value [B, Skv, Hkv*D] or 4-D (any Skv;
  /// Skv = 0 gives output 0, as FlashAttention), on the layer's device in its dtype; output
  /// like query.
  /// Skv != Sq runs on the selected backend's cross-attention path (NotSupported, with its
  /// reasons, when that backend refuses it). Per-(B, Sq, Skv) metadata is built once and kept on
  /// the device, so repeated shapes launch without host work beyond the plan. The attention is
  /// enqueued on `stream`; a shape's first call uploads its metadata and may grow the workspace
  /// (synchronous copies and an allocation), so run each shape once before capturing it.
  void forward(const TensorView& query, const TensorView& key, const TensorView& value,
               const TensorView& output, Stream stream = {});
  /// Allocating mode: returns a new output shaped like query (allocates: not for capture).
  Tensor forward(const TensorView& query, const TensorView& key, const TensorView& value,
                 Stream stream = {});

 private:
  struct Step {
    StepMetadata host;
    AttentionMetadata device;
  };
  const Step& step_for(int batch, int seq_q, int seq_kv);
  AttentionImpl& cross_impl();

  AttentionConfig config_;        // the caller's shapes; encoder_only: Skv == Sq
  AttentionConfig run_config_;    // what the backend runs: config_, or its padded head size
  AttentionConfig cross_config_;  // encoder_decoder over a one-token-per-block view: Skv != Sq
  Device device_;
  const Backend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  std::unique_ptr<AttentionImpl> cross_impl_;  // made on the first Skv != Sq call
  std::map<std::tuple<int, int, int>, std::unique_ptr<Step>> steps_;  // (B, Sq, Skv)
  Tensor workspace_;
  size_t workspace_bytes_ = 0;
  std::unique_ptr<detail::HeadPad> pad_;  // set when the backend runs a padded head size
};

}  // namespace pagedattn
