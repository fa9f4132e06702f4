// Explicit registration of the built-in backends and device runtimes: the one place that
// knows every backend (the core sees them only through the Backend interface).
#include <mutex>

#include "pagedattn/registry.h"
#include "ref/ref_backend.h"
#if PAGEDATTN_WITH_CPU_BACKEND
#include "cpu/cpu_backend.h"
#endif
#if PAGEDATTN_WITH_CUDA
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/runtime.h"
#endif

namespace pagedattn {

void ensure_builtins_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
#if PAGEDATTN_WITH_CUDA
    detail::set_device_runtime(DeviceType::kCUDA, &cuda::runtime());
#endif
  });
}

Registry& default_registry() {
  static Registry registry = [] {
    ensure_builtins_registered();
    Registry r;
    // Priority order: the first backend whose check() passes serves a layer.
#if PAGEDATTN_WITH_CUDA
    r.add(cuda::make_backend());  // CUDA tensors only; the others refuse them
#endif
#if PAGEDATTN_WITH_CPU_BACKEND
    r.add(cpu::make_backend());
#endif
    r.add(ref::make_backend(ref::Precision::kFloat64));
    return r;
  }();
  return registry;
}

}  // namespace pagedattn
