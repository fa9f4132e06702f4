#include "pagedattn/kv_cache_spec.h"

#include <algorithm>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {
// a, b > 0 (no a + b - 1: a may be INT64_MAX).
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}
// Byte counts of sizes and limits up to INT64_MAX: a product or sum past it saturates there,
// and plan_kv_cache refuses a need that saturated (no budget holds it).
constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();
int64_t sat_mul(int64_t a, int64_t b) {  // a, b >= 0
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kSaturated : r;
}
int64_t sat_add(int64_t a, int64_t b) {  // a, b >= 0
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kSaturated : r;
}
}  // namespace

KVCacheSpec KVCacheSpec::full(int block_size, int num_kv_heads, int head_size, DType dtype) {
  return {KVCacheSpecKind::kFullAttention, block_size, num_kv_heads, head_size, dtype, {}};
}
KVCacheSpec KVCacheSpec::sliding(int block_size, int num_kv_heads, int head_size, DType dtype,
                                 int sliding_window) {
  return {
      KVCacheSpecKind::kSlidingWindow, block_size, num_kv_heads, head_size, dtype, sliding_window};
}
KVCacheSpec KVCacheSpec::mla(int block_size, int head_size, DType dtype) {
  return {KVCacheSpecKind::kMLA, block_size, 1, head_size, dtype, {}};
}
KVCacheSpec KVCacheSpec::cross(int block_size, int num_kv_heads, int head_size, DType dtype) {
  return {KVCacheSpecKind::kCrossAttention, block_size, num_kv_heads, head_size, dtype, {}};
}

void KVCacheSpec::validate() const {
  require(block_size > 0, "KVCacheSpec.block_size (", block_size, ") must be > 0");
  require(num_kv_heads > 0, "KVCacheSpec.num_kv_heads (", num_kv_heads, ") must be > 0");
  require(head_size > 0, "KVCacheSpec.head_size (", head_size, ") must be > 0");
  require(kind != KVCacheSpecKind::kMLA || num_kv_heads == 1, "KVCacheSpec.num_kv_heads (",
          num_kv_heads, ") must be 1 for an MLA spec");
  require(v_head_size >= 0 && v_head_size <= head_size, "KVCacheSpec.v_head_size (", v_head_size,
          ") must be 1..head_size (", head_size, "), or 0 for head_size");
  require(kind != KVCacheSpecKind::kMLA || v_head_size == 0, "KVCacheSpec.v_head_size (",
          v_head_size, ") must be 0 for an MLA spec (one latent entry, no separate V)");
  require(is_floating(dtype) || dtype == DType::kU8, "KVCacheSpec.dtype (", dtype_name(dtype),
          ") must be a floating type or uint8");
  if (kind == KVCacheSpecKind::kSlidingWindow) {
    require(sliding_window.has_value(),
            "KVCacheSpec.sliding_window is required for a sliding-window spec");
  }
  if (sliding_window) {
    require(*sliding_window >= 1, "KVCacheSpec.sliding_window (", *sliding_window,
            ") must be >= 1");
  }
  require(page_size_bytes() < kSaturated, "KVCacheSpec page (block_size ", block_size,
          " x num_kv_heads ", num_kv_heads, " x head_size ", head_size,
          kind == KVCacheSpecKind::kMLA ? "" : cat(" + v head_size ", head_size_v()), " x ",
          dtype_size(dtype), " bytes) does not fit in int64 bytes");
}

int64_t KVCacheSpec::page_size_bytes() const {
  // MLA: one latent entry; otherwise K and V, whose head sizes may differ.
  const int64_t width =
      kind == KVCacheSpecKind::kMLA ? int64_t(head_size) : sat_add(head_size, head_size_v());
  const int64_t per_token = sat_mul(sat_mul(num_kv_heads, width), int64_t(dtype_size(dtype)));
  return sat_mul(block_size, per_token);
}

int64_t KVCacheSpec::max_memory_usage_bytes(const SchedulerLimits& limits) const {
  const int64_t page = page_size_bytes();
  switch (kind) {
    case KVCacheSpecKind::kFullAttention:
    case KVCacheSpecKind::kMLA:
      return sat_mul(ceil_div(limits.max_model_len, block_size), page);
    case KVCacheSpecKind::kSlidingWindow: {
      // The window of the first new token plus this step's new tokens; +1 because the window
      // may start mid-block.
      const int64_t tokens =
          std::min<int64_t>(sat_add(int64_t(*sliding_window) - 1, limits.max_num_batched_tokens),
                            limits.max_model_len);
      return sat_mul(sat_add(ceil_div(tokens, block_size), 1), page);
    }
    case KVCacheSpecKind::kCrossAttention:
      return sat_mul(ceil_div(limits.max_num_encoder_input_tokens, block_size), page);
  }
  return 0;
}

std::string_view kv_cache_spec_kind_name(KVCacheSpecKind kind) {
  switch (kind) {
    case KVCacheSpecKind::kFullAttention:
      return "full_attention";
    case KVCacheSpecKind::kSlidingWindow:
      return "sliding_window";
    case KVCacheSpecKind::kMLA:
      return "mla";
    case KVCacheSpecKind::kCrossAttention:
      return "cross_attention";
  }
  return "unknown";
}

std::string describe(const KVCacheSpec& spec) {
  std::string s = cat(kv_cache_spec_kind_name(spec.kind), "(block_size=", spec.block_size,
                      ", num_kv_heads=", spec.num_kv_heads, ", head_size=", spec.head_size,
                      ", dtype=", dtype_name(spec.dtype));
  if (spec.sliding_window) s += cat(", sliding_window=", *spec.sliding_window);
  if (spec.v_head_size > 0) s += cat(", v_head_size=", spec.v_head_size);
  return s + ")";
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "1.25 GiB".
std::string gib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << double(bytes) / kGiB << " GiB";
  return os.str();
}

// Checks names, specs and the limits the specs depend on; errors name the layer.
void validate_layers(std::string_view fn, const std::vector<LayerCacheSpec>& layers,
                     const SchedulerLimits& limits) {
  std::set<std::string_view> names;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerCacheSpec& l = layers[i];
    require(!l.layer_name.empty(), fn, ": layers[", i, "].layer_name is empty");
    require(names.insert(l.layer_name).second, fn, ": layer name '", l.layer_name,
            "' appears more than once (again at layers[", i, "])");
    try {
      l.spec.validate();
    } catch (const InvalidArgument& e) {
      detail::fail(fn, ": layer '", l.layer_name, "': ", e.what());
    }
    if (l.spec.kind == KVCacheSpecKind::kSlidingWindow) {
      require(limits.max_num_batched_tokens >= 1, fn, ": SchedulerLimits.max_num_batched_tokens (",
              limits.max_num_batched_tokens, ") must be >= 1 for the sliding-window layer '",
              l.layer_name, "'");
    }
    if (l.spec.kind == KVCacheSpecKind::kCrossAttention) {
      require(limits.max_num_encoder_input_tokens >= 1, fn,
              ": SchedulerLimits.max_num_encoder_input_tokens (",
              limits.max_num_encoder_input_tokens, ") must be >= 1 for the cross-attention layer '",
              l.layer_name, "'");
    }
  }
  if (!layers.empty()) {
    require(limits.max_model_len >= 1, fn, ": SchedulerLimits.max_model_len (",
            limits.max_model_len, ") must be >= 1");
  }
}

int64_t total_max_memory_usage(const std::vector<LayerCacheSpec>& layers,
                               const SchedulerLimits& limits) {
  int64_t total = 0;
  for (const LayerCacheSpec& l : layers)
    total = sat_add(total, l.spec.max_memory_usage_bytes(limits));
  return total;
}

// Largest M in [1, limits.max_model_len] with total_max_memory_usage(M) <= available, or 0.
// The need never decreases with M, so the feasible lengths are a prefix.
int64_t search_max_model_len(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                             const SchedulerLimits& limits) {
  SchedulerLimits trial = limits;
  const auto fits = [&](int64_t model_len) {
    trial.max_model_len = model_len;
    return total_max_memory_usage(layers, trial) <= available_bytes;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = limits.max_model_len;  // fits(lo) holds
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Layers with one spec, in order of first appearance.
struct SpecBucket {
  KVCacheSpec spec;
  std::vector<std::string> layer_names;
};

std::vector<SpecBucket> bucket_by_spec(const std::vector<LayerCacheSpec>& layers) {
  std::vector<SpecBucket> buckets;
  for (const LayerCacheSpec& l : layers) {
    auto it = std::find_if(buckets.begin(), buckets.end(),
                           [&](const SpecBucket& b) { return b.spec == l.spec; });
    if (it == buckets.end()) {
      buckets.push_back({l.spec, {}});
      it = buckets.end() - 1;
    }
    it->layer_names.push_back(l.layer_name);
  }
  return buckets;
}

// vLLM's UniformTypeKVCacheSpecs: one attention kind and block size (one window for sliding
// windows); head counts, head sizes and dtypes may differ.
bool is_uniform_type(const std::vector<LayerCacheSpec>& layers) {
  const KVCacheSpec& first = layers.front().spec;
  return std::all_of(layers.begin(), layers.end(), [&](const LayerCacheSpec& l) {
    return l.spec.kind == first.kind && l.spec.block_size == first.block_size &&
           (first.kind != KVCacheSpecKind::kSlidingWindow ||
            l.spec.sliding_window == first.sliding_window);
  });
}

[[noreturn]] void fail_ungroupable(const std::vector<SpecBucket>& buckets) {
  std::string specs;
  for (const SpecBucket& b : buckets) {
    specs += cat("\n  ", describe(b.spec), ": page_size_bytes ", b.spec.page_size_bytes(), ", ",
                 b.layer_names.size(), " layer(s), first '", b.layer_names.front(), "'");
  }
  detail::fail<NotSupported>(
      "plan_kv_cache: cannot group these KV-cache specs: they are of different kinds (or block "
      "sizes or windows) and their page sizes differ, so they can share neither one block table "
      "nor one block pool. Specs:",
      specs);
}

// Splits the layers of each spec into groups of about `min layers of any spec` layers by
// strided assignment (group g of k takes layers g, g + k, ...), as vLLM does for hybrid models.
std::vector<KVCacheGroup> hybrid_groups(const std::vector<SpecBucket>& buckets) {
  size_t min_layers = buckets.front().layer_names.size();
  for (const SpecBucket& b : buckets) min_layers = std::min(min_layers, b.layer_names.size());
  std::vector<KVCacheGroup> groups;
  for (const SpecBucket& b : buckets) {
    const size_t n = b.layer_names.size();
    const size_t num_groups = (n + min_layers - 1) / min_layers;
    for (size_t g = 0; g < num_groups; ++g) {
      KVCacheGroup group{{}, b.spec};
      for (size_t i = g; i < n; i += num_groups) group.layer_names.push_back(b.layer_names[i]);
      groups.push_back(std::move(group));
    }
  }
  return groups;
}

// page * num_blocks (num_blocks from num_blocks_override may make it overflow).
int64_t tensor_bytes(int64_t page, int64_t num_blocks) {
  const int64_t bytes = sat_mul(page, num_blocks);
  require(bytes < kSaturated, "plan_kv_cache: num_blocks ", num_blocks, " x page_size_bytes ", page,
          " does not fit in int64 bytes");
  return bytes;
}

}  // namespace

int64_t estimate_max_model_len(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                               const SchedulerLimits& limits) {
  validate_layers("estimate_max_model_len", layers, limits);
  require(limits.max_model_len >= 1, "estimate_max_model_len: SchedulerLimits.max_model_len (",
          limits.max_model_len, ") must be >= 1");
  return search_max_model_len(layers, available_bytes, limits);
}

KVCachePlan plan_kv_cache(const std::vector<LayerCacheSpec>& layers, int64_t available_bytes,
                          const SchedulerLimits& limits,
                          std::optional<int64_t> num_blocks_override) {
  KVCachePlan plan;
  if (layers.empty()) return plan;  // attention-free model: nothing to allocate
  validate_layers("plan_kv_cache", layers, limits);
  if (num_blocks_override) {
    require(*num_blocks_override >= 1, "plan_kv_cache: num_blocks_override (", *num_blocks_override,
            ") must be >= 1");
  }

  // Feasibility (spec 7.2 step 2).
  require(available_bytes > 0,
          "No available memory for the cache blocks (available_bytes = ", available_bytes,
          "). Try increasing gpu_memory_utilization or decreasing the memory used by the model.");
  const int64_t needed = total_max_memory_usage(layers, limits);
  if (needed > available_bytes || needed == kSaturated) {
    const int64_t estimate = search_max_model_len(layers, available_bytes, limits);
    std::string hint;
    if (estimate > 0) {
      hint = cat(" Based on the available memory, the estimated maximum model length is ", estimate,
                 ".");
    }
    detail::fail("plan_kv_cache: one request of max_model_len ", limits.max_model_len, " needs ",
                 gib(needed), " of KV cache (", needed, " bytes), more than the available ",
                 gib(available_bytes), " (", available_bytes, " bytes).", hint,
                 " Try increasing gpu_memory_utilization or decreasing max_model_len.");
  }

  // Grouping and block count (steps 3 and 4).
  const std::vector<SpecBucket> buckets = bucket_by_spec(layers);
  if (buckets.size() == 1 || is_uniform_type(layers)) {
    // One group; every layer has its own tensor. For equal specs sum(pages) is page * L, so
    // this is vLLM's floor(available / page / num_layers) too.
    int64_t sum_pages = 0;
    KVCacheGroup group{{}, layers.front().spec};
    for (const LayerCacheSpec& l : layers) {
      sum_pages = sat_add(sum_pages, l.spec.page_size_bytes());
      group.layer_names.push_back(l.layer_name);
    }
    plan.num_blocks = num_blocks_override.value_or(available_bytes / sum_pages);
    for (const LayerCacheSpec& l : layers) {
      plan.tensors.push_back(
          {tensor_bytes(l.spec.page_size_bytes(), plan.num_blocks), {l.layer_name}});
    }
    plan.groups.push_back(std::move(group));
  } else {
    const int64_t page = layers.front().spec.page_size_bytes();
    const bool uniform_page = std::all_of(layers.begin(), layers.end(), [&](const auto& l) {
      return l.spec.page_size_bytes() == page;
    });
    if (!uniform_page) fail_ungroupable(buckets);
    plan.groups = hybrid_groups(buckets);
    size_t layers_per_group = 0;
    for (const KVCacheGroup& g : plan.groups) {
      layers_per_group = std::max(layers_per_group, g.layer_names.size());
    }
    plan.num_blocks =
        num_blocks_override.value_or(available_bytes / page / int64_t(layers_per_group));
    for (size_t i = 0; i < layers_per_group; ++i) {
      KVCacheTensorPlan tensor{tensor_bytes(page, plan.num_blocks), {}};
      for (const KVCacheGroup& g : plan.groups) {
        if (i < g.layer_names.size()) tensor.shared_by.push_back(g.layer_names[i]);
      }
      plan.tensors.push_back(std::move(tensor));
    }
  }

  // Capacity (step 5). Each group draws its own blocks from the pool for every request, so a
  // request pins, per group, the most blocks any of its layers needs.
  std::map<std::string_view, const KVCacheSpec*> spec_of;
  for (const LayerCacheSpec& l : layers) spec_of[l.layer_name] = &l.spec;
  for (const KVCacheGroup& g : plan.groups) {
    int64_t group_blocks = 0;
    for (const std::string& name : g.layer_names) {
      const KVCacheSpec& spec = *spec_of.at(name);
      group_blocks = std::max(
          group_blocks, ceil_div(spec.max_memory_usage_bytes(limits), spec.page_size_bytes()));
    }
    plan.num_blocks_per_request = sat_add(plan.num_blocks_per_request, group_blocks);
  }
  // Every layer pins at least one block (the limits were checked >= 1), so this is > 0.
  plan.max_concurrency = double(plan.num_blocks) / double(plan.num_blocks_per_request);
  return plan;
}

}  // namespace pagedattn
