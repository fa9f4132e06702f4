// The machine's memory read bandwidth, for comparison with the KV bytes attention reads.
#pragma once

#include <cstddef>
#include <optional>

#include "pagedattn/device.h"

namespace pagedattn::sim {

/// Best of `passes` streaming reads over a buffer of `bytes` (much larger than the caches),
/// split over `threads` threads (0 = every hardware thread). Bytes per second, or nullopt
/// when the buffer cannot be allocated.
std::optional<double> measure_read_bandwidth(size_t bytes, int passes = 4, int threads = 0);

/// Best of `passes` device-to-device copies of `bytes` on `device`: the bytes read per second
/// (the copy also writes as many). nullopt when the buffers cannot be allocated.
std::optional<double> measure_device_copy_bandwidth(Device device, size_t bytes, int passes = 4);

}  // namespace pagedattn::sim
