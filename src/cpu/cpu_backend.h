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
  /// Threads the plan spreads a step's work over, KV splits included (0: OpenMP's thread
  /// count). The kernels run on OpenMP's threads (OMP_NUM_THREADS): tests plan for more threads
  /// than they run, so the split and merge paths run on any machine.
  int threads = 0;
};

/// The defaults with the thread count from PAGEDATTN_CPU_THREADS (throws InvalidArgument naming
/// the variable for a bad value).
BackendOptions backend_options_from_env();

std::unique_ptr<Backend> make_backend(const BackendOptions& options = backend_options_from_env());

}  // namespace pagedattn::cpu
