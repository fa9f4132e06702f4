// Backends and the registry, per-layer impls (write_kv / forward with an explicit stream),
// plans, KV-cache allocation, merge of partial results, calc_kv_scales and amax.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <sstream>

#include "bindings.h"
#include "py_metadata.h"

namespace pagedattn::py {

using detail::cat;
using detail::require;

namespace {

/// pagedattn.Impl: one backend's implementation for a fixed config on one device.
struct PyImpl {
  const Backend* backend = nullptr;
  AttentionConfig config;
  Device device;
  std::unique_ptr<AttentionImpl> impl;
};

/// pagedattn.Plan: a backend's schedule for one step's metadata and one layer shape.
struct PyPlan {
  std::unique_ptr<Plan> plan;
  std::string backend;
};

std::string names_of(const Registry& r) {
  std::string s;
  for (const Backend* b : r.backends()) s += (s.empty() ? "" : ", ") + std::string(b->name());
  return s;
}

const Backend& find_backend(const std::string& name) {
  const Registry& r = default_registry();
  const Backend* b = r.find(name);
  require(b != nullptr, "backend '", name, "' is not registered; registered: ", names_of(r));
  return *b;
}

// The backend for device-level operations (merge, amax): by name, else cuda for CUDA memory,
// cpu (or ref) for host memory.
const Backend& backend_for(Device device, const std::optional<std::string>& name) {
  if (name) return find_backend(*name);
  const Registry& r = default_registry();
  if (device.is_cuda()) {
    if (const Backend* b = r.find("cuda")) return *b;
    detail::fail<NotSupported>("no backend of this build runs on ", to_string(device),
                               " (pagedattn was built without CUDA)");
  }
  if (const Backend* b = r.find("cpu")) return *b;
  return find_backend("ref");
}

void make_impl(PyImpl* self, const AttentionConfig& config, nb::handle device,
               const std::optional<std::string>& backend) {
  config.validate();
  const Device d = parse_device(device);
  const Backend& b = default_registry().select(BackendQuery{config, d}, backend);
  std::unique_ptr<AttentionImpl> impl = b.make_impl(config, d);
  new (self) PyImpl{&b, config, d, std::move(impl)};
}

// A scale argument: one float (per tensor) or a flat list (per head; the argument checks
// refuse lengths other than num_kv_heads or, for the attention, num_seqs * num_kv_heads).
using ScaleArg = std::variant<float, std::vector<float>>;

void set_scale(const ScaleArg& arg, float* whole, std::vector<float>* per_head) {
  if (const float* f = std::get_if<float>(&arg)) {
    *whole = *f;
  } else {
    *per_head = std::get<std::vector<float>>(arg);
  }
}

void impl_write_kv(PyImpl& s, nb::handle key, nb::handle value, nb::handle slot_mapping,
                   nb::handle kv_cache, const ScaleArg& k_scale, const ScaleArg& v_scale,
                   uintptr_t stream, bool check) {
  const AttentionConfig& c = s.config;
  WriteKVArgs a;
  a.key = as_heads(to_view(key, "key"), "key", c.num_kv_heads, c.head_size);
  a.value = as_heads(to_view(value, "value"), "value", c.num_kv_heads, c.head_size);
  a.slot_mapping = to_view(slot_mapping, "slot_mapping");
  a.kv_cache = to_cache_view(kv_cache, "kv_cache", c.cache_dtype());
  set_scale(k_scale, &a.scales.k_scale, &a.scales.k_scales);
  set_scale(v_scale, &a.scales.v_scale, &a.scales.v_scales);
  a.stream = to_stream(stream);
  check_write_kv_args(c, a, check);
  nb::gil_scoped_release release;
  s.impl->write_kv(a);
}

void impl_forward(PyImpl& s, nb::handle query, nb::handle kv_cache, const PyMetadata& metadata,
                  nb::handle output, nb::handle lse, nb::handle key, nb::handle value,
                  const ScaleArg& k_scale, const ScaleArg& v_scale, const PyPlan* plan,
                  nb::handle workspace, uintptr_t stream, bool check, const ScaleArg& q_scale) {
  const AttentionConfig& c = s.config;
  const AttentionMetadata& md = metadata.md;
  ForwardArgs f;
  f.query = as_heads(to_view(query, "query"), "query", c.num_heads, c.head_size);
  f.output = as_heads(to_view(output, "output", true), "output", c.num_heads, c.head_size);
  f.lse = to_view(lse, "lse", true);
  if (uses_kv_cache(c.attn_type)) {
    f.kv_cache = to_cache_view(kv_cache, "kv_cache", c.cache_dtype());
  } else {
    f.key = as_heads(to_view(key, "key"), "key", c.num_kv_heads, c.head_size);
    f.value = as_heads(to_view(value, "value"), "value", c.num_kv_heads, c.head_size);
  }
  set_scale(k_scale, &f.scales.k_scale, &f.scales.k_scales);
  set_scale(v_scale, &f.scales.v_scale, &f.scales.v_scales);
  set_scale(q_scale, &f.scales.q_scale, &f.scales.q_scales);
  f.metadata = &md;
  f.stream = to_stream(stream);
  // Metadata values are checked where the host can read them: CPU tensors or the *_cpu
  // mirrors (device-only metadata is checked by the cuda backend's checked mode).
  const bool host_metadata = md.query_start_loc_cpu.defined() && md.seq_lens_cpu.defined() &&
                             (md.slot_mapping.defined() || !uses_kv_cache(c.attn_type));
  check_forward_args(c, f, check && host_metadata);

  std::unique_ptr<Plan> own_plan;
  if (plan != nullptr) {
    require(plan->backend == s.backend->name(), "plan was made by backend '", plan->backend,
            "'; this impl runs on '", s.backend->name(), "'");
    f.plan = plan->plan.get();
  } else {
    own_plan = s.backend->plan(md, c);
    f.plan = own_plan.get();
  }
  const size_t need = f.plan->workspace_bytes();
  Tensor own_workspace;
  if (!workspace.is_none()) {
    const TensorView w = to_view(workspace, "workspace", true);
    require(w.device == f.query.device && w.is_contiguous() && w.nbytes() >= need,
            "workspace must be a contiguous array of >= ", need, " bytes on ",
            to_string(f.query.device), "; got ", describe(w));
    f.workspace = Workspace{w.data, w.nbytes()};
  } else if (need > 0) {
    own_workspace = Tensor::empty({int64_t(need)}, DType::kU8, f.query.device);
    f.workspace = Workspace{own_workspace.data(), need};
  }
  nb::gil_scoped_release release;
  s.impl->forward(f);
}

KVCache allocate(const AttentionConfig* config, int64_t num_blocks, int block_size,
                 int num_kv_heads, int head_size, nb::handle dtype, const std::string& layout,
                 nb::handle device) {
  const Device d = parse_device(device);
  if (config != nullptr) return KVCache::allocate(*config, num_blocks, d);
  return KVCache::allocate(num_blocks, block_size, num_kv_heads, head_size, parse_dtype(dtype),
                           parse_kv_cache_layout(layout), d);
}

// The combined [num_blocks, 2, ...] array, or for a V head size of its own (no combined view)
// the (key_cache, value_cache) pair of [num_blocks, block_size, num_kv_heads, d / dv] views of
// its one storage, the form write_kv and forward take.
nb::object export_cache(const KVCache& cache) {
  nb::capsule owner(new KVCache(cache), [](void* p) noexcept { delete static_cast<KVCache*>(p); });
  if (cache.split()) {
    const KVCacheView v = cache.view();
    return nb::make_tuple(export_view(v.key, owner), export_view(v.value, owner));
  }
  return export_view(cache.tensor(), owner);
}

}  // namespace

void bind_backend(nb::module_& m) {
  nb::class_<Backend>(m, "Backend", "A family of kernels behind one name (ref, cpu, cuda).")
      .def_prop_ro("name", [](const Backend& b) { return std::string(b.name()); })
      .def_prop_ro("description", [](const Backend& b) { return std::string(b.description()); })
      .def(
          "check",
          [](const Backend& b, const AttentionConfig& c, nb::handle device) {
            return b.check(BackendQuery{c, parse_device(device)});
          },
          nb::arg("config"), nb::arg("device") = "cpu",
          "Why this backend cannot serve config on device (empty = supported).")
      .def("options", &Backend::options,
           "The backend's options (kernel variants, tuning knobs) with their current values.")
      .def("__repr__",
           [](const Backend& b) { return cat("<pagedattn.Backend '", b.name(), "'>"); });

  nb::class_<BackendOptionInfo>(m, "BackendOptionInfo",
                                "One option of a backend: its value, what it allows, what it does.")
      .def_ro("name", &BackendOptionInfo::name)
      .def_ro("value", &BackendOptionInfo::value)
      .def_ro("allowed", &BackendOptionInfo::allowed)
      .def_ro("help", &BackendOptionInfo::help)
      .def("__repr__", [](const BackendOptionInfo& i) {
        return cat("BackendOptionInfo(name='", i.name, "', value='", i.value, "')");
      });

  nb::class_<BackendVerdict>(m, "BackendVerdict", "One backend's answer to a configuration.")
      .def_ro("name", &BackendVerdict::name)
      .def_ro("reasons", &BackendVerdict::reasons)
      .def_prop_ro("supported", &BackendVerdict::supported)
      .def("__repr__", [](const BackendVerdict& v) {
        return cat("BackendVerdict(name='", v.name,
                   "', supported=", v.supported() ? "True" : "False",
                   ", reasons=", v.reasons.size(), ")");
      });

  m.def(
      "list_backends", [] { return default_registry().backends(); }, nb::rv_policy::reference,
      "The registered backends in priority order.");
  m.def(
      "get_backend", [](const std::string& name) { return &find_backend(name); }, nb::arg("name"),
      nb::rv_policy::reference);
  m.def(
      "explain",
      [](const AttentionConfig& c, nb::handle device) {
        return default_registry().explain(BackendQuery{c, parse_device(device)});
      },
      nb::arg("config"), nb::arg("device") = "cpu",
      "Every backend's verdict on config, in priority order (what `pagedattn backends` prints).");
  m.def(
      "select_backend",
      [](const AttentionConfig& c, nb::handle device, const std::optional<std::string>& name) {
        return &default_registry().select(BackendQuery{c, parse_device(device)}, name);
      },
      nb::arg("config"), nb::arg("device") = "cpu", nb::arg("name").none() = nb::none(),
      nb::rv_policy::reference,
      "The backend that serves config: `name` (or $PAGEDATTN_BACKEND) forces one and never "
      "falls back; otherwise the first supported. Raises NotSupported listing every reason.");
  m.def("format_verdicts", &format_verdicts, nb::arg("verdicts"));
  m.def(
      "configure_backend",
      [](const std::string& name, const std::vector<std::string>& settings) {
        default_registry().configure(name, settings);
      },
      nb::arg("name"), nb::arg("settings"),
      "Replaces the registered backend `name` with one whose options are its current ones with "
      "settings (\"name=value\" each) applied (Registry::configure). Impls made before keep "
      "their options. Raises InvalidArgument naming the option, the value and what is allowed.");

  nb::class_<PyPlan>(m, "Plan", "A backend's schedule for one step and one layer shape.")
      .def_prop_ro("workspace_bytes", [](const PyPlan& p) { return p.plan->workspace_bytes(); })
      .def_ro("backend", &PyPlan::backend);

  nb::class_<PyImpl>(m, "Impl",
                     "One backend's implementation of a layer config on one device: write_kv and "
                     "forward with an explicit stream (what pagedattn.torch calls).")
      .def("__init__", &make_impl, nb::arg("config"), nb::arg("device") = "cpu",
           nb::arg("backend").none() = nb::none(),
           "Validates config and selects its backend (by name, $PAGEDATTN_BACKEND or priority).")
      .def_prop_ro(
          "backend", [](const PyImpl& s) { return s.backend; }, nb::rv_policy::reference)
      .def_prop_ro("config", [](const PyImpl& s) { return s.config; })
      .def_prop_ro("device", [](const PyImpl& s) { return to_string(s.device); })
      .def("write_kv", &impl_write_kv, nb::arg("key"), nb::arg("value"), nb::arg("slot_mapping"),
           nb::arg("kv_cache"), nb::arg("k_scale") = 1.0f, nb::arg("v_scale") = 1.0f,
           nb::arg("stream") = 0, nb::arg("check") = true,
           "Scatters key/value [T, num_kv_heads(, *)head_size] into kv_cache (one combined "
           "array or a (key_cache, value_cache) pair) at slot_mapping (int64; -1 skips). "
           "k_scale / v_scale: a float, or a list of num_kv_heads floats (per head).")
      .def(
          "plan",
          [](const PyImpl& s, const PyMetadata& md) {
            return PyPlan{s.backend->plan(md.md, s.config), std::string(s.backend->name())};
          },
          nb::arg("metadata"))
      .def("forward", &impl_forward, nb::arg("query"), nb::arg("kv_cache").none(),
           nb::arg("metadata"), nb::arg("output"), nb::arg("lse").none() = nb::none(),
           nb::arg("key").none() = nb::none(), nb::arg("value").none() = nb::none(),
           nb::arg("k_scale") = 1.0f, nb::arg("v_scale") = 1.0f,
           nb::arg("plan").none() = nb::none(), nb::arg("workspace").none() = nb::none(),
           nb::arg("stream") = 0, nb::arg("check") = true, nb::arg("q_scale") = 1.0f,
           "Attention only: every key is read from kv_cache (key/value for encoder types). "
           "Writes output rows [0, num_actual_tokens) and, when given, lse float32 [num_heads, "
           "num_tokens]. Without a plan one is made from the metadata's host mirrors; without "
           "a workspace one is allocated for the call. q_scale is the query's fp8 scale under "
           "config.query_quant. Each scale is a float or a flat list of num_kv_heads (per "
           "head) or num_seqs * num_kv_heads (per sequence and head, row-major) floats.");

  m.def(
      "allocate_kv_cache",
      [](int64_t num_blocks, int block_size, int num_kv_heads, int head_size, nb::handle dtype,
         const std::string& layout, nb::handle device) {
        return export_cache(allocate(nullptr, num_blocks, block_size, num_kv_heads, head_size,
                                     dtype, layout, device));
      },
      nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("num_kv_heads"), nb::arg("head_size"),
      nb::arg("dtype"), nb::arg("layout") = "NHD", nb::arg("device") = "cpu",
      "A zero-filled [num_blocks, 2, block_size, num_kv_heads, head_size] cache (strided for "
      "HND). fp8 caches are uint8 bytes.");
  m.def(
      "allocate_kv_cache",
      [](const AttentionConfig& config, int64_t num_blocks, nb::handle device) {
        return export_cache(allocate(&config, num_blocks, 0, 0, 0, nb::none(), "NHD", device));
      },
      nb::arg("config"), nb::arg("num_blocks"), nb::arg("device") = "cpu",
      "A cache for config (its block size, KV heads, head size, cache dtype and layout); with "
      "a v_head_size of its own, a (key_cache, value_cache) pair of views of one storage.");

  m.def(
      "merge_attn_states",
      [](nb::handle output, nb::handle prefix_output, nb::handle prefix_lse,
         nb::handle suffix_output, nb::handle suffix_lse, nb::handle output_lse,
         const std::optional<std::string>& backend, uintptr_t stream) {
        MergeArgs a;
        a.output = to_view(output, "output", true);
        a.prefix_output = to_view(prefix_output, "prefix_output");
        a.prefix_lse = to_view(prefix_lse, "prefix_lse");
        a.suffix_output = to_view(suffix_output, "suffix_output");
        a.suffix_lse = to_view(suffix_lse, "suffix_lse");
        a.output_lse = to_view(output_lse, "output_lse", true);
        a.stream = to_stream(stream);
        check_merge_args(a);
        const Backend& b = backend_for(a.output.device, backend);
        nb::gil_scoped_release release;
        b.merge_states(a);
      },
      nb::arg("output"), nb::arg("prefix_output"), nb::arg("prefix_lse"), nb::arg("suffix_output"),
      nb::arg("suffix_lse"), nb::arg("output_lse").none() = nb::none(),
      nb::arg("backend").none() = nb::none(), nb::arg("stream") = 0,
      "vLLM's merge_attn_states: outputs [N, H, D], LSEs float32 [H, N] (natural log; any "
      "infinity reads as -inf).");

  nb::class_<CalibratedScales>(m, "CalibratedScales", "Scales from one batch (calc_kv_scales).")
      .def_ro("q_scale", &CalibratedScales::q_scale)
      .def_ro("k_scale", &CalibratedScales::k_scale)
      .def_ro("v_scale", &CalibratedScales::v_scale)
      .def_ro("all_zero", &CalibratedScales::all_zero)
      .def("__repr__", [](const CalibratedScales& s) {
        std::ostringstream os;
        os << "CalibratedScales(q_scale=" << s.q_scale << ", k_scale=" << s.k_scale
           << ", v_scale=" << s.v_scale << ", all_zero=" << (s.all_zero ? "True" : "False") << ")";
        return os.str();
      });
  m.def(
      "calc_kv_scales",
      [](nb::handle query, nb::handle key, nb::handle value,
         const std::optional<std::string>& backend) {
        const TensorView q = to_view(query, "query"), k = to_view(key, "key"),
                         v = to_view(value, "value");
        require(q.defined() && k.defined() && v.defined(), "query, key and value are required");
        const Backend& b = backend_for(q.device, backend);
        nb::gil_scoped_release release;
        return calc_kv_scales(b, q, k, v);
      },
      nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("backend").none() = nb::none(),
      "vLLM's calc_kv_scales: q = max|q| / 200, k = max|k| / 200, v = max|v| / 100 "
      "($PAGEDATTN_{Q,K,V}_SCALE_CONSTANT override the divisors).");
  m.def(
      "amax",
      [](nb::handle x, const std::optional<std::string>& backend) {
        const TensorView v = to_view(x, "x");
        require(v.defined(), "x is required");
        const Backend& b = backend_for(v.device, backend);
        nb::gil_scoped_release release;
        return b.amax(v);
      },
      nb::arg("x"), nb::arg("backend").none() = nb::none(), "max |x| over a float array.");
  m.def(
      "device_count",
      [](const std::string& type) {
        require(type == "cpu" || type == "cuda", "device type '", type, "' is not 'cpu' or 'cuda'");
        DeviceRuntime* r = device_runtime(type == "cpu" ? DeviceType::kCPU : DeviceType::kCUDA);
        return r ? r->device_count() : 0;
      },
      nb::arg("type") = "cuda", "Visible devices of a type (0 when this build has no runtime).");
}

}  // namespace pagedattn::py
