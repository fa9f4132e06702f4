// The CUDA implementation of pagedattn::DeviceRuntime (host-side; no kernels).
#pragma once

#include "pagedattn/device.h"

namespace pagedattn::cuda {

/// The process-wide CUDA runtime object, registered by the built-in registration.
DeviceRuntime& runtime();

}  // namespace pagedattn::cuda
