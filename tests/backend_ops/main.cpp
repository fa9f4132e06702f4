// backend_ops: every backend against the float64 reference over one case matrix.
//   backend_ops test     [--backend NAME]... [--filter TEXT] [--device cpu|cuda]
//                        [--cuda-option NAME=VALUE]... [--cpu-option NAME=VALUE]...
//   backend_ops support  which cases each backend covers, and why not
//   backend_ops perf     forward time per case (median of --repeats)
//   backend_ops selftest the deliberately wrong backends must each fail some case, and the
//                        naive low-precision reference must pass every case
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>

#include "broken_backends.h"
#include "harness.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"
#include "ref/ref_backend.h"
#if PAGEDATTN_WITH_CPU_BACKEND
#include "cpu/cpu_kernels.h"
#endif

namespace pagedattn::backend_ops {
namespace {

struct Options {
  std::vector<std::string> backends;
  std::string filter;
  std::string device = "cpu";
  uint32_t seed = 20261202;
  std::string cpu_target;  // force one SIMD target of the cpu backend ("all": each in turn)
  // Options of the registered backends ("name=value", Registry::configure), e.g. prefill=all.
  std::vector<std::string> cuda_options, cpu_options;
  int repeats = 5;
  bool verbose = false;
};

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s == "cuda:0") return Device::cuda(0);
  throw InvalidArgument("--device '" + s + "' is not cpu or cuda");
}

std::vector<OpCase> selected_cases(const Options& o) {
  std::vector<OpCase> out;
  for (auto& k : make_case_matrix(o.seed))
    if (o.filter.empty() || k.name.find(o.filter) != std::string::npos) out.push_back(k);
  return out;
}

// Applies --cuda-option / --cpu-option to the registered backends (again on a second call: the
// settings are values, not increments).
void configure_backends(const Options& o) {
  if (!o.cuda_options.empty()) default_registry().configure("cuda", o.cuda_options);
  if (!o.cpu_options.empty()) default_registry().configure("cpu", o.cpu_options);
}

// The registered backends under test: all but the oracle itself, unless named.
std::vector<const Backend*> backends_under_test(const Options& o) {
  configure_backends(o);
  std::vector<const Backend*> out;
  for (const Backend* b : default_registry().backends()) {
    const bool named =
        std::find(o.backends.begin(), o.backends.end(), b->name()) != o.backends.end();
    if (o.backends.empty() ? b->name() != "ref" : named) out.push_back(b);
  }
  return out;
}

struct Tally {
  int passed = 0, failed = 0, unsupported = 0;
};

Tally run_all(const Backend& b, const std::vector<OpCase>& cases, const Options& o,
              bool print_failures) {
  Tally t;
  RunOptions ro{parse_device(o.device), 0};
  for (const auto& k : cases) {
    CaseResult r;
    try {
      r = run_case(b, k, ro);
    } catch (const std::exception& e) {
      r.passed = false;
      r.message = std::string("threw: ") + e.what();
    }
    if (!r.supported) {
      ++t.unsupported;
    } else if (r.passed) {
      ++t.passed;
      if (o.verbose) {
        std::printf("  ok    %-60s out %.2e (budget %.2e) lse %.2e\n", k.name.c_str(),
                    r.output_error.max_abs, r.output_budget.max_abs, r.lse_error.max_abs);
      }
    } else {
      ++t.failed;
      if (print_failures)
        std::printf("  FAIL  %s\n        %s\n", k.name.c_str(), r.message.c_str());
    }
  }
  return t;
}

int cmd_test(const Options& o);

// Runs the test once per requested SIMD target of the cpu backend.
int cmd_test_targets(const Options& o) {
#if PAGEDATTN_WITH_CPU_BACKEND
  std::vector<std::string> targets = {o.cpu_target};
  if (o.cpu_target == "all") targets = cpu::available_targets();
  int rc = 0;
  for (const auto& t : targets) {
    if (!cpu::force_target(t)) {
      throw InvalidArgument("--cpu-target '" + t + "' is not available on this CPU");
    }
    std::printf("== cpu SIMD target %s\n", cpu::current_target().c_str());
    Options one = o;
    one.cpu_target.clear();
    rc |= cmd_test(one);
  }
  cpu::force_target("");
  return rc;
#else
  (void)o;
  throw InvalidArgument("--cpu-target: this build has no cpu backend");
#endif
}

int cmd_test(const Options& o) {
  if (!o.cpu_target.empty()) return cmd_test_targets(o);
  const auto cases = selected_cases(o);
  auto under_test = backends_under_test(o);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  if (under_test.empty()) {
    std::printf("no backend besides ref is registered; exercising the harness with ref_lowp\n");
    under_test.push_back(lowp.get());
  }
  int failures = 0;
  for (const Backend* b : under_test) {
    std::printf("backend %s: %zu cases\n", std::string(b->name()).c_str(), cases.size());
    const std::vector<std::string>& set = b->name() == "cuda"  ? o.cuda_options
                                          : b->name() == "cpu" ? o.cpu_options
                                                               : std::vector<std::string>{};
    for (const std::string& s : set) std::printf("  option %s\n", s.c_str());
    const Tally t = run_all(*b, cases, o, true);
    std::printf("backend %s: %d passed, %d failed, %d unsupported\n",
                std::string(b->name()).c_str(), t.passed, t.failed, t.unsupported);
    failures += t.failed;
    // A backend for another device (cuda when testing on the cpu) serves no case here: that
    // is fine unless it was asked for by name.
    const bool named = !o.backends.empty();
    if (t.passed == 0 && (named || t.unsupported < int(cases.size()))) {
      std::printf("backend %s passed no case at all\n", std::string(b->name()).c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}

int cmd_support(const Options& o) {
  configure_backends(o);
  const auto cases = selected_cases(o);
  for (const Backend* b : default_registry().backends()) {
    std::map<std::string, int> reasons;
    int supported = 0;
    for (const auto& k : cases) {
      const auto r = b->check(BackendQuery{k.config, parse_device(o.device)});
      if (r.empty()) {
        ++supported;
      } else {
        for (const auto& why : r) ++reasons[why];
      }
    }
    std::printf("%-10s supports %d of %zu cases\n", std::string(b->name()).c_str(), supported,
                cases.size());
    for (const auto& [why, n] : reasons) std::printf("    %4d x %s\n", n, why.c_str());
  }
  return 0;
}

int cmd_perf(const Options& o) {
  const auto cases = selected_cases(o);
  for (const Backend* b : backends_under_test(o)) {
    for (const auto& k : cases) {
      const CaseResult r = run_case(*b, k, {parse_device(o.device), o.repeats});
      if (!r.supported) continue;
      std::printf("%-8s %10.3f ms  %s%s\n", std::string(b->name()).c_str(), r.seconds * 1e3,
                  k.name.c_str(), r.passed ? "" : "  (FAILED)");
    }
  }
  return 0;
}

int cmd_selftest(const Options& o) {
  const auto cases = selected_cases(o);
  int problems = 0;
  for (Bug bug : all_bugs()) {
    const auto b = make_broken_backend(bug);
    const Tally t = run_all(*b, cases, o, false);
    std::printf("%-28s caught by %3d of %zu cases\n", std::string(b->name()).c_str(), t.failed,
                cases.size());
    if (t.failed == 0) {
      std::printf("  PROBLEM: no case catches %s\n", std::string(b->name()).c_str());
      ++problems;
    }
  }
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  const Tally t = run_all(*lowp, cases, o, true);
  std::printf("%-28s passes %d of %zu cases\n", "ref_lowp (must pass all)", t.passed, cases.size());
  if (t.failed) ++problems;
  return problems == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pagedattn::backend_ops

int main(int argc, char** argv) {
  using namespace pagedattn::backend_ops;
  CLI::App app{"backend_ops: every backend against the float64 reference"};
  app.require_subcommand(1);
  Options o;
  int rc = 0;
  auto add_common = [&o](CLI::App* c) {
    c->add_option("--backend", o.backends, "backend(s) to run (default: all but ref)");
    c->add_option("--filter", o.filter, "only cases whose name contains this text");
    c->add_option("--device", o.device, "cpu | cuda");
    c->add_option("--seed", o.seed, "base seed of the random inputs");
    c->add_flag("-v,--verbose", o.verbose, "print every case");
    c->add_option("--cuda-option", o.cuda_options,
                  "cuda backend option NAME=VALUE (repeatable; `pagedattn backends` lists them)")
        ->allow_extra_args(false);
    c->add_option("--cpu-option", o.cpu_options, "cpu backend option NAME=VALUE (repeatable)")
        ->allow_extra_args(false);
  };
  auto* test = app.add_subcommand("test", "compare every backend with ref")->callback([&] {
    rc = cmd_test(o);
  });
  add_common(test);
  test->add_option("--cpu-target", o.cpu_target,
                   "cpu backend: force a SIMD target (AVX3, AVX2, SSE4, SSSE3, SCALAR) or 'all'");
  add_common(app.add_subcommand("support", "which cases each backend supports")->callback([&] {
    rc = cmd_support(o);
  }));
  auto* perf = app.add_subcommand("perf", "time each case")->callback([&] { rc = cmd_perf(o); });
  add_common(perf);
  perf->add_option("--repeats", o.repeats, "timed repeats per case");
  add_common(app.add_subcommand("selftest", "the harness catches deliberately wrong backends")
                 ->callback([&] { rc = cmd_selftest(o); }));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "backend_ops: error: %s\n", e.what());
    return 2;
  }
  return rc;
}
