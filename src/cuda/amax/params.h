// Parameters of amax (max |x| for KV-scale calibration): one POD struct, host -> device.
#pragma once

#include <cstdint>

namespace pagedattn::cuda::amax {

inline constexpr int kMaxDims = 6;

/// max |x| over every element of a strided tensor (element (i0..in) at
/// x + sum_k i_k * strides[k]); NaN wins, as in the reference.
struct AmaxParams {
  const void* x;
  int dtype;  ///< pagedattn::DType code: a float type (float64, float32, 16-bit, fp8)
  int ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t numel;
  unsigned int* result;  ///< float bits of the maximum; zeroed by the launch first
};

}  // namespace pagedattn::cuda::amax
