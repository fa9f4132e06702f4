// MLAAttention on CUDA tensors (the cuda backend's latent kernel, the device projections)
// against the same steps through the host path: a prefill step then decode steps (one padded
// with slot -1 rows), 16 heads, L = 512, R = 64 (the kernel's only shape), bf16 and fp8 e4m3
// latent caches, block sizes 64 and 16, inputs drawn fresh (the seed is printed). Each step's
// output must pass check_mla_step (the float64 oracle, accuracy.h's budget) and the device
// cache must be bit-identical to the host path's. Both formulations: every request absorbed, and
// the split (prompts and a chunk over a cached context through the prefill formulation, with
// context chunks of 32 tokens merged by LSE, beside absorbed decodes in the same step). Also: a
// decode step captured in a CUDA graph, and the profiling step. Every test skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"
#include "pagedattn/mla.h"
#include "pagedattn/mla_check.h"

namespace pagedattn {
namespace {

constexpr int kN = 16, kL = 512, kR = 64, kE = kL + kR;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && default_registry().find("cuda");
}

MLAOptions options(int p, int v, KVCacheDType cache, int block, Device device,
                   MLAFormulation formulation = MLAFormulation::kAbsorbed) {
  MLAOptions o;
  o.num_heads = kN;
  o.qk_nope_head_dim = p;
  o.qk_rope_head_dim = kR;
  o.v_head_dim = v;
  o.kv_lora_rank = kL;
  o.scale = 1.0f / std::sqrt(float(p + kR));
  o.dtype = DType::kBF16;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = block;
  o.cache_config->cache_dtype = cache;
  o.formulation = formulation;
  o.context_chunk_tokens = 32;  // several chunks per context in the prefill formulation
  o.device = device;
  return o;
}

Tensor random_host(const std::vector<int64_t>& shape, DType dtype, std::mt19937& rng,
                   double sigma = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<double> dist(0.0, sigma);
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

Tensor poisoned(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor host = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < host.view().numel(); ++i) store_element(host.data(), dtype, i, NAN);
  return device.is_cpu() ? host : Tensor::copy_of(host.view(), device);
}

int64_t differing_bytes(const TensorView& a, const TensorView& b) {
  const auto* x = static_cast<const unsigned char*>(a.data);
  const auto* y = static_cast<const unsigned char*>(b.data);
  int64_t n = 0;
  for (size_t i = 0; i < a.nbytes(); ++i) n += x[i] != y[i];
  return n;
}

struct MlaShape {
  int p, v;
  KVCacheDType cache;
  int block;
};

std::string label(const MlaShape& s) {
  std::ostringstream os;
  os << "P=" << s.p << " V=" << s.v << " cache=" << to_string(s.cache) << " block=" << s.block;
  return os.str();
}

// Three requests: prompts of 70, 5 and 33 tokens in step 1, then one token each per decode step
// (step 2's input padded with 2 rows of slot -1), except that request 0 takes a chunk of 9 tokens
// over its 70 cached ones in step 2.
void run_scenario(const MlaShape& s, uint32_t seed, MLAFormulation formulation) {
  SCOPED_TRACE(label(s) + " seed=" + std::to_string(seed) + " " +
               std::string(to_string(formulation)));
  std::mt19937 rng(seed);
  const Device dev = Device::cuda(0);
  const DType act = DType::kBF16;
  const int prompts[3] = {70, 5, 33};
  const int max_tokens = 96;
  const int blocks_per_req = (max_tokens + s.block - 1) / s.block;
  const int64_t num_blocks = 1 + 3 * blocks_per_req;  // block 0 stays unused
  const float k_scale = is_fp8(s.cache) ? 0.02f : 1.0f;

  ForwardContext host_ctx, dev_ctx;
  MLAOptions host_o = options(s.p, s.v, s.cache, s.block, Device::cpu(), formulation);
  host_o.attn_backend = "ref";
  MLAAttention host_layer(host_ctx, host_o);
  const MLAOptions dev_o = options(s.p, s.v, s.cache, s.block, dev, formulation);
  MLAAttention dev_layer(dev_ctx, dev_o);
  ASSERT_EQ(dev_layer.backend().name(), "cuda");
  // kv_b_proj [L, N * (P + V)], small enough that logits stay O(1).
  const Tensor w = random_host({kL, int64_t(kN) * (s.p + s.v)}, DType::kF32, rng, 0.05);
  host_layer.load_kv_b_proj(w.view());
  dev_layer.load_kv_b_proj(w.view());
  const DType cache_dtype = host_layer.config().cache_dtype();
  Tensor host_cache = Tensor::zeros({num_blocks, s.block, kE}, cache_dtype);  // [B, bs, E]
  Tensor dev_cache = Tensor::copy_of(host_cache.view(), dev);                 // [B, bs, E]
  host_layer.bind_kv_cache(host_cache.view());
  dev_layer.bind_kv_cache(dev_cache.view());
  if (is_fp8(s.cache)) {
    host_layer.set_k_scale(k_scale);
    dev_layer.set_k_scale(k_scale);
  }

  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    MetadataBuilder b(s.block);
    int64_t ta = 0;
    for (int r = 0; r < 3; ++r) {
      std::vector<int32_t> ids;
      for (int i = 0; i < blocks_per_req; ++i) ids.push_back(1 + r * blocks_per_req + i);
      const int chunk = step == 1 && r == 0 ? 9 : 1;
      const int done = step == 0 ? 0 : prompts[r] + (step - 1) + (r == 0 && step > 1 ? 8 : 0);
      const RequestSpec spec =
          step == 0 ? RequestSpec{0, prompts[r], ids} : RequestSpec{done, chunk, ids};
      b.add(spec);
      ta += spec.num_new_tokens;
    }
    const int64_t t = step == 1 ? ta + 2 : ta;
    if (t > ta) b.pad_slots_to(int(t));
    StepMetadata md = b.build();
    const AttentionMetadata host_md = md.view();
    const AttentionMetadata dev_md = md.to_device(dev);

    const Tensor q = random_host({t, kN, s.p + kR}, act, rng);  // [T, N, P + R]
    const Tensor kv_c = random_host({t, kL}, act, rng);         // [T, L]
    const Tensor k_pe = random_host({t, kR}, act, rng);         // [T, R]
    const Tensor cache_before = Tensor::copy_of(dev_cache.view(), Device::cpu());

    Tensor host_out = poisoned({t, int64_t(kN) * s.v}, act, Device::cpu());  // [T, N * V]
    host_ctx.begin_step({&host_md});
    host_layer.forward(q.view(), kv_c.view(), k_pe.view(), host_out.view());
    host_ctx.end_step();

    const Tensor gq = Tensor::copy_of(q.view(), dev), gkv = Tensor::copy_of(kv_c.view(), dev),
                 gpe = Tensor::copy_of(k_pe.view(), dev);
    Tensor gout = poisoned({t, int64_t(kN) * s.v}, act, dev);  // [T, N * V]
    dev_ctx.begin_step({&dev_md});
    dev_layer.forward(gq.view(), gkv.view(), gpe.view(), gout.view());
    dev_ctx.end_step();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

    const Tensor got = Tensor::copy_of(gout.view(), Device::cpu());
    const Tensor cache_after = Tensor::copy_of(dev_cache.view(), Device::cpu());
    MLAStepCase c;
    c.options = dev_o;
    c.kv_b_proj = w.view();
    c.k_scale = k_scale;
    c.latent_cache = cache_before.view();
    c.metadata = host_md;
    c.q = q.view();
    c.kv_c_normed = kv_c.view();
    c.k_pe = k_pe.view();
    const CaseCheck check = check_mla_step(c, got.view(), cache_after.view());
    const ErrorStats vs_host = compare(got.view().slice(0, 0, ta), host_out.view().slice(0, 0, ta));
    EXPECT_TRUE(check.pass()) << check.to_string()
                              << "\ndevice vs host path (ref backend): " << vs_host.to_string();
    EXPECT_EQ(differing_bytes(cache_after.view(), host_cache.view()), 0)
        << "latent cache bytes differ from the host path's";
    int64_t padded_written = 0;  // rows past num_actual_tokens stay poisoned
    for (int64_t i = ta * kN * s.v; i < got.view().numel(); ++i)
      padded_written += !std::isnan(load_element(got.data(), act, i));
    EXPECT_EQ(padded_written, 0);
  }
}

TEST(CudaMLAAttention, MatchesTheHostPathOverPrefillAndDecodeSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint32_t seed = std::random_device{}();
  for (const MlaShape& s :
       {MlaShape{64, 64, KVCacheDType::kAuto, 64}, MlaShape{64, 64, KVCacheDType::kFp8E4M3, 16},
        MlaShape{128, 128, KVCacheDType::kAuto, 16},
        MlaShape{128, 128, KVCacheDType::kFp8E4M3, 64}}) {
    for (const MLAFormulation f : {MLAFormulation::kAbsorbed, MLAFormulation::kSplit}) {
      run_scenario(s, seed, f);
    }
  }
}

// A decode step captured into a CUDA graph on the layer's stream: the replay must write the same
// output and cache bytes as the eager forward of the same step from the same cache.
TEST(CudaMLAAttention, ADecodeStepCapturedInAGraphReplaysTheEagerStep) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  const int p = 64, v = 64, block = 16;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  ForwardContext ctx;
  MLAAttention layer(ctx, options(p, v, KVCacheDType::kFp8E4M3, block, dev));
  layer.set_k_scale(0.02f);
  layer.load_kv_b_proj(random_host({kL, kN * (p + v)}, DType::kF32, rng, 0.05).view());
  Tensor cache = Tensor::zeros({9, block, kE}, layer.config().cache_dtype(), dev);  // [B, bs, E]
  layer.bind_kv_cache(cache.view());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream on{stream};
  auto inputs = [&](int64_t t) {
    return std::array<Tensor, 3>{
        Tensor::copy_of(random_host({t, kN, p + kR}, DType::kBF16, rng).view(), dev),  // q
        Tensor::copy_of(random_host({t, kL}, DType::kBF16, rng).view(), dev),          // kv_c
        Tensor::copy_of(random_host({t, kR}, DType::kBF16, rng).view(), dev)};         // k_pe
  };
  // Eager prefill: uploads the weights and fills the cache.
  {
    StepMetadata md = MetadataBuilder(block).add({0, 40, {1, 2, 3, 4}}).add({0, 9, {5, 6}}).build();
    const AttentionMetadata dmd = md.to_device(dev);
    const auto in = inputs(49);
    Tensor out = poisoned({49, kN * v}, DType::kBF16, dev);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ctx.begin_step({&dmd});
    layer.forward(in[0].view(), in[1].view(), in[2].view(), out.view(), on);
    ctx.end_step();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  StepMetadata md = MetadataBuilder(block).add({40, 1, {1, 2, 3, 4}}).add({9, 1, {5, 6}}).build();
  const AttentionMetadata dmd = md.to_device(dev);
  const auto in = inputs(2);
  const Tensor cache_before = Tensor::copy_of(cache.view(), Device::cpu());
  Tensor out = poisoned({2, kN * v}, DType::kBF16, dev);  // [T, N * V]
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ctx.begin_step({&dmd});
  layer.forward(in[0].view(), in[1].view(), in[2].view(), out.view(), on);  // eager, sizes things
  ctx.end_step();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const Tensor eager_out = Tensor::copy_of(out.view(), Device::cpu());
  const Tensor eager_cache = Tensor::copy_of(cache.view(), Device::cpu());

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ctx.begin_step({&dmd});
  layer.forward(in[0].view(), in[1].view(), in[2].view(), out.view(), on);
  ctx.end_step();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Replay from the cache as it was before the step, into a poisoned output.
  ASSERT_EQ(cudaMemcpy(cache.data(), cache_before.data(), cache_before.view().nbytes(),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  const Tensor poison = poisoned({2, kN * v}, DType::kBF16, Device::cpu());
  ASSERT_EQ(cudaMemcpy(out.data(), poison.data(), poison.view().nbytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const Tensor replay_out = Tensor::copy_of(out.view(), Device::cpu());
  const Tensor replay_cache = Tensor::copy_of(cache.view(), Device::cpu());
  EXPECT_EQ(differing_bytes(replay_out.view(), eager_out.view()), 0)
      << "replayed vs eager output: " << compare(replay_out.view(), eager_out.view()).to_string();
  EXPECT_EQ(differing_bytes(replay_cache.view(), eager_cache.view()), 0);
  EXPECT_GT(differing_bytes(eager_cache.view(), cache_before.view()), 0)
      << "the decode step wrote nothing";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaMLAAttention, AProfilingStepZeroesTheOutput) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  ForwardContext ctx;
  MLAAttention layer(ctx, options(64, 64, KVCacheDType::kAuto, 16, dev));
  std::mt19937 rng(std::random_device{}());
  const Tensor q = Tensor::copy_of(random_host({5, kN, 64 + kR}, DType::kBF16, rng).view(), dev);
  const Tensor kv = Tensor::copy_of(random_host({5, kL}, DType::kBF16, rng).view(), dev);
  const Tensor pe = Tensor::copy_of(random_host({5, kR}, DType::kBF16, rng).view(), dev);
  Tensor out = poisoned({5, kN * 64}, DType::kBF16, dev);  // [T, N * V]
  ctx.begin_profile_step();
  layer.forward(q.view(), kv.view(), pe.view(), out.view());
  ctx.end_step();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = Tensor::copy_of(out.view(), Device::cpu());
  int64_t nonzero = 0;
  for (int64_t i = 0; i < got.view().numel(); ++i)
    nonzero += load_element(got.data(), DType::kBF16, i) != 0.0;
  EXPECT_EQ(nonzero, 0);
}

}  // namespace
}  // namespace pagedattn
