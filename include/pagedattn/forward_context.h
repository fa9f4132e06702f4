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
class KVConnector;

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

  /// The KV connector whose worker-side hooks the layers call (not owned; nullptr = none, the
  /// default). Set it between steps. A step calls it only when it holds metadata at begin_step:
  /// begin_step calls start_load_kv, end_step wait_for_save (spec 8.1).
  void set_kv_connector(KVConnector* connector);
  KVConnector* kv_connector() const { return kv_connector_; }
  /// The connector when this step calls its hooks, else nullptr (a profiling step, no
  /// connector, or no metadata bound): without a connector a layer pays this one check.
  KVConnector* active_kv_connector() const { return connector_active_ ? kv_connector_ : nullptr; }

 private:
  friend class Attention;
  void register_layer(Attention* layer);  // throws on duplicate names
  void unregister_layer(Attention* layer);

  // (group, backend, heads, KV heads, head size, window, type, query_quant)
  using PlanKey = std::tuple<int, const Backend*, int, int, int, int, int, bool>;
  int pipeline_parallel_size_;
  std::vector<std::pair<std::string, Attention*>> layers_;
  bool in_step_ = false;
  bool profiling_ = false;
  int virtual_engine_ = 0;
  std::vector<const AttentionMetadata*> metadata_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
  std::set<std::tuple<int, int, int64_t, int>> validated_;  // (group, type, blocks, block size)
  std::map<std::pair<int, int>, Tensor> workspaces_;        // (device type, index) -> buffer
  KVConnector* kv_connector_ = nullptr;
  bool connector_active_ = false;  // this step calls kv_connector_'s hooks
};

}  // namespace pagedattn
