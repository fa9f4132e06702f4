// Random damage to one argument of a valid step, sent through the Attention layer on the cpu
// and ref backends. Every call must either run, writing every output row with finite values,
// or throw pagedattn::Error with a message that names what broke. Under the asan preset
// (AddressSanitizer + UBSan) the same cases also prove that no damage reads or writes out of
// bounds: validation must stop every bad value before a backend trusts it.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/step_damage.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

using namespace pagedattn::testing;  // NOLINT: the damage helpers

// One valid step: a decoder's over a paged cache whose every slot holds finite values, or an
// encoder-only layer's (no cache: keys are the step's own rows, not causal).
struct Scenario {
  AttentionOptions options;
  RandomRequests step;
};

Scenario random_scenario(std::mt19937& rng, const std::string& backend) {
  Scenario s;
  AttentionOptions& o = s.options;
  o.num_kv_heads = pick(rng, {1, 2});
  o.num_heads = *o.num_kv_heads * pick(rng, {1, 2, 4});
  o.head_size = pick(rng, {16, 32, 64});
  o.scale = 1.0f / std::sqrt(float(o.head_size));
  o.dtype = pick(rng, {DType::kF32, DType::kBF16});
  o.attn_backend = backend;
  CacheConfig cache;
  cache.block_size = pick(rng, {1, 4, 16});
  cache.cache_dtype = pick(rng, {KVCacheDType::kAuto, KVCacheDType::kAuto, KVCacheDType::kFp8E4M3});
  if (pick(rng, {0, 0, 1})) cache.sliding_window = pick(rng, {3, 17});
  o.cache_config = cache;
  if (pick(rng, {0, 0, 1})) o.logits_soft_cap = 20.0f;
  o.attn_type = pick(rng, {AttentionType::kDecoder, AttentionType::kDecoder,
                           AttentionType::kDecoder, AttentionType::kEncoderOnly});
  if (o.attn_type == AttentionType::kEncoderOnly) {
    o.cache_config->cache_dtype = KVCacheDType::kAuto;  // no cache to quantise
    s.step = random_requests(rng, cache.block_size, {1, 2, 3, 4}, {0}, {0, 1, 3, 7, 12});
    for (auto& r : s.step.requests) r.block_ids.clear();  // no cache: slots -1
  } else {
    s.step =
        random_requests(rng, cache.block_size, {1, 2, 3, 4}, {0, 0, 1, 5, 23}, {0, 1, 1, 3, 7});
  }
  return s;
}

class InputFuzz : public ::testing::TestWithParam<std::string> {};

TEST_P(InputFuzz, EveryDamageIsRefusedOrHarmless) {
  const std::string backend = GetParam();
  constexpr int kCases = 600;
  Tally tally;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0x5eed0000u + i));
    Scenario s = random_scenario(rng, backend);
    s.options.prefix = "fuzz." + std::to_string(i);
    ForwardContext ctx;
    Attention layer(ctx, s.options);
    const bool cached = uses_kv_cache(layer.config().attn_type);
    KVCache cache;
    if (cached) {
      cache = KVCache::allocate(layer.config(), s.step.num_blocks);
      layer.bind_kv_cache({cache.view()});
      fill_layer_cache(ctx, layer, s.step.num_blocks, rng);
    }

    DamagedLayerStep d(layer.config(), s.step.requests, rng);
    SCOPED_TRACE("case " + std::to_string(i) + " (" + backend + "): " + d.what);
    announce(i, d.what);
    tally.count(run_damaged(ctx, d.m, d.inputs, d.output, d.tokens, d.what,
                            [&](const std::vector<TensorView>& in, const TensorView& dst) {
                              layer.forward(in[0], in[1], in[2], dst);
                            }));
  }
  tally.print("fuzz " + backend);
  // The damages include "none" and harmless ones (a larger max_seq_len); most must be refused.
  EXPECT_GT(tally.ran, kCases / 20);
  EXPECT_GT(kCases - tally.ran, kCases / 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, InputFuzz, ::testing::Values("cpu", "ref"));

}  // namespace
}  // namespace pagedattn
