// bench_decode: paged decode attention of the `cuda` backend, timed with CUDA events over
// CUDA-graph replays (and eagerly), on random data with rotating block tables so that the
// working set exceeds L2. Writes JSON (bench/gpu/report.py merges it with the torch peers).
//
//   bench_decode --out ours.json [--quick] [--max-tokens N] [--only S1,S2,...]
//                [--cuda-option NAME=VALUE]...
//
// --only keeps the points whose label contains one of the substrings (ncu runs use it).
//
// Bytes counted: each valid K and V byte once (sum over requests of seq_len * Hkv * D * elem
// * 2); split partials, Q and O are not counted (docs/kernels/decode.md). The device copy rate
// (a 1 GiB device-to-device cudaMemcpy, read + write counted) is measured in the same run.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
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

struct Shape {
  std::string group;  // which figure / table the point belongs to
  int batch = 1, context = 1024, q_len = 1;
  int num_heads = 32, num_kv_heads = 8, head_size = 128, block_size = 16;
  DType dtype = DType::kBF16;
  KVCacheDType kv = KVCacheDType::kAuto;
  KVCacheLayout layout = KVCacheLayout::kNHD;
  int layers = 0;  // > 0: a whole step (write_kv + attention) of this many layers in one graph
};

std::string label(const Shape& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s b%d ctx%d q%d h%d/%d d%d bs%d %s%s%s", s.group.c_str(),
                s.batch, s.context, s.q_len, s.num_heads, s.num_kv_heads, s.head_size, s.block_size,
                std::string(to_string(s.kv)).c_str(), s.layout == KVCacheLayout::kHND ? " HND" : "",
                s.layers ? (" layers" + std::to_string(s.layers)).c_str() : "");
  return buf;
}

struct Options {
  std::string out = "bench_ours.json";
  bool quick = false;
  int64_t max_tokens = int64_t(8) << 20;  // batch * context cap per point
  std::vector<std::string> only;          // label substrings to keep (empty: all)
  std::vector<std::string> cuda_options;  // --cuda-option NAME=VALUE (Registry::configure)
};

json run_point(const Backend& backend, const Shape& s, const Options& o, size_t l2_bytes,
               std::mt19937& rng, cudaStream_t stream) {
  AttentionConfig c;
  c.num_heads = s.num_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.head_size = s.head_size;
  c.scale = 1.0f / std::sqrt(float(s.head_size));
  c.dtype = s.dtype;
  c.kv_cache_dtype = s.kv;
  c.block_size = s.block_size;
  json r = {{"label", label(s)},
            {"group", s.group},
            {"batch", s.batch},
            {"context", s.context},
            {"q_len", s.q_len},
            {"num_heads", s.num_heads},
            {"num_kv_heads", s.num_kv_heads},
            {"head_size", s.head_size},
            {"block_size", s.block_size},
            {"dtype", std::string(dtype_name(s.dtype))},
            {"kv_cache_dtype", std::string(to_string(s.kv))},
            {"layout", s.layout == KVCacheLayout::kHND ? "HND" : "NHD"},
            {"layers", s.layers}};
  const auto reasons = backend.check({c, Device::cuda(0)});
  if (!reasons.empty()) {
    r["skipped"] = reasons.front();
    return r;
  }
  const Device dev = Device::cuda(0);
  const DType cache_dtype = c.cache_dtype();
  const int seq_len = s.context + s.q_len;  // keys after this step's tokens are written
  const int blocks_per_seq = (seq_len + s.block_size - 1) / s.block_size;
  const double block_bytes =
      2.0 * s.block_size * s.num_kv_heads * s.head_size * double(dtype_size(cache_dtype));
  const double kv_bytes = 2.0 * double(s.batch) * seq_len * s.num_kv_heads * s.head_size *
                          double(dtype_size(cache_dtype));
  // Rotate among enough disjoint block sets that one pass reads >= 4x L2.
  const int rotations =
      std::clamp(int(std::ceil(4.0 * double(l2_bytes) / kv_bytes)), 1, o.quick ? 8 : 64);
  const int64_t num_blocks = int64_t(blocks_per_seq) * s.batch * rotations + 1;
  KVCache cache = KVCache::allocate(num_blocks, s.block_size, s.num_kv_heads, s.head_size,
                                    cache_dtype, s.layout, dev);
  fill_random(cache.storage().data(), cache.storage().view().nbytes(), cache_dtype, rng, stream);

  // Metadata per rotation: shuffled, disjoint blocks (block 0 stays the null block).
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<StepMetadata> steps;
  std::vector<AttentionMetadata> mds;
  steps.reserve(size_t(rotations));
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
  Tensor query = Tensor::empty({tokens, s.num_heads, s.head_size}, s.dtype, dev);
  fill_random(query.data(), query.view().nbytes(), s.dtype, rng, stream);
  Tensor new_kv = Tensor::empty({tokens, s.num_kv_heads, s.head_size}, s.dtype, dev);
  fill_random(new_kv.data(), new_kv.view().nbytes(), s.dtype, rng, stream);
  Tensor out = Tensor::empty({tokens, s.num_heads, s.head_size}, s.dtype, dev);

  auto impl = backend.make_impl(c, dev);
  const auto host_t0 = std::chrono::steady_clock::now();
  const auto plan = backend.plan(mds[0], c);
  const double plan_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_t0).count();
  Tensor workspace;
  if (plan->workspace_bytes() > 0) {
    workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, dev);
  }
  const KVScales scales{1.0f, 1.0f};
  auto forward = [&](int rot) {
    ForwardArgs f;
    f.query = query.view();
    f.kv_cache = cache.view();
    f.scales = scales;
    f.metadata = &mds[size_t(rot)];
    f.output = out.view();
    f.plan = plan.get();
    f.workspace = {workspace.data(), plan->workspace_bytes()};
    f.stream = {stream};
    impl->forward(f);
  };
  auto write = [&](int rot) {
    WriteKVArgs w{new_kv.view(), new_kv.view(), mds[size_t(rot)].slot_mapping,
                  cache.view(),  scales,        {stream}};
    impl->write_kv(w);
  };
  const int layers = std::max(1, s.layers);
  auto one_pass = [&] {  // every rotation once (a whole step per rotation when layers > 0)
    for (int rot = 0; rot < rotations; ++rot) {
      for (int l = 0; l < layers; ++l) {
        if (s.layers > 0) write(rot);
        forward(rot);
      }
    }
  };
  const int repeats = o.quick ? 5 : 15;
  const PassTimes times = time_eager_and_graphed(stream, repeats, one_pass);
  const std::vector<double>& eager = times.eager;
  const std::vector<double>& graphed = times.graphed;

  const double calls = double(rotations) * layers;
  const double us_graph = median(graphed) * 1e3 / calls, us_eager = median(eager) * 1e3 / calls;
  const double spread = (*std::max_element(graphed.begin(), graphed.end()) -
                         *std::min_element(graphed.begin(), graphed.end())) *
                        1e3 / calls;
  r["rotations"] = rotations;
  r["kv_bytes"] = kv_bytes;
  r["num_splits_workspace_bytes"] = plan->workspace_bytes();
  r["plan_us"] = plan_us;
  r["us"] = us_graph;
  r["us_spread"] = spread;
  r["us_eager"] = us_eager;
  r["gbps"] = kv_bytes / (us_graph * 1e-6) / 1e9;
  r["gbps_eager"] = kv_bytes / (us_eager * 1e-6) / 1e9;
  r["block_bytes"] = block_bytes;
  return r;
}

/// The head-size sweep (groups heads-*): compiled sizes and the sizes between them.
constexpr int kSweepHeadSizes[] = {32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256};

std::vector<Shape> shapes(const Options& o) {
  std::vector<Shape> v;
  const std::vector<int> batches =
      o.quick ? std::vector<int>{1, 64} : std::vector<int>{1, 16, 64, 128, 256};
  const std::vector<int> contexts =
      o.quick ? std::vector<int>{4096} : std::vector<int>{1024, 2048, 4096, 8192, 16384, 32768};
  for (int b : batches) {
    for (int ctx : contexts) {
      if (int64_t(b) * ctx > o.max_tokens) continue;
      Shape s;
      s.group = "gqa32/8-d128";
      s.batch = b;
      s.context = ctx;
      v.push_back(s);
    }
  }
  // Variants at three representative points.
  const std::vector<std::pair<int, int>> points =
      o.quick ? std::vector<std::pair<int, int>>{{16, 8192}}
              : std::vector<std::pair<int, int>>{{1, 32768}, {16, 8192}, {64, 4096}};
  for (auto [b, ctx] : points) {
    Shape s;
    s.batch = b;
    s.context = ctx;
    Shape x = s;
    x.group = "d64";
    x.head_size = 64;
    v.push_back(x);
    x = s;
    x.group = "d256";
    x.head_size = 256;
    v.push_back(x);
    x = s;
    x.group = "mha32/32";
    x.num_kv_heads = 32;
    v.push_back(x);
    x = s;
    x.group = "fp8-e4m3";
    x.kv = KVCacheDType::kFp8E4M3;
    v.push_back(x);
    x = s;
    x.group = "bs1";
    x.block_size = 1;
    v.push_back(x);
    x = s;
    x.group = "bs128";
    x.block_size = 128;
    v.push_back(x);
    x = s;
    x.group = "fp8-e5m2";
    x.kv = KVCacheDType::kFp8E5M2;
    v.push_back(x);
    // HND ([blocks][Hkv][bs][D]: each block and head 4 KB contiguous) as the control for the
    // row gather of NHD.
    x = s;
    x.group = "hnd";
    x.layout = KVCacheLayout::kHND;
    v.push_back(x);
    x.group = "hnd-fp8-e4m3";
    x.kv = KVCacheDType::kFp8E4M3;
    v.push_back(x);
    x = s;
    x.group = "q4";
    x.q_len = 4;
    v.push_back(x);
  }
  // Head sizes between and below the compiled ones (a bucket: the next compiled instance with
  // zero columns past the problem's) beside the compiled ones, bf16 and fp8 caches, at one
  // memory-bound point. bytes/s counts the problem's head size.
  for (int d : kSweepHeadSizes) {
    for (const KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
      if (kv == KVCacheDType::kFp8E4M3 && d % 16 != 0) continue;  // fp8 rows of 16-byte chunks
      Shape x;
      x.group = std::string("heads-") + (kv == KVCacheDType::kAuto ? "bf16" : "fp8");
      x.batch = 64;
      x.context = 4096;
      x.head_size = d;
      x.kv = kv;
      v.push_back(x);
    }
  }
  Shape step;
  step.group = "step-32-layers";
  step.batch = 64;
  step.context = 4096;
  step.layers = 32;
  v.push_back(step);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      o.out = argv[++i];
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--max-tokens" && i + 1 < argc) {
      o.max_tokens = std::atoll(argv[++i]);
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
                   "usage: bench_decode [--out FILE] [--quick] [--max-tokens N] [--only S1,S2] "
                   "[--cuda-option NAME=VALUE]...\n");
      return 2;
    }
  }
  try {
    if (default_registry().find("cuda") != nullptr) {
      default_registry().configure("cuda", o.cuda_options);
    }
    const Backend* backend = default_registry().find("cuda");
    if (backend == nullptr) {
      std::fprintf(stderr, "bench_decode: this build has no cuda backend\n");
      return 2;
    }
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0, mem_clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, 0);
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(20261202);
    json doc;
    doc["gpu"] = prop.name;
    doc["sms"] = prop.multiProcessorCount;
    doc["l2_bytes"] = prop.l2CacheSize;
    doc["max_sm_clock_mhz"] = clock_khz / 1000;
    doc["copy_gbps"] = copy_rate_gbps(stream);
    std::printf("device %s, %d SMs, L2 %d MB, D2D copy %.0f GB/s (read+write)\n", prop.name,
                prop.multiProcessorCount, prop.l2CacheSize >> 20, doc["copy_gbps"].get<double>());
    json results = json::array();
    for (const Shape& s : shapes(o)) {
      if (!o.only.empty() && std::none_of(o.only.begin(), o.only.end(), [&](const std::string& x) {
            return label(s).find(x) != std::string::npos;
          })) {
        continue;
      }
      json r = run_point(*backend, s, o, size_t(prop.l2CacheSize), rng, stream);
      if (r.contains("us")) {
        std::printf("%-58s %9.1f us  %7.0f GB/s  (eager %7.0f GB/s, spread %.1f us)\n",
                    r["label"].get<std::string>().c_str(), r["us"].get<double>(),
                    r["gbps"].get<double>(), r["gbps_eager"].get<double>(),
                    r["us_spread"].get<double>());
      } else {
        std::printf("%-58s skipped: %s\n", r["label"].get<std::string>().c_str(),
                    r["skipped"].get<std::string>().c_str());
      }
      std::fflush(stdout);
      results.push_back(r);
    }
    doc["results"] = results;
    std::ofstream(o.out) << doc.dump(1) << "\n";
    BENCH_CUDA(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_decode: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
