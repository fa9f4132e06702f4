// check_mla_step: an MLA layer's step against the same layer run over the reference backend in
// both precisions. It lives beside the oracle for the reason check_case does: it needs both
// reference precisions, which the registry does not hold.
#include <cstring>

#include "pagedattn/error.h"
#include "pagedattn/mla.h"
#include "pagedattn/mla_check.h"
#include "ref/ref_backend.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {

struct StepRun {
  Tensor output;  // [T, N * V]
  Tensor cache;   // the latent cache after the step
};

// The step on a fresh layer of `backend_name` over a copy of the cache before the step.
StepRun run_step(const MLAStepCase& s, const Registry& registry, std::string_view backend_name,
                 DType output_dtype) {
  MLAOptions o = s.options;
  o.attn_backend = std::string(backend_name);
  o.device = Device::cpu();
  if (o.cache_config) o.cache_config->calculate_kv_scales = false;  // the step's scale is given
  ForwardContext context;
  MLAAttention layer(context, o, registry);
  layer.load_kv_b_proj(s.kv_b_proj);
  StepRun run;
  run.cache = Tensor::copy_of(s.latent_cache, Device::cpu());
  layer.bind_kv_cache(run.cache.view());
  if (is_fp8(layer.config().kv_cache_dtype)) layer.set_k_scale(s.k_scale);
  run.output = Tensor::zeros({s.q.size(0), int64_t(o.num_heads) * o.v_head_dim}, output_dtype,
                             Device::cpu());
  context.begin_step({&s.metadata});
  layer.forward(s.q, s.kv_c_normed, s.k_pe, run.output.view());
  context.end_step();
  return run;
}

}  // namespace

CaseCheck check_mla_step(const MLAStepCase& s, const TensorView& output,
                         const TensorView& latent_cache_after) {
  for (const auto& [v, name] : {std::pair{&s.q, "q"},
                                {&s.kv_c_normed, "kv_c_normed"},
                                {&s.k_pe, "k_pe"},
                                {&s.latent_cache, "latent_cache"},
                                {&s.kv_b_proj, "kv_b_proj"},
                                {&output, "output"},
                                {&latent_cache_after, "latent_cache_after"}}) {
    require(v->defined() && v->device.is_cpu(), "check_mla_step: ", name,
            " must be a host tensor; got ", describe(*v));
  }
  const int64_t num_tokens = s.q.size(0), num_actual = s.metadata.num_actual_tokens;
  const int64_t width = int64_t(s.options.num_heads) * s.options.v_head_dim;
  require(output.ndim == 2 && output.size(0) == num_tokens && output.size(1) == width,
          "check_mla_step: output must be [num_tokens=", num_tokens,
          ", num_heads*v_head_dim=", width, "]; got ", describe(output));

  Registry registry;
  registry.add(ref::make_backend(ref::Precision::kFloat64));
  registry.add(ref::make_backend(ref::Precision::kLowPrecision));
  const StepRun exact = run_step(s, registry, "ref", DType::kF64);
  const StepRun baseline = run_step(s, registry, "ref_lowp", s.options.dtype);

  CaseCheck check;
  auto rows = [num_actual](const TensorView& t) { return t.slice(0, 0, num_actual); };
  TensorCheck& t = check.output;
  t.got = compare(rows(output), rows(exact.output.view()));
  t.baseline = compare(rows(baseline.output.view()), rows(exact.output.view()));
  t.tolerance = default_tolerance(s.options.dtype);
  t.pass = within_budget(t.got, t.baseline, t.tolerance);

  const TensorView& want = exact.cache.view();
  check.kv_cache_elements = want.numel();
  if (latent_cache_after.shape_vector() != want.shape_vector() ||
      latent_cache_after.dtype != want.dtype) {
    check.kv_cache_problem = cat("the latent cache after the step is ",
                                 describe(latent_cache_after), "; expected ", describe(want));
    return check;
  }
  const Tensor dense = Tensor::copy_of(latent_cache_after, Device::cpu());
  const size_t es = dtype_size(want.dtype);
  const auto* a = static_cast<const unsigned char*>(dense.data());
  const auto* b = static_cast<const unsigned char*>(want.data);
  for (int64_t i = 0; i < check.kv_cache_elements; ++i) {
    if (std::memcmp(a + size_t(i) * es, b + size_t(i) * es, es) != 0) ++check.kv_cache_mismatches;
  }
  return check;
}

}  // namespace pagedattn
