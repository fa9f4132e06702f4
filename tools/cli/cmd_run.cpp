// `pagedattn run`: the main job. A serving simulation that drives every attention layer of a
// model preset through continuous batching over a paged KV cache, with no model weights, and
// reports speed, cache use and accuracy against the float64 reference (tools/sim).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "cli.h"
#include "pagedattn/config.h"
#include "pagedattn/connector.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"
#include "pagedattn/registry.h"
#include "sim/presets.h"
#include "sim/report.h"
#include "sim/simulation.h"

namespace pagedattn::cli {
namespace {

struct RunOptions {
  sim::SimOptions sim;
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  std::string kv_cache_layout = "NHD";
  std::string kv_cache_memory = "auto";
  std::string mla_formulation = "split";
  std::string device = "cpu";
  std::string role = "both";
  int64_t max_model_len = 0;
  int threads = 0;
  bool no_prefix_caching = false;
  bool no_bandwidth = false;
  bool json = false;
  bool quiet = false;
};

DType parse_activation_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "float16" || s == "half") return DType::kF16;
  if (s == "fp32" || s == "float32" || s == "float") return DType::kF32;
  detail::fail("--dtype '", s, "' is not bfloat16, float16 or float32");
}

Device parse_run_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() < 10 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos) {
    return Device::cuda(std::stoi(s.substr(5)));
  }
  detail::fail("--device '", s, "' is not cpu, cuda or cuda:N");
}

// One line on stderr, redrawn in place.
void draw_progress(const sim::Progress& p) {
  const int width = 30;
  const int done = p.total > 0 ? p.finished * width / p.total : width;
  std::string bar(size_t(done), '=');
  bar.resize(size_t(width), ' ');
  std::fprintf(stderr, "\r[%s] step %lld, %d/%d requests finished, %d running, %d waiting ",
               bar.c_str(), static_cast<long long>(p.step), p.finished, p.total, p.running,
               p.waiting);
  std::fflush(stderr);
}

void run(RunOptions& o) {
  sim::SimOptions& s = o.sim;
  s.dtype = parse_activation_dtype(o.dtype);
  s.device = parse_run_device(o.device);
  s.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  s.kv_cache_layout = parse_kv_cache_layout(o.kv_cache_layout);
  s.mla_formulation = parse_mla_formulation(o.mla_formulation);
  if (o.kv_cache_memory != "auto") {
    s.kv_cache_memory = sim::parse_byte_size(o.kv_cache_memory, "--kv-cache-memory");
  }
  if (o.max_model_len != 0) s.max_model_len = o.max_model_len;
  s.enable_prefix_caching = !o.no_prefix_caching;
  s.measure_bandwidth = !o.no_bandwidth;
  s.role = parse_kv_transfer_role(o.role);
  if (o.threads > 0) {
    detail::require(default_registry().find("cpu") != nullptr,
                    "--threads sets the cpu backend's threads; this build has no cpu backend");
    default_registry().configure("cpu", {"threads=" + std::to_string(o.threads)});
  }
  s.log = &std::cerr;
  const bool progress = !o.quiet && isatty(fileno(stderr));
  if (progress) s.on_progress = draw_progress;
  const sim::SimReport report = sim::run_simulation(s);
  if (progress) std::fprintf(stderr, "\n");
  if (o.json) {
    std::fputs(sim::report_json(report).c_str(), stdout);
  } else {
    std::fputs(sim::format_report(report).c_str(), stdout);
  }
  if (!report.passed() || sim::connector_shortfall(report).failed) set_exit_code(1);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  sim::SimOptions& s = o->sim;
  sim::WorkloadOptions& w = s.workload;
  CLI::App* cmd = app.add_subcommand(
      "run",
      "The main job: a seeded serving simulation (continuous batching, chunked prefill, prefix "
      "caching, preemption, sliding windows) through every attention layer of a model preset, "
      "checked against the float64 reference");
  cmd->add_option("--preset", s.preset,
                  "model shape: " + sim::preset_names() +
                      " (deepseek-v3: MLAAttention layers, scaled down for a CPU run)")
      ->capture_default_str();
  cmd->add_option("--backend", s.backend,
                  "force a backend (default: $PAGEDATTN_BACKEND, else the registry's choice)");
  cmd->add_option("--device", o->device,
                  "cpu | cuda | cuda:N: where caches, activations and metadata live")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads,
                  "cpu backend threads (default: $PAGEDATTN_CPU_THREADS, else OMP_NUM_THREADS, "
                  "else the CPUs this process may use)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--dtype", o->dtype, "activations: bfloat16 | float16 | float32")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype,
                  "auto | bfloat16 | float16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2 (fp8: k/v "
                  "scales calibrated on the first batch)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-layout", o->kv_cache_layout, "NHD | HND")->capture_default_str();
  cmd->add_option("--block-size", s.block_size, "tokens per cache block")->capture_default_str();
  cmd->add_option("--mla-formulation", o->mla_formulation,
                  "MLA presets: split (vLLM's: decodes absorbed, prefills with K/V expanded per "
                  "head) | absorbed | prefill (either one for every request)")
      ->capture_default_str();
  cmd->add_option("--mla-context-chunk-tokens", s.mla_context_chunk_tokens,
                  "MLA presets: cached latent entries a prefill expands at once (the workspace "
                  "cap; longer contexts run in chunks merged by LSE)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-memory", o->kv_cache_memory,
                  "KV-cache budget, e.g. 512MiB; auto = half of what the workload would pin "
                  "at once (at least one request of max_model_len)")
      ->capture_default_str();
  cmd->add_option("--max-model-len", o->max_model_len,
                  "longest request (default: min(the model's, 1024))");
  cmd->add_option("--max-num-batched-tokens", s.max_num_batched_tokens, "new tokens per step")
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", s.max_num_seqs, "running requests at once")
      ->capture_default_str();
  cmd->add_flag("--no-prefix-caching", o->no_prefix_caching, "disable prefix caching");
  cmd->add_option("--seed", w.seed, "workload seed")->capture_default_str();
  cmd->add_option("--num-requests", w.num_requests, "requests in the workload")
      ->capture_default_str();
  cmd->add_option("--prompt-len", w.prompt_len_median, "median prompt length (log-normal)")
      ->capture_default_str();
  cmd->add_option("--output-len", w.output_len_median, "median generated length (log-normal)")
      ->capture_default_str();
  cmd->add_option("--shared-prefix-fraction", w.shared_prefix_fraction,
                  "fraction of requests starting with a shared system prompt")
      ->capture_default_str();
  cmd->add_option("--num-shared-prefixes", w.num_shared_prefixes, "distinct system prompts")
      ->capture_default_str();
  cmd->add_option("--arrival-rate", w.arrival_rate, "mean arrivals per step (0 = all at once)")
      ->capture_default_str();
  cmd->add_option("--verify-every", s.verify_every,
                  "check every Nth step against the float64 reference (0 = never)")
      ->capture_default_str();
  cmd->add_option("--verify-layers", s.verify_layers,
                  "layers checked per KV-cache group in a verified step")
      ->capture_default_str();
  cmd->add_option("--verify-max-work", s.verify_max_work,
                  "largest step checked: (query, key) pairs * heads * head size over the "
                  "checked layers; larger due steps defer the check to the next step")
      ->capture_default_str();
  cmd->add_option("--failure-dir", s.failure_dir, "where failing steps are saved as case files")
      ->capture_default_str();
  cmd->add_option("--connector", s.kv_connector,
                  "KV connector: storage:/dir or redis://[:password@]host:port[/db] (options "
                  "after '?', docs/connector.md); prompts' KV blocks are saved to and loaded "
                  "from it");
  cmd->add_option("--role", o->role,
                  "with --connector: prefill (compute prompts and their first token, save their "
                  "KV), decode (load what the store holds, generate) or both")
      ->capture_default_str();
  cmd->add_option("--digest", s.digest_file,
                  "write a digest of every token-producing output row of every layer to this "
                  "file (compare runs with cmp; use --backend ref, whose rows do not depend on "
                  "the batch)");
  cmd->add_flag("--no-bandwidth", o->no_bandwidth, "skip measuring the machine's read bandwidth");
  cmd->add_flag("--json", o->json, "print the report as JSON on stdout");
  cmd->add_flag("--quiet,-q", o->quiet, "no progress bar");
  cmd->callback([o] { run(*o); });
}

}  // namespace pagedattn::cli
