#include "pagedattn/tensor.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {
template <class Shape>
TensorView make_contiguous(void* data, DType dtype, const Shape& shape, Device device) {
  require(int(shape.size()) <= kMaxDims, "tensor rank ", shape.size(), " exceeds ", kMaxDims);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) {
    require(s >= 0, "tensor dimension ", i, " has negative size ", s);
    v.shape[size_t(i++)] = s;
  }
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[size_t(d)] = stride;
    stride *= v.shape[size_t(d)];
  }
  return v;
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape, device);
}
TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape, device);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[size_t(d)];
  return ndim == 0 ? 0 : n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[size_t(d)] != 1 && strides[size_t(d)] != stride) return false;
    stride *= shape[size_t(d)];
  }
  return true;
}

void* TensorView::element_ptr(std::initializer_list<int64_t> index) const {
  require(int(index.size()) == ndim, "element_ptr: ", index.size(), " indices for a rank-", ndim,
          " tensor");
  int64_t offset = 0;
  int d = 0;
  for (int64_t i : index) offset += i * strides[size_t(d++)];
  return static_cast<char*>(data) + offset * int64_t(dtype_size(dtype));
}

TensorView TensorView::select(int dim, int64_t index) const {
  require(dim >= 0 && dim < ndim, "select: dim ", dim, " out of range for rank ", ndim);
  require(index >= 0 && index < shape[size_t(dim)], "select: index ", index, " out of range [0, ",
          shape[size_t(dim)], ")");
  TensorView v = *this;
  v.data = static_cast<char*>(data) + index * strides[size_t(dim)] * int64_t(dtype_size(dtype));
  for (int d = dim; d < ndim - 1; ++d) {
    v.shape[size_t(d)] = shape[size_t(d) + 1];
    v.strides[size_t(d)] = strides[size_t(d) + 1];
  }
  v.ndim = ndim - 1;
  return v;
}

TensorView TensorView::slice(int dim, int64_t begin, int64_t end) const {
  require(dim >= 0 && dim < ndim, "slice: dim ", dim, " out of range for rank ", ndim);
  require(0 <= begin && begin <= end && end <= shape[size_t(dim)], "slice: [", begin, ", ", end,
          ") out of range [0, ", shape[size_t(dim)], "]");
  TensorView v = *this;
  if (data) {
    v.data = static_cast<char*>(data) + begin * strides[size_t(dim)] * int64_t(dtype_size(dtype));
  }
  v.shape[size_t(dim)] = end - begin;
  return v;
}

TensorView TensorView::reshape(const std::vector<int64_t>& new_shape) const {
  require(is_contiguous(), "reshape: ", describe(*this), " is not contiguous");
  TensorView v = make_contiguous(data, dtype, new_shape, device);
  require(v.numel() == numel(), "reshape: ", shape_string(*this), " (", numel(),
          " elements) cannot become ", shape_string(v));
  return v;
}
TensorView TensorView::reshape(std::initializer_list<int64_t> new_shape) const {
  return reshape(std::vector<int64_t>(new_shape));
}

TensorView TensorView::permute(std::initializer_list<int> order) const {
  require(int(order.size()) == ndim, "permute: ", order.size(), " axes for rank ", ndim);
  TensorView v = *this;
  std::array<bool, kMaxDims> seen{};
  int i = 0;
  for (int src : order) {
    require(src >= 0 && src < ndim && !seen[size_t(src)], "permute: bad axis ", src);
    seen[size_t(src)] = true;
    v.shape[size_t(i)] = shape[size_t(src)];
    v.strides[size_t(i)] = strides[size_t(src)];
    ++i;
  }
  return v;
}

std::string shape_string(const TensorView& view) {
  std::string s = "[";
  for (int d = 0; d < view.ndim; ++d) {
    if (d) s += ", ";
    s += std::to_string(view.shape[size_t(d)]);
  }
  return s + "]";
}

std::string describe(const TensorView& view) {
  if (!view.defined()) return "<none>";
  std::string s = cat(dtype_name(view.dtype), shape_string(view));
  if (!view.device.is_cpu()) s += cat(" on ", to_string(view.device));
  return s;
}

Tensor Tensor::empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  DeviceRuntime& rt = require_device(device);
  Tensor t;
  t.view_ = TensorView::contiguous(nullptr, dtype, shape, device);
  const size_t bytes = std::max<size_t>(t.view_.nbytes(), 1);
  void* p = rt.allocate(bytes, device.index);
  t.storage_ = std::shared_ptr<void>(p, [&rt, device](void* q) { rt.deallocate(q, device.index); });
  t.view_.data = p;
  return t;
}

Tensor Tensor::zeros(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  require_device(device).memset(t.data(), 0, t.view_.nbytes(), device.index);
  return t;
}

Tensor Tensor::copy_of(const TensorView& src, Device device) {
  Tensor t = empty(src.shape_vector(), src.dtype, device);
  copy_tensor(t.view(), src);
  return t;
}

namespace {
// Visits every index of `shape` in row-major order, calling f(dst_offset, src_offset).
template <class F>
void for_each_index(const TensorView& a, const TensorView& b, F&& f) {
  const int nd = a.ndim;
  std::array<int64_t, kMaxDims> idx{};
  const int64_t n = a.numel();
  for (int64_t k = 0; k < n; ++k) {
    int64_t oa = 0, ob = 0;
    for (int d = 0; d < nd; ++d) {
      oa += idx[size_t(d)] * a.strides[size_t(d)];
      ob += idx[size_t(d)] * b.strides[size_t(d)];
    }
    f(oa, ob);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < a.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
}
}  // namespace

void copy_tensor(const TensorView& dst, const TensorView& src) {
  require(dst.dtype == src.dtype, "copy_tensor: dtype ", dtype_name(src.dtype), " into ",
          dtype_name(dst.dtype));
  require(dst.ndim == src.ndim &&
              std::equal(dst.shape.begin(), dst.shape.begin() + dst.ndim, src.shape.begin()),
          "copy_tensor: shape ", shape_string(src), " into ", shape_string(dst));
  if (dst.numel() == 0) return;
  const size_t es = dtype_size(dst.dtype);
  const bool same_layout =
      std::equal(dst.strides.begin(), dst.strides.begin() + dst.ndim, src.strides.begin());
  if (dst.is_contiguous() && src.is_contiguous() && same_layout) {
    DeviceRuntime& rt = require_device(dst.device.is_cpu() ? src.device : dst.device);
    rt.copy(dst.data, dst.device, src.data, src.device, dst.nbytes());
    return;
  }
  if (dst.device.is_cpu() && src.device.is_cpu()) {
    for_each_index(dst, src, [&](int64_t od, int64_t os) {
      std::memcpy(static_cast<char*>(dst.data) + od * int64_t(es),
                  static_cast<const char*>(src.data) + os * int64_t(es), es);
    });
    return;
  }
  // Strided and off-host: stage through contiguous host copies.
  Tensor host_src = Tensor::empty(src.shape_vector(), src.dtype);
  if (src.device.is_cpu()) {
    copy_tensor(host_src.view(), src);
  } else if (src.is_contiguous()) {
    require_device(src.device)
        .copy(host_src.data(), Device::cpu(), src.data, src.device, src.nbytes());
  } else {
    // The bytes the view spans (a column of a wider table, a transposed matrix), then a
    // strided copy on the host.
    int64_t last = 0;
    for (int d = 0; d < src.ndim; ++d) {
      require(src.stride(d) >= 0, "copy_tensor: negative stride ", src.stride(d), " of ",
              describe(src), " is not supported");
      last += (src.size(d) - 1) * src.stride(d);
    }
    Tensor span = Tensor::empty({last + 1}, src.dtype);
    require_device(src.device)
        .copy(span.data(), Device::cpu(), src.data, src.device, size_t(last + 1) * es);
    TensorView on_host = src;
    on_host.data = span.data();
    on_host.device = Device::cpu();
    copy_tensor(host_src.view(), on_host);
  }
  if (dst.device.is_cpu()) {
    copy_tensor(dst, host_src.view());
    return;
  }
  require(dst.is_contiguous(), "copy_tensor: strided destination on ", to_string(dst.device),
          " is not supported");
  require_device(dst.device)
      .copy(dst.data, dst.device, host_src.data(), Device::cpu(), dst.nbytes());
}

void fill_host(const TensorView& dst, double value) {
  require(dst.device.is_cpu(), "fill_host: ", describe(dst), " is not on the CPU");
  TensorView flat = dst;
  for_each_index(flat, flat,
                 [&](int64_t o, int64_t) { store_element(dst.data, dst.dtype, o, value); });
}

}  // namespace pagedattn
