// The Attention layer and its ForwardContext: construction (spec 1.2), KV sharing (7.5),
// cache specs (1.9), binding per virtual engine, forward in both output modes, profiling runs
// and k/v scales (1.7).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

AttentionOptions options(std::string prefix, int num_heads = 4, std::optional<int> kv = 2) {
  AttentionOptions o;
  o.num_heads = num_heads;
  o.num_kv_heads = kv;
  o.head_size = 8;
  o.scale = 0.35f;
  o.prefix = std::move(prefix);
  o.dtype = DType::kF32;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = 4;
  return o;
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(AttentionLayer, ResolvesDefaults) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.0.attn", 4, std::nullopt);
  o.cache_config.reset();
  Attention layer(ctx, o);
  EXPECT_EQ(layer.config().num_kv_heads, 4);
  EXPECT_EQ(layer.config().block_size, 16);
  EXPECT_EQ(layer.config().kv_cache_dtype, KVCacheDType::kAuto);
  EXPECT_FALSE(layer.calculate_kv_scales());
#if PAGEDATTN_WITH_CPU_BACKEND
  const std::string backend = "cpu";  // every head size up to 576
#else
  const std::string backend = "ref";
#endif
  EXPECT_EQ(layer.extra_repr(),
            "head_size=8, num_heads=4, num_kv_heads=4, scale=0.35, backend=" + backend);
  EXPECT_EQ(ctx.layer("model.layers.0.attn"), &layer);
}

TEST(AttentionLayer, PerLayerWindowOverridesTheModelDefault) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.cache_config->sliding_window = 4096;
  Attention a(ctx, o);
  EXPECT_EQ(a.config().sliding_window, 4096);
  o.prefix = "l.1";
  o.per_layer_sliding_window = 128;
  Attention b(ctx, o);
  EXPECT_EQ(b.config().sliding_window, 128);
}

TEST(AttentionLayer, ValidatesHeads) {
  ForwardContext ctx;
  EXPECT_ERROR(Attention(ctx, options("l.0", 6, 4)), InvalidArgument,
               "num_heads (6) is not divisible by num_kv_heads (4)");
  EXPECT_TRUE(ctx.layer_names().empty());
}

TEST(AttentionLayer, DuplicateNamesRejected) {
  ForwardContext ctx;
  Attention a(ctx, options("model.layers.0.attn"));
  EXPECT_ERROR(Attention(ctx, options("model.layers.0.attn")), InvalidArgument,
               "Duplicate layer name: model.layers.0.attn");
  EXPECT_EQ(ctx.layer_names().size(), 1u);
}

TEST(AttentionLayer, DestructionUnregisters) {
  ForwardContext ctx;
  { Attention a(ctx, options("l.0")); }
  EXPECT_EQ(ctx.layer("l.0"), nullptr);
  EXPECT_NO_THROW(Attention(ctx, options("l.0")));
}

TEST(AttentionLayer, Fp8NeedsACache) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.attn_type = AttentionType::kEncoderOnly;
  o.cache_config->cache_dtype = KVCacheDType::kFp8;
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "kv_cache_dtype fp8: quantization is not supported for encoder_only attention");
}

TEST(AttentionLayer, E5m2RejectsCheckpointScales) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E5M2;
  o.has_checkpoint_kv_scales = true;
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "fp8_e5m2 kv-cache is not supported with fp8 checkpoints.");
}

TEST(AttentionLayer, BackendOverrideByName) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.attn_backend = "no_such_backend";
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "backend 'no_such_backend' is not a registered backend; valid backends: ");
  o.attn_backend = "ref";
  Attention a(ctx, o);
  EXPECT_EQ(a.backend().name(), "ref");
}

TEST(KVSharing, TargetMustDiffer) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.1.attn");
  o.kv_sharing_target_layer_name = "model.layers.1.attn";
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "Specified KV sharing target layer for model.layers.1.attn is not valid: target "
               "layer model.layers.1.attn cannot be the same as the current layer.");
  EXPECT_TRUE(ctx.layer_names().empty());
}

TEST(KVSharing, TargetMustComeFirst) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.1.attn");
  o.kv_sharing_target_layer_name = "model.layers.2.attn";
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "target layer model.layers.2.attn must come before the current layer.");
}

TEST(KVSharing, TargetMustExist) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.3.attn");
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "target layer model.layers.0.attn is not a valid Attention layer in the model.");
}

TEST(KVSharing, TargetMustHaveTheSameType) {
  ForwardContext ctx;
  AttentionOptions t = options("model.layers.0.attn");
  t.attn_type = AttentionType::kEncoderDecoder;
  Attention target(ctx, t);
  AttentionOptions o = options("model.layers.1.attn");
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  EXPECT_ERROR(Attention(ctx, o), InvalidArgument,
               "must be the same type as the current layer (decoder).");
}

TEST(CacheSpec, PerAttentionType) {
  ForwardContext ctx;
  Attention full(ctx, options("l.0"));
  const auto f = full.get_kv_cache_spec();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->kind, KVCacheSpecKind::kFullAttention);
  EXPECT_EQ(f->page_size_bytes(), 2 * 4 * 2 * 8 * 4);
  AttentionOptions o = options("l.1");
  o.per_layer_sliding_window = 16;
  Attention swa(ctx, o);
  EXPECT_EQ(swa.get_kv_cache_spec()->kind, KVCacheSpecKind::kSlidingWindow);
  EXPECT_EQ(swa.get_kv_cache_spec()->sliding_window, 16);
  o = options("l.2");
  o.attn_type = AttentionType::kEncoderOnly;
  EXPECT_FALSE(Attention(ctx, o).get_kv_cache_spec().has_value());
  o = options("l.3");
  o.attn_type = AttentionType::kEncoderDecoder;
  EXPECT_EQ(Attention(ctx, o).get_kv_cache_spec()->kind, KVCacheSpecKind::kCrossAttention);
  o = options("l.4");
  o.kv_sharing_target_layer_name = "l.0";
  EXPECT_FALSE(Attention(ctx, o).get_kv_cache_spec().has_value());
}

TEST(CacheBinding, OnePerVirtualEngine) {
  ForwardContext ctx(2);
  Attention a(ctx, options("l.0"));
  KVCache c = KVCache::allocate(a.config(), 4);
  EXPECT_ERROR(a.bind_kv_cache({c.view()}), InvalidArgument,
               "layer l.0: got 1 KV caches; expected one per virtual engine (2)");
  AttentionOptions o = options("l.1");
  o.kv_sharing_target_layer_name = "l.0";
  Attention consumer(ctx, o);
  EXPECT_ERROR(consumer.bind_kv_cache({c.view(), c.view()}), InvalidArgument,
               "layer l.1 shares the KV cache of l.0; bind the cache to that layer instead");
  EXPECT_ERROR(consumer.kv_cache(), InvalidArgument, "layer l.0 has no KV cache bound");
}

// A decode + chunked-prefill step through the layer equals the reference impl called directly.
class LayerForward : public ::testing::Test {
 protected:
  void SetUp() override {
    layer_ = std::make_unique<Attention>(ctx_, options("model.layers.0.attn"));
    cache_ = KVCache::allocate(layer_->config(), 8);
    layer_->bind_kv_cache({cache_.view()});
    step_ = MetadataBuilder(4).add({0, 5, {6, 2}}).add({0, 3, {1}}).build();
    md_ = step_.view();
    q_ = random_values(8 * 4 * 8, 1);
    k_ = random_values(8 * 2 * 8, 2);
    v_ = random_values(8 * 2 * 8, 3);
  }
  TensorView q() { return TensorView::contiguous(q_.data(), DType::kF32, {8, 32}); }
  TensorView k() { return TensorView::contiguous(k_.data(), DType::kF32, {8, 16}); }
  TensorView v() { return TensorView::contiguous(v_.data(), DType::kF32, {8, 16}); }

  ForwardContext ctx_;
  std::unique_ptr<Attention> layer_;
  KVCache cache_;
  StepMetadata step_;
  AttentionMetadata md_;
  std::vector<float> q_, k_, v_;
};

TEST_F(LayerForward, OutsideAStepIsAnError) {
  EXPECT_ERROR(layer_->forward(q(), k(), v()), InvalidArgument, "forward called outside a step");
}

TEST_F(LayerForward, BothOutputModesAgree) {
  ctx_.begin_step({&md_});
  Tensor allocated = layer_->forward(q(), k(), v());
  ctx_.end_step();
  std::vector<float> buffer(8 * 32, std::nanf(""));
  std::vector<float> lse(4 * 8, std::nanf(""));
  ctx_.begin_step({&md_});
  layer_->forward(q(), k(), v(), TensorView::contiguous(buffer.data(), DType::kF32, {8, 32}),
                  TensorView::contiguous(lse.data(), DType::kF32, {4, 8}));
  ctx_.end_step();
  for (size_t i = 0; i < buffer.size(); ++i) {
    ASSERT_TRUE(std::isfinite(buffer[i])) << i;
    EXPECT_EQ(buffer[i], allocated.data_as<float>()[i]) << i;
  }
  for (float x : lse) EXPECT_TRUE(std::isfinite(x));
}

TEST_F(LayerForward, ProfilingStepZeroesAndWritesNothing) {
  std::vector<float> out(8 * 32, 7.0f);
  ctx_.begin_profile_step();
  layer_->forward(q(), k(), v(), TensorView::contiguous(out.data(), DType::kF32, {8, 32}));
  ctx_.end_step();
  for (float x : out) EXPECT_EQ(x, 0.0f);
  const auto* c = static_cast<const float*>(cache_.storage().data());
  for (int64_t i = 0; i < cache_.storage().view().numel(); ++i) EXPECT_EQ(c[i], 0.0f);
}

TEST_F(LayerForward, KvSharingConsumerReadsButNeverWrites) {
  ctx_.begin_step({&md_});
  Tensor target_out = layer_->forward(q(), k(), v());
  ctx_.end_step();
  AttentionOptions o = options("model.layers.1.attn");
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  Attention consumer(ctx_, o);
  std::vector<float> other_k = random_values(k_.size(), 9);
  ctx_.begin_step({&md_});
  Tensor out =
      consumer.forward(q(), TensorView::contiguous(other_k.data(), DType::kF32, {8, 16}), v());
  ctx_.end_step();
  // Same cache, same queries: identical output although the consumer was handed other keys.
  for (int i = 0; i < 8 * 32; ++i)
    EXPECT_EQ(out.data_as<float>()[i], target_out.data_as<float>()[i]);
}

TEST(KVSharing, ConsumerReadsWithTheOwnersFp8Scales) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.0.attn");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.has_checkpoint_kv_scales = true;
  Attention owner(ctx, o);
  owner.load_kv_scales(0.5f, 0.25f, 0.125f);
  o.prefix = "model.layers.1.attn";
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  Attention consumer(ctx, o);  // its own scales stay at 1.0
  KVCache cache = KVCache::allocate(owner.config(), 4);
  owner.bind_kv_cache({cache.view()});
  StepMetadata s = MetadataBuilder(4).add({0, 3, {2}}).build();
  AttentionMetadata md = s.view();
  const auto q = random_values(3 * 32, 11), k = random_values(3 * 16, 12),
             v = random_values(3 * 16, 13);
  auto view = [](const std::vector<float>& x, int64_t cols) {
    return TensorView::contiguous(const_cast<float*>(x.data()), DType::kF32, {3, cols});
  };
  ctx.begin_step({&md});
  Tensor a = owner.forward(view(q, 32), view(k, 16), view(v, 16));
  Tensor b = consumer.forward(view(q, 32), TensorView{}, TensorView{});
  ctx.end_step();
  for (int i = 0; i < 3 * 32; ++i) EXPECT_EQ(a.data_as<float>()[i], b.data_as<float>()[i]) << i;
}

// quantize_query (the seed's query_quant): the layer hands its own q_scale to the backend,
// which attends with e4m3(q / q_scale) * q_scale; the cpu backend refuses it with a reason.
TEST(AttentionLayer, QuantizeQueryAttendsWithTheQuantisedQuery) {
  ForwardContext ctx;
  AttentionOptions o = options("model.layers.0.attn");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.has_checkpoint_kv_scales = true;
  o.quantize_query = true;
  o.attn_backend = "ref";
  Attention quant(ctx, o);
  EXPECT_TRUE(quant.config().query_quant);
  const auto verdicts = default_registry().explain(BackendQuery{quant.config(), Device::cpu()});
  for (const auto& v : verdicts) {
    if (v.name == "cpu") {
      // One of its reasons names query_quant (head size 8 may be refused first).
      bool named = false;
      for (const std::string& r : v.reasons) named = named || r.find("query_quant") != r.npos;
      EXPECT_TRUE(named) << (v.reasons.empty() ? "no reasons" : v.reasons.front());
    }
  }
  o.prefix = "model.layers.1.attn";
  o.quantize_query = false;
  Attention plain(ctx, o);
  const float q_scale = 0.0125f;
  for (Attention* a : {&quant, &plain}) a->load_kv_scales(q_scale, 0.25f, 0.5f);
  KVCache c0 = KVCache::allocate(quant.config(), 4), c1 = KVCache::allocate(plain.config(), 4);
  quant.bind_kv_cache({c0.view()});
  plain.bind_kv_cache({c1.view()});
  StepMetadata s = MetadataBuilder(4).add({0, 3, {2}}).build();
  AttentionMetadata md = s.view();
  const auto q = random_values(3 * 32, 21), k = random_values(3 * 16, 22),
             v = random_values(3 * 16, 23);
  std::vector<float> q8(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q8[i] = fp8_e4m3_to_float(float_to_fp8_e4m3(q[i] * (1.0f / q_scale))) * q_scale;
  }
  auto view = [](const std::vector<float>& x, int64_t cols) {
    return TensorView::contiguous(const_cast<float*>(x.data()), DType::kF32, {3, cols});
  };
  ctx.begin_step({&md});
  Tensor a = quant.forward(view(q, 32), view(k, 16), view(v, 16));
  Tensor b = plain.forward(view(q8, 32), view(k, 16), view(v, 16));
  Tensor unquantised = plain.forward(view(q, 32), view(k, 16), view(v, 16));
  ctx.end_step();
  double differs = 0;
  for (int i = 0; i < 3 * 32; ++i) {
    EXPECT_NEAR(a.data_as<float>()[i], b.data_as<float>()[i], 1e-6) << i;
    differs = std::max(differs,
                       double(std::fabs(a.data_as<float>()[i] - unquantised.data_as<float>()[i])));
  }
  EXPECT_GT(differs, 1e-4);  // the quantisation is visible
}

TEST_F(LayerForward, BadQueryShapeNamesTheArgument) {
  ctx_.begin_step({&md_});
  std::vector<float> bad(8 * 30);
  EXPECT_ERROR(layer_->forward(TensorView::contiguous(bad.data(), DType::kF32, {8, 30}), k(), v()),
               InvalidArgument, "query must be [num_tokens, 4*8] or [num_tokens, 4, 8]");
  std::vector<uint16_t> half(8 * 32);
  EXPECT_ERROR(
      layer_->forward(TensorView::contiguous(half.data(), DType::kBF16, {8, 32}), k(), v()),
      InvalidArgument, "query must be float32; got bfloat16[8, 4, 8]");
}

TEST(VirtualEngines, StepPicksTheCache) {
  ForwardContext ctx(2);
  Attention a(ctx, options("l.0"));
  KVCache c0 = KVCache::allocate(a.config(), 2), c1 = KVCache::allocate(a.config(), 2);
  a.bind_kv_cache({c0.view(), c1.view()});
  StepMetadata s = MetadataBuilder(4).add({0, 1, {1}}).build();
  AttentionMetadata md = s.view();
  std::vector<float> q(32, 1.0f), k(16, 2.0f), v(16, 3.0f);
  ctx.begin_step({&md}, /*virtual_engine=*/1);
  a.forward(TensorView::contiguous(q.data(), DType::kF32, {1, 32}),
            TensorView::contiguous(k.data(), DType::kF32, {1, 16}),
            TensorView::contiguous(v.data(), DType::kF32, {1, 16}));
  ctx.end_step();
  const auto nonzero = [](const KVCache& c) {
    const auto* p = static_cast<const float*>(c.storage().data());
    for (int64_t i = 0; i < c.storage().view().numel(); ++i)
      if (p[i] != 0.0f) return true;
    return false;
  };
  EXPECT_FALSE(nonzero(c0));
  EXPECT_TRUE(nonzero(c1));
}

TEST(KvScales, CheckpointRules) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.has_checkpoint_kv_scales = true;
  Attention a(ctx, o);
  a.load_kv_scales(0.5f, 2.0f, 3.0f);  // all present
  EXPECT_FLOAT_EQ(a.q_scale(), 0.5f);
  EXPECT_FLOAT_EQ(a.k_scale(), 2.0f);
  EXPECT_FLOAT_EQ(a.v_scale(), 3.0f);
  a.load_kv_scales(-1.0f, -1.0f, 4.0f);  // one present: a single kv scale for both
  EXPECT_FLOAT_EQ(a.k_scale(), 4.0f);
  EXPECT_FLOAT_EQ(a.v_scale(), 4.0f);
  EXPECT_FLOAT_EQ(a.q_scale(), 4.0f);  // missing q: k's, with a warning
  EXPECT_FALSE(a.warnings().empty());
  a.load_kv_scales(-1.0f, -1.0f, -1.0f);  // none: 1.0
  EXPECT_FLOAT_EQ(a.k_scale(), 1.0f);
  EXPECT_ERROR(a.load_kv_scales(1.0f, std::nanf(""), 1.0f), InvalidArgument,
               "k_scale (nan) must be finite and non-zero");
}

TEST(KvScales, AutoCacheIgnoresCheckpointScales) {
  ForwardContext ctx;
  Attention a(ctx, options("l.0"));
  a.load_kv_scales(0.5f, 2.0f, 3.0f);
  EXPECT_FLOAT_EQ(a.k_scale(), 1.0f);
  EXPECT_FLOAT_EQ(a.v_scale(), 1.0f);
}

TEST(KvScales, CalibratedOnceOnTheFirstRealBatch) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.cache_config->calculate_kv_scales = true;
  Attention a(ctx, o);
  KVCache c = KVCache::allocate(a.config(), 2);
  a.bind_kv_cache({c.view()});
  StepMetadata s = MetadataBuilder(4).add({0, 1, {1}}).build();
  AttentionMetadata md = s.view();
  std::vector<float> q(32, 0.0f), k(16, 0.0f), v(16, 0.0f);
  auto run = [&] {
    ctx.begin_step({&md});
    a.forward(TensorView::contiguous(q.data(), DType::kF32, {1, 32}),
              TensorView::contiguous(k.data(), DType::kF32, {1, 16}),
              TensorView::contiguous(v.data(), DType::kF32, {1, 16}));
    ctx.end_step();
  };
  run();  // all zeros: nothing to calibrate on, try again next time
  EXPECT_TRUE(a.calculate_kv_scales());
  q[3] = -40.0f;
  k[5] = 100.0f;
  v[0] = 50.0f;
  run();
  EXPECT_FALSE(a.calculate_kv_scales());
  EXPECT_FLOAT_EQ(a.q_scale(), 40.0f / 200.0f);
  EXPECT_FLOAT_EQ(a.k_scale(), 100.0f / 200.0f);
  EXPECT_FLOAT_EQ(a.v_scale(), 50.0f / 100.0f);
  k[5] = 1000.0f;  // later batches leave the scales alone
  run();
  EXPECT_FLOAT_EQ(a.k_scale(), 0.5f);
}

TEST(KvScales, PerHeadCheckpointRules) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");  // 2 KV heads
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.has_checkpoint_kv_scales = true;
  Attention a(ctx, o);
  a.load_kv_scales({0.5f, 0.25f}, {2.0f, 8.0f}, {3.0f, 0.75f});
  EXPECT_EQ(a.q_scales(), (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(a.k_scales(), (std::vector<float>{2.0f, 8.0f}));
  EXPECT_EQ(a.v_scales(), (std::vector<float>{3.0f, 0.75f}));
  const KVScales s = a.kv_scales();
  EXPECT_EQ(s.k_scales, a.k_scales());
  EXPECT_EQ(s.v_scales, a.v_scales());
  EXPECT_TRUE(s.q_scales.empty());         // write_kv's scales: the query's travel with forward
  a.load_kv_scales({}, {}, {4.0f, 5.0f});  // one present: both; missing q: k's, with a warning
  EXPECT_EQ(a.k_scales(), (std::vector<float>{4.0f, 5.0f}));
  EXPECT_EQ(a.v_scales(), (std::vector<float>{4.0f, 5.0f}));
  EXPECT_EQ(a.q_scales(), (std::vector<float>{4.0f, 5.0f}));
  EXPECT_NE(a.warnings().back().find("no q_scales"), std::string::npos) << a.warnings().back();
  a.load_kv_scales(0.5f, 2.0f, 3.0f);  // per tensor again: the vectors go
  EXPECT_TRUE(a.k_scales().empty() && a.v_scales().empty() && a.q_scales().empty());
  EXPECT_FLOAT_EQ(a.k_scale(), 2.0f);
  EXPECT_ERROR(a.load_kv_scales({}, {1.0f, 2.0f, 3.0f}, {}), InvalidArgument,
               "k_scales has 3 values; expected num_kv_heads (2) or none");
  EXPECT_ERROR(a.load_kv_scales({}, {1.0f, 2.0f}, {1.0f, -2.0f}), InvalidArgument,
               "v_scales[1] (-2) must be finite and > 0");
}

TEST(KvScales, PerHeadScalesOnAnAutoCacheAreUnused) {
  ForwardContext ctx;
  Attention a(ctx, options("l.0"));
  a.load_kv_scales({0.5f, 0.25f}, {2.0f, 8.0f}, {3.0f, 0.75f});
  EXPECT_TRUE(a.k_scales().empty() && a.v_scales().empty() && a.q_scales().empty());
}

// Each KV head's rows depend on its own scales only: a layer with per-head scales gives bit for
// bit the rows of the per-tensor layer with head 0's scales for KV head 0, and likewise head 1.
TEST(KvScales, PerHeadScalesServeEachHeadItsOwn) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");
  o.cache_config->cache_dtype = KVCacheDType::kFp8E5M2;
  std::vector<std::unique_ptr<Attention>> layers;
  std::vector<KVCache> caches;
  for (int i = 0; i < 3; ++i) {
    o.prefix = "l." + std::to_string(i);
    layers.push_back(std::make_unique<Attention>(ctx, o));
    caches.push_back(KVCache::allocate(layers.back()->config(), 4));
    layers.back()->bind_kv_cache({caches.back().view()});
  }
  // Not powers of two: the written bytes (x / scale rounded) then depend on the scale.
  layers[0]->load_kv_scales({}, {0.3f, 3.0f}, {0.7f, 1.9f});
  layers[1]->load_kv_scales(-1.0f, 0.3f, 0.7f);
  layers[2]->load_kv_scales(-1.0f, 3.0f, 1.9f);
  StepMetadata st = MetadataBuilder(4).add({0, 5, {2, 0}}).build();
  AttentionMetadata md = st.view();
  const auto q = random_values(5 * 32, 21), k = random_values(5 * 16, 22),
             v = random_values(5 * 16, 23);
  auto view = [](const std::vector<float>& x, int64_t cols) {
    return TensorView::contiguous(const_cast<float*>(x.data()), DType::kF32, {5, cols});
  };
  ctx.begin_step({&md});
  std::vector<Tensor> out;
  for (auto& l : layers) out.push_back(l->forward(view(q, 32), view(k, 16), view(v, 16)));
  ctx.end_step();
  bool differs = false;
  for (int t = 0; t < 5; ++t) {
    for (int h = 0; h < 4; ++h) {  // query heads 0, 1 read KV head 0; 2, 3 KV head 1
      for (int d = 0; d < 8; ++d) {
        const int i = (t * 4 + h) * 8 + d;
        const float want = out[h < 2 ? 1 : 2].data_as<float>()[i];
        EXPECT_EQ(out[0].data_as<float>()[i], want) << "t=" << t << " h=" << h << " d=" << d;
        differs = differs || out[1].data_as<float>()[i] != out[2].data_as<float>()[i];
      }
    }
  }
  EXPECT_TRUE(differs);  // the scales matter, so the check above means something
}

TEST(KvScales, CalibratedPerHead) {
  ForwardContext ctx;
  AttentionOptions o = options("l.0");  // 4 query heads, 2 KV heads, head size 8
  o.cache_config->cache_dtype = KVCacheDType::kFp8E4M3;
  o.cache_config->calculate_kv_scales = true;
  o.per_head_kv_scales = true;
  Attention a(ctx, o);
  KVCache c = KVCache::allocate(a.config(), 2);
  a.bind_kv_cache({c.view()});
  StepMetadata s = MetadataBuilder(4).add({0, 1, {1}}).build();
  AttentionMetadata md = s.view();
  std::vector<float> q(32, 0.0f), k(16, 0.0f), v(16, 0.0f);
  auto run = [&] {
    ctx.begin_step({&md});
    a.forward(TensorView::contiguous(q.data(), DType::kF32, {1, 32}),
              TensorView::contiguous(k.data(), DType::kF32, {1, 16}),
              TensorView::contiguous(v.data(), DType::kF32, {1, 16}));
    ctx.end_step();
  };
  q[3] = -40.0f;  // query head 0 (KV head 0)
  k[5] = 100.0f;  // KV head 0
  v[0] = 50.0f;
  run();  // KV head 1 is all zeros: nothing to calibrate it on, try again next time
  EXPECT_TRUE(a.calculate_kv_scales());
  EXPECT_TRUE(a.k_scales().empty());
  q[8 * 3 + 1] = 4.0f;  // query head 3 (KV head 1)
  k[8 + 2] = -10.0f;
  v[8 + 7] = 20.0f;
  run();
  EXPECT_FALSE(a.calculate_kv_scales());
  EXPECT_EQ(a.q_scales(), (std::vector<float>{40.0f / 200.0f, 4.0f / 200.0f}));
  EXPECT_EQ(a.k_scales(), (std::vector<float>{100.0f / 200.0f, 10.0f / 200.0f}));
  EXPECT_EQ(a.v_scales(), (std::vector<float>{50.0f / 100.0f, 20.0f / 100.0f}));
  EXPECT_EQ(a.kv_scales().k_scales, a.k_scales());
}

}  // namespace
}  // namespace pagedattn
