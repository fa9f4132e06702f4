// FlashAttention's edge cases through the layers (the backend_ops matrix checks each backend on
// them against float64): a cache of zero blocks, requests with no keys (output 0, LSE -inf), a
// query longer than its keys, and empty batches, on every CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"
#include "pagedattn/mha.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

constexpr int kHq = 4, kHk = 2, kD = 16, kBlock = 4;  // the cpu backend's smallest head

AttentionOptions options(const std::string& backend) {
  AttentionOptions o;
  o.num_heads = kHq;
  o.num_kv_heads = kHk;
  o.head_size = kD;
  o.scale = 0.35f;
  o.prefix = "layers.0.attn";
  o.dtype = DType::kF32;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = kBlock;
  o.attn_backend = backend;
  return o;
}

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

std::vector<std::string> cpu_backends() {
  std::vector<std::string> names = {"ref"};
  if (default_registry().find("cpu")) names.push_back("cpu");
  return names;
}

// One request of `q_len` tokens and no keys (seq_len 0: nothing cached, every slot -1).
StepMetadata no_key_step(int q_len) {
  StepMetadata s;
  s.query_start_loc = {0, q_len};
  s.seq_lens = {0};
  s.max_blocks_per_seq = 1;
  s.block_table = {0};  // unused: seq_len 0 uses no block
  s.slot_mapping.assign(size_t(q_len), -1);
  s.max_query_len = q_len;
  s.max_seq_len = 0;
  return s;
}

TEST(EdgeCases, ACacheOfZeroBlocksServesRequestsWithNoKeys) {
  for (const std::string& backend : cpu_backends()) {
    SCOPED_TRACE(backend);
    ForwardContext ctx;
    Attention layer(ctx, options(backend));
    KVCache cache = KVCache::allocate(layer.config(), 0);
    layer.bind_kv_cache({cache.view()});
    const StepMetadata step = no_key_step(3);
    const AttentionMetadata md = step.view();
    auto q = random_values(3 * kHq * kD, 1), k = random_values(3 * kHk * kD, 2);
    auto v = random_values(3 * kHk * kD, 3);
    std::vector<float> out(3 * kHq * kD, std::nanf("")), lse(kHq * 3, std::nanf(""));
    ctx.begin_step({&md});
    layer.forward(f32(q, {3, kHq * kD}), f32(k, {3, kHk * kD}), f32(v, {3, kHk * kD}),
                  f32(out, {3, kHq * kD}), f32(lse, {kHq, 3}));
    ctx.end_step();
    for (float x : out) EXPECT_EQ(x, 0.0f);
    for (float x : lse) EXPECT_EQ(x, -INFINITY);

    // A referenced block is refused: there is none.
    StepMetadata one = no_key_step(1);
    one.seq_lens = {1};
    one.max_seq_len = 1;
    one.slot_mapping = {0};
    const AttentionMetadata md1 = one.view();
    ctx.begin_step({&md1});
    EXPECT_ERROR(layer.forward(f32(q, {1, kHq * kD}), f32(k, {1, kHk * kD}), f32(v, {1, kHk * kD}),
                               f32(out, {1, kHq * kD})),
                 InvalidArgument, "metadata.block_table[0][0] (0) is outside the cache's blocks");
    ctx.end_step();
  }
}

TEST(EdgeCases, KVCacheAllocatesZeroBlocksButNotFewer) {
  AttentionConfig c;
  c.num_heads = kHq;
  c.num_kv_heads = kHk;
  c.head_size = kD;
  c.scale = 0.35f;
  c.block_size = kBlock;
  c.dtype = DType::kF32;
  EXPECT_EQ(KVCache::allocate(c, 0).view().num_blocks(), 0);
  EXPECT_ERROR(KVCache::allocate(c, -1), InvalidArgument, "num_blocks (-1) must be >= 0");
}

// 0 tokens and 0 sequences: every layer returns without touching anything.
TEST(EdgeCases, AnEmptyBatchIsANoOpForEveryLayer) {
  for (const std::string& backend : cpu_backends()) {
    SCOPED_TRACE(backend);
    ForwardContext ctx;
    Attention layer(ctx, options(backend));
    KVCache cache = KVCache::allocate(layer.config(), 4);
    layer.bind_kv_cache({cache.view()});
    StepMetadata empty;
    empty.query_start_loc = {0};
    empty.max_blocks_per_seq = 1;
    const AttentionMetadata md = empty.view();
    std::vector<float> none;
    ctx.begin_step({&md});
    layer.forward(f32(none, {0, kHq * kD}), f32(none, {0, kHk * kD}), f32(none, {0, kHk * kD}),
                  f32(none, {0, kHq * kD}), f32(none, {kHq, 0}));
    const Tensor out =
        layer.forward(f32(none, {0, kHq * kD}), f32(none, {0, kHk * kD}), f32(none, {0, kHk * kD}));
    EXPECT_EQ(out.view().size(0), 0);
    ctx.end_step();

    MultiHeadAttentionOptions mo;
    mo.num_heads = kHq;
    mo.head_size = kD;
    mo.scale = 0.35f;
    mo.dtype = DType::kF32;
    mo.attn_backend = backend;
    MultiHeadAttention mha(mo);
    const Tensor m = mha.forward(f32(none, {0, 3, kHq * kD}), f32(none, {0, 3, kHq * kD}),
                                 f32(none, {0, 3, kHq * kD}));
    EXPECT_EQ(m.view().numel(), 0);

    MLAOptions lo;
    lo.num_heads = 2;
    lo.qk_nope_head_dim = 12;
    lo.qk_rope_head_dim = 4;
    lo.v_head_dim = 16;
    lo.kv_lora_rank = 28;
    lo.scale = 0.25f;
    lo.dtype = DType::kF32;
    lo.prefix = "layers.0.mla";
    lo.cache_config = CacheConfig{};
    lo.cache_config->block_size = kBlock;
    lo.attn_backend = backend;
    MLAAttention mla(ctx, lo);
    auto w = random_values(28 * 2 * 28, 4);
    mla.load_kv_b_proj(f32(w, {28, 2 * 28}));
    Tensor latent = Tensor::zeros({4, kBlock, 32}, DType::kF32);
    mla.bind_kv_cache(latent.view());
    ctx.begin_step({&md});
    mla.forward(f32(none, {0, 2, 16}), f32(none, {0, 28}), f32(none, {0, 4}), f32(none, {0, 32}));
    ctx.end_step();
  }
}

}  // namespace
}  // namespace pagedattn
