// The layer interface the simulation engine drives, so that one engine runs both kinds of model
// layer: Attention (K/V pages, query/key/value inputs) and MLAAttention (a latent page per
// token, q/kv_c_normed/k_pe inputs, projections inside the layer).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pagedattn/case_file.h"
#include "pagedattn/config.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/metadata.h"
#include "pagedattn/registry.h"
#include "pagedattn/tensor.h"
#include "sim/presets.h"

namespace pagedattn::sim {

struct SimOptions;

/// One tensor of the cache plan: its storage and the view a layer binds, blocks first
/// (Attention: [num_blocks, 2, block_size, num_kv_heads, head_size] in NHD or HND strides;
/// MLA: [num_blocks, block_size, L + R]).
struct SimCache {
  Tensor storage;
  TensorView view;
};

/// One verified step of one layer, with the cache reduced to the blocks the step's block
/// tables name (renumbered 1..n; 0 stays the null block) so that a saved case stays small.
struct StepRecord {
  const StepMetadata* metadata = nullptr;  ///< block table and slots renumbered
  Tensor cache_before, cache_after;        ///< host copies of the reduced cache
  std::vector<TensorView> inputs;          ///< as the layer got them (input_widths() order)
  TensorView output;                       ///< [T, output_width()], where the layer wrote it
};

/// What a verification found, and where a failing step was saved.
struct LayerCheck {
  CaseCheck check;
  std::string saved_case;  ///< the case file of a failing step; empty when none was written
};

/// A model layer as the engine sees it.
class SimLayer {
 public:
  virtual ~SimLayer() = default;
  virtual const std::string& name() const = 0;
  virtual const Backend& backend() const = 0;
  /// What the backends run (MLA: the latent MQA, num_kv_heads 1 and head_size L + R).
  virtual const AttentionConfig& config() const = 0;
  virtual KVCacheSpec kv_cache_spec() const = 0;
  /// A zeroed cache of `num_blocks` blocks in this layer's geometry on the options' device.
  virtual SimCache allocate_cache(int64_t num_blocks) const = 0;
  /// Binds a cache allocated by a layer of the same geometry; the layer reads the metadata of
  /// KV-cache group `group`.
  virtual void bind_cache(const SimCache& cache, int group) = 0;
  /// Columns of each per-token input row, in forward()'s order.
  virtual std::vector<int64_t> input_widths() const = 0;
  virtual int64_t output_width() const = 0;
  /// One step: `inputs` [T, input_widths()[i]] each, `output` [T, output_width()].
  virtual void forward(const std::vector<TensorView>& inputs, const TensorView& output) = 0;
  /// Bytes a step reads for one key it attends to (K and V, or the one latent entry).
  virtual double bytes_per_key() const = 0;
  /// Calibrated fp8 scales (v_scale unset for MLA, whose latent has one scale).
  virtual float k_scale() const = 0;
  virtual std::optional<float> v_scale() const = 0;
  /// Checks a step against the float64 reference (the accuracy rule); a failing step is saved
  /// as `failure_base` + ".safetensors" (with its result beside it) where the layer kind has a
  /// case format.
  virtual LayerCheck verify(const StepRecord& step, const std::string& failure_base) const = 0;
};

/// The preset's layers, registered in `context`: Attention layers, or MLAAttention layers with
/// random kv_b_proj weights (fixed per seed and layer) when the preset is an MLA model.
std::vector<std::unique_ptr<SimLayer>> make_sim_layers(const ModelPreset& preset,
                                                       const SimOptions& options,
                                                       ForwardContext& context);

}  // namespace pagedattn::sim
