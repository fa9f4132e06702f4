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

/// Whether this build holds the Hopper code (sm_90a: the wgmma prefill and MLA kernels, and the
/// bulk-copy and TMA paths of the others): PAGEDATTN_CUDA_ARCHS lists 90a.
bool hopper_code_compiled();
/// Whether the Hopper code runs on a device of compute capability `cc_major`.`cc_minor`: compiled
/// and 9.0 (sm_90a code runs on 9.0 alone; Blackwell and later load the portable kernels' PTX).
constexpr bool runs_hopper_code(int cc_major, int cc_minor, bool compiled) {
  return compiled && cc_major == 9 && cc_minor == 0;
}
/// Compute capability the portable kernels need (mma.sync bf16, cp.async, ldmatrix: Ampere).
inline constexpr int kMinCcMajor = 8;

/// Number of visible CUDA devices (0 when there is no driver or device; never throws).
int visible_device_count();
/// The properties of `device` (cached after the first call). Throws pagedattn::Error when the
/// device cannot be queried.
const DeviceProps& device_props(int device);
/// The current device of the calling thread.
int current_device();
/// Whether `kernel`, as loaded on the current device, was compiled from sm_90-or-later code
/// (cudaFuncAttributes::ptxVersion >= 90), so that it runs the griddepcontrol pair (which
/// compiles out below sm_90): programmatic dependent launch is safe for it only then. Cached
/// per kernel and device.
bool kernel_has_pdl(const void* kernel);

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
