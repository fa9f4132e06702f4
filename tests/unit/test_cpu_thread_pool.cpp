// The cpu backend's thread pool (src/cpu/thread_pool.h): every item runs exactly once whatever
// the thread count and spin, an item's exception reaches the caller after the other items ran,
// a loop inside an item runs on its thread, and loops from two threads at once both complete.
#include <gtest/gtest.h>

#if PAGEDATTN_WITH_CPU_BACKEND

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/thread_pool.h"

namespace pagedattn::cpu {
namespace {

TEST(CpuThreadPool, RunsEveryItemOnceAtEveryThreadCountAndSpin) {
  for (const int threads : {1, 2, 3, 8}) {
    for (const int spin : {0, 50}) {
      for (const int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000)}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        for (int round = 0; round < 3; ++round) {
          parallel_for(n, Parallelism{threads, spin}, [&](int64_t i) { ++hits[size_t(i)]; });
        }
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[size_t(i)].load(), 3)
              << threads << " threads, spin " << spin << ", n " << n << ", item " << i;
        }
      }
    }
  }
}

TEST(CpuThreadPool, AnItemsExceptionReachesTheCallerAfterTheOtherItems) {
  std::atomic<int> ran{0};
  EXPECT_THROW(parallel_for(100, Parallelism{4, 50},
                            [&](int64_t i) {
                              ++ran;
                              if (i == 37) throw std::runtime_error("item 37");
                            }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 100);
  // The pool still serves the next loop.
  std::atomic<int64_t> sum{0};
  parallel_for(10, Parallelism{4, 50}, [&](int64_t i) { sum += i; });
  EXPECT_EQ(sum.load(), 45);
}

TEST(CpuThreadPool, NestedAndConcurrentLoopsComplete) {
  std::atomic<int64_t> inner{0};
  parallel_for(8, Parallelism{2, 50}, [&](int64_t) {
    parallel_for(5, Parallelism{2, 50}, [&](int64_t) { ++inner; });  // on this thread
  });
  EXPECT_EQ(inner.load(), 40);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) {
        parallel_for(16, Parallelism{3, 10}, [&](int64_t) { ++total; });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 16);
}

}  // namespace
}  // namespace pagedattn::cpu

#endif  // PAGEDATTN_WITH_CPU_BACKEND
