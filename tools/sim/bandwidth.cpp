#include "sim/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <thread>
#include <vector>

namespace pagedattn::sim {

namespace {

// Sums 64-bit words with four independent accumulators, so the loop is limited by loads.
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

}  // namespace

std::optional<double> measure_read_bandwidth(size_t bytes, int passes, int threads) {
  const size_t words = bytes / sizeof(uint64_t);
  if (words == 0 || passes < 1) return std::nullopt;
  std::unique_ptr<uint64_t[]> buffer(new (std::nothrow) uint64_t[words]);
  if (!buffer) return std::nullopt;
  const int n = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const size_t chunk = (words + size_t(n) - 1) / size_t(n);
  std::vector<uint64_t> sums(size_t(n) * 8);  // one cache line apart: no false sharing
  auto run = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 0; t < n; ++t) {
      const size_t begin = std::min(words, size_t(t) * chunk);
      const size_t end = std::min(words, begin + chunk);
      pool.emplace_back([&body, t, begin, end] { body(t, begin, end); });
    }
    for (std::thread& th : pool) th.join();
  };
  // First touch by the threads that will read it (pages land near them), non-zero data.
  run([&](int, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) buffer[i] = i * 0x9e3779b97f4a7c15ull;
  });
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    run([&](int t, size_t begin, size_t end) {
      sums[size_t(t) * 8] += sum_words(buffer.get() + begin, end - begin);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, double(words * sizeof(uint64_t)) / s);
  }
  // Keep the sums observable so the reads cannot be optimised away.
  volatile uint64_t sink = 0;
  for (const uint64_t s : sums) sink = sink + s;
  (void)sink;
  return best;
}

std::optional<double> measure_device_copy_bandwidth(Device device, size_t bytes, int passes) {
  DeviceRuntime& rt = require_device(device);
  void* src = nullptr;
  void* dst = nullptr;
  try {
    src = rt.allocate(bytes, device.index);
    dst = rt.allocate(bytes, device.index);
  } catch (const std::exception&) {
    if (src) rt.deallocate(src, device.index);
    return std::nullopt;
  }
  rt.memset(src, 0x5a, bytes, device.index);
  rt.copy(dst, device, src, device, bytes);  // warm-up
  rt.synchronize(device.index);
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    rt.copy(dst, device, src, device, bytes);
    rt.synchronize(device.index);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, double(bytes) / s);
  }
  rt.deallocate(src, device.index);
  rt.deallocate(dst, device.index);
  return best;
}

}  // namespace pagedattn::sim
