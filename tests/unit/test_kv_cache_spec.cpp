// KV-cache specs (page sizes, per-request bounds, validation) and memory planning (spec 7).
// Every expected number is computed by hand in the comment beside it.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache_spec.h"

namespace pagedattn {
namespace {

using testing::error_of;

constexpr int64_t kMiB = int64_t(1) << 20;
constexpr int64_t kGiB = int64_t(1) << 30;

// Llama-3-8B: Hkv 8, D 128, bf16, block_size 16.
KVCacheSpec llama3_8b_spec() {
  return KVCacheSpec::full(16, 8, 128, DType::kBF16);
}

std::vector<LayerCacheSpec> same_spec_layers(int n, const KVCacheSpec& spec) {
  std::vector<LayerCacheSpec> layers;
  for (int i = 0; i < n; ++i) {
    layers.push_back({"model.layers." + std::to_string(i) + ".self_attn.attn", spec});
  }
  return layers;
}

// Invariants of every plan: each layer is in exactly one group and exactly one tensor, every
// group of the hybrid case shares the page size, and without an override the tensors fit.
void expect_consistent(const KVCachePlan& plan, const std::vector<LayerCacheSpec>& layers,
                       int64_t available_bytes, bool overridden = false) {
  std::map<std::string, int> in_groups, in_tensors;
  for (const KVCacheGroup& g : plan.groups) {
    for (const std::string& n : g.layer_names) ++in_groups[n];
  }
  int64_t total = 0;
  for (const KVCacheTensorPlan& t : plan.tensors) {
    total += t.size_bytes;
    for (const std::string& n : t.shared_by) ++in_tensors[n];
  }
  ASSERT_EQ(in_groups.size(), layers.size());
  ASSERT_EQ(in_tensors.size(), layers.size());
  for (const LayerCacheSpec& l : layers) {
    EXPECT_EQ(in_groups[l.layer_name], 1) << l.layer_name;
    EXPECT_EQ(in_tensors[l.layer_name], 1) << l.layer_name;
  }
  if (!overridden) {
    EXPECT_LE(total, available_bytes);
  }
  EXPECT_GT(plan.num_blocks_per_request, 0);
  EXPECT_DOUBLE_EQ(plan.max_concurrency,
                   double(plan.num_blocks) / double(plan.num_blocks_per_request));
}

// ---------------------------------------------------------------------------------------------
// Specs

TEST(KVCacheSpec, PageSizeLlama3_8B) {
  const KVCacheSpec spec = llama3_8b_spec();
  EXPECT_EQ(spec.page_size_bytes(), 65536);  // 2 * 16 * 8 * 128 * 2
  // All 32 layers: 32 * 65536 = 2 MiB per block of 16 tokens.
  EXPECT_EQ(32 * spec.page_size_bytes(), 2 * kMiB);
  // One request of 8192 tokens: ceil(8192 / 16) = 512 blocks per layer = 32 MiB.
  EXPECT_EQ(spec.max_memory_usage_bytes({8192, 2048, 0}), 512 * 65536);
  // 100 tokens still pin whole blocks: ceil(100 / 16) = 7.
  EXPECT_EQ(spec.max_memory_usage_bytes({100, 2048, 0}), 7 * 65536);
}

TEST(KVCacheSpec, MlaPageHasNoKvFactor) {
  // DeepSeek-V3: kv_lora_rank 512 + rope 64 = 576, one latent entry per token.
  const KVCacheSpec spec = KVCacheSpec::mla(64, 576, DType::kBF16);
  EXPECT_EQ(spec.num_kv_heads, 1);
  EXPECT_EQ(spec.page_size_bytes(), 73728);  // 64 * 1 * 576 * 2, no factor 2
  EXPECT_EQ(KVCacheSpec::mla(16, 576, DType::kBF16).page_size_bytes(), 18432);     // 16 * 576 * 2
  EXPECT_EQ(KVCacheSpec::mla(64, 576, DType::kFp8E4M3).page_size_bytes(), 36864);  // 64 * 576
  // Bounded like full attention: ceil(163840 / 64) = 2560 blocks.
  EXPECT_EQ(spec.max_memory_usage_bytes({163840, 8192, 0}), 2560 * 73728);
}

TEST(KVCacheSpec, DtypeSizes) {
  // 2 * 16 * 8 * 128 = 32768 elements per page.
  EXPECT_EQ(KVCacheSpec::full(16, 8, 128, DType::kFp8E4M3).page_size_bytes(), 32768);
  EXPECT_EQ(KVCacheSpec::full(16, 8, 128, DType::kFp8E5M2).page_size_bytes(), 32768);
  EXPECT_EQ(KVCacheSpec::full(16, 8, 128, DType::kU8).page_size_bytes(), 32768);
  EXPECT_EQ(KVCacheSpec::full(16, 8, 128, DType::kF16).page_size_bytes(), 65536);
  EXPECT_EQ(KVCacheSpec::full(16, 8, 128, DType::kF32).page_size_bytes(), 131072);
}

TEST(KVCacheSpec, SlidingWindowBound) {
  const KVCacheSpec spec = KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 4096);
  EXPECT_EQ(spec.page_size_bytes(), 65536);
  // min(4095 + 2048, 32768) = 6143 tokens -> ceil(6143 / 16) = 384 blocks, + 1 = 385.
  EXPECT_EQ(spec.max_memory_usage_bytes({32768, 2048, 0}), 385 * 65536);
  // Capped at M: min(6143, 1000) = 1000 -> ceil(1000 / 16) = 63, + 1 = 64.
  EXPECT_EQ(spec.max_memory_usage_bytes({1000, 2048, 0}), 64 * 65536);
  // Window 1 keeps only the step's tokens: min(0 + 32, 4096) = 32 -> 2 blocks, + 1 = 3.
  EXPECT_EQ(KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 1).max_memory_usage_bytes({4096, 32, 0}),
            3 * 65536);
}

TEST(KVCacheSpec, CrossAttentionBoundIsTheEncoderLength) {
  // Whisper-like decoder cross attention: Hkv 20, D 64, fp16; 1500 encoder tokens.
  const KVCacheSpec spec = KVCacheSpec::cross(16, 20, 64, DType::kF16);
  EXPECT_EQ(spec.page_size_bytes(), 81920);  // 2 * 16 * 20 * 64 * 2
  // ceil(1500 / 16) = 94 blocks, whatever max_model_len is.
  EXPECT_EQ(spec.max_memory_usage_bytes({448, 2048, 1500}), 94 * 81920);
  EXPECT_EQ(spec.max_memory_usage_bytes({100000, 2048, 1500}), 94 * 81920);
}

TEST(KVCacheSpec, ValidateNamesFieldAndValue) {
  KVCacheSpec spec = llama3_8b_spec();
  EXPECT_NO_THROW(spec.validate());

  spec.block_size = 0;
  EXPECT_NE(error_of<InvalidArgument>([&] {
              spec.validate();
            }).find("KVCacheSpec.block_size (0) must be > 0"),
            std::string::npos);
  spec = llama3_8b_spec();
  spec.num_kv_heads = -1;
  EXPECT_NE(error_of<InvalidArgument>([&] {
              spec.validate();
            }).find("KVCacheSpec.num_kv_heads (-1) must be > 0"),
            std::string::npos);
  spec = llama3_8b_spec();
  spec.head_size = 0;
  EXPECT_NE(error_of<InvalidArgument>([&] {
              spec.validate();
            }).find("KVCacheSpec.head_size (0) must be > 0"),
            std::string::npos);
  spec = llama3_8b_spec();
  spec.dtype = DType::kI32;
  EXPECT_NE(error_of<InvalidArgument>([&] { spec.validate(); }).find("KVCacheSpec.dtype (int32)"),
            std::string::npos);

  KVCacheSpec mla = KVCacheSpec::mla(64, 576, DType::kBF16);
  mla.num_kv_heads = 2;
  EXPECT_NE(error_of<InvalidArgument>([&] {
              mla.validate();
            }).find("KVCacheSpec.num_kv_heads (2) must be 1 for an MLA spec"),
            std::string::npos);

  KVCacheSpec sliding = KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 0);
  EXPECT_NE(error_of<InvalidArgument>([&] {
              sliding.validate();
            }).find("KVCacheSpec.sliding_window (0) must be >= 1"),
            std::string::npos);
  sliding.sliding_window.reset();
  EXPECT_NE(error_of<InvalidArgument>([&] {
              sliding.validate();
            }).find("KVCacheSpec.sliding_window is required"),
            std::string::npos);
}

TEST(KVCacheSpec, Describe) {
  EXPECT_EQ(describe(llama3_8b_spec()),
            "full_attention(block_size=16, num_kv_heads=8, head_size=128, dtype=bfloat16)");
  EXPECT_EQ(describe(KVCacheSpec::sliding(32, 4, 64, DType::kFp8E4M3, 128)),
            "sliding_window(block_size=32, num_kv_heads=4, head_size=64, dtype=float8_e4m3fn, "
            "sliding_window=128)");
  EXPECT_EQ(kv_cache_spec_kind_name(KVCacheSpecKind::kMLA), "mla");
  EXPECT_EQ(kv_cache_spec_kind_name(KVCacheSpecKind::kCrossAttention), "cross_attention");
}

// ---------------------------------------------------------------------------------------------
// Planning

TEST(KVCachePlan, EmptyLayerListGivesEmptyPlan) {
  const KVCachePlan plan = plan_kv_cache({}, 0, {});
  EXPECT_EQ(plan.num_blocks, 0);
  EXPECT_TRUE(plan.groups.empty());
  EXPECT_TRUE(plan.tensors.empty());
  EXPECT_EQ(plan.max_concurrency, 0.0);
}

TEST(KVCachePlan, UniformLlama3_8B) {
  const auto layers = same_spec_layers(32, llama3_8b_spec());
  const SchedulerLimits limits{8192, 8192, 0};
  // floor(10 GiB / 65536 / 32) = 10 GiB / 2 MiB = 5120; a spare 2 MiB - 1 byte changes nothing.
  for (int64_t available : {10 * kGiB, 10 * kGiB + 2 * kMiB - 1}) {
    const KVCachePlan plan = plan_kv_cache(layers, available, limits);
    EXPECT_EQ(plan.num_blocks, 5120);
    ASSERT_EQ(plan.groups.size(), 1u);
    EXPECT_EQ(plan.groups[0].spec, llama3_8b_spec());
    ASSERT_EQ(plan.groups[0].layer_names.size(), 32u);
    EXPECT_EQ(plan.groups[0].layer_names[5], "model.layers.5.self_attn.attn");
    ASSERT_EQ(plan.tensors.size(), 32u);
    for (size_t i = 0; i < 32; ++i) {
      EXPECT_EQ(plan.tensors[i].size_bytes, 65536 * 5120);  // 320 MiB
      EXPECT_EQ(plan.tensors[i].shared_by, std::vector<std::string>{layers[i].layer_name});
    }
    // ceil(8192 / 16) = 512 blocks per request; 5120 / 512 = 10 requests.
    EXPECT_EQ(plan.num_blocks_per_request, 512);
    EXPECT_DOUBLE_EQ(plan.max_concurrency, 10.0);
    expect_consistent(plan, layers, available);
  }
}

TEST(KVCachePlan, UniformMlaDeepSeekV3) {
  const auto layers = same_spec_layers(61, KVCacheSpec::mla(64, 576, DType::kBF16));
  const SchedulerLimits limits{163840, 8192, 0};
  // floor(40 GiB / 73728 / 61) = floor(582542.2 / 61) = 9549.
  const KVCachePlan plan = plan_kv_cache(layers, 40 * kGiB, limits);
  EXPECT_EQ(plan.num_blocks, 9549);
  EXPECT_EQ(plan.tensors.size(), 61u);
  EXPECT_EQ(plan.tensors[0].size_bytes, int64_t(73728) * 9549);
  EXPECT_EQ(plan.num_blocks_per_request, 2560);  // 163840 / 64
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 9549.0 / 2560.0);
  expect_consistent(plan, layers, 40 * kGiB);
}

TEST(KVCachePlan, UniformTypeDifferentHeadSizes) {
  // All full attention, block size 16, different sizes: one group, own tensor per layer.
  const std::vector<LayerCacheSpec> layers = {
      {"a", KVCacheSpec::full(16, 8, 128, DType::kBF16)},   // page 65536
      {"b", KVCacheSpec::full(16, 8, 64, DType::kBF16)},    // page 32768
      {"c", KVCacheSpec::full(16, 2, 64, DType::kFp8E4M3)}  // page 4096
  };
  const SchedulerLimits limits{4096, 2048, 0};
  const int64_t available = 1000000000;
  const KVCachePlan plan = plan_kv_cache(layers, available, limits);
  // sum of pages = 102400; floor(1e9 / 102400) = 9765 (9766 * 102400 = 1000038400 > 1e9).
  EXPECT_EQ(plan.num_blocks, 9765);
  ASSERT_EQ(plan.groups.size(), 1u);
  EXPECT_EQ(plan.groups[0].layer_names, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(plan.groups[0].spec, layers[0].spec);
  ASSERT_EQ(plan.tensors.size(), 3u);
  EXPECT_EQ(plan.tensors[0].size_bytes, 65536 * 9765);
  EXPECT_EQ(plan.tensors[1].size_bytes, 32768 * 9765);
  EXPECT_EQ(plan.tensors[2].size_bytes, 4096 * 9765);
  EXPECT_EQ(plan.tensors[2].shared_by, std::vector<std::string>{"c"});
  // Every layer needs ceil(4096 / 16) = 256 blocks; 9765 / 256 = 38.14453125.
  EXPECT_EQ(plan.num_blocks_per_request, 256);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 38.14453125);
  expect_consistent(plan, layers, available);
}

TEST(KVCachePlan, UniformTypeRecordedWindowAndSameWindowSliding) {
  // A full spec that records a window differs from one that does not, but is the same type.
  KVCacheSpec windowed = llama3_8b_spec();
  windowed.sliding_window = 512;
  const std::vector<LayerCacheSpec> full = {{"x", llama3_8b_spec()}, {"y", windowed}};
  const KVCachePlan p1 = plan_kv_cache(full, 64 * kMiB, {1024, 256, 0});
  EXPECT_EQ(p1.groups.size(), 1u);
  EXPECT_EQ(p1.num_blocks, 512);             // 64 MiB / (2 * 65536)
  EXPECT_EQ(p1.num_blocks_per_request, 64);  // 1024 / 16

  // Sliding windows of one width, different head counts: one uniform-type group.
  const std::vector<LayerCacheSpec> sliding = {
      {"s0", KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 256)},  // page 65536
      {"s1", KVCacheSpec::sliding(16, 4, 128, DType::kBF16, 256)},  // page 32768
  };
  const KVCachePlan p2 = plan_kv_cache(sliding, 96 * kMiB, {1024, 256, 0});
  EXPECT_EQ(p2.groups.size(), 1u);
  EXPECT_EQ(p2.num_blocks, 1024);  // 96 MiB / 98304
  // min(255 + 256, 1024) = 511 -> 32 blocks, + 1 = 33.
  EXPECT_EQ(p2.num_blocks_per_request, 33);
  expect_consistent(p2, sliding, 96 * kMiB);
}

// Gemma-2-9B-like: 42 layers alternating sliding (window 4096) and full, Hkv 8, D 256, bf16.
TEST(KVCachePlan, HybridGemma2Alternating) {
  const KVCacheSpec sliding = KVCacheSpec::sliding(16, 8, 256, DType::kBF16, 4096);
  const KVCacheSpec full = KVCacheSpec::full(16, 8, 256, DType::kBF16);
  std::vector<LayerCacheSpec> layers;
  for (int i = 0; i < 42; ++i)
    layers.push_back({"layer" + std::to_string(i), i % 2 ? full : sliding});
  const SchedulerLimits limits{8192, 2048, 0};
  const KVCachePlan plan = plan_kv_cache(layers, 8 * kGiB, limits);

  // 21 layers of each spec: group_size 21, one group per spec, sliding first (layer 0).
  ASSERT_EQ(plan.groups.size(), 2u);
  EXPECT_EQ(plan.groups[0].spec, sliding);
  EXPECT_EQ(plan.groups[1].spec, full);
  ASSERT_EQ(plan.groups[0].layer_names.size(), 21u);
  EXPECT_EQ(plan.groups[0].layer_names[3], "layer6");
  EXPECT_EQ(plan.groups[1].layer_names[3], "layer7");
  // page = 2 * 16 * 8 * 256 * 2 = 131072; floor(8 GiB / 131072 / 21) = floor(65536 / 21) = 3120.
  EXPECT_EQ(plan.num_blocks, 3120);
  ASSERT_EQ(plan.tensors.size(), 21u);
  for (size_t i = 0; i < 21; ++i) {
    EXPECT_EQ(plan.tensors[i].size_bytes, 131072 * 3120);
    EXPECT_EQ(plan.tensors[i].shared_by,
              (std::vector<std::string>{"layer" + std::to_string(2 * i),
                                        "layer" + std::to_string(2 * i + 1)}));
  }
  // Per request: sliding min(4095 + 2048, 8192) = 6143 -> 384 + 1 = 385 blocks, full 512.
  EXPECT_EQ(plan.num_blocks_per_request, 385 + 512);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 3120.0 / 897.0);
  expect_consistent(plan, layers, 8 * kGiB);
}

// gpt-oss-20b-like: 24 layers alternating sliding (window 128) and full, Hkv 8, D 64, bf16.
TEST(KVCachePlan, HybridGptOss) {
  const KVCacheSpec sliding = KVCacheSpec::sliding(16, 8, 64, DType::kBF16, 128);
  const KVCacheSpec full = KVCacheSpec::full(16, 8, 64, DType::kBF16);
  std::vector<LayerCacheSpec> layers;
  for (int i = 0; i < 24; ++i) layers.push_back({"l" + std::to_string(i), i % 2 ? full : sliding});
  const SchedulerLimits limits{131072, 8192, 0};
  const KVCachePlan plan = plan_kv_cache(layers, 20 * kGiB, limits);
  ASSERT_EQ(plan.groups.size(), 2u);
  // page = 2 * 16 * 8 * 64 * 2 = 32768; floor(20 GiB / 32768 / 12) = floor(655360 / 12) = 54613.
  EXPECT_EQ(plan.num_blocks, 54613);
  EXPECT_EQ(plan.tensors.size(), 12u);
  EXPECT_EQ(plan.tensors[11].shared_by, (std::vector<std::string>{"l22", "l23"}));
  // Sliding: min(127 + 8192, 131072) = 8319 -> 520 + 1 = 521 blocks; full: 131072 / 16 = 8192.
  EXPECT_EQ(plan.num_blocks_per_request, 521 + 8192);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 54613.0 / 8713.0);
  expect_consistent(plan, layers, 20 * kGiB);
}

// Gemma-3-like 5:1 pattern: 10 sliding + 2 full layers -> the sliding layers split in 5 groups.
TEST(KVCachePlan, HybridFiveToOneStridedGroups) {
  const KVCacheSpec sliding = KVCacheSpec::sliding(16, 4, 128, DType::kBF16, 1024);
  const KVCacheSpec full = KVCacheSpec::full(16, 4, 128, DType::kBF16);
  std::vector<LayerCacheSpec> layers;
  for (int i = 0; i < 12; ++i) {
    layers.push_back({"L" + std::to_string(i), i % 6 == 5 ? full : sliding});
  }
  const SchedulerLimits limits{8192, 512, 0};
  const KVCachePlan plan = plan_kv_cache(layers, kGiB, limits);
  // Sliding layers [L0..L4, L6..L10]: group_size = 2 (the full layers), so 5 groups taking
  // sliding[g] and sliding[g + 5].
  const std::vector<std::vector<std::string>> expected = {
      {"L0", "L6"}, {"L1", "L7"}, {"L2", "L8"}, {"L3", "L9"}, {"L4", "L10"}, {"L5", "L11"}};
  ASSERT_EQ(plan.groups.size(), expected.size());
  for (size_t g = 0; g < expected.size(); ++g) {
    EXPECT_EQ(plan.groups[g].layer_names, expected[g]) << "group " << g;
    EXPECT_EQ(plan.groups[g].spec, g < 5 ? sliding : full);
  }
  // page = 2 * 16 * 4 * 128 * 2 = 32768; floor(1 GiB / 32768 / 2) = 16384.
  EXPECT_EQ(plan.num_blocks, 16384);
  ASSERT_EQ(plan.tensors.size(), 2u);
  EXPECT_EQ(plan.tensors[0].shared_by,
            (std::vector<std::string>{"L0", "L1", "L2", "L3", "L4", "L5"}));
  EXPECT_EQ(plan.tensors[1].shared_by,
            (std::vector<std::string>{"L6", "L7", "L8", "L9", "L10", "L11"}));
  // Sliding: min(1023 + 512, 8192) = 1535 -> 96 + 1 = 97 blocks per group (5 groups);
  // full: 512. 5 * 97 + 512 = 997.
  EXPECT_EQ(plan.num_blocks_per_request, 997);
  expect_consistent(plan, layers, kGiB);
}

TEST(KVCachePlan, HybridPaddedGroups) {
  // 7 sliding + 2 full: the sliding layers split into ceil(7 / 2) = 4 groups, the last short.
  const KVCacheSpec sliding = KVCacheSpec::sliding(16, 4, 128, DType::kBF16, 1024);
  const KVCacheSpec full = KVCacheSpec::full(16, 4, 128, DType::kBF16);
  const std::vector<LayerCacheSpec> layers = {{"s0", sliding}, {"s1", sliding}, {"f0", full},
                                              {"s2", sliding}, {"s3", sliding}, {"s4", sliding},
                                              {"f1", full},    {"s5", sliding}, {"s6", sliding}};
  const SchedulerLimits limits{8192, 512, 0};
  const KVCachePlan plan = plan_kv_cache(layers, kGiB, limits);
  const std::vector<std::vector<std::string>> expected = {
      {"s0", "s4"}, {"s1", "s5"}, {"s2", "s6"}, {"s3"}, {"f0", "f1"}};
  ASSERT_EQ(plan.groups.size(), expected.size());
  for (size_t g = 0; g < expected.size(); ++g) EXPECT_EQ(plan.groups[g].layer_names, expected[g]);
  // Two layers per group at most: floor(1 GiB / 32768 / 2) = 16384 blocks, two tensors.
  EXPECT_EQ(plan.num_blocks, 16384);
  ASSERT_EQ(plan.tensors.size(), 2u);
  EXPECT_EQ(plan.tensors[0].shared_by, (std::vector<std::string>{"s0", "s1", "s2", "s3", "f0"}));
  EXPECT_EQ(plan.tensors[1].shared_by, (std::vector<std::string>{"s4", "s5", "s6", "f1"}));
  // vLLM: per_request = 2 * (4 * 97 + 512) pages, per block = 2 pages -> 900 blocks.
  EXPECT_EQ(plan.num_blocks_per_request, 4 * 97 + 512);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 16384.0 / 900.0);
  expect_consistent(plan, layers, kGiB);
}

TEST(KVCachePlan, HybridEncoderDecoderWithCrossAttention) {
  // Whisper-like decoder: 4 layers of self attention (full) and cross attention, same page.
  const KVCacheSpec self = KVCacheSpec::full(16, 20, 64, DType::kF16);
  const KVCacheSpec cross = KVCacheSpec::cross(16, 20, 64, DType::kF16);
  std::vector<LayerCacheSpec> layers;
  for (int i = 0; i < 4; ++i) {
    layers.push_back({"decoder.layers." + std::to_string(i) + ".self_attn", self});
    layers.push_back({"decoder.layers." + std::to_string(i) + ".encoder_attn", cross});
  }
  const SchedulerLimits limits{448, 2048, 1500};
  const KVCachePlan plan = plan_kv_cache(layers, 100000000, limits);
  ASSERT_EQ(plan.groups.size(), 2u);
  EXPECT_EQ(plan.groups[1].spec, cross);
  // page 81920; floor(1e8 / 81920 / 4) = floor(1220.7 / 4) = 305.
  EXPECT_EQ(plan.num_blocks, 305);
  // Self: ceil(448 / 16) = 28; cross: ceil(1500 / 16) = 94; 305 / 122 = 2.5.
  EXPECT_EQ(plan.num_blocks_per_request, 122);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 2.5);
  expect_consistent(plan, layers, 100000000);
}

TEST(KVCachePlan, InsufficientMemoryNamesSizesAndEstimate) {
  const auto layers = same_spec_layers(32, llama3_8b_spec());
  const SchedulerLimits limits{8192, 2048, 0};
  // Needed: 32 * 512 * 65536 = 1 GiB; available 512 MiB. needed(M) = ceil(M / 16) * 2 MiB
  // <= 512 MiB -> ceil(M / 16) <= 256 -> M = 4096.
  const std::string msg =
      error_of<InvalidArgument>([&] { plan_kv_cache(layers, 512 * kMiB, limits); });
  EXPECT_NE(msg.find("1.00 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0.50 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_model_len 8192"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the estimated maximum model length is 4096."), std::string::npos) << msg;
  EXPECT_EQ(estimate_max_model_len(layers, 512 * kMiB, limits), 4096);
  // One byte less: ceil(M / 16) <= 255 -> 4080.
  EXPECT_EQ(estimate_max_model_len(layers, 512 * kMiB - 1, limits), 4080);
  // 3 MiB: one block of every layer (2 MiB) fits, two do not -> 16 tokens.
  EXPECT_EQ(estimate_max_model_len(layers, 3 * kMiB, limits), 16);
  // Everything fits: the limit itself.
  EXPECT_EQ(estimate_max_model_len(layers, 2 * kGiB, limits), 8192);

  // Not even one token fits: no estimate in the message.
  EXPECT_EQ(estimate_max_model_len(layers, 1000, limits), 0);
  const std::string none = error_of<InvalidArgument>([&] { plan_kv_cache(layers, 1000, limits); });
  EXPECT_NE(none.find("1.00 GiB"), std::string::npos) << none;
  EXPECT_EQ(none.find("estimated maximum model length"), std::string::npos) << none;
}

TEST(KVCachePlan, SlidingWindowEstimate) {
  // One sliding layer (window 4096, 2048 new tokens), room for 100 pages.
  const std::vector<LayerCacheSpec> layers = {
      {"swa", KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 4096)}};
  const SchedulerLimits limits{32768, 2048, 0};
  // At M = 32768 the layer needs 385 pages. ceil(min(6143, M) / 16) + 1 <= 100 -> M <= 1584.
  EXPECT_EQ(estimate_max_model_len(layers, 100 * 65536, limits), 1584);
  const std::string msg =
      error_of<InvalidArgument>([&] { plan_kv_cache(layers, 100 * 65536, limits); });
  EXPECT_NE(msg.find("the estimated maximum model length is 1584"), std::string::npos) << msg;
}

TEST(KVCachePlan, NoAvailableMemory) {
  const auto layers = same_spec_layers(2, llama3_8b_spec());
  for (int64_t available : {int64_t(0), int64_t(-5)}) {
    const std::string msg = error_of<InvalidArgument>([&] {
      plan_kv_cache(layers, available, {1024, 256, 0});
    });
    EXPECT_NE(msg.find("No available memory for the cache blocks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available_bytes = " + std::to_string(available)), std::string::npos) << msg;
  }
}

TEST(KVCachePlan, NumBlocksOverride) {
  const auto layers = same_spec_layers(32, llama3_8b_spec());
  const SchedulerLimits limits{8192, 2048, 0};
  const KVCachePlan plan = plan_kv_cache(layers, 10 * kGiB, limits, 1000);
  EXPECT_EQ(plan.num_blocks, 1000);
  EXPECT_EQ(plan.tensors[0].size_bytes, 65536 * 1000);
  EXPECT_DOUBLE_EQ(plan.max_concurrency, 1000.0 / 512.0);
  expect_consistent(plan, layers, 10 * kGiB);

  // The override may exceed the budget (tensors follow it) ...
  const KVCachePlan big = plan_kv_cache(layers, 10 * kGiB, limits, 100000);
  EXPECT_EQ(big.tensors[31].size_bytes, int64_t(65536) * 100000);
  expect_consistent(big, layers, 10 * kGiB, /*overridden=*/true);

  // ... and applies to the hybrid case too.
  const std::vector<LayerCacheSpec> hybrid = {
      {"s", KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 64)}, {"f", llama3_8b_spec()}};
  const KVCachePlan h = plan_kv_cache(hybrid, 10 * kGiB, limits, 7);
  EXPECT_EQ(h.num_blocks, 7);
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].size_bytes, 65536 * 7);

  // The feasibility check still runs, and the override must be positive.
  EXPECT_THROW(plan_kv_cache(layers, 512 * kMiB, limits, 1000), InvalidArgument);
  const std::string msg =
      error_of<InvalidArgument>([&] { plan_kv_cache(layers, 10 * kGiB, limits, 0); });
  EXPECT_NE(msg.find("num_blocks_override (0) must be >= 1"), std::string::npos) << msg;
}

TEST(KVCachePlan, DuplicateAndEmptyLayerNames) {
  std::vector<LayerCacheSpec> layers = same_spec_layers(3, llama3_8b_spec());
  layers[2].layer_name = layers[0].layer_name;
  const std::string msg = error_of<InvalidArgument>([&] {
    plan_kv_cache(layers, kGiB, {1024, 256, 0});
  });
  EXPECT_NE(msg.find("'model.layers.0.self_attn.attn' appears more than once (again at layers[2])"),
            std::string::npos)
      << msg;
  layers[2].layer_name.clear();
  EXPECT_NE(error_of<InvalidArgument>([&] {
              plan_kv_cache(layers, kGiB, {1024, 256, 0});
            }).find("layers[2].layer_name is empty"),
            std::string::npos);
  EXPECT_THROW(estimate_max_model_len(layers, kGiB, {1024, 256, 0}), InvalidArgument);
}

TEST(KVCachePlan, InvalidSpecNamesTheLayer) {
  std::vector<LayerCacheSpec> layers = same_spec_layers(4, llama3_8b_spec());
  layers[3].spec.head_size = 0;
  const std::string msg = error_of<InvalidArgument>([&] {
    plan_kv_cache(layers, kGiB, {1024, 256, 0});
  });
  EXPECT_NE(msg.find("layer 'model.layers.3.self_attn.attn'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("KVCacheSpec.head_size (0) must be > 0"), std::string::npos) << msg;
}

TEST(KVCachePlan, LimitsTheLayersNeed) {
  const auto full = same_spec_layers(1, llama3_8b_spec());
  EXPECT_NE(error_of<InvalidArgument>([&] {
              plan_kv_cache(full, kGiB, {0, 256, 0});
            }).find("SchedulerLimits.max_model_len (0) must be >= 1"),
            std::string::npos);
  const std::vector<LayerCacheSpec> swa = {
      {"swa", KVCacheSpec::sliding(16, 8, 128, DType::kBF16, 64)}};
  EXPECT_NE(error_of<InvalidArgument>([&] {
              plan_kv_cache(swa, kGiB, {1024, 0, 0});
            }).find("max_num_batched_tokens (0) must be >= 1 for the sliding-window layer 'swa'"),
            std::string::npos);
  const std::vector<LayerCacheSpec> cross = {
      {"xattn", KVCacheSpec::cross(16, 8, 128, DType::kBF16)}};
  EXPECT_NE(error_of<InvalidArgument>([&] {
              plan_kv_cache(cross, kGiB, {1024, 256, 0});
            })
                .find("max_num_encoder_input_tokens (0) must be >= 1 for the cross-attention layer "
                      "'xattn'"),
            std::string::npos);
}

TEST(KVCachePlan, UngroupableSpecsAreNotSupported) {
  // Different kinds and different page sizes.
  const std::vector<LayerCacheSpec> layers = {
      {"full", llama3_8b_spec()},                                   // page 65536
      {"swa", KVCacheSpec::sliding(16, 8, 64, DType::kBF16, 512)},  // page 32768
  };
  const std::string msg = error_of<NotSupported>([&] {
    plan_kv_cache(layers, kGiB, {1024, 256, 0});
  });
  EXPECT_NE(msg.find(describe(layers[0].spec) + ": page_size_bytes 65536"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find(describe(layers[1].spec) + ": page_size_bytes 32768"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("first 'swa'"), std::string::npos) << msg;

  // Full attention with two block sizes is not one type; with unequal pages it cannot group.
  const std::vector<LayerCacheSpec> block_sizes = {
      {"a", KVCacheSpec::full(16, 8, 128, DType::kBF16)},
      {"b", KVCacheSpec::full(32, 8, 128, DType::kBF16)}};
  EXPECT_THROW(plan_kv_cache(block_sizes, kGiB, {1024, 256, 0}), NotSupported);
  // ... but with equal pages they plan as a hybrid model: two groups sharing one tensor.
  const std::vector<LayerCacheSpec> equal_pages = {
      {"a", KVCacheSpec::full(16, 8, 128, DType::kBF16)},
      {"b", KVCacheSpec::full(32, 4, 128, DType::kBF16)}};
  const KVCachePlan plan = plan_kv_cache(equal_pages, kGiB, {1024, 256, 0});
  EXPECT_EQ(plan.groups.size(), 2u);
  EXPECT_EQ(plan.tensors.size(), 1u);
  EXPECT_EQ(plan.num_blocks, kGiB / 65536);
  EXPECT_EQ(plan.num_blocks_per_request, 64 + 32);  // 1024 / 16 + 1024 / 32
}

}  // namespace
}  // namespace pagedattn
