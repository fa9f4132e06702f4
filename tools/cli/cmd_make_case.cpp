// `pagedattn make-case OUT.safetensors [options]`: writes a random attention case
// (docs/case_format.md) for `pagedattn compute`, tests and other implementations.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "pagedattn/case_file.h"
#include "pagedattn/error.h"

namespace pagedattn::cli {
namespace {

struct MakeCaseOptions {
  std::string out_path;
  uint64_t seed = 0;
  std::string attn_type = "decoder";
  int num_heads = 4;
  int num_kv_heads = 2;
  int head_size = 32;
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  std::optional<float> scale;
  std::optional<int> sliding_window;
  std::optional<float> soft_cap;
  bool alibi = false;
  bool sinks = false;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  std::vector<float> k_scales, v_scales;  // per KV head (empty: k_scale / v_scale)
  std::string requests = "0:7,21:1,5:12";
  int pad_tokens = 0;
  int spare_blocks = 2;
  bool no_cross_kv = false;
};

void run_make_case(const MakeCaseOptions& o) {
  CaseSpec spec;
  spec.seed = o.seed;
  spec.attn_type = parse_attn_type(o.attn_type);
  spec.num_heads = o.num_heads;
  spec.num_kv_heads = o.num_kv_heads;
  spec.head_size = o.head_size;
  const auto dtype = dtype_from_name(o.dtype);
  if (!dtype || !is_activation_dtype(*dtype)) {
    throw InvalidArgument("--dtype '" + o.dtype + "' is not float32, float16 or bfloat16");
  }
  spec.dtype = *dtype;
  spec.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  spec.block_size = o.block_size;
  spec.scale = o.scale;
  spec.sliding_window = o.sliding_window;
  spec.logits_soft_cap = o.soft_cap;
  spec.alibi = o.alibi;
  spec.sinks = o.sinks;
  spec.scales = {o.k_scale, o.v_scale, 1.0f, o.k_scales, o.v_scales, {}};
  spec.requests = parse_case_requests(o.requests);
  spec.pad_tokens = o.pad_tokens;
  spec.spare_blocks = o.spare_blocks;
  spec.cross_kv = !o.no_cross_kv;
  const Case c = make_random_case(spec);
  save_case(o.out_path, c);
  std::printf("wrote %s\n  %s\n", o.out_path.c_str(), describe(c).c_str());
}

}  // namespace

void add_make_case_command(CLI::App& app) {
  auto opts = std::make_shared<MakeCaseOptions>();
  CLI::App* cmd = app.add_subcommand(
      "make-case", "Write a random attention case file for `compute` (docs/case_format.md)");
  cmd->add_option("out", opts->out_path, "case file to write (.safetensors)")->required();
  cmd->add_option("--seed", opts->seed, "random seed")->capture_default_str();
  cmd->add_option("--attn-type", opts->attn_type,
                  "decoder | encoder | encoder_only | encoder_decoder")
      ->capture_default_str();
  cmd->add_option("--num-heads", opts->num_heads, "query heads")->capture_default_str();
  cmd->add_option("--num-kv-heads", opts->num_kv_heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-size", opts->head_size, "head size")->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "float32 | float16 | bfloat16")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", opts->kv_cache_dtype,
                  "auto bfloat16 float16 float32 fp8 fp8_e4m3 fp8_e5m2")
      ->capture_default_str();
  cmd->add_option("--block-size", opts->block_size, "tokens per cache block")
      ->capture_default_str();
  cmd->add_option("--scale", opts->scale, "softmax scale (default 1/sqrt(head_size))");
  cmd->add_option("--sliding-window", opts->sliding_window, "window, current token included");
  cmd->add_option("--soft-cap", opts->soft_cap, "logits soft cap");
  cmd->add_flag("--alibi", opts->alibi, "random ALiBi slopes");
  cmd->add_flag("--sinks", opts->sinks, "random attention sinks");
  cmd->add_option("--k-scale", opts->k_scale, "fp8 K scale")->capture_default_str();
  cmd->add_option("--v-scale", opts->v_scale, "fp8 V scale")->capture_default_str();
  cmd->add_option("--k-scales", opts->k_scales, "fp8 K scales per KV head (comma-separated)")
      ->delimiter(',');
  cmd->add_option("--v-scales", opts->v_scales, "fp8 V scales per KV head (comma-separated)")
      ->delimiter(',');
  cmd->add_option("--requests", opts->requests,
                  "context_len:num_new_tokens per request, comma-separated (encoder types: 0:n; "
                  "encoder_decoder: seq_len = context_len + num_new_tokens encoder tokens)")
      ->capture_default_str();
  cmd->add_option("--pad-tokens", opts->pad_tokens, "padding query rows (slot -1)")
      ->capture_default_str();
  cmd->add_option("--spare-blocks", opts->spare_blocks, "cache blocks no request uses")
      ->capture_default_str();
  cmd->add_flag("--no-cross-kv", opts->no_cross_kv,
                "encoder_decoder: a decode step without key/value (nothing written)");
  cmd->callback([opts] { run_make_case(*opts); });
}

}  // namespace pagedattn::cli
