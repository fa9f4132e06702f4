// Properties of a CUDA device that planning and launches read, queried once per device.
#pragma once

#include <string>

namespace pagedattn::cuda {

struct DeviceProps {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int num_sms = 0;
  int max_smem_per_cta = 0;  ///< opt-in dynamic shared memory limit, bytes
  int l2_bytes = 0;
};

/// Number of visible CUDA devices (0 when there is no driver or device; never throws).
int visible_device_count();
/// The properties of `device` (cached after the first call). Throws pagedattn::Error when the
/// device cannot be queried.
const DeviceProps& device_props(int device);
/// The current device of the calling thread.
int current_device();

/// Makes `index` the current device for a scope and restores the previous one after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int index);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
  int index_ = 0;
};

}  // namespace pagedattn::cuda
