// The one accuracy rule every comparison with the float64 reference uses (tests, the CLI's
// --check, the GPU check script). docs/testing.md explains it.
#pragma once

#include <cstdint>
#include <string>

#include "pagedattn/tensor.h"

namespace pagedattn {

/// Differences between a result and the float64 reference, over the compared elements.
struct ErrorStats {
  double max_abs = 0;                ///< max |got - ref| over finite pairs
  double max_ref = 0;                ///< max |ref|, for scale
  double rel_l2 = 0;                 ///< ||got - ref|| / ||ref||
  int64_t count = 0;                 ///< elements compared
  int64_t mismatched_nonfinite = 0;  ///< got non-finite where ref is finite, or vice versa
  std::string to_string() const;
};

/// Compares two host tensors of the same shape (any float dtypes, any strides) element by
/// element. Infinities of the same sign count as equal (an empty row's LSE is -inf).
ErrorStats compare(const TensorView& got, const TensorView& ref);

/// FlashAttention's rule: a backend may be at most `multiple` times as far from the float64
/// reference as the same algorithm run naively in the same low precision, plus `atol`.
struct Tolerance {
  double multiple = 2.0;
  double atol = 0.0;
};
/// The atol for results stored in `dtype`: 1e-5 for float32/float64, 1e-4 for float16 and
/// bfloat16 (a few units of the smallest values attention outputs round to), and for fp8 KV
/// cases the low-precision baseline already carries the cache's quantisation.
Tolerance default_tolerance(DType dtype);

/// The tolerance for an LSE (stored in float32) whose largest finite reference value is
/// `max_ref` in magnitude: multiple 2 and atol = max(1e-5, 8 * 2^-23 * max_ref), eight float32
/// units in the last place of the largest LSE. A float32 LSE is already rounded by half a unit,
/// and the same terms summed in another order move it by a few (at |LSE| ~ 70 one unit is
/// 7.6e-6, so a flat 1e-5 there allowed barely one).
Tolerance lse_tolerance(double max_ref);

/// True when `got` (vs the reference) is within the budget set by `baseline` (the naive
/// low-precision run vs the reference): no non-finite mismatch, and
/// got.max_abs <= tol.multiple * baseline.max_abs + tol.atol.
bool within_budget(const ErrorStats& got, const ErrorStats& baseline, const Tolerance& tol);

}  // namespace pagedattn
