// DLPack adapter: dtype and device mapping, zero-copy round trips of contiguous and strided
// views, byte_offset, lifetime of exported tensors, and the rejections.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/dlpack.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

using testing::contains;
using testing::error_of;

void expect_same_view(const TensorView& a, const TensorView& b) {
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.device, b.device);
  ASSERT_EQ(a.ndim, b.ndim);
  for (int d = 0; d < a.ndim; ++d) {
    EXPECT_EQ(a.size(d), b.size(d)) << "dim " << d;
    EXPECT_EQ(a.stride(d), b.stride(d)) << "dim " << d;
  }
}

// Runs the deleter when the test scope ends, even on a failed assertion.
struct ManagedDeleter {
  void operator()(DLManagedTensor* m) const {
    if (m && m->deleter) m->deleter(m);
  }
};
using ManagedPtr = std::unique_ptr<DLManagedTensor, ManagedDeleter>;

TEST(DLPack, DtypeMapping) {
  struct Case {
    DType dtype;
    uint8_t code;
    uint8_t bits;
  };
  const Case cases[] = {{DType::kF32, kDLFloat, 32},   {DType::kF16, kDLFloat, 16},
                        {DType::kBF16, kDLBfloat, 16}, {DType::kF64, kDLFloat, 64},
                        {DType::kI32, kDLInt, 32},     {DType::kI64, kDLInt, 64},
                        {DType::kU8, kDLUInt, 8}};
  for (const Case& c : cases) {
    const DLDataType dl = to_dlpack_dtype(c.dtype);
    EXPECT_EQ(dl.code, c.code) << dtype_name(c.dtype);
    EXPECT_EQ(dl.bits, c.bits) << dtype_name(c.dtype);
    EXPECT_EQ(dl.lanes, 1) << dtype_name(c.dtype);
    EXPECT_EQ(dtype_from_dlpack(dl), c.dtype) << dtype_name(c.dtype);
  }
  // fp8 leaves as bytes and comes back as uint8.
  for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const DLDataType dl = to_dlpack_dtype(fp8);
    EXPECT_EQ(dl.code, kDLUInt);
    EXPECT_EQ(dl.bits, 8);
    EXPECT_EQ(dtype_from_dlpack(dl), DType::kU8);
  }
}

TEST(DLPack, DeviceMapping) {
  EXPECT_EQ(to_dlpack_device(Device::cpu()).device_type, kDLCPU);
  const DLDevice cuda = to_dlpack_device(Device::cuda(3));
  EXPECT_EQ(cuda.device_type, kDLCUDA);
  EXPECT_EQ(cuda.device_id, 3);
  EXPECT_EQ(device_from_dlpack({kDLCUDA, 3}), Device::cuda(3));
  EXPECT_EQ(device_from_dlpack({kDLCPU, 0}), Device::cpu());
  EXPECT_EQ(device_from_dlpack({kDLCUDAHost, 0}), Device::cpu());  // pinned host memory
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] {
                         device_from_dlpack({kDLROCM, 0});
                       }),
                       "device_type 10 is not supported"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] {
                         device_from_dlpack({kDLCUDAManaged, 0});
                       }),
                       "device_type 13"));
}

// Every dtype: export a tensor, import it back, and see the same memory and layout.
TEST(DLPack, RoundTripEveryDtype) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kFp8E4M3,
                      DType::kFp8E5M2, DType::kI32, DType::kI64, DType::kU8}) {
    const Tensor t = Tensor::zeros({3, 4, 5}, dtype);  // [3, 4, 5]
    ManagedPtr managed(to_dlpack(t));
    ASSERT_NE(managed, nullptr);
    const DLTensor& dl = managed->dl_tensor;
    EXPECT_EQ(dl.data, t.data());
    EXPECT_EQ(dl.byte_offset, 0u);
    EXPECT_EQ(dl.ndim, 3);
    EXPECT_EQ(dl.shape[0], 3);
    EXPECT_EQ(dl.shape[2], 5);
    EXPECT_EQ(dl.strides[0], 20);
    EXPECT_EQ(dl.strides[2], 1);
    EXPECT_EQ(dl.device.device_type, kDLCPU);
    EXPECT_EQ(int(dl.dtype.bits), int(8 * dtype_size(dtype))) << dtype_name(dtype);

    TensorView back = from_dlpack(dl);
    const DType expected = is_fp8(dtype) ? DType::kU8 : dtype;
    EXPECT_EQ(back.dtype, expected) << dtype_name(dtype);
    back.dtype = dtype;  // the layer reinterprets uint8 as its fp8 cache dtype
    expect_same_view(back, t.view());
  }
}

TEST(DLPack, StridedPermutedAndSlicedViews) {
  // An HND cache seen in the logical NHD order: [num_blocks, block_size, num_kv_heads, D].
  auto owner = std::make_shared<Tensor>(Tensor::zeros({4, 2, 16, 8}, DType::kBF16));
  const TensorView logical = owner->view().permute({0, 2, 1, 3});  // [4, 16, 2, 8]
  const TensorView sliced = logical.slice(0, 1, 3).select(2, 1);   // [2, 16, 8]
  for (const TensorView& view : {logical, sliced}) {
    ManagedPtr managed(to_dlpack_view(view, owner));
    const DLTensor& dl = managed->dl_tensor;
    ASSERT_EQ(dl.ndim, view.ndim);
    for (int d = 0; d < view.ndim; ++d) {
      EXPECT_EQ(dl.shape[d], view.size(d));
      EXPECT_EQ(dl.strides[d], view.stride(d));
    }
    expect_same_view(from_dlpack(dl), view);
  }
  EXPECT_EQ(logical.stride(1), 8);    // token stride inside a head (HND)
  EXPECT_EQ(logical.stride(2), 128);  // head stride
}

TEST(DLPack, ImportAppliesByteOffsetAndNullStrides) {
  std::vector<float> buffer(32);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = float(i);
  int64_t shape[] = {2, 3};
  DLTensor dl{};
  dl.data = buffer.data();
  dl.device = {kDLCPU, 0};
  dl.ndim = 2;
  dl.dtype = {kDLFloat, 32, 1};
  dl.shape = shape;
  dl.strides = nullptr;  // row-major contiguous
  dl.byte_offset = 5 * sizeof(float);
  const TensorView v = from_dlpack(dl);
  EXPECT_EQ(v.data, buffer.data() + 5);
  EXPECT_EQ(v.stride(0), 3);
  EXPECT_EQ(v.stride(1), 1);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(*static_cast<float*>(v.element_ptr({1, 2})), 10.0f);  // 5 + 1 * 3 + 2

  // Explicit strides: a transposed [3, 2] view of the same bytes.
  int64_t tshape[] = {3, 2};
  int64_t tstrides[] = {1, 3};
  dl.shape = tshape;
  dl.strides = tstrides;
  const TensorView t = from_dlpack(dl);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(*static_cast<float*>(t.element_ptr({2, 1})), 10.0f);  // 5 + 2 + 1 * 3
}

TEST(DLPack, ScalarAndEmptyTensors) {
  double value = 2.5;
  DLTensor scalar{};
  scalar.data = &value;
  scalar.device = {kDLCPU, 0};
  scalar.ndim = 0;
  scalar.dtype = {kDLFloat, 64, 1};
  const TensorView s = from_dlpack(scalar);
  EXPECT_EQ(s.ndim, 1);
  EXPECT_EQ(s.size(0), 1);
  EXPECT_EQ(*s.data_as<double>(), 2.5);

  int64_t shape[] = {0, 4};
  DLTensor empty{};
  empty.device = {kDLCUDA, 1};
  empty.ndim = 2;
  empty.dtype = {kDLBfloat, 16, 1};
  empty.shape = shape;
  const TensorView e = from_dlpack(empty);  // NULL data is fine without elements
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.data, nullptr);
  EXPECT_EQ(e.device, Device::cuda(1));
}

TEST(DLPack, ExportKeepsStorageAliveAndDeletesOnce) {
  int released = 0;
  {
    std::vector<int32_t> memory = {1, 2, 3, 4, 5, 6};
    std::shared_ptr<void> keep(memory.data(), [&released](void*) { ++released; });
    const TensorView view = TensorView::contiguous(memory.data(), DType::kI32, {2, 3});
    DLManagedTensor* managed = to_dlpack_view(view, keep);
    keep.reset();
    EXPECT_EQ(released, 0);  // the exported tensor still holds it
    managed->deleter(managed);
    EXPECT_EQ(released, 1);
  }
  EXPECT_EQ(released, 1);

  // An owning Tensor: drop every Tensor, then read through the DLPack tensor (ASan checks).
  Tensor t = Tensor::empty({8}, DType::kF32);
  fill_host(t.view(), 3.0);
  DLManagedTensor* managed = to_dlpack(t);
  t = Tensor();
  const TensorView back = from_dlpack(managed->dl_tensor);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(back.data_as<float>()[i], 3.0f);
  EXPECT_NE(managed->manager_ctx, nullptr);
  managed->deleter(managed);

  // Without a keep-alive handle the caller owns the lifetime; the deleter frees only the
  // wrapper.
  float local[4] = {};
  DLManagedTensor* borrowed =
      to_dlpack_view(TensorView::contiguous(local, DType::kF32, {4}, Device::cpu()));
  EXPECT_EQ(borrowed->dl_tensor.data, local);
  borrowed->deleter(borrowed);
}

TEST(DLPack, ExportCudaView) {
  // No memory is touched: exporting a device view only describes it.
  int dummy = 0;
  const TensorView v = TensorView::contiguous(&dummy, DType::kF16, {2, 2}, Device::cuda(1));
  ManagedPtr managed(to_dlpack_view(v));
  EXPECT_EQ(managed->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(managed->dl_tensor.device.device_id, 1);
  expect_same_view(from_dlpack(managed->dl_tensor), v);
}

TEST(DLPack, Rejections) {
  float x[4] = {};
  int64_t shape[] = {4};
  DLTensor dl{};
  dl.data = x;
  dl.device = {kDLCPU, 0};
  dl.ndim = 1;
  dl.dtype = {kDLFloat, 32, 1};
  dl.shape = shape;
  EXPECT_NO_THROW(from_dlpack(dl));

  DLTensor bad = dl;
  bad.dtype = {kDLComplex, 64, 1};
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }),
                       "(code 5 = complex, bits 64, lanes 1) is not supported"));
  bad.dtype = {kDLInt, 8, 1};
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }),
                       "(code 0 = int, bits 8, lanes 1)"));
  bad.dtype = {kDLFloat, 8, 1};
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "bits 8"));
  bad.dtype = {kDLFloat, 32, 4};
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "has lanes 4"));

  bad = dl;
  bad.ndim = kMaxDims + 1;
  EXPECT_TRUE(
      contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "ndim (7) must be in [0, 6]"));
  bad = dl;
  bad.device = {kDLVulkan, 0};
  EXPECT_TRUE(
      contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "device_type 7 is not"));
  bad = dl;
  bad.shape = nullptr;
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "shape is NULL"));
  bad = dl;
  int64_t negative[] = {-2};
  bad.shape = negative;
  EXPECT_TRUE(
      contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }), "shape[0] (-2) must be >= 0"));
  bad = dl;
  int64_t huge[] = {int64_t(1) << 40, int64_t(1) << 40};  // 2^80 elements
  bad.shape = huge;
  bad.ndim = 2;
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }),
                       "element count overflows int64 at shape[1] (1099511627776)"));
  int64_t wide[] = {int64_t(1) << 62};  // 2^62 float32 elements: 2^64 bytes
  bad.shape = wide;
  bad.ndim = 1;
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }),
                       "elements of 4 bytes overflow int64 bytes"));
  bad = dl;
  bad.data = nullptr;
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { from_dlpack(bad); }),
                       "data is NULL for a tensor of 4 elements"));

  EXPECT_TRUE(contains(error_of<InvalidArgument>([] { to_dlpack(Tensor()); }), "undefined"));
  EXPECT_TRUE(
      contains(error_of<InvalidArgument>([] { to_dlpack_view(TensorView()); }), "undefined"));
}

}  // namespace
}  // namespace pagedattn
