// Helpers of the GPU benchmarks (bench_decode, bench_prefill, bench_mla, bench_dcp): CUDA error
// checks, event timing, clock warm-up, graph capture, the device copy rate and random device data.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

#include "pagedattn/pagedattn.h"

namespace bench {

using namespace pagedattn;

#define BENCH_CUDA(call)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                                  \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Times `body` (which enqueues work on `stream`) `repeats` times with events; milliseconds.
template <class F>
std::vector<double> time_ms(cudaStream_t stream, int repeats, F&& body) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<double> out;
  for (int i = 0; i < repeats; ++i) {
    BENCH_CUDA(cudaEventRecord(a, stream));
    body();
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    out.push_back(ms);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  return out;
}

// Runs `pass` (which enqueues work on `stream`) and waits, again and again until >= 100 ms have
// gone by: the clocks are up before anything is timed.
template <class F>
void warm_clocks(cudaStream_t stream, F&& pass) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 0.1) {
    pass();
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }
}

// What `pass` enqueues on `stream`, captured once into an executable CUDA graph.
class Graph {
 public:
  template <class F>
  Graph(cudaStream_t stream, F&& pass) : stream_(stream) {
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    pass();
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph_));
    BENCH_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~Graph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch() const { BENCH_CUDA(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// bench_decode's and bench_mla's protocol: `pass` once (module load, attributes), the clocks
// warmed, `repeats` eager passes, then `repeats` replays of the pass captured in a graph;
// milliseconds per pass, eager and replayed.
struct PassTimes {
  std::vector<double> eager, graphed;
};
template <class F>
PassTimes time_eager_and_graphed(cudaStream_t stream, int repeats, F&& pass) {
  pass();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  warm_clocks(stream, pass);
  PassTimes t;
  t.eager = time_ms(stream, repeats, pass);
  const Graph graph(stream, pass);
  graph.launch();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  t.graphed = time_ms(stream, repeats, [&] { graph.launch(); });
  return t;
}

inline double copy_rate_gbps(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  BENCH_CUDA(cudaMemsetAsync(src, 1, bytes, stream));
  for (int i = 0; i < 3; ++i)
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  const auto ms = time_ms(stream, 10, [&] {
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  BENCH_CUDA(cudaFree(src));
  BENCH_CUDA(cudaFree(dst));
  return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
}

// Host random values of `dtype` (normal, std 1), `count` elements.
inline std::vector<uint8_t> random_bytes(DType dtype, int64_t count, std::mt19937& rng) {
  std::vector<uint8_t> out(size_t(count) * dtype_size(dtype));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) store_element(out.data(), dtype, i, dist(rng));
  return out;
}

// Fills `bytes` of device memory with valid random values of `dtype` (a 64 MiB random tile,
// replicated by device copies).
inline void fill_random(void* dst, size_t bytes, DType dtype, std::mt19937& rng,
                        cudaStream_t stream) {
  constexpr size_t kTile = size_t(64) << 20;
  static std::map<DType, std::vector<uint8_t>> tiles;  // drawn once per dtype
  auto& host = tiles[dtype];
  if (host.empty()) host = random_bytes(dtype, int64_t(kTile / dtype_size(dtype)), rng);
  const size_t tile = std::min(bytes, kTile);
  BENCH_CUDA(cudaMemcpy(dst, host.data(), tile, cudaMemcpyHostToDevice));
  for (size_t off = tile; off < bytes; off += tile) {
    BENCH_CUDA(cudaMemcpyAsync(static_cast<char*>(dst) + off, dst, std::min(tile, bytes - off),
                               cudaMemcpyDeviceToDevice, stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
}

}  // namespace bench
