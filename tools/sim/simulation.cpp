#include "sim/simulation.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "pagedattn/connector.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/metadata.h"
#include "sim/bandwidth.h"
#include "sim/presets.h"
#include "sim/scheduler.h"
#include "sim/sim_layer.h"

namespace pagedattn::sim {

using detail::cat;
using detail::require;

namespace {

using Clock = std::chrono::steady_clock;

// Short requests keep the default run quick; --max-model-len raises it up to the model's.
constexpr int64_t kDefaultMaxModelLen = 1024;

int64_t resolve_max_model_len(const SimOptions& o, const ModelPreset& preset) {
  return o.max_model_len.value_or(std::min(preset.max_model_len, kDefaultMaxModelLen));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// (query, key) pairs a request's step attends over: query i (at position c + i) sees
// min(window, c + i + 1) keys.
int64_t visible_pairs(int64_t c, int64_t q, std::optional<int> window) {
  if (!window) return q * c + q * (q + 1) / 2;
  const int64_t w = *window, lo = c + 1, hi = c + q;
  int64_t pairs = 0;
  const int64_t b = std::min(hi, w);
  if (b >= lo) pairs += (lo + b) * (b - lo + 1) / 2;
  const int64_t a = std::max(lo, w + 1);
  if (hi >= a) pairs += w * (hi - a + 1);
  return pairs;
}

// Keys a request's step reads at least once: every position from the first query's window on.
int64_t keys_read(int64_t c, int64_t q, std::optional<int> window) {
  return window ? std::min(c + q, q + *window - 1) : c + q;
}

// splitmix64's finaliser: a well-mixed 64-bit function of a 64-bit value.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A digest of one output row (equal rows, equal digests; a flipped bit changes it).
uint64_t row_digest(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = mix64(bytes);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = mix64(h ^ w);
  }
  for (; i < bytes; ++i) h = mix64(h ^ p[i]);
  return h;
}

// The blocks one verified step touches, renumbered 1..n (0 stays the null block), so that its
// case file holds only those blocks.
struct Compaction {
  std::vector<int32_t> old_ids{kNullBlock};  // new id -> physical id
  std::unordered_map<int32_t, int32_t> new_id{{kNullBlock, kNullBlock}};

  explicit Compaction(const std::vector<int32_t>& used) {
    std::vector<int32_t> ids = used;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (const int32_t b : ids) {
      if (b == kNullBlock) continue;
      new_id[b] = int32_t(old_ids.size());
      old_ids.push_back(b);
    }
  }
  // Contiguous host copy of the compacted blocks of `cache` (any tensor whose dim 0 is blocks).
  Tensor gather(const TensorView& cache) const {
    std::vector<int64_t> shape = cache.shape_vector();
    shape[0] = int64_t(old_ids.size());
    Tensor out = Tensor::empty(shape, cache.dtype);
    for (size_t i = 0; i < old_ids.size(); ++i) {
      copy_tensor(out.view().select(0, int64_t(i)), cache.select(0, old_ids[i]));
    }
    return out;
  }
};

// One model: its layers in one forward context, their caches and the plan behind them.
class Engine {
 public:
  Engine(const SimOptions& options, const ModelPreset& preset, SimReport& report);
  void run(const std::vector<WorkloadRequest>& workload);

 private:
  void build_layers();
  int64_t auto_budget(const std::vector<LayerCacheSpec>& specs, const SchedulerLimits& limits,
                      const std::vector<WorkloadRequest>& workload) const;
  void plan_caches(const std::vector<WorkloadRequest>& workload);
  void make_activation_pool();
  void make_connector();
  void run_step(const SchedulerOutput& out);
  TensorView activation(uint64_t salt, int64_t rows, int64_t cols) const;
  // [tokens, cols] rows of the step's tokens for `layer`: each a window of the pool chosen by
  // (the token's prefix, layer, which of q/k/v), so a token has the same rows in every run.
  TensorView keyed_activation(const SchedulerOutput& out, int layer, int which, int64_t cols);
  const std::vector<uint64_t>& prefix_keys(const Request& r, int upto);
  void record_digest(const SchedulerOutput& out, int layer, const TensorView& output);
  void write_digest() const;
  void verify_layer(int layer, const SchedulerOutput& out, const StepMetadata& md,
                    const Compaction& compaction, const Tensor& cache_before,
                    const std::vector<TensorView>& inputs, const TensorView& output);

  const SimOptions& o_;
  const ModelPreset& preset_;
  SimReport& report_;
  int64_t max_model_len_ = 0;
  ForwardContext context_;
  std::vector<std::unique_ptr<SimLayer>> layers_;
  std::vector<int> group_of_;                     // [layer] KV-cache group
  std::vector<std::vector<int>> group_layers_;    // [group] layer indices
  std::vector<std::optional<int>> group_window_;  // [group]
  std::vector<const SimCache*> cache_of_;         // [layer]
  std::vector<SimCache> caches_;                  // one per planned tensor
  KVCachePlan plan_;
  Tensor pool_;    // [pool_elements] random activations, windows of it feed every layer
  Tensor output_;  // [max_num_batched_tokens, the layers' output width]
  int64_t pool_slack_ = 0;
  std::unique_ptr<Scheduler> scheduler_;
  // Token-keyed activations (with a connector or a digest).
  bool keyed_ = false;
  Tensor pool_host_;                                            // the pool on the host
  std::vector<Tensor> keyed_host_, keyed_device_;               // [q, k, v] row buffers
  std::unordered_map<int, std::vector<uint64_t>> prefix_keys_;  // request -> [position]
  // Digest: (request, position, layer) -> row digest; this step's rows wait for its outcome.
  std::map<std::tuple<int, int, int>, uint64_t> digest_;
  std::vector<std::pair<std::tuple<int, int, int>, uint64_t>> step_digest_;
  // The connector's two halves: the scheduler's and the worker's (set in the context).
  std::unique_ptr<KVConnector> scheduler_connector_, worker_connector_;
  int64_t step_ = 0;
  bool verify_due_ = false;
  double worst_ratio_ = 0;  // max |error| / budget over the checks so far
};

Engine::Engine(const SimOptions& options, const ModelPreset& preset, SimReport& report)
    : o_(options), preset_(preset), report_(report) {
  max_model_len_ = resolve_max_model_len(o_, preset_);
  require(max_model_len_ >= 2 && max_model_len_ <= preset_.max_model_len, "--max-model-len (",
          max_model_len_, ") must be in [2, ", preset_.max_model_len, "] for preset ",
          preset_.name);
  require(o_.verify_every >= 0, "--verify-every (", o_.verify_every, ") must be >= 0");
  require(o_.verify_layers >= 1, "--verify-layers (", o_.verify_layers, ") must be >= 1");
  require(o_.verify_max_work >= 1, "--verify-max-work (", o_.verify_max_work, ") must be >= 1");
  build_layers();
}

void Engine::build_layers() {
  layers_ = make_sim_layers(preset_, o_, context_);
}

int64_t Engine::auto_budget(const std::vector<LayerCacheSpec>& specs, const SchedulerLimits& limits,
                            const std::vector<WorkloadRequest>& workload) const {
  // One block of every tensor: the bytes one pool block costs.
  const KVCachePlan probe =
      plan_kv_cache(specs, std::numeric_limits<int64_t>::max() / 4, limits, int64_t(1));
  int64_t bytes_per_block = 0;
  for (const KVCacheTensorPlan& t : probe.tensors) bytes_per_block += t.size_bytes;
  int64_t demand = 0;  // blocks if every request ran at once, at its full length
  for (const WorkloadRequest& r : workload) {
    const int64_t len = int64_t(r.prompt.size()) + r.output_len - 1;
    for (const KVCacheGroup& g : probe.groups) {
      int64_t blocks = ceil_div(len, o_.block_size);
      if (g.spec.kind == KVCacheSpecKind::kSlidingWindow) {
        blocks = std::min(
            blocks,
            ceil_div(*g.spec.sliding_window - 1 + o_.max_num_batched_tokens, o_.block_size) + 1);
      }
      demand += blocks;
    }
  }
  const int64_t blocks = std::max(probe.num_blocks_per_request, ceil_div(demand, 2)) + 1;
  return blocks * bytes_per_block;
}

void Engine::plan_caches(const std::vector<WorkloadRequest>& workload) {
  std::vector<LayerCacheSpec> specs;
  for (const auto& layer : layers_) specs.push_back({layer->name(), layer->kv_cache_spec()});
  const SchedulerLimits limits{max_model_len_, o_.max_num_batched_tokens, 0};
  const int64_t budget =
      o_.kv_cache_memory ? *o_.kv_cache_memory : auto_budget(specs, limits, workload);
  report_.kv_cache_budget = budget;
  report_.kv_cache_budget_auto = !o_.kv_cache_memory;
  require(budget > 0, "--kv-cache-memory (", budget, " bytes) must be > 0");
  try {
    plan_ = plan_kv_cache(specs, budget, limits);
  } catch (const InvalidArgument& e) {
    detail::fail("--kv-cache-memory (", budget,
                 " bytes) does not fit the model at --max-model-len ", max_model_len_, ": ",
                 e.what());
  }
  // The planner checks bytes; the null block also costs one block of every tensor.
  if (plan_.num_blocks - 1 < plan_.num_blocks_per_request) {
    int64_t bytes_per_block = 0;
    for (const KVCacheTensorPlan& t : plan_.tensors) {
      bytes_per_block += plan_.num_blocks > 0 ? t.size_bytes / plan_.num_blocks : 0;
    }
    detail::fail("--kv-cache-memory (", budget, " bytes) gives ", plan_.num_blocks, " blocks, ",
                 plan_.num_blocks - 1, " usable after the null block; one request of",
                 " max_model_len ", max_model_len_, " needs ", plan_.num_blocks_per_request,
                 "; give at least ", (plan_.num_blocks_per_request + 1) * bytes_per_block,
                 " bytes or lower --max-model-len");
  }
  require(plan_.num_blocks <= std::numeric_limits<int32_t>::max(), "--kv-cache-memory (", budget,
          " bytes) gives ", plan_.num_blocks, " blocks, more than int32 block ids hold");

  std::map<std::string, int> index_of;
  for (size_t i = 0; i < layers_.size(); ++i) index_of[layers_[i]->name()] = int(i);
  group_of_.assign(layers_.size(), -1);
  for (size_t g = 0; g < plan_.groups.size(); ++g) {
    const KVCacheGroup& group = plan_.groups[g];
    group_layers_.emplace_back();
    for (const std::string& name : group.layer_names) {
      group_of_[size_t(index_of.at(name))] = int(g);
      group_layers_.back().push_back(index_of.at(name));
    }
    group_window_.push_back(group.spec.kind == KVCacheSpecKind::kSlidingWindow
                                ? group.spec.sliding_window
                                : std::nullopt);
    GroupReport gr;
    gr.kind = std::string(kv_cache_spec_kind_name(group.spec.kind));
    gr.sliding_window = group_window_.back();
    gr.num_layers = int(group.layer_names.size());
    report_.groups.push_back(gr);
  }
  cache_of_.assign(layers_.size(), nullptr);
  caches_.reserve(plan_.tensors.size());
  for (const KVCacheTensorPlan& t : plan_.tensors) {
    const SimLayer& owner = *layers_[size_t(index_of.at(t.shared_by.front()))];
    const AttentionConfig& first = owner.config();
    caches_.push_back(owner.allocate_cache(plan_.num_blocks));
    report_.kv_cache_bytes += t.size_bytes;
    for (const std::string& name : t.shared_by) {
      const int i = index_of.at(name);
      const AttentionConfig& c = layers_[size_t(i)]->config();
      require(c.num_kv_heads == first.num_kv_heads && c.head_size == first.head_size &&
                  c.cache_dtype() == first.cache_dtype(),
              "layers ", t.shared_by.front(), " and ", name,
              " share a cache tensor but differ in cache geometry");
      layers_[size_t(i)]->bind_cache(caches_.back(), group_of_[size_t(i)]);
      cache_of_[size_t(i)] = &caches_.back();
    }
  }
  report_.num_blocks = plan_.num_blocks;
  report_.usable_blocks = plan_.num_blocks - 1;
}

void Engine::make_activation_pool() {
  // Every input and output row of the step fits in the pool at any offset up to the slack.
  const SimLayer& layer = *layers_.front();
  const std::vector<int64_t> widths = layer.input_widths();
  const int64_t row =
      std::max(layer.output_width(), *std::max_element(widths.begin(), widths.end()));
  pool_slack_ = int64_t(1) << 20;
  const int64_t n = int64_t(o_.max_num_batched_tokens) * row + pool_slack_;
  Tensor host = Tensor::empty({n}, o_.dtype);
  Rng rng(o_.workload.seed ^ 0xac71fa7e5ull);
  for (int64_t i = 0; i < n; ++i) {
    double x = rng.normal();
    if (std::abs(x) < 1e-3) x = 1e-3;  // never zero
    store_element(host.data(), o_.dtype, i, x);
  }
  pool_ = o_.device.is_cpu() ? host : Tensor::copy_of(host.view(), o_.device);
  output_ = Tensor::empty({int64_t(o_.max_num_batched_tokens), layer.output_width()}, o_.dtype,
                          o_.device);
  keyed_ = !o_.kv_connector.empty() || !o_.digest_file.empty();
  if (keyed_) {
    pool_host_ = host;
    const int64_t t = o_.max_num_batched_tokens;
    for (const int64_t cols : widths) {
      keyed_host_.push_back(Tensor::empty({t, cols}, o_.dtype));
      if (!o_.device.is_cpu())
        keyed_device_.push_back(Tensor::empty({t, cols}, o_.dtype, o_.device));
    }
  }
}

const std::vector<uint64_t>& Engine::prefix_keys(const Request& r, int upto) {
  std::vector<uint64_t>& keys = prefix_keys_[r.id];
  while (int(keys.size()) < upto) {
    const size_t p = keys.size();
    const uint64_t parent = p == 0 ? mix64(o_.workload.seed ^ 0x70c3e9ull) : keys[p - 1];
    keys.push_back(mix64(parent ^ (uint64_t(uint32_t(r.token_ids[p])) << 20) ^ p));
  }
  return keys;
}

TensorView Engine::keyed_activation(const SchedulerOutput& out, int layer, int which,
                                    int64_t cols) {
  const size_t es = dtype_size(o_.dtype);
  const int64_t pool_elements = pool_host_.view().numel();
  const auto* pool = static_cast<const char*>(pool_host_.data());
  char* dst = static_cast<char*>(keyed_host_[size_t(which)].data());
  int64_t rows = 0;
  for (const ScheduledRequest& s : out.requests) {
    const Request& r = scheduler_->request(s.request_id);
    const std::vector<uint64_t>& keys = prefix_keys(r, s.context_len + s.num_new_tokens);
    for (int i = 0; i < s.num_new_tokens; ++i) {
      const uint64_t key =
          mix64(keys[size_t(s.context_len + i)] ^ (uint64_t(layer + 1) * 0x9e3779b97f4a7c15ull) ^
                (uint64_t(which + 1) << 56));
      const int64_t offset = int64_t(key % uint64_t(pool_elements - cols + 1));
      std::memcpy(dst, pool + size_t(offset) * es, size_t(cols) * es);
      dst += size_t(cols) * es;
      ++rows;
    }
  }
  const TensorView host = keyed_host_[size_t(which)].view().slice(0, 0, rows);
  if (o_.device.is_cpu()) return host;
  const TensorView device = keyed_device_[size_t(which)].view().slice(0, 0, rows);
  copy_tensor(device, host);
  return device;
}

void Engine::record_digest(const SchedulerOutput& out, int layer, const TensorView& output) {
  const Tensor host = Tensor::copy_of(output, Device::cpu());
  const size_t row_bytes = size_t(host.view().size(1)) * dtype_size(o_.dtype);
  const auto* base = static_cast<const char*>(host.data());
  int64_t row = 0;
  for (const ScheduledRequest& s : out.requests) {
    const int prompt_len = scheduler_->request(s.request_id).prompt_len;
    for (int i = 0; i < s.num_new_tokens; ++i, ++row) {
      const int position = s.context_len + i;
      if (position < prompt_len - 1) continue;  // only rows that produce a token
      step_digest_.push_back(
          {{s.request_id, position, layer}, row_digest(base + size_t(row) * row_bytes, row_bytes)});
    }
  }
}

void Engine::write_digest() const {
  std::ofstream f(o_.digest_file);
  require<Error>(bool(f), "--digest: cannot create '", o_.digest_file, "'");
  // The header names what the rows depend on; the role and the connector do not belong here.
  f << "# pagedattn run digest v1: preset " << preset_.name << ", seed " << o_.workload.seed
    << ", dtype " << dtype_name(o_.dtype) << ", kv cache " << to_string(o_.kv_cache_dtype)
    << "\n# request position layer digest\n";
  char line[96];
  for (const auto& [key, value] : digest_) {
    std::snprintf(line, sizeof line, "%d %d %d %016llx\n", std::get<0>(key), std::get<1>(key),
                  std::get<2>(key), static_cast<unsigned long long>(value));
    f << line;
  }
  require<Error>(bool(f.flush()), "--digest: cannot write '", o_.digest_file, "'");
}

void Engine::make_connector() {
  if (o_.kv_connector.empty()) {
    require(o_.role == KVTransferRole::kBoth, "--role ",
            o_.role == KVTransferRole::kProducer ? "prefill" : "decode",
            " needs a KV connector (--connector storage:/dir or redis://host:port)");
    return;
  }
  require<NotSupported>(!preset_.mla, "--connector: preset ", preset_.name,
                        " runs MLAAttention layers, which have no KV-connector hooks in this "
                        "version");
  KVConnectorConfig c = parse_kv_connector_spec(o_.kv_connector);
  c.kv_role = o_.role;
  // The sim's "weights" are its seed: K/V of a token depend on it.
  c.model = cat(preset_.name, "-seed", o_.workload.seed);
  for (size_t i = 0; i < layers_.size(); ++i)
    c.layers.push_back({layers_[i]->name(), group_of_[i]});
  c.block_size = o_.block_size;
  c.num_kv_heads = preset_.num_kv_heads;
  c.head_size = preset_.head_size;
  c.kv_cache_dtype = o_.kv_cache_dtype;
  c.cache_dtype = layers_.front()->config().cache_dtype();
  if (o_.log) {
    c.log = [log = o_.log](std::string_view m) {
      static std::mutex mu;  // worker threads log too
      std::lock_guard<std::mutex> lock(mu);
      *log << "pagedattn run: " << m << std::endl;
    };
  }
  scheduler_connector_ = make_kv_connector(c, KVConnectorRole::kScheduler);
  worker_connector_ = make_kv_connector(c, KVConnectorRole::kWorker);
  context_.set_kv_connector(worker_connector_.get());
  report_.kv_connector = redact_kv_connector_spec(o_.kv_connector);
}

TensorView Engine::activation(uint64_t salt, int64_t rows, int64_t cols) const {
  Rng rng(salt);
  const int64_t offset = rng.uniform_int(0, pool_slack_);
  void* data = static_cast<char*>(pool_.data()) + size_t(offset) * dtype_size(o_.dtype);
  return TensorView::contiguous(data, o_.dtype, {rows, cols}, o_.device);
}

void Engine::verify_layer(int layer, const SchedulerOutput& out, const StepMetadata& md,
                          const Compaction& compaction, const Tensor& cache_before,
                          const std::vector<TensorView>& inputs, const TensorView& output) {
  const SimLayer& l = *layers_[size_t(layer)];
  const int64_t t = inputs.front().size(0);
  const int bs = o_.block_size;
  // The step exactly as the backend saw it, except that the cache keeps only the blocks the
  // step's block tables name (renumbered by Compaction), so saved cases stay small.
  StepMetadata compacted = md;
  for (int32_t& b : compacted.block_table) {
    // Entries past a request's blocks are padding that no kernel reads: point them at block 0.
    const auto it = compaction.new_id.find(b);
    b = it == compaction.new_id.end() ? kNullBlock : it->second;
  }
  for (int64_t& s : compacted.slot_mapping) {
    if (s >= 0) s = int64_t(compaction.new_id.at(int32_t(s / bs))) * bs + s % bs;
  }
  StepRecord record;
  record.metadata = &compacted;
  record.cache_before = cache_before;
  record.cache_after = compaction.gather(cache_of_[size_t(layer)]->view);
  record.inputs = inputs;
  record.output = output;
  const std::string base = cat(o_.failure_dir, "/pagedattn-run-step", step_, "-layer", layer);
  const LayerCheck result = l.verify(record, base);
  const CaseCheck& check = result.check;
  ++report_.layer_checks;
  const double ratio = check.output.budget() > 0 ? check.output.got.max_abs / check.output.budget()
                                                 : check.output.got.max_abs;
  if (report_.worst.step < 0 || ratio > worst_ratio_) {
    worst_ratio_ = ratio;
    report_.worst = {step_, l.name(), check.output.got.max_abs, check.output.budget()};
  }
  if (check.pass()) return;
  ++report_.failed_checks;
  if (!result.saved_case.empty()) report_.failure_files.push_back(result.saved_case);
  if (o_.log) {
    *o_.log << "verification FAILED: step " << step_ << ", layer " << l.name() << " (backend "
            << l.backend().name() << "), " << out.requests.size() << " requests, " << t
            << " tokens\n"
            << check.to_string();
    if (result.saved_case.empty()) {
      *o_.log << "(this layer kind has no case-file format: the step is not saved)\n";
    } else {
      *o_.log << "case saved to " << result.saved_case << " (replay: pagedattn compute "
              << result.saved_case << " --check)\n";
    }
  }
}

void Engine::run_step(const SchedulerOutput& out) {
  const int num_groups = int(plan_.groups.size());
  const int64_t t = out.num_scheduled_tokens();
  // One metadata per KV-cache group: same queries and lengths, the group's block tables.
  std::vector<StepMetadata> steps;
  std::vector<AttentionMetadata> views;
  for (int g = 0; g < num_groups; ++g) {
    MetadataBuilder b(o_.block_size);
    for (const ScheduledRequest& s : out.requests) {
      b.add({s.context_len, s.num_new_tokens, s.block_ids[size_t(g)]});
    }
    steps.push_back(b.build());
  }
  // Device copies of the tensors (host mirrors stay in `steps`), owned by `steps`.
  for (StepMetadata& s : steps) views.push_back(s.to_device(o_.device));
  std::vector<const AttentionMetadata*> per_group;
  for (const AttentionMetadata& v : views) per_group.push_back(&v);

  // Work per layer of each group, for the report and the verification bound.
  std::vector<int64_t> pairs(size_t(num_groups), 0), keys(size_t(num_groups), 0);
  for (int g = 0; g < num_groups; ++g) {
    for (const ScheduledRequest& s : out.requests) {
      pairs[size_t(g)] += visible_pairs(s.context_len, s.num_new_tokens, group_window_[size_t(g)]);
      keys[size_t(g)] += keys_read(s.context_len, s.num_new_tokens, group_window_[size_t(g)]);
    }
  }
  // Layers checked this step: verify_layers per group, rotating through the group.
  std::vector<char> check_layer(layers_.size(), 0);
  if (o_.verify_every > 0 && step_ % o_.verify_every == 0) verify_due_ = true;
  if (verify_due_) {
    int64_t work = 0;
    for (int g = 0; g < num_groups; ++g) {
      const std::vector<int>& members = group_layers_[size_t(g)];
      const int n = std::min<int>(o_.verify_layers, int(members.size()));
      for (int j = 0; j < n; ++j) {
        const size_t pick = size_t(report_.verified_steps * o_.verify_layers + j) % members.size();
        check_layer[size_t(members[pick])] = 1;
        const AttentionConfig& c = layers_[size_t(members[pick])]->config();
        work += pairs[size_t(g)] * c.num_heads * c.head_size;
      }
    }
    if (work > o_.verify_max_work) {
      std::fill(check_layer.begin(), check_layer.end(), 0);
      ++report_.deferred_checks;
    } else {
      verify_due_ = false;
      ++report_.verified_steps;
    }
  }

  const TensorView output = output_.view().slice(0, 0, t);
  DeviceRuntime& runtime = require_device(o_.device);
  context_.begin_step(per_group);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const uint64_t salt =
        o_.workload.seed * 0x2545f4914f6cdd1dull + uint64_t(step_) * 1000003u + uint64_t(i) * 3u;
    const int layer = int(i);
    SimLayer& l = *layers_[i];
    // Attention: query, key, value; MLA: q, kv_c_normed, k_pe.
    std::vector<TensorView> inputs;
    const std::vector<int64_t> widths = l.input_widths();
    for (int which = 0; which < int(widths.size()); ++which) {
      const int64_t cols = widths[size_t(which)];
      inputs.push_back(keyed_ ? keyed_activation(out, layer, which, cols)
                              : activation(salt + uint64_t(which), t, cols));
    }
    const int g = group_of_[i];
    std::optional<Compaction> compaction;
    Tensor before;
    if (check_layer[i]) {
      // The snapshot must hold the blocks a connector loads for this layer.
      if (KVConnector* c = context_.active_kv_connector()) c->wait_for_layer_load(l.name());
      const auto t0 = Clock::now();
      std::vector<int32_t> used;
      for (const ScheduledRequest& s : out.requests) {
        used.insert(used.end(), s.block_ids[size_t(g)].begin(), s.block_ids[size_t(g)].end());
      }
      compaction.emplace(used);
      before = compaction->gather(cache_of_[i]->view);
      report_.verify_seconds += seconds_since(t0);
    }
    const auto t0 = Clock::now();
    l.forward(inputs, output);
    runtime.synchronize(o_.device.index);  // a no-op on the CPU
    report_.attention_seconds += seconds_since(t0);
    if (!o_.digest_file.empty()) record_digest(out, layer, output);
    if (check_layer[i]) {
      const auto t1 = Clock::now();
      verify_layer(int(i), out, steps[size_t(g)], *compaction, before, inputs, output);
      report_.verify_seconds += seconds_since(t1);
    }
    const AttentionConfig& c = l.config();
    report_.kv_bytes_read += double(keys[size_t(g)]) * l.bytes_per_key();
    report_.attention_flops += 4.0 * double(pairs[size_t(g)]) * double(c.num_heads * c.head_size);
  }
  context_.end_step();
}

void Engine::run(const std::vector<WorkloadRequest>& workload) {
  plan_caches(workload);
  make_activation_pool();
  make_connector();
  SchedulerConfig sc;
  sc.block_size = o_.block_size;
  sc.max_num_batched_tokens = o_.max_num_batched_tokens;
  sc.max_num_seqs = o_.max_num_seqs;
  sc.max_model_len = max_model_len_;
  sc.enable_prefix_caching = o_.enable_prefix_caching;
  sc.group_windows = group_window_;
  scheduler_ = std::make_unique<Scheduler>(sc, plan_.num_blocks);
  scheduler_->set_kv_connector(scheduler_connector_.get());

  const uint64_t seed = o_.workload.seed;
  const int vocab = preset_.vocab_size;
  auto sample = [seed, vocab](const Request& r) {
    return sample_token(seed, r.id, r.num_tokens(), vocab);
  };
  size_t next = 0;
  int64_t clock = 0;
  Progress progress;
  progress.total = int(workload.size());
  while (next < workload.size() || scheduler_->has_unfinished()) {
    while (next < workload.size() && workload[next].arrival_step <= clock) {
      const WorkloadRequest& r = workload[next++];
      scheduler_->add_request(r.id, r.prompt, r.output_len);
    }
    if (!scheduler_->has_unfinished()) {  // idle until the next arrival
      clock = workload[next].arrival_step;
      continue;
    }
    const SchedulerOutput out = scheduler_->schedule();
    require<Error>(!out.requests.empty(), "step ", step_, ": the scheduler found nothing to run (",
                   scheduler_->num_waiting(), " waiting, ", scheduler_->num_running(), " running, ",
                   scheduler_->pool().num_free_blocks(), " free blocks)");
    if (worker_connector_) {
      // Spec 8.1: the scheduler side plans the step's transfers, the worker side does them.
      worker_connector_->bind_connector_metadata(
          scheduler_connector_->build_connector_meta(scheduler_->connector_output(out)));
    }
    step_digest_.clear();
    run_step(out);
    std::vector<int32_t> invalid;  // blocks whose load failed: their requests recompute
    if (worker_connector_) {
      invalid = worker_connector_->get_block_ids_with_load_errors();
      worker_connector_->clear_connector_metadata();
      scheduler_connector_->update_connector_output(invalid);
    }
    for (const auto& [key, value] : step_digest_) {
      const auto& s = *std::find_if(
          out.requests.begin(), out.requests.end(),
          [&](const ScheduledRequest& r) { return r.request_id == std::get<0>(key); });
      if (!Scheduler::holds_any(s, invalid)) digest_[key] = value;  // else discarded, redone
    }
    const std::vector<int> finished = scheduler_->update(out, sample, invalid);
    for (const int id : finished) prefix_keys_.erase(id);
    report_.prefill_tokens += out.num_prefill_tokens;
    report_.decode_tokens += out.num_decode_tokens;
    if (out.num_prefill_tokens > 0 && out.num_decode_tokens > 0) ++report_.mixed_steps;
    report_.finished_requests += int(finished.size());
    ++step_;
    ++clock;
    if (o_.on_progress) {
      progress.step = step_;
      progress.finished = report_.finished_requests;
      progress.running = scheduler_->num_running();
      progress.waiting = scheduler_->num_waiting() + int(workload.size() - next);
      o_.on_progress(progress);
    }
  }
  report_.steps = step_;
  const SchedulerStats& st = scheduler_->stats();
  report_.partial_prefill_chunks = st.partial_prefill_chunks;
  report_.preemptions = st.preemptions;
  report_.lookup_tokens = st.lookup_tokens;
  report_.prefix_hit_tokens = st.prefix_hit_tokens;
  report_.peak_blocks_used = st.peak_blocks_used;
  report_.window_blocks_released = st.window_blocks_released;
  report_.evictions = scheduler_->pool().num_evictions();
  report_.external_hit_tokens = st.external_hit_tokens;
  report_.load_error_requests = st.load_error_requests;
  report_.load_error_tokens = st.load_error_tokens;
  if (worker_connector_) {
    worker_connector_->flush();  // every save in the store before the report
    report_.connector = scheduler_connector_->stats();
    report_.connector += worker_connector_->stats();
  }
  if (!o_.digest_file.empty()) {
    write_digest();
    report_.digest_rows = int64_t(digest_.size());
  }
  if (is_fp8(o_.kv_cache_dtype)) {
    report_.k_scale = layers_.front()->k_scale();
    report_.v_scale = layers_.front()->v_scale();  // unset for MLA: the latent has one scale
  }
  std::map<std::string, int> backends;
  for (const auto& l : layers_) ++backends[std::string(l->backend().name())];
  report_.backends.assign(backends.begin(), backends.end());
}

}  // namespace

SimReport run_simulation(const SimOptions& options) {
  const auto t0 = Clock::now();
  const ModelPreset& preset = find_preset(options.preset);
  SimReport report;
  report.preset = preset.name;
  report.layer_kind = preset.mla ? "MLAAttention" : "Attention";
  report.mla = preset.mla;
  if (preset.mla) {
    report.mla_formulation = std::string(to_string(options.mla_formulation));
    report.mla_context_chunk_tokens = options.mla_context_chunk_tokens;
  }
  report.model_num_layers = preset.model_num_layers;
  report.model_num_heads = preset.model_num_heads;
  report.scaled_down_reason = preset.scaled_down_reason;
  report.num_layers = preset.num_layers;
  report.num_heads = preset.num_heads;
  report.num_kv_heads = preset.num_kv_heads;
  report.head_size = preset.head_size;
  report.dtype = std::string(dtype_name(options.dtype));
  report.kv_cache_dtype = std::string(to_string(options.kv_cache_dtype));
  report.kv_cache_storage_dtype =
      std::string(dtype_name(kv_cache_storage_dtype(options.kv_cache_dtype, options.dtype)));
  report.kv_cache_layout = std::string(to_string(options.kv_cache_layout));
  report.block_size = options.block_size;
  report.max_num_batched_tokens = options.max_num_batched_tokens;
  report.max_num_seqs = options.max_num_seqs;
  report.prefix_caching = options.enable_prefix_caching;
  report.verify_every = options.verify_every;
  report.device = to_string(options.device);

  Engine engine(options, preset, report);
  WorkloadOptions w = options.workload;
  w.max_model_len = resolve_max_model_len(options, preset);
  w.vocab_size = preset.vocab_size;
  report.max_model_len = w.max_model_len;
  report.workload = w;
  std::vector<WorkloadRequest> workload = make_workload(w);
  report.role = std::string(to_string(options.role));
  report.digest_file = options.digest_file;
  if (options.role == KVTransferRole::kProducer) {
    // A prefill instance: compute the prompt and its first token; the decode instance goes on.
    for (WorkloadRequest& r : workload) r.output_len = 1;
  }
  report.num_requests = int(workload.size());
  for (const WorkloadRequest& r : workload) {
    report.workload_prompt_tokens += int64_t(r.prompt.size());
    report.workload_output_tokens += r.output_len;
  }
  engine.run(workload);
  report.wall_seconds = seconds_since(t0);
  if (options.measure_bandwidth) {
    // Much larger than the last-level cache and than the KV caches the run read.
    const size_t bytes =
        size_t(std::clamp<int64_t>(4 * report.kv_cache_bytes, int64_t(1) << 30, int64_t(2) << 30));
    if (options.device.is_cpu()) {
      report.machine_read_bandwidth = measure_read_bandwidth(bytes);
      report.bandwidth_method = "streaming read on every hardware thread, best of 4";
    } else {
      report.machine_read_bandwidth = measure_device_copy_bandwidth(options.device, bytes);
      report.bandwidth_method = "device-to-device copy, bytes read per second, best of 4";
    }
  }
  return report;
}

int64_t parse_byte_size(std::string_view text, std::string_view what) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    ++i;
  }
  const std::string number(text.substr(0, i));
  std::string unit(text.substr(i));
  for (char& ch : unit) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  if (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  static const std::map<std::string, double> kUnits = {{"", 1.0},
                                                       {"b", 1.0},
                                                       {"kib", 1024.0},
                                                       {"mib", 1048576.0},
                                                       {"gib", 1073741824.0},
                                                       {"tib", 1099511627776.0},
                                                       {"kb", 1e3},
                                                       {"mb", 1e6},
                                                       {"gb", 1e9},
                                                       {"tb", 1e12}};
  const auto u = kUnits.find(unit);
  char* end = nullptr;
  const double value = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  require(u != kUnits.end() && !number.empty() && end && *end == '\0' && value > 0 &&
              value * u->second < 9e18,
          what, " '", text, "' is not a positive byte size such as 512MiB, 1.5GiB, 2GB or 1000000");
  return int64_t(std::llround(value * u->second));
}

}  // namespace pagedattn::sim
