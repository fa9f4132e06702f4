// plan_kv_cache and estimate_max_model_len on random layer specs whose sizes run from 1 to
// INT_MAX and byte budgets and limits to INT64_MAX: each call returns a plan that keeps its own
// invariants or throws pagedattn::Error; under the asan preset (UBSan: signed overflow is an
// error there) no size product may overflow on the way.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache_spec.h"

namespace pagedattn {
namespace {

template <class T>
T pick(std::mt19937_64& rng, std::initializer_list<T> values) {
  return *(values.begin() + std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
}

KVCacheSpec random_spec(std::mt19937_64& rng) {
  KVCacheSpec s;
  s.kind = static_cast<KVCacheSpecKind>(pick(rng, {0, 1, 2, 3}));
  s.block_size = pick(rng, {16, 16, 16, 64, 1, 1 << 20, INT_MAX, 0, -1});
  s.num_kv_heads = s.kind == KVCacheSpecKind::kMLA ? pick(rng, {1, 1, 1, 2})
                                                   : pick(rng, {8, 8, 8, 1, 1 << 16, INT_MAX, 0});
  s.head_size = pick(rng, {128, 128, 128, 64, 576, 1 << 20, INT_MAX, -5});
  s.dtype = pick(rng, {DType::kBF16, DType::kBF16, DType::kF32, DType::kFp8E4M3, DType::kI32});
  if (s.kind == KVCacheSpecKind::kSlidingWindow || pick(rng, {0, 0, 1})) {
    s.sliding_window = pick(rng, {1, 4096, 4096, INT_MAX, 0});
  }
  return s;
}

TEST(KVCacheSpecFuzz, ExtremeSizesArePlannedOrRefused) {
  constexpr int kCases = 20000;
  int planned = 0, refused = 0;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937_64 rng(0x5bec0000u + uint64_t(i));
    std::vector<LayerCacheSpec> layers;
    const int n = pick(rng, {1, 2, 3, 6});
    const KVCacheSpec shared = random_spec(rng);
    for (int l = 0; l < n; ++l) {
      // Mostly one spec for every layer (the common case), sometimes a second one.
      layers.push_back(
          {"layer." + std::to_string(l), pick(rng, {0, 0, 1}) ? random_spec(rng) : shared});
    }
    SchedulerLimits limits;
    limits.max_model_len =
        pick<int64_t>(rng, {4096, 4096, 131072, 1, int64_t(1) << 40, INT64_MAX, 0});
    limits.max_num_batched_tokens = pick<int64_t>(rng, {8192, 8192, 1, INT64_MAX, -1});
    limits.max_num_encoder_input_tokens = pick<int64_t>(rng, {4096, 4096, 0, INT64_MAX});
    const int64_t available =
        pick<int64_t>(rng, {int64_t(80) << 30, int64_t(80) << 30, int64_t(1) << 30,
                            int64_t(1) << 62, INT64_MAX, 1, 0});
    std::optional<int64_t> override_blocks;
    if (pick(rng, {0, 0, 1}))
      override_blocks = pick<int64_t>(rng, {1, 1000, int64_t(1) << 40, INT64_MAX});
    SCOPED_TRACE("case " + std::to_string(i) + ": " + describe(layers[0].spec) + ", " +
                 std::to_string(n) + " layers, available " + std::to_string(available));
    try {
      const KVCachePlan plan = plan_kv_cache(layers, available, limits, override_blocks);
      ++planned;
      EXPECT_GE(plan.num_blocks, 1);
      for (const KVCacheTensorPlan& t : plan.tensors) {
        EXPECT_GT(t.size_bytes, 0);
        if (!override_blocks) {
          EXPECT_LE(t.size_bytes, available);
        }
      }
    } catch (const Error& e) {
      ++refused;
      EXPECT_FALSE(std::string(e.what()).empty());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw a non-pagedattn exception: " << e.what();
    }
    try {
      const int64_t len = estimate_max_model_len(layers, available, limits);
      EXPECT_GE(len, 0);
      EXPECT_LE(len, limits.max_model_len);
    } catch (const Error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "estimate_max_model_len threw a non-pagedattn exception: " << e.what();
    }
  }
  std::printf("[kv cache spec fuzz] %d planned, %d refused\n", planned, refused);
  EXPECT_GT(planned, kCases / 50);  // most draws hold an extreme or invalid size
  EXPECT_GT(refused, kCases / 20);
}

}  // namespace
}  // namespace pagedattn
