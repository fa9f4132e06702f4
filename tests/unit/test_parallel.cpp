// Tensor parallelism (issue 9, item 1): the head split, and N ranks (each its own context,
// layer and cache, fed views of the full step's tensors) gathered equal one rank, on every CPU
// backend, for GQA, MQA with replicated KV heads, ALiBi and sinks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/expect_error.h"
#include "common/parallel_scenarios.h"
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

TEST(TensorParallel, RanksGatheredEqualOneRank) {
  struct Shape {
    int hq, hk, world;
    bool alibi, sinks;
  };
  uint32_t seed = 9;
  for (const Shape sh : {Shape{8, 4, 2, false, false}, Shape{8, 2, 4, true, false},
                         Shape{8, 1, 4, false, true}, Shape{16, 2, 8, false, false}}) {
    const test::TpScenario s = test::make_tp_scenario(sh.hq, sh.hk, sh.alibi, sh.sinks, seed++);
    for (const Backend* backend : default_registry().backends()) {
      AttentionConfig probe;
      probe.num_heads = sh.hq;
      probe.num_kv_heads = sh.hk;
      probe.head_size = s.options.head_size;
      probe.scale = s.options.scale;
      probe.dtype = DType::kF32;
      if (!backend->check({probe, Device::cpu()}).empty()) continue;
      const std::string name(backend->name());
      std::vector<Tensor> want, got;
      test::run_tp(s, name, nullptr, want);
      for (int r = 0; r < sh.world; ++r) {
        const auto shard = TensorParallelShard::of(sh.hq, sh.hk, r, sh.world);
        test::run_tp(s, name, &shard, got);
      }
      for (size_t i = 0; i < want.size(); ++i) {
        const ErrorStats e = compare(got[i].view(), want[i].view());
        // Each head is computed by the same code on the same inputs either way.
        EXPECT_LE(e.max_abs, 1e-6 * std::max(1.0, e.max_ref))
            << name << " hq " << sh.hq << " hk " << sh.hk << " world " << sh.world << " step " << i
            << ": " << e.to_string();
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
  const test::DcpScenario s = test::make_dcp_scenario(21);
  ASSERT_TRUE(DecodeContextParallel::unsupported(s.config).empty());
  for (const Backend* backend : default_registry().backends()) {
    if (!backend->check({s.config, Device::cpu()}).empty()) continue;
    Tensor want, want_lse;
    test::run_dcp(s, *backend, nullptr, want, want_lse);
    for (int world : {2, 3, 4}) {
      std::vector<Tensor> outs(static_cast<size_t>(world)), lses(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        const auto dcp = DecodeContextParallel::of(r, world);
        test::run_dcp(s, *backend, &dcp, outs[size_t(r)], lses[size_t(r)]);
      }
      const Tensor merged = test::merge_ranks(*backend, outs, lses);
      const ErrorStats e = compare(merged.view(), want.view());
      EXPECT_LE(e.max_abs, 2e-6 * std::max(1.0, e.max_ref))
          << backend->name() << " world " << world << ": " << e.to_string();
    }
  }
}

}  // namespace
}  // namespace pagedattn
