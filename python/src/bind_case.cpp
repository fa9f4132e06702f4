// Attention case files (load / save / run / check / random) and the accuracy rule.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "convert.h"

namespace pagedattn::py {

namespace {

// An owning host copy of an array (None -> an undefined tensor).
Tensor host_copy(nb::handle obj, std::string_view name) {
  const TensorView v = to_view(obj, name);
  if (!v.defined()) return {};
  return Tensor::copy_of(v, Device::cpu());
}

nb::object maybe_export(const Tensor& t) {
  return t.defined() ? export_tensor(t) : nb::none();
}

// A Case tensor property: read as an exported array sharing the case's storage, written as a
// host copy of any array.
template <Tensor Case::*field>
void tensor_property(nb::class_<Case>& cls, const char* name, const char* doc) {
  cls.def_prop_rw(
      name, [](const Case& c) { return maybe_export(c.*field); },
      [name](Case& c, nb::handle v) { c.*field = host_copy(v, name); }, nb::arg("value").none(),
      doc);
}

template <Tensor CaseResult::*field>
void result_property(nb::class_<CaseResult>& cls, const char* name, const char* doc) {
  cls.def_prop_rw(
      name, [](const CaseResult& r) { return maybe_export(r.*field); },
      [name](CaseResult& r, nb::handle v) { r.*field = host_copy(v, name); },
      nb::arg("value").none(), doc);
}

const Backend& case_backend(const Case& c, const std::optional<std::string>& name, Device device) {
  return default_registry().select(BackendQuery{c.config, device}, name);
}

}  // namespace

void bind_case(nb::module_& m) {
  nb::class_<Case> cls(m, "Case",
                       "One attention step (inputs, cache before the step, metadata) as stored in "
                       "a case file. Tensors are host copies; setting one copies the array.");
  cls.def(
         "__init__",
         [](Case* self, const AttentionConfig& config, nb::handle query, nb::handle key,
            nb::handle value, nb::handle kv_cache, nb::handle block_table, nb::handle seq_lens,
            nb::handle query_start_loc, nb::handle slot_mapping, float k_scale, float v_scale) {
           Case c;
           c.config = config;
           c.scales = KVScales{k_scale, v_scale};
           c.query = host_copy(query, "query");
           c.key = host_copy(key, "key");
           c.value = host_copy(value, "value");
           c.kv_cache = host_copy(kv_cache, "kv_cache");
           c.block_table = host_copy(block_table, "block_table");
           c.seq_lens = host_copy(seq_lens, "seq_lens");
           c.query_start_loc = host_copy(query_start_loc, "query_start_loc");
           c.slot_mapping = host_copy(slot_mapping, "slot_mapping");
           // Checks it the way a loaded file is checked (FormatError naming the tensor).
           new (self) Case(case_from_safetensors(case_to_safetensors(c)));
         },
         nb::arg("config"), nb::arg("query"), nb::arg("key").none(), nb::arg("value").none(),
         nb::arg("kv_cache").none(), nb::arg("block_table"), nb::arg("seq_lens"),
         nb::arg("query_start_loc"), nb::arg("slot_mapping"), nb::arg("k_scale") = 1.0f,
         nb::arg("v_scale") = 1.0f,
         "A case from arrays (copied). Shapes as in docs/case_format.md: query [T, H, D], "
         "key/value [T_kv, H_kv, D], kv_cache [NB, 2, bs, H_kv, D] (uint8 for fp8).")
      .def_rw("config", &Case::config)
      .def_prop_rw(
          "k_scale", [](const Case& c) { return c.scales.k_scale; },
          [](Case& c, float s) { c.scales.k_scale = s; })
      .def_prop_rw(
          "v_scale", [](const Case& c) { return c.scales.v_scale; },
          [](Case& c, float s) { c.scales.v_scale = s; })
      .def_prop_rw(
          "k_scales", [](const Case& c) { return c.scales.k_scales; },
          [](Case& c, const std::vector<float>& s) { c.scales.k_scales = s; },
          "per-KV-head k scales ([] = k_scale for every head)")
      .def_prop_rw(
          "v_scales", [](const Case& c) { return c.scales.v_scales; },
          [](Case& c, const std::vector<float>& s) { c.scales.v_scales = s; })
      .def_prop_rw(
          "q_scales", [](const Case& c) { return c.scales.q_scales; },
          [](Case& c, const std::vector<float>& s) { c.scales.q_scales = s; })
      .def_prop_ro("num_seqs", &Case::num_seqs)
      .def_prop_ro("num_tokens", &Case::num_tokens)
      .def_prop_ro("num_actual_tokens", &Case::num_actual_tokens)
      .def_prop_ro("writes_kv", &Case::writes_kv)
      .def("__repr__", [](const Case& c) { return "Case(" + describe(c) + ")"; });
  tensor_property<&Case::query>(cls, "query", "[num_tokens, num_heads, head_size]");
  tensor_property<&Case::key>(cls, "key", "[num_kv_tokens, num_kv_heads, head_size] or None");
  tensor_property<&Case::value>(cls, "value", "[num_kv_tokens, num_kv_heads, head_size] or None");
  tensor_property<&Case::kv_cache>(cls, "kv_cache",
                                   "[num_blocks, 2, block_size, num_kv_heads, head_size] or None");
  tensor_property<&Case::block_table>(cls, "block_table", "int32 [num_seqs, max_blocks_per_seq]");
  tensor_property<&Case::seq_lens>(cls, "seq_lens", "int32 [num_seqs]");
  tensor_property<&Case::query_start_loc>(cls, "query_start_loc", "int32 [num_seqs + 1]");
  tensor_property<&Case::slot_mapping>(cls, "slot_mapping", "int64 [num_slots]");

  nb::class_<CaseResult> res(m, "CaseResult", "What a step produced, on the host.");
  res.def(
         "__init__",
         [](CaseResult* self, nb::handle output, nb::handle kv_cache, nb::handle lse) {
           CaseResult r;
           r.output = host_copy(output, "output");
           r.kv_cache = host_copy(kv_cache, "kv_cache");
           r.lse = host_copy(lse, "lse");
           new (self) CaseResult(std::move(r));
         },
         nb::arg("output"), nb::arg("kv_cache").none() = nb::none(),
         nb::arg("lse").none() = nb::none(),
         "A result computed elsewhere (e.g. pagedattn.torch on a GPU), to check_case it.")
      .def("__repr__", [](const CaseResult& r) {
        return std::string("CaseResult(output=") + (r.output.defined() ? "yes" : "None") +
               ", kv_cache=" + (r.kv_cache.defined() ? "yes" : "None") +
               ", lse=" + (r.lse.defined() ? "yes" : "None") + ")";
      });
  result_property<&CaseResult::output>(res, "output", "[num_tokens, num_heads * head_size]");
  result_property<&CaseResult::kv_cache>(res, "kv_cache", "the cache after the step, or None");
  result_property<&CaseResult::lse>(res, "lse", "[num_heads, num_tokens] float32, or None");

  nb::class_<ErrorStats>(m, "ErrorStats", "Differences between a result and the reference.")
      .def_ro("max_abs", &ErrorStats::max_abs)
      .def_ro("max_ref", &ErrorStats::max_ref)
      .def_ro("rel_l2", &ErrorStats::rel_l2)
      .def_ro("count", &ErrorStats::count)
      .def_ro("mismatched_nonfinite", &ErrorStats::mismatched_nonfinite)
      .def("__repr__", &ErrorStats::to_string);
  nb::class_<Tolerance>(m, "Tolerance", "budget = multiple * baseline.max_abs + atol")
      .def_ro("multiple", &Tolerance::multiple)
      .def_ro("atol", &Tolerance::atol);
  nb::class_<TensorCheck>(m, "TensorCheck", "One tensor against the float64 reference.")
      .def_ro("got", &TensorCheck::got)
      .def_ro("baseline", &TensorCheck::baseline)
      .def_ro("tolerance", &TensorCheck::tolerance)
      .def_ro("passed", &TensorCheck::pass)
      .def_prop_ro("budget", &TensorCheck::budget);
  nb::class_<CaseCheck>(m, "CaseCheck", "The verdict of check_case.")
      .def_ro("output", &CaseCheck::output)
      .def_ro("lse", &CaseCheck::lse)
      .def_ro("kv_cache_elements", &CaseCheck::kv_cache_elements)
      .def_ro("kv_cache_mismatches", &CaseCheck::kv_cache_mismatches)
      .def_ro("kv_cache_problem", &CaseCheck::kv_cache_problem)
      .def_prop_ro("passed", &CaseCheck::pass)
      .def("__bool__", &CaseCheck::pass)
      .def("__str__", &CaseCheck::to_string)
      .def("__repr__", &CaseCheck::to_string);

  m.def("load_case", &load_case, nb::arg("path"),
        "Reads a case file (docs/case_format.md); raises FormatError naming the problem.");
  m.def("save_case", &save_case, nb::arg("path"), nb::arg("case"),
        "Writes a case file (atomically) that load_case gives back.");
  m.def(
      "run_case",
      [](const Case& c, const std::optional<std::string>& backend, bool lse,
         std::optional<nb::handle> output_dtype, nb::handle lse_dtype, nb::handle device) {
        RunCaseOptions o;
        o.lse = lse;
        if (output_dtype && !output_dtype->is_none()) o.output_dtype = parse_dtype(*output_dtype);
        o.lse_dtype = parse_dtype(lse_dtype);
        o.device = parse_device(device);
        const Backend& b = case_backend(c, backend, o.device);
        nb::gil_scoped_release release;
        return run_case(c, b, o);
      },
      nb::arg("case"), nb::arg("backend").none() = nb::none(), nb::arg("lse") = false,
      nb::arg("output_dtype").none() = nb::none(), nb::arg("lse_dtype") = "float32",
      nb::arg("device") = "cpu",
      "Runs the step (write_kv into a copy of the cache, then attention) on a backend: by name, "
      "else the one the registry selects for the case on device. Results come back to the "
      "host.");
  m.def(
      "check_case",
      [](const Case& c, const CaseResult& r) {
        nb::gil_scoped_release release;
        return check_case(c, r);
      },
      nb::arg("case"), nb::arg("result"),
      "Checks a result against the float64 reference with the accuracy rule (docs/testing.md); "
      "the cache after the step must match the reference's bytes.");
  m.def(
      "save_case_result",
      [](const std::string& path, const Case& c, const CaseResult& r, const std::string& backend) {
        save_case_result(path, c, r, backend);
      },
      nb::arg("path"), nb::arg("case"), nb::arg("result"), nb::arg("backend") = "");
  m.def(
      "make_random_case",
      [](uint64_t seed, const std::string& attn_type, int num_heads, int num_kv_heads,
         int head_size, nb::handle dtype, const std::string& kv_cache_dtype, int block_size,
         std::optional<float> scale, std::optional<int> sliding_window,
         std::optional<float> logits_soft_cap, bool alibi, bool sinks, float k_scale, float v_scale,
         const std::vector<std::pair<int, int>>& requests, int pad_tokens, int spare_blocks,
         bool cross_kv) {
        CaseSpec s;
        s.seed = seed;
        s.attn_type = parse_attn_type(attn_type);
        s.num_heads = num_heads;
        s.num_kv_heads = num_kv_heads;
        s.head_size = head_size;
        s.dtype = parse_dtype(dtype);
        s.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
        s.block_size = block_size;
        s.scale = scale;
        s.sliding_window = sliding_window;
        s.logits_soft_cap = logits_soft_cap;
        s.alibi = alibi;
        s.sinks = sinks;
        s.scales = KVScales{k_scale, v_scale};
        s.requests.clear();
        for (const auto& [ctx, n] : requests) s.requests.push_back(CaseRequest{ctx, n});
        s.pad_tokens = pad_tokens;
        s.spare_blocks = spare_blocks;
        s.cross_kv = cross_kv;
        return make_random_case(s);
      },
      nb::arg("seed") = 0, nb::arg("attn_type") = "decoder", nb::arg("num_heads") = 4,
      nb::arg("num_kv_heads") = 2, nb::arg("head_size") = 32, nb::arg("dtype") = "bfloat16",
      nb::arg("kv_cache_dtype") = "auto", nb::arg("block_size") = 16,
      nb::arg("scale").none() = nb::none(), nb::arg("sliding_window").none() = nb::none(),
      nb::arg("logits_soft_cap").none() = nb::none(), nb::arg("alibi") = false,
      nb::arg("sinks") = false, nb::arg("k_scale") = 1.0f, nb::arg("v_scale") = 1.0f,
      nb::arg("requests") = std::vector<std::pair<int, int>>{{0, 7}, {21, 1}, {5, 12}},
      nb::arg("pad_tokens") = 0, nb::arg("spare_blocks") = 2, nb::arg("cross_kv") = true,
      "A deterministic random case; requests are (context_len, num_new_tokens) pairs.");
  m.def(
      "compare",
      [](nb::handle got, nb::handle ref) {
        return compare(host_copy(got, "got").view(), host_copy(ref, "ref").view());
      },
      nb::arg("got"), nb::arg("ref"),
      "Element-wise differences of two float arrays of one shape (same-sign infinities equal).");
  m.def(
      "default_tolerance", [](nb::handle dtype) { return default_tolerance(parse_dtype(dtype)); },
      nb::arg("dtype"));
}

}  // namespace pagedattn::py
