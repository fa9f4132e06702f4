// The float64 reference backend: the oracle every other backend is checked against.
#pragma once

#include <memory>

#include "pagedattn/backend.h"

namespace pagedattn::ref {

/// kFloat64 is the oracle. kLowPrecision runs the same naive algorithm the way a fast kernel
/// does (float32 scores and sums, probabilities rounded to the activation dtype before P*V):
/// its distance from the oracle sets the error budget of the fast backends (tests/README.md).
enum class Precision { kFloat64, kLowPrecision };

std::unique_ptr<Backend> make_backend(Precision precision = Precision::kFloat64);

}  // namespace pagedattn::ref
