// One function per binding file; module.cpp calls them in order.
#pragma once

#include <nanobind/nanobind.h>

namespace pagedattn::py {

void bind_config(nanobind::module_& m);    // bind_config.cpp
void bind_metadata(nanobind::module_& m);  // bind_metadata.cpp
void bind_backend(nanobind::module_& m);   // bind_backend.cpp
void bind_layer(nanobind::module_& m);     // bind_layer.cpp
void bind_case(nanobind::module_& m);      // bind_case.cpp

}  // namespace pagedattn::py
