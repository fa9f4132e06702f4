// TMA tensor maps for the kernels' bulk tensor copies, encoded on the host through the driver's
// cuTensorMapEncodeTiled, reached via the runtime's driver entry point (the library links the
// static runtime only, never libcuda directly).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pagedattn::cuda {

/// A tiled map over a `rank`-D tensor (2 to 5) of 16-bit elements (bf16 when `bf16`, else f16):
/// dims[0] (contiguous) .. dims[rank - 1] elements, `strides` the byte strides of dims 1 ..
/// rank - 1 (multiples of 16), boxes of box[0] x .. x box[rank - 1] elements landing 128-byte
/// swizzled (box[0] * 2 must be 128). False, with a reason in `*why`, when the driver refuses
/// or has no entry point: the caller then keeps its cp.async path.
bool encode_tiled_sw128(CUtensorMap* map, const void* base, bool bf16, int rank,
                        const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                        const char** why);

}  // namespace pagedattn::cuda
