// ForwardContext and the Attention layer with vLLM's constructor arguments.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "py_metadata.h"

namespace pagedattn::py {

using detail::require;

namespace {

/// pagedattn.ForwardContext: the C++ context plus the metadata objects of the current step,
/// held so that the pointers the context keeps stay valid.
struct PyForwardContext {
  explicit PyForwardContext(int pipeline_parallel_size) : ctx(pipeline_parallel_size) {}
  ForwardContext ctx;
  std::vector<nb::object> step_metadata;
};

/// pagedattn.Attention: the layer plus the cache arrays bound to it (kept alive).
struct PyAttention {
  PyAttention(ForwardContext& context, const AttentionOptions& options) : layer(context, options) {}
  Attention layer;
  nb::object caches = nb::none();
};

std::vector<float> floats_of(nb::handle obj, std::string_view name) {
  if (obj.is_none()) return {};
  // A list or tuple of numbers, or a 1-D float array (numpy / torch / DLPack).
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
    return nb::cast<std::vector<float>>(obj);
  }
  const TensorView v = to_view(obj, name);
  require(v.ndim == 1 && is_floating(v.dtype), name, " must be a 1-D float array or a list; got ",
          describe(v));
  const Tensor host = Tensor::copy_of(v, Device::cpu());
  std::vector<float> out(size_t(v.size(0)));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = float(load_element(host.data(), v.dtype, int64_t(i)));
  }
  return out;
}

void make_attention(PyAttention* self, PyForwardContext& context, int num_heads, int head_size,
                    float scale, std::optional<int> num_kv_heads, nb::handle alibi_slopes,
                    std::optional<CacheConfig> cache_config, std::optional<float> logits_soft_cap,
                    std::optional<int> per_layer_sliding_window, const std::string& prefix,
                    const std::string& attn_type,
                    std::optional<std::string> kv_sharing_target_layer_name,
                    std::optional<std::string> attn_backend, nb::handle sinks, nb::handle dtype,
                    nb::handle device, bool has_checkpoint_kv_scales, bool quantize_query,
                    bool per_head_kv_scales) {
  AttentionOptions o;
  o.num_heads = num_heads;
  o.head_size = head_size;
  o.scale = scale;
  o.num_kv_heads = num_kv_heads;
  o.alibi_slopes = floats_of(alibi_slopes, "alibi_slopes");
  o.cache_config = cache_config;
  o.logits_soft_cap = logits_soft_cap;
  o.per_layer_sliding_window = per_layer_sliding_window;
  o.prefix = prefix;
  o.attn_type = parse_attn_type(attn_type);
  o.kv_sharing_target_layer_name = std::move(kv_sharing_target_layer_name);
  o.attn_backend = std::move(attn_backend);
  o.sinks = floats_of(sinks, "sinks");
  o.dtype = parse_dtype(dtype);
  o.device = parse_device(device);
  o.has_checkpoint_kv_scales = has_checkpoint_kv_scales;
  o.quantize_query = quantize_query;
  o.per_head_kv_scales = per_head_kv_scales;
  new (self) PyAttention(context.ctx, o);
}

void bind_caches(PyAttention& a, nb::handle caches, int kv_cache_group) {
  std::vector<KVCacheView> views;
  const std::optional<DType> fp8 = a.layer.config().cache_dtype();
  if (nb::isinstance<nb::list>(caches)) {
    int i = 0;
    for (nb::handle c : nb::borrow<nb::list>(caches)) {
      views.push_back(to_cache_view(c, "kv_caches[" + std::to_string(i++) + "]", fp8));
    }
  } else {
    views.push_back(to_cache_view(caches, "kv_cache", fp8));
  }
  a.layer.bind_kv_cache(std::move(views), kv_cache_group);
  a.caches = nb::borrow(caches);
}

// The output-buffer convention of every layer's forward: `run(out)` (with the GIL released)
// writes into `output` when one is given (and it is returned), else into a new tensor of
// `shape`, zeroed on `stream` (the layer's stream) so that the layer's work is ordered after it,
// that is returned.
template <class Run>
nb::object run_into(nb::handle output, const std::vector<int64_t>& shape, DType dtype,
                    Device device, uintptr_t stream, Run&& run) {
  Tensor owned;
  TensorView out;
  if (output.is_none()) {
    owned = Tensor::empty(shape, dtype, device);
    out = owned.view();
    require_device(device).memset_async(out.data, 0, out.nbytes(), device.index, to_stream(stream));
  } else {
    out = to_view(output, "output", true);
  }
  {
    nb::gil_scoped_release release;
    run(out);
  }
  return output.is_none() ? export_tensor(owned) : nb::borrow(output);
}

nb::object forward(PyAttention& a, nb::handle query, nb::handle key, nb::handle value,
                   nb::handle output, nb::handle lse, uintptr_t stream) {
  const TensorView q = to_view(query, "query");
  const TensorView k = to_view(key, "key");
  const TensorView v = to_view(value, "value");
  require(!output.is_none() || lse.is_none(), "lse needs an output buffer");
  const TensorView l = to_view(lse, "lse", true);
  const AttentionConfig& c = a.layer.config();
  return run_into(
      output, {q.defined() ? q.size(0) : 0, int64_t(c.num_heads) * c.head_size}, q.dtype, q.device,
      stream, [&](const TensorView& out) { a.layer.forward(q, k, v, out, l, to_stream(stream)); });
}

/// pagedattn.MultiHeadAttention: vLLM's no-cache layer for vision encoders.
struct PyMultiHeadAttention {
  explicit PyMultiHeadAttention(const MultiHeadAttentionOptions& options) : layer(options) {}
  MultiHeadAttention layer;
};

void make_mha(PyMultiHeadAttention* self, int num_heads, int head_size, float scale,
              std::optional<int> num_kv_heads, const std::string& prefix,
              std::optional<std::string> attn_backend, nb::handle dtype, nb::handle device) {
  MultiHeadAttentionOptions o;
  o.num_heads = num_heads;
  o.head_size = head_size;
  o.scale = scale;
  o.num_kv_heads = num_kv_heads;
  o.prefix = prefix;
  o.attn_backend = std::move(attn_backend);
  o.dtype = parse_dtype(dtype);
  o.device = parse_device(device);
  new (self) PyMultiHeadAttention(o);
}

nb::object mha_forward(PyMultiHeadAttention& a, nb::handle query, nb::handle key, nb::handle value,
                       nb::handle output, uintptr_t stream) {
  const TensorView q = to_view(query, "query");
  const TensorView k = to_view(key, "key");
  const TensorView v = to_view(value, "value");
  require(q.defined(), "query is required");
  return run_into(output, q.shape_vector(), q.dtype, q.device, stream,
                  [&](const TensorView& out) { a.layer.forward(q, k, v, out, to_stream(stream)); });
}

/// pagedattn.MLAAttention: the layer plus its bound latent cache (kept alive).
struct PyMLA {
  PyMLA(ForwardContext& context, const MLAOptions& options) : layer(context, options) {}
  MLAAttention layer;
  nb::object cache = nb::none();
};

void make_mla(PyMLA* self, PyForwardContext& context, int num_heads, float scale,
              int qk_nope_head_dim, int qk_rope_head_dim, int v_head_dim,
              std::optional<int> q_lora_rank, int kv_lora_rank, nb::handle kv_b_proj,
              std::optional<CacheConfig> cache_config, const std::string& prefix,
              std::optional<std::string> attn_backend, nb::handle dtype, nb::handle device,
              const std::string& formulation, int decode_threshold, int context_chunk_tokens) {
  MLAOptions o;
  o.num_heads = num_heads;
  o.scale = scale;
  o.qk_nope_head_dim = qk_nope_head_dim;
  o.qk_rope_head_dim = qk_rope_head_dim;
  o.v_head_dim = v_head_dim;
  o.q_lora_rank = q_lora_rank;
  o.kv_lora_rank = kv_lora_rank;
  o.cache_config = cache_config;
  o.prefix = prefix;
  o.attn_backend = std::move(attn_backend);
  o.dtype = parse_dtype(dtype);
  o.device = parse_device(device);
  o.formulation = parse_mla_formulation(formulation);
  o.decode_threshold = decode_threshold;
  o.context_chunk_tokens = context_chunk_tokens;
  new (self) PyMLA(context.ctx, o);
  if (!kv_b_proj.is_none()) self->layer.load_kv_b_proj(to_view(kv_b_proj, "kv_b_proj"));
}

nb::object mla_forward(PyMLA& a, nb::handle q, nb::handle kv_c_normed, nb::handle k_pe,
                       nb::handle output, uintptr_t stream) {
  const TensorView qv = to_view(q, "q");
  const TensorView kv = to_view(kv_c_normed, "kv_c_normed");
  const TensorView pe = to_view(k_pe, "k_pe");
  require(qv.defined(), "q is required");
  const AttentionConfig& c = a.layer.config();
  return run_into(
      output, {qv.size(0), int64_t(c.num_heads) * a.layer.v_head_dim()}, c.dtype, qv.device, stream,
      [&](const TensorView& out) { a.layer.forward(qv, kv, pe, out, to_stream(stream)); });
}

}  // namespace

void bind_layer(nb::module_& m) {
  nb::class_<PyForwardContext>(m, "ForwardContext",
                               "The layers of a model by name, and one step's metadata per "
                               "KV-cache group (no globals: one context drives one model).")
      .def(nb::init<int>(), nb::arg("pipeline_parallel_size") = 1)
      .def("layer_names", [](const PyForwardContext& c) { return c.ctx.layer_names(); })
      .def_prop_ro("pipeline_parallel_size",
                   [](const PyForwardContext& c) { return c.ctx.pipeline_parallel_size(); })
      .def(
          "begin_step",
          [](PyForwardContext& c, nb::handle metadata, int virtual_engine) {
            std::vector<nb::object> keep;
            std::vector<const AttentionMetadata*> per_group;
            auto add = [&](nb::handle h) {
              per_group.push_back(&nb::cast<const PyMetadata&>(h).md);
              keep.push_back(nb::borrow(h));
            };
            if (nb::isinstance<nb::list>(metadata) || nb::isinstance<nb::tuple>(metadata)) {
              for (nb::handle h : nb::borrow<nb::sequence>(metadata)) add(h);
            } else {
              add(metadata);
            }
            c.ctx.begin_step(std::move(per_group), virtual_engine);
            c.step_metadata = std::move(keep);
          },
          nb::arg("metadata"), nb::arg("virtual_engine") = 0,
          "Starts a step: metadata (one AttentionMetadata, or a list: one per KV-cache group).")
      .def(
          "begin_profile_step",
          [](PyForwardContext& c, int virtual_engine) {
            c.ctx.begin_profile_step(virtual_engine);
            c.step_metadata.clear();
          },
          nb::arg("virtual_engine") = 0,
          "Starts a profiling (dummy) step: layers zero their output and write nothing.")
      .def("end_step",
           [](PyForwardContext& c) {
             c.ctx.end_step();
             c.step_metadata.clear();
           })
      .def_prop_ro("in_step", [](const PyForwardContext& c) { return c.ctx.in_step(); })
      .def_prop_ro("virtual_engine",
                   [](const PyForwardContext& c) { return c.ctx.virtual_engine(); });

  nb::class_<PyAttention>(m, "Attention",
                          "vLLM's Attention layer. forward() enqueues on `stream` (a cudaStream_t "
                          "as an int; 0, the default, is the legacy default stream); "
                          "pagedattn.torch.Attention uses torch's current stream.")
      .def("__init__", &make_attention, nb::arg("context"), nb::arg("num_heads"),
           nb::arg("head_size"), nb::arg("scale"), nb::arg("num_kv_heads").none() = nb::none(),
           nb::arg("alibi_slopes").none() = nb::none(), nb::arg("cache_config").none() = nb::none(),
           nb::arg("logits_soft_cap").none() = nb::none(),
           nb::arg("per_layer_sliding_window").none() = nb::none(), nb::arg("prefix") = "",
           nb::arg("attn_type") = "decoder",
           nb::arg("kv_sharing_target_layer_name").none() = nb::none(),
           nb::arg("attn_backend").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
           nb::arg("dtype") = "bfloat16", nb::arg("device") = "cpu",
           nb::arg("has_checkpoint_kv_scales") = false, nb::arg("quantize_query") = false,
           nb::arg("per_head_kv_scales") = false, nb::keep_alive<1, 2>(),
           "Resolves window and cache settings, validates, selects a backend (explaining any "
           "refusal) and registers under prefix in context.")
      .def_prop_ro("name", [](const PyAttention& a) { return a.layer.name(); })
      .def_prop_ro("config", [](const PyAttention& a) { return a.layer.config(); })
      .def_prop_ro(
          "run_config", [](const PyAttention& a) { return a.layer.run_config(); },
          "what the backend runs: config, or config at the head size padded to a multiple of 8 "
          "(then the cache's head size too)")
      .def_prop_ro(
          "backend", [](const PyAttention& a) { return &a.layer.backend(); },
          nb::rv_policy::reference)
      .def_prop_ro("calculate_kv_scales",
                   [](const PyAttention& a) { return a.layer.calculate_kv_scales(); })
      .def("extra_repr", [](const PyAttention& a) { return a.layer.extra_repr(); })
      .def("get_kv_cache_spec", [](const PyAttention& a) { return a.layer.get_kv_cache_spec(); })
      .def_prop_ro("kv_sharing_target_layer_name",
                   [](const PyAttention& a) { return a.layer.kv_sharing_target(); })
      .def("bind_kv_cache", &bind_caches, nb::arg("kv_caches"), nb::arg("kv_cache_group") = 0,
           "Binds one cache per virtual engine: a list of caches (each a combined array or a "
           "(key_cache, value_cache) pair), or one cache when pipeline_parallel_size is 1.")
      .def_prop_ro("kv_cache", [](const PyAttention& a) { return a.caches; })
      .def_prop_ro("kv_cache_group", [](const PyAttention& a) { return a.layer.kv_cache_group(); })
      .def_prop_ro("q_scale", [](const PyAttention& a) { return a.layer.q_scale(); })
      .def_prop_ro("k_scale", [](const PyAttention& a) { return a.layer.k_scale(); })
      .def_prop_ro("v_scale", [](const PyAttention& a) { return a.layer.v_scale(); })
      .def(
          "load_kv_scales",
          [](PyAttention& a, float q, float k, float v) { a.layer.load_kv_scales(q, k, v); },
          nb::arg("q_scale"), nb::arg("k_scale"), nb::arg("v_scale"),
          "Checkpoint scales after weight loading; a negative value means absent.")
      .def(
          "load_kv_scales",
          [](PyAttention& a, const std::vector<float>& q, const std::vector<float>& k,
             const std::vector<float>& v) { a.layer.load_kv_scales(q, k, v); },
          nb::arg("q_scale"), nb::arg("k_scale"), nb::arg("v_scale"),
          "Per-head checkpoint scales: lists of num_kv_heads floats; an empty list means "
          "absent.")
      .def_prop_ro("q_scales", [](const PyAttention& a) { return a.layer.q_scales(); })
      .def_prop_ro("k_scales", [](const PyAttention& a) { return a.layer.k_scales(); })
      .def_prop_ro("v_scales", [](const PyAttention& a) { return a.layer.v_scales(); })
      .def_prop_ro("warnings", [](const PyAttention& a) { return a.layer.warnings(); })
      .def("forward", &forward, nb::arg("query"), nb::arg("key").none(), nb::arg("value").none(),
           nb::arg("output").none() = nb::none(), nb::arg("lse").none() = nb::none(),
           nb::arg("stream") = 0,
           "query [T, num_heads*head_size] (or 3-D), key/value [T, num_kv_heads*head_size] or "
           "None. Without output, returns a new [T, num_heads*head_size] array (zero rows past "
           "num_actual_tokens).")
      .def("__call__", &forward, nb::arg("query"), nb::arg("key").none(), nb::arg("value").none(),
           nb::arg("output").none() = nb::none(), nb::arg("lse").none() = nb::none(),
           nb::arg("stream") = 0)
      .def("__repr__", [](const PyAttention& a) {
        return "Attention(" + a.layer.extra_repr() + ", prefix='" + a.layer.name() + "')";
      });

  nb::class_<PyMultiHeadAttention>(m, "MultiHeadAttention",
                                   "vLLM's MultiHeadAttention: dense bidirectional attention "
                                   "with no cache (vision encoders). forward() enqueues on "
                                   "`stream` (a cudaStream_t as an int; 0: the legacy default "
                                   "stream).")
      .def("__init__", &make_mha, nb::arg("num_heads"), nb::arg("head_size"), nb::arg("scale"),
           nb::arg("num_kv_heads").none() = nb::none(), nb::arg("prefix") = "",
           nb::arg("attn_backend").none() = nb::none(), nb::arg("dtype") = "bfloat16",
           nb::arg("device") = "cpu")
      .def_prop_ro(
          "backend_name",
          [](const PyMultiHeadAttention& a) { return std::string(a.layer.backend().name()); })
      .def("forward", &mha_forward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("output").none() = nb::none(), nb::arg("stream") = 0,
           "query [B, Sq, num_heads*head_size] (or 4-D), key/value [B, Skv, "
           "num_kv_heads*head_size] (or 4-D), any Skv (Skv != Sq runs as cross attention; "
           "Skv = 0 gives output 0). Without output, returns a new array shaped like query.")
      .def("__call__", &mha_forward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("output").none() = nb::none(), nb::arg("stream") = 0);

  nb::class_<PyMLA>(m, "MLAAttention",
                    "vLLM's MLAAttention (DeepSeek latent attention) over a paged latent cache: "
                    "decodes absorbed, prefills with K/V expanded per head and the cached "
                    "context in chunks merged by LSE (formulation='split', vLLM's; 'absorbed' "
                    "or 'prefill' force one for every request); host arrays on the ref and cpu "
                    "backends; forward() enqueues device work on `stream` (a cudaStream_t as an "
                    "int; 0: the legacy default stream).")
      .def("__init__", &make_mla, nb::arg("context"), nb::arg("num_heads"), nb::arg("scale"),
           nb::arg("qk_nope_head_dim"), nb::arg("qk_rope_head_dim"), nb::arg("v_head_dim"),
           nb::arg("q_lora_rank").none(), nb::arg("kv_lora_rank"),
           nb::arg("kv_b_proj").none() = nb::none(), nb::arg("cache_config").none() = nb::none(),
           nb::arg("prefix") = "", nb::arg("attn_backend").none() = nb::none(),
           nb::arg("dtype") = "bfloat16", nb::arg("device") = "cpu",
           nb::arg("formulation") = "split", nb::arg("decode_threshold") = 1,
           nb::arg("context_chunk_tokens") = MLAOptions{}.context_chunk_tokens)
      .def_prop_ro("config", [](const PyMLA& a) { return a.layer.config(); })
      .def_prop_ro("formulation",
                   [](const PyMLA& a) { return std::string(to_string(a.layer.formulation())); })
      .def_prop_ro("backend_name",
                   [](const PyMLA& a) { return std::string(a.layer.backend().name()); })
      .def_prop_rw(
          "k_scale", [](const PyMLA& a) { return a.layer.k_scale(); },
          [](PyMLA& a, float s) { a.layer.set_k_scale(s); })
      .def("get_kv_cache_spec", [](const PyMLA& a) { return a.layer.get_kv_cache_spec(); })
      .def(
          "load_kv_b_proj",
          [](PyMLA& a, nb::handle w) { a.layer.load_kv_b_proj(to_view(w, "kv_b_proj")); },
          nb::arg("weight"), "kv_b_proj's weight as [kv_lora_rank, num_heads*(P+V)].")
      .def(
          "bind_kv_cache",
          [](PyMLA& a, nb::handle cache) {
            a.layer.bind_kv_cache(to_view(cache, "latent_cache", true));
            a.cache = nb::borrow(cache);
          },
          nb::arg("latent_cache"), "The paged latent cache [num_blocks, block_size, L+R].")
      .def("forward", &mla_forward, nb::arg("q"), nb::arg("kv_c_normed"), nb::arg("k_pe"),
           nb::arg("output").none() = nb::none(), nb::arg("stream") = 0,
           "q [T, N, P+R], kv_c_normed [T, L], k_pe [T, R]; returns (or fills) [T, N*V].")
      .def("__call__", &mla_forward, nb::arg("q"), nb::arg("kv_c_normed"), nb::arg("k_pe"),
           nb::arg("output").none() = nb::none(), nb::arg("stream") = 0);
}

}  // namespace pagedattn::py
