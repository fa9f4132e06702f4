// The seeded request stream of `pagedattn run` and the model presets.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "sim/presets.h"
#include "sim/workload.h"

namespace pagedattn::sim {
namespace {

bool same(const std::vector<WorkloadRequest>& a, const std::vector<WorkloadRequest>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].arrival_step != b[i].arrival_step || a[i].prompt != b[i].prompt ||
        a[i].output_len != b[i].output_len || a[i].shared_prefix != b[i].shared_prefix) {
      return false;
    }
  }
  return true;
}

TEST(SimWorkload, SameSeedSameStreamOtherSeedOtherStream) {
  WorkloadOptions o;
  o.seed = 42;
  const auto a = make_workload(o), b = make_workload(o);
  EXPECT_TRUE(same(a, b));
  o.seed = 43;
  EXPECT_FALSE(same(a, make_workload(o)));
  EXPECT_EQ(sample_token(1, 2, 3, 1000), sample_token(1, 2, 3, 1000));
  EXPECT_NE(sample_token(1, 2, 3, 1 << 30), sample_token(1, 2, 4, 1 << 30));
}

TEST(SimWorkload, LengthsArrivalsAndTokensStayInBounds) {
  WorkloadOptions o;
  o.num_requests = 200;
  o.max_model_len = 300;
  o.prompt_len_median = 150;  // long tails get clipped
  o.prompt_len_sigma = 1.5;
  o.vocab_size = 50;
  o.arrival_rate = 3;
  const auto w = make_workload(o);
  ASSERT_EQ(w.size(), 200u);
  int last_arrival = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const WorkloadRequest& r = w[i];
    EXPECT_EQ(r.id, int(i));
    EXPECT_GE(r.prompt.size(), 1u);
    EXPECT_GE(r.output_len, 1);
    EXPECT_LE(int64_t(r.prompt.size()) + r.output_len, o.max_model_len);
    EXPECT_GE(r.arrival_step, last_arrival);
    last_arrival = r.arrival_step;
    for (const int32_t t : r.prompt) EXPECT_TRUE(t >= 0 && t < 50);
  }
  // About 3 arrivals per step: 200 requests span roughly 67 steps.
  EXPECT_GT(last_arrival, 40);
  EXPECT_LT(last_arrival, 100);
  o.arrival_rate = 0;
  for (const WorkloadRequest& r : make_workload(o)) EXPECT_EQ(r.arrival_step, 0);
}

TEST(SimWorkload, SharedPrefixesStartTheirRequests) {
  WorkloadOptions o;
  o.num_requests = 20;
  o.shared_prefix_fraction = 0.5;
  o.num_shared_prefixes = 2;
  const auto w = make_workload(o);
  std::map<int, std::vector<const WorkloadRequest*>> by_prefix;
  int shared = 0;
  for (const WorkloadRequest& r : w) {
    if (r.shared_prefix >= 0) {
      ++shared;
      by_prefix[r.shared_prefix].push_back(&r);
    }
  }
  EXPECT_EQ(shared, 10) << "round(0.5 * 20)";
  for (const auto& [p, rs] : by_prefix) {
    ASSERT_GE(rs.size(), 2u) << "prefix " << p;
    // Requests of one prefix agree on a common head of at least 16 tokens.
    size_t common = rs[0]->prompt.size();
    for (const WorkloadRequest* r : rs) {
      const auto diff = std::mismatch(rs[0]->prompt.begin(), rs[0]->prompt.end(), r->prompt.begin(),
                                      r->prompt.end());
      common = std::min(common, size_t(diff.first - rs[0]->prompt.begin()));
    }
    EXPECT_GE(common, 16u) << "prefix " << p;
  }
}

TEST(SimWorkload, ValidationNamesTheOption) {
  WorkloadOptions o;
  o.num_requests = 0;
  EXPECT_ERROR(make_workload(o), InvalidArgument, "--num-requests (0)");
  o = {};
  o.shared_prefix_fraction = 1.5;
  EXPECT_ERROR(make_workload(o), InvalidArgument, "--shared-prefix-fraction (1.5)");
  o = {};
  o.arrival_rate = -1;
  EXPECT_ERROR(make_workload(o), InvalidArgument, "--arrival-rate (-1)");
}

TEST(SimPresets, ShapesOfTheNamedModels) {
  const ModelPreset& llama = find_preset("llama-3-8b");
  EXPECT_EQ(llama.num_layers, 32);
  EXPECT_EQ(llama.num_heads, 32);
  EXPECT_EQ(llama.num_kv_heads, 8);
  EXPECT_EQ(llama.head_size, 128);
  EXPECT_FALSE(llama.sliding_window_of(0));
  const ModelPreset& gemma = find_preset("gemma-2-9b");
  EXPECT_EQ(gemma.num_layers, 42);
  EXPECT_FLOAT_EQ(gemma.scale, 1.0f / 16.0f);
  EXPECT_EQ(gemma.logits_soft_cap, 50.0f);
  EXPECT_EQ(gemma.sliding_window_of(0), 4096);
  EXPECT_FALSE(gemma.sliding_window_of(1));
  const ModelPreset& mistral = find_preset("mistral-7b");
  for (int i = 0; i < mistral.num_layers; ++i) EXPECT_EQ(mistral.sliding_window_of(i), 4096);
  const ModelPreset& oss = find_preset("gpt-oss-20b");
  EXPECT_TRUE(oss.sinks);
  EXPECT_EQ(oss.num_heads, 64);
  EXPECT_EQ(oss.head_size, 64);
  EXPECT_EQ(oss.sliding_window_of(2), 128);
  EXPECT_FALSE(oss.sliding_window_of(3));
  const ModelPreset& qwen = find_preset("qwen2.5-7b");
  EXPECT_EQ(qwen.num_layers, 28);
  EXPECT_EQ(qwen.num_kv_heads, 4);
  // DeepSeek-V3's MLA sizes (spec 5.1), its YaRN-scaled softmax scale, and the scale-down.
  const ModelPreset& dsv3 = find_preset("deepseek-v3");
  ASSERT_TRUE(dsv3.mla);
  EXPECT_EQ(dsv3.mla->qk_nope_head_dim, 128);
  EXPECT_EQ(dsv3.mla->qk_rope_head_dim, 64);
  EXPECT_EQ(dsv3.mla->v_head_dim, 128);
  EXPECT_EQ(dsv3.mla->kv_lora_rank, 512);
  EXPECT_EQ(dsv3.mla->q_lora_rank, 1536);
  EXPECT_EQ(dsv3.num_kv_heads, 1);
  EXPECT_EQ(dsv3.head_size, 576);
  EXPECT_NEAR(dsv3.scale, 0.1352338, 1e-6);  // (1 + 0.1 ln 40)^2 / sqrt(192)
  EXPECT_EQ(dsv3.model_num_layers, 61);
  EXPECT_EQ(dsv3.model_num_heads, 128);
  EXPECT_LT(dsv3.num_layers, dsv3.model_num_layers);
  EXPECT_LT(dsv3.num_heads, dsv3.model_num_heads);
  EXPECT_FALSE(dsv3.scaled_down_reason.empty());
  EXPECT_FALSE(llama.mla);
  EXPECT_EQ(find_preset("tiny").num_layers, 2);
  EXPECT_EQ(ModelPreset::layer_name(3), "model.layers.3.self_attn.attn");
  EXPECT_ERROR(find_preset("llama-2"), InvalidArgument,
               "--preset 'llama-2' is not a model preset; valid presets: llama-3-8b, qwen2.5-7b, "
               "mistral-7b, gemma-2-9b, gpt-oss-20b, deepseek-v3, tiny");
}

}  // namespace
}  // namespace pagedattn::sim
