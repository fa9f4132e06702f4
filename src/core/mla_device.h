// MLAAttention's device-resident state: the absorbed weights on the layer's device, uploaded by
// the first forward on device tensors (mla_device.cpp), and the backend's kernels around the
// attention there.
#pragma once

#include "pagedattn/backend.h"
#include "pagedattn/mla_device_ops.h"
#include "pagedattn/tensor.h"

namespace pagedattn::detail {

struct MLADeviceWeights {
  Tensor w_uk_t;  // float32 [N, P, L] (the absorbed query's layout)
  Tensor w_uk;    // float32 [N, L, P] (the prefill formulation's K expansion)
  Tensor w_uv;    // float32 [N, L, V]
};

/// `backend`'s MLADeviceOps for a forward on device tensors (q among them); throws NotSupported
/// naming the backend and q when it has none.
const MLADeviceOps& mla_device_ops_for(const Backend& backend, const TensorView& q);

}  // namespace pagedattn::detail
