// bench_dcp: decode with decode context parallelism (DCP) on 1, 2, 4 and 8 GPUs of one host,
// one process per GPU (forked here, tests/common/fork_ranks.h), the partial results exchanged
// and merged by pagedattn_nccl (nccl::dcp_exchange). The measurements: decode latency
// at batch 1 over 128k..1M tokens of context and throughput at batch 64 over 32k, the speedup
// against one GPU and the time in the exchange. World sizes past the visible GPUs are listed as
// not run; no figure is made up.
//
//   bench_dcp [--worlds 1,2,4,8] [--out FILE] [--quick] [--repeats N] [--cuda-option N=V]...
//
// Per point and rank: the rank's share of every request's KV (global position i on rank
// i % world), written as random bf16 data in shuffled blocks, rotating block tables so that one
// pass reads >= 4x L2; a step is the rank's decode forward (cuda backend, with LSE, straight into
// its slot of the exchange workspace: an in-place all-gather) then nccl::dcp_exchange (the
// outputs' and LSEs' all-gathers as one NCCL group, the rank-order merge). CUDA events around
// the forward and the exchange time each part of every eager step (median over steps; the
// exchange includes waiting for the slowest rank); the whole step is also captured in a CUDA
// graph (attention + NCCL + merge) and timed by replays. Reported per world: the slowest rank's
// medians (attention, exchange and step eager; "graph" the replayed step); "exchange" is the
// exchange's share of the eager step; speedup = the graphed step on 1 GPU / on N GPUs (same
// point, same run).
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "common/fork_ranks.h"
#include "pagedattn/nccl.h"
#include "pagedattn/pagedattn.h"

namespace {

using namespace pagedattn;
using json = nlohmann::json;
using namespace bench;

#define BENCH_NCCL(call)                                                                       \
  do {                                                                                         \
    const ncclResult_t r_ = (call);                                                            \
    if (r_ != ncclSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, ncclGetErrorString(r_), __FILE__, \
                   __LINE__);                                                                  \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

struct Point {
  std::string group;  // "latency b1" or "throughput b64"
  int batch = 1, context = 131072;
};

struct Options {
  std::vector<int> worlds = {1, 2, 4, 8};
  std::string out = "bench_dcp.json";
  bool quick = false;
  int repeats = 20;
  std::vector<std::string> cuda_options;  // --cuda-option NAME=VALUE (Registry::configure)
};

// The model: Llama-3-8B-like attention (32 query heads, 8 KV heads, head size 128), bf16
// activations and cache, block size 16.
AttentionConfig model_config() {
  AttentionConfig c;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_size = 128;
  c.scale = 1.0f / std::sqrt(128.0f);
  c.dtype = DType::kBF16;
  c.block_size = 16;
  return c;
}

std::vector<Point> points(const Options& o) {
  std::vector<Point> v;
  const std::vector<int> contexts =
      o.quick ? std::vector<int>{131072} : std::vector<int>{131072, 262144, 524288, 1048576};
  for (int ctx : contexts) v.push_back({"latency b1", 1, ctx});
  v.push_back({"throughput b64", 64, 32768});
  return v;
}

std::string label(const Point& p) {
  return p.group + " ctx" + std::to_string(p.context);
}

// Barrier: a one-word all-reduce, waited for.
void barrier(ncclComm_t comm, cudaStream_t stream, int* word) {
  BENCH_NCCL(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
}

// One rank's measurement of one point.
json run_point(const Point& p, int rank, int world, ncclComm_t comm, cudaStream_t stream, int* word,
               size_t l2_bytes, int repeats) {
  const Backend& cuda = *default_registry().find("cuda");
  const Device dev = Device::cuda(rank);
  const auto dcp = DecodeContextParallel::of(rank, world);
  const AttentionConfig c = dcp_config(model_config(), dcp);
  const int bs = c.block_size;
  // Each request: `context` cached tokens, the new one at position `context`.
  const int64_t local = dcp.local_len(int64_t(p.context) + 1);
  const int64_t blocks_per_seq = (local + bs - 1) / bs;
  const double kv_bytes = 2.0 * double(p.batch) * double(local) * c.num_kv_heads * c.head_size *
                          double(dtype_size(c.dtype));
  const int rotations = std::clamp(int(std::ceil(4.0 * double(l2_bytes) / kv_bytes)), 1, 8);
  const int64_t num_blocks = blocks_per_seq * p.batch * rotations + 1;
  KVCache cache = KVCache::allocate(num_blocks, bs, c.num_kv_heads, c.head_size, c.dtype,
                                    KVCacheLayout::kNHD, dev);
  std::mt19937 rng(20261202 + uint32_t(rank));
  fill_random(cache.storage().data(), cache.storage().view().nbytes(), c.dtype, rng, stream);
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<StepMetadata> steps;
  std::vector<AttentionMetadata> mds;
  for (int rot = 0; rot < rotations; ++rot) {
    std::vector<DcpDecodeRequest> reqs;
    for (int q = 0; q < p.batch; ++q) {
      const size_t base = (size_t(rot) * size_t(p.batch) + size_t(q)) * size_t(blocks_per_seq);
      reqs.push_back({p.context, std::vector<int32_t>(pool.begin() + long(base),
                                                      pool.begin() + long(base + blocks_per_seq))});
    }
    steps.push_back(dcp_decode_metadata(reqs, bs, dcp));
  }
  for (auto& st : steps) mds.push_back(st.to_device(dev));
  // The same query on every rank (the step's full query: DCP ranks attend with all of it).
  std::mt19937 qrng(7);
  Tensor query = Tensor::empty({p.batch, c.num_heads, c.head_size}, c.dtype, dev);
  fill_random(query.data(), query.view().nbytes(), c.dtype, qrng, stream);
  Tensor output = Tensor::empty({p.batch, c.num_heads, c.head_size}, c.dtype, dev);
  const auto layout = DcpExchangeLayout::of(world, p.batch, c.num_heads, c.head_size, c.dtype);
  Tensor exchange_ws = Tensor::empty({int64_t(layout.bytes)}, DType::kU8, dev);
  auto impl = cuda.make_impl(c, dev);
  std::vector<std::unique_ptr<Plan>> plans;
  size_t plan_ws = 0;
  for (const auto& md : mds) {
    plans.push_back(cuda.plan(md, c));
    plan_ws = std::max(plan_ws, plans.back()->workspace_bytes());
  }
  Tensor attention_ws = Tensor::empty({std::max<int64_t>(int64_t(plan_ws), 1)}, DType::kU8, dev);
  DcpExchangeArgs x;
  x.rank = rank;
  x.world = world;
  x.partial_output = layout.output_slot(exchange_ws.data(), rank, dev);
  x.partial_lse = layout.lse_slot(exchange_ws.data(), rank, dev);
  x.output = output.view();
  x.workspace = {exchange_ws.data(), layout.bytes};
  x.stream = {stream};
  auto forward = [&](int rot) {
    ForwardArgs f;
    f.query = query.view();
    f.kv_cache = cache.view();
    f.metadata = &mds[size_t(rot)];
    f.output = x.partial_output;
    f.lse = x.partial_lse;
    f.plan = plans[size_t(rot)].get();
    f.workspace = {attention_ws.data(), plan_ws};
    f.stream = {stream};
    impl->forward(f);
  };
  auto exchange = [&] { nccl::dcp_exchange(comm, cuda, x); };
  // Warm-up (module load, NCCL channels), then the clocks.
  for (int rot = 0; rot < rotations; ++rot) {
    forward(rot);
    exchange();
  }
  barrier(comm, stream, word);
  auto step_all = [&] {  // every rotation once
    for (int rot = 0; rot < rotations; ++rot) {
      forward(rot);
      exchange();
    }
  };
  // A fixed number of passes, not warm_clocks' time limit: every rank must make the same
  // number of collective calls.
  for (int i = 0; i < 20; ++i) step_all();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  barrier(comm, stream, word);
  // Eager steps, each part between events.
  std::vector<cudaEvent_t> ev(size_t(3 * repeats));
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < repeats; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[size_t(3 * i)], stream));
    forward(i % rotations);
    BENCH_CUDA(cudaEventRecord(ev[size_t(3 * i + 1)], stream));
    exchange();
    BENCH_CUDA(cudaEventRecord(ev[size_t(3 * i + 2)], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> attention, exchange_ms, step;
  for (int i = 0; i < repeats; ++i) {
    float a = 0, b = 0;
    BENCH_CUDA(cudaEventElapsedTime(&a, ev[size_t(3 * i)], ev[size_t(3 * i + 1)]));
    BENCH_CUDA(cudaEventElapsedTime(&b, ev[size_t(3 * i + 1)], ev[size_t(3 * i + 2)]));
    attention.push_back(a);
    exchange_ms.push_back(b);
    step.push_back(double(a) + b);
  }
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  // The whole step (every rotation) in one CUDA graph, replayed.
  barrier(comm, stream, word);
  std::vector<double> graphed;
  {
    const Graph graph(stream, step_all);
    graph.launch();
    barrier(comm, stream, word);
    graphed = time_ms(stream, std::max(3, repeats / 2), [&] { graph.launch(); });
  }
  barrier(comm, stream, word);
  return {{"label", label(p)},
          {"group", p.group},
          {"batch", p.batch},
          {"context", p.context},
          {"world", world},
          {"rank", rank},
          {"local_tokens_per_request", local},
          {"kv_bytes", kv_bytes},
          {"rotations", rotations},
          {"us_attention", median(attention) * 1e3},
          {"us_exchange", median(exchange_ms) * 1e3},
          {"us_step", median(step) * 1e3},
          {"us_step_graph", median(graphed) * 1e3 / rotations}};
}

int rank_main(int rank, int world, const std::string& id_bytes, const Options& o,
              const std::string& dir) {
  default_registry().configure("cuda", o.cuda_options);
  BENCH_CUDA(cudaSetDevice(rank));
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof id);
  ncclComm_t comm;
  BENCH_NCCL(ncclCommInitRank(&comm, world, id, rank));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int* word = nullptr;
  BENCH_CUDA(cudaMalloc(&word, sizeof(int)));
  BENCH_CUDA(cudaMemset(word, 0, sizeof(int)));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, rank));
  json results = json::array();
  for (const Point& p : points(o)) {
    json r = run_point(p, rank, world, comm, stream, word, size_t(prop.l2CacheSize), o.repeats);
    if (rank == 0) {
      std::printf(
          "  world %d rank 0: %-28s attention %9.1f us  exchange %7.1f us  step %9.1f us "
          "(graph %9.1f us)\n",
          world, r["label"].get<std::string>().c_str(), r["us_attention"].get<double>(),
          r["us_exchange"].get<double>(), r["us_step"].get<double>(),
          r["us_step_graph"].get<double>());
    }
    results.push_back(r);
  }
  json doc = {{"gpu", prop.name}, {"nccl", nccl::version()}, {"results", results}};
  std::ofstream(dir + "/rank" + std::to_string(rank) + ".json") << doc.dump() << "\n";
  BENCH_CUDA(cudaFree(word));
  BENCH_CUDA(cudaStreamDestroy(stream));
  BENCH_NCCL(ncclCommDestroy(comm));
  return 0;
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
    } else if (a == "--repeats" && i + 1 < argc) {
      o.repeats = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--worlds" && i + 1 < argc) {
      o.worlds.clear();
      std::stringstream list(argv[++i]);
      for (std::string w; std::getline(list, w, ',');) o.worlds.push_back(std::atoi(w.c_str()));
    } else if (a == "--cuda-option" && i + 1 < argc) {
      o.cuda_options.push_back(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_dcp [--worlds 1,2,4,8] [--out FILE] [--quick] [--repeats N] "
                   "[--cuda-option NAME=VALUE]...\n");
      return 2;
    }
  }
  const int gpus = test::count_devices_in_child([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  if (gpus <= 0) {
    std::fprintf(stderr, "bench_dcp: no CUDA device is visible\n");
    return 2;
  }
  std::printf("bench_dcp: %d visible GPU(s)\n", gpus);
  json doc;
  doc["visible_gpus"] = gpus;
  doc["model"] = "32 query heads, 8 KV heads, head size 128, bf16 activations and cache, block 16";
  json by_world = json::object(), not_run = json::array();
  int status = 0;
  for (int world : o.worlds) {
    if (world < 1 || world > gpus) {
      std::printf("world %d: not run (%d GPU(s) visible)\n", world, gpus);
      not_run.push_back(world);
      continue;
    }
    char tmpl[] = "/tmp/bench_dcp.XXXXXX";
    const char* dir = mkdtemp(tmpl);
    if (dir == nullptr) {
      std::perror("bench_dcp: mkdtemp");
      return 2;
    }
    const std::string where(dir);
    std::printf("world %d:\n", world);
    const int rc = test::fork_ranks(
        world, 580, 30,
        [] {
          ncclUniqueId id;
          BENCH_NCCL(ncclGetUniqueId(&id));
          return std::string(reinterpret_cast<const char*>(&id), sizeof id);
        },
        [&](int rank, int w, const std::string& id) { return rank_main(rank, w, id, o, where); });
    if (rc != 0) {
      std::fprintf(stderr, "bench_dcp: world %d failed (%d)\n", world, rc);
      status = 1;
      continue;
    }
    // The slowest rank of each point (the ranks finish a step together, but each part's time
    // can differ).
    json merged = json::array();
    for (int r = 0; r < world; ++r) {
      std::ifstream in(where + "/rank" + std::to_string(r) + ".json");
      const json d = json::parse(in);
      doc["gpu"] = d["gpu"];
      doc["nccl"] = d["nccl"];
      for (size_t i = 0; i < d["results"].size(); ++i) {
        const json& x = d["results"][i];
        if (r == 0) {
          merged.push_back(x);
          merged[i].erase("rank");
          continue;
        }
        for (const char* key : {"us_attention", "us_exchange", "us_step", "us_step_graph"}) {
          merged[i][key] = std::max(merged[i][key].get<double>(), x[key].get<double>());
        }
      }
      std::remove((where + "/rank" + std::to_string(r) + ".json").c_str());
    }
    ::rmdir(dir);
    by_world[std::to_string(world)] = merged;
  }
  // Speedups against one GPU, and the exchange's share of the step.
  json table = json::array();
  std::printf("\n%-30s %5s %13s %12s %12s %12s %9s %8s\n", "point", "GPUs", "attention us",
              "exchange us", "step us", "graph us", "exchange", "speedup");
  for (auto& [w, results] : by_world.items()) {
    for (json& r : results) {
      r["exchange_share"] = r["us_exchange"].get<double>() / r["us_step"].get<double>();
      if (by_world.contains("1")) {
        for (const json& one : by_world["1"]) {
          if (one["label"] == r["label"]) {
            r["speedup_vs_1"] =
                one["us_step_graph"].get<double>() / r["us_step_graph"].get<double>();
          }
        }
      }
      std::printf("%-30s %5s %13.1f %12.1f %12.1f %12.1f %8.1f%% %8s\n",
                  r["label"].get<std::string>().c_str(), w.c_str(), r["us_attention"].get<double>(),
                  r["us_exchange"].get<double>(), r["us_step"].get<double>(),
                  r["us_step_graph"].get<double>(), 100.0 * r["exchange_share"].get<double>(),
                  r.contains("speedup_vs_1")
                      ? (std::to_string(r["speedup_vs_1"].get<double>()).substr(0, 5) + "x").c_str()
                      : "-");
      table.push_back(r);
    }
  }
  doc["results"] = table;
  doc["worlds_not_run"] = not_run;
  std::ofstream(o.out) << doc.dump(1) << "\n";
  return status;
}
