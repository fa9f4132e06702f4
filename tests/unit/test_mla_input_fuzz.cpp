// The input fuzz of test_input_fuzz.cpp for MLAAttention: random valid steps over a latent
// cache (every formulation, fp8 or not, cpu and ref), one damage each (tests/common/
// step_damage.h). Every call either throws pagedattn::Error or runs, writing every output row
// with finite values and giving the same bits when rerun on dense copies of what the validator
// read; under the asan preset, with no access out of bounds.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/step_damage.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"

namespace pagedattn {
namespace {

using namespace pagedattn::testing;  // NOLINT: the damage helpers

struct MlaScenario {
  MLAOptions options;
  RandomRequests step;
};

MlaScenario random_mla_scenario(std::mt19937& rng, const std::string& backend) {
  MlaScenario s;
  MLAOptions& o = s.options;
  o.num_heads = pick(rng, {2, 4});
  o.qk_nope_head_dim = 16;
  o.qk_rope_head_dim = 16;
  o.v_head_dim = pick(rng, {8, 16});
  o.kv_lora_rank = pick(rng, {32, 48});
  o.scale = 1.0f / std::sqrt(32.0f);
  o.dtype = pick(rng, {DType::kF32, DType::kBF16});
  o.attn_backend = backend;
  o.formulation =
      pick(rng, {MLAFormulation::kSplit, MLAFormulation::kAbsorbed, MLAFormulation::kPrefill});
  o.decode_threshold = pick(rng, {1, 4});
  CacheConfig cache;
  cache.block_size = pick(rng, {1, 4, 16});
  cache.cache_dtype = pick(rng, {KVCacheDType::kAuto, KVCacheDType::kAuto, KVCacheDType::kFp8E4M3});
  o.cache_config = cache;
  s.step = random_requests(rng, cache.block_size, {1, 2, 3}, {0, 0, 1, 9, 23}, {0, 1, 1, 3, 6});
  return s;
}

// The layer's inputs for `tokens` rows: q [T, N, P + R], kv_c [T, L], k_pe [T, R].
struct MlaInputs {
  Rows q, kv_c, k_pe;
  MlaInputs(const MLAOptions& o, int64_t tokens, std::mt19937& rng)
      : q(random_rows(o.dtype, {tokens, o.num_heads, o.qk_nope_head_dim + o.qk_rope_head_dim},
                      rng)),
        kv_c(random_rows(o.dtype, {tokens, o.kv_lora_rank}, rng)),
        k_pe(random_rows(o.dtype, {tokens, o.qk_rope_head_dim}, rng)) {}
};

// Writes finite latent entries into every slot: one request owning every block.
void fill_latent_cache(ForwardContext& ctx, MLAAttention& layer, const MLAOptions& o,
                       int num_blocks, std::mt19937& rng) {
  const int bs = o.cache_config->block_size;
  RequestSpec all;
  all.num_new_tokens = num_blocks * bs;
  for (int b = 0; b < num_blocks; ++b) all.block_ids.push_back(b);
  StepMetadata step = MetadataBuilder(bs).add(all).build();
  AttentionMetadata md = step.view();
  MlaInputs in(o, all.num_new_tokens, rng);
  Tensor out = Tensor::empty({all.num_new_tokens, int64_t(o.num_heads) * o.v_head_dim}, o.dtype);
  ctx.begin_step({&md});
  layer.forward(in.q.view, in.kv_c.view, in.k_pe.view, out.view());
  ctx.end_step();
}

class MlaInputFuzz : public ::testing::TestWithParam<std::string> {};

TEST_P(MlaInputFuzz, EveryDamageIsRefusedOrHarmless) {
  const std::string backend = GetParam();
  constexpr int kCases = 300;
  Tally tally;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0x31a00000u + i));
    MlaScenario s = random_mla_scenario(rng, backend);
    const MLAOptions& o = s.options;
    ForwardContext ctx;
    MLAAttention layer(ctx, o);
    const int l = o.kv_lora_rank, n = o.num_heads;
    Tensor w = Tensor::empty({l, int64_t(n) * (o.qk_nope_head_dim + o.v_head_dim)}, DType::kF64);
    std::normal_distribution<double> dist;
    for (int64_t j = 0; j < w.view().numel(); ++j) w.data_as<double>()[j] = 0.2 * dist(rng);
    layer.load_kv_b_proj(w.view());
    Tensor cache =
        Tensor::zeros({s.step.num_blocks, o.cache_config->block_size, l + o.qk_rope_head_dim},
                      layer.config().cache_dtype());
    layer.bind_kv_cache(cache.view());
    if (is_fp8(o.cache_config->cache_dtype)) layer.set_k_scale(0.05f);
    fill_latent_cache(ctx, layer, o, s.step.num_blocks, rng);

    MetadataBuilder builder(o.cache_config->block_size);
    for (const auto& r : s.step.requests) builder.add(r);
    StepMetadata step = builder.build();
    Metadata m(step);
    const int64_t tokens = m.md.num_actual_tokens;
    const MlaInputs in(o, tokens, rng);
    const Rows out = poisoned_rows(o.dtype, {tokens, int64_t(n) * o.v_head_dim});
    std::vector<TensorView> inputs = {in.q.view, in.kv_c.view, in.k_pe.view};
    TensorView output = out.view;
    const std::string what = damage(
        m,
        {{"q", &inputs[0]}, {"kv_c_normed", &inputs[1]}, {"k_pe", &inputs[2]}, {"output", &output}},
        rng);
    SCOPED_TRACE("case " + std::to_string(i) + " (" + backend + ", " +
                 std::string(to_string(o.formulation)) + "): " + what);
    announce(i, what);
    tally.count(run_damaged(ctx, m, inputs, output, tokens, what,
                            [&](const std::vector<TensorView>& x, const TensorView& dst) {
                              layer.forward(x[0], x[1], x[2], dst);
                            }));
  }
  tally.print("mla fuzz " + backend);
  EXPECT_GT(tally.ran, kCases / 20);
  EXPECT_GT(kCases - tally.ran, kCases / 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, MlaInputFuzz, ::testing::Values("cpu", "ref"));

}  // namespace
}  // namespace pagedattn
