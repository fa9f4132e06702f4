// The cuda backend's options by name: the table that Registry::configure, the tools'
// --cuda-option flags and `pagedattn backends` go through, and the two environment variables
// a user sets (PAGEDATTN_CHECKED, PAGEDATTN_CUDA_SPLITS).
#include <climits>
#include <cstdlib>
#include <string>

#include "core/option_table.h"
#include "cuda/attn_common/config.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device_props.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

namespace {

using detail::OptionField;
using Field = OptionField<BackendOptions>;
using mla::Consumer;

constexpr std::string_view kSource = "cuda backend";

const std::vector<Field>& option_table() {
  static const std::vector<Field> table = {
      {{"checked",
        "copy and validate each step's device metadata before launching (slow, no graphs)",
        {{"off", 0}, {"on", 1}}},
       [](const BackendOptions& o) { return int(o.checked); },
       [](BackendOptions& o, int v) { o.checked = v != 0; }},
      {{"splits",
        "KV splits of every step (auto: the planner's choice per step; $PAGEDATTN_CUDA_SPLITS)",
        {{"auto", 0}},
        1,
        attn::kMaxSplits},
       [](const BackendOptions& o) { return o.num_splits; },
       [](BackendOptions& o, int v) { o.num_splits = v; }},
      {{"prefill",
        "rows per kernel: auto (requests of more than 64 packed rows on the prefill kernel), off "
        "(decode kernel only; comparison), all (prefill kernel only; tests)",
        {{"auto", int(PrefillRoute::kAuto)},
         {"off", int(PrefillRoute::kOff)},
         {"all", int(PrefillRoute::kAll)}}},
       [](const BackendOptions& o) { return int(o.prefill); },
       [](BackendOptions& o, int v) { o.prefill = PrefillRoute(v); }},
      {{"prefill_kernel",
        "auto (the Hopper kernel where compiled) or portable (the mma.sync kernel on Hopper too; "
        "tests, comparisons)",
        {{"auto", 0}, {"portable", 1}}},
       [](const BackendOptions& o) { return int(o.portable_prefill); },
       [](BackendOptions& o, int v) { o.portable_prefill = v != 0; }},
      {{"decode_copy",
        "decode K/V row copies: auto (bulk for rows of >= 256 bytes, else cp.async), or one "
        "forced for every shape (tests)",
        {{"auto", int(DecodeCopy::kAuto)},
         {"bulk", int(DecodeCopy::kBulk)},
         {"cp.async", int(DecodeCopy::kCpAsync)}}},
       [](const BackendOptions& o) { return int(o.decode_copy); },
       [](BackendOptions& o, int v) { o.decode_copy = DecodeCopy(v); }},
      {{"mla_consumer",
        "MLA (head size 576) variant: auto (seesaw or split-S by cache and heads, swap AB for "
        "steps of <= 32 rows a request), or one forced (tests, comparisons)",
        {{"auto", int(Consumer::kAuto)},
         {"split-s", int(Consumer::kSplitS)},
         {"seesaw", int(Consumer::kSeesaw)},
         {"swap-ab", int(Consumer::kSwapAB)},
         {"swap-ab-32", int(Consumer::kSwapAB32)}}},
       [](const BackendOptions& o) { return int(o.mla_consumer); },
       [](BackendOptions& o, int v) { o.mla_consumer = Consumer(v); }},
      {{"mla_copy",
        "MLA full tiles of a 16-bit cache: auto (TMA at block sizes that are multiples of 64, "
        "else cp.async) or cp.async (always)",
        {{"auto", int(MlaCopy::kAuto)}, {"cp.async", int(MlaCopy::kCpAsync)}}},
       [](const BackendOptions& o) { return int(o.mla_copy); },
       [](BackendOptions& o, int v) { o.mla_copy = MlaCopy(v); }},
      {{"prefill_copy",
        "Hopper prefill Q/K/V tiles of a 16-bit cache: auto (TMA where the block size and "
        "strides allow, else cp.async) or cp.async (always)",
        {{"auto", 1}, {"cp.async", 0}}},
       [](const BackendOptions& o) { return int(o.prefill_tma); },
       [](BackendOptions& o, int v) { o.prefill_tma = v != 0; }},
      {{"prefill_persistent",
        "Hopper prefill CTAs: auto (as many as are resident, each walking several work tiles) "
        "or at most N (tests: 1 walks every work tile through one CTA)",
        {{"auto", kPrefillPersistent}},
        1,
        INT_MAX},
       [](const BackendOptions& o) { return o.prefill_persistent; },
       [](BackendOptions& o, int v) { o.prefill_persistent = v; }},
      {{"prefill_pair_group",
        "prefill work-tile walk: (request, KV head) pairs per group, auto (sized to the L2) or N "
        "(tests: a smaller last group)",
        {{"auto", 0}},
        1,
        INT_MAX},
       [](const BackendOptions& o) { return o.prefill_pair_group; },
       [](BackendOptions& o, int v) { o.prefill_pair_group = v; }},
      {{"head_scales",
        "fp8 caches: k/v scales that differ between KV heads on the attention kernels: off "
        "(refused, the default until the path has run on a GPU) or on",
        {{"off", 0}, {"on", 1}}},
       [](const BackendOptions& o) { return int(o.head_scales); },
       [](BackendOptions& o, int v) { o.head_scales = v != 0; }},
      {{"v_head",
        "V head sizes narrower than K's (v_head_size) on the attention kernels: off (refused, the "
        "default until the path has run on a GPU) or on",
        {{"off", 0}, {"on", 1}}},
       [](const BackendOptions& o) { return int(o.v_head); },
       [](BackendOptions& o, int v) { o.v_head = v != 0; }},
      {{"kernels",
        "auto (the Hopper kernels on compute capability 9.0 where compiled, the portable ones "
        "elsewhere) or portable (the portable kernels everywhere: what Ampere, Ada and later "
        "GPUs run; tests, comparisons)",
        {{"auto", 0}, {"portable", 1}}},
       [](const BackendOptions& o) { return int(o.portable); },
       [](BackendOptions& o, int v) { o.portable = v != 0; }},
      {{"prefill_walk",
        "persistent Hopper prefill: auto (an atomic counter where the dynamic walk pays, else "
        "the static snake) or static (the snake always; tests)",
        {{"auto", 1}, {"static", 0}}},
       [](const BackendOptions& o) { return int(o.prefill_dynamic); },
       [](BackendOptions& o, int v) { o.prefill_dynamic = v != 0; }},
  };
  return table;
}

}  // namespace

BackendOptions backend_options_from_env() {
  BackendOptions o;
  if (const char* s = std::getenv(kCheckedEnvVar); s && *s) {
    o.checked = std::string_view(s) != "0";
  }
  if (const char* s = std::getenv(kSplitsEnvVar); s && *s) {
    detail::set_option(option_table(), o, "splits", s,
                       std::string(kSplitsEnvVar) + ": " + std::string(kSource));
  }
  return o;
}

BackendOptions apply_settings(const BackendOptions& options,
                              const std::vector<std::string>& settings) {
  return detail::with_settings(option_table(), options, settings, kSource);
}

std::vector<BackendOptionInfo> describe_options(const BackendOptions& options) {
  return detail::describe_options(option_table(), options);
}

bool hopper_route(int device, const BackendOptions& options) {
  const DeviceProps& d = device_props(device);
  return !options.portable && runs_hopper_code(d.cc_major, d.cc_minor, hopper_code_compiled());
}

std::string device_family(int device, const BackendOptions& options) {
  const DeviceProps& d = device_props(device);
  const std::string what = detail::cat("cuda:", device, " (", d.name, ", compute capability ",
                                       d.cc_major, ".", d.cc_minor, "): ");
  if (d.cc_major < kMinCcMajor) {
    return what + "not served (the kernels need compute capability 8.0 or later)";
  }
  if (hopper_route(device, options)) {
    return what +
           "Hopper kernels (sm_90a: wgmma prefill with TMA, decode with bulk copies, the "
           "MLA latent kernel, fp8 products)";
  }
  std::string why = options.portable ? "the option kernels=portable"
                    : d.cc_major == 9 && d.cc_minor == 0
                        ? "this build has no sm_90a code (PAGEDATTN_CUDA_ARCHS without 90a)"
                        : "the Hopper kernels are sm_90a code";
  return what +
         "portable kernels (mma.sync prefill and decode with cp.async; fp8 caches widened "
         "by conversion; no MLA latent kernel) because of " +
         why;
}

}  // namespace pagedattn::cuda
