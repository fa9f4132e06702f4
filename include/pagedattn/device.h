// Devices, streams and the per-device runtime (allocation and copies) behind owning tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pagedattn {

/// Where memory lives. Values match DLPack's DLDeviceType.
enum class DeviceType : int32_t { kCPU = 1, kCUDA = 2 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device&, const Device&) = default;
};

/// "cpu" or "cuda:N".
std::string to_string(Device device);

/// A device work queue: a cudaStream_t for CUDA (nullptr = the legacy default stream); unused
/// on the CPU.
struct Stream {
  void* handle = nullptr;
};

/// Memory services of one device type. The CPU runtime is always present; the CUDA runtime
/// exists when the library was built with CUDA.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  /// Number of devices of this type visible to the process (0 when there is no driver).
  virtual int device_count() const = 0;
  /// Allocates `bytes` (aligned to at least 256 bytes); throws pagedattn::Error on failure.
  virtual void* allocate(size_t bytes, int index) = 0;
  virtual void deallocate(void* ptr, int index) = 0;
  /// Copies between this device and the host or within this device, synchronously.
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device,
                    size_t bytes) = 0;
  virtual void memset(void* dst, int byte, size_t bytes, int index) = 0;
  /// memset ordered on `stream` of device `index` without synchronising the host (capturable in
  /// a CUDA graph); the CPU runtime sets the bytes at once.
  virtual void memset_async(void* dst, int byte, size_t bytes, int index, Stream stream) = 0;
  /// Copies `rows` rows of `row_bytes` each within device `index`: row i from
  /// src + i * src_pitch to dst + i * dst_pitch (pitches >= row_bytes when rows > 1). Ordered on
  /// `stream` without synchronising the host, so it can be captured in a CUDA graph; the CPU
  /// runtime copies at once. The rows must not overlap.
  virtual void copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                             size_t row_bytes, size_t rows, int index, Stream stream) = 0;
  /// Waits for everything on device `index`.
  virtual void synchronize(int index) = 0;
  /// Waits for the work enqueued on `stream` of device `index` (the CPU runtime has none).
  virtual void synchronize_stream(int index, Stream stream) = 0;
};

/// The runtime for a device type, or nullptr when this build has none.
DeviceRuntime* device_runtime(DeviceType type);
/// Like device_runtime(), but throws NotSupported naming the device when it is missing or the
/// index is past the visible devices.
DeviceRuntime& require_device(Device device);

namespace detail {
/// Installs the runtime for a device type (the built-in registration calls this once).
void set_device_runtime(DeviceType type, DeviceRuntime* runtime);
}  // namespace detail

}  // namespace pagedattn
