// `pagedattn bench`: the machine's read bandwidth, then paged decode (KV bytes read per second,
// as a fraction of that bandwidth) and prefill / chunked prefill (GFLOP/s) on one backend, all
// in one run. Medians over repeats; --json for scripts.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "pagedattn/pagedattn.h"
#include "sim/bandwidth.h"

namespace pagedattn::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct BenchOptions {
  std::string backend;
  bool json = false;
  bool quick = false;
  int repeats = 5;
  double max_gib = 6.0;
  std::string out;
  std::string only;  // "decode", "prefill" or ""
  std::string commit;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  detail::require(!v.empty(), "bench: no timed runs to take a median of");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills a tensor with random finite values of its dtype (never zeros, never NaN).
void fill_random(const TensorView& t, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t n = t.numel();
  // A pool of random elements, tiled: generating every element would dominate the setup.
  const int64_t pool = std::min<int64_t>(n, 1 << 20);
  std::vector<uint8_t> bytes(size_t(pool) * dtype_size(t.dtype));
  for (int64_t i = 0; i < pool; ++i) store_element(bytes.data(), t.dtype, i, dist(rng) + 0.001f);
  auto* dst = static_cast<uint8_t*>(t.data);
  const size_t total = size_t(n) * dtype_size(t.dtype);
  for (size_t off = 0; off < total; off += bytes.size()) {
    std::memcpy(dst + off, bytes.data(), std::min(bytes.size(), total - off));
  }
}

struct Shape {
  int batch, context, num_heads, num_kv_heads, head_size;
  KVCacheDType kv;
  int query_len = 1;
  bool fresh = false;  // prefill without context
};

// One attention step of `shape` on `backend`: caches (several replicas when small, so that the
// timed loop streams from memory, not from the last-level cache), metadata, inputs.
class Step {
 public:
  Step(const Backend& backend, const Shape& s, int replicas, std::mt19937& rng) : shape_(s) {
    config_.num_heads = s.num_heads;
    config_.num_kv_heads = s.num_kv_heads;
    config_.head_size = s.head_size;
    config_.scale = 1.0f / std::sqrt(float(s.head_size));
    config_.dtype = s.kv == KVCacheDType::kFloat16 ? DType::kF16 : DType::kBF16;
    config_.kv_cache_dtype = s.kv;
    config_.block_size = 16;
    const int seq_len = s.context + s.query_len;
    const int blocks_per_seq = (seq_len + config_.block_size - 1) / config_.block_size;
    const int64_t num_blocks = int64_t(s.batch) * blocks_per_seq + 1;
    std::vector<int32_t> ids(size_t(num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), rng);  // paged: no request gets contiguous blocks
    MetadataBuilder b(config_.block_size);
    for (int r = 0; r < s.batch; ++r) {
      b.add({s.context, s.query_len,
             std::vector<int32_t>(ids.begin() + int64_t(r) * blocks_per_seq,
                                  ids.begin() + int64_t(r + 1) * blocks_per_seq)});
    }
    step_ = b.build();
    md_ = step_.view();
    for (int i = 0; i < replicas; ++i) {
      caches_.push_back(KVCache::allocate(config_, num_blocks));
      fill_random(caches_.back().storage().view(), rng);
    }
    const int64_t tokens = int64_t(s.batch) * s.query_len;
    query_ = Tensor::empty({tokens, s.num_heads, s.head_size}, config_.dtype);
    output_ = Tensor::empty({tokens, s.num_heads, s.head_size}, config_.dtype);
    fill_random(query_.view(), rng);
    impl_ = backend.make_impl(config_, Device::cpu());
    plan_ = backend.plan(md_, config_);
    if (plan_->workspace_bytes()) {
      workspace_ = Tensor::empty({int64_t(plan_->workspace_bytes())}, DType::kU8);
    }
  }

  // Median seconds of one forward over `repeats` timed runs after two warm-ups.
  double time(int repeats) {
    std::vector<double> times;
    for (int i = 0; i < repeats + 2; ++i) {
      ForwardArgs f;
      f.query = query_.view();
      f.kv_cache = caches_[size_t(i) % caches_.size()].view();
      f.scales = {0.5f, 0.5f};
      f.metadata = &md_;
      f.output = output_.view();
      f.plan = plan_.get();
      if (workspace_.defined()) f.workspace = {workspace_.data(), workspace_.view().nbytes()};
      const auto t0 = Clock::now();
      impl_->forward(f);
      if (i >= 2) times.push_back(seconds_since(t0));
    }
    return median(times);
  }

  const AttentionConfig& config() const { return config_; }

 private:
  Shape shape_;
  AttentionConfig config_;
  StepMetadata step_;
  AttentionMetadata md_;
  std::vector<KVCache> caches_;
  Tensor query_, output_, workspace_;
  std::unique_ptr<AttentionImpl> impl_;
  std::unique_ptr<Plan> plan_;
};

int64_t kv_bytes(const Shape& s) {
  const size_t elem = is_fp8(s.kv) ? 1 : 2;
  return int64_t(s.batch) * (s.context + s.query_len) * s.num_kv_heads * s.head_size * 2 *
         int64_t(elem);
}

std::string kv_name(KVCacheDType kv) {
  return kv == KVCacheDType::kAuto ? "bf16" : std::string(to_string(kv));
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

void run_bench(const BenchOptions& o) {
  const Registry& registry = default_registry();
  AttentionConfig probe;
  probe.num_heads = 32;
  probe.num_kv_heads = 8;
  probe.head_size = 128;
  probe.scale = 0.088f;
  const Backend& backend = registry.select(
      BackendQuery{probe, Device::cpu()},
      o.backend.empty() ? std::nullopt : std::optional<std::string_view>(o.backend));
  std::mt19937 rng(1234);
  json out;
  out["backend"] = backend.name();
  out["commit"] = o.commit;
  {
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    out["date"] = date;
  }
  out["cpu"] = cpu_model();
  out["threads"] = omp_get_max_threads();
  const double bandwidth = sim::measure_read_bandwidth(size_t(1) << 30, 5).value_or(0.0);
  if (bandwidth <= 0) throw InvalidArgument("bench: cannot allocate the 1 GiB bandwidth buffer");
  out["read_bandwidth_gbs"] = bandwidth / 1e9;
  if (!o.json) {
    std::printf(
        "backend %s, %d threads, %s\nread bandwidth: %.1f GB/s (streaming read on every hardware "
        "thread, best of 5 over 1 GiB)\n",
        std::string(backend.name()).c_str(), omp_get_max_threads(), cpu_model().c_str(),
        bandwidth / 1e9);
  }

  if (o.only.empty() || o.only == "decode") {
    const std::vector<int> batches = o.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 64};
    const std::vector<int> contexts =
        o.quick ? std::vector<int>{1024, 8192} : std::vector<int>{1024, 8192, 32768};
    const std::vector<std::pair<int, int>> heads = {{32, 8}, {32, 32}};
    const std::vector<int> head_sizes =
        o.quick ? std::vector<int>{128} : std::vector<int>{64, 128, 256};
    const std::vector<KVCacheDType> kvs = {KVCacheDType::kAuto, KVCacheDType::kFloat16,
                                           KVCacheDType::kFp8E4M3};
    if (!o.json) {
      std::printf("\ndecode (1 query token per request, block size 16, shuffled blocks)\n");
      std::printf("%6s %7s %6s %5s %5s %9s %10s %8s %7s\n", "batch", "context", "heads", "d", "kv",
                  "KV MiB", "time ms", "GB/s", "of bw");
    }
    for (int batch : batches) {
      for (int ctx : contexts) {
        for (auto [hq, hk] : heads) {
          for (int d : head_sizes) {
            for (KVCacheDType kv : kvs) {
              const Shape s{batch, ctx - 1, hq, hk, d, kv};
              const int64_t bytes = kv_bytes(s);
              json row = {{"batch", batch},     {"context", ctx}, {"num_heads", hq},
                          {"num_kv_heads", hk}, {"head_size", d}, {"kv", kv_name(kv)},
                          {"kv_bytes", bytes}};
              if (double(bytes) > o.max_gib * double(1 << 30)) {
                row["skipped"] = "cache larger than --max-gib";
                out["decode"].push_back(row);
                continue;
              }
              // Replicas so that each timed run streams at least 256 MiB from memory.
              const int replicas =
                  int(std::clamp<int64_t>((int64_t(256) << 20) / bytes + 1, 1, 64));
              Step step(backend, s, replicas, rng);
              const double t = step.time(o.repeats);
              const double gbs = double(bytes) / t / 1e9;
              row["seconds"] = t;
              row["gbs"] = gbs;
              row["fraction_of_bandwidth"] = gbs * 1e9 / bandwidth;
              out["decode"].push_back(row);
              if (!o.json) {
                std::printf("%6d %7d %3d/%-2d %5d %5s %9.1f %10.3f %8.1f %6.0f%%\n", batch, ctx, hq,
                            hk, d, kv_name(kv).c_str(), double(bytes) / (1 << 20), t * 1e3, gbs,
                            100.0 * gbs * 1e9 / bandwidth);
              }
            }
          }
        }
      }
    }
  }

  if (o.only.empty() || o.only == "prefill") {
    const std::vector<int> chunks =
        o.quick ? std::vector<int>{128, 512} : std::vector<int>{128, 512, 1024, 2048, 4096};
    const std::vector<int> contexts =
        o.quick ? std::vector<int>{0, 2048} : std::vector<int>{0, 2048, 8192};
    const std::vector<int> head_sizes =
        o.quick ? std::vector<int>{128} : std::vector<int>{64, 128, 256};
    if (!o.json) {
      std::printf("\nprefill / chunked prefill (one request, GQA 32/8, bf16, causal)\n");
      std::printf("%6s %7s %5s %10s %9s\n", "chunk", "context", "d", "time ms", "GFLOP/s");
    }
    for (int d : head_sizes) {
      for (int ctx : contexts) {
        for (int q : chunks) {
          const Shape s{1, ctx, 32, 8, d, KVCacheDType::kAuto, q};
          Step step(backend, s, 1, rng);
          const double t = step.time(std::max(1, o.repeats / 2));
          // 4 * head_size FLOPs per visible (query, key) pair and query head: the causal mask
          // hides the upper triangle of the chunk's own q x q block.
          const double pairs = double(q) * ctx + double(q) * (q + 1) / 2;
          const double flops = 4.0 * d * 32 * pairs;
          json row = {
              {"chunk", q},        {"context", ctx}, {"head_size", d},           {"num_heads", 32},
              {"num_kv_heads", 8}, {"seconds", t},   {"gflops", flops / t / 1e9}};
          out["prefill"].push_back(row);
          if (!o.json) {
            std::printf("%6d %7d %5d %10.2f %9.1f\n", q, ctx, d, t * 1e3, flops / t / 1e9);
          }
        }
      }
    }
  }
  if (o.json) std::printf("%s\n", out.dump(2).c_str());
  if (!o.out.empty()) {
    std::ofstream f(o.out);
    f << out.dump(2) << "\n";
    if (!f) throw InvalidArgument("--out: cannot write " + o.out);
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Measure read bandwidth, paged decode (GB/s) and prefill (GFLOP/s) side by side");
  cmd->add_option("--backend", o->backend, "backend to measure (default: the selected one)");
  cmd->add_flag("--json", o->json, "print the results as JSON");
  cmd->add_flag("--quick", o->quick, "a small subset of the grid");
  cmd->add_option("--repeats", o->repeats, "timed repeats per point (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--max-gib", o->max_gib, "skip decode points whose cache exceeds this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--only", o->only, "decode | prefill");
  cmd->add_option("--out", o->out, "also write the JSON to this file");
  cmd->add_option("--commit", o->commit, "commit id recorded in the JSON");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace pagedattn::cli
