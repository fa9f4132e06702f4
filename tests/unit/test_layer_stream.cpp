// The stream convention of the three layers: every forward takes a Stream as its last argument
// and hands it to every backend call it makes (write_kv, forward, merge_states), so that a
// caller's CUDA graph captures the whole step. A backend wrapping ref records the streams.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "pagedattn/layer.h"
#include "pagedattn/mha.h"
#include "pagedattn/mla.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

struct Seen {
  std::vector<std::string> calls;  // "write_kv" / "forward" / "merge_states", in order
  std::vector<void*> streams;      // the stream of each call
};

class RecordingImpl final : public AttentionImpl {
 public:
  RecordingImpl(std::unique_ptr<AttentionImpl> inner, Seen& seen)
      : inner_(std::move(inner)), seen_(seen) {}
  void write_kv(const WriteKVArgs& a) override {
    seen_.calls.push_back("write_kv");
    seen_.streams.push_back(a.stream.handle);
    inner_->write_kv(a);
  }
  void forward(const ForwardArgs& a) override {
    seen_.calls.push_back("forward");
    seen_.streams.push_back(a.stream.handle);
    inner_->forward(a);
  }

 private:
  std::unique_ptr<AttentionImpl> inner_;
  Seen& seen_;
};

class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(Seen& seen) : seen_(seen) {}
  std::string_view name() const override { return "recording"; }
  std::string_view description() const override { return "ref, recording each call's stream"; }
  std::vector<std::string> check(const BackendQuery& q) const override { return ref_->check(q); }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device d) const override {
    return std::make_unique<RecordingImpl>(ref_->make_impl(c, d), seen_);
  }
  std::unique_ptr<Plan> plan(const AttentionMetadata& md, const AttentionConfig& c) const override {
    return ref_->plan(md, c);
  }
  void merge_states(const MergeArgs& a) const override {
    seen_.calls.push_back("merge_states");
    seen_.streams.push_back(a.stream.handle);
    ref_->merge_states(a);
  }

 private:
  Seen& seen_;
  std::unique_ptr<Backend> ref_ = ref::make_backend(ref::Precision::kFloat64);
};

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TensorView f32(std::vector<float>& v, std::vector<int64_t> shape) {
  return TensorView::contiguous(v.data(), DType::kF32, shape);
}

class LayerStream : public ::testing::Test {
 protected:
  void SetUp() override { registry_.add(std::make_unique<RecordingBackend>(seen_)); }
  void expect_all_on(void* stream, size_t min_calls) {
    EXPECT_GE(seen_.streams.size(), min_calls);
    for (size_t i = 0; i < seen_.streams.size(); ++i) {
      EXPECT_EQ(seen_.streams[i], stream) << "call " << i << " (" << seen_.calls[i] << ")";
    }
    seen_ = {};
  }
  Seen seen_;
  Registry registry_;
  int tag_ = 0;  // its address stands for a stream: the host backends never dereference it
};

TEST_F(LayerStream, AttentionHandsItsStreamToTheCacheWriteAndTheAttention) {
  ForwardContext ctx;
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_size = 8;
  o.scale = 0.35f;
  o.prefix = "layers.0.attn";
  o.dtype = DType::kF32;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = 4;
  o.attn_backend = "recording";
  Attention layer(ctx, o, registry_);
  KVCache cache = KVCache::allocate(layer.config(), 8);
  layer.bind_kv_cache({cache.view()});
  const StepMetadata step = MetadataBuilder(4).add({0, 5, {6, 2}}).add({0, 3, {1}}).build();
  const AttentionMetadata md = step.view();
  auto q = random_values(8 * 32, 1), k = random_values(8 * 16, 2), v = random_values(8 * 16, 3);
  const Stream s{&tag_};
  std::vector<float> out(8 * 32, std::nanf(""));
  ctx.begin_step({&md});
  layer.forward(f32(q, {8, 32}), f32(k, {8, 16}), f32(v, {8, 16}), f32(out, {8, 32}), {}, s);
  ctx.end_step();
  EXPECT_EQ(seen_.calls, (std::vector<std::string>{"write_kv", "forward"}));
  expect_all_on(&tag_, 2);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));

  ctx.begin_step({&md});
  const Tensor allocated = layer.forward(f32(q, {8, 32}), f32(k, {8, 16}), f32(v, {8, 16}), s);
  ctx.end_step();
  expect_all_on(&tag_, 2);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(allocated.data_as<float>()[i], out[i]) << i;

  // The default is the legacy default stream (a null handle).
  ctx.begin_step({&md});
  layer.forward(f32(q, {8, 32}), f32(k, {8, 16}), f32(v, {8, 16}), f32(out, {8, 32}));
  ctx.end_step();
  expect_all_on(nullptr, 2);
}

TEST_F(LayerStream, MultiHeadAttentionHandsItsStreamToTheAttention) {
  MultiHeadAttentionOptions o;
  o.num_heads = 2;
  o.head_size = 8;
  o.scale = 0.35f;
  o.dtype = DType::kF32;
  o.attn_backend = "recording";
  MultiHeadAttention layer(o, registry_);
  auto q = random_values(2 * 3 * 16, 4), k = random_values(2 * 5 * 16, 5);
  auto v = random_values(2 * 5 * 16, 6);
  std::vector<float> out(2 * 3 * 16, std::nanf(""));
  const Stream s{&tag_};
  // Skv == Sq (the encoder-only path) and Skv != Sq (the cross-attention path).
  layer.forward(f32(q, {2, 3, 16}), f32(k, {2, 3, 16}), f32(v, {2, 3, 16}), f32(out, {2, 3, 16}),
                s);
  layer.forward(f32(q, {2, 3, 16}), f32(k, {2, 5, 16}), f32(v, {2, 5, 16}), f32(out, {2, 3, 16}),
                s);
  const Tensor allocated =
      layer.forward(f32(q, {2, 3, 16}), f32(k, {2, 5, 16}), f32(v, {2, 5, 16}), s);
  EXPECT_EQ(seen_.calls, (std::vector<std::string>{"forward", "forward", "forward"}));
  expect_all_on(&tag_, 3);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(allocated.data_as<float>()[i], out[i]) << i;
}

// Host tensors: the stream still reaches every backend call of both formulations (the latent
// write, the absorbed attention, the prefill's attentions and merges).
TEST_F(LayerStream, MLAAttentionHandsItsStreamToEveryBackendCall) {
  constexpr int kN = 2, kP = 8, kR = 4, kV = 8, kL = 16, kBlock = 4;
  ForwardContext ctx;
  MLAOptions o;
  o.num_heads = kN;
  o.qk_nope_head_dim = kP;
  o.qk_rope_head_dim = kR;
  o.v_head_dim = kV;
  o.kv_lora_rank = kL;
  o.scale = 0.25f;
  o.dtype = DType::kF32;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = kBlock;
  o.attn_backend = std::string("recording");
  o.context_chunk_tokens = 4;  // several context chunks: merges
  MLAAttention layer(ctx, o, registry_);
  auto w = random_values(size_t(kL) * kN * (kP + kV), 7);
  layer.load_kv_b_proj(f32(w, {kL, kN * (kP + kV)}));
  Tensor cache = Tensor::zeros({8, kBlock, kL + kR}, DType::kF32);
  layer.bind_kv_cache(cache.view());
  const Stream s{&tag_};
  auto run = [&](const StepMetadata& step, int64_t t) {
    const AttentionMetadata md = step.view();
    auto q = random_values(size_t(t) * kN * (kP + kR), 8), kv = random_values(size_t(t) * kL, 9);
    auto pe = random_values(size_t(t) * kR, 10);
    std::vector<float> out(size_t(t) * kN * kV, std::nanf(""));
    ctx.begin_step({&md});
    layer.forward(f32(q, {t, kN, kP + kR}), f32(kv, {t, kL}), f32(pe, {t, kR}),
                  f32(out, {t, kN * kV}), s);
    ctx.end_step();
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
  };
  run(MetadataBuilder(kBlock).add({0, 9, {1, 2, 3}}).build(), 9);  // a prefill
  expect_all_on(&tag_, 2);
  // A decode and a prefill with context: both formulations in one step.
  run(MetadataBuilder(kBlock).add({9, 1, {1, 2, 3}}).add({0, 3, {4}}).build(), 4);
  ASSERT_NE(std::find(seen_.calls.begin(), seen_.calls.end(), "forward"), seen_.calls.end());
  expect_all_on(&tag_, 3);
  run(MetadataBuilder(kBlock).add({10, 3, {1, 2, 3, 5}}).build(), 3);  // context: merges
  ASSERT_NE(std::find(seen_.calls.begin(), seen_.calls.end(), "merge_states"), seen_.calls.end());
  expect_all_on(&tag_, 4);
}

}  // namespace
}  // namespace pagedattn
