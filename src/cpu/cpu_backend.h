// The fast CPU backend: SIMD (run-time dispatched) + OpenMP threads. The embedded default on
// machines without a GPU.
#pragma once

#include <memory>

#include "pagedattn/backend.h"

namespace pagedattn::cpu {

/// Environment variable holding the registered backend's thread count (the option `threads`).
inline constexpr const char* kThreadsEnvVar = "PAGEDATTN_CPU_THREADS";

/// The cpu backend's options (set by name through Registry::configure, "threads=8").
struct BackendOptions {
  /// Threads the plan spreads a step's work over, KV splits included, and the step runs on (the
  /// caller and a process-wide pool: cpu/thread_pool.h), up to OpenMP's thread count
  /// (OMP_NUM_THREADS, else the CPUs this process may use; 0: that many). Tests plan for more
  /// threads than they run, so the split and merge paths run on any machine.
  int threads = 0;
  /// Microseconds an idle pool thread spins for the next loop, or the caller for a loop's end,
  /// before it sleeps (0: at once). Short: long spins take the cores of a busy machine's other
  /// processes (OpenMP's default barriers made a run beside four busy processes 8x slower).
  int spin_us = 50;
};

/// The defaults with the thread count from PAGEDATTN_CPU_THREADS (throws InvalidArgument naming
/// the variable for a bad value).
BackendOptions backend_options_from_env();

std::unique_ptr<Backend> make_backend(const BackendOptions& options = backend_options_from_env());

}  // namespace pagedattn::cpu
