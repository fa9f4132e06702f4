// MultiHeadAttention on the cuda backend: ViT-like shapes (Skv == Sq, the kernels' encoder-only
// path) and key lengths other than the query's (Sq = 1, Skv = 1, Sq > Skv, Sq < Skv: the
// cross-attention path over the key rows seen as one-token blocks), MHA and GQA, head sizes
// with and without a Hopper kernel, between the compiled ones (72, 40: their buckets) and off
// the multiples of 8 (59, 111: padded by the layer), against float64; and the paged Attention
// layer at head sizes it pads, through its cache.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/mha_reference.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
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

// The paged Attention layer at head sizes the kernels take only padded (59, 111: run at 64 and
// 112 with zero columns, the cache at the padded size) and at a bucketed one (72), over a
// prefill step and a decode step through the cache, against float64 (host layers on ref).
TEST(CudaAttentionPadding, PaddedLayerMatchesFloat64ThroughTheCache) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  std::mt19937 rng(59);
  for (const int d : {59, 111, 72}) {
    AttentionOptions o;
    o.num_heads = 8;
    o.num_kv_heads = 2;
    o.head_size = d;
    o.scale = 1.0f / std::sqrt(float(d));
    o.prefix = "layers.0.attn";
    o.dtype = DType::kBF16;
    o.cache_config = CacheConfig{};
    o.cache_config->block_size = 16;
    ForwardContext gpu_ctx, want_ctx, base_ctx;
    AttentionOptions og = o;
    og.device = Device::cuda(0);
    Attention gpu(gpu_ctx, og);
    ASSERT_EQ(gpu.backend().name(), "cuda");
    EXPECT_EQ(gpu.run_config().head_size, (d + 7) / 8 * 8);
    AttentionOptions ow = o;
    ow.attn_backend = "ref";
    Attention want(want_ctx, ow);
    Attention base(base_ctx, o, lowp);
    KVCache gpu_cache = KVCache::allocate(gpu.run_config(), 16, Device::cuda(0));
    KVCache want_cache = KVCache::allocate(want.config(), 16);
    KVCache base_cache = KVCache::allocate(base.config(), 16);
    gpu.bind_kv_cache({gpu_cache.view()});
    want.bind_kv_cache({want_cache.view()});
    base.bind_kv_cache({base_cache.view()});
    std::vector<StepMetadata> steps;
    steps.push_back(MetadataBuilder(16).add({0, 40, {3, 7, 9}}).add({0, 17, {1, 2}}).build());
    steps.push_back(MetadataBuilder(16).add({40, 1, {3, 7, 9}}).add({17, 2, {1, 2}}).build());
    for (StepMetadata& step : steps) {
      const AttentionMetadata host_md = step.view();
      const AttentionMetadata dev_md = step.to_device(Device::cuda(0));
      const int64_t t = host_md.num_actual_tokens;
      const Tensor q = test::random_tensor({t, int64_t(8) * d}, DType::kBF16, rng);
      const Tensor k = test::random_tensor({t, int64_t(2) * d}, DType::kBF16, rng);
      const Tensor v = test::random_tensor({t, int64_t(2) * d}, DType::kBF16, rng);
      auto run = [&](Attention& layer, ForwardContext& ctx, const AttentionMetadata& md,
                     Device dev) {
        const Tensor dq = Tensor::copy_of(q.view(), dev), dk = Tensor::copy_of(k.view(), dev),
                     dv = Tensor::copy_of(v.view(), dev);
        Tensor host_out = Tensor::empty({t, int64_t(8) * d}, DType::kBF16);
        for (int64_t i = 0; i < host_out.view().numel(); ++i) {
          store_element(host_out.data(), DType::kBF16, i, NAN);
        }
        Tensor out = Tensor::copy_of(host_out.view(), dev);
        ctx.begin_step({&md});
        layer.forward(dq.view(), dk.view(), dv.view(), out.view());
        ctx.end_step();
        if (dev.is_cuda()) {
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        }
        return Tensor::copy_of(out.view(), Device::cpu());
      };
      const Tensor ref = run(want, want_ctx, host_md, Device::cpu());
      const ErrorStats base_err =
          compare(run(base, base_ctx, host_md, Device::cpu()).view(), ref.view());
      const ErrorStats err = compare(run(gpu, gpu_ctx, dev_md, Device::cuda(0)).view(), ref.view());
      EXPECT_TRUE(within_budget(err, base_err, default_tolerance(DType::kBF16)))
          << "d" << d << " tokens " << t << ": " << err.to_string()
          << " (low-precision reference: " << base_err.to_string() << ")";
    }
  }
}

}  // namespace
}  // namespace pagedattn
