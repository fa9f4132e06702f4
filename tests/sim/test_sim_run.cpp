// End to end: the serving simulation of `pagedattn run` on the tiny preset, checked against the
// float64 reference, plus its argument errors and a deliberately wrong backend it must catch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/expect_error.h"
#include "pagedattn/backend.h"
#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"
#include "sim/report.h"
#include "sim/simulation.h"

namespace pagedattn::sim {
namespace {

SimOptions tiny_options() {
  SimOptions o;
  o.preset = "tiny";
  o.measure_bandwidth = false;
  o.verify_every = 1;
  o.workload.num_requests = 10;
  return o;
}

TEST(SimRun, TinyPresetEveryStepMatchesTheReference) {
  const SimReport r = run_simulation(tiny_options());
  EXPECT_TRUE(r.passed());
  EXPECT_EQ(r.finished_requests, 10);
  EXPECT_GT(r.steps, 0);
  EXPECT_EQ(r.verified_steps, r.steps) << "tiny steps are all small enough to verify";
  EXPECT_EQ(r.deferred_checks, 0);
  EXPECT_EQ(r.layer_checks, 2 * r.steps) << "one layer per KV-cache group, two groups";
  EXPECT_EQ(r.failed_checks, 0);
  EXPECT_LE(r.worst.max_abs, r.worst.budget);
  ASSERT_EQ(r.groups.size(), 2u);
  EXPECT_EQ(r.groups[0].kind, "sliding_window");
  EXPECT_EQ(r.groups[0].sliding_window, 64);
  EXPECT_EQ(r.groups[1].kind, "full_attention");
  EXPECT_GT(r.window_blocks_released, 0);
  EXPECT_GT(r.prefix_hit_tokens, 0);
  EXPECT_GT(r.decode_tokens, 0);
  EXPECT_GT(r.prefill_tokens, 0);
  EXPECT_GT(r.attention_seconds, 0);
  EXPECT_GT(r.kv_bytes_read, 0);
  EXPECT_LE(r.peak_blocks_used, r.usable_blocks);
  EXPECT_EQ(r.usable_blocks, r.num_blocks - 1);

  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  EXPECT_EQ(j["preset"], "tiny");
  EXPECT_EQ(j["run"]["steps"], r.steps);
  EXPECT_EQ(j["verification"]["passed"], true);
  EXPECT_EQ(j["kv_cache"]["groups"].size(), 2u);
  const std::string text = format_report(r);
  EXPECT_NE(text.find("all passed"), std::string::npos) << text;
  // Lengths from 1000 on print whole (2048, not 2.05e+03).
  SimReport wide = r;
  wide.workload.prompt_len_median = 2048;
  EXPECT_NE(format_report(wide).find("medians prompt 2048,"), std::string::npos)
      << format_report(wide);
}

// A run with a connector that saved none of what it scheduled fails (the run exits non-zero);
// a decode whose lookups found nothing warns on the report's last line.
TEST(SimReportConnector, SavesThatAllFailedFailAndEmptyLoadsWarn) {
  SimReport r;
  EXPECT_TRUE(connector_shortfall(r).message.empty());  // no connector
  r.kv_connector = "storage:/x";
  r.role = "producer";
  r.connector.save_scheduled = 10;
  r.connector.save_errors = 10;
  ConnectorShortfall s = connector_shortfall(r);
  EXPECT_TRUE(s.failed);
  EXPECT_NE(s.message.find("none of the 10 blocks scheduled to save was saved (10 failed"),
            std::string::npos)
      << s.message;
  const std::string text = format_report(r);
  EXPECT_NE(text.rfind("kv FAILED"), std::string::npos);
  EXPECT_EQ(text.find('\n', text.rfind("kv FAILED")), text.size() - 1) << "the last line";
  r.connector.saved_blocks = 1;
  EXPECT_TRUE(connector_shortfall(r).message.empty());
  r.role = "consumer";
  r.connector = {};
  r.connector.lookup_blocks = 7;
  r.connector.lookup_errors = 2;
  s = connector_shortfall(r);
  EXPECT_FALSE(s.failed);
  EXPECT_NE(s.message.find("none of the 7 blocks asked about (2 lookups could not reach it)"),
            std::string::npos)
      << s.message;
  r.connector.hit_blocks = 1;
  EXPECT_TRUE(connector_shortfall(r).message.empty());
}

TEST(SimRun, EveryTokenIsComputedOnceWithoutPreemption) {
  SimOptions o = tiny_options();
  o.verify_every = 0;
  o.kv_cache_memory = int64_t(64) << 20;  // room for everything: no preemption
  const SimReport r = run_simulation(o);
  ASSERT_EQ(r.preemptions, 0);
  EXPECT_EQ(r.lookup_tokens, r.workload_prompt_tokens);
  // Each request computes its prompt and all but its last generated token, minus the hits.
  EXPECT_EQ(r.prefill_tokens + r.decode_tokens + r.prefix_hit_tokens,
            r.workload_prompt_tokens + r.workload_output_tokens - r.num_requests);
  EXPECT_EQ(r.verified_steps, 0);
}

TEST(SimRun, TightMemoryPreemptsAndStillMatchesTheReference) {
  SimOptions o = tiny_options();
  o.workload.num_requests = 12;
  o.workload.arrival_rate = 0;
  o.verify_every = 2;
  o.kv_cache_memory = int64_t(90) * 4096;  // 90 blocks: one request of 1024 tokens needs 85
  const SimReport r = run_simulation(o);
  EXPECT_EQ(r.num_blocks, 90);
  EXPECT_GT(r.preemptions, 0);
  EXPECT_GT(r.evictions, 0);
  EXPECT_EQ(r.finished_requests, 12);
  EXPECT_TRUE(r.passed());
}

TEST(SimRun, Fp8CacheAndHndLayout) {
  SimOptions o = tiny_options();
  o.workload.num_requests = 4;
  o.verify_every = 2;
  o.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  o.kv_cache_layout = KVCacheLayout::kHND;
  const SimReport r = run_simulation(o);
  EXPECT_TRUE(r.passed());
  ASSERT_TRUE(r.k_scale && r.v_scale);
  EXPECT_NE(*r.k_scale, 1.0f) << "calibrated on the first batch";
  EXPECT_NE(*r.v_scale, 1.0f);
  EXPECT_EQ(r.kv_cache_storage_dtype, "float8_e4m3fn");
  EXPECT_GT(r.layer_checks, 0);
}

// The reference with every output 5% too large: the run must notice.
class ScaledImpl : public AttentionImpl {
 public:
  explicit ScaledImpl(std::unique_ptr<AttentionImpl> inner) : inner_(std::move(inner)) {}
  void write_kv(const WriteKVArgs& args) override { inner_->write_kv(args); }
  void forward(const ForwardArgs& args) override {
    inner_->forward(args);
    const int64_t n =
        int64_t(args.metadata->num_actual_tokens) * args.output.size(1) * args.output.size(2);
    for (int64_t i = 0; i < n; ++i) {
      store_element(args.output.data, args.output.dtype, i,
                    1.05 * load_element(args.output.data, args.output.dtype, i));
    }
  }

 private:
  std::unique_ptr<AttentionImpl> inner_;
};

class ScaledBackend : public Backend {
 public:
  explicit ScaledBackend(const Backend& ref) : ref_(ref) {}
  std::string_view name() const override { return "sim-test-scaled"; }
  std::string_view description() const override { return "ref with outputs off by 5%"; }
  std::vector<std::string> check(const BackendQuery& q) const override { return ref_.check(q); }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device d) const override {
    return std::make_unique<ScaledImpl>(ref_.make_impl(c, d));
  }
  std::unique_ptr<Plan> plan(const AttentionMetadata& md, const AttentionConfig& c) const override {
    return ref_.plan(md, c);
  }
  // MLA's prefill formulation merges its partial results with the backend's merge_states.
  void merge_states(const MergeArgs& a) const override { ref_.merge_states(a); }

 private:
  const Backend& ref_;
};

TEST(SimRun, AWrongBackendFailsAndLeavesReplayableCases) {
  Registry& registry = default_registry();
  if (!registry.find("sim-test-scaled")) {
    registry.add(std::make_unique<ScaledBackend>(*registry.find("ref")));
  }
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pagedattn_sim_test_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  SimOptions o = tiny_options();
  o.workload.num_requests = 3;
  o.verify_every = 5;
  o.backend = "sim-test-scaled";
  o.failure_dir = dir.string();
  std::ostringstream log;
  o.log = &log;
  const SimReport r = run_simulation(o);
  EXPECT_FALSE(r.passed());
  EXPECT_GT(r.failed_checks, 0);
  EXPECT_GT(r.worst.max_abs, r.worst.budget);
  ASSERT_FALSE(r.failure_files.empty());
  EXPECT_NE(log.str().find("verification FAILED"), std::string::npos) << log.str();
  EXPECT_NE(format_report(r).find("FAILED"), std::string::npos);
  // The saved step replays: the reference passes it, the wrong backend's saved result fails.
  const Case c = load_case(r.failure_files.front());
  EXPECT_TRUE(check_case(c, run_case(c, *registry.find("ref"))).pass());
  EXPECT_FALSE(check_case(c, run_case(c, *registry.find("sim-test-scaled"))).pass());
  std::filesystem::remove_all(dir);
}

// A short workload (the layer's host projections make MLA steps slow, under ASan most): five
// requests sharing one system prompt, arriving one every other step so that later prompts hit
// the earlier ones' cached blocks.
SimOptions deepseek_options() {
  SimOptions o;
  o.preset = "deepseek-v3";
  o.measure_bandwidth = false;
  o.verify_every = 2;
  o.workload.num_requests = 5;
  o.workload.prompt_len_median = 48;
  o.workload.output_len_median = 8;
  o.workload.shared_prefix_fraction = 1.0;
  o.workload.num_shared_prefixes = 1;
  o.workload.arrival_rate = 0.5;
  return o;
}

// The MLA preset: MLAAttention layers through the same engine, checked against the layer over
// the float64 reference.
TEST(SimRun, DeepSeekV3RunsMLAAttentionAndMatchesTheReference) {
  const SimReport r = run_simulation(deepseek_options());
  EXPECT_TRUE(r.passed());
  EXPECT_EQ(r.layer_kind, "MLAAttention");
  EXPECT_EQ(r.finished_requests, 5);
  EXPECT_GT(r.verified_steps, 0);
  EXPECT_EQ(r.layer_checks, r.verified_steps) << "one KV-cache group, one layer checked per step";
  EXPECT_EQ(r.failed_checks, 0);
  EXPECT_LE(r.worst.max_abs, r.worst.budget);
  ASSERT_EQ(r.groups.size(), 1u);
  EXPECT_EQ(r.groups[0].kind, "mla");
  EXPECT_EQ(r.groups[0].num_layers, r.num_layers);
  EXPECT_EQ(r.num_kv_heads, 1);
  EXPECT_EQ(r.head_size, 576);
  EXPECT_GT(r.decode_tokens, 0);
  EXPECT_GT(r.prefix_hit_tokens, 0);
  // One 576-wide bf16 latent entry per key, read once.
  EXPECT_GT(r.kv_bytes_read, 0);
  EXPECT_EQ(std::fmod(r.kv_bytes_read, 576.0 * 2.0), 0.0);
  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  EXPECT_EQ(j["model"]["layer"], "MLAAttention");
  EXPECT_EQ(j["model"]["mla"]["kv_lora_rank"], 512);
  EXPECT_EQ(j["model"]["mla"]["formulation"], "split");
  EXPECT_EQ(j["model"]["scaled_down"]["model_num_layers"], 61);
  EXPECT_EQ(j["verification"]["passed"], true);
  const std::string text = format_report(r);
  EXPECT_NE(text.find("MLAAttention layers"), std::string::npos) << text;
  EXPECT_NE(text.find("scaled down"), std::string::npos) << text;
  EXPECT_NE(text.find("all passed"), std::string::npos) << text;
}

// Either formulation forced on every request, the prefill one with the cached context (prefix
// hits, chunked prefills) expanded 16 latent entries at a time: several chunks per step.
TEST(SimRun, DeepSeekV3EitherFormulationMatchesTheReference) {
  for (MLAFormulation f : {MLAFormulation::kAbsorbed, MLAFormulation::kPrefill}) {
    SimOptions o = deepseek_options();
    o.workload.num_requests = 3;
    o.workload.output_len_median = 3;  // forced prefill re-expands the context at every decode
    o.verify_every = 2;
    o.mla_formulation = f;
    o.mla_context_chunk_tokens = 16;
    const SimReport r = run_simulation(o);
    EXPECT_TRUE(r.passed()) << to_string(f);
    EXPECT_GT(r.prefix_hit_tokens, 0);
    EXPECT_EQ(r.failed_checks, 0) << to_string(f);
    EXPECT_NE(format_report(r).find(std::string(to_string(f)) + " for every request"),
              std::string::npos);
  }
  SimOptions o = tiny_options();
  o.mla_formulation = MLAFormulation::kPrefill;
  EXPECT_ERROR(run_simulation(o), InvalidArgument,
               "--mla-formulation prefill / --mla-context-chunk-tokens 4096 apply to MLA presets "
               "only; preset tiny runs Attention layers");
}

TEST(SimRun, DeepSeekV3Fp8LatentCacheCalibratesOneScale) {
  SimOptions o = deepseek_options();
  o.workload.num_requests = 3;
  o.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  const SimReport r = run_simulation(o);
  EXPECT_TRUE(r.passed());
  EXPECT_GT(r.layer_checks, 0);
  ASSERT_TRUE(r.k_scale);
  EXPECT_NE(*r.k_scale, 1.0f) << "calibrated on the first batch";
  EXPECT_FALSE(r.v_scale) << "the latent has one scale";
  EXPECT_EQ(r.kv_cache_storage_dtype, "float8_e4m3fn");
}

// On the batch-invariant reference, every output row of the absorbed formulation depends only on
// its token's prefix: two schedules of one workload (batched with prefix hits; one request at a
// time, no prefix caching) give the same digest. The prefill formulation does not: a prompt
// whose prefix was a cache hit merges a context part and a new-token part, each rounded to
// bfloat16, where a cold run computes it in one part.
TEST(SimRun, DeepSeekV3DigestDoesNotDependOnTheSchedule) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pagedattn_sim_mla_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto digest = [&](bool batched, const std::string& name) {
    SimOptions o = deepseek_options();
    o.workload.num_requests = 3;
    o.verify_every = 0;
    o.backend = "ref";
    o.mla_formulation = MLAFormulation::kAbsorbed;
    if (!batched) {
      o.max_num_seqs = 1;
      o.enable_prefix_caching = false;
    }
    o.digest_file = (dir / name).string();
    const SimReport r = run_simulation(o);
    EXPECT_EQ(r.digest_rows, r.num_layers * r.workload_output_tokens);
    EXPECT_EQ(r.prefix_hit_tokens > 0, batched);
    std::ifstream f(o.digest_file);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string batched = digest(true, "batched"), serial = digest(false, "serial");
  EXPECT_FALSE(batched.empty());
  EXPECT_EQ(batched, serial);
  std::filesystem::remove_all(dir);
}

TEST(SimRun, AWrongBackendFailsTheMLAPreset) {
  Registry& registry = default_registry();
  if (!registry.find("sim-test-scaled")) {
    registry.add(std::make_unique<ScaledBackend>(*registry.find("ref")));
  }
  SimOptions o = deepseek_options();
  o.workload.num_requests = 2;
  o.backend = "sim-test-scaled";
  std::ostringstream log;
  o.log = &log;
  const SimReport r = run_simulation(o);
  EXPECT_FALSE(r.passed());
  EXPECT_GT(r.failed_checks, 0);
  EXPECT_GT(r.worst.max_abs, r.worst.budget);
  EXPECT_TRUE(r.failure_files.empty()) << "MLA steps have no case-file format";
  EXPECT_NE(log.str().find("verification FAILED"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("no case-file format"), std::string::npos) << log.str();
}

TEST(SimRun, DeepSeekV3RefusesWhatMLADoesNotHave) {
  SimOptions o = deepseek_options();
  o.kv_cache_layout = KVCacheLayout::kHND;
  EXPECT_ERROR(run_simulation(o), InvalidArgument,
               "--kv-cache-layout HND does not apply to preset deepseek-v3");
  o = deepseek_options();
  o.kv_connector = "storage:" + std::filesystem::temp_directory_path().string();
  EXPECT_ERROR(run_simulation(o), NotSupported,
               "--connector: preset deepseek-v3 runs MLAAttention layers, which have no "
               "KV-connector hooks");
  o = deepseek_options();
  o.device = Device::cuda(0);
  EXPECT_ERROR(run_simulation(o), NotSupported,
               "--device cuda:0: preset deepseek-v3 runs MLAAttention layers, which take host "
               "tensors in this version");
}

TEST(SimRun, BadArgumentsAreNamed) {
  SimOptions o = tiny_options();
  o.preset = "llama-4";
  EXPECT_ERROR(run_simulation(o), InvalidArgument, "valid presets: llama-3-8b");
  o = tiny_options();
  o.max_model_len = 4096;
  EXPECT_ERROR(run_simulation(o), InvalidArgument, "--max-model-len (4096) must be in [2, 2048]");
  o = tiny_options();
  o.kv_cache_memory = 1024;
  EXPECT_ERROR(run_simulation(o), InvalidArgument, "one request of max_model_len 1024 needs");
  // Enough bytes for the planner, but the null block leaves one block short.
  o.kv_cache_memory = int64_t(85) * 4096;
  EXPECT_ERROR(run_simulation(o), InvalidArgument,
               "--kv-cache-memory (348160 bytes) gives 85 blocks, 84 usable after the null "
               "block; one request of max_model_len 1024 needs 85; give at least 352256 bytes");
  o.kv_cache_memory = int64_t(86) * 4096;
  o.workload.num_requests = 2;
  EXPECT_TRUE(run_simulation(o).passed());
  o = tiny_options();
  o.verify_layers = 0;
  EXPECT_ERROR(run_simulation(o), InvalidArgument, "--verify-layers (0)");
  o = tiny_options();
  o.backend = "no-such-backend";
  EXPECT_ERROR(run_simulation(o), Error, "no-such-backend");
}

TEST(SimRun, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t(512) << 20);
  EXPECT_EQ(parse_byte_size("1.5GiB"), int64_t(3) << 29);
  EXPECT_EQ(parse_byte_size("64kib"), int64_t(64) << 10);
  EXPECT_EQ(parse_byte_size("2GB"), int64_t(2000000000));
  EXPECT_EQ(parse_byte_size("1000"), 1000);
  EXPECT_ERROR(parse_byte_size("lots", "--kv-cache-memory"), InvalidArgument,
               "--kv-cache-memory 'lots' is not a positive byte size");
  EXPECT_ERROR(parse_byte_size("-1GiB"), InvalidArgument, "'-1GiB'");
  EXPECT_ERROR(parse_byte_size("3XB"), InvalidArgument, "'3XB'");
  EXPECT_ERROR(parse_byte_size("0"), InvalidArgument, "'0'");
}

}  // namespace
}  // namespace pagedattn::sim
