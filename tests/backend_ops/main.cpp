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

// One run of the matrix: a backend, and for the cpu backend optionally one forced SIMD target.
struct Run {
  std::string label;
  const Backend* backend;
  std::string cpu_target;  // empty: the backend's own choice
  Tally tally;
};

void force_cpu_target(const std::string& target) {
#if PAGEDATTN_WITH_CPU_BACKEND
  if (!cpu::force_target(target)) {
    throw InvalidArgument("--cpu-target '" + target + "' is not available on this CPU");
  }
#else
  if (!target.empty()) throw InvalidArgument("--cpu-target: this build has no cpu backend");
#endif
}

// Runs every case on every run, cases outermost, so that each case's references are computed
// once and shared by all runs (the float64 reference costs more than any backend under test).
void run_matrix(std::vector<Run>& runs, const std::vector<OpCase>& cases, const Options& o) {
  const RunOptions ro{parse_device(o.device), 0};
  for (const auto& k : cases) {
    std::optional<CaseOracle> oracle;
    for (Run& run : runs) {
      if (!run.cpu_target.empty()) force_cpu_target(run.cpu_target);
      CaseResult r;
      try {
        r = run_case(*run.backend, k, oracle, ro);
      } catch (const std::exception& e) {
        r.passed = false;
        r.message = std::string("threw: ") + e.what();
      }
      if (!run.cpu_target.empty()) force_cpu_target("");
      if (!r.supported) {
        ++run.tally.unsupported;
      } else if (r.passed) {
        ++run.tally.passed;
        if (o.verbose) {
          std::printf("  ok    %-14s %-60s out %.2e (budget %.2e) lse %.2e\n", run.label.c_str(),
                      k.name.c_str(), r.output_error.max_abs, r.output_budget.max_abs,
                      r.lse_error.max_abs);
        }
      } else {
        ++run.tally.failed;
        std::printf("  FAIL  %-14s %s\n        %s\n", run.label.c_str(), k.name.c_str(),
                    r.message.c_str());
      }
    }
  }
}

// The runs `test` makes: every backend under test, the cpu backend once per SIMD target when
// --cpu-target names one or `all`.
std::vector<Run> test_runs(const Options& o, const Backend* fallback) {
  std::vector<Run> runs;
  for (const Backend* b : backends_under_test(o)) {
    const std::string name(b->name());
    std::vector<std::string> targets;
#if PAGEDATTN_WITH_CPU_BACKEND
    if (name == "cpu" && !o.cpu_target.empty()) {
      targets =
          o.cpu_target == "all" ? cpu::available_targets() : std::vector<std::string>{o.cpu_target};
    }
#else
    if (!o.cpu_target.empty()) throw InvalidArgument("--cpu-target: this build has no cpu backend");
#endif
    if (targets.empty()) {
      runs.push_back({name, b, "", {}});
    } else {
      for (const auto& t : targets) {
        force_cpu_target(t);  // refuses a target this CPU lacks before anything runs
        runs.push_back({name + ":" + t, b, t, {}});
      }
      force_cpu_target("");
    }
  }
  if (runs.empty()) {
    std::printf("no backend besides ref is registered; exercising the harness with ref_lowp\n");
    runs.push_back({"ref_lowp", fallback, "", {}});
  }
  return runs;
}

int cmd_test(const Options& o) {
  const auto cases = selected_cases(o);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  std::vector<Run> runs = test_runs(o, lowp.get());
  for (const Run& run : runs) {
    std::printf("backend %s: %zu cases\n", run.label.c_str(), cases.size());
    const std::string_view name = run.backend->name();
    for (const std::string& s : name == "cuda"  ? o.cuda_options
                                : name == "cpu" ? o.cpu_options
                                                : std::vector<std::string>{}) {
      std::printf("  option %s\n", s.c_str());
    }
  }
  run_matrix(runs, cases, o);
  int failures = 0;
  for (const Run& run : runs) {
    const Tally& t = run.tally;
    std::printf("backend %s: %d passed, %d failed, %d unsupported\n", run.label.c_str(), t.passed,
                t.failed, t.unsupported);
    failures += t.failed;
    // A backend for another device (cuda when testing on the cpu) serves no case here: that
    // is fine unless it was asked for by name.
    const bool named = !o.backends.empty();
    if (t.passed == 0 && (named || t.unsupported < int(cases.size()))) {
      std::printf("backend %s passed no case at all\n", run.label.c_str());
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

// Each broken backend runs until a case catches it (the first catch is all the claim needs);
// the naive low-precision reference runs every case and must pass them all.
int cmd_selftest(const Options& o) {
  const auto cases = selected_cases(o);
  struct Suspect {
    std::unique_ptr<Backend> backend;
    std::string caught_by;  // the first case that failed it
  };
  std::vector<Suspect> suspects;
  for (Bug bug : all_bugs()) suspects.push_back({make_broken_backend(bug), ""});
  Tally lowp_tally;
  const RunOptions ro{parse_device(o.device), 0};
  for (const auto& k : cases) {
    std::optional<CaseOracle> oracle;
    for (Suspect& s : suspects) {
      if (!s.caught_by.empty()) continue;
      CaseResult r;
      try {
        r = run_case(*s.backend, k, oracle, ro);
      } catch (const std::exception&) {
        r.passed = false;  // a throw is a failure the harness reports too
      }
      if (r.supported && !r.passed) s.caught_by = k.name;
    }
    // The naive low-precision run is the oracle's own: checked as any backend's output is.
    if (!oracle) oracle = make_oracle(k);
    const CaseResult r = check_run(k, *oracle, oracle->naive);
    if (!r.supported) {
      ++lowp_tally.unsupported;
    } else if (r.passed) {
      ++lowp_tally.passed;
    } else {
      ++lowp_tally.failed;
      std::printf("  FAIL  ref_lowp %s\n        %s\n", k.name.c_str(), r.message.c_str());
    }
  }
  int problems = 0;
  // Reading element 0 of per-head scales must fail every case whose values differ, not one:
  // a backend may read them right on one path (decode) and wrong on another.
  const auto head_zero = make_broken_backend(Bug::kHeadZeroScales);
  for (const auto& k : cases) {
    if (k.k_scales.empty() && k.v_scales.empty() && k.q_scales.empty()) continue;
    CaseResult r;
    try {
      r = run_case(*head_zero, k, ro);
    } catch (const std::exception&) {
      r.passed = false;
    }
    if (r.supported && r.passed) {
      std::printf("%-28s PROBLEM: passes %s\n", std::string(head_zero->name()).c_str(),
                  k.name.c_str());
      ++problems;
    }
  }
  for (const Suspect& s : suspects) {
    const std::string name(s.backend->name());
    if (s.caught_by.empty()) {
      std::printf("%-28s PROBLEM: no case catches it\n", name.c_str());
      ++problems;
    } else {
      std::printf("%-28s caught by %s\n", name.c_str(), s.caught_by.c_str());
    }
  }
  std::printf("%-28s passes %d of %zu cases\n", "ref_lowp (must pass all)", lowp_tally.passed,
              cases.size());
  if (lowp_tally.failed) ++problems;
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
