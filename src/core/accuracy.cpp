#include "pagedattn/accuracy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>

#include "pagedattn/error.h"

namespace pagedattn {

std::string ErrorStats::to_string() const {
  std::ostringstream os;
  os << "max_abs " << max_abs << ", rel_l2 " << rel_l2 << ", max|ref| " << max_ref << " over "
     << count << " elements";
  if (mismatched_nonfinite) os << ", " << mismatched_nonfinite << " non-finite mismatches";
  return os.str();
}

ErrorStats compare(const TensorView& got, const TensorView& ref) {
  detail::require(got.device.is_cpu() && ref.device.is_cpu(),
                  "compare: tensors must be on the CPU");
  detail::require(got.shape_vector() == ref.shape_vector(),
                  "compare: shapes differ: ", describe(got), " vs ", describe(ref));
  ErrorStats s;
  double diff2 = 0, ref2 = 0;
  std::array<int64_t, kMaxDims> idx{};
  const int nd = got.ndim;
  for (int64_t k = 0, n = got.numel(); k < n; ++k) {
    int64_t og = 0, orf = 0;
    for (int d = 0; d < nd; ++d) {
      og += idx[size_t(d)] * got.stride(d);
      orf += idx[size_t(d)] * ref.stride(d);
    }
    const double g = load_element(got.data, got.dtype, og);
    const double r = load_element(ref.data, ref.dtype, orf);
    ++s.count;
    if (std::isfinite(g) && std::isfinite(r)) {
      const double e = std::fabs(g - r);
      s.max_abs = std::max(s.max_abs, e);
      s.max_ref = std::max(s.max_ref, std::fabs(r));
      diff2 += e * e;
      ref2 += r * r;
    } else if (!(std::isinf(g) && g == r)) {
      ++s.mismatched_nonfinite;
    }
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < got.size(d)) break;
      idx[size_t(d)] = 0;
    }
  }
  s.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return s;
}

Tolerance default_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      return {2.0, 1e-4};
    default:
      return {2.0, 1e-5};
  }
}

Tolerance lse_tolerance(double max_ref) {
  constexpr double kUlpsAllowed = 8.0, kF32Epsilon = 1.0 / double(1 << 23);
  Tolerance t = default_tolerance(DType::kF32);
  t.atol = std::max(t.atol, kUlpsAllowed * kF32Epsilon * max_ref);
  return t;
}

bool within_budget(const ErrorStats& got, const ErrorStats& baseline, const Tolerance& tol) {
  return got.mismatched_nonfinite == 0 && baseline.mismatched_nonfinite == 0 &&
         got.max_abs <= tol.multiple * baseline.max_abs + tol.atol;
}

}  // namespace pagedattn
