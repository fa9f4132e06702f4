// The CUDA DeviceRuntime: device memory and copies for owning tensors and caches.
#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/runtime.h"

namespace pagedattn::cuda {
namespace {

// Makes `index` current for the duration of a call, restoring the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    PAGEDATTN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) PAGEDATTN_CUDA_CHECK(cudaSetDevice(index));
    index_ = index;
  }
  ~DeviceGuard() {
    if (previous_ != index_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int index_ = 0;
};

cudaMemcpyKind copy_kind(Device dst, Device src) {
  if (dst.is_cuda() && src.is_cuda()) return cudaMemcpyDeviceToDevice;
  if (dst.is_cuda()) return cudaMemcpyHostToDevice;
  if (src.is_cuda()) return cudaMemcpyDeviceToHost;
  return cudaMemcpyHostToHost;
}

class CudaRuntime final : public DeviceRuntime {
 public:
  int device_count() const override {
    int n = 0;
    // No driver or no device is not an error here: the build simply has nothing to run on.
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }
  void* allocate(size_t bytes, int index) override {
    DeviceGuard guard(index);
    void* p = nullptr;
    PAGEDATTN_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
    return p;
  }
  void deallocate(void* ptr, int index) override {
    DeviceGuard guard(index);
    cudaFree(ptr);
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            size_t bytes) override {
    if (bytes == 0) return;
    DeviceGuard guard(dst_device.is_cuda() ? dst_device.index : src_device.index);
    PAGEDATTN_CUDA_CHECK(cudaMemcpy(dst, src, bytes, copy_kind(dst_device, src_device)));
  }
  void memset(void* dst, int byte, size_t bytes, int index) override {
    if (bytes == 0) return;
    DeviceGuard guard(index);
    PAGEDATTN_CUDA_CHECK(cudaMemset(dst, byte, bytes));
  }
  void memset_async(void* dst, int byte, size_t bytes, int index, Stream stream) override {
    if (bytes == 0) return;
    DeviceGuard guard(index);
    PAGEDATTN_CUDA_CHECK(
        cudaMemsetAsync(dst, byte, bytes, static_cast<cudaStream_t>(stream.handle)));
  }
  void copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, int index, Stream stream) override {
    if (rows == 0 || row_bytes == 0) return;
    DeviceGuard guard(index);
    const auto s = static_cast<cudaStream_t>(stream.handle);
    if (rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes)) {
      PAGEDATTN_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, rows * row_bytes, cudaMemcpyDeviceToDevice, s));
    } else {
      PAGEDATTN_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                             cudaMemcpyDeviceToDevice, s));
    }
  }
  void synchronize(int index) override {
    DeviceGuard guard(index);
    PAGEDATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void synchronize_stream(int index, Stream stream) override {
    DeviceGuard guard(index);
    PAGEDATTN_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  }
};

}  // namespace

DeviceRuntime& runtime() {
  static CudaRuntime instance;
  return instance;
}

}  // namespace pagedattn::cuda
