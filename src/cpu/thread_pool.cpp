#include "cpu/thread_pool.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedattn::cpu {
namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Waits while `a` holds `old`: spins up to spin_us (the clock read every 64 polls), then sleeps
// in atomic::wait (a futex on Linux) until a notify.
template <class T>
void await_change(const std::atomic<T>& a, T old, int spin_us) {
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::microseconds(spin_us);
  for (int k = 1; a.load(std::memory_order_acquire) == old; ++k) {
    if (spin_us <= 0 || (k % 64 == 0 && std::chrono::steady_clock::now() - start > limit)) {
      a.wait(old, std::memory_order_acquire);
    } else {
      cpu_relax();
    }
  }
}

thread_local bool t_inside = false;  // this thread runs a loop's items

class Pool {
 public:
  ~Pool() {
    stop_.store(true, std::memory_order_release);
    job_.fetch_add(kGeneration, std::memory_order_release);
    job_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // Precondition: run_ is held by the caller, which is not inside a loop.
  void run(int64_t n, const Parallelism& how, const std::function<void(int64_t)>& fn) {
    const int helpers = static_cast<int>(std::min<int64_t>({how.threads, n, kMaxThreads})) - 1;
    while (static_cast<int>(workers_.size()) < helpers) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { work(index); });
    }
    // Read only by this loop's helpers, which are done with them before run returns.
    fn_ = &fn;
    n_ = n;
    error_ = nullptr;
    spin_us_.store(how.spin_us, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    // One word holds the loop's generation and its helper count, so that a worker decides
    // whether it takes part from the same loop it woke for.
    const uint64_t job = (job_.load(std::memory_order_relaxed) & ~kHelperMask) + kGeneration;
    state_.store(uint64_t(uint32_t(job >> 16)) << 32, std::memory_order_relaxed);  // open, none
    job_.store(job | uint64_t(helpers), std::memory_order_release);
    if (helpers > 0) job_.notify_all();
    items();
    // Closed: a helper that wakes only now (late, on a busy machine) takes no part, so the
    // caller waits only for helpers that are running items, never for one to be scheduled.
    uint64_t s = state_.fetch_or(kClosed, std::memory_order_acq_rel) | kClosed;
    for (; (s & kActiveMask) != 0; s = state_.load(std::memory_order_acquire)) {
      await_change(state_, s, how.spin_us);
    }
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex run_;  // one loop at a time

 private:
  static constexpr uint64_t kHelperMask = 0xffff, kGeneration = 0x10000;
  // state_: the loop's generation (bits 32-63), closed (bit 31), helpers in it (bits 0-30).
  static constexpr uint64_t kClosed = uint64_t(1) << 31, kActiveMask = kClosed - 1;
  static constexpr int64_t kMaxThreads = 4096;

  void items() {
    t_inside = true;
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    t_inside = false;
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      await_change(job_, seen, spin_us_.load(std::memory_order_relaxed));
      seen = job_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      if (uint64_t(index) >= (seen & kHelperMask)) continue;  // this loop wants fewer threads
      // Join the loop unless it is over or closed (its items all taken by the time we ran).
      const uint64_t gen = uint64_t(uint32_t(seen >> 16));
      uint64_t s = state_.load(std::memory_order_acquire);
      bool joined = false;
      while ((s >> 32) == gen && (s & kClosed) == 0) {
        if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;
      items();
      if (((state_.fetch_sub(1, std::memory_order_acq_rel) - 1) & kActiveMask) == 0) {
        state_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> job_{0};    // generation (bits 16 on) and helper count (bits 0-15)
  std::atomic<uint64_t> state_{0};  // the loop's generation, closed bit and helpers in it
  std::atomic<int64_t> next_{0};
  std::atomic<int> spin_us_{50};
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int default_threads() {
  return omp_get_max_threads();
}

void parallel_for(int64_t n, const Parallelism& how, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.run_, std::defer_lock);
  if (how.threads <= 1 || n == 1 || t_inside || !lock.try_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  p.run(n, how, fn);
}

}  // namespace pagedattn::cpu
