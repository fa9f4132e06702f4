// check_case: a case result against the oracle. It lives beside the oracle because it is the
// one caller outside the registry that needs both reference precisions (src/core knows
// backends only through the Backend interface).
#include <cstdio>
#include <cstring>

#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "ref/ref_backend.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {

TensorCheck check_tensor(const TensorView& got, const TensorView& exact, const TensorView& baseline,
                         const Tolerance& tolerance) {
  TensorCheck t;
  t.got = compare(got, exact);
  t.baseline = compare(baseline, exact);
  t.tolerance = tolerance;
  t.pass = within_budget(t.got, t.baseline, tolerance);
  return t;
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

std::string tensor_line(const char* name, const TensorCheck& t) {
  std::string s = cat(name, ": max_abs ", sci(t.got.max_abs), " vs budget ", sci(t.budget()), " (",
                      t.tolerance.multiple, " x ref_lowp's ", sci(t.baseline.max_abs), " + ",
                      sci(t.tolerance.atol), "), rel_l2 ", sci(t.got.rel_l2), ", max|ref| ",
                      sci(t.got.max_ref), ", ", t.got.count, " elements");
  if (t.got.mismatched_nonfinite) {
    s += cat(", ", t.got.mismatched_nonfinite, " non-finite where the reference is finite (or ",
             "the reverse)");
  }
  if (t.baseline.mismatched_nonfinite) {
    s += cat(", ref_lowp has ", t.baseline.mismatched_nonfinite, " non-finite mismatches");
  }
  return s + (t.pass ? ": PASS" : ": FAIL");
}

}  // namespace

bool CaseCheck::pass() const {
  return output.pass && (!lse || lse->pass) && kv_cache_problem.empty() && kv_cache_mismatches == 0;
}

std::string CaseCheck::to_string() const {
  std::string s = tensor_line("output", output) + "\n";
  if (lse) s += tensor_line("lse", *lse) + "\n";
  if (!kv_cache_problem.empty()) {
    s += cat("kv_cache: ", kv_cache_problem, ": FAIL\n");
  } else if (kv_cache_elements > 0 || kv_cache_mismatches > 0) {
    if (kv_cache_mismatches == 0) {
      s += cat("kv_cache: ", kv_cache_elements, " elements identical to ref's write: PASS\n");
    } else {
      s += cat("kv_cache: ", kv_cache_mismatches, " of ", kv_cache_elements,
               " elements differ from ref's write: FAIL\n");
    }
  }
  return s;
}

CaseCheck check_case(const Case& c, const CaseResult& result) {
  const AttentionConfig& cfg = c.config;
  const int64_t num_tokens = c.num_tokens(), num_actual = c.num_actual_tokens();
  const int64_t width = int64_t(cfg.num_heads) * cfg.head_size;
  const TensorView& out = result.output.view();
  require(result.output.defined() && out.ndim == 2 && out.size(0) == num_tokens &&
              out.size(1) == width && out.device.is_cpu(),
          "check_case: result.output must be a host tensor [num_tokens=", num_tokens,
          ", num_heads*head_size=", width, "]; got ", describe(out));
  const bool with_lse = result.lse.defined();
  if (with_lse) {
    const TensorView& l = result.lse.view();
    require(
        l.ndim == 2 && l.size(0) == cfg.num_heads && l.size(1) == num_tokens && l.device.is_cpu(),
        "check_case: result.lse must be a host tensor [num_heads=", cfg.num_heads,
        ", num_tokens=", num_tokens, "]; got ", describe(l));
  }

  const auto oracle = ref::make_backend(ref::Precision::kFloat64);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  RunCaseOptions exact_options;
  exact_options.lse = with_lse;
  exact_options.output_dtype = DType::kF64;
  exact_options.lse_dtype = DType::kF64;
  const CaseResult exact = run_case(c, *oracle, exact_options);
  RunCaseOptions lowp_options;  // the output in the query dtype, as a fast kernel stores it
  lowp_options.lse = with_lse;
  const CaseResult baseline = run_case(c, *lowp, lowp_options);

  CaseCheck check;
  auto rows = [num_actual](const Tensor& t) { return t.view().slice(0, 0, num_actual); };
  check.output = check_tensor(rows(result.output), rows(exact.output), rows(baseline.output),
                              default_tolerance(cfg.dtype));
  if (with_lse) {
    auto cols = [num_actual](const Tensor& t) { return t.view().slice(1, 0, num_actual); };
    check.lse = check_tensor(cols(result.lse), cols(exact.lse), cols(baseline.lse),
                             lse_tolerance(compare(cols(exact.lse), cols(exact.lse)).max_ref));
  }

  if (exact.kv_cache.defined()) {
    const TensorView& want = exact.kv_cache.view();
    const TensorView& got = result.kv_cache.view();
    check.kv_cache_elements = want.numel();
    if (!result.kv_cache.defined()) {
      check.kv_cache_problem = "the result has no kv_cache";
    } else if (got.shape_vector() != want.shape_vector() || got.dtype != want.dtype ||
               !got.device.is_cpu()) {
      check.kv_cache_problem =
          cat("the result's kv_cache is ", describe(got), "; expected ", describe(want));
    } else {
      const Tensor dense = got.is_contiguous() ? result.kv_cache : Tensor::copy_of(got, {});
      const size_t es = dtype_size(want.dtype);
      const auto* a = static_cast<const unsigned char*>(dense.data());
      const auto* b = static_cast<const unsigned char*>(want.data);
      for (int64_t i = 0; i < check.kv_cache_elements; ++i) {
        if (std::memcmp(a + size_t(i) * es, b + size_t(i) * es, es) != 0) {
          ++check.kv_cache_mismatches;
        }
      }
    }
  }
  return check;
}

}  // namespace pagedattn
