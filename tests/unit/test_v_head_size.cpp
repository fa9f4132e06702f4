// A V head size of its own (AttentionConfig::v_head_size, FlashAttention's dv < d): the bound,
// the split cache, the spec's bytes, the argument checks and the layer on every host backend.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/backend.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

AttentionConfig config(int d, int dv) {
  AttentionConfig c;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_size = d;
  c.v_head_size = dv;
  c.scale = 0.3f;
  c.dtype = DType::kF32;
  c.block_size = 4;
  return c;
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(VHeadSize, BoundedByTheHeadSize) {
  EXPECT_EQ(config(8, 0).head_size_v(), 8);
  EXPECT_EQ(config(8, 3).head_size_v(), 3);
  EXPECT_NO_THROW(config(8, 8).validate());
  EXPECT_ERROR(config(8, 9).validate(), InvalidArgument,
               "v_head_size (9) must be 1..head_size (8), or 0 for head_size");
  EXPECT_ERROR(config(8, -1).validate(), InvalidArgument, "v_head_size (-1) must be 1..head_size");
}

TEST(VHeadSize, CacheHasSeparateKAndVViews) {
  for (KVCacheLayout layout : {KVCacheLayout::kNHD, KVCacheLayout::kHND}) {
    AttentionConfig c = config(8, 3);
    c.kv_cache_layout = layout;
    const KVCache cache = KVCache::allocate(c, 5);
    ASSERT_TRUE(cache.split());
    const KVCacheView v = cache.view();
    EXPECT_EQ(v.key.shape_vector(), (std::vector<int64_t>{5, 4, 2, 8}));
    EXPECT_EQ(v.value.shape_vector(), (std::vector<int64_t>{5, 4, 2, 3}));
    EXPECT_EQ(v.head_size(), 8);
    EXPECT_EQ(v.head_size_v(), 3);
    // One allocation of (d + dv) elements per token and head; K and V never overlap.
    EXPECT_EQ(cache.storage().view().nbytes(), size_t(5 * 4 * 2 * (8 + 3) * 4));
    EXPECT_EQ(layout_of(v), layout);
    fill_host(v.key, 1.0);
    fill_host(v.value, 2.0);
    int64_t ones = 0, twos = 0;
    const float* s = cache.storage().data_as<float>();
    for (int64_t i = 0; i < 5 * 4 * 2 * 11; ++i) (s[i] == 1.0f ? ones : twos) += 1;
    EXPECT_EQ(ones, 5 * 4 * 2 * 8);
    EXPECT_EQ(twos, 5 * 4 * 2 * 3);
    EXPECT_ERROR(cache.tensor(), InvalidArgument,
                 "this cache's V head size (3) differs from its K head size (8)");
  }
  EXPECT_FALSE(KVCache::allocate(config(8, 8), 2).split());
  EXPECT_NO_THROW(KVCache::allocate(config(8, 8), 2).tensor());
}

TEST(VHeadSize, SpecCountsKAndVBytes) {
  KVCacheSpec s = KVCacheSpec::full(16, 8, 192, DType::kBF16);
  s.v_head_size = 128;
  EXPECT_EQ(s.page_size_bytes(), 16 * 8 * (192 + 128) * 2);
  EXPECT_NO_THROW(s.validate());
  EXPECT_NE(describe(s).find("v_head_size=128"), std::string::npos);
  s.v_head_size = 193;
  EXPECT_ERROR(s.validate(), InvalidArgument, "KVCacheSpec.v_head_size (193) must be 1..head_size");
  KVCacheSpec mla = KVCacheSpec::mla(64, 576, DType::kBF16);
  mla.v_head_size = 512;
  EXPECT_ERROR(mla.validate(), InvalidArgument, "must be 0 for an MLA spec");
}

TEST(VHeadSize, ArgumentChecksNameTheExpectedV) {
  const AttentionConfig c = config(8, 3);
  KVCache cache = KVCache::allocate(c, 4);
  StepMetadata step = MetadataBuilder(4).add({0, 2, {1}}).build();
  const AttentionMetadata md = step.view();
  std::vector<float> q(2 * 4 * 8), k(2 * 2 * 8), v(2 * 2 * 8), out(2 * 4 * 8);
  ForwardArgs f;
  f.query = TensorView::contiguous(q.data(), DType::kF32, {2, 4, 8});
  f.kv_cache = cache.view();
  f.metadata = &md;
  f.output = TensorView::contiguous(out.data(), DType::kF32, {2, 4, 8});
  EXPECT_ERROR(check_forward_args(c, f), InvalidArgument,
               "output must be [>= num_actual_tokens (2), num_heads=4, v_head_size=3 (or "
               "1..v_head_size leading columns of P V)]; got float32[2, 4, 8]");
  f.output = TensorView::contiguous(out.data(), DType::kF32, {2, 4, 3});
  EXPECT_NO_THROW(check_forward_args(c, f));
  // A combined cache of the Q/K size as V.
  KVCache wrong = KVCache::allocate(config(8, 8), 4);
  f.kv_cache = wrong.view();
  EXPECT_ERROR(check_forward_args(c, f), InvalidArgument,
               "kv_cache.value must be [num_blocks, block_size=4, num_kv_heads=2, v_head_size=3]");
  std::vector<int64_t> slots = {4, 5};
  WriteKVArgs w{TensorView::contiguous(k.data(), DType::kF32, {2, 2, 8}),
                TensorView::contiguous(v.data(), DType::kF32, {2, 2, 8}),
                TensorView::contiguous(slots.data(), DType::kI64, {2}),
                cache.view(),
                {},
                {}};
  EXPECT_ERROR(check_write_kv_args(c, w), InvalidArgument,
               "value must be [num_tokens, num_kv_heads=2, v_head_size=3]; got float32[2, 2, 8]");
  AttentionConfig encoder = c;
  encoder.attn_type = AttentionType::kEncoderOnly;
  f.key = w.key;
  f.value = w.value;
  f.kv_cache = {};
  EXPECT_ERROR(check_forward_args(encoder, f), InvalidArgument,
               "value must be [num_tokens, num_kv_heads=2, v_head_size=3]");
}

// The layer with a V head size of its own: every host backend that serves it gives the
// reference's output, [T, num_heads * dv], over a split cache written by its own write_kv.
TEST(VHeadSize, LayerOnEveryHostBackend) {
  const int d = 24, dv = 10, hq = 4, hk = 2, t = 7;
  StepMetadata step = MetadataBuilder(4).add({0, 5, {3, 1}}).add({0, 2, {2}}).build();
  const AttentionMetadata md = step.view();
  const auto q = random_values(size_t(t * hq * d), 31), k = random_values(size_t(t * hk * d), 32),
             v = random_values(size_t(t * hk * dv), 33);
  auto view = [](const std::vector<float>& x, int64_t cols) {
    return TensorView::contiguous(const_cast<float*>(x.data()), DType::kF32, {t, cols});
  };
  std::vector<std::vector<float>> outputs;
  std::vector<std::string> names;
  for (const char* name : {"ref", "cpu"}) {
    const Backend* b = default_registry().find(name);
    if (b == nullptr) continue;
    ForwardContext ctx;
    AttentionOptions o;
    o.num_heads = hq;
    o.num_kv_heads = hk;
    o.head_size = d;
    o.v_head_size = dv;
    o.scale = 0.25f;
    o.dtype = DType::kF32;
    o.cache_config = CacheConfig{};
    o.cache_config->block_size = 4;
    o.prefix = "model.layers.0.attn";
    o.attn_backend = name;
    Attention layer(ctx, o);
    ASSERT_EQ(layer.backend().name(), name);
    const KVCacheSpec spec = *layer.get_kv_cache_spec();
    EXPECT_EQ(spec.v_head_size, dv);
    EXPECT_EQ(spec.page_size_bytes(), 4 * hk * (d + dv) * 4);
    EXPECT_NE(layer.extra_repr().find("v_head_size=10"), std::string::npos);
    KVCache cache = KVCache::allocate(layer.config(), 4);
    layer.bind_kv_cache({cache.view()});
    ctx.begin_step({&md});
    Tensor out = layer.forward(view(q, hq * d), view(k, hk * d), view(v, hk * dv));
    ctx.end_step();
    ASSERT_EQ(out.view().shape_vector(), (std::vector<int64_t>{t, hq * dv}));
    outputs.emplace_back(out.data_as<float>(), out.data_as<float>() + t * hq * dv);
    names.push_back(name);
  }
  ASSERT_FALSE(outputs.empty());
  for (float x : outputs[0]) ASSERT_TRUE(std::isfinite(x));
  for (size_t b = 1; b < outputs.size(); ++b) {
    for (size_t i = 0; i < outputs[0].size(); ++i) {
      EXPECT_NEAR(outputs[b][i], outputs[0][i], 1e-5) << names[b] << " " << i;
    }
  }
}

}  // namespace
}  // namespace pagedattn
