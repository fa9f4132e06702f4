#include "pagedattn/dlpack.h"

#include <array>
#include <limits>
#include <string>
#include <utility>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {

std::string describe_dl_dtype(DLDataType dtype) {
  const char* code = "unknown";
  switch (dtype.code) {
    case kDLInt:
      code = "int";
      break;
    case kDLUInt:
      code = "uint";
      break;
    case kDLFloat:
      code = "float";
      break;
    case kDLOpaqueHandle:
      code = "opaque handle";
      break;
    case kDLBfloat:
      code = "bfloat";
      break;
    case kDLComplex:
      code = "complex";
      break;
    default:
      break;
  }
  return cat("(code ", int(dtype.code), " = ", code, ", bits ", int(dtype.bits), ", lanes ",
             dtype.lanes, ")");
}

// Owns the shape and strides arrays the DLTensor points at, and whatever keeps the memory
// alive. `managed` is handed out; its manager_ctx points back at this object.
struct ManagerContext {
  DLManagedTensor managed{};
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  std::shared_ptr<void> keep_alive;
};

void delete_manager_context(DLManagedTensor* self) {
  if (self) delete static_cast<ManagerContext*>(self->manager_ctx);
}

}  // namespace

DLDataType to_dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {kDLFloat, 32, 1};
    case DType::kF16:
      return {kDLFloat, 16, 1};
    case DType::kBF16:
      return {kDLBfloat, 16, 1};
    case DType::kF64:
      return {kDLFloat, 64, 1};
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:  // no fp8 codes in DLPack 0.6: bytes, as vLLM stores fp8 caches
    case DType::kU8:
      return {kDLUInt, 8, 1};
    case DType::kI32:
      return {kDLInt, 32, 1};
    case DType::kI64:
      return {kDLInt, 64, 1};
  }
  detail::fail("to_dlpack_dtype: unknown DType value ", int(dtype));
}

DType dtype_from_dlpack(DLDataType dtype) {
  require(dtype.lanes == 1, "from_dlpack: DLPack dtype ", describe_dl_dtype(dtype), " has lanes ",
          dtype.lanes, "; only lanes 1 (scalar elements) is supported");
  const int bits = dtype.bits;
  switch (dtype.code) {
    case kDLFloat:
      if (bits == 16) return DType::kF16;
      if (bits == 32) return DType::kF32;
      if (bits == 64) return DType::kF64;
      break;
    case kDLBfloat:
      if (bits == 16) return DType::kBF16;
      break;
    case kDLInt:
      if (bits == 32) return DType::kI32;
      if (bits == 64) return DType::kI64;
      break;
    case kDLUInt:
      if (bits == 8) return DType::kU8;
      break;
    default:
      break;
  }
  detail::fail("from_dlpack: DLPack dtype ", describe_dl_dtype(dtype),
               " is not supported; supported: float 16/32/64, bfloat 16, int 32/64, uint 8");
}

DLDevice to_dlpack_device(Device device) {
  switch (device.type) {
    case DeviceType::kCPU:
      return {kDLCPU, 0};
    case DeviceType::kCUDA:
      return {kDLCUDA, device.index};
  }
  detail::fail("to_dlpack: unknown device type ", int(device.type));
}

Device device_from_dlpack(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: the host reads it like any other
      return Device::cpu();
    case kDLCUDA:
      require(device.device_id >= 0, "from_dlpack: CUDA device_id (", device.device_id,
              ") must be >= 0");
      return Device::cuda(device.device_id);
    default:
      break;
  }
  detail::fail("from_dlpack: DLPack device_type ", int(device.device_type),
               " is not supported; supported: 1 (CPU), 2 (CUDA), 3 (CUDA host)");
}

TensorView from_dlpack(const DLTensor& tensor) {
  require(tensor.ndim >= 0 && tensor.ndim <= kMaxDims, "from_dlpack: ndim (", tensor.ndim,
          ") must be in [0, ", kMaxDims, "]");
  TensorView v;
  v.dtype = dtype_from_dlpack(tensor.dtype);
  v.device = device_from_dlpack(tensor.device);
  if (tensor.ndim == 0) {  // a scalar: one element, seen as shape [1]
    v.ndim = 1;
    v.shape[0] = 1;
    v.strides[0] = 1;
  } else {
    require(tensor.shape != nullptr, "from_dlpack: shape is NULL for ndim ", tensor.ndim);
    v.ndim = tensor.ndim;
    int64_t elements = 1;  // every later size product (numel, nbytes, strides) stays in int64
    for (int d = 0; d < v.ndim; ++d) {
      require(tensor.shape[d] >= 0, "from_dlpack: shape[", d, "] (", tensor.shape[d],
              ") must be >= 0");
      v.shape[size_t(d)] = tensor.shape[d];
      require(!__builtin_mul_overflow(elements, tensor.shape[d], &elements),
              "from_dlpack: the shape's element count overflows int64 at shape[", d, "] (",
              tensor.shape[d], ")");
    }
    require(elements <= std::numeric_limits<int64_t>::max() / int64_t(dtype_size(v.dtype)),
            "from_dlpack: ", elements, " elements of ", dtype_size(v.dtype),
            " bytes overflow int64 bytes");
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.strides[size_t(d)] = tensor.strides ? tensor.strides[d] : stride;
      stride *= v.shape[size_t(d)];
    }
  }
  require(tensor.data != nullptr || v.numel() == 0, "from_dlpack: data is NULL for a tensor of ",
          v.numel(), " elements");
  v.data = tensor.data ? static_cast<char*>(tensor.data) + tensor.byte_offset : nullptr;
  return v;
}

DLManagedTensor* to_dlpack_view(const TensorView& view, std::shared_ptr<void> keep_alive) {
  require(view.defined(), "to_dlpack: the view is undefined (ndim ", view.ndim, ")");
  require(view.ndim <= kMaxDims, "to_dlpack: ndim (", view.ndim, ") exceeds ", kMaxDims);
  auto ctx = std::make_unique<ManagerContext>();
  ctx->shape = view.shape;
  ctx->strides = view.strides;
  ctx->keep_alive = std::move(keep_alive);
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = view.data;
  t.device = to_dlpack_device(view.device);
  t.ndim = view.ndim;
  t.dtype = to_dlpack_dtype(view.dtype);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = delete_manager_context;
  return &ctx.release()->managed;
}

DLManagedTensor* to_dlpack(const Tensor& tensor) {
  require(tensor.defined(), "to_dlpack: the tensor is undefined (no storage)");
  // Copying the Tensor copies its shared storage handle: the memory lives until the deleter.
  return to_dlpack_view(tensor.view(), std::make_shared<Tensor>(tensor));
}

}  // namespace pagedattn
