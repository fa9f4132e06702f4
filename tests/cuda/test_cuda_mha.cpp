// MultiHeadAttention on the cuda backend: ViT-like shapes (Skv == Sq, the kernels' encoder-only
// path) and key lengths other than the query's (Sq = 1, Skv = 1, Sq > Skv, Sq < Skv: the
// cross-attention path over the key rows seen as one-token blocks), MHA and GQA, head sizes
// with and without a Hopper kernel, between the compiled ones (72, 40: their buckets) and off
// the multiples of 8 (59, 111: padded by the layer), against float64.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/mha_reference.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/mha.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && default_registry().find("cuda");
}

TEST(CudaMultiHeadAttention, MatchesFloat64) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  std::mt19937 rng(7);
  struct Shape {
    int b, sq, skv, hq, hkv, d;
  };
  for (const Shape sh :
       {Shape{2, 197, 197, 12, 12, 64}, Shape{2, 129, 129, 16, 16, 80}, Shape{3, 65, 65, 8, 2, 128},
        Shape{1, 300, 300, 4, 1, 256}, Shape{4, 3, 3, 8, 8, 64}, Shape{2, 1, 300, 8, 2, 128},
        Shape{3, 50, 1, 8, 8, 64}, Shape{2, 200, 77, 12, 12, 64}, Shape{1, 9, 500, 16, 16, 80},
        Shape{2, 129, 600, 4, 1, 256}, Shape{2, 129, 129, 16, 16, 72}, Shape{2, 20, 33, 4, 4, 40},
        Shape{2, 65, 65, 4, 2, 59}, Shape{1, 40, 17, 4, 1, 111}}) {
    for (DType dt : {DType::kBF16, DType::kF16}) {
      const Tensor q = test::random_tensor({sh.b, sh.sq, int64_t(sh.hq) * sh.d}, dt, rng);
      const Tensor k = test::random_tensor({sh.b, sh.skv, int64_t(sh.hkv) * sh.d}, dt, rng);
      const Tensor v = test::random_tensor({sh.b, sh.skv, int64_t(sh.hkv) * sh.d}, dt, rng);
      MultiHeadAttentionOptions o;
      o.num_heads = sh.hq;
      o.num_kv_heads = sh.hkv;
      o.head_size = sh.d;
      o.scale = 1.0f / std::sqrt(float(sh.d));
      o.dtype = dt;
      const Tensor want = test::naive_mha(q, k, v, sh.hq, sh.hkv, sh.d, o.scale);
      MultiHeadAttention base(o, lowp);
      const ErrorStats base_err =
          compare(base.forward(q.view(), k.view(), v.view()).view(), want.view());
      o.device = Device::cuda(0);
      MultiHeadAttention mha(o);
      ASSERT_EQ(mha.backend().name(), "cuda");
      const Device dev = Device::cuda(0);
      const Tensor gq = Tensor::copy_of(q.view(), dev), gk = Tensor::copy_of(k.view(), dev),
                   gv = Tensor::copy_of(v.view(), dev);
      // Poisoned output: every element must be written.
      Tensor host_out = Tensor::empty({sh.b, sh.sq, int64_t(sh.hq) * sh.d}, dt);
      for (int64_t i = 0; i < host_out.view().numel(); ++i)
        store_element(host_out.data(), dt, i, NAN);
      Tensor gout = Tensor::copy_of(host_out.view(), dev);
      mha.forward(gq.view(), gk.view(), gv.view(), gout.view());
      mha.forward(gq.view(), gk.view(), gv.view(), gout.view());  // the cached metadata again
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor got = Tensor::copy_of(gout.view(), Device::cpu());
      const ErrorStats err = compare(got.view(), want.view());
      EXPECT_TRUE(within_budget(err, base_err, default_tolerance(dt)))
          << dtype_name(dt) << " b" << sh.b << " sq" << sh.sq << " skv" << sh.skv << " h" << sh.hq
          << "/" << sh.hkv << " d" << sh.d << ": " << err.to_string()
          << " (low-precision reference: " << base_err.to_string() << ")";
    }
  }
}

}  // namespace
}  // namespace pagedattn
