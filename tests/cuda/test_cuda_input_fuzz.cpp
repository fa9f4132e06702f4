// The input fuzz of tests/unit/test_input_fuzz.cpp on the cuda backend in checked mode (which
// copies the device metadata to the host and validates it before any launch): random valid
// decode / prefill / mixed steps (bf16 and f16, head sizes 64 and 128, fp8 caches, windows,
// soft cap), one damage each (tests/common/step_damage.h), metadata and inputs copied to the GPU
// with their damaged shapes, strides and dtypes. Every call either throws pagedattn::Error or
// runs, writing every output row with finite values that a rerun on dense copies reproduces bit
// for bit. Run under compute-sanitizer (bench/gpu/run.sh) it also proves that no damage
// reaches a kernel as an out-of-bounds access. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/step_damage.h"
#include "cuda/backend/cuda_backend.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

using namespace pagedattn::testing;  // NOLINT: the damage helpers

bool have_gpu() {
  DeviceRuntime* rt = device_runtime(DeviceType::kCUDA);
  return rt != nullptr && rt->device_count() > 0;
}

AttentionOptions random_options(std::mt19937& rng) {
  AttentionOptions o;
  o.num_kv_heads = pick(rng, {1, 2});
  o.num_heads = *o.num_kv_heads * pick(rng, {1, 4});
  o.head_size = pick(rng, {64, 128});
  o.scale = 1.0f / std::sqrt(float(o.head_size));
  o.dtype = pick(rng, {DType::kBF16, DType::kF16});
  o.attn_backend = "cuda";
  o.device = Device::cuda(0);
  CacheConfig cache;
  cache.block_size = pick(rng, {1, 16, 64});
  cache.cache_dtype = pick(rng, {KVCacheDType::kAuto, KVCacheDType::kAuto, KVCacheDType::kFp8E4M3});
  if (pick(rng, {0, 0, 1})) cache.sliding_window = pick(rng, {3, 40});
  o.cache_config = cache;
  if (pick(rng, {0, 0, 1})) o.logits_soft_cap = 20.0f;
  return o;
}

TEST(CudaInputFuzz, EveryDamageIsRefusedOrHarmlessInCheckedMode) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device is visible";
  Registry registry;
  registry.add(cuda::make_backend({/*checked=*/true, 0}));
  constexpr int kCases = 300;
  Tally tally;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0xc0da0000u + i));
    AttentionOptions o = random_options(rng);
    o.prefix = "fuzz." + std::to_string(i);
    // Decodes, chunks over context and fresh prompts; long enough for the prefill kernels.
    const RandomRequests r = random_requests(rng, o.cache_config->block_size, {1, 2, 3},
                                             {0, 0, 1, 70, 300}, {0, 1, 1, 4, 130});
    ForwardContext ctx;
    Attention layer(ctx, o, registry);
    KVCache cache = KVCache::allocate(layer.config(), r.num_blocks, Device::cuda(0));
    layer.bind_kv_cache({cache.view()});
    fill_layer_cache(ctx, layer, r.num_blocks, rng, Device::cuda(0));

    DamagedLayerStep d(layer.config(), r.requests, rng);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + d.what);
    announce(i, d.what);
    tally.count(run_damaged(
        ctx, d.m, d.inputs, d.output, d.tokens, d.what,
        [&](const std::vector<TensorView>& in, const TensorView& dst) {
          layer.forward(in[0], in[1], in[2], dst);
        },
        Device::cuda(0)));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "case " << i << ": " << d.what;
  }
  tally.print("cuda fuzz");
  EXPECT_GT(tally.ran, kCases / 20);
  EXPECT_GT(kCases - tally.ran, kCases / 2);
}

}  // namespace
}  // namespace pagedattn
