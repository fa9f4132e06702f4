// bench_prefill: paged prefill attention of the `cuda` backend (causal, bf16 and fp8 KV),
// timed with CUDA events over CUDA-graph replays on random data, in TFLOP/s. Writes JSON that
// bench/gpu/report_prefill.py merges with peers_prefill.py's torch figures.
//
//   bench_prefill --out ours.json [--quick] [--only SUBSTR[,SUBSTR...]]
//                 [--cuda-option NAME=VALUE]...
//
// --only keeps the points whose label ("causal-d128 b4 ctx0 q4096 h32/8 d128 auto",
// "vit-mha b32 s577 h16 d80") contains one of the substrings: the variant sweeps of a tuning
// run time only what they change.
// FLOPs counted: 4 * head_size per visible (query, key) pair per query head (QK^T and PV,
// 2 FLOPs per multiply-add), i.e. 4 * q * k * d halved for a causal square; a chunk of q
// tokens over c cached ones sees sum_i (c + i + 1) keys. Nothing else is counted.
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "bench_common.h"

namespace {

using json = nlohmann::json;
using namespace bench;

struct Shape {
  std::string group;
  int batch = 1, context = 0, q_len = 4096;  // context: cached tokens before the chunk
  int num_heads = 32, num_kv_heads = 8, head_size = 128, block_size = 16;
  KVCacheDType kv = KVCacheDType::kAuto;
  bool query_quant = false;  // fp8 query (and fp8 products where compiled)
};

std::string label(const Shape& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s b%d ctx%d q%d h%d/%d d%d %s", s.group.c_str(), s.batch,
                s.context, s.q_len, s.num_heads, s.num_kv_heads, s.head_size,
                std::string(to_string(s.kv)).c_str());
  return buf;
}

double flops(const Shape& s) {
  // sum over the chunk's tokens i of (context + i + 1) visible keys
  const double pairs = double(s.q_len) * s.context + double(s.q_len) * (s.q_len + 1) / 2.0;
  return 4.0 * s.head_size * pairs * s.num_heads * s.batch;
}

// Graph-replayed median of `body` in microseconds (enough launches per replay for ~2 ms).
template <class F>
double graph_us(cudaStream_t stream, bool quick, F&& body) {
  body();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const double one_ms = median(time_ms(stream, 3, body));
  const int per_graph = std::clamp(int(std::ceil(2.0 / std::max(one_ms, 1e-3))), 1, 64);
  const Graph graph(stream, [&] {
    for (int i = 0; i < per_graph; ++i) body();
  });
  warm_clocks(stream, [&] { graph.launch(); });
  const auto ms = time_ms(stream, quick ? 5 : 11, [&] { graph.launch(); });
  return median(ms) * 1e3 / per_graph;
}

json run_point(const Backend& backend, const Shape& s, bool quick, std::mt19937& rng,
               cudaStream_t stream) {
  AttentionConfig c;
  c.num_heads = s.num_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.head_size = s.head_size;
  c.scale = 1.0f / std::sqrt(float(s.head_size));
  c.dtype = DType::kBF16;
  c.kv_cache_dtype = s.kv;
  c.block_size = s.block_size;
  c.query_quant = s.query_quant;
  json r = {{"label", label(s)},
            {"group", s.group},
            {"batch", s.batch},
            {"context", s.context},
            {"q_len", s.q_len},
            {"num_heads", s.num_heads},
            {"num_kv_heads", s.num_kv_heads},
            {"head_size", s.head_size},
            {"kv_cache_dtype", std::string(to_string(s.kv))},
            {"query_quant", s.query_quant},
            {"flops", flops(s)}};
  const Device dev = Device::cuda(0);
  const auto reasons = backend.check({c, dev});
  if (!reasons.empty()) {
    r["skipped"] = reasons.front();
    return r;
  }
  const DType cache_dtype = c.cache_dtype();
  const int seq_len = s.context + s.q_len;
  const int blocks_per_seq = (seq_len + s.block_size - 1) / s.block_size;
  const int64_t num_blocks = int64_t(blocks_per_seq) * s.batch + 1;
  KVCache cache = KVCache::allocate(num_blocks, s.block_size, s.num_kv_heads, s.head_size,
                                    cache_dtype, KVCacheLayout::kNHD, dev);
  fill_random(cache.storage().data(), cache.storage().view().nbytes(), cache_dtype, rng, stream);
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);  // a shuffled block table
  MetadataBuilder b(s.block_size);
  for (int q = 0; q < s.batch; ++q) {
    RequestSpec spec{s.context, s.q_len, {}};
    const size_t base = size_t(q) * size_t(blocks_per_seq);
    spec.block_ids.assign(pool.begin() + long(base), pool.begin() + long(base + blocks_per_seq));
    b.add(spec);
  }
  StepMetadata step = b.build();
  AttentionMetadata md = step.to_device(dev);
  const int64_t tokens = int64_t(s.batch) * s.q_len;
  Tensor query = Tensor::empty({tokens, s.num_heads, s.head_size}, DType::kBF16, dev);
  fill_random(query.data(), query.view().nbytes(), DType::kBF16, rng, stream);
  Tensor out = Tensor::empty({tokens, s.num_heads, s.head_size}, DType::kBF16, dev);
  auto impl = backend.make_impl(c, dev);
  const auto plan = backend.plan(md, c);
  Tensor workspace;
  if (plan->workspace_bytes() > 0) {
    workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, dev);
  }
  auto forward = [&] {
    ForwardArgs f;
    f.query = query.view();
    f.kv_cache = cache.view();
    f.scales = {1.0f, 1.0f, 0.02f};  // q_scale: random queries span about +-4
    f.metadata = &md;
    f.output = out.view();
    f.plan = plan.get();
    f.workspace = {workspace.data(), plan->workspace_bytes()};
    f.stream = {stream};
    impl->forward(f);
  };
  const double us = graph_us(stream, quick, forward);
  r["us"] = us;
  r["tflops"] = flops(s) / (us * 1e-6) / 1e12;
  r["num_splits_workspace_bytes"] = plan->workspace_bytes();
  return r;
}

// MultiHeadAttention (no cache, not causal) at ViT shapes: [B, S, H*D] bf16, FLOPs 4*S*S*D*H*B.
json run_mha_point(int batch, int seq, int heads, int head_size, bool quick, std::mt19937& rng,
                   cudaStream_t stream) {
  const double flop = 4.0 * seq * double(seq) * head_size * heads * batch;
  char name[128];
  std::snprintf(name, sizeof name, "vit-mha b%d s%d h%d d%d", batch, seq, heads, head_size);
  json r = {{"label", name},         {"group", "vit-mha"},     {"batch", batch},
            {"context", 0},          {"q_len", seq},           {"num_heads", heads},
            {"num_kv_heads", heads}, {"head_size", head_size}, {"flops", flop}};
  const Device dev = Device::cuda(0);
  MultiHeadAttentionOptions o;
  o.num_heads = heads;
  o.head_size = head_size;
  o.scale = 1.0f / std::sqrt(float(head_size));
  o.dtype = DType::kBF16;
  o.device = dev;
  MultiHeadAttention mha(o);
  const int64_t elems = int64_t(batch) * seq * heads * head_size;
  Tensor q = Tensor::empty({batch, seq, int64_t(heads) * head_size}, DType::kBF16, dev);
  Tensor k = Tensor::empty({batch, seq, int64_t(heads) * head_size}, DType::kBF16, dev);
  Tensor v = Tensor::empty({batch, seq, int64_t(heads) * head_size}, DType::kBF16, dev);
  Tensor out = Tensor::empty({batch, seq, int64_t(heads) * head_size}, DType::kBF16, dev);
  for (Tensor* t : {&q, &k, &v})
    fill_random(t->data(), size_t(elems) * 2, DType::kBF16, rng, stream);
  const double us = graph_us(stream, quick, [&] {
    mha.forward(q.view(), k.view(), v.view(), out.view(), Stream{stream});
  });
  r["us"] = us;
  r["tflops"] = flop / (us * 1e-6) / 1e12;
  return r;
}

std::vector<Shape> shapes(bool quick) {
  std::vector<Shape> v;
  // Fresh causal prompts, ~16k tokens per launch.
  const std::vector<int> lens =
      quick ? std::vector<int>{4096} : std::vector<int>{1024, 2048, 4096, 8192, 16384};
  for (int d : {128, 64, 256}) {
    for (int n : lens) {
      Shape s;
      s.group = "causal-d" + std::to_string(d);
      s.head_size = d;
      s.q_len = n;
      s.batch = std::max(1, 16384 / n);
      v.push_back(s);
    }
  }
  for (int n : quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384}) {
    Shape s;
    s.group = "causal-d128-fp8";
    s.kv = KVCacheDType::kFp8E4M3;
    s.q_len = n;
    s.batch = std::max(1, 16384 / n);
    v.push_back(s);
  }
  // fp8 products: the query quantised, QK^T and P V in e4m3 (issue 5's fp8 compute path).
  for (int d : {128, 64}) {
    for (int n : quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384}) {
      Shape s;
      s.group = "causal-d" + std::to_string(d) + "-fp8-qquant";
      s.kv = KVCacheDType::kFp8E4M3;
      s.query_quant = true;
      s.head_size = d;
      s.q_len = n;
      s.batch = std::max(1, 16384 / n);
      v.push_back(s);
    }
  }
  // Head sizes between and below the compiled ones (a bucket: the next compiled instance with
  // zero columns past the problem's) beside the compiled ones: causal 4k, 16k tokens per
  // launch. FLOP/s counts the problem's head size.
  if (!quick) {
    for (int d : {32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256}) {
      Shape s;
      s.group = "heads-causal";
      s.head_size = d;
      s.q_len = 4096;
      s.batch = 4;
      v.push_back(s);
    }
  }
  // Chunked prefill with few heads per GPU (tensor parallel 4: 8 query heads, 1 KV head).
  for (int ctx : quick ? std::vector<int>{16384} : std::vector<int>{8192, 16384, 32768}) {
    for (int chunk : quick ? std::vector<int>{512} : std::vector<int>{256, 512, 1024}) {
      Shape s;
      s.group = "chunked-h8/1";
      s.num_heads = 8;
      s.num_kv_heads = 1;
      s.context = ctx;
      s.q_len = chunk;
      v.push_back(s);
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "bench_prefill.json";
  bool quick = false;
  std::vector<std::string> only;
  std::vector<std::string> cuda_options;  // --cuda-option NAME=VALUE (Registry::configure)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        if (comma > at) only.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "--cuda-option" && i + 1 < argc) {
      cuda_options.push_back(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_prefill [--out FILE] [--quick] [--only SUBSTR,...] "
                   "[--cuda-option NAME=VALUE]...\n");
      return 2;
    }
  }
  try {
    if (default_registry().find("cuda") != nullptr) {
      default_registry().configure("cuda", cuda_options);
    }
    const Backend* backend = default_registry().find("cuda");
    if (backend == nullptr) {
      std::fprintf(stderr, "bench_prefill: this build has no cuda backend\n");
      return 2;
    }
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(20261202);
    json doc;
    doc["gpu"] = prop.name;
    doc["sms"] = prop.multiProcessorCount;
    json results = json::array();
    auto wanted = [&](const std::string& name) {
      if (only.empty()) return true;
      for (const std::string& o : only) {
        if (name.find(o) != std::string::npos) return true;
      }
      return false;
    };
    for (const Shape& s : shapes(quick)) {
      if (!wanted(label(s))) continue;
      json r = run_point(*backend, s, quick, rng, stream);
      if (r.contains("us")) {
        std::printf("%-52s %10.1f us  %6.1f TFLOP/s\n", r["label"].get<std::string>().c_str(),
                    r["us"].get<double>(), r["tflops"].get<double>());
      } else {
        std::printf("%-52s skipped: %s\n", r["label"].get<std::string>().c_str(),
                    r["skipped"].get<std::string>().c_str());
      }
      std::fflush(stdout);
      results.push_back(r);
    }
    for (int seq : {577, 1025}) {
      for (int d : {64, 72, 80}) {
        if (quick && (seq != 577 || d != 64)) continue;
        char name[128];
        std::snprintf(name, sizeof name, "vit-mha b32 s%d h16 d%d", seq, d);
        if (!wanted(name)) continue;
        json r = run_mha_point(32, seq, 16, d, quick, rng, stream);
        std::printf("%-52s %10.1f us  %6.1f TFLOP/s\n", r["label"].get<std::string>().c_str(),
                    r["us"].get<double>(), r["tflops"].get<double>());
        std::fflush(stdout);
        results.push_back(r);
      }
    }
    doc["results"] = results;
    std::ofstream(out) << doc.dump(1) << "\n";
    BENCH_CUDA(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_prefill: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
