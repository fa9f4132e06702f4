// Random damage to one argument of a valid step, sent through the Attention layer on the cpu
// and ref backends. Every call must either run, writing every output row with finite values,
// or throw pagedattn::Error with a message that names what broke. Under the asan preset
// (AddressSanitizer + UBSan) the same cases also prove that no damage reads or writes out of
// bounds: validation must stop every bad value before a backend trusts it.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
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

// One valid decoder step over a paged cache whose every slot holds finite values.
struct Scenario {
  AttentionOptions options;
  int num_blocks = 0;
  std::vector<RequestSpec> requests;
};

Scenario random_scenario(std::mt19937& rng, const std::string& backend) {
  auto pick = [&](std::initializer_list<int> values) {
    std::uniform_int_distribution<size_t> d(0, values.size() - 1);
    return *(values.begin() + d(rng));
  };
  Scenario s;
  AttentionOptions& o = s.options;
  o.num_kv_heads = pick({1, 2});
  o.num_heads = *o.num_kv_heads * pick({1, 2, 4});
  o.head_size = pick({16, 32, 64});
  o.scale = 1.0f / std::sqrt(float(o.head_size));
  o.dtype = pick({0, 1}) ? DType::kF32 : DType::kBF16;
  o.attn_backend = backend;
  CacheConfig cache;
  cache.block_size = pick({1, 4, 16});
  cache.cache_dtype = pick({0, 0, 1}) ? KVCacheDType::kAuto : KVCacheDType::kFp8E4M3;
  if (pick({0, 0, 1})) cache.sliding_window = pick({3, 17});
  o.cache_config = cache;
  if (pick({0, 0, 1})) o.logits_soft_cap = 20.0f;

  const int num_requests = pick({1, 2, 3, 4});
  std::vector<int> free_blocks;
  int used = 0;
  for (int r = 0; r < num_requests; ++r) {
    RequestSpec req;
    req.context_len = pick({0, 0, 1, 5, 23});
    req.num_new_tokens = pick({0, 1, 1, 3, 7});
    const int seq_len = req.context_len + req.num_new_tokens;
    const int blocks = (seq_len + cache.block_size - 1) / cache.block_size + pick({0, 1});
    for (int b = 0; b < blocks; ++b) req.block_ids.push_back(used++);
    s.requests.push_back(std::move(req));
  }
  s.num_blocks = used + pick({1, 3});
  // Shuffle the physical blocks so that no request owns a contiguous range.
  std::vector<int32_t> perm(size_t(s.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (auto& req : s.requests) {
    for (auto& b : req.block_ids) b = perm[size_t(b)];
  }
  return s;
}

// Writes finite K/V into every slot of the layer's cache: one request owning every block.
void fill_cache(ForwardContext& ctx, Attention& layer, int num_blocks, std::mt19937& rng) {
  const AttentionConfig& c = layer.config();
  RequestSpec all;
  all.num_new_tokens = num_blocks * c.block_size;
  for (int b = 0; b < num_blocks; ++b) all.block_ids.push_back(b);
  StepMetadata step = MetadataBuilder(c.block_size).add(all).build();
  AttentionMetadata md = step.view();
  const int64_t t = all.num_new_tokens;
  const Rows q = random_rows(c.dtype, {t, c.num_heads * c.head_size}, rng);
  const Rows k = random_rows(c.dtype, {t, c.num_kv_heads * c.head_size}, rng);
  const Rows v = random_rows(c.dtype, {t, c.num_kv_heads * c.head_size}, rng);
  ctx.begin_step({&md});
  layer.forward(q.view, k.view, v.view);
  ctx.end_step();
}

class InputFuzz : public ::testing::TestWithParam<std::string> {};

TEST_P(InputFuzz, EveryDamageIsRefusedOrHarmless) {
  const std::string backend = GetParam();
  constexpr int kCases = 600;
  std::map<std::string, int> refusals;  // first words of each error, for the summary
  int ran = 0;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0x5eed0000u + i));
    Scenario s = random_scenario(rng, backend);
    s.options.prefix = "fuzz." + std::to_string(i);
    ForwardContext ctx;
    Attention layer(ctx, s.options);
    KVCache cache = KVCache::allocate(layer.config(), s.num_blocks);
    layer.bind_kv_cache({cache.view()});
    fill_cache(ctx, layer, s.num_blocks, rng);

    MetadataBuilder builder(layer.config().block_size);
    for (const auto& r : s.requests) builder.add(r);
    StepMetadata step = builder.build();
    Metadata m(step);
    const AttentionConfig& c = layer.config();
    const int64_t tokens = m.md.num_actual_tokens;
    const int64_t q_cols = c.num_heads * c.head_size, kv_cols = c.num_kv_heads * c.head_size;
    const Rows q = random_rows(c.dtype, {tokens, q_cols}, rng);
    const Rows k = random_rows(c.dtype, {tokens, kv_cols}, rng);
    const Rows v = random_rows(c.dtype, {tokens, kv_cols}, rng);
    const Rows out = poisoned_rows(c.dtype, {tokens, q_cols});
    std::vector<TensorView> inputs = {q.view, k.view, v.view};
    TensorView output = out.view;
    const std::string what = damage(
        m, {{"query", &inputs[0]}, {"key", &inputs[1]}, {"value", &inputs[2]}, {"output", &output}},
        rng);
    SCOPED_TRACE("case " + std::to_string(i) + " (" + backend + "): " + what);
    // A sanitizer stops the process without the trace: PAGEDATTN_FUZZ_VERBOSE names the case.
    if (std::getenv("PAGEDATTN_FUZZ_VERBOSE")) {
      std::fprintf(stderr, "case %d: %s\n", i, what.c_str());
    }
    const Outcome o = run_damaged(ctx, m, inputs, output, tokens, what,
                                  [&](const std::vector<TensorView>& in, const TensorView& dst) {
                                    layer.forward(in[0], in[1], in[2], dst);
                                  });
    if (o.ran) ++ran;
    if (!o.refusal.empty()) refusals[o.refusal.substr(0, o.refusal.find_first_of(" ([:"))]++;
  }
  std::string summary;
  for (const auto& [head, n] : refusals) summary += " " + head + ":" + std::to_string(n);
  std::printf("[fuzz %s] %d of %d cases ran; refusals by first word:%s\n", backend.c_str(), ran,
              kCases, summary.c_str());
  // The damages include "none" and harmless ones (a larger max_seq_len); most must be refused.
  EXPECT_GT(ran, kCases / 20);
  EXPECT_GT(kCases - ran, kCases / 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, InputFuzz, ::testing::Values("cpu", "ref"));

}  // namespace
}  // namespace pagedattn
