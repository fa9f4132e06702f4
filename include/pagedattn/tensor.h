// Non-owning strided tensor views and a small owning tensor on top of them.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/device.h"
#include "pagedattn/dtype.h"

namespace pagedattn {

inline constexpr int kMaxDims = 6;

/// A non-owning view: pointer, element type, shape and strides (in elements, as in DLPack and
/// PyTorch), and the device that owns the memory. Kernels take strides, so one storage can be
/// seen in several layouts (NHD and HND KV caches are two views of the same bytes).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  Device device{};

  /// A view with contiguous (row-major) strides.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = {});

  /// False for a default-constructed view (an absent optional input).
  bool defined() const { return ndim > 0; }
  int64_t size(int dim) const { return shape[size_t(dim)]; }
  int64_t stride(int dim) const { return strides[size_t(dim)]; }
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  std::vector<int64_t> shape_vector() const { return {shape.begin(), shape.begin() + ndim}; }

  template <class T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
  /// Address of the element at `index` (ndim entries).
  void* element_ptr(std::initializer_list<int64_t> index) const;

  /// The sub-view with dimension `dim` fixed at `index` (one fewer dimension).
  TensorView select(int dim, int64_t index) const;
  /// Rows [begin, end) of dimension `dim`.
  TensorView slice(int dim, int64_t begin, int64_t end) const;
  /// Reinterprets a contiguous view with a new shape of the same element count.
  TensorView reshape(std::initializer_list<int64_t> new_shape) const;
  TensorView reshape(const std::vector<int64_t>& new_shape) const;
  /// Reorders dimensions: result dim i is source dim order[i].
  TensorView permute(std::initializer_list<int> order) const;
};

/// "float32[4, 8, 64]" for messages.
std::string describe(const TensorView& view);
/// "[4, 8, 64]".
std::string shape_string(const TensorView& view);

/// An owning tensor: shared storage plus a view into it.
class Tensor {
 public:
  Tensor() = default;
  /// Uninitialised memory on `device`.
  static Tensor empty(const std::vector<int64_t>& shape, DType dtype, Device device = {});
  /// Zero-filled memory on `device`.
  static Tensor zeros(const std::vector<int64_t>& shape, DType dtype, Device device = {});
  /// A contiguous copy of `src` on `device` (any source strides).
  static Tensor copy_of(const TensorView& src, Device device);

  const TensorView& view() const { return view_; }
  TensorView& view() { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a tensor is usable as a view
  void* data() const { return view_.data; }
  template <class T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  bool defined() const { return storage_ != nullptr; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

/// Copies `src` into `dst` element by element (same shape and dtype, any strides, any devices
/// the runtimes can reach). Strided device copies go through the host.
void copy_tensor(const TensorView& dst, const TensorView& src);

/// Fills a CPU view with `value` converted to its dtype.
void fill_host(const TensorView& dst, double value);

}  // namespace pagedattn
