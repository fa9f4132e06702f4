#include "core/head_pad.h"

#include <exception>

#include "pagedattn/error.h"

namespace pagedattn::detail {

HeadPad::HeadPad(int head_size, int padded_head_size, DType dtype, Device device)
    : head_size_(head_size), padded_(padded_head_size), dtype_(dtype), device_(device) {}

TensorView HeadPad::scratch(Slot slot, int64_t n, int64_t heads, Stream stream) {
  Tensor& t = scratch_[slot];
  const int64_t elems = n * heads * padded_;
  if (!t.defined() || t.view().numel() < elems) {
    // The columns past head_size are never written after this: they stay zero.
    t = Tensor::empty({elems}, dtype_, device_);
    require_device(device_).memset_async(t.data(), 0, t.view().nbytes(), device_.index, stream);
  }
  TensorView v = t.view();
  v.ndim = 3;
  v.shape = {n, heads, padded_, 0, 0, 0};
  v.strides = {heads * padded_, padded_, 1, 0, 0, 0};
  return v;
}

TensorView HeadPad::pad(Slot slot, const TensorView& rows, Stream stream) {
  require(rows.ndim == 3 && rows.size(2) == head_size_ && rows.stride(2) == 1,
          "head padding: ", describe(rows), " is not [n, heads, ", head_size_,
          "] with contiguous rows");
  const TensorView dst = scratch(slot, rows.size(0), rows.size(1), stream);
  const size_t e = dtype_size(dtype_);
  DeviceRuntime& rt = require_device(device_);
  for (int64_t h = 0; h < rows.size(1); ++h) {
    rt.copy_2d_async(static_cast<char*>(dst.data) + h * padded_ * e, size_t(dst.stride(0)) * e,
                     static_cast<const char*>(rows.data) + h * rows.stride(1) * e,
                     size_t(rows.stride(0)) * e, size_t(head_size_) * e, size_t(rows.size(0)),
                     device_.index, stream);
  }
  return dst;
}

void HeadPad::unpad(const TensorView& padded, const TensorView& out, Stream stream) const {
  require(out.ndim == 3 && out.size(2) == head_size_ && out.stride(2) == 1,
          "head padding: ", describe(out), " is not [n, heads, ", head_size_,
          "] with contiguous rows");
  const size_t e = dtype_size(dtype_);
  DeviceRuntime& rt = require_device(device_);
  for (int64_t h = 0; h < out.size(1); ++h) {
    rt.copy_2d_async(static_cast<char*>(out.data) + h * out.stride(1) * e,
                     size_t(out.stride(0)) * e,
                     static_cast<const char*>(padded.data) + h * padded.stride(1) * e,
                     size_t(padded.stride(0)) * e, size_t(head_size_) * e, size_t(out.size(0)),
                     device_.index, stream);
  }
}

PaddedSelection select_padded(const Registry& registry, const AttentionConfig& config,
                              Device device, const std::optional<std::string>& override_name) {
  PaddedSelection out;
  out.run_config = config;
  try {
    out.backend = &registry.select(BackendQuery{config, device}, override_name);
    return out;
  } catch (const NotSupported&) {
    const std::exception_ptr refused = std::current_exception();
    AttentionConfig padded = config;
    padded.head_size = head_size_step_8(config.head_size);
    if (padded.head_size == config.head_size || config.head_size_v() != config.head_size) {
      std::rethrow_exception(refused);
    }
    try {
      out.backend = &registry.select(BackendQuery{padded, device}, override_name);
    } catch (const NotSupported&) {
      std::rethrow_exception(refused);
    }
    out.run_config = padded;
    out.pad = std::make_unique<HeadPad>(config.head_size, padded.head_size, config.dtype, device);
    return out;
  }
}

}  // namespace pagedattn::detail
