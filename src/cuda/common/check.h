// Error checking for CUDA runtime calls: every failure becomes a pagedattn::Error that names
// the call, the CUDA error and where it happened.
#pragma once

#include <cuda_runtime.h>

#include "pagedattn/error.h"

#define PAGEDATTN_CUDA_CHECK(call)                                                               \
  do {                                                                                           \
    const cudaError_t pagedattn_err_ = (call);                                                   \
    if (pagedattn_err_ != cudaSuccess) {                                                         \
      ::pagedattn::detail::fail<::pagedattn::Error>(                                             \
          #call, " failed: ", cudaGetErrorString(pagedattn_err_), " (", __FILE__, ":", __LINE__, \
          ")");                                                                                  \
    }                                                                                            \
  } while (0)

/// After a kernel launch: reports launch-configuration errors without synchronising.
#define PAGEDATTN_CUDA_CHECK_LAUNCH() PAGEDATTN_CUDA_CHECK(cudaGetLastError())
