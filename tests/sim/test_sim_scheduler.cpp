// Continuous batching: token budget, decodes first, chunked prefill, prefix hits, preemption
// and requeue, and sliding-window groups giving blocks back (spec 2.4, 3.7, 7.3).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"
#include "sim/scheduler.h"

namespace pagedattn::sim {
namespace {

std::vector<int32_t> tokens(int n, int32_t first = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

int32_t fake_sample(const Request& r) {
  return 100000 + r.num_tokens();
}

SchedulerConfig config(int block_size, int budget,
                       std::vector<std::optional<int>> windows = {std::nullopt}) {
  SchedulerConfig c;
  c.block_size = block_size;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 8;
  c.max_model_len = 512;
  c.group_windows = std::move(windows);
  return c;
}

// Every scheduled request's block table covers its sequence, and the step's metadata passes the
// library's own validation for each group.
void expect_valid_step(const Scheduler& s, const SchedulerOutput& out) {
  const int bs = s.config().block_size;
  for (size_t g = 0; g < s.config().group_windows.size(); ++g) {
    MetadataBuilder b(bs);
    for (const ScheduledRequest& r : out.requests) {
      const int seq_len = r.context_len + r.num_new_tokens;
      EXPECT_GE(int(r.block_ids[g].size()), (seq_len + bs - 1) / bs);
      b.add({r.context_len, r.num_new_tokens, r.block_ids[g]});
    }
    const StepMetadata md = b.build();
    validate_metadata(md.view(), AttentionType::kDecoder, {s.pool().num_blocks(), bs});
  }
}

// Runs steps until every request finished; returns the outputs.
std::vector<SchedulerOutput> run_to_completion(Scheduler& s, int max_steps = 1000) {
  std::vector<SchedulerOutput> outs;
  while (s.has_unfinished()) {
    EXPECT_LT(int(outs.size()), max_steps) << "no progress";
    if (int(outs.size()) >= max_steps) break;
    outs.push_back(s.schedule());
    expect_valid_step(s, outs.back());
    s.update(outs.back(), fake_sample);
  }
  return outs;
}

TEST(SimScheduler, RespectsTheTokenBudgetAndMaxNumSeqs) {
  SchedulerConfig c = config(4, 32);
  c.max_num_seqs = 3;
  Scheduler s(c, 200);
  for (int i = 0; i < 6; ++i) s.add_request(i, tokens(20 + i, 1000 * (i + 1)), 5);
  const SchedulerOutput first = s.schedule();
  // 20 tokens of request 0, then a 12-token chunk of request 1.
  ASSERT_EQ(first.requests.size(), 2u);
  EXPECT_EQ(first.requests[0].num_new_tokens, 20);
  EXPECT_EQ(first.requests[1].num_new_tokens, 12);
  EXPECT_EQ(first.num_scheduled_tokens(), 32);
  s.update(first, fake_sample);
  for (const SchedulerOutput& out : run_to_completion(s)) {
    EXPECT_LE(out.num_scheduled_tokens(), 32);
    EXPECT_GE(out.num_scheduled_tokens(), 1);
    EXPECT_LE(int(out.requests.size()), 3);
  }
  EXPECT_EQ(s.pool().num_used_blocks(), 0) << "every block came back";
  for (int i = 0; i < 6; ++i) EXPECT_EQ(s.request(i).num_output_tokens(), 5);
}

TEST(SimScheduler, SchedulesDecodesBeforePrefills) {
  Scheduler s(config(4, 16), 100);
  s.add_request(0, tokens(4), 10);
  SchedulerOutput out = s.schedule();
  s.update(out, fake_sample);  // request 0 is now decoding
  s.add_request(1, tokens(100, 500), 3);
  s.add_request(2, tokens(3, 900), 3);
  out = s.schedule();
  ASSERT_EQ(out.requests.size(), 2u);
  EXPECT_EQ(out.requests[0].request_id, 0);
  EXPECT_TRUE(out.requests[0].is_decode);
  EXPECT_EQ(out.requests[0].context_len, 4);
  EXPECT_EQ(out.requests[1].request_id, 1);
  EXPECT_EQ(out.requests[1].num_new_tokens, 15) << "the prefill takes what the decode left";
  EXPECT_EQ(out.num_decode_tokens, 1);
  EXPECT_EQ(out.num_prefill_tokens, 15);
  s.update(out, fake_sample);
  out = s.schedule();
  // Order: the decode of 0, then the running prefill of 1 (fills the budget); 2 waits.
  ASSERT_EQ(out.requests.size(), 2u);
  EXPECT_TRUE(out.requests[0].is_decode);
  EXPECT_FALSE(out.requests[1].is_decode);
  EXPECT_EQ(s.num_waiting(), 1);
}

TEST(SimScheduler, ChunksALongPromptOverSeveralSteps) {
  Scheduler s(config(16, 32), 100);
  s.add_request(7, tokens(100), 2);
  const int expected_ctx[] = {0, 32, 64, 96};
  const int expected_new[] = {32, 32, 32, 4};
  for (int i = 0; i < 4; ++i) {
    const SchedulerOutput out = s.schedule();
    ASSERT_EQ(out.requests.size(), 1u);
    const ScheduledRequest& r = out.requests[0];
    EXPECT_EQ(r.context_len, expected_ctx[i]);
    EXPECT_EQ(r.num_new_tokens, expected_new[i]);
    EXPECT_FALSE(r.is_decode);
    EXPECT_EQ(int(r.block_ids[0].size()), (r.context_len + r.num_new_tokens + 15) / 16);
    expect_valid_step(s, out);
    s.update(out, fake_sample);
  }
  EXPECT_EQ(s.stats().partial_prefill_chunks, 3);
  EXPECT_EQ(s.request(7).num_output_tokens(), 1) << "the last chunk produced a token";
  const SchedulerOutput decode = s.schedule();
  ASSERT_EQ(decode.requests.size(), 1u);
  EXPECT_TRUE(decode.requests[0].is_decode);
  EXPECT_EQ(decode.requests[0].context_len, 100);
  s.update(decode, fake_sample);
  EXPECT_FALSE(s.has_unfinished());
}

TEST(SimScheduler, ReusesTheLongestCachedPrefixOfFullBlocks) {
  Scheduler s(config(4, 64), 50);
  std::vector<int32_t> a = tokens(10);
  s.add_request(0, a, 1);
  const SchedulerOutput first = s.schedule();
  const std::vector<int32_t> a_blocks = first.requests[0].block_ids[0];
  s.update(first, fake_sample);  // finished after one token; blocks 0..1 stay cached
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.pool().num_cached_blocks(), 2);

  // Same first 8 tokens (2 full blocks), then different ones.
  std::vector<int32_t> b(a.begin(), a.begin() + 8);
  b.insert(b.end(), {77, 78, 79});
  s.add_request(1, b, 3);
  // A copy of a's first block only: its second block differs in one token.
  std::vector<int32_t> c(a.begin(), a.begin() + 4);
  c.insert(c.end(), {5, 6, 7, 99, 1});
  s.add_request(2, c, 3);
  // Exactly the 8 cached tokens: the hit is capped so that one token is computed.
  s.add_request(3, std::vector<int32_t>(a.begin(), a.begin() + 8), 3);
  const SchedulerOutput out = s.schedule();
  ASSERT_EQ(out.requests.size(), 3u);
  EXPECT_EQ(out.requests[0].prefix_hit_tokens, 8);
  EXPECT_EQ(out.requests[0].context_len, 8);
  EXPECT_EQ(out.requests[0].num_new_tokens, 3);
  EXPECT_EQ(out.requests[0].block_ids[0][0], a_blocks[0]);
  EXPECT_EQ(out.requests[0].block_ids[0][1], a_blocks[1]);
  EXPECT_EQ(out.requests[1].prefix_hit_tokens, 4);
  EXPECT_EQ(out.requests[1].block_ids[0][0], a_blocks[0]);
  EXPECT_NE(out.requests[1].block_ids[0][1], a_blocks[1]);
  EXPECT_EQ(out.requests[2].prefix_hit_tokens, 4);
  EXPECT_EQ(out.requests[2].num_new_tokens, 4);
  EXPECT_EQ(s.pool().ref_count(a_blocks[0]), 3) << "shared by three running requests";
  EXPECT_EQ(s.pool().ref_count(a_blocks[1]), 1);
  EXPECT_EQ(s.stats().prefix_hit_tokens, 16);
  expect_valid_step(s, out);
  s.update(out, fake_sample);
  run_to_completion(s);
  EXPECT_EQ(s.pool().num_used_blocks(), 0);
}

TEST(SimScheduler, NoHitsWithPrefixCachingDisabled) {
  SchedulerConfig c = config(4, 64);
  c.enable_prefix_caching = false;
  Scheduler s(c, 50);
  s.add_request(0, tokens(10), 1);
  s.update(s.schedule(), fake_sample);
  s.add_request(1, tokens(10), 1);
  const SchedulerOutput out = s.schedule();
  EXPECT_EQ(out.requests[0].prefix_hit_tokens, 0);
  EXPECT_EQ(s.pool().num_cached_blocks(), 0);
}

TEST(SimScheduler, PreemptsTheLatestRequestWhenBlocksRunOutAndRecomputesIt) {
  // 6 usable blocks of 4 tokens; two requests of 8 prompt tokens that grow to 20 tokens each.
  Scheduler s(config(4, 64), 7);
  s.add_request(0, tokens(8, 1), 12);
  s.add_request(1, tokens(8, 100), 12);
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(out.requests.size(), 2u);
  EXPECT_EQ(s.pool().num_used_blocks(), 4);
  s.update(out, fake_sample);
  bool seen = false;
  for (int step = 0; step < 100 && !seen; ++step) {
    out = s.schedule();
    expect_valid_step(s, out);
    if (!out.preempted.empty()) {
      seen = true;
      EXPECT_EQ(out.preempted, std::vector<int>{1}) << "the request admitted last goes first";
      EXPECT_EQ(s.waiting().front(), 1);
      EXPECT_EQ(s.request(1).num_computed_tokens, 0);
      EXPECT_TRUE(s.request(1).block_ids[0].empty());
      EXPECT_GT(s.request(1).num_output_tokens(), 0) << "generated tokens are kept";
      ASSERT_EQ(out.requests.size(), 1u);
      EXPECT_EQ(out.requests[0].request_id, 0);
    }
    s.update(out, fake_sample);
  }
  ASSERT_TRUE(seen);
  EXPECT_EQ(s.stats().preemptions, 1);
  const int64_t admissions = s.stats().admissions;
  run_to_completion(s);
  EXPECT_GT(s.stats().admissions, admissions) << "the preempted request was resumed";
  EXPECT_EQ(s.request(0).num_output_tokens(), 12);
  EXPECT_EQ(s.request(1).num_output_tokens(), 12);
  EXPECT_EQ(s.pool().num_used_blocks(), 0);
}

TEST(SimScheduler, SlidingWindowGroupsReleaseBlocksThatLeftTheWindow) {
  // Group 0: window 4; group 1: full attention. Both draw from one pool.
  Scheduler s(config(4, 64, {4, std::nullopt}), 40);
  s.add_request(0, tokens(16), 5);
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(out.requests[0].block_ids[0].size(), 4u);
  EXPECT_EQ(out.requests[0].block_ids[1].size(), 4u);
  EXPECT_EQ(s.pool().num_used_blocks(), 8);
  const std::vector<int32_t> window_blocks = out.requests[0].block_ids[0];
  s.update(out, fake_sample);
  out = s.schedule();  // decode at position 16: keys 13..16 are visible
  const ScheduledRequest& r = out.requests[0];
  ASSERT_TRUE(r.is_decode);
  ASSERT_EQ(r.block_ids[0].size(), 5u);
  // Blocks 0..2 (positions 0..11) fell out of the window: the null block replaces them.
  EXPECT_EQ(r.block_ids[0][0], kNullBlock);
  EXPECT_EQ(r.block_ids[0][1], kNullBlock);
  EXPECT_EQ(r.block_ids[0][2], kNullBlock);
  EXPECT_EQ(r.block_ids[0][3], window_blocks[3]);
  EXPECT_NE(r.block_ids[0][4], kNullBlock);
  for (const int32_t b : r.block_ids[1]) EXPECT_NE(b, kNullBlock) << "full attention keeps all";
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(s.pool().is_free(window_blocks[size_t(j)]));
  EXPECT_EQ(s.stats().window_blocks_released, 3);
  EXPECT_EQ(s.pool().num_used_blocks(), 2 + 5);
  expect_valid_step(s, out);
  s.update(out, fake_sample);
  run_to_completion(s);
  EXPECT_EQ(s.pool().num_used_blocks(), 0);
}

TEST(SimScheduler, SlidingWindowPrefixHitNeedsOnlyTheWindow) {
  Scheduler s(config(4, 64, {4}), 40);
  s.add_request(0, tokens(16), 3);
  run_to_completion(s);
  // Same 16 tokens, then more: the window of position 16 covers block 3 only.
  std::vector<int32_t> b = tokens(16);
  b.insert(b.end(), {50, 51, 52, 53});
  s.add_request(1, b, 1);
  const SchedulerOutput out = s.schedule();
  ASSERT_EQ(out.requests.size(), 1u);
  const ScheduledRequest& r = out.requests[0];
  EXPECT_EQ(r.prefix_hit_tokens, 16);
  EXPECT_EQ(r.block_ids[0][0], kNullBlock);
  EXPECT_EQ(r.block_ids[0][1], kNullBlock);
  EXPECT_EQ(r.block_ids[0][2], kNullBlock);
  EXPECT_NE(r.block_ids[0][3], kNullBlock);
  expect_valid_step(s, out);
}

TEST(SimScheduler, RejectsBadRequestsAndConfigs) {
  Scheduler s(config(4, 64), 10);
  EXPECT_ERROR(s.add_request(0, {}, 1), InvalidArgument, "the prompt is empty");
  EXPECT_ERROR(s.add_request(0, tokens(500), 20), InvalidArgument, "exceeds max_model_len (512)");
  EXPECT_ERROR(s.add_request(0, tokens(5), 0), InvalidArgument, "max_output_len (0)");
  s.add_request(0, tokens(5), 1);
  EXPECT_ERROR(s.add_request(0, tokens(5), 1), InvalidArgument, "request 0 was already added");
  EXPECT_ERROR(Scheduler(config(4, 0), 10), InvalidArgument, "max_num_batched_tokens (0)");
  EXPECT_ERROR(Scheduler(config(4, 8, {0}), 10), InvalidArgument, "group_windows[0] (0)");
}

}  // namespace
}  // namespace pagedattn::sim
