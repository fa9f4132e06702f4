// MLAAttention's device-resident state: the absorbed weights on the layer's CUDA device,
// uploaded by the first forward on device tensors (mla_device.cpp).
#pragma once

#include "pagedattn/tensor.h"

namespace pagedattn::detail {

struct MLADeviceWeights {
  Tensor w_uk_t;  // float32 [N, P, L] (the absorbed query's layout)
  Tensor w_uk;    // float32 [N, L, P] (the prefill formulation's K expansion)
  Tensor w_uv;    // float32 [N, L, V]
};

}  // namespace pagedattn::detail
