// ForwardContext: the layers of a model by name, and one step's metadata per KV-cache group.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

class Attention;

/// An explicit object (no globals) that vLLM splits between the static forward context (layers
/// by name, filled at construction) and the per-step forward context (metadata, virtual engine).
/// Not thread-safe: one context drives one model's steps.
class ForwardContext {
 public:
  explicit ForwardContext(int pipeline_parallel_size = 1);
  ForwardContext(const ForwardContext&) = delete;
  ForwardContext& operator=(const ForwardContext&) = delete;

  /// The layer registered under `name`, or nullptr.
  Attention* layer(std::string_view name) const;
  /// Registered layer names in registration order.
  std::vector<std::string> layer_names() const;
  /// One KV cache per virtual engine (pipeline-parallel micro-batch).
  int pipeline_parallel_size() const { return pipeline_parallel_size_; }

  /// Starts a step: metadata[g] serves the layers of KV-cache group g (pointers must outlive
  /// the step). Plans built during the previous step are dropped.
  void begin_step(std::vector<const AttentionMetadata*> metadata_per_group, int virtual_engine = 0);
  /// Starts a profiling (dummy) step: no metadata; layers zero their output and write nothing.
  void begin_profile_step(int virtual_engine = 0);
  void end_step();
  bool in_step() const { return in_step_; }

  /// This step's metadata for `group`; nullptr in a profiling step. Throws outside a step or
  /// for a group the step did not provide.
  const AttentionMetadata* metadata(int group) const;
  int virtual_engine() const { return virtual_engine_; }

  /// The step's plan for (group, backend, layer shape): built on first request, then shared
  /// by every layer that asks with the same key during this step.
  const Plan& plan(int group, const Backend& backend, const AttentionConfig& config);
  /// True the first time in this step that (group, attn_type, cache geometry) is asked for:
  /// the caller then validates the step's metadata against that cache, once per step.
  bool first_use(int group, AttentionType attn_type, const CacheGeometry& cache);
  /// Scratch memory on `device` of at least `bytes`, kept across steps.
  Workspace workspace(Device device, size_t bytes);

 private:
  friend class Attention;
  void register_layer(Attention* layer);  // throws on duplicate names
  void unregister_layer(Attention* layer);

  using PlanKey = std::tuple<int, const Backend*, int, int, int, int, int>;
  int pipeline_parallel_size_;
  std::vector<std::pair<std::string, Attention*>> layers_;
  bool in_step_ = false;
  bool profiling_ = false;
  int virtual_engine_ = 0;
  std::vector<const AttentionMetadata*> metadata_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
  std::set<std::tuple<int, int, int64_t, int>> validated_;  // (group, type, blocks, block size)
  std::map<std::pair<int, int>, Tensor> workspaces_;        // (device type, index) -> buffer
};

}  // namespace pagedattn
