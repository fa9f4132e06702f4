// The Attention layer over a backend that takes its head size only padded to the next multiple
// of 8 or 16 (as the cuda kernels take 59 as 64, and 40 as 48 over an fp8 cache): the layer runs it
// padded (src/core/head_pad.h) and gives what an unpadded layer gives, step after step through the
// cache.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/step_backend.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

AttentionOptions options(int head_size) {
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_size = head_size;
  o.scale = 1.0f / std::sqrt(float(head_size));
  o.prefix = "layers.0.attn";
  o.dtype = DType::kF32;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = 4;
  return o;
}

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(AttentionLayerPadding, RunsAHeadSizeTheBackendTakesOnlyPaddedAsTheUnpaddedLayerDoes) {
  Registry step8, step16;
  step8.add(std::make_unique<test::StepBackend>(*default_registry().find("ref"), 8));
  step16.add(std::make_unique<test::StepBackend>(*default_registry().find("ref"), 16));
  std::mt19937 rng(59);
  // Steps of 16 (cuda over an fp8 cache): 40 runs as 48.
  for (const auto& [d, step] : {std::pair{59, 8}, {13, 8}, {40, 16}}) {
    const int d8 = (d + step - 1) / step * step;
    ForwardContext padded_ctx, plain_ctx;
    Attention padded(padded_ctx, options(d), step == 8 ? step8 : step16);
    AttentionOptions plain_options = options(d);
    plain_options.attn_backend = "ref";
    Attention plain(plain_ctx, plain_options);
    EXPECT_EQ(padded.config().head_size, d);
    EXPECT_EQ(padded.run_config().head_size, d8);
    EXPECT_EQ(padded.run_config().scale, padded.config().scale);
    EXPECT_EQ(padded.get_kv_cache_spec()->head_size, d8);
    EXPECT_NE(padded.extra_repr().find(detail::cat("padded_head_size=", d8)), std::string::npos);
    KVCache padded_cache = KVCache::allocate(padded.run_config(), 8);
    KVCache plain_cache = KVCache::allocate(plain.config(), 8);
    padded.bind_kv_cache({padded_cache.view()});
    plain.bind_kv_cache({plain_cache.view()});
    // A prefill step, then a decode step over the cached keys.
    const std::vector<StepMetadata> steps = {
        MetadataBuilder(4).add({0, 5, {6, 2}}).add({0, 3, {1}}).build(),
        MetadataBuilder(4).add({5, 1, {6, 2}}).add({3, 1, {1}}).build()};
    for (size_t s = 0; s < steps.size(); ++s) {
      const AttentionMetadata md = steps[s].view();
      const int64_t t = md.num_actual_tokens, rows = t + 1;  // one row past the step's
      // q, k and v as column ranges of one packed [t, 8 d] qkv buffer (rows strided past
      // their heads, as a fused projection leaves them); the output contiguous.
      auto qkv = random_values(size_t(t * 8 * d), rng);
      auto part = [&](int64_t col, int64_t w) {
        TensorView x = TensorView::contiguous(qkv.data() + col, DType::kF32, {t, w});
        x.strides[0] = 8 * d;
        return x;
      };
      const TensorView q = part(0, 4 * d), k = part(4 * d, 2 * d), v = part(6 * d, 2 * d);
      auto view = [](std::vector<float>& x, int64_t n, int64_t w) {
        return TensorView::contiguous(x.data(), DType::kF32, {n, w});
      };
      std::vector<float> got(size_t(rows * 4 * d), std::nanf("")), want = got;
      padded_ctx.begin_step({&md});
      padded.forward(q, k, v, view(got, rows, 4 * d));
      padded_ctx.end_step();
      plain_ctx.begin_step({&md});
      plain.forward(q, k, v, view(want, rows, 4 * d));
      plain_ctx.end_step();
      for (int64_t i = 0; i < t * 4 * d; ++i) {
        ASSERT_TRUE(std::isfinite(got[size_t(i)])) << "d" << d << " step " << s << " at " << i;
        EXPECT_NEAR(got[size_t(i)], want[size_t(i)], 1e-5) << "d" << d << " step " << s;
      }
      for (int64_t i = t * 4 * d; i < rows * 4 * d; ++i) {
        EXPECT_TRUE(std::isnan(got[size_t(i)])) << "a row past the step was written";
      }
    }
  }
  // No backend takes it padded either: the refusal for the caller's head size stands.
  Registry step128;
  step128.add(std::make_unique<test::StepBackend>(*default_registry().find("ref"), 128));
  ForwardContext ctx;
  EXPECT_ERROR(Attention(ctx, options(59), step128), NotSupported, "head sizes in steps of 128");
}

}  // namespace
}  // namespace pagedattn
