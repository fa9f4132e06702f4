// DLPack adapter: TensorView / Tensor to and from DLPack 0.6 tensors (zero copy).
//
// Kept out of the umbrella header so that users who do not exchange tensors need not see
// <dlpack/dlpack.h>.
//
// Type mapping (DType <-> DLDataType {code, bits, lanes = 1}):
//   kF16 <-> float 16, kF32 <-> float 32, kF64 <-> float 64, kBF16 <-> bfloat 16,
//   kI32 <-> int 32, kI64 <-> int 64, kU8 <-> uint 8.
//   kFp8E4M3 and kFp8E5M2 are exported as uint 8: DLPack 0.6 has no fp8 codes, and vLLM keeps
//   its fp8 caches as uint8 too. Importing uint 8 always gives kU8; the layer reinterprets a
//   uint8 cache as the configured fp8 cache dtype. So an fp8 round trip returns kU8.
// Device mapping: kDLCPU <-> CPU, kDLCUDA <-> CUDA (device_id = index). kDLCUDAHost (pinned
// host memory) is imported as CPU, since the host reads it directly; export never produces it.
// Other device types (including managed memory) are rejected.
#pragma once

#include <dlpack/dlpack.h>

#include <memory>

#include "pagedattn/tensor.h"

namespace pagedattn {

/// The DLPack data type of `dtype` (fp8 types become uint8).
DLDataType to_dlpack_dtype(DType dtype);
/// The DType of a DLPack data type; throws InvalidArgument naming the code, bits and lanes
/// when it has no DType (lanes != 1, complex, int8, bool, ...).
DType dtype_from_dlpack(DLDataType dtype);
/// The DLPack device of `device`.
DLDevice to_dlpack_device(Device device);
/// The Device of a DLPack device (CUDAHost becomes CPU); throws InvalidArgument naming the
/// device type otherwise.
Device device_from_dlpack(DLDevice device);

/// A view of a DLPack tensor's memory (nothing is copied; the caller keeps the producer's
/// tensor alive while the view is used). byte_offset is folded into the data pointer; NULL
/// strides mean row-major contiguous. A 0-d tensor becomes shape [1] (a TensorView with
/// ndim 0 means "absent"). Throws InvalidArgument for an unsupported dtype or device, ndim
/// past kMaxDims, a negative dimension, or a NULL shape or data pointer with elements.
TensorView from_dlpack(const DLTensor& tensor);

/// Exports `tensor` as a DLPack tensor that shares its memory. The returned tensor holds a
/// copy of the storage handle, so the memory stays valid until the consumer calls
/// `deleter(result)` (exactly once), even if every Tensor is gone. data is the view's
/// pointer with byte_offset 0. Throws InvalidArgument for an undefined tensor.
DLManagedTensor* to_dlpack(const Tensor& tensor);

/// Exports a view. `keep_alive` (may be empty) is held until the consumer calls
/// `deleter(result)` and released then: pass the owner of the memory (for instance
/// std::make_shared<Tensor>(owner) for a slice of `owner`). With an empty `keep_alive` the
/// caller guarantees that the memory outlives the consumer's use of it. Throws
/// InvalidArgument for an undefined view.
DLManagedTensor* to_dlpack_view(const TensorView& view, std::shared_ptr<void> keep_alive = {});

}  // namespace pagedattn
