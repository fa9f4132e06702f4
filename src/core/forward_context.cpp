#include "pagedattn/forward_context.h"

#include <algorithm>

#include "pagedattn/connector.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {

using detail::require;

ForwardContext::ForwardContext(int pipeline_parallel_size)
    : pipeline_parallel_size_(pipeline_parallel_size) {
  require(pipeline_parallel_size >= 1, "pipeline_parallel_size (", pipeline_parallel_size,
          ") must be >= 1");
}

Attention* ForwardContext::layer(std::string_view name) const {
  for (const auto& [n, l] : layers_)
    if (n == name) return l;
  return nullptr;
}

std::vector<std::string> ForwardContext::layer_names() const {
  std::vector<std::string> names;
  for (const auto& entry : layers_) names.push_back(entry.first);
  return names;
}

void ForwardContext::register_layer(Attention* l) {
  require(!l->name().empty(), "Attention prefix (the layer name) must not be empty");
  if (layer(l->name()) != nullptr) detail::fail("Duplicate layer name: ", l->name());
  layers_.emplace_back(l->name(), l);
}

void ForwardContext::unregister_layer(Attention* l) {
  std::erase_if(layers_, [l](const auto& e) { return e.second == l; });
}

void ForwardContext::begin_step(std::vector<const AttentionMetadata*> metadata_per_group,
                                int virtual_engine) {
  require(virtual_engine >= 0 && virtual_engine < pipeline_parallel_size_, "virtual_engine (",
          virtual_engine, ") is outside [0, pipeline_parallel_size=", pipeline_parallel_size_, ")");
  for (size_t g = 0; g < metadata_per_group.size(); ++g) {
    require(metadata_per_group[g] != nullptr, "begin_step: metadata for group ", g,
            " is null (use begin_profile_step for a profiling run)");
  }
  metadata_ = std::move(metadata_per_group);
  virtual_engine_ = virtual_engine;
  profiling_ = false;
  in_step_ = true;
  plans_.clear();
  validated_.clear();
  // Spec 8.1: the connector starts this step's loads before the first layer runs.
  connector_active_ = kv_connector_ != nullptr && kv_connector_->has_connector_metadata();
  if (connector_active_) kv_connector_->start_load_kv(*this);
}

void ForwardContext::begin_profile_step(int virtual_engine) {
  KVConnector* const connector = kv_connector_;
  kv_connector_ = nullptr;  // a profiling step moves no KV
  begin_step({}, virtual_engine);
  kv_connector_ = connector;
  profiling_ = true;
}

void ForwardContext::set_kv_connector(KVConnector* connector) {
  require(!in_step_, "set_kv_connector: called inside a step; set the connector between steps");
  kv_connector_ = connector;
}

void ForwardContext::end_step() {
  if (connector_active_) {
    connector_active_ = false;
    kv_connector_->wait_for_save();  // the caches may be overwritten after the step
  }
  in_step_ = false;
  profiling_ = false;
  metadata_.clear();
  plans_.clear();
  validated_.clear();
}

bool ForwardContext::first_use(int group, AttentionType attn_type, const CacheGeometry& cache) {
  return validated_.emplace(group, int(attn_type), cache.num_blocks, cache.block_size).second;
}

const AttentionMetadata* ForwardContext::metadata(int group) const {
  require(in_step_, "forward called outside a step: call ForwardContext::begin_step first");
  if (profiling_) return nullptr;
  require(group >= 0 && group < int(metadata_.size()), "no metadata for KV-cache group ", group,
          "; the step provided ", metadata_.size(), " group(s)");
  return metadata_[size_t(group)];
}

const Plan& ForwardContext::plan(int group, const Backend& backend, const AttentionConfig& config) {
  const PlanKey key{group,
                    &backend,
                    config.num_heads,
                    config.num_kv_heads,
                    config.head_size,
                    config.sliding_window.value_or(0),
                    int(config.attn_type),
                    config.query_quant};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    const AttentionMetadata* md = metadata(group);
    require(md != nullptr, "no plan in a profiling step");
    it = plans_.emplace(key, backend.plan(*md, config)).first;
  }
  return *it->second;
}

Workspace ForwardContext::workspace(Device device, size_t bytes) {
  if (bytes == 0) return {};
  Tensor& t = workspaces_[{int(device.type), device.index}];
  if (!t.defined() || t.view().nbytes() < bytes) {
    t = Tensor::empty({int64_t(bytes)}, DType::kU8, device);
  }
  return {t.data(), t.view().nbytes()};
}

}  // namespace pagedattn
