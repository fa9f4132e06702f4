#include "cuda/common/device_props.h"

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "cuda/common/check.h"

namespace pagedattn::cuda {

bool hopper_code_compiled() {
#if PAGEDATTN_CUDA_HOPPER
  return true;
#else
  return false;
#endif
}

int visible_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return n;
}

const DeviceProps& device_props(int device) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<DeviceProps>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[device];
  if (!slot) {
    cudaDeviceProp p{};
    PAGEDATTN_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
    auto d = std::make_unique<DeviceProps>();
    d->index = device;
    d->name = p.name;
    d->cc_major = p.major;
    d->cc_minor = p.minor;
    d->num_sms = p.multiProcessorCount;
    d->max_smem_per_cta = int(p.sharedMemPerBlockOptin);
    d->l2_bytes = p.l2CacheSize;
    slot = std::move(d);
  }
  return *slot;
}

int current_device() {
  int d = 0;
  PAGEDATTN_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

ScopedDevice::ScopedDevice(int index) : index_(index) {
  PAGEDATTN_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != index_) PAGEDATTN_CUDA_CHECK(cudaSetDevice(index_));
}

ScopedDevice::~ScopedDevice() {
  if (previous_ != index_) cudaSetDevice(previous_);
}

bool kernel_has_pdl(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> cache;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  cudaFuncAttributes a{};
  PAGEDATTN_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
  return cache[key] = a.ptxVersion >= 90;
}

}  // namespace pagedattn::cuda
