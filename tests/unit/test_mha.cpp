// MultiHeadAttention (spec section 6): validation, shapes, and results on every CPU-side
// backend against a float64 loop in this file, within the accuracy rule (accuracy.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/expect_error.h"
#include "common/mha_reference.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/mha.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

MultiHeadAttentionOptions mha_options(int hq, int hkv, int d, DType dtype) {
  MultiHeadAttentionOptions o;
  o.num_heads = hq;
  o.num_kv_heads = hkv;
  o.head_size = d;
  o.scale = 1.0f / std::sqrt(float(d));
  o.dtype = dtype;
  return o;
}

TEST(MultiHeadAttention, RejectsHeadsNotDivisibleByKvHeads) {
  EXPECT_ERROR(MultiHeadAttention(mha_options(6, 4, 64, DType::kF32)), InvalidArgument,
               "num_heads (6) must be divisible by num_kv_heads (4)");
}

TEST(MultiHeadAttention, ChecksShapes) {
  MultiHeadAttention mha(mha_options(4, 2, 16, DType::kF32));
  Tensor q = Tensor::zeros({2, 5, 64}, DType::kF32), kv = Tensor::zeros({2, 5, 32}, DType::kF32);
  Tensor bad = Tensor::zeros({2, 5, 48}, DType::kF32), out = Tensor::zeros({2, 5, 64}, DType::kF32);
  EXPECT_ERROR(mha.forward(q.view(), bad.view(), kv.view(), out.view()), InvalidArgument,
               "key must be [batch, seq, 2*16]");
  Tensor longer = Tensor::zeros({2, 7, 32}, DType::kF32);
  EXPECT_ERROR(mha.forward(q.view(), longer.view(), longer.view(), out.view()), NotSupported,
               "Sq=5, Skv=7");
}

// Every backend this build has on the CPU, bf16 and float32, MHA / GQA / MQA, 3-D and 4-D views:
// the budget is twice the low-precision reference's error plus the dtype's atol.
TEST(MultiHeadAttention, MatchesFloat64OnEveryCpuBackend) {
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  std::mt19937 rng(20261202);
  struct Shape {
    int b, s, hq, hkv, d;
  };
  for (const Shape sh : {Shape{3, 17, 4, 4, 64}, Shape{2, 33, 8, 2, 80}, Shape{1, 1, 16, 1, 64},
                         Shape{2, 40, 4, 1, 128}}) {
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const Tensor q = test::random_tensor({sh.b, sh.s, int64_t(sh.hq) * sh.d}, dt, rng);
      const Tensor k = test::random_tensor({sh.b, sh.s, int64_t(sh.hkv) * sh.d}, dt, rng);
      const Tensor v = test::random_tensor({sh.b, sh.s, int64_t(sh.hkv) * sh.d}, dt, rng);
      const MultiHeadAttentionOptions o = mha_options(sh.hq, sh.hkv, sh.d, dt);
      const Tensor want = test::naive_mha(q, k, v, sh.hq, sh.hkv, sh.d, o.scale);
      MultiHeadAttention base(o, lowp);
      const ErrorStats base_err =
          compare(base.forward(q.view(), k.view(), v.view()).view(), want.view());
      int tested = 0;
      for (const Backend* backend : default_registry().backends()) {
        if (!backend->check({base.config(), Device::cpu()}).empty()) continue;
        ++tested;
        MultiHeadAttentionOptions ob = o;
        ob.attn_backend = std::string(backend->name());
        MultiHeadAttention mha(ob);
        // 4-D views of the same storage, and a poisoned output that must be overwritten.
        Tensor out = Tensor::empty({sh.b, sh.s, sh.hq, sh.d}, dt);
        for (int64_t i = 0; i < out.view().numel(); ++i) store_element(out.data(), dt, i, NAN);
        const TensorView q4 = TensorView::contiguous(q.data(), dt, {sh.b, sh.s, sh.hq, sh.d});
        const TensorView k4 = TensorView::contiguous(k.data(), dt, {sh.b, sh.s, sh.hkv, sh.d});
        const TensorView v4 = TensorView::contiguous(v.data(), dt, {sh.b, sh.s, sh.hkv, sh.d});
        mha.forward(q4, k4, v4, out.view());
        const TensorView got =
            TensorView::contiguous(out.data(), dt, {sh.b, sh.s, int64_t(sh.hq) * sh.d});
        const ErrorStats err = compare(got, want.view());
        EXPECT_TRUE(within_budget(err, base_err, default_tolerance(dt)))
            << backend->name() << " " << dtype_name(dt) << " b" << sh.b << " s" << sh.s << " h"
            << sh.hq << "/" << sh.hkv << " d" << sh.d << ": " << err.to_string()
            << " (low-precision reference: " << base_err.to_string() << ")";
      }
      // ref always; cpu where this build has it.
      EXPECT_GE(tested, default_registry().find("cpu") != nullptr ? 2 : 1);
    }
  }
}

}  // namespace
}  // namespace pagedattn
