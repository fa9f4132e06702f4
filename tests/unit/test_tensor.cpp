// TensorView and Tensor basics: contiguous strides, select / slice / permute / reshape,
// element addressing, copies between strided views, fill_host and the describe() strings.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/tensor.h"

namespace pagedattn {
namespace {

using testing::contains;
using testing::error_of;

// A host tensor of `shape` holding 0, 1, 2, ... in row-major order.
Tensor iota_f32(const std::vector<int64_t>& shape) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.view().numel(); ++i) p[i] = float(i);
  return t;
}

float at(const TensorView& v, std::initializer_list<int64_t> index) {
  return *static_cast<const float*>(v.element_ptr(index));
}

TEST(TensorView, ContiguousStrides) {
  const TensorView v = TensorView::contiguous(nullptr, DType::kBF16, {4, 8, 64});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.stride(0), 512);
  EXPECT_EQ(v.stride(1), 64);
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_EQ(v.numel(), 2048);
  EXPECT_EQ(v.nbytes(), 4096u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_TRUE(v.defined());
  EXPECT_FALSE(TensorView().defined());
  EXPECT_EQ(TensorView().numel(), 0);
  EXPECT_EQ(v.shape_vector(), (std::vector<int64_t>{4, 8, 64}));
  // The vector overload agrees, and rank and sizes are checked.
  const TensorView w =
      TensorView::contiguous(nullptr, DType::kBF16, std::vector<int64_t>{4, 8, 64});
  EXPECT_EQ(w.strides, v.strides);
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] {
                         TensorView::contiguous(nullptr, DType::kF32, {1, 1, 1, 1, 1, 1, 1});
                       }),
                       "rank 7 exceeds 6"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([] {
                         TensorView::contiguous(nullptr, DType::kF32, {2, -1});
                       }),
                       "dimension 1 has negative size -1"));
}

TEST(TensorView, ElementPtrAndSelect) {
  const Tensor t = iota_f32({2, 3, 4});
  EXPECT_EQ(at(t, {1, 2, 3}), 23.0f);            // 12 + 8 + 3
  const TensorView row = t.view().select(1, 2);  // [2, 4]
  EXPECT_EQ(row.ndim, 2);
  EXPECT_EQ(row.size(0), 2);
  EXPECT_EQ(row.stride(0), 12);
  EXPECT_EQ(at(row, {1, 3}), 23.0f);
  EXPECT_FALSE(row.is_contiguous());
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { t.view().select(1, 3); }),
                       "select: index 3 out of range [0, 3)"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { t.view().select(3, 0); }),
                       "select: dim 3 out of range for rank 3"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] {
                         t.view().element_ptr({0, 0});
                       }),
                       "2 indices for a rank-3 tensor"));
}

TEST(TensorView, Slice) {
  const Tensor t = iota_f32({5, 4});
  const TensorView rows = t.view().slice(0, 1, 3);  // [2, 4], still contiguous
  EXPECT_EQ(rows.size(0), 2);
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(at(rows, {0, 0}), 4.0f);
  const TensorView cols = t.view().slice(1, 1, 3);  // [5, 2], row stride 4
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(at(cols, {4, 1}), 18.0f);  // 16 + 2
  EXPECT_EQ(t.view().slice(0, 2, 2).numel(), 0);
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { t.view().slice(0, 3, 6); }),
                       "slice: [3, 6) out of range [0, 5]"));
}

TEST(TensorView, PermuteNhdToHnd) {
  // [block_size 4, num_kv_heads 2, head_size 3] seen as [num_kv_heads, block_size, head_size].
  const Tensor t = iota_f32({4, 2, 3});
  const TensorView hnd = t.view().permute({1, 0, 2});
  EXPECT_EQ(hnd.shape_vector(), (std::vector<int64_t>{2, 4, 3}));
  EXPECT_EQ(hnd.stride(0), 3);
  EXPECT_EQ(hnd.stride(1), 6);
  EXPECT_FALSE(hnd.is_contiguous());
  EXPECT_EQ(at(hnd, {1, 3, 2}), at(t, {3, 1, 2}));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] {
                         t.view().permute({0, 0, 1});
                       }),
                       "permute: bad axis 0"));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] {
                         t.view().permute({0, 1});
                       }),
                       "permute: 2 axes for rank 3"));
}

TEST(TensorView, Reshape) {
  const Tensor t = iota_f32({2, 3, 4});
  const TensorView r = t.view().reshape({6, 4});
  EXPECT_EQ(r.data, t.data());
  EXPECT_EQ(r.stride(0), 4);
  EXPECT_EQ(at(r, {5, 3}), 23.0f);
  // A view whose only non-unit dimensions are contiguous still reshapes.
  EXPECT_NO_THROW(t.view().slice(0, 1, 2).reshape({12}));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] {
                         t.view().reshape({5, 5});
                       }),
                       "(24 elements) cannot become [5, 5]"));
  const TensorView permuted = t.view().permute({2, 0, 1});
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { permuted.reshape({24}); }),
                       "reshape: float32[4, 2, 3] is not contiguous"));
}

TEST(Tensor, ZerosEmptyAndCopyOf) {
  const Tensor z = Tensor::zeros({3, 5}, DType::kBF16);
  EXPECT_TRUE(z.defined());
  EXPECT_FALSE(Tensor().defined());
  const auto* bits = z.data_as<uint16_t>();
  for (int i = 0; i < 15; ++i) EXPECT_EQ(bits[i], 0);
  // A zero-element tensor still gets storage.
  EXPECT_TRUE(Tensor::empty({0, 4}, DType::kF32).defined());

  // copy_of a permuted view is contiguous in the new order.
  const Tensor t = iota_f32({2, 3});
  const Tensor c = Tensor::copy_of(t.view().permute({1, 0}), Device::cpu());
  EXPECT_TRUE(c.view().is_contiguous());
  const std::vector<float> expected = {0, 3, 1, 4, 2, 5};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(c.data_as<float>()[i], expected[i]);
}

TEST(Tensor, CopyBetweenStridedViews) {
  // Copy the transposed columns 1..2 of a [3, 4] source into rows of a [2, 3] slice of a
  // larger destination, leaving the rest of the destination untouched.
  const Tensor src = iota_f32({3, 4});
  Tensor dst = Tensor::empty({4, 5}, DType::kF32);
  fill_host(dst.view(), -1.0);
  const TensorView from = src.view().slice(1, 1, 3).permute({1, 0});  // [2, 3]
  const TensorView to = dst.view().slice(0, 1, 3).slice(1, 2, 5);     // [2, 3]
  copy_tensor(to, from);
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 5; ++j) {
      const bool inside = i >= 1 && i < 3 && j >= 2;
      const float expected = inside ? float((j - 2) * 4 + (i - 1) + 1) : -1.0f;
      EXPECT_EQ(at(dst, {i, j}), expected) << i << "," << j;
    }
  }
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { copy_tensor(to, src.view()); }),
                       "copy_tensor: shape [3, 4] into [2, 3]"));
  const Tensor ints = Tensor::zeros({2, 3}, DType::kI32);
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { copy_tensor(to, ints.view()); }),
                       "copy_tensor: dtype int32 into float32"));
}

TEST(Tensor, FillHostConvertsAndRespectsStrides) {
  Tensor t = Tensor::zeros({2, 4}, DType::kBF16);
  fill_host(t.view().slice(1, 1, 3), 1.5);  // columns 1 and 2 only
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      const uint16_t bits = *static_cast<const uint16_t*>(t.view().element_ptr({i, j}));
      EXPECT_EQ(bf16_to_float(bits), (j == 1 || j == 2) ? 1.5f : 0.0f);
    }
  }
  Tensor f8 = Tensor::zeros({3}, DType::kFp8E4M3);
  fill_host(f8.view(), 1000.0);  // saturates to 448
  EXPECT_EQ(fp8_e4m3_to_float(f8.data_as<uint8_t>()[2]), 448.0f);

  const TensorView on_gpu = TensorView::contiguous(nullptr, DType::kF32, {2}, Device::cuda(0));
  EXPECT_TRUE(contains(error_of<InvalidArgument>([&] { fill_host(on_gpu, 0.0); }),
                       "fill_host: float32[2] on cuda:0 is not on the CPU"));
}

TEST(TensorView, Describe) {
  EXPECT_EQ(describe(TensorView::contiguous(nullptr, DType::kF32, {4, 8, 64})),
            "float32[4, 8, 64]");
  EXPECT_EQ(describe(TensorView::contiguous(nullptr, DType::kBF16, {2, 3}, Device::cuda(1))),
            "bfloat16[2, 3] on cuda:1");
  EXPECT_EQ(describe(TensorView()), "<none>");
  EXPECT_EQ(shape_string(TensorView::contiguous(nullptr, DType::kU8, {7})), "[7]");
}

}  // namespace
}  // namespace pagedattn
