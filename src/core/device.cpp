#include "pagedattn/device.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "pagedattn/error.h"

namespace pagedattn {

void ensure_builtins_registered();  // src/builtin/builtin.cpp

std::string to_string(Device device) {
  switch (device.type) {
    case DeviceType::kCPU:
      return "cpu";
    case DeviceType::kCUDA:
      return "cuda:" + std::to_string(device.index);
  }
  return "device(" + std::to_string(int(device.type)) + ")";
}

namespace {

class CpuRuntime final : public DeviceRuntime {
  static constexpr size_t kHugePage = size_t(2) << 20;
  static constexpr size_t kHugeThreshold = size_t(4) << 20;

 public:
  int device_count() const override { return 1; }
  void* allocate(size_t bytes, int) override {
    // 64-byte alignment covers every SIMD width the CPU backend uses. Large buffers (KV
    // caches) are 2 MiB aligned and asked to use transparent huge pages: attention walks
    // shuffled blocks, and with 4 KiB pages nearly every block would miss the TLB.
    const bool huge = bytes >= kHugeThreshold;
    const size_t align = huge ? kHugePage : 64;
    const size_t rounded = std::max<size_t>((bytes + align - 1) / align * align, align);
    void* p = std::aligned_alloc(align, rounded);
    if (!p) detail::fail<Error>("cpu: cannot allocate ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
    if (huge) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    return p;
  }
  void deallocate(void* ptr, int) override {
    std::free(ptr);
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            size_t bytes) override {
    detail::require(dst_device.is_cpu() && src_device.is_cpu(), "cpu runtime: cannot copy from ",
                    to_string(src_device), " to ", to_string(dst_device));
    if (bytes) std::memmove(dst, src, bytes);
  }
  void memset(void* dst, int byte, size_t bytes, int) override {
    if (bytes) std::memset(dst, byte, bytes);
  }
  void memset_async(void* dst, int byte, size_t bytes, int, Stream) override {
    if (bytes) std::memset(dst, byte, bytes);
  }
  void copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, int, Stream) override {
    for (size_t i = 0; i < rows && row_bytes > 0; ++i) {
      std::memcpy(static_cast<char*>(dst) + i * dst_pitch,
                  static_cast<const char*>(src) + i * src_pitch, row_bytes);
    }
  }
  void synchronize(int) override {}
  void synchronize_stream(int, Stream) override {}
};

CpuRuntime g_cpu_runtime;
std::atomic<DeviceRuntime*> g_cuda_runtime{nullptr};

}  // namespace

namespace detail {
void set_device_runtime(DeviceType type, DeviceRuntime* runtime) {
  require(type == DeviceType::kCUDA, "set_device_runtime: only the CUDA runtime is replaceable");
  g_cuda_runtime.store(runtime);
}
}  // namespace detail

DeviceRuntime* device_runtime(DeviceType type) {
  ensure_builtins_registered();
  switch (type) {
    case DeviceType::kCPU:
      return &g_cpu_runtime;
    case DeviceType::kCUDA:
      return g_cuda_runtime.load();
  }
  return nullptr;
}

DeviceRuntime& require_device(Device device) {
  DeviceRuntime* rt = device_runtime(device.type);
  if (!rt) {
    detail::fail<NotSupported>("device ", to_string(device),
                               ": this build of pagedattn has no runtime for it (built without "
                               "CUDA?)");
  }
  const int count = rt->device_count();
  detail::require<NotSupported>(device.index >= 0 && device.index < count, "device ",
                                to_string(device), ": index out of range [0, ", count, ")");
  return *rt;
}

}  // namespace pagedattn
