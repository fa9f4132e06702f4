#include "pagedattn/layer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/head_pad.h"
#include "pagedattn/connector.h"
#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::fail;
using detail::require;

namespace {

AttentionConfig make_config(const AttentionOptions& o) {
  const CacheConfig cache = o.cache_config.value_or(CacheConfig{});
  AttentionConfig c;
  c.num_heads = o.num_heads;
  c.head_size = o.head_size;
  c.scale = o.scale;
  c.num_kv_heads = o.num_kv_heads.value_or(o.num_heads);
  // Spec 1.2 step 1: the per-layer window wins over the model-level default.
  c.sliding_window = o.per_layer_sliding_window ? o.per_layer_sliding_window : cache.sliding_window;
  c.logits_soft_cap = o.logits_soft_cap;
  c.alibi_slopes = o.alibi_slopes;
  c.sinks = o.sinks;
  c.attn_type = o.attn_type;
  c.dtype = o.dtype;
  c.kv_cache_dtype = cache.cache_dtype;
  c.kv_cache_layout = cache.layout;
  c.block_size = cache.block_size;
  c.query_quant = o.quantize_query;
  c.v_head_size = o.v_head_size;
  return c;
}

// vLLM's extract_layer_index: the single integer component of a dotted layer name.
std::optional<int> layer_index(const std::string& name) {
  std::optional<int> index;
  std::stringstream ss(name);
  std::string part;
  int found = 0;
  while (std::getline(ss, part, '.')) {
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos) {
      index = std::stoi(part);
      ++found;
    }
  }
  return found == 1 ? index : std::nullopt;
}

// [T, H*D] or [T, H, D] -> [T, H, D].
TensorView as_heads(const TensorView& v, std::string_view name, int heads, int head_size) {
  if (!v.defined()) return v;
  if (v.ndim == 3) return v;
  require(v.ndim == 2 && v.size(1) == int64_t(heads) * head_size, name, " must be [num_tokens, ",
          heads, "*", head_size, "] or [num_tokens, ", heads, ", ", head_size, "]; got ",
          describe(v));
  require(v.stride(1) == 1, name, " must be contiguous in its last dimension");
  TensorView out = v;
  out.ndim = 3;
  out.shape = {v.size(0), heads, head_size, 0, 0, 0};
  out.strides = {v.stride(0), head_size, 1, 0, 0, 0};
  return out;
}

float scale_constant(const char* env, float fallback) {
  const char* s = std::getenv(env);
  if (!s || !*s) return fallback;
  char* end = nullptr;
  const float v = std::strtof(s, &end);
  require(end && *end == '\0' && std::isfinite(v) && v > 0.0f, env, " ('", s,
          "') must be a positive number");
  return v;
}

}  // namespace

Attention::Attention(ForwardContext& context, const AttentionOptions& options,
                     const Registry& registry)
    : context_(context),
      name_(options.prefix),
      config_(make_config(options)),
      device_(options.device),
      kv_sharing_target_(options.kv_sharing_target_layer_name) {
  config_.validate();
  require(!(is_fp8(config_.kv_cache_dtype) && !uses_kv_cache(config_.attn_type)), "kv_cache_dtype ",
          to_string(config_.kv_cache_dtype), ": quantization is not supported for ",
          to_string(config_.attn_type), " attention (it has no KV cache)");
  const CacheConfig cache = options.cache_config.value_or(CacheConfig{});
  calculate_kv_scales_ = cache.calculate_kv_scales;
  has_checkpoint_scales_ = options.has_checkpoint_kv_scales;
  per_head_scales_ = options.per_head_kv_scales;
  require(!(has_checkpoint_scales_ && config_.kv_cache_dtype == KVCacheDType::kFp8E5M2),
          "fp8_e5m2 kv-cache is not supported with fp8 checkpoints.");

  {
    detail::PaddedSelection sel =
        detail::select_padded(registry, config_, device_, options.attn_backend);
    backend_ = sel.backend;
    run_config_ = sel.run_config;
    pad_ = std::move(sel.pad);
  }
  impl_ = backend_->make_impl(run_config_, device_);

  context_.register_layer(this);
  try {
    if (kv_sharing_target_) {
      const std::string& tgt = *kv_sharing_target_;
      const std::string head = cat("Specified KV sharing target layer for ", name_,
                                   " is not valid: target layer ", tgt, " ");
      require(tgt != name_, head, "cannot be the same as the current layer.");
      const Attention* target = context_.layer(tgt);
      if (!target) {
        const auto cur_idx = layer_index(name_), tgt_idx = layer_index(tgt);
        if (cur_idx && tgt_idx && *cur_idx <= *tgt_idx)
          fail(head, "must come before the current layer.");
        fail(head, "is not a valid Attention layer in the model.");
      }
      require(target->config().attn_type == config_.attn_type, head,
              "must be the same type as the current layer (", to_string(config_.attn_type), ").");
    }
  } catch (...) {
    context_.unregister_layer(this);
    throw;
  }
}

Attention::~Attention() {
  context_.unregister_layer(this);
}

std::string Attention::extra_repr() const {
  std::ostringstream os;
  os << "head_size=" << config_.head_size << ", num_heads=" << config_.num_heads
     << ", num_kv_heads=" << config_.num_kv_heads << ", scale=" << config_.scale
     << ", backend=" << backend_->name();
  if (config_.head_size_v() != config_.head_size) os << ", v_head_size=" << config_.v_head_size;
  if (pad_ != nullptr) os << ", padded_head_size=" << run_config_.head_size;
  return os.str();
}

std::optional<KVCacheSpec> Attention::get_kv_cache_spec() const {
  if (kv_sharing_target_) return std::nullopt;  // the target's spec covers both layers
  // The cache holds what the backend runs: rows of the padded head size where it pads.
  const int bs = config_.block_size, hk = config_.num_kv_heads, d = run_config_.head_size;
  const DType dt = config_.cache_dtype();
  std::optional<KVCacheSpec> spec;
  switch (config_.attn_type) {
    case AttentionType::kEncoder:
    case AttentionType::kEncoderOnly:
      return std::nullopt;
    case AttentionType::kEncoderDecoder:
      spec = KVCacheSpec::cross(bs, hk, d, dt);
      break;
    case AttentionType::kDecoder:
      spec = config_.sliding_window ? KVCacheSpec::sliding(bs, hk, d, dt, *config_.sliding_window)
                                    : KVCacheSpec::full(bs, hk, d, dt);
      break;
  }
  // 0 when V's size is K's, so that such specs equal (and group with) those of other layers.
  if (spec && run_config_.head_size_v() != d) spec->v_head_size = run_config_.head_size_v();
  return spec;
}

const Attention& Attention::cache_owner() const {
  if (!kv_sharing_target_) return *this;
  const Attention* target = context_.layer(*kv_sharing_target_);
  require(target != nullptr, "layer ", name_, ": KV sharing target ", *kv_sharing_target_,
          " is no longer registered");
  return *target;
}

void Attention::bind_kv_cache(std::vector<KVCacheView> caches, int kv_cache_group) {
  require(!kv_sharing_target_, "layer ", name_, " shares the KV cache of ", *kv_sharing_target_,
          "; bind the cache to that layer instead");
  require(uses_kv_cache(config_.attn_type), "layer ", name_, " (", to_string(config_.attn_type),
          ") has no KV cache to bind");
  require(int(caches.size()) == context_.pipeline_parallel_size(), "layer ", name_, ": got ",
          caches.size(), " KV caches; expected one per virtual engine (",
          context_.pipeline_parallel_size(), ")");
  require(kv_cache_group >= 0, "kv_cache_group (", kv_cache_group, ") must be >= 0");
  for (KVCacheView& c : caches) {
    // vLLM allocates fp8 caches as bytes; see them through the cache's fp8 type.
    if (is_fp8(config_.kv_cache_dtype) && c.key.dtype == DType::kU8) {
      c.key.dtype = c.value.dtype = config_.cache_dtype();
    }
  }
  kv_caches_ = std::move(caches);
  kv_cache_group_ = kv_cache_group;
}

KVCacheView Attention::kv_cache() const {
  const Attention& owner = cache_owner();
  require(!owner.kv_caches_.empty(), "layer ", owner.name_, " has no KV cache bound");
  return owner.kv_caches_[size_t(context_.virtual_engine())];
}

int Attention::kv_cache_group() const {
  return cache_owner().kv_cache_group_;
}

void Attention::load_kv_scales(float q_scale, float k_scale, float v_scale) {
  for (auto [s, name] :
       {std::pair{q_scale, "q_scale"}, {k_scale, "k_scale"}, {v_scale, "v_scale"}}) {
    require(std::isfinite(s) && s != 0.0f, name, " (", s,
            ") must be finite and non-zero (negative means absent from the checkpoint)");
  }
  if (q_scale > 0.0f) calculate_kv_scales_ = false;  // a checkpoint q scale disables calibration
  if (!calculate_kv_scales_ || config_.kv_cache_dtype == KVCacheDType::kAuto) {
    q_scales_.clear();  // per-tensor scales replace per-head ones
    k_scales_.clear();
    v_scales_.clear();
  }
  if (config_.kv_cache_dtype == KVCacheDType::kAuto) {
    q_scale_ = k_scale_ = v_scale_ = 1.0f;  // "auto" stores the model dtype: scales unused
    return;
  }
  if (calculate_kv_scales_) return;
  if (k_scale > 0.0f && v_scale > 0.0f) {
    k_scale_ = k_scale;
    v_scale_ = v_scale;
  } else if (k_scale < 0.0f && v_scale < 0.0f) {
    k_scale_ = v_scale_ = 1.0f;
    if (is_fp8(config_.kv_cache_dtype) && config_.kv_cache_dtype != KVCacheDType::kFp8E5M2) {
      warnings_.push_back(cat("layer ", name_,
                              ": no k/v scales in the checkpoint for an fp8 e4m3 cache; using "
                              "1.0, which may lower accuracy"));
    }
  } else {
    // Exactly one present: it is a single kv_scale for both.
    k_scale_ = v_scale_ = std::max(k_scale, v_scale);
  }
  if (q_scale > 0.0f) {
    q_scale_ = q_scale;
  } else {
    q_scale_ = k_scale_;
    warnings_.push_back(
        cat("layer ", name_, ": no q_scale in the checkpoint; using k_scale (", k_scale_, ")"));
  }
}

void Attention::load_kv_scales(const std::vector<float>& q_scales,
                               const std::vector<float>& k_scales,
                               const std::vector<float>& v_scales) {
  const int heads = config_.num_kv_heads;
  for (const auto& [v, name] :
       {std::pair{&q_scales, "q_scales"}, {&k_scales, "k_scales"}, {&v_scales, "v_scales"}}) {
    require(v->empty() || v->size() == size_t(heads), name, " has ", v->size(),
            " values; expected num_kv_heads (", heads, ") or none (absent from the checkpoint)");
    for (size_t h = 0; h < v->size(); ++h) {
      require(std::isfinite((*v)[h]) && (*v)[h] > 0.0f, name, "[", h, "] (", (*v)[h],
              ") must be finite and > 0");
    }
  }
  // The float rules (absent, one of k/v for both, q from k) applied per head.
  load_kv_scales(q_scales.empty() ? -1.0f : 1.0f, k_scales.empty() ? -1.0f : 1.0f,
                 v_scales.empty() ? -1.0f : 1.0f);
  if (config_.kv_cache_dtype == KVCacheDType::kAuto || calculate_kv_scales_) return;
  if (k_scales.empty() && v_scales.empty()) return;  // 1.0 per tensor, warned above
  k_scales_ = k_scales.empty() ? v_scales : k_scales;
  v_scales_ = v_scales.empty() ? k_scales : v_scales;
  q_scales_ = q_scales.empty() ? k_scales_ : q_scales;
  if (!warnings_.empty() && q_scales.empty()) {
    warnings_.back() = cat("layer ", name_, ": no q_scales in the checkpoint; using k_scales");
  }
}

CalibratedScales calc_kv_scales_per_head(const Backend& backend, const TensorView& q,
                                         const TensorView& k, const TensorView& v) {
  require(q.ndim == 3 && k.ndim == 3 && v.ndim == 3 && k.size(1) == v.size(1) && k.size(1) > 0 &&
              q.size(1) % k.size(1) == 0,
          "calc_kv_scales_per_head: query must be [T, num_heads, head_size] and key, value "
          "[T, num_kv_heads, head_size] with num_kv_heads dividing num_heads; got ",
          describe(q), ", ", describe(k), ", ", describe(v));
  const int heads = int(k.size(1)), group = int(q.size(1)) / heads;
  CalibratedScales s;
  for (int h = 0; h < heads; ++h) {
    const CalibratedScales one = calc_kv_scales(backend, q.slice(1, h * group, (h + 1) * group),
                                                k.slice(1, h, h + 1), v.slice(1, h, h + 1));
    s.all_zero = s.all_zero || one.all_zero;
    s.q_scales.push_back(one.q_scale);
    s.k_scales.push_back(one.k_scale);
    s.v_scales.push_back(one.v_scale);
  }
  return s;
}

CalibratedScales calc_kv_scales(const Backend& backend, const TensorView& q, const TensorView& k,
                                const TensorView& v) {
  const float qa = backend.amax(q), ka = backend.amax(k), va = backend.amax(v);
  require(std::isfinite(qa) && std::isfinite(ka) && std::isfinite(va),
          "calc_kv_scales: the batch holds non-finite values (max |q|, |k|, |v| = ", qa, ", ", ka,
          ", ", va, ")");
  CalibratedScales s;
  s.all_zero = qa == 0.0f || ka == 0.0f || va == 0.0f;
  if (s.all_zero) return s;
  s.q_scale = qa / scale_constant("PAGEDATTN_Q_SCALE_CONSTANT", 200.0f);
  s.k_scale = ka / scale_constant("PAGEDATTN_K_SCALE_CONSTANT", 200.0f);
  s.v_scale = va / scale_constant("PAGEDATTN_V_SCALE_CONSTANT", 100.0f);
  return s;
}

void Attention::calibrate_scales(const TensorView& q, const TensorView& k, const TensorView& v) {
  const CalibratedScales s = per_head_scales_ ? calc_kv_scales_per_head(*backend_, q, k, v)
                                              : calc_kv_scales(*backend_, q, k, v);
  if (s.all_zero) return;  // an all-zero batch (e.g. padding): try the next one
  q_scale_ = s.q_scale;
  k_scale_ = s.k_scale;
  v_scale_ = s.v_scale;
  q_scales_ = s.q_scales;
  k_scales_ = s.k_scales;
  v_scales_ = s.v_scales;
  calculate_kv_scales_ = false;
}

void Attention::forward(const TensorView& query_in, const TensorView& key_in,
                        const TensorView& value_in, const TensorView& output_in,
                        const TensorView& lse, Stream stream) {
  const int hq = config_.num_heads, hk = config_.num_kv_heads, d = config_.head_size;
  const int dv = config_.head_size_v();
  const TensorView query = as_heads(query_in, "query", hq, d);
  const TensorView key = as_heads(key_in, "key", hk, d);
  const TensorView value = as_heads(value_in, "value", hk, dv);
  const TensorView output = as_heads(output_in, "output", hq, dv);
  require(key.defined() == value.defined(), "key and value must both be given or both be None");
  require(output.defined() && output.dtype == query.dtype,
          "output must be given in the query "
          "dtype (",
          dtype_name(query.dtype), "); got ", describe(output));
  require(output.size(0) >= query.size(0), "output has ", output.size(0), " rows; the query has ",
          query.size(0));

  const int group = kv_cache_group();
  const AttentionMetadata* md = context_.metadata(group);
  if (md == nullptr) {  // profiling run: no writes, zero output (spec 2.9)
    require(output.is_contiguous(), "output must be contiguous in a profiling run");
    require_device(output.device)
        .memset_async(output.data, 0, output.nbytes(), output.device.index, stream);
    return;
  }
  // Calibration reads max |x| back to the host (a blocking reduction on the device's default
  // stream): the scales are host floats passed by value to the kernels. It happens once, on
  // the first real batch, so a captured step (after an eager one) never does it.
  if (calculate_kv_scales_ && key.defined()) calibrate_scales(query, key, value);

  const bool cached = uses_kv_cache(config_.attn_type);
  KVCacheView cache;
  if (cached) cache = kv_cache();
  const CacheGeometry geometry =
      cached ? CacheGeometry{cache.num_blocks(), cache.block_size()} : CacheGeometry{};
  // Metadata is checked once per step and cache, before anything is written.
  if (context_.first_use(group, config_.attn_type, geometry)) {
    validate_metadata(*md, config_.attn_type, geometry);
  }
  // Spec 1.11: a configured KV connector holding this step's metadata loads this layer's
  // blocks before its attention and saves them after. KV-sharing consumers own no cache.
  KVConnector* const connector =
      cached && !kv_sharing_target_ ? context_.active_kv_connector() : nullptr;
  if (connector) connector->wait_for_layer_load(name_);
  // A padded head size (run_config): q, k, v and the output through zero-tailed scratch rows.
  using detail::HeadPad;
  const bool padded = pad_ != nullptr;
  const TensorView q = padded ? pad_->pad(HeadPad::kQuery, query, stream) : query;
  const TensorView k = padded && key.defined() ? pad_->pad(HeadPad::kKey, key, stream) : key;
  const TensorView v =
      padded && value.defined() ? pad_->pad(HeadPad::kValue, value, stream) : value;
  const TensorView out =
      padded ? pad_->scratch(HeadPad::kOutput, output.size(0), output.size(1), stream) : output;
  if (cached && !kv_sharing_target_ && key.defined()) {
    // Write first, then read: every key, the new ones included, comes from the cache.
    WriteKVArgs w{k, v, md->slot_mapping, cache, kv_scales(), stream};
    check_write_kv_args(run_config_, w, /*check_slots=*/false);
    impl_->write_kv(w);
  }
  ForwardArgs f;
  f.query = q;
  if (!cached) {
    f.key = k;
    f.value = v;
  }
  f.kv_cache = cache;
  // The cache holds values stored with its owner's scales (a KV-sharing consumer reads them).
  f.scales = cache_owner().kv_scales();
  f.scales.q_scale = q_scale_;  // the query is this layer's own
  f.scales.q_scales = q_scales_;
  f.metadata = md;
  f.output = out;
  f.lse = lse;
  f.plan = &context_.plan(group, *backend_, run_config_);
  f.workspace = context_.workspace(query.device, f.plan->workspace_bytes());
  f.stream = stream;
  check_forward_args(run_config_, f, /*check_metadata=*/false);
  impl_->forward(f);
  if (padded) {
    // The step's rows only: the rows past them are the caller's, never written.
    const int64_t rows = std::min<int64_t>(output.size(0), md->num_actual_tokens);
    pad_->unpad(out.slice(0, 0, rows), output.slice(0, 0, rows), stream);
  }
  if (connector) connector->save_kv_layer(name_, cache, *md, kv_scales());
}

Tensor Attention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                          Stream stream) {
  const int64_t rows = query.defined() ? query.size(0) : 0;
  Tensor out = Tensor::empty({rows, int64_t(config_.num_heads) * config_.head_size_v()},
                             query.dtype, query.device);
  // Zeroed on the stream, not with Tensor::zeros: that memset runs on the legacy default stream,
  // which a non-blocking `stream` does not wait for (padding rows past T_a are never written).
  const TensorView& o = out.view();
  require_device(o.device).memset_async(o.data, 0, o.nbytes(), o.device.index, stream);
  forward(query, key, value, out.view(), {}, stream);
  return out;
}

}  // namespace pagedattn
