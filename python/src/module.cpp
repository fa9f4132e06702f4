// pagedattn._C: the nanobind extension. Argument conversion only; the API lives in the C++
// library (include/pagedattn/) and the pure-Python modules of python/pagedattn/.
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "convert.h"

NB_MODULE(_C, m) {
  namespace py = pagedattn::py;
  m.doc() = "pagedattn C++ bindings (use the pagedattn package, not this module directly)";
  // Layers, impls and caches often live in module-level objects (torch modules, the impl
  // caches) until interpreter exit, after nanobind's leak check would run: no false alarms.
  nanobind::set_leak_warnings(false);
  py::register_exceptions(m);
  py::bind_config(m);
  py::bind_metadata(m);
  py::bind_backend(m);
  py::bind_layer(m);
  py::bind_case(m);
  m.attr("__version__") = PAGEDATTN_PY_VERSION;
  m.attr("with_cuda") = bool(PAGEDATTN_PY_WITH_CUDA);
  m.attr("with_cpu_backend") = bool(PAGEDATTN_PY_WITH_CPU_BACKEND);
}
