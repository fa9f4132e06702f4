// A whole decode step of a model (every layer's cache write and attention) captured in one
// CUDA graph on a non-blocking stream through the layers' stream argument, then replayed with
// new metadata, slots and q/k/v written into the captured buffers. A capture fails if anything
// is enqueued on another stream or the host synchronises, so the capture itself checks the
// convention; each replay's outputs and caches are checked against the float64 reference.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "cuda/backend/plan.h"
#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && default_registry().find("cuda");
}

constexpr int kLayers = 3, kSeqs = 4, kHq = 8, kHk = 2, kD = 128, kBlock = 16;
constexpr int kMaxBlocks = 8;  // per request: seq lengths grow up to 128 within the captured plan
constexpr int kNumBlocks = 48;

Tensor random_host(const std::vector<int64_t>& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<double> dist;
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

Tensor host_i32(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  return Tensor::copy_of(TensorView::contiguous(const_cast<int32_t*>(v.data()), DType::kI32, shape),
                         Device::cpu());
}

void upload(const TensorView& dst, const void* src) {
  ASSERT_EQ(cudaMemcpy(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
}

struct Model {
  ForwardContext ctx;
  std::vector<std::unique_ptr<Attention>> layers;
  std::vector<KVCache> caches;
  std::vector<Tensor> q, k, v, out;  // per layer, on the device
};

// The requests' lengths `seq` (each a decode: one new token at position seq - 1) over fixed
// block tables, written into `step` in place so that its device buffers keep their addresses.
void set_lengths(StepMetadata& step, const std::vector<int32_t>& seq) {
  for (int r = 0; r < kSeqs; ++r) {
    const int32_t pos = seq[size_t(r)] - 1;
    step.seq_lens[size_t(r)] = seq[size_t(r)];
    const int32_t block = step.block_table[size_t(r * kMaxBlocks + pos / kBlock)];
    step.slot_mapping[size_t(r)] = int64_t(block) * kBlock + pos % kBlock;
  }
}

class CudaGraphLayers : public ::testing::TestWithParam<KVCacheDType> {};

TEST_P(CudaGraphLayers, ADecodeStepOfThreeLayersReplaysWithNewMetadata) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  cudaStream_t raw;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  const Stream stream{raw};

  Model m;
  for (int i = 0; i < kLayers; ++i) {
    AttentionOptions o;
    o.num_heads = kHq;
    o.num_kv_heads = kHk;
    o.head_size = kD;
    o.scale = 1.0f / std::sqrt(float(kD));
    o.prefix = "model.layers." + std::to_string(i) + ".self_attn";
    o.dtype = DType::kBF16;
    o.device = dev;
    o.cache_config = CacheConfig{};
    o.cache_config->block_size = kBlock;
    o.cache_config->cache_dtype = GetParam();
    o.has_checkpoint_kv_scales = is_fp8(GetParam());
    auto layer = std::make_unique<Attention>(m.ctx, o);
    ASSERT_EQ(layer->backend().name(), "cuda");
    if (is_fp8(GetParam())) layer->load_kv_scales(1.0f, 0.05f + 0.01f * i, 0.04f + 0.01f * i);
    m.caches.push_back(KVCache::allocate(layer->config(), kNumBlocks, dev));
    const Tensor init = random_host(m.caches.back().storage().view().shape_vector(),
                                    layer->config().cache_dtype(), rng);
    ASSERT_NO_FATAL_FAILURE(upload(m.caches.back().storage().view(), init.data()));
    layer->bind_kv_cache({m.caches.back().view()});
    m.q.push_back(Tensor::empty({kSeqs, kHq * kD}, DType::kBF16, dev));
    m.k.push_back(Tensor::empty({kSeqs, kHk * kD}, DType::kBF16, dev));
    m.v.push_back(Tensor::empty({kSeqs, kHk * kD}, DType::kBF16, dev));
    m.out.push_back(Tensor::empty({kSeqs, kHq * kD}, DType::kBF16, dev));
    m.layers.push_back(std::move(layer));
  }

  // Four decodes over disjoint shuffled blocks; max_seq_len covers every later length.
  std::vector<int32_t> blocks(kNumBlocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  MetadataBuilder builder(kBlock);
  std::vector<int32_t> seq = {17, 64, 5, 100};
  for (int r = 0; r < kSeqs; ++r) {
    builder.add({seq[size_t(r)] - 1, 1,
                 std::vector<int32_t>(blocks.begin() + r * kMaxBlocks,
                                      blocks.begin() + (r + 1) * kMaxBlocks)});
  }
  StepMetadata step = builder.build();
  step.max_seq_len = kMaxBlocks * kBlock;
  const AttentionMetadata md = step.to_device(dev);

  // One step: fresh q/k/v, the caches before it kept, outputs poisoned; `launch` runs it; then
  // every layer's output and cache against the float64 reference.
  auto run_and_check = [&](const char* what, auto&& launch) {
    ASSERT_NO_FATAL_FAILURE(upload(md.seq_lens, step.seq_lens.data()));
    ASSERT_NO_FATAL_FAILURE(upload(md.slot_mapping, step.slot_mapping.data()));
    ASSERT_NO_FATAL_FAILURE(upload(md.block_table, step.block_table.data()));
    std::vector<Case> cases(kLayers);
    for (int i = 0; i < kLayers; ++i) {
      Case& c = cases[size_t(i)];
      c.config = m.layers[size_t(i)]->config();
      c.scales = m.layers[size_t(i)]->kv_scales();
      c.query = random_host({kSeqs, kHq, kD}, DType::kBF16, rng);
      c.key = random_host({kSeqs, kHk, kD}, DType::kBF16, rng);
      c.value = random_host({kSeqs, kHk, kD}, DType::kBF16, rng);
      c.kv_cache = Tensor::copy_of(m.caches[size_t(i)].storage().view(), Device::cpu());
      c.block_table = host_i32(step.block_table, {kSeqs, kMaxBlocks});
      c.seq_lens = host_i32(step.seq_lens, {kSeqs});
      c.query_start_loc = host_i32(step.query_start_loc, {kSeqs + 1});
      c.slot_mapping = Tensor::copy_of(
          TensorView::contiguous(step.slot_mapping.data(), DType::kI64, {kSeqs}), Device::cpu());
      ASSERT_NO_FATAL_FAILURE(upload(m.q[size_t(i)].view(), c.query.data()));
      ASSERT_NO_FATAL_FAILURE(upload(m.k[size_t(i)].view(), c.key.data()));
      ASSERT_NO_FATAL_FAILURE(upload(m.v[size_t(i)].view(), c.value.data()));
      ASSERT_EQ(cudaMemset(m.out[size_t(i)].data(), 0xff, m.out[size_t(i)].view().nbytes()),
                cudaSuccess);  // bf16 NaN
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    launch();
    ASSERT_EQ(cudaStreamSynchronize(raw), cudaSuccess);
    for (int i = 0; i < kLayers; ++i) {
      CaseResult got;
      got.output = Tensor::copy_of(m.out[size_t(i)].view(), Device::cpu());
      got.kv_cache = Tensor::copy_of(m.caches[size_t(i)].storage().view(), Device::cpu());
      const CaseCheck check = check_case(cases[size_t(i)], got);
      EXPECT_TRUE(check.pass()) << what << ", layer " << i << ":\n" << check.to_string();
    }
  };
  auto forward_all = [&] {
    m.ctx.begin_step({&md});
    for (int i = 0; i < kLayers; ++i) {
      const size_t l = size_t(i);
      m.layers[l]->forward(m.q[l].view(), m.k[l].view(), m.v[l].view(), m.out[l].view(), {},
                           stream);
    }
    m.ctx.end_step();
  };

  // Eager first: it builds the plan and grows the context's workspace (no allocation may
  // happen inside the capture).
  set_lengths(step, seq);
  run_and_check("eager", forward_all);

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(raw, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  forward_all();
  ASSERT_EQ(cudaStreamEndCapture(raw, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int replay = 0; replay < 3; ++replay) {
    for (int32_t& s : seq) ++s;  // the next token of every request: new lengths, new slots
    set_lengths(step, seq);
    const std::string what = "replay " + std::to_string(replay);
    run_and_check(what.c_str(), [&] { ASSERT_EQ(cudaGraphLaunch(exec, raw), cudaSuccess); });
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(raw);
}

// Host only (no GPU needed): a decoder request with fewer keys than query tokens is refused on
// the host by the plan (the kernels are not verified on rows that see no key); cross attention
// with no keys and a decoder with as many keys as queries are planned.
TEST(CudaBackendHost, PlanRefusesDecoderRowsThatSeeNoKey) {
  AttentionConfig c;
  c.num_heads = kHq;
  c.num_kv_heads = kHk;
  c.head_size = kD;
  c.scale = 0.1f;
  c.block_size = kBlock;
  StepMetadata step = MetadataBuilder(kBlock).add({0, 3, {1}}).add({4, 1, {2}}).build();
  EXPECT_NO_THROW(cuda::make_plan(step.view(), c, 132, 2));
  step.seq_lens[0] = 1;
  EXPECT_ERROR(cuda::make_plan(step.view(), c, 132, 2), NotSupported,
               "request 0 has 3 query tokens but seq_len 1 keys");
  EXPECT_ERROR(cuda::refuse_rows_without_keys(step.view(), c), NotSupported, "see no key");
  step.seq_lens[0] = 0;
  step.causal = false;
  c.attn_type = AttentionType::kEncoderDecoder;
  EXPECT_NO_THROW(cuda::make_plan(step.view(), c, 132, 2));
}

INSTANTIATE_TEST_SUITE_P(CacheDTypes, CudaGraphLayers,
                         ::testing::Values(KVCacheDType::kAuto, KVCacheDType::kFp8E4M3),
                         [](const auto& param_info) {
                           return param_info.param == KVCacheDType::kAuto ? std::string("bf16")
                                                                          : std::string("fp8_e4m3");
                         });

}  // namespace
}  // namespace pagedattn
