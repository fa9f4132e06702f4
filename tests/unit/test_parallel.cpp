// Tensor parallelism (issue 9, item 1): the head split, and N ranks (each its own context,
// layer and cache, fed views of the full step's tensors) gathered equal one rank, on every CPU
// backend, for GQA, MQA with replicated KV heads, ALiBi and sinks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/expect_error.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/parallel.h"

namespace pagedattn {
namespace {

TEST(TensorParallel, SplitsQueryHeadsAndSplitsOrReplicatesKvHeads) {
  for (int r = 0; r < 4; ++r) {
    const auto s = TensorParallelShard::of(32, 8, r, 4);
    EXPECT_EQ(s.head_begin, 8 * r);
    EXPECT_EQ(s.num_heads, 8);
    EXPECT_EQ(s.kv_head_begin, 2 * r);
    EXPECT_EQ(s.num_kv_heads, 2);
  }
  for (int r = 0; r < 8; ++r) {  // 2 KV heads on 8 ranks: each replicated on 4
    const auto s = TensorParallelShard::of(32, 2, r, 8);
    EXPECT_EQ(s.num_heads, 4);
    EXPECT_EQ(s.num_kv_heads, 1);
    EXPECT_EQ(s.kv_head_begin, r / 4);
    // Every query head of the rank uses that KV head globally.
    EXPECT_EQ((s.head_begin + s.num_heads - 1) / 16, s.kv_head_begin);
  }
  EXPECT_ERROR(TensorParallelShard::of(30, 2, 0, 4), InvalidArgument,
               "num_heads (30) must be divisible by the tensor-parallel world size (4)");
  EXPECT_ERROR(TensorParallelShard::of(24, 6, 0, 4), InvalidArgument,
               "num_kv_heads (6) must divide or be divisible");
  EXPECT_ERROR(TensorParallelShard::of(32, 8, 4, 4), InvalidArgument,
               "tensor-parallel rank (4) must be in [0, 4)");
}

Tensor random_host(const std::vector<int64_t>& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < t.view().numel(); ++i) static_cast<float*>(t.data())[i] = dist(rng);
  return t;
}

// Two steps (prefill of two requests, then a decode and a chunk) through `layers` layers that
// each see `q`/`k`/`v` through `feed`, writing into `out` through `out_view`.
struct Steps {
  std::vector<StepMetadata> md;
  std::vector<Tensor> q, k, v;
};

Steps make_steps(int hq, int hk, int d, std::mt19937& rng) {
  Steps s;
  s.md.push_back(MetadataBuilder(16).add({0, 20, {1, 2}}).add({0, 9, {3}}).build());
  s.md.push_back(MetadataBuilder(16).add({20, 1, {1, 2}}).add({9, 5, {3}}).build());
  for (const StepMetadata& m : s.md) {
    const int64_t t = m.view().num_actual_tokens;
    s.q.push_back(random_host({t, int64_t(hq) * d}, rng));
    s.k.push_back(random_host({t, int64_t(hk) * d}, rng));
    s.v.push_back(random_host({t, int64_t(hk) * d}, rng));
  }
  return s;
}

TEST(TensorParallel, RanksGatheredEqualOneRank) {
  std::mt19937 rng(9);
  struct Shape {
    int hq, hk, world;
    bool alibi, sinks;
  };
  for (const Shape sh : {Shape{8, 4, 2, false, false}, Shape{8, 2, 4, true, false},
                         Shape{8, 1, 4, false, true}, Shape{16, 2, 8, false, false}}) {
    const int d = 32;
    const Steps steps = make_steps(sh.hq, sh.hk, d, rng);
    for (const Backend* backend : default_registry().backends()) {
      AttentionOptions o;
      o.num_heads = sh.hq;
      o.num_kv_heads = sh.hk;
      o.head_size = d;
      o.scale = 0.2f;
      o.dtype = DType::kF32;
      o.prefix = "model.layers.0.attn";
      o.attn_backend = std::string(backend->name());
      if (sh.alibi) o.alibi_slopes = alibi_slopes(sh.hq);
      if (sh.sinks) {
        for (int h = 0; h < sh.hq; ++h) o.sinks.push_back(0.3f * float(h) - 1.0f);
      }
      {
        ForwardContext probe_ctx;
        AttentionOptions probe = o;
        probe.attn_backend.reset();
        if (!backend->check({Attention(probe_ctx, probe).config(), Device::cpu()}).empty())
          continue;
      }
      // One rank.
      std::vector<Tensor> want;
      {
        ForwardContext ctx;
        Attention layer(ctx, o);
        KVCache cache = KVCache::allocate(layer.config(), 6);
        layer.bind_kv_cache({cache.view()});
        for (size_t i = 0; i < steps.md.size(); ++i) {
          const AttentionMetadata md = steps.md[i].view();
          ctx.begin_step({&md});
          want.push_back(layer.forward(steps.q[i].view(), steps.k[i].view(), steps.v[i].view()));
          ctx.end_step();
        }
      }
      // N ranks, outputs written into their columns of one gathered tensor per step.
      std::vector<Tensor> got;
      for (size_t i = 0; i < steps.md.size(); ++i) {
        got.push_back(Tensor::zeros(want[i].view().shape_vector(), DType::kF32));
      }
      for (int r = 0; r < sh.world; ++r) {
        const auto shard = TensorParallelShard::of(sh.hq, sh.hk, r, sh.world);
        ForwardContext ctx;
        Attention layer(ctx, shard_options(o, shard));
        KVCache cache = KVCache::allocate(layer.config(), 6);
        layer.bind_kv_cache({cache.view()});
        for (size_t i = 0; i < steps.md.size(); ++i) {
          const AttentionMetadata md = steps.md[i].view();
          ctx.begin_step({&md});
          layer.forward(
              shard_query(steps.q[i].view(), shard, d), shard_kv(steps.k[i].view(), shard, d),
              shard_kv(steps.v[i].view(), shard, d), shard_query(got[i].view(), shard, d));
          ctx.end_step();
        }
      }
      for (size_t i = 0; i < steps.md.size(); ++i) {
        const ErrorStats e = compare(got[i].view(), want[i].view());
        // Each head is computed by the same code on the same inputs either way.
        EXPECT_LE(e.max_abs, 1e-6 * std::max(1.0, e.max_ref))
            << backend->name() << " hq " << sh.hq << " hk " << sh.hk << " world " << sh.world
            << " step " << i << ": " << e.to_string();
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn

namespace pagedattn {
namespace {

TEST(DecodeContextParallel, SpreadsTokensRoundRobin) {
  const auto d = DecodeContextParallel::of(1, 3);
  EXPECT_EQ(d.local_len(0), 0);
  EXPECT_EQ(d.local_len(1), 0);
  EXPECT_EQ(d.local_len(2), 1);  // position 1
  EXPECT_EQ(d.local_len(8), 3);  // positions 1, 4, 7
  EXPECT_TRUE(d.owns(7));
  EXPECT_EQ(d.local_pos(7), 2);
  EXPECT_ERROR(DecodeContextParallel::of(3, 3), InvalidArgument,
               "decode-context-parallel rank (3) must be in [0, 3)");
  EXPECT_ERROR(dcp_decode_metadata({{0, {1}}}, 16, d), InvalidArgument,
               "needs >= 3 tokens per request");
  AttentionConfig c;
  c.num_heads = 4;
  c.num_kv_heads = 1;
  c.head_size = 16;
  c.scale = 0.25f;
  c.sliding_window = 8;
  c.sinks = {0, 0, 0, 0};
  const auto why = DecodeContextParallel::unsupported(c);
  ASSERT_EQ(why.size(), 2u);
  EXPECT_EQ(why[0], "a sliding window needs global key positions");
}

// A decode step of three requests (contexts 37, 5 and 64) over a cache spread on `world` ranks,
// each rank's (output, LSE) merged by merge_states, against the same backend on one rank.
TEST(DecodeContextParallel, MergedRanksEqualOneRank) {
  std::mt19937 rng(21);
  const int hq = 8, hk = 2, d = 32, bs = 16;
  const std::vector<int> contexts = {37, 5, 64};
  int64_t ctx_tokens = 0;
  for (int c : contexts) ctx_tokens += c;
  const Tensor ctx_k = random_host({ctx_tokens, hk, d}, rng),
               ctx_v = random_host({ctx_tokens, hk, d}, rng);
  const int64_t nreq = int64_t(contexts.size());
  const Tensor new_k = random_host({nreq, hk, d}, rng), new_v = random_host({nreq, hk, d}, rng);
  const Tensor q = random_host({nreq, hq, d}, rng);
  AttentionConfig c;
  c.num_heads = hq;
  c.num_kv_heads = hk;
  c.head_size = d;
  c.scale = 0.18f;
  c.dtype = DType::kF32;
  c.block_size = bs;
  c.logits_soft_cap = 20.0f;  // position-free features work under DCP
  ASSERT_TRUE(DecodeContextParallel::unsupported(c).empty());
  for (const Backend* backend : default_registry().backends()) {
    if (!backend->check({c, Device::cpu()}).empty()) continue;
    const auto impl = backend->make_impl(c, Device::cpu());
    // One rank: every token in one cache.
    Tensor want = Tensor::empty({nreq, hq, d}, DType::kF32);
    {
      KVCache cache = KVCache::allocate(c, 16);
      MetadataBuilder prefill(bs), decode(bs);
      int next_block = 1;
      for (int ctx : contexts) {
        std::vector<int32_t> ids;
        for (int i = 0; i < (ctx + 1 + bs - 1) / bs; ++i) ids.push_back(next_block++);
        prefill.add({0, ctx, ids});
        decode.add({ctx, 1, ids});
      }
      const StepMetadata pm = prefill.build(), dm = decode.build();
      const AttentionMetadata pv = pm.view(), dv = dm.view();
      impl->write_kv({ctx_k.view(), ctx_v.view(), pv.slot_mapping, cache.view(), {}, {}});
      impl->write_kv({new_k.view(), new_v.view(), dv.slot_mapping, cache.view(), {}, {}});
      const auto plan = backend->plan(dv, c);
      ForwardArgs f;
      f.query = q.view();
      f.kv_cache = cache.view();
      f.metadata = &dv;
      f.output = want.view();
      f.plan = plan.get();
      std::vector<uint8_t> ws(plan->workspace_bytes());
      f.workspace = {ws.data(), ws.size()};
      impl->forward(f);
    }
    for (int world : {2, 3, 4}) {
      Tensor merged, merged_lse;
      for (int r = 0; r < world; ++r) {
        const auto dcp = DecodeContextParallel::of(r, world);
        KVCache cache = KVCache::allocate(c, 16);
        std::vector<DcpDecodeRequest> reqs;
        std::vector<int64_t> slots;
        int next_block = 1;
        for (int ctx : contexts) {
          DcpDecodeRequest req{ctx, {}};
          for (int64_t i = 0; i < (dcp.local_len(ctx + 1) + bs - 1) / bs; ++i) {
            req.local_block_ids.push_back(next_block++);
          }
          dcp_prefill_slots(ctx, req.local_block_ids, bs, dcp, slots);
          reqs.push_back(req);
        }
        const Tensor slot_t = Tensor::empty({int64_t(slots.size())}, DType::kI64);
        std::copy(slots.begin(), slots.end(), static_cast<int64_t*>(slot_t.data()));
        impl->write_kv({ctx_k.view(), ctx_v.view(), slot_t.view(), cache.view(), {}, {}});
        const StepMetadata dm = dcp_decode_metadata(reqs, bs, dcp);
        const AttentionMetadata dv = dm.view();
        impl->write_kv({new_k.view(), new_v.view(), dv.slot_mapping, cache.view(), {}, {}});
        Tensor out = Tensor::empty({nreq, hq, d}, DType::kF32);
        Tensor lse = Tensor::empty({hq, nreq}, DType::kF32);
        const auto plan = backend->plan(dv, c);
        ForwardArgs f;
        f.query = q.view();
        f.kv_cache = cache.view();
        f.metadata = &dv;
        f.output = out.view();
        f.lse = lse.view();
        f.plan = plan.get();
        std::vector<uint8_t> ws(plan->workspace_bytes());
        f.workspace = {ws.data(), ws.size()};
        impl->forward(f);
        if (r == 0) {
          merged = std::move(out);
          merged_lse = std::move(lse);
          continue;
        }
        Tensor next = Tensor::empty({nreq, hq, d}, DType::kF32);
        Tensor next_lse = Tensor::empty({hq, nreq}, DType::kF32);
        backend->merge_states({merged.view(),
                               merged_lse.view(),
                               out.view(),
                               lse.view(),
                               next.view(),
                               next_lse.view(),
                               {}});
        merged = std::move(next);
        merged_lse = std::move(next_lse);
      }
      const ErrorStats e = compare(merged.view(), want.view());
      EXPECT_LE(e.max_abs, 2e-6 * std::max(1.0, e.max_ref))
          << backend->name() << " world " << world << ": " << e.to_string();
    }
  }
}

}  // namespace
}  // namespace pagedattn
