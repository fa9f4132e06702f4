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

  // The backend-level configuration of a rank: its heads and its slices of slopes and sinks.
  AttentionConfig c;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_size = 16;
  c.scale = 0.25f;
  c.alibi_slopes = alibi_slopes(8);
  c.sinks = {0, 1, 2, 3, 4, 5, 6, 7};
  const auto s2 = TensorParallelShard::of(8, 2, 2, 4);
  const AttentionConfig r = shard_config(c, s2);
  EXPECT_EQ(r.num_heads, 2);
  EXPECT_EQ(r.num_kv_heads, 1);
  EXPECT_EQ(r.sinks, (std::vector<float>{4, 5}));
  EXPECT_EQ(r.alibi_slopes, (std::vector<float>{c.alibi_slopes[4], c.alibi_slopes[5]}));
  c.num_kv_heads = 8;
  EXPECT_ERROR(shard_config(c, s2), InvalidArgument,
               "shard was made for another head configuration (num_heads 8, num_kv_heads 8)");
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
  ASSERT_EQ(why.size(), 1u);  // sinks are supported: rank 0 carries them
  EXPECT_EQ(why[0], "a sliding window needs global key positions");
  EXPECT_ERROR(dcp_config(c, d), InvalidArgument,
               "does not support this layer: a sliding window needs global key positions");
  c.sliding_window.reset();
  EXPECT_TRUE(dcp_config(c, d).sinks.empty());
  EXPECT_EQ(dcp_config(c, DecodeContextParallel::of(0, 3)).sinks, c.sinks);
  c.alibi_slopes = alibi_slopes(4);
  c.attn_type = AttentionType::kEncoderDecoder;
  EXPECT_EQ(
      DecodeContextParallel::unsupported(c),
      (std::vector<std::string>{"cross attention (encoder_decoder) keeps its encoder keys whole",
                                "ALiBi biases need global key positions"}));
  c.attn_type = AttentionType::kEncoderOnly;
  EXPECT_EQ(DecodeContextParallel::unsupported(c)[0],
            "encoder_only attention has no KV cache to spread");

  // The layer's options: the window comes from the cache config when the layer has none.
  AttentionOptions o;
  o.num_heads = 4;
  o.head_size = 16;
  o.scale = 0.25f;
  o.sinks = {1, 2, 3, 4};
  o.cache_config = CacheConfig{};
  o.cache_config->sliding_window = 64;
  EXPECT_ERROR(dcp_options(o, d), InvalidArgument, "a sliding window needs global key positions");
  o.cache_config->sliding_window.reset();
  EXPECT_TRUE(dcp_options(o, d).sinks.empty());
  EXPECT_EQ(dcp_options(o, DecodeContextParallel::of(0, 3)).sinks, o.sinks);
  o.alibi_slopes = alibi_slopes(4);
  EXPECT_ERROR(dcp_options(o, d), InvalidArgument, "ALiBi biases need global key positions");
}

// Rank 1 of 3, block size 2: a chunk of 5 tokens over a context of 1 (positions 1..5; the rank
// holds positions 1 and 4) and a first token (position 0, held by rank 0 only).
TEST(DecodeContextParallel, StepMetadataGivesEachRowItsVisibleLocalKeys) {
  const auto d = DecodeContextParallel::of(1, 3);
  const DcpStep step = dcp_step_metadata({{1, 5, {7, 9}}, {0, 1, {}}}, 2, d);
  const StepMetadata& m = step.metadata;
  EXPECT_EQ(m.query_start_loc, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  // Positions 1, 2, 3 see local key 0 (position 1); 4 and 5 see local keys 0 and 1.
  EXPECT_EQ(m.seq_lens, (std::vector<int32_t>{1, 1, 1, 2, 2, 1}));
  // Positions 1 and 4 are written to their local slots 0 and 1 of block 7; the rest nowhere.
  EXPECT_EQ(m.slot_mapping, (std::vector<int64_t>{14, -1, -1, 15, -1, -1}));
  EXPECT_EQ(m.block_table, (std::vector<int32_t>{7, 7, 7, 7, 7, 0}));
  EXPECT_TRUE(m.causal);
  EXPECT_EQ(step.empty_rows, (std::vector<int32_t>{5}));
  validate_metadata(m.view(), AttentionType::kDecoder, {10, 2});

  // Rank 0 holds position 0 and 3: the first token is its own.
  const DcpStep r0 =
      dcp_step_metadata({{1, 5, {4}}, {0, 1, {6}}}, 2, DecodeContextParallel::of(0, 3));
  EXPECT_EQ(r0.metadata.seq_lens, (std::vector<int32_t>{1, 1, 2, 2, 2, 1}));
  EXPECT_EQ(r0.metadata.slot_mapping, (std::vector<int64_t>{-1, -1, 9, -1, -1, 12}));
  EXPECT_TRUE(r0.empty_rows.empty());

  EXPECT_ERROR(dcp_step_metadata({{1, 5, {}}}, 2, d), InvalidArgument,
               "request 0: local_block_ids has 0 blocks; rank 1 of 3 holds 2 of its 6 tokens "
               "and needs 1");
  EXPECT_ERROR(dcp_step_metadata({{0, 1, {1}}, {3, -1, {1}}}, 2, d), InvalidArgument,
               "request 1: context_len (3) and num_new_tokens (-1) must be >= 0");
  EXPECT_ERROR(dcp_step_metadata({}, 0, d), InvalidArgument, "block_size (0) must be >= 1");
}

TEST(DecodeContextParallel, ClearEmptyRowsWritesNoKeys) {
  const DcpStep step = dcp_step_metadata({{0, 3, {1}}}, 4, DecodeContextParallel::of(2, 4));
  ASSERT_EQ(step.empty_rows, (std::vector<int32_t>{0, 1}));  // positions 0 and 1 precede rank 2
  std::mt19937 rng(5);
  Tensor out = test::random_f32({3, 2, 4}, rng), lse = test::random_f32({2, 3}, rng);
  const float kept = static_cast<const float*>(out.data())[2 * 8];
  const float kept_lse = static_cast<const float*>(lse.data())[2];
  dcp_clear_empty_rows(step, out.view(), lse.view());
  const auto* o = static_cast<const float*>(out.data());
  const auto* l = static_cast<const float*>(lse.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(o[i], 0.0f);
  EXPECT_EQ(o[16], kept);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(l[h * 3 + 0], -INFINITY);
    EXPECT_EQ(l[h * 3 + 1], -INFINITY);
  }
  EXPECT_EQ(l[2], kept_lse);
  // [T, H*D] outputs work too; rows past the tensors are refused.
  Tensor flat = test::random_f32({3, 8}, rng);
  dcp_clear_empty_rows(step, flat.view(), lse.view());
  EXPECT_EQ(static_cast<const float*>(flat.data())[15], 0.0f);
  EXPECT_ERROR(dcp_clear_empty_rows(step, out.view().slice(0, 0, 1), lse.view()), InvalidArgument,
               "empty row 1 is past the output (1 rows)");
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

// Prefill chunks and decodes over four steps through the Attention layer (dcp_options,
// dcp_step_metadata, dcp_clear_empty_rows; outputs and the cache poisoned with NaN), merged over
// 2, 3 and 4 ranks, against the same backend on one rank: output and LSE of every step, with
// and without sinks.
TEST(DecodeContextParallel, PrefillChunksMergedEqualOneRank) {
  for (const bool sinks : {false, true}) {
    const test::DcpChunkScenario s = test::make_dcp_chunk_scenario(sinks, sinks ? 42 : 41);
    for (const Backend* backend : default_registry().backends()) {
      AttentionConfig probe;
      probe.num_heads = s.options.num_heads;
      probe.num_kv_heads = *s.options.num_kv_heads;
      probe.head_size = s.options.head_size;
      probe.scale = s.options.scale;
      probe.dtype = s.options.dtype;
      probe.sinks = s.options.sinks;
      probe.logits_soft_cap = s.options.logits_soft_cap;
      if (!backend->check({probe, Device::cpu()}).empty()) continue;
      const std::string name(backend->name());
      std::vector<Tensor> want, want_lse;
      test::run_dcp_chunks(s, name, nullptr, want, want_lse);
      for (int world : {2, 3, 4}) {
        const auto ranks = static_cast<size_t>(world);
        std::vector<std::vector<Tensor>> outs(ranks), lses(ranks);
        for (int r = 0; r < world; ++r) {
          const auto dcp = DecodeContextParallel::of(r, world);
          test::run_dcp_chunks(s, name, &dcp, outs[size_t(r)], lses[size_t(r)]);
        }
        for (size_t i = 0; i < want.size(); ++i) {
          std::vector<Tensor> step_outs, step_lses;
          for (int r = 0; r < world; ++r) {
            step_outs.push_back(outs[size_t(r)][i]);
            step_lses.push_back(lses[size_t(r)][i]);
          }
          Tensor merged_lse;
          const Tensor merged = test::merge_ranks(*backend, step_outs, step_lses, &merged_lse);
          const ErrorStats e = compare(merged.view(), want[i].view());
          const ErrorStats el = compare(merged_lse.view(), want_lse[i].view());
          EXPECT_TRUE(e.mismatched_nonfinite == 0 && e.max_abs <= 2e-6 * std::max(1.0, e.max_ref))
              << name << " sinks " << sinks << " world " << world << " step " << i << ": "
              << e.to_string();
          EXPECT_TRUE(el.mismatched_nonfinite == 0 &&
                      el.max_abs <= 2e-6 * std::max(1.0, el.max_ref))
              << name << " sinks " << sinks << " world " << world << " step " << i
              << " lse: " << el.to_string();
        }
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn
