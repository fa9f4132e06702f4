// `pagedattn compute CASE.safetensors`: replays one stored attention step (docs/case_format.md)
// on a selected backend, optionally writes the result and checks it against the reference.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "cli.h"
#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"

namespace pagedattn::cli {
namespace {

struct ComputeOptions {
  std::string case_path;
  std::string backend;
  std::string out_path;
  std::string device = "cpu";
  bool check = false;
  bool lse = false;
};

Device parse_compute_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() < 10 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos) {
    return Device::cuda(std::stoi(s.substr(5)));
  }
  throw InvalidArgument("--device '" + s + "' is not cpu, cuda or cuda:N");
}

void run_compute(const ComputeOptions& o) {
  const Case c = load_case(o.case_path);
  const Device device = parse_compute_device(o.device);
  std::printf("case: %s\n", o.case_path.c_str());
  std::printf("  %s\n", describe(c).c_str());
  std::printf("  query %s", describe(c.query.view()).c_str());
  if (c.key.defined()) {
    std::printf(", key %s, value %s", describe(c.key.view()).c_str(),
                describe(c.value.view()).c_str());
  }
  std::printf(", slot_mapping %s\n", describe(c.slot_mapping.view()).c_str());
  const BackendQuery query{c.config, device};
  std::optional<std::string_view> name;
  if (!o.backend.empty()) name = o.backend;
  const Backend& backend = default_registry().select(query, name);
  const std::string backend_name(backend.name());
  std::printf("backend: %s on %s\n", backend_name.c_str(), to_string(device).c_str());

  RunCaseOptions options;
  options.lse = o.lse;
  options.device = device;
  const CaseResult result = run_case(c, backend, options);
  std::printf("output: %s", describe(result.output.view()).c_str());
  if (result.lse.defined()) std::printf(", lse: %s", describe(result.lse.view()).c_str());
  if (result.kv_cache.defined()) {
    std::printf(", kv_cache: %s", describe(result.kv_cache.view()).c_str());
  }
  std::printf("\n");
  if (!o.out_path.empty()) {
    save_case_result(o.out_path, c, result, backend_name);
    std::printf("wrote %s\n", o.out_path.c_str());
  }
  if (o.check) {
    const CaseCheck check = check_case(c, result);
    std::printf("check against ref (float64), budget from ref_lowp:\n%s",
                check.to_string().c_str());
    std::printf("%s\n", check.pass() ? "PASS" : "FAIL");
    if (!check.pass()) set_exit_code(1);
  }
}

}  // namespace

void add_compute_command(CLI::App& app) {
  auto opts = std::make_shared<ComputeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compute",
      "Run one stored attention step (a case file) on a backend; see docs/case_format.md");
  cmd->add_option("case", opts->case_path, "case file (.safetensors)")->required();
  cmd->add_option("--backend", opts->backend,
                  "backend name (default: $PAGEDATTN_BACKEND, else the first that fits)");
  cmd->add_option("--out", opts->out_path, "write output, kv_cache (and lse) to this file");
  cmd->add_option("--device", opts->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_flag("--check", opts->check,
                "compare with the float64 reference; exit code 1 when over the error budget");
  cmd->add_flag("--lse", opts->lse, "also compute the log-sum-exp [num_heads, num_tokens]");
  cmd->callback([opts] { run_compute(*opts); });
}

}  // namespace pagedattn::cli
