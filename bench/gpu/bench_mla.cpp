// bench_mla: MLA latent decode of the `cuda` backend (head size 576 = kv_lora_rank 512 +
// qk_rope_head_dim 64, one latent KV head read as K and V, as MLAAttention binds it), timed with
// CUDA events over CUDA-graph replays (and eagerly), on random data with rotating block tables
// so that the working set exceeds L2. Writes JSON.
//
//   bench_mla --out mla.json [--quick] [--only S1,S2,...] [--out-cols 512|576]
//             [--cuda-option NAME=VALUE]...
//
// --out-cols 576 binds the generic contract's output (512..575 = P k_pe), which auto serves with
// split-S's 576-column instance: an A/B of the 512-column kernels against it in one binary.
// --cuda-option sets a cuda backend option (`pagedattn backends` lists them), e.g.
// mla_consumer=seesaw: two variants of one binary compared (ab_mla.sh).
//
// Bytes counted: each visible latent byte once (sum over requests of seq_len * 576 * elem);
// split partials, Q and O are not counted. FLOPs: 2 * rows * seq_len * (576 + 512) per request
// (rows = num_heads * q_len; S over 576 columns, P V over the 512 of the output, which
// MLAAttention binds as [tokens, heads, 512]). The device copy rate (a 1 GiB
// device-to-device cudaMemcpy, read + write counted) is measured in the same run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "pagedattn/pagedattn.h"

namespace {

using namespace pagedattn;
using json = nlohmann::json;
using namespace bench;

constexpr int kEntry = 576;  // kv_lora_rank + qk_rope_head_dim (DeepSeek-V2/V3)
constexpr int kLatent = 512;

struct Shape {
  std::string group;
  int batch = 64, context = 4096, q_len = 1, num_heads = 16, block_size = 64;
  DType dtype = DType::kBF16;
  KVCacheDType kv = KVCacheDType::kAuto;
};

std::string label(const Shape& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s b%d ctx%d q%d h%d bs%d %s %s", s.group.c_str(), s.batch,
                s.context, s.q_len, s.num_heads, s.block_size,
                std::string(dtype_name(s.dtype)).c_str(), std::string(to_string(s.kv)).c_str());
  return buf;
}

struct Options {
  std::string out = "bench_mla.json";
  bool quick = false;
  std::vector<std::string> only;
  int out_cols = kLatent;
  std::vector<std::string> cuda_options;  // --cuda-option NAME=VALUE (Registry::configure)
};

json run_point(const Backend& backend, const Shape& s, const Options& o, size_t l2_bytes,
               double copy_gbps, std::mt19937& rng, cudaStream_t stream) {
  AttentionConfig c;
  c.num_heads = s.num_heads;
  c.num_kv_heads = 1;
  c.head_size = kEntry;
  c.scale = 1.0f / std::sqrt(192.0f);  // (qk_nope 128 + qk_rope 64)^-0.5
  c.dtype = s.dtype;
  c.kv_cache_dtype = s.kv;
  c.block_size = s.block_size;
  json r = {{"label", label(s)},
            {"group", s.group},
            {"batch", s.batch},
            {"context", s.context},
            {"q_len", s.q_len},
            {"num_heads", s.num_heads},
            {"block_size", s.block_size},
            {"dtype", std::string(dtype_name(s.dtype))},
            {"kv_cache_dtype", std::string(to_string(s.kv))},
            {"out_cols", o.out_cols}};
  const auto reasons = backend.check({c, Device::cuda(0)});
  if (!reasons.empty()) {
    r["skipped"] = reasons.front();
    return r;
  }
  const Device dev = Device::cuda(0);
  const DType cache_dtype = c.cache_dtype();
  const int seq_len = s.context + s.q_len;
  const int blocks_per_seq = (seq_len + s.block_size - 1) / s.block_size;
  const double kv_bytes = double(s.batch) * seq_len * kEntry * double(dtype_size(cache_dtype));
  const double flops =
      2.0 * double(s.batch) * s.num_heads * s.q_len * double(seq_len) * (kEntry + kLatent);
  const int rotations =
      std::clamp(int(std::ceil(4.0 * double(l2_bytes) / kv_bytes)), 1, o.quick ? 8 : 32);
  const int64_t num_blocks = int64_t(blocks_per_seq) * s.batch * rotations + 1;
  KVCache cache =
      KVCache::allocate(num_blocks, s.block_size, 1, kEntry, cache_dtype, KVCacheLayout::kNHD, dev);
  fill_random(cache.storage().data(), cache.storage().view().nbytes(), cache_dtype, rng, stream);
  KVCacheView latent = cache.view();
  latent.value = latent.key;  // one entry as K and V

  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<StepMetadata> steps;
  std::vector<AttentionMetadata> mds;
  for (int rot = 0; rot < rotations; ++rot) {
    MetadataBuilder b(s.block_size);
    for (int q = 0; q < s.batch; ++q) {
      RequestSpec spec{s.context, s.q_len, {}};
      const size_t base = (size_t(rot) * s.batch + q) * size_t(blocks_per_seq);
      spec.block_ids.assign(pool.begin() + long(base), pool.begin() + long(base + blocks_per_seq));
      b.add(spec);
    }
    steps.push_back(b.build());
  }
  for (auto& st : steps) mds.push_back(st.to_device(dev));
  const int64_t tokens = int64_t(s.batch) * s.q_len;
  Tensor query = Tensor::empty({tokens, s.num_heads, kEntry}, s.dtype, dev);
  fill_random(query.data(), query.view().nbytes(), s.dtype, rng, stream);
  // The latent output as MLAAttention binds it: P V's first kv_lora_rank columns (or all 576).
  Tensor out = Tensor::empty({tokens, s.num_heads, o.out_cols}, s.dtype, dev);

  auto impl = backend.make_impl(c, dev);
  const auto plan = backend.plan(mds[0], c);
  Tensor workspace;
  if (plan->workspace_bytes() > 0) {
    workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, dev);
  }
  auto one_pass = [&] {
    for (int rot = 0; rot < rotations; ++rot) {
      ForwardArgs f;
      f.query = query.view();
      f.kv_cache = latent;
      f.scales = {1.0f, 1.0f};
      f.metadata = &mds[size_t(rot)];
      f.output = out.view();
      f.plan = plan.get();
      f.workspace = {workspace.data(), plan->workspace_bytes()};
      f.stream = {stream};
      impl->forward(f);
    }
  };
  const int repeats = o.quick ? 5 : 15;
  const PassTimes times = time_eager_and_graphed(stream, repeats, one_pass);
  const std::vector<double>& eager = times.eager;
  const std::vector<double>& graphed = times.graphed;

  const double us = median(graphed) * 1e3 / rotations;
  const double us_eager = median(eager) * 1e3 / rotations;
  r["rotations"] = rotations;
  r["kv_bytes"] = kv_bytes;
  r["flops"] = flops;
  r["workspace_bytes"] = plan->workspace_bytes();
  r["us"] = us;
  r["us_eager"] = us_eager;
  r["gbps"] = kv_bytes / (us * 1e-6) / 1e9;
  r["x_copy"] = r["gbps"].get<double>() / copy_gbps;
  r["tflops"] = flops / (us * 1e-6) / 1e12;
  return r;
}

std::vector<Shape> shapes(const Options& o) {
  std::vector<Shape> v;
  // Memory-bound: 16 heads x 1 token (DeepSeek-V3 at TP 8), bf16 and fp8 latent caches.
  for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
    for (int b : o.quick ? std::vector<int>{64} : std::vector<int>{64, 128}) {
      for (int ctx : o.quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384}) {
        Shape s;
        s.group = kv == KVCacheDType::kAuto ? "h16q1" : "h16q1-fp8";
        s.batch = b;
        s.context = ctx;
        s.kv = kv;
        v.push_back(s);
      }
    }
  }
  // 32 packed rows: 16 heads x 2 tokens (one MTP draft token) over bf16 and fp8 caches, and
  // 32 heads x 1 token (TP 4).
  for (int b : o.quick ? std::vector<int>{64} : std::vector<int>{64, 128}) {
    for (int ctx : o.quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192}) {
      Shape s;
      s.batch = b;
      s.context = ctx;
      s.group = "h16q2";
      s.q_len = 2;
      v.push_back(s);
      s.group = "h16q2-fp8";
      s.kv = KVCacheDType::kFp8E4M3;
      v.push_back(s);
      s.group = "h32q1";
      s.kv = KVCacheDType::kAuto;
      s.q_len = 1;
      s.num_heads = 32;
      v.push_back(s);
    }
  }
  // Compute-heavier: 128 heads x 1 token (TP 1) and 16 heads x 4 tokens (speculative decode).
  for (int b : o.quick ? std::vector<int>{64} : std::vector<int>{64, 128}) {
    for (int ctx : o.quick ? std::vector<int>{4096} : std::vector<int>{4096, 8192}) {
      Shape s;
      s.batch = b;
      s.context = ctx;
      s.group = "h128q1";
      s.num_heads = 128;
      v.push_back(s);
      s.group = "h16q4";
      s.num_heads = 16;
      s.q_len = 4;
      v.push_back(s);
      // The same two over an fp8 e4m3 cache: half the bytes per FLOP, where the compute-bound
      // target (600 TFLOP/s) is within the copy rate's reach at 16 heads x 4.
      s.kv = KVCacheDType::kFp8E4M3;
      s.group = "h16q4-fp8";
      v.push_back(s);
      s.group = "h128q1-fp8";
      s.num_heads = 128;
      s.q_len = 1;
      v.push_back(s);
      s.kv = KVCacheDType::kAuto;
      // 128 heads x 2 tokens (multi-token prediction): four M tiles share each K/V read.
      s.group = "h128q2";
      s.num_heads = 128;
      s.q_len = 2;
      v.push_back(s);
    }
  }
  // Block sizes 16 and 1 against 64, and a small batch with a long context (split-KV).
  Shape s;
  s.group = "bs16";
  s.block_size = 16;
  s.context = 8192;
  v.push_back(s);
  s.group = "bs1";
  s.block_size = 1;
  v.push_back(s);
  s = Shape{};
  s.group = "long";
  s.batch = 4;
  s.context = 32768;
  v.push_back(s);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      o.out = argv[++i];
    } else if (a == "--out-cols" && i + 1 < argc) {
      o.out_cols = std::atoi(argv[++i]);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        if (q > p) o.only.push_back(list.substr(p, q - p));
        p = q + 1;
      }
    } else if (a == "--cuda-option" && i + 1 < argc) {
      o.cuda_options.push_back(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_mla [--out FILE] [--quick] [--only S1,S2] [--out-cols 512|576] "
                   "[--cuda-option NAME=VALUE]...\n");
      return 2;
    }
  }
  if (o.out_cols != kLatent && o.out_cols != kEntry) {
    std::fprintf(stderr, "bench_mla: --out-cols takes %d or %d\n", kLatent, kEntry);
    return 2;
  }
  try {
    if (default_registry().find("cuda") != nullptr) {
      default_registry().configure("cuda", o.cuda_options);
    }
    const Backend* backend = default_registry().find("cuda");
    if (backend == nullptr) {
      std::fprintf(stderr, "bench_mla: this build has no cuda backend\n");
      return 2;
    }
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(20261203);
    json doc;
    doc["gpu"] = prop.name;
    doc["sms"] = prop.multiProcessorCount;
    doc["l2_bytes"] = prop.l2CacheSize;
    const double copy = copy_rate_gbps(stream);
    doc["copy_gbps"] = copy;
    std::printf("device %s, %d SMs, L2 %d MB, D2D copy %.0f GB/s (read+write)\n", prop.name,
                prop.multiProcessorCount, prop.l2CacheSize >> 20, copy);
    json results = json::array();
    for (const Shape& s : shapes(o)) {
      if (!o.only.empty() && std::none_of(o.only.begin(), o.only.end(), [&](const std::string& x) {
            return label(s).find(x) != std::string::npos;
          })) {
        continue;
      }
      json r = run_point(*backend, s, o, size_t(prop.l2CacheSize), copy, rng, stream);
      if (r.contains("us")) {
        std::printf("%-44s %9.1f us %6.0f GB/s %5.2f x copy %6.1f TFLOP/s (eager %.1f us)\n",
                    r["label"].get<std::string>().c_str(), r["us"].get<double>(),
                    r["gbps"].get<double>(), r["x_copy"].get<double>(), r["tflops"].get<double>(),
                    r["us_eager"].get<double>());
      } else {
        std::printf("%-44s skipped: %s\n", r["label"].get<std::string>().c_str(),
                    r["skipped"].get<std::string>().c_str());
      }
      std::fflush(stdout);
      results.push_back(r);
    }
    doc["results"] = results;
    std::ofstream(o.out) << doc.dump(1) << "\n";
    BENCH_CUDA(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mla: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
