// The fast CPU backend: SIMD (run-time dispatched) + OpenMP threads. The embedded default on
// machines without a GPU.
#pragma once

#include <memory>

#include "pagedattn/backend.h"

namespace pagedattn::cpu {

std::unique_ptr<Backend> make_backend();

}  // namespace pagedattn::cpu
