// RequestSpec, MetadataBuilder, StepMetadata and AttentionMetadata (arrays from any producer).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <sstream>

#include "bindings.h"
#include "py_metadata.h"

namespace pagedattn::py {

using detail::require;

namespace {

/// pagedattn.StepMetadata: host buffers built by MetadataBuilder, shared with the metadata
/// objects made from them.
struct PyStepMetadata {
  std::shared_ptr<StepMetadata> step;
};

nb::capsule step_owner(const std::shared_ptr<StepMetadata>& step) {
  return nb::capsule(new std::shared_ptr<StepMetadata>(step), [](void* p) noexcept {
    delete static_cast<std::shared_ptr<StepMetadata>*>(p);
  });
}

int32_t at_i32(const TensorView& v, int64_t i) {
  return static_cast<const int32_t*>(v.data)[i * v.stride(0)];
}

// The host-visible form of a metadata vector: its mirror, else itself when on the CPU.
TensorView host_view(const TensorView& main, const TensorView& mirror, std::string_view name) {
  const TensorView v = mirror.defined() ? mirror : main;
  if (!v.defined() || !v.device.is_cpu()) return {};
  require(v.ndim == 1 && v.dtype == DType::kI32, "metadata.", name, " must be int32 [n]; got ",
          describe(v));
  return v;
}

void make_metadata(PyMetadata* self, nb::object query_start_loc, nb::object seq_lens,
                   nb::object block_table, nb::object slot_mapping, std::optional<int> num_seqs,
                   std::optional<int> num_actual_tokens, std::optional<int> max_query_len,
                   std::optional<int> max_seq_len, bool causal, nb::object query_start_loc_cpu,
                   nb::object seq_lens_cpu) {
  PyMetadata local;  // constructed in place only once every check passed
  PyMetadata* p = &local;
  AttentionMetadata& md = p->md;
  md.query_start_loc = to_view(query_start_loc, "metadata.query_start_loc");
  md.seq_lens = to_view(seq_lens, "metadata.seq_lens");
  md.block_table = to_view(block_table, "metadata.block_table");
  md.slot_mapping = to_view(slot_mapping, "metadata.slot_mapping");
  md.query_start_loc_cpu = to_view(query_start_loc_cpu, "metadata.query_start_loc_cpu");
  md.seq_lens_cpu = to_view(seq_lens_cpu, "metadata.seq_lens_cpu");
  require(md.query_start_loc.defined() && md.seq_lens.defined(),
          "metadata.query_start_loc and metadata.seq_lens are required");
  require(md.seq_lens.ndim == 1, "metadata.seq_lens must be int32 [num_seqs]; got ",
          describe(md.seq_lens));
  md.num_seqs = num_seqs.value_or(int(md.seq_lens.size(0)));
  md.causal = causal;
  // CPU metadata is its own host mirror (plans and validation read the mirrors).
  if (!md.query_start_loc_cpu.defined() && md.query_start_loc.device.is_cpu()) {
    md.query_start_loc_cpu = md.query_start_loc;
  }
  if (!md.seq_lens_cpu.defined() && md.seq_lens.device.is_cpu()) md.seq_lens_cpu = md.seq_lens;

  const TensorView qsl = host_view(md.query_start_loc, md.query_start_loc_cpu, "query_start_loc");
  const TensorView sl = host_view(md.seq_lens, md.seq_lens_cpu, "seq_lens");
  auto missing = [&](const char* field) {
    detail::fail("metadata.", field,
                 " is required when query_start_loc and seq_lens are not on the CPU and no "
                 "query_start_loc_cpu / seq_lens_cpu mirrors are given");
  };
  if (qsl.defined()) {
    require(qsl.size(0) >= md.num_seqs + 1, "metadata.query_start_loc has ", qsl.size(0),
            " entries; expected num_seqs + 1 (", md.num_seqs + 1, ")");
  }
  if (sl.defined()) {
    require(sl.size(0) >= md.num_seqs, "metadata.seq_lens has ", sl.size(0),
            " entries; expected num_seqs (", md.num_seqs, ")");
  }
  if (num_actual_tokens) {
    md.num_actual_tokens = *num_actual_tokens;
  } else if (qsl.defined()) {
    md.num_actual_tokens = at_i32(qsl, md.num_seqs);
  } else {
    missing("num_actual_tokens");
  }
  if (max_query_len) {
    md.max_query_len = *max_query_len;
  } else if (qsl.defined()) {
    for (int r = 0; r < md.num_seqs; ++r) {
      md.max_query_len = std::max(md.max_query_len, at_i32(qsl, r + 1) - at_i32(qsl, r));
    }
  } else {
    missing("max_query_len");
  }
  if (max_seq_len) {
    md.max_seq_len = *max_seq_len;
  } else if (sl.defined()) {
    for (int r = 0; r < md.num_seqs; ++r) md.max_seq_len = std::max(md.max_seq_len, at_i32(sl, r));
  } else {
    missing("max_seq_len");
  }
  p->query_start_loc = query_start_loc;
  p->seq_lens = seq_lens;
  p->block_table = block_table;
  p->slot_mapping = slot_mapping;
  p->query_start_loc_cpu = query_start_loc_cpu;
  p->seq_lens_cpu = seq_lens_cpu;
  new (self) PyMetadata(std::move(local));
}

// Metadata over a step's buffers: the host buffers themselves, or a device copy of them.
PyMetadata metadata_of(const std::shared_ptr<StepMetadata>& step, Device device) {
  PyMetadata p;
  if (device.is_cpu()) {
    p.step = step;
    p.md = step->view();
  } else {
    p.step = std::make_shared<StepMetadata>(*step);  // earlier device copies stay valid
    p.md = p.step->to_device(device);
  }
  const nb::capsule owner = step_owner(p.step);
  auto out = [&](const TensorView& v) { return v.defined() ? export_view(v, owner) : nb::none(); };
  p.query_start_loc = out(p.md.query_start_loc);
  p.seq_lens = out(p.md.seq_lens);
  p.block_table = out(p.md.block_table);
  p.slot_mapping = out(p.md.slot_mapping);
  p.query_start_loc_cpu = out(p.md.query_start_loc_cpu);
  p.seq_lens_cpu = out(p.md.seq_lens_cpu);
  return p;
}

std::string repr(const AttentionMetadata& md) {
  std::ostringstream os;
  os << "AttentionMetadata(num_seqs=" << md.num_seqs
     << ", num_actual_tokens=" << md.num_actual_tokens << ", max_query_len=" << md.max_query_len
     << ", max_seq_len=" << md.max_seq_len << ", causal=" << (md.causal ? "True" : "False")
     << ", device='" << to_string(md.query_start_loc.device) << "')";
  return os.str();
}

}  // namespace

void bind_metadata(nb::module_& m) {
  nb::class_<RequestSpec>(m, "RequestSpec", "One request of a step, as a scheduler sees it.")
      .def(
          "__init__",
          [](RequestSpec* self, int context_len, int num_new_tokens,
             std::vector<int32_t> block_ids) {
            new (self) RequestSpec{context_len, num_new_tokens, std::move(block_ids)};
          },
          nb::arg("context_len") = 0, nb::arg("num_new_tokens") = 0,
          nb::arg("block_ids") = std::vector<int32_t>{})
      .def_rw("context_len", &RequestSpec::context_len, "Tokens already in the cache.")
      .def_rw("num_new_tokens", &RequestSpec::num_new_tokens, "Query tokens this step.")
      .def_rw("block_ids", &RequestSpec::block_ids, "Physical blocks in logical order.")
      .def("__repr__", [](const RequestSpec& r) {
        std::ostringstream os;
        os << "RequestSpec(context_len=" << r.context_len << ", num_new_tokens=" << r.num_new_tokens
           << ", block_ids=[";
        for (size_t i = 0; i < r.block_ids.size(); ++i) os << (i ? ", " : "") << r.block_ids[i];
        os << "])";
        return os.str();
      });

  nb::class_<PyStepMetadata>(m, "StepMetadata",
                             "Host buffers of one step, built by MetadataBuilder.build().")
      .def_prop_ro("num_seqs", [](const PyStepMetadata& s) { return int(s.step->seq_lens.size()); })
      .def_prop_ro("num_actual_tokens",
                   [](const PyStepMetadata& s) { return s.step->query_start_loc.back(); })
      .def_prop_ro("max_query_len", [](const PyStepMetadata& s) { return s.step->max_query_len; })
      .def_prop_ro("max_seq_len", [](const PyStepMetadata& s) { return s.step->max_seq_len; })
      .def_prop_ro("max_blocks_per_seq",
                   [](const PyStepMetadata& s) { return s.step->max_blocks_per_seq; })
      .def_prop_ro("causal", [](const PyStepMetadata& s) { return s.step->causal; })
      .def_prop_ro(
          "query_start_loc",
          [](const PyStepMetadata& s) {
            return export_view(s.step->view().query_start_loc, step_owner(s.step));
          },
          "int32 [num_seqs + 1] (a numpy view of the step's buffer).")
      .def_prop_ro(
          "seq_lens",
          [](const PyStepMetadata& s) {
            return export_view(s.step->view().seq_lens, step_owner(s.step));
          },
          "int32 [num_seqs].")
      .def_prop_ro(
          "block_table",
          [](const PyStepMetadata& s) {
            return export_view(s.step->view().block_table, step_owner(s.step));
          },
          "int32 [num_seqs, max_blocks_per_seq].")
      .def_prop_ro(
          "slot_mapping",
          [](const PyStepMetadata& s) {
            return export_view(s.step->view().slot_mapping, step_owner(s.step));
          },
          "int64 [num_slots]; -1 = not written.")
      .def(
          "metadata",
          [](const PyStepMetadata& s, nb::handle device) {
            return metadata_of(s.step, parse_device(device));
          },
          nb::arg("device") = "cpu",
          "The AttentionMetadata of this step on `device` (a device copy for 'cuda'; the host "
          "mirrors stay in host memory).");

  nb::class_<MetadataBuilder>(m, "MetadataBuilder", "Builds a step's metadata from requests.")
      .def(nb::init<int>(), nb::arg("block_size"))
      .def(
          "add",
          [](MetadataBuilder& b, const RequestSpec& r) -> MetadataBuilder& { return b.add(r); },
          nb::arg("request"), nb::rv_policy::reference)
      .def(
          "add",
          [](MetadataBuilder& b, int context_len, int num_new_tokens,
             std::vector<int32_t> block_ids) -> MetadataBuilder& {
            return b.add(RequestSpec{context_len, num_new_tokens, std::move(block_ids)});
          },
          nb::arg("context_len"), nb::arg("num_new_tokens"),
          nb::arg("block_ids") = std::vector<int32_t>{}, nb::rv_policy::reference)
      .def("add_padding_requests", &MetadataBuilder::add_padding_requests, nb::arg("count"),
           nb::rv_policy::reference)
      .def("pad_slots_to", &MetadataBuilder::pad_slots_to, nb::arg("num_tokens"),
           nb::rv_policy::reference)
      .def("causal", &MetadataBuilder::causal, nb::arg("causal"), nb::rv_policy::reference)
      .def("max_seq_len_at_least", &MetadataBuilder::max_seq_len_at_least, nb::arg("max_seq_len"),
           nb::rv_policy::reference)
      .def("build", [](const MetadataBuilder& b) {
        return PyStepMetadata{std::make_shared<StepMetadata>(b.build())};
      });

  nb::class_<PyMetadata>(m, "AttentionMetadata",
                         "One step's batch description (vLLM's CommonAttentionMetadata) over "
                         "arrays from any DLPack producer (zero copy; the arrays are kept "
                         "alive by this object).")
      .def("__init__", &make_metadata, nb::arg("query_start_loc"), nb::arg("seq_lens"),
           nb::arg("block_table").none() = nb::none(), nb::arg("slot_mapping").none() = nb::none(),
           nb::kw_only(), nb::arg("num_seqs").none() = nb::none(),
           nb::arg("num_actual_tokens").none() = nb::none(),
           nb::arg("max_query_len").none() = nb::none(), nb::arg("max_seq_len").none() = nb::none(),
           nb::arg("causal") = true, nb::arg("query_start_loc_cpu").none() = nb::none(),
           nb::arg("seq_lens_cpu").none() = nb::none(),
           "Scalars left out are computed from the host-visible query_start_loc / seq_lens "
           "(the arrays themselves when on the CPU, else the *_cpu mirrors).")
      .def_prop_rw(
          "num_seqs", [](const PyMetadata& p) { return p.md.num_seqs; },
          [](PyMetadata& p, int v) { p.md.num_seqs = v; })
      .def_prop_rw(
          "num_actual_tokens", [](const PyMetadata& p) { return p.md.num_actual_tokens; },
          [](PyMetadata& p, int v) { p.md.num_actual_tokens = v; })
      .def_prop_rw(
          "max_query_len", [](const PyMetadata& p) { return p.md.max_query_len; },
          [](PyMetadata& p, int v) { p.md.max_query_len = v; })
      .def_prop_rw(
          "max_seq_len", [](const PyMetadata& p) { return p.md.max_seq_len; },
          [](PyMetadata& p, int v) { p.md.max_seq_len = v; })
      .def_prop_rw(
          "causal", [](const PyMetadata& p) { return p.md.causal; },
          [](PyMetadata& p, bool v) { p.md.causal = v; })
      .def_ro("query_start_loc", &PyMetadata::query_start_loc)
      .def_ro("seq_lens", &PyMetadata::seq_lens)
      .def_ro("block_table", &PyMetadata::block_table)
      .def_ro("slot_mapping", &PyMetadata::slot_mapping)
      .def_ro("query_start_loc_cpu", &PyMetadata::query_start_loc_cpu)
      .def_ro("seq_lens_cpu", &PyMetadata::seq_lens_cpu)
      .def_prop_ro("device",
                   [](const PyMetadata& p) { return to_string(p.md.query_start_loc.device); })
      .def("__repr__", [](const PyMetadata& p) { return repr(p.md); });

  m.def(
      "validate_metadata",
      [](const PyMetadata& p, const std::string& attn_type, int64_t num_blocks, int block_size) {
        validate_metadata(p.md, parse_attn_type(attn_type), CacheGeometry{num_blocks, block_size});
      },
      nb::arg("metadata"), nb::arg("attn_type") = "decoder", nb::arg("num_blocks") = 0,
      nb::arg("block_size") = 0,
      "Checks a step's metadata against a cache of num_blocks blocks of block_size tokens; "
      "raises InvalidArgument naming the field, the request and the bound.");
}

}  // namespace pagedattn::py
