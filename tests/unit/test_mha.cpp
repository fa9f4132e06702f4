// MultiHeadAttention (spec section 6): validation, shapes, and results on every CPU-side
// backend against a float64 loop in this file, within the accuracy rule (accuracy.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/mha_reference.h"
#include "common/step_backend.h"
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
  EXPECT_ERROR(mha.forward(q.view(), longer.view(), kv.view(), out.view()), InvalidArgument,
               "key has 7 tokens per batch element and value 5");
  Tensor other_batch = Tensor::zeros({3, 7, 32}, DType::kF32);
  EXPECT_ERROR(mha.forward(q.view(), other_batch.view(), other_batch.view(), out.view()),
               InvalidArgument, "must have the same batch size; got 2, 3, 3, 2");
}

// No keys at all: every row sees none and its output is 0 (FlashAttention's answer), on a
// poisoned output, packed or strided, with empty views as a DLPack producer may hand them over.
TEST(MultiHeadAttention, NoKeysGiveZeroOutput) {
  for (const char* backend : {"ref", "cpu"}) {
    if (default_registry().find(backend) == nullptr) continue;
    MultiHeadAttentionOptions o = mha_options(4, 2, 16, DType::kF32);
    o.attn_backend = std::string(backend);
    MultiHeadAttention mha(o);
    std::mt19937 rng(3);
    const Tensor q = test::random_tensor({2, 5, 64}, DType::kF32, rng);
    Tensor none = Tensor::zeros({2, 0, 32}, DType::kF32);
    TensorView empty = none.view();
    empty.strides = {0, 0, 0, 0, 0, 0};
    Tensor wide = Tensor::empty({2, 5, 128}, DType::kF32);  // output: every other 64 columns
    TensorView strided = wide.view();
    strided.shape = {2, 5, 64, 0, 0, 0};
    for (const TensorView& keys : {none.view(), empty}) {
      for (const bool packed : {true, false}) {
        Tensor out = Tensor::empty({2, 5, 64}, DType::kF32);
        const TensorView o_view = packed ? out.view() : strided;
        float* base = static_cast<float*>(packed ? out.data() : wide.data());
        std::fill(base, base + (packed ? 2 * 5 * 64 : 2 * 5 * 128), std::nanf(""));
        mha.forward(q.view(), keys, keys, o_view);
        for (int64_t i = 0; i < 2 * 5; ++i) {
          for (int64_t c = 0; c < 64; ++c) {
            EXPECT_EQ(base[i * (packed ? 64 : 128) + c], 0.0f) << backend << " row " << i;
          }
        }
      }
    }
  }
}

// ref with cross attention (encoder_decoder) refused: a key length other than the query's
// must then fail with that refusal, while equal lengths still run.
class NoCrossBackend final : public Backend {
 public:
  explicit NoCrossBackend(const Backend& ref) : ref_(ref) {}
  std::string_view name() const override { return "mha-test-no-cross"; }
  std::string_view description() const override { return "ref without encoder_decoder"; }
  std::vector<std::string> check(const BackendQuery& q) const override {
    if (q.config.attn_type == AttentionType::kEncoderDecoder) return {"no cross attention here"};
    return ref_.check(q);
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device d) const override {
    return ref_.make_impl(c, d);
  }

 private:
  const Backend& ref_;
};

TEST(MultiHeadAttention, AKeyLengthOtherThanTheQuerysNeedsTheCrossAttentionPath) {
  Registry registry;
  registry.add(std::make_unique<NoCrossBackend>(*default_registry().find("ref")));
  MultiHeadAttention mha(mha_options(2, 2, 16, DType::kF32), registry);
  std::mt19937 rng(5);
  const Tensor q = test::random_tensor({1, 3, 32}, DType::kF32, rng);
  const Tensor kv = test::random_tensor({1, 4, 32}, DType::kF32, rng);
  EXPECT_ERROR(mha.forward(q.view(), kv.view(), kv.view()), NotSupported,
               "runs as cross attention (encoder_decoder), which backend 'mha-test-no-cross' "
               "refuses here: no cross attention here");
  const Tensor same = test::random_tensor({1, 3, 32}, DType::kF32, rng);
  EXPECT_NO_THROW(mha.forward(q.view(), same.view(), same.view()));
}

// A head size the backend refuses but takes padded to the next multiple of 8 runs padded (zero
// columns, the caller's scale) and gives attention at the caller's head size, self and cross;
// with no backend taking either, the refusal names the caller's head size.
TEST(MultiHeadAttention, PadsAHeadSizeTheBackendTakesOnlyPadded) {
  Registry registry;
  registry.add(std::make_unique<test::StepBackend>(*default_registry().find("ref"), 8));
  std::mt19937 rng(59);
  for (const int d : {59, 13, 1}) {
    for (const int skv : {9, 14}) {
      const int b = 2, sq = 9, hq = 4, hkv = 2;
      const MultiHeadAttentionOptions o = mha_options(hq, hkv, d, DType::kF32);
      MultiHeadAttention mha(o, registry);
      EXPECT_EQ(mha.config().head_size, d);
      for (int call = 0; call < 2; ++call) {
        const Tensor q = test::random_tensor({b, sq, int64_t(hq) * d}, DType::kF32, rng);
        const Tensor k = test::random_tensor({b, skv, int64_t(hkv) * d}, DType::kF32, rng);
        const Tensor v = test::random_tensor({b, skv, int64_t(hkv) * d}, DType::kF32, rng);
        Tensor out = Tensor::empty({b, sq, int64_t(hq) * d}, DType::kF32);
        for (int64_t i = 0; i < out.view().numel(); ++i) {
          store_element(out.data(), DType::kF32, i, NAN);
        }
        mha.forward(q.view(), k.view(), v.view(), out.view());
        const Tensor want = test::naive_mha(q, k, v, hq, hkv, d, o.scale);
        const ErrorStats err = compare(out.view(), want.view());
        EXPECT_LE(err.max_abs, 1e-5 * std::max(1.0, err.max_ref))
            << "d" << d << " skv" << skv << " call " << call << ": " << err.to_string();
      }
    }
  }
  Registry coarse;
  coarse.add(std::make_unique<test::StepBackend>(*default_registry().find("ref"), 128));
  EXPECT_ERROR(MultiHeadAttention(mha_options(2, 2, 59, DType::kF32), coarse), NotSupported,
               "head sizes in steps of 128");
}

// Every backend this build has on the CPU, bf16 and float32, MHA / GQA / MQA, key lengths equal
// to, shorter and longer than the query's (Sq = 1 and Skv = 1 included), 3-D and 4-D views:
// the budget is twice the low-precision reference's error plus the dtype's atol.
TEST(MultiHeadAttention, MatchesFloat64OnEveryCpuBackend) {
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  std::mt19937 rng(20261202);
  struct Shape {
    int b, sq, skv, hq, hkv, d;
  };
  for (const Shape sh :
       {Shape{3, 17, 17, 4, 4, 64}, Shape{2, 33, 33, 8, 2, 80}, Shape{1, 1, 1, 16, 1, 64},
        Shape{2, 40, 40, 4, 1, 128}, Shape{2, 1, 37, 8, 2, 64}, Shape{3, 19, 1, 4, 4, 32},
        Shape{2, 45, 12, 8, 8, 64}, Shape{2, 7, 70, 6, 2, 80}, Shape{1, 130, 300, 4, 1, 64}}) {
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const Tensor q = test::random_tensor({sh.b, sh.sq, int64_t(sh.hq) * sh.d}, dt, rng);
      const Tensor k = test::random_tensor({sh.b, sh.skv, int64_t(sh.hkv) * sh.d}, dt, rng);
      const Tensor v = test::random_tensor({sh.b, sh.skv, int64_t(sh.hkv) * sh.d}, dt, rng);
      const MultiHeadAttentionOptions o = mha_options(sh.hq, sh.hkv, sh.d, dt);
      const Tensor want = test::naive_mha(q, k, v, sh.hq, sh.hkv, sh.d, o.scale);
      MultiHeadAttention base(o, lowp);
      const ErrorStats base_err =
          compare(base.forward(q.view(), k.view(), v.view()).view(), want.view());
      // The layer builds the metadata every backend reads, the baseline's included: a fault in it
      // would widen the budget along with the error, so the baseline must also be close to
      // float64 in absolute terms (float32 rounding; 16-bit: the probabilities and the output
      // rounded to the dtype).
      const double abs_bound = dt == DType::kF32 ? 1e-5 : 1e-2;
      EXPECT_LE(base_err.max_abs, abs_bound * std::max(1.0, base_err.max_ref))
          << dtype_name(dt) << " b" << sh.b << " sq" << sh.sq << " skv" << sh.skv << ": "
          << base_err.to_string();
      int tested = 0;
      for (const Backend* backend : default_registry().backends()) {
        if (!backend->check({base.config(), Device::cpu()}).empty()) continue;
        ++tested;
        MultiHeadAttentionOptions ob = o;
        ob.attn_backend = std::string(backend->name());
        MultiHeadAttention mha(ob);
        // 4-D views of the same storage, and a poisoned output that must be overwritten, twice
        // (the second call reuses the metadata built by the first).
        const TensorView q4 = TensorView::contiguous(q.data(), dt, {sh.b, sh.sq, sh.hq, sh.d});
        const TensorView k4 = TensorView::contiguous(k.data(), dt, {sh.b, sh.skv, sh.hkv, sh.d});
        const TensorView v4 = TensorView::contiguous(v.data(), dt, {sh.b, sh.skv, sh.hkv, sh.d});
        for (int call = 0; call < 2; ++call) {
          Tensor out = Tensor::empty({sh.b, sh.sq, sh.hq, sh.d}, dt);
          for (int64_t i = 0; i < out.view().numel(); ++i) store_element(out.data(), dt, i, NAN);
          mha.forward(q4, k4, v4, out.view());
          const TensorView got =
              TensorView::contiguous(out.data(), dt, {sh.b, sh.sq, int64_t(sh.hq) * sh.d});
          const ErrorStats err = compare(got, want.view());
          EXPECT_TRUE(within_budget(err, base_err, default_tolerance(dt)))
              << backend->name() << " " << dtype_name(dt) << " b" << sh.b << " sq" << sh.sq
              << " skv" << sh.skv << " h" << sh.hq << "/" << sh.hkv << " d" << sh.d << " call "
              << call << ": " << err.to_string()
              << " (low-precision reference: " << base_err.to_string() << ")";
        }
      }
      // ref always; cpu where this build has it.
      EXPECT_GE(tested, default_registry().find("cpu") != nullptr ? 2 : 1);
    }
  }
}

}  // namespace
}  // namespace pagedattn
