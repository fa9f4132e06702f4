#include "pagedattn/mla.h"

#include <cmath>

#include "core/mla_device.h"
#include "core/mla_prefill.h"
#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

namespace {

AttentionConfig make_config(const MLAOptions& o) {
  const CacheConfig cache = o.cache_config.value_or(CacheConfig{});
  AttentionConfig c;
  c.num_heads = o.num_heads;
  c.num_kv_heads = 1;
  c.head_size = o.kv_lora_rank + o.qk_rope_head_dim;
  c.scale = o.scale;
  c.dtype = o.dtype;
  c.kv_cache_dtype = cache.cache_dtype;
  c.block_size = cache.block_size;
  c.attn_type = AttentionType::kDecoder;
  return c;
}

// Element (i0, i1, i2) of a view of up to 3 dimensions, as a double.
double at(const TensorView& v, int64_t i0, int64_t i1, int64_t i2 = 0) {
  int64_t off = i0 * v.stride(0) + i1 * v.stride(1);
  if (v.ndim > 2) off += i2 * v.stride(2);
  return load_element(v.data, v.dtype, off);
}

// Rounds to `dtype` (the activation dtype the absorbed weights live in).
float rounded(double x, DType dtype) {
  uint64_t bits = 0;
  store_element(&bits, dtype, 0, x);
  return float(load_element(&bits, dtype, 0));
}

}  // namespace

std::string_view to_string(MLAFormulation f) {
  switch (f) {
    case MLAFormulation::kSplit:
      return "split";
    case MLAFormulation::kAbsorbed:
      return "absorbed";
    case MLAFormulation::kPrefill:
      return "prefill";
  }
  return "?";
}

MLAFormulation parse_mla_formulation(std::string_view name) {
  for (MLAFormulation f :
       {MLAFormulation::kSplit, MLAFormulation::kAbsorbed, MLAFormulation::kPrefill}) {
    if (name == to_string(f)) return f;
  }
  detail::fail<InvalidArgument>("MLA formulation '", name,
                                "' is not one of split, absorbed, prefill");
}

MLAAttention::MLAAttention(ForwardContext& context, const MLAOptions& options,
                           const Registry& registry)
    : context_(context), options_(options), config_(make_config(options)) {
  require(options.num_heads > 0 && options.qk_nope_head_dim > 0 && options.qk_rope_head_dim > 0 &&
              options.v_head_dim > 0 && options.kv_lora_rank > 0,
          "MLA dimensions must be positive: num_heads=", options.num_heads,
          ", qk_nope_head_dim=", options.qk_nope_head_dim,
          ", qk_rope_head_dim=", options.qk_rope_head_dim, ", v_head_dim=", options.v_head_dim,
          ", kv_lora_rank=", options.kv_lora_rank);
  require(options.decode_threshold >= 1, "decode_threshold (", options.decode_threshold,
          ") must be >= 1");
  require(options.context_chunk_tokens >= 1, "context_chunk_tokens (", options.context_chunk_tokens,
          ") must be >= 1");
  config_.validate();
  calibrate_ = options.cache_config && options.cache_config->calculate_kv_scales;
  backend_ = &registry.select(BackendQuery{config_, options.device}, options.attn_backend);
  impl_ = backend_->make_impl(config_, options.device);
}

MLAAttention::~MLAAttention() = default;

KVCacheSpec MLAAttention::get_kv_cache_spec() const {
  return KVCacheSpec::mla(config_.block_size, config_.head_size, config_.cache_dtype());
}

void MLAAttention::load_kv_b_proj(const TensorView& w) {
  const int n = options_.num_heads, p = options_.qk_nope_head_dim, v = options_.v_head_dim;
  const int l = options_.kv_lora_rank;
  // vLLM asserts the shape (spec 5.3).
  require(w.defined() && w.ndim == 2 && w.size(0) == l && w.size(1) == int64_t(n) * (p + v),
          "kv_b_proj must be [kv_lora_rank=", l,
          ", num_heads*(qk_nope_head_dim+v_head_dim)=", int64_t(n) * (p + v), "]; got ",
          describe(w));
  require(w.device.is_cpu() && is_floating(w.dtype),
          "kv_b_proj must be a float tensor on the host; got ", describe(w));
  device_weights_.reset();  // re-uploaded by the next device forward
  w_uk_t_.assign(size_t(n) * p * l, 0.0f);
  w_uk_.assign(size_t(n) * l * p, 0.0f);
  w_uv_.assign(size_t(n) * l * v, 0.0f);
  for (int li = 0; li < l; ++li) {
    for (int h = 0; h < n; ++h) {
      const int64_t col = int64_t(h) * (p + v);
      for (int pi = 0; pi < p; ++pi) {
        const float x = rounded(at(w, li, col + pi), config_.dtype);
        w_uk_t_[(size_t(h) * p + pi) * l + li] = x;
        w_uk_[(size_t(h) * l + li) * p + pi] = x;
      }
      for (int vi = 0; vi < v; ++vi) {
        w_uv_[(size_t(h) * l + li) * v + vi] = rounded(at(w, li, col + p + vi), config_.dtype);
      }
    }
  }
}

void MLAAttention::bind_kv_cache(const TensorView& c) {
  const int entry = config_.head_size;
  require(c.defined() && (c.ndim == 3 || (c.ndim == 4 && c.size(2) == 1)) &&
              c.size(1) == config_.block_size && c.size(c.ndim - 1) == entry,
          "the latent cache must be [num_blocks, block_size=", config_.block_size,
          ", kv_lora_rank+qk_rope_head_dim=", entry, "] (or with a KV-head dimension of 1); got ",
          describe(c));
  require(c.dtype == config_.cache_dtype(), "the latent cache is ", dtype_name(c.dtype),
          "; the layer's cache dtype is ", dtype_name(config_.cache_dtype()));
  TensorView v = c;
  if (c.ndim == 3) {
    v.ndim = 4;
    v.shape = {c.size(0), c.size(1), 1, entry, 0, 0};
    v.strides = {c.stride(0), c.stride(1), entry * c.stride(2), c.stride(2), 0, 0};
  }
  // One latent entry serves as both K and V (the backends only read V's first L columns'
  // worth of the output: the layer drops the rest).
  cache_ = KVCacheView{v, v};
}

void MLAAttention::set_k_scale(float k_scale) {
  require(std::isfinite(k_scale) && k_scale > 0.0f, "k_scale (", k_scale,
          ") must be finite and > 0");
  k_scale_ = k_scale;
}

void MLAAttention::forward(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe_in,
                           const TensorView& output, Stream stream) {
  const int n = options_.num_heads, p = options_.qk_nope_head_dim, r = options_.qk_rope_head_dim;
  const int v = options_.v_head_dim, l = options_.kv_lora_rank, e = l + r;
  require(q.defined() && q.ndim == 3 && q.size(1) == n && q.size(2) == p + r,
          "q must be [num_tokens, num_heads=", n, ", qk_nope_head_dim+qk_rope_head_dim=", p + r,
          "]; got ", describe(q));
  const int64_t t_in = q.size(0);
  require(kv_c.defined() && kv_c.ndim == 2 && kv_c.size(0) == t_in && kv_c.size(1) == l,
          "kv_c_normed must be [num_tokens=", t_in, ", kv_lora_rank=", l, "]; got ",
          describe(kv_c));
  TensorView k_pe = k_pe_in;
  if (k_pe.defined() && k_pe.ndim == 3 && k_pe.size(1) == 1) {
    k_pe.ndim = 2;
    k_pe.shape = {k_pe_in.size(0), r, 0, 0, 0, 0};
    k_pe.strides = {k_pe_in.stride(0), k_pe_in.stride(2), 0, 0, 0, 0};
  }
  require(k_pe.defined() && k_pe.ndim == 2 && k_pe.size(0) == t_in && k_pe.size(1) == r,
          "k_pe must be [num_tokens=", t_in, ", qk_rope_head_dim=", r, "] or [num_tokens, 1, ", r,
          "]; got ", describe(k_pe_in));
  require(output.defined() && output.ndim == 2 && output.size(0) >= t_in &&
              output.size(1) == int64_t(n) * v &&
              (output.dtype == config_.dtype || output.dtype == DType::kF32 ||
               output.dtype == DType::kF64),
          "output must be ", dtype_name(config_.dtype),
          " (or float32 / float64) [num_tokens=", t_in, ", num_heads*v_head_dim=", int64_t(n) * v,
          "]; got ", describe(output));
  // The inputs in the activation dtype, as Attention's query: every formulation stores them
  // (the latent write) or multiplies them in that precision.
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&kv_c, "kv_c_normed"}, {&k_pe_in, "k_pe"}}) {
    require(t->dtype == config_.dtype, name, " must be ", dtype_name(config_.dtype),
            " (the layer's dtype); got ", describe(*t));
  }
  const bool on_device = !q.device.is_cpu();  // forward_on_device checks the others' device
  for (const TensorView* t : {&kv_c, static_cast<const TensorView*>(&k_pe), &output}) {
    require(on_device || t->device.is_cpu(), "q is on the host, so must the rest be; got ",
            describe(*t));
  }
  const AttentionMetadata* md = context_.metadata(0);
  if (md == nullptr && on_device) return forward_on_device(q, kv_c, k_pe, md, output, stream);
  if (md == nullptr) {  // profiling run
    for (int64_t i = 0; i < t_in; ++i) {
      for (int64_t c = 0; c < output.size(1); ++c) {
        store_element(output.data, output.dtype, i * output.stride(0) + c * output.stride(1), 0.0);
      }
    }
    return;
  }
  require(!w_uk_t_.empty(), "load_kv_b_proj() must be called before forward()");
  require(cache_.key.defined(), "bind_kv_cache() must be called before forward()");
  const int64_t ta = md->num_actual_tokens;
  require(ta <= t_in, "metadata.num_actual_tokens (", ta, ") exceeds the ", t_in, " input tokens");
  const CacheGeometry geometry{cache_.num_blocks(), cache_.block_size()};
  if (context_.first_use(0, config_.attn_type, geometry)) {
    validate_metadata(*md, config_.attn_type, geometry);
  }
  if (calibrate_) {
    const CalibratedScales cs = calc_kv_scales(*backend_, q, kv_c, k_pe);
    if (!cs.all_zero) {
      k_scale_ = cs.k_scale;
      calibrate_ = false;
    }
  }
  if (on_device) return forward_on_device(q, kv_c, k_pe, md, output, stream);
  const DType act = config_.dtype;
  // 1. The step's latent entries [kv_c | k_pe] into the cache (one entry as K and V).
  Tensor latent = Tensor::empty({ta, 1, e}, act);
  for (int64_t t = 0; t < ta; ++t) {
    for (int c = 0; c < e; ++c) {
      store_element(latent.data(), act, t * e + c, c < l ? at(kv_c, t, c) : at(k_pe, t, c - l));
    }
  }
  const KVScales scales{k_scale_, k_scale_};
  impl_->write_kv({latent.view(), latent.view(), md->slot_mapping, cache_, scales, stream});
  // 2. Each request in its formulation: decodes absorbed, prefills expanded (spec 5.4).
  const detail::MLARequestSplit split =
      detail::split_mla_requests(*md, options_.formulation, options_.decode_threshold);
  if (split.prefills.empty()) {
    forward_absorbed(q, *md, {}, context_.plan(0, *backend_, config_), output, stream);
    return;
  }
  if (!split.decodes.empty()) {
    std::vector<int64_t> rows;
    const StepMetadata sub = detail::subset_metadata(*md, split.decodes, rows);
    const auto plan = backend_->plan(sub.view(), config_);
    forward_absorbed(q, sub.view(), rows, *plan, output, stream);
  }
  if (!prefill_) prefill_ = std::make_unique<detail::MLAPrefill>(options_, *backend_);
  prefill_->forward(q, kv_c, k_pe, *md, split.prefills, cache_, k_scale_,
                    detail::MLAWeights{w_uk_.data(), w_uv_.data()}, context_, output, stream);
}

void MLAAttention::forward_absorbed(const TensorView& q, const AttentionMetadata& md,
                                    const std::vector<int64_t>& rows, const Plan& plan,
                                    const TensorView& output, Stream stream) {
  const int n = options_.num_heads, p = options_.qk_nope_head_dim, r = options_.qk_rope_head_dim;
  const int v = options_.v_head_dim, l = options_.kv_lora_rank, e = l + r;
  const DType act = config_.dtype;
  const int64_t ta = md.num_actual_tokens;
  auto row = [&rows](int64_t t) { return rows.empty() ? t : rows[size_t(t)]; };
  // The absorbed query [q_nope W_UK^T | q_pe], rounded to the activation dtype.
  Tensor qa = Tensor::empty({ta, n, e}, act);
  std::vector<float> acc(static_cast<size_t>(l), 0.0f);
  for (int64_t t = 0; t < ta; ++t) {
    const int64_t src = row(t);
    for (int h = 0; h < n; ++h) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int pi = 0; pi < p; ++pi) {
        const float qv = float(at(q, src, h, pi));
        const float* w = &w_uk_t_[(size_t(h) * p + pi) * l];
        for (int li = 0; li < l; ++li) acc[size_t(li)] += qv * w[li];
      }
      const int64_t base = (t * n + h) * e;
      for (int li = 0; li < l; ++li) store_element(qa.data(), act, base + li, acc[size_t(li)]);
      for (int ri = 0; ri < r; ++ri)
        store_element(qa.data(), act, base + l + ri, at(q, src, h, p + ri));
    }
  }
  // MQA over the latent cache.
  Tensor o_lat = Tensor::empty({ta, n, l}, act);  // P V's first L columns (W_UV's input)
  ForwardArgs f;
  f.query = qa.view();
  f.kv_cache = cache_;
  f.scales = KVScales{k_scale_, k_scale_};
  f.metadata = &md;
  f.output = o_lat.view();
  f.plan = &plan;
  f.workspace = context_.workspace(Device::cpu(), plan.workspace_bytes());
  f.stream = stream;
  check_forward_args(config_, f, /*check_metadata=*/false);
  impl_->forward(f);
  // Up-projection of the latent output's first L columns by W_UV.
  std::vector<float> lat(static_cast<size_t>(l), 0.0f), out(static_cast<size_t>(v), 0.0f);
  for (int64_t t = 0; t < ta; ++t) {
    const int64_t dst = row(t);
    for (int h = 0; h < n; ++h) {
      for (int li = 0; li < l; ++li)
        lat[size_t(li)] = float(load_element(o_lat.data(), act, (t * n + h) * l + li));
      std::fill(out.begin(), out.end(), 0.0f);
      for (int li = 0; li < l; ++li) {
        const float* w = &w_uv_[(size_t(h) * l + li) * v];
        for (int vi = 0; vi < v; ++vi) out[size_t(vi)] += lat[size_t(li)] * w[vi];
      }
      for (int vi = 0; vi < v; ++vi) {
        store_element(output.data, output.dtype,
                      dst * output.stride(0) + (int64_t(h) * v + vi) * output.stride(1),
                      out[size_t(vi)]);
      }
    }
  }
}

}  // namespace pagedattn
