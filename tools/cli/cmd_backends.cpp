// `pagedattn backends [config flags]`: every registered backend, why it does or does not
// support a configuration, and its options with their values.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "cli.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"

namespace pagedattn::cli {
namespace {

int g_exit_code = 0;

struct BackendsOptions {
  int num_heads = 32;
  int num_kv_heads = 8;
  int head_size = 128;
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  std::string layout = "NHD";
  int block_size = 16;
  std::string attn_type = "decoder";
  std::optional<int> sliding_window;
  std::optional<float> soft_cap;
  bool alibi = false;
  bool sinks = false;
  std::string device = "cpu";
};

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) return Device::cuda(std::stoi(s.substr(5)));
  throw InvalidArgument("--device '" + s + "' is not cpu, cuda or cuda:N");
}

// Each backend's options: name=value, what it allows, what it does (Registry::configure and
// the tools' --cuda-option / --cpu-option flags set them).
void print_options(const Registry& registry) {
  for (const Backend* b : registry.backends()) {
    const std::vector<BackendOptionInfo> options = b->options();
    if (options.empty()) continue;
    std::printf("%s options:\n", std::string(b->name()).c_str());
    size_t width = 0;
    for (const BackendOptionInfo& i : options) {
      width = std::max(width, i.name.size() + 1 + i.value.size());
    }
    for (const BackendOptionInfo& i : options) {
      std::string allowed;
      for (const std::string& a : i.allowed) allowed += (allowed.empty() ? "" : " | ") + a;
      std::printf("  %-*s  %s\n  %-*s  %s\n", int(width), (i.name + "=" + i.value).c_str(),
                  allowed.c_str(), int(width), "", i.help.c_str());
    }
  }
}

void run_backends(const BackendsOptions& o) {
  AttentionConfig c;
  c.num_heads = o.num_heads;
  c.num_kv_heads = o.num_kv_heads;
  c.head_size = o.head_size;
  c.scale = 1.0f / std::sqrt(float(o.head_size > 0 ? o.head_size : 1));
  const auto dtype = dtype_from_name(o.dtype);
  if (!dtype)
    throw InvalidArgument("--dtype '" + o.dtype + "' is not float32, float16 or bfloat16");
  c.dtype = *dtype;
  c.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  c.kv_cache_layout = parse_kv_cache_layout(o.layout);
  c.block_size = o.block_size;
  c.attn_type = parse_attn_type(o.attn_type);
  c.sliding_window = o.sliding_window;
  c.logits_soft_cap = o.soft_cap;
  if (o.alibi) c.alibi_slopes = alibi_slopes(o.num_heads);
  if (o.sinks) c.sinks.assign(size_t(o.num_heads > 0 ? o.num_heads : 0), 0.0f);
  c.validate();
  const BackendQuery query{c, parse_device(o.device)};
  const Registry& registry = default_registry();
  std::printf(
      "configuration: %s, %s, heads %d/%d, head_size %d, kv_cache_dtype %s (%s), "
      "block_size %d, on %s\n",
      std::string(to_string(c.attn_type)).c_str(), o.dtype.c_str(), c.num_heads, c.num_kv_heads,
      c.head_size, o.kv_cache_dtype.c_str(), o.layout.c_str(), c.block_size,
      to_string(query.device).c_str());
  std::printf("%s", format_verdicts(registry.explain(query)).c_str());
  for (const Backend* b : registry.backends()) {
    const std::string info = b->device_info(query.device);
    if (!info.empty())
      std::printf("%s kernels: %s\n", std::string(b->name()).c_str(), info.c_str());
  }
  try {
    const Backend& chosen = registry.select(query);
    std::printf("selected: %s\n", std::string(chosen.name()).c_str());
  } catch (const Error& e) {
    std::printf("selected: none (%s)\n", e.what());
    g_exit_code = 1;
  }
  print_options(registry);
}

}  // namespace

int exit_code() {
  return g_exit_code;
}
void set_exit_code(int code) {
  g_exit_code = code;
}

void add_backends_command(CLI::App& app) {
  auto opts = std::make_shared<BackendsOptions>();
  CLI::App* cmd = app.add_subcommand(
      "backends", "List the backends and why each does or does not support a configuration");
  cmd->add_option("--num-heads", opts->num_heads, "query heads")->capture_default_str();
  cmd->add_option("--num-kv-heads", opts->num_kv_heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-size", opts->head_size, "head size")->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "float32 | float16 | bfloat16")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", opts->kv_cache_dtype,
                  "auto bfloat16 float16 float32 fp8 fp8_e4m3 fp8_e5m2")
      ->capture_default_str();
  cmd->add_option("--layout", opts->layout, "KV cache layout: NHD | HND")->capture_default_str();
  cmd->add_option("--block-size", opts->block_size, "tokens per cache block")
      ->capture_default_str();
  cmd->add_option("--attn-type", opts->attn_type,
                  "decoder | encoder | encoder_only | encoder_decoder")
      ->capture_default_str();
  cmd->add_option("--sliding-window", opts->sliding_window, "window, current token included");
  cmd->add_option("--soft-cap", opts->soft_cap, "logits soft cap");
  cmd->add_flag("--alibi", opts->alibi, "use ALiBi slopes");
  cmd->add_flag("--sinks", opts->sinks, "use attention sinks");
  cmd->add_option("--device", opts->device, "cpu | cuda | cuda:N")->capture_default_str();
  cmd->callback([opts] { run_backends(*opts); });
}

}  // namespace pagedattn::cli
