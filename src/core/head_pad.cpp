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

namespace {

// The first `cols` elements of every (row, head) of src [n, heads, *] into dst [n, heads, *]:
// one 2-D copy of n * heads rows where both views' heads are evenly strided across rows, else
// one per head.
void copy_heads(const TensorView& dst, const TensorView& src, int cols, Device device,
                Stream stream) {
  const size_t e = dtype_size(src.dtype);
  DeviceRuntime& rt = require_device(device);
  auto flat = [](const TensorView& v) { return v.stride(0) == v.size(1) * v.stride(1); };
  if (flat(dst) && flat(src)) {
    rt.copy_2d_async(dst.data, size_t(dst.stride(1)) * e, src.data, size_t(src.stride(1)) * e,
                     size_t(cols) * e, size_t(src.size(0) * src.size(1)), device.index, stream);
    return;
  }
  for (int64_t h = 0; h < src.size(1); ++h) {
    rt.copy_2d_async(
        static_cast<char*>(dst.data) + h * dst.stride(1) * e, size_t(dst.stride(0)) * e,
        static_cast<const char*>(src.data) + h * src.stride(1) * e, size_t(src.stride(0)) * e,
        size_t(cols) * e, size_t(src.size(0)), device.index, stream);
  }
}

}  // namespace

TensorView HeadPad::pad(Slot slot, const TensorView& rows, Stream stream) {
  require(rows.ndim == 3 && rows.size(2) == head_size_ && rows.stride(2) == 1,
          "head padding: ", describe(rows), " is not [n, heads, ", head_size_,
          "] with contiguous rows");
  const TensorView dst = scratch(slot, rows.size(0), rows.size(1), stream);
  copy_heads(dst, rows, head_size_, device_, stream);
  return dst;
}

void HeadPad::unpad(const TensorView& padded, const TensorView& out, Stream stream) const {
  require(out.ndim == 3 && out.size(2) == head_size_ && out.stride(2) == 1,
          "head padding: ", describe(out), " is not [n, heads, ", head_size_,
          "] with contiguous rows");
  copy_heads(out, padded, head_size_, device_, stream);
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
    if (config.head_size_v() != config.head_size) std::rethrow_exception(refused);
    // The next multiple of 8, then of 16 (fp8 caches' 16-byte rows): the first one taken.
    const int d = config.head_size;
    for (const int width : {head_size_step_8(d), (d + 15) / 16 * 16}) {
      if (width == d) continue;
      AttentionConfig padded = config;
      padded.head_size = width;
      try {
        out.backend = &registry.select(BackendQuery{padded, device}, override_name);
      } catch (const NotSupported&) {
        continue;
      }
      out.run_config = padded;
      out.pad = std::make_unique<HeadPad>(d, width, config.dtype, device);
      return out;
    }
    std::rethrow_exception(refused);
  }
}

}  // namespace pagedattn::detail
