// MLAAttention (spec section 5) against a float64 loop of the non-absorbed formulation, on every
// CPU backend, within the accuracy rule (accuracy.h): the absorbed formulation over two steps;
// vLLM's split and the forced prefill formulation over single steps drawn fresh per case (pure
// prefill, context chunked past the workspace cap, prefix caching, decodes mixed with
// prefills, zero-length requests, padded rows; 16-bit and fp8 e4m3 latent caches; block sizes
// 1, 16, 64); the two formulations against each other; check_mla_step; validation errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"
#include "pagedattn/mla_check.h"
#include "pagedattn/mla_device_ops.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

constexpr int kN = 4, kP = 16, kR = 16, kV = 8, kL = 48, kE = kL + kR, kBlock = 16;

struct Token {
  std::vector<double> q, kv_c, k_pe;  // [N*(P+R)], [L], [R] as stored in the activation dtype
};

double round_to(double x, DType dtype) {
  uint64_t bits = 0;
  store_element(&bits, dtype, 0, x);
  return load_element(&bits, dtype, 0);
}

MLAOptions mla_options(DType dtype, KVCacheDType cache) {
  MLAOptions o;
  o.num_heads = kN;
  o.qk_nope_head_dim = kP;
  o.qk_rope_head_dim = kR;
  o.v_head_dim = kV;
  o.kv_lora_rank = kL;
  o.scale = 1.0f / std::sqrt(float(kP + kR));
  o.dtype = dtype;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = kBlock;
  o.cache_config->cache_dtype = cache;
  return o;
}

// Two steps of three requests; returns step 2's output [T2, N*V] (float64) from the layer.
struct Scenario {
  DType dtype;
  KVCacheDType cache;
  std::vector<std::vector<Token>> tokens;  // per request, all positions
  std::vector<double> w;                   // kv_b_proj [L, N*(P+V)]
  float k_scale = 1.0f;
};

Scenario make_scenario(DType dtype, KVCacheDType cache, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist;
  Scenario s{dtype, cache, {}, {}, is_fp8(cache) ? 0.05f : 1.0f};
  const int lens[3] = {21, 8, 7};
  for (int len : lens) {
    std::vector<Token> req(static_cast<size_t>(len));
    for (Token& t : req) {
      for (int i = 0; i < kN * (kP + kR); ++i) t.q.push_back(round_to(dist(rng), dtype));
      for (int i = 0; i < kL; ++i) t.kv_c.push_back(round_to(dist(rng), dtype));
      for (int i = 0; i < kR; ++i) t.k_pe.push_back(round_to(dist(rng), dtype));
    }
    s.tokens.push_back(std::move(req));
  }
  for (int i = 0; i < kL * kN * (kP + kV); ++i) s.w.push_back(dist(rng) * 0.2);
  return s;
}

// Step 1: request 0 tokens [0, 20), request 1 [0, 5). Step 2: request 0 token 20 (decode),
// request 1 [5, 8) (chunk over cached context), request 2 [0, 7) (fresh prompt).
const int kStep1[3][2] = {{0, 20}, {0, 5}, {0, 0}};
const int kStep2[3][2] = {{20, 1}, {5, 3}, {0, 7}};

Tensor run_layer(const Scenario& s, const std::string& backend, const Registry& registry) {
  ForwardContext ctx;
  MLAOptions o = mla_options(s.dtype, s.cache);
  o.formulation = MLAFormulation::kAbsorbed;  // the prefill formulation reads fp8 new tokens raw
  o.attn_backend = backend;
  MLAAttention layer(ctx, o, registry);
  const Tensor w = Tensor::empty({kL, kN * (kP + kV)}, DType::kF64);
  std::copy(s.w.begin(), s.w.end(), static_cast<double*>(w.data()));
  layer.load_kv_b_proj(w.view());
  const int blocks_per_req = 2;
  Tensor cache = Tensor::zeros({1 + 3 * blocks_per_req, kBlock, kE}, layer.config().cache_dtype());
  layer.bind_kv_cache(cache.view());
  if (is_fp8(s.cache)) layer.set_k_scale(s.k_scale);
  Tensor out;
  for (const auto& step : {kStep1, kStep2}) {
    MetadataBuilder b(kBlock);
    int64_t t_total = 0;
    for (int r = 0; r < 3; ++r) {
      std::vector<int32_t> ids = {1 + r * blocks_per_req, 2 + r * blocks_per_req};
      b.add(RequestSpec{step[r][0], step[r][1], ids});
      t_total += step[r][1];
    }
    const StepMetadata md = b.build();
    const AttentionMetadata view = md.view();
    Tensor q = Tensor::empty({t_total, kN, kP + kR}, s.dtype);
    Tensor kv_c = Tensor::empty({t_total, kL}, s.dtype),
           k_pe = Tensor::empty({t_total, kR}, s.dtype);
    int64_t row = 0;
    for (int r = 0; r < 3; ++r) {
      for (int i = 0; i < step[r][1]; ++i, ++row) {
        const Token& tk = s.tokens[size_t(r)][size_t(step[r][0] + i)];
        for (int c = 0; c < kN * (kP + kR); ++c)
          store_element(q.data(), s.dtype, row * kN * (kP + kR) + c, tk.q[size_t(c)]);
        for (int c = 0; c < kL; ++c)
          store_element(kv_c.data(), s.dtype, row * kL + c, tk.kv_c[size_t(c)]);
        for (int c = 0; c < kR; ++c)
          store_element(k_pe.data(), s.dtype, row * kR + c, tk.k_pe[size_t(c)]);
      }
    }
    out = Tensor::empty({t_total, kN * kV}, s.dtype);
    for (int64_t i = 0; i < out.view().numel(); ++i) store_element(out.data(), s.dtype, i, NAN);
    ctx.begin_step({&view});
    layer.forward(q.view(), kv_c.view(), k_pe.view(), out.view());
    ctx.end_step();
  }
  return out;
}

// The non-absorbed formulation in float64: per head, K = [kv_c W_UK | k_pe], V = kv_c W_UV.
Tensor reference(const Scenario& s) {
  int64_t t_total = 0;
  for (int r = 0; r < 3; ++r) t_total += kStep2[r][1];
  Tensor out = Tensor::empty({t_total, kN * kV}, DType::kF64);
  double* o = static_cast<double*>(out.data());
  const DType cache = is_fp8(s.cache)
                          ? (s.cache == KVCacheDType::kFp8E5M2 ? DType::kFp8E5M2 : DType::kFp8E4M3)
                          : s.dtype;
  // What the cache holds: the latent entry in the cache dtype (fp8: x / k_scale, saturated).
  auto stored = [&](double x) {
    return is_fp8(s.cache) ? round_to(x / s.k_scale, cache) * s.k_scale : round_to(x, cache);
  };
  const double scale = 1.0 / std::sqrt(double(kP + kR));
  auto wuk = [&](int l, int h, int p) {
    return round_to(s.w[size_t(l) * kN * (kP + kV) + size_t(h) * (kP + kV) + size_t(p)], s.dtype);
  };
  auto wuv = [&](int l, int h, int v) {
    return round_to(s.w[size_t(l) * kN * (kP + kV) + size_t(h) * (kP + kV) + size_t(kP + v)],
                    s.dtype);
  };
  int64_t row = 0;
  for (int r = 0; r < 3; ++r) {
    const auto& toks = s.tokens[size_t(r)];
    for (int i = 0; i < kStep2[r][1]; ++i, ++row) {
      const int pos = kStep2[r][0] + i;
      const Token& qt = toks[size_t(pos)];
      for (int h = 0; h < kN; ++h) {
        std::vector<double> logit(static_cast<size_t>(pos + 1), 0.0);
        for (int j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int p = 0; p < kP; ++p) {
            double k = 0;
            for (int l = 0; l < kL; ++l)
              k += stored(toks[size_t(j)].kv_c[size_t(l)]) * wuk(l, h, p);
            dot += qt.q[size_t(h) * (kP + kR) + size_t(p)] * k;
          }
          for (int e = 0; e < kR; ++e)
            dot += qt.q[size_t(h) * (kP + kR) + size_t(kP + e)] *
                   stored(toks[size_t(j)].k_pe[size_t(e)]);
          logit[size_t(j)] = dot * scale;
        }
        double mx = -INFINITY, sum = 0;
        for (double x : logit) mx = std::max(mx, x);
        for (double& x : logit) sum += (x = std::exp(x - mx));
        for (int vv = 0; vv < kV; ++vv) {
          double acc = 0;
          for (int j = 0; j <= pos; ++j) {
            double val = 0;
            for (int l = 0; l < kL; ++l)
              val += stored(toks[size_t(j)].kv_c[size_t(l)]) * wuv(l, h, vv);
            acc += logit[size_t(j)] * val;
          }
          o[row * kN * kV + h * kV + vv] = acc / sum;
        }
      }
    }
  }
  return out;
}

TEST(MLAAttention, MatchesTheNonAbsorbedFormulationOnEveryCpuBackend) {
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  const std::pair<DType, KVCacheDType> combos[] = {{DType::kF32, KVCacheDType::kAuto},
                                                   {DType::kBF16, KVCacheDType::kAuto},
                                                   {DType::kBF16, KVCacheDType::kFp8E4M3}};
  uint32_t seed = 1;
  for (const auto& [dtype, cache] : combos) {
    const Scenario s = make_scenario(dtype, cache, seed++);
    const Tensor want = reference(s);
    const ErrorStats base = compare(run_layer(s, "ref_lowp", lowp).view(), want.view());
    // The layer's own arithmetic (absorption, latent write, up-projection) is shared by every
    // backend, so the relative rule alone cannot see an error in it: the low-precision run must
    // also be close to float64 in absolute terms (float32: float32 rounding; 16-bit: vLLM's MLA
    // rtol of 1e-2 on the absorbed query and latent output, three roundings).
    const double rel = dtype == DType::kF32 ? 1e-4 : 3e-2;
    EXPECT_LE(base.max_abs, rel * std::max(1.0, base.max_ref))
        << dtype_name(dtype) << " cache " << to_string(cache) << ": " << base.to_string();
    int tested = 0;
    for (const Backend* backend : default_registry().backends()) {
      MLAOptions o = mla_options(dtype, cache);
      AttentionConfig probe;
      {
        ForwardContext probe_ctx;
        MLAAttention probe_layer(probe_ctx, o, lowp);
        probe = probe_layer.config();
      }
      if (!backend->check({probe, Device::cpu()}).empty()) continue;
      ++tested;
      const Tensor got = run_layer(s, std::string(backend->name()), default_registry());
      const ErrorStats err = compare(got.view(), want.view());
      EXPECT_TRUE(within_budget(err, base, default_tolerance(dtype)))
          << backend->name() << " " << dtype_name(dtype) << " cache " << to_string(cache) << ": "
          << err.to_string() << " (low-precision reference: " << base.to_string() << ")";
    }
    EXPECT_GE(tested, default_registry().find("cpu") != nullptr ? 2 : 1);
  }
}

// check_mla_step passes a step the cpu (or ref) layer ran, and fails one whose output or latent
// cache was changed afterwards.
TEST(MLAAttention, CheckMlaStepPassesTheLayerAndCatchesAWrongOutputOrCache) {
  const Scenario s = make_scenario(DType::kBF16, KVCacheDType::kAuto, 11);
  MLAOptions o = mla_options(s.dtype, s.cache);
  ForwardContext ctx;
  MLAAttention layer(ctx, o);
  Tensor w = Tensor::empty({kL, kN * (kP + kV)}, DType::kF64);
  std::copy(s.w.begin(), s.w.end(), static_cast<double*>(w.data()));
  layer.load_kv_b_proj(w.view());
  // Blocks 1-2: request 0's 20 cached tokens (written by a first step); the checked step adds
  // its token 20 and a fresh 7-token request in block 3.
  Tensor cache = Tensor::zeros({4, kBlock, kE}, layer.config().cache_dtype());
  layer.bind_kv_cache(cache.view());
  auto inputs = [&](int r, int first, int count) {
    Tensor q = Tensor::empty({count, kN, kP + kR}, s.dtype),
           kv = Tensor::empty({count, kL}, s.dtype);
    Tensor pe = Tensor::empty({count, kR}, s.dtype);
    for (int i = 0; i < count; ++i) {
      const Token& tk = s.tokens[size_t(r)][size_t(first + i)];
      for (int c = 0; c < kN * (kP + kR); ++c)
        store_element(q.data(), s.dtype, i * kN * (kP + kR) + c, tk.q[size_t(c)]);
      for (int c = 0; c < kL; ++c)
        store_element(kv.data(), s.dtype, i * kL + c, tk.kv_c[size_t(c)]);
      for (int c = 0; c < kR; ++c)
        store_element(pe.data(), s.dtype, i * kR + c, tk.k_pe[size_t(c)]);
    }
    return std::array<Tensor, 3>{q, kv, pe};
  };
  {
    const StepMetadata md = MetadataBuilder(kBlock).add({0, 20, {1, 2}}).build();
    const AttentionMetadata view = md.view();
    const auto in = inputs(0, 0, 20);
    Tensor out = Tensor::empty({20, kN * kV}, s.dtype);
    ctx.begin_step({&view});
    layer.forward(in[0].view(), in[1].view(), in[2].view(), out.view());
    ctx.end_step();
  }
  const Tensor before = Tensor::copy_of(cache.view(), Device::cpu());
  const StepMetadata md = MetadataBuilder(kBlock).add({20, 1, {1, 2}}).add({0, 7, {3}}).build();
  const AttentionMetadata view = md.view();
  const auto a = inputs(0, 20, 1), b = inputs(2, 0, 7);
  Tensor q = Tensor::empty({8, kN, kP + kR}, s.dtype), kv = Tensor::empty({8, kL}, s.dtype);
  Tensor pe = Tensor::empty({8, kR}, s.dtype);
  copy_tensor(q.view().slice(0, 0, 1), a[0].view());
  copy_tensor(q.view().slice(0, 1, 8), b[0].view());
  copy_tensor(kv.view().slice(0, 0, 1), a[1].view());
  copy_tensor(kv.view().slice(0, 1, 8), b[1].view());
  copy_tensor(pe.view().slice(0, 0, 1), a[2].view());
  copy_tensor(pe.view().slice(0, 1, 8), b[2].view());
  Tensor out = Tensor::empty({8, kN * kV}, s.dtype);
  ctx.begin_step({&view});
  layer.forward(q.view(), kv.view(), pe.view(), out.view());
  ctx.end_step();

  MLAStepCase c;
  c.options = o;
  c.kv_b_proj = w.view();
  c.latent_cache = before.view();
  c.metadata = view;
  c.q = q.view();
  c.kv_c_normed = kv.view();
  c.k_pe = pe.view();
  const CaseCheck good = check_mla_step(c, out.view(), cache.view());
  EXPECT_TRUE(good.pass()) << good.to_string();
  EXPECT_EQ(good.kv_cache_elements, 4 * kBlock * kE);
  EXPECT_EQ(good.output.got.count, 8 * kN * kV);

  Tensor wrong = Tensor::copy_of(out.view(), Device::cpu());
  store_element(wrong.data(), s.dtype, 37, load_element(wrong.data(), s.dtype, 37) + 0.05);
  const CaseCheck bad_output = check_mla_step(c, wrong.view(), cache.view());
  EXPECT_FALSE(bad_output.pass());
  EXPECT_FALSE(bad_output.output.pass) << bad_output.to_string();

  Tensor moved = Tensor::copy_of(cache.view(), Device::cpu());
  store_element(moved.data(), s.dtype, 3 * kBlock * kE + 5,
                1.0 + load_element(moved.data(), s.dtype, 3 * kBlock * kE + 5));
  const CaseCheck bad_cache = check_mla_step(c, out.view(), moved.view());
  EXPECT_TRUE(bad_cache.output.pass);
  EXPECT_EQ(bad_cache.kv_cache_mismatches, 1);
  EXPECT_FALSE(bad_cache.pass());
}

TEST(MLAAttention, ValidatesWeightsCacheAndInputs) {
  ForwardContext ctx;
  MLAAttention layer(ctx, mla_options(DType::kF32, KVCacheDType::kAuto));
  EXPECT_EQ(layer.config().head_size, kE);
  EXPECT_EQ(layer.config().num_kv_heads, 1);
  EXPECT_EQ(layer.get_kv_cache_spec().kind, KVCacheSpecKind::kMLA);
  Tensor bad = Tensor::zeros({kL, kN * kP}, DType::kF32);
  EXPECT_ERROR(layer.load_kv_b_proj(bad.view()), InvalidArgument,
               "kv_b_proj must be [kv_lora_rank=48");
  Tensor wrong_cache = Tensor::zeros({4, kBlock, kE + 1}, DType::kF32);
  EXPECT_ERROR(layer.bind_kv_cache(wrong_cache.view()), InvalidArgument, "latent cache must be");
  Tensor q = Tensor::zeros({2, kN, kP + kR}, DType::kF32), kv = Tensor::zeros({2, kL}, DType::kF32);
  Tensor pe = Tensor::zeros({2, kR}, DType::kF32), out = Tensor::zeros({2, kN * kV}, DType::kF32);
  Tensor short_pe = Tensor::zeros({2, kR - 1}, DType::kF32);
  EXPECT_ERROR(layer.forward(q.view(), kv.view(), short_pe.view(), out.view()), InvalidArgument,
               "k_pe must be [num_tokens=2, qk_rope_head_dim=16]");
}

TEST(MLAAttention, CalibratesTheLatentScaleOnce) {
  ForwardContext ctx;
  MLAOptions o = mla_options(DType::kF32, KVCacheDType::kFp8E4M3);
  o.cache_config->calculate_kv_scales = true;
  MLAAttention layer(ctx, o);
  EXPECT_TRUE(layer.calculate_kv_scales());
  const Tensor w = Tensor::zeros({kL, kN * (kP + kV)}, DType::kF32);
  layer.load_kv_b_proj(w.view());
  Tensor cache = Tensor::zeros({3, kBlock, kE}, DType::kFp8E4M3);
  layer.bind_kv_cache(cache.view());
  auto step = [&](float amax) {
    const StepMetadata md = MetadataBuilder(kBlock).add(RequestSpec{0, 2, {1}}).build();
    const AttentionMetadata view = md.view();
    Tensor q = Tensor::zeros({2, kN, kP + kR}, DType::kF32),
           kv = Tensor::zeros({2, kL}, DType::kF32);
    Tensor pe = Tensor::zeros({2, kR}, DType::kF32), out = Tensor::zeros({2, kN * kV}, DType::kF32);
    static_cast<float*>(kv.data())[7] = -amax;
    static_cast<float*>(q.data())[3] = 1.0f;  // calibration needs every tensor non-zero
    static_cast<float*>(pe.data())[1] = 0.5f;
    ctx.begin_step({&view});
    layer.forward(q.view(), kv.view(), pe.view(), out.view());
    ctx.end_step();
  };
  step(0.0f);  // all zeros: nothing to calibrate on yet
  EXPECT_TRUE(layer.calculate_kv_scales());
  EXPECT_EQ(layer.k_scale(), 1.0f);
  step(50.0f);
  EXPECT_FALSE(layer.calculate_kv_scales());
  EXPECT_FLOAT_EQ(layer.k_scale(), 50.0f / 200.0f);
  step(400.0f);  // once only
  EXPECT_FLOAT_EQ(layer.k_scale(), 50.0f / 200.0f);
}

// ---- One step in either formulation, drawn fresh per case ----

// One request of a checked step: `context` tokens cached by earlier steps (written into the
// cache by the test), `count` new ones. A request may share the first `shared_blocks` blocks
// (and so those tokens) of an earlier request: prefix caching.
struct Req {
  int context = 0;
  int count = 0;
  int share_from = -1;
  int shared_blocks = 0;
};

struct StepCase {
  std::string name;
  DType dtype;
  KVCacheDType cache;
  int block_size;
  std::vector<Req> reqs;
  int context_chunk_tokens = 4096;
  int decode_threshold = 1;
  int padding_requests = 0;  // zero-length requests after the others
  int padded_rows = 0;       // input rows past num_actual_tokens (slot -1, never written)
};

struct StepData {
  StepCase c;
  std::vector<std::vector<Token>> tokens;    // per request, positions [0, context + count)
  std::vector<std::vector<int32_t>> blocks;  // per request, physical ids in logical order
  std::vector<double> w;                     // kv_b_proj [L, N*(P+V)]
  float k_scale = 1.0f;
  int num_blocks = 1;
};

StepData draw_step(const StepCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist;
  StepData s{c, {}, {}, {}, is_fp8(c.cache) ? 0.05f : 1.0f, 1};
  auto token = [&] {
    Token t;
    for (int i = 0; i < kN * (kP + kR); ++i) t.q.push_back(round_to(dist(rng), c.dtype));
    for (int i = 0; i < kL; ++i) t.kv_c.push_back(round_to(dist(rng), c.dtype));
    for (int i = 0; i < kR; ++i) t.k_pe.push_back(round_to(dist(rng), c.dtype));
    return t;
  };
  int total_blocks = 0;
  for (const Req& r : c.reqs) {
    total_blocks += (r.context + r.count + c.block_size - 1) / c.block_size;
  }
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks));
  for (int i = 0; i < total_blocks; ++i) ids[size_t(i)] = i + 1;  // block 0 is the null block
  std::shuffle(ids.begin(), ids.end(), rng);
  s.num_blocks = total_blocks + 1;
  size_t next = 0;
  for (const Req& r : c.reqs) {
    std::vector<Token> toks;
    std::vector<int32_t> blocks;
    if (r.share_from >= 0) {
      const int shared = r.shared_blocks * c.block_size;
      toks.assign(s.tokens[size_t(r.share_from)].begin(),
                  s.tokens[size_t(r.share_from)].begin() + shared);
      blocks.assign(s.blocks[size_t(r.share_from)].begin(),
                    s.blocks[size_t(r.share_from)].begin() + r.shared_blocks);
    }
    while (int(toks.size()) < r.context + r.count) toks.push_back(token());
    while (int(blocks.size()) * c.block_size < r.context + r.count) blocks.push_back(ids[next++]);
    s.tokens.push_back(std::move(toks));
    s.blocks.push_back(std::move(blocks));
  }
  for (int i = 0; i < kL * kN * (kP + kV); ++i) s.w.push_back(dist(rng) * 0.2);
  return s;
}

// The requests that run the prefill formulation (vLLM's split unless forced).
std::vector<bool> prefill_requests(const StepData& s, MLAFormulation f) {
  std::vector<bool> p;
  for (const Req& r : s.c.reqs) {
    p.push_back(f == MLAFormulation::kPrefill ||
                (f == MLAFormulation::kSplit && r.count > s.c.decode_threshold));
  }
  return p;
}

// The step's output [T_a + padded_rows, N*V] in the activation dtype, poisoned with NaN first.
Tensor run_step(const StepData& s, MLAFormulation f, const std::string& backend,
                const Registry& registry) {
  const StepCase& c = s.c;
  ForwardContext ctx;
  MLAOptions o = mla_options(c.dtype, c.cache);
  o.cache_config->block_size = c.block_size;
  o.formulation = f;
  o.decode_threshold = c.decode_threshold;
  o.context_chunk_tokens = c.context_chunk_tokens;
  o.attn_backend = backend;
  MLAAttention layer(ctx, o, registry);
  const Tensor w = Tensor::empty({kL, kN * (kP + kV)}, DType::kF64);
  std::copy(s.w.begin(), s.w.end(), static_cast<double*>(w.data()));
  layer.load_kv_b_proj(w.view());
  const DType cd = layer.config().cache_dtype();
  Tensor cache = Tensor::zeros({s.num_blocks, c.block_size, kE}, cd);
  layer.bind_kv_cache(cache.view());
  if (is_fp8(c.cache)) layer.set_k_scale(s.k_scale);
  // The context as earlier steps left it: stored = x / k_scale for fp8.
  const double inv = is_fp8(c.cache) ? 1.0 / double(s.k_scale) : 1.0;
  MetadataBuilder b(c.block_size);
  int64_t t_a = 0;
  for (size_t r = 0; r < c.reqs.size(); ++r) {
    const Req& q = c.reqs[r];
    for (int pos = 0; pos < q.context; ++pos) {
      const Token& tk = s.tokens[r][size_t(pos)];
      const int64_t slot =
          int64_t(s.blocks[r][size_t(pos / c.block_size)]) * c.block_size + pos % c.block_size;
      for (int e = 0; e < kE; ++e) {
        const double x = e < kL ? tk.kv_c[size_t(e)] : tk.k_pe[size_t(e - kL)];
        store_element(cache.data(), cd, slot * kE + e, x * inv);
      }
    }
    b.add(RequestSpec{q.context, q.count, s.blocks[r]});
    t_a += q.count;
  }
  b.add_padding_requests(c.padding_requests);
  const int64_t t_total = t_a + c.padded_rows;
  b.pad_slots_to(int(t_total));
  const StepMetadata md = b.build();
  const AttentionMetadata view = md.view();
  Tensor q = Tensor::empty({t_total, kN, kP + kR}, c.dtype);
  Tensor kv_c = Tensor::empty({t_total, kL}, c.dtype), k_pe = Tensor::empty({t_total, kR}, c.dtype);
  std::normal_distribution<double> dist;
  std::mt19937 pad_rng(7);
  int64_t row = 0;
  for (size_t r = 0; r < c.reqs.size(); ++r) {
    for (int i = 0; i < c.reqs[r].count; ++i, ++row) {
      const Token& tk = s.tokens[r][size_t(c.reqs[r].context + i)];
      for (int e = 0; e < kN * (kP + kR); ++e)
        store_element(q.data(), c.dtype, row * kN * (kP + kR) + e, tk.q[size_t(e)]);
      for (int e = 0; e < kL; ++e)
        store_element(kv_c.data(), c.dtype, row * kL + e, tk.kv_c[size_t(e)]);
      for (int e = 0; e < kR; ++e)
        store_element(k_pe.data(), c.dtype, row * kR + e, tk.k_pe[size_t(e)]);
    }
  }
  for (; row < t_total; ++row) {  // padding rows: garbage the layer must not use
    for (int e = 0; e < kN * (kP + kR); ++e)
      store_element(q.data(), c.dtype, row * kN * (kP + kR) + e, 100 * dist(pad_rng));
    for (int e = 0; e < kL; ++e) store_element(kv_c.data(), c.dtype, row * kL + e, 1e4);
    for (int e = 0; e < kR; ++e) store_element(k_pe.data(), c.dtype, row * kR + e, -1e4);
  }
  Tensor out = Tensor::empty({t_total, kN * kV}, c.dtype);
  for (int64_t i = 0; i < out.view().numel(); ++i) store_element(out.data(), c.dtype, i, NAN);
  ctx.begin_step({&view});
  layer.forward(q.view(), kv_c.view(), k_pe.view(), out.view());
  ctx.end_step();
  return out;
}

// The non-absorbed formulation in float64 over rows [0, T_a). A request in the prefill
// formulation sees its new tokens as the inputs hold them (vLLM up-projects kv_c_normed, not
// the cache); everything else is read as the cache stores it.
Tensor step_reference(const StepData& s, const std::vector<bool>& prefill) {
  const StepCase& c = s.c;
  int64_t t_a = 0;
  for (const Req& r : c.reqs) t_a += r.count;
  Tensor out = Tensor::empty({t_a, kN * kV}, DType::kF64);
  double* o = static_cast<double*>(out.data());
  const DType cache = is_fp8(c.cache) ? DType::kFp8E4M3 : kv_cache_storage_dtype(c.cache, c.dtype);
  auto stored = [&](double x) {
    return is_fp8(c.cache) ? round_to(x / s.k_scale, cache) * s.k_scale : round_to(x, cache);
  };
  auto weight = [&](int l, int h, int col) {
    return round_to(s.w[size_t(l) * kN * (kP + kV) + size_t(h) * (kP + kV) + size_t(col)], c.dtype);
  };
  const double scale = 1.0 / std::sqrt(double(kP + kR));
  int64_t row = 0;
  for (size_t r = 0; r < c.reqs.size(); ++r) {
    const Req& req = c.reqs[r];
    const int len = req.context + req.count;
    // Per key token and head: K [P + R] and V [V], expanded in float64.
    std::vector<double> k(size_t(len) * kN * (kP + kR)), v(size_t(len) * kN * kV);
    for (int j = 0; j < len; ++j) {
      const Token& tk = s.tokens[r][size_t(j)];
      const bool raw = prefill[r] && j >= req.context;
      std::vector<double> lat(kL);
      for (int l = 0; l < kL; ++l)
        lat[size_t(l)] = raw ? tk.kv_c[size_t(l)] : stored(tk.kv_c[size_t(l)]);
      for (int h = 0; h < kN; ++h) {
        double* kr = &k[(size_t(j) * kN + size_t(h)) * (kP + kR)];
        double* vr = &v[(size_t(j) * kN + size_t(h)) * kV];
        for (int p = 0; p < kP; ++p)
          for (int l = 0; l < kL; ++l) kr[p] += lat[size_t(l)] * weight(l, h, p);
        for (int e = 0; e < kR; ++e)
          kr[kP + e] = raw ? tk.k_pe[size_t(e)] : stored(tk.k_pe[size_t(e)]);
        for (int x = 0; x < kV; ++x)
          for (int l = 0; l < kL; ++l) vr[x] += lat[size_t(l)] * weight(l, h, kP + x);
      }
    }
    for (int i = 0; i < req.count; ++i, ++row) {
      const int pos = req.context + i;
      const Token& qt = s.tokens[r][size_t(pos)];
      for (int h = 0; h < kN; ++h) {
        std::vector<double> logit(size_t(pos + 1));
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int e = 0; e < kP + kR; ++e)
            dot += qt.q[size_t(h) * (kP + kR) + size_t(e)] *
                   k[(size_t(j) * kN + size_t(h)) * (kP + kR) + size_t(e)];
          mx = std::max(mx, logit[size_t(j)] = dot * scale);
        }
        for (double& x : logit) sum += (x = std::exp(x - mx));
        for (int x = 0; x < kV; ++x) {
          double acc = 0;
          for (int j = 0; j <= pos; ++j)
            acc += logit[size_t(j)] * v[(size_t(j) * kN + size_t(h)) * kV + size_t(x)];
          o[row * kN * kV + h * kV + x] = acc / sum;
        }
      }
    }
  }
  return out;
}

int64_t actual_tokens(const StepCase& c) {
  int64_t t = 0;
  for (const Req& r : c.reqs) t += r.count;
  return t;
}

// Every row of a real token written (finite), every padded row left as poisoned.
void expect_rows_written(const Tensor& out, int64_t t_a, const std::string& what) {
  int64_t finite = 0, untouched = 0;
  const int64_t width = out.view().size(1);
  for (int64_t i = 0; i < out.view().numel(); ++i) {
    const double x = load_element(out.data(), out.view().dtype, i);
    if (i < t_a * width)
      finite += std::isfinite(x) ? 1 : 0;
    else
      untouched += std::isnan(x) ? 1 : 0;
  }
  EXPECT_EQ(finite, t_a * width) << what;
  EXPECT_EQ(untouched, out.view().numel() - t_a * width) << what;
}

// The backends a layer of this dtype can select on the host, by name.
std::vector<std::string> cpu_backends(DType dtype, KVCacheDType cache) {
  std::vector<std::string> names;
  ForwardContext probe_ctx;
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  const MLAAttention probe(probe_ctx, mla_options(dtype, cache), lowp);
  for (const Backend* b : default_registry().backends()) {
    if (b->check({probe.config(), Device::cpu()}).empty()) names.emplace_back(b->name());
  }
  return names;
}

// The step in formulation `f` on every host backend against the float64 loop; returns the
// low-precision reference's error (the budget).
ErrorStats check_step(const StepData& s, MLAFormulation f) {
  const StepCase& c = s.c;
  const std::string what = c.name + " (" + std::string(to_string(f)) + ", " +
                           std::string(dtype_name(c.dtype)) + ", cache " +
                           std::string(to_string(c.cache)) + ", block " +
                           std::to_string(c.block_size) + ")";
  const int64_t t_a = actual_tokens(c);
  const Tensor want = step_reference(s, prefill_requests(s, f));
  Registry lowp;
  lowp.add(ref::make_backend(ref::Precision::kLowPrecision));
  const Tensor base_out = run_step(s, f, "ref_lowp", lowp);
  expect_rows_written(base_out, t_a, what + " ref_lowp");
  const ErrorStats base = compare(base_out.view().slice(0, 0, t_a), want.view());
  // The layer's own arithmetic (projections, expansion, merges) is shared by every backend, so
  // the relative rule alone cannot see an error in it; the baseline must be close to float64 in
  // absolute terms too (float32: float32 rounding; 16-bit: vLLM's MLA rtol of 1e-2 over a few
  // roundings) and in relative L2 (a few units of the dtype's rounding: the naive baseline
  // measures 2e-7, 4e-4 and 3e-3 here; an fp8 new token read rounded instead of raw, 3e-2).
  const double rel = c.dtype == DType::kF32 ? 1e-4 : 3e-2;
  EXPECT_LE(base.max_abs, rel * std::max(1.0, base.max_ref)) << what << ": " << base.to_string();
  const double rel_l2 = c.dtype == DType::kF32 ? 1e-5 : c.dtype == DType::kF16 ? 2e-3 : 1.5e-2;
  EXPECT_LE(base.rel_l2, rel_l2) << what << ": " << base.to_string();
  int tested = 0;
  for (const std::string& name : cpu_backends(c.dtype, c.cache)) {
    ++tested;
    const Tensor got = run_step(s, f, name, default_registry());
    expect_rows_written(got, t_a, what + " " + name);
    const ErrorStats err = compare(got.view().slice(0, 0, t_a), want.view());
    EXPECT_TRUE(within_budget(err, base, default_tolerance(c.dtype)))
        << name << " " << what << ": " << err.to_string()
        << " (low-precision reference: " << base.to_string() << ")";
  }
  EXPECT_GE(tested, default_registry().find("cpu") != nullptr ? 2 : 1) << what;
  return base;
}

const KVCacheDType kAuto = KVCacheDType::kAuto, kE4M3 = KVCacheDType::kFp8E4M3;

std::vector<StepCase> step_cases() {
  return {
      {"pure prefill", DType::kBF16, kAuto, 16, {{0, 9}, {0, 17}, {0, 5}}},
      {"context in several chunks", DType::kBF16, kAuto, 16, {{70, 6}, {45, 9}, {0, 4}}, 32},
      {"block size 1, chunks", DType::kF32, kAuto, 1, {{37, 5}, {0, 3}, {12, 8}}, 10},
      {"block size 64, chunks", DType::kF16, kAuto, 64, {{150, 7}, {10, 20}}, 128},
      {"prefix caching", DType::kBF16, kAuto, 16, {{40, 5}, {32, 6, 0, 2}, {20, 1}, {16, 9, 0, 1}}},
      {"mixed, zero-length, padded, fp8",
       DType::kF16,
       kE4M3,
       16,
       {{33, 1}, {12, 0}, {25, 8}, {0, 11}, {12, 1}},
       24,
       1,
       2,
       3},
      {"fp8, block size 64", DType::kBF16, kE4M3, 64, {{100, 5}, {64, 3}, {5, 1}}, 64},
      {"fp8, block size 1", DType::kBF16, kE4M3, 1, {{20, 4}, {3, 1}, {0, 6}}, 8},
      {"spec-decode threshold", DType::kBF16, kAuto, 16, {{30, 3}, {18, 4}, {0, 9}}, 4096, 3},
  };
}

TEST(MLAAttention, SplitAndPrefillFormulationsMatchTheNonAbsorbedLoop) {
  uint32_t seed = 100;
  for (const StepCase& c : step_cases()) {
    const StepData s = draw_step(c, seed++);
    check_step(s, MLAFormulation::kSplit);
    check_step(s, MLAFormulation::kPrefill);
  }
}

// Without an fp8 cache both formulations compute the same function: on one step, the cpu (or
// ref) layer's two results are as close as the budgets of their low-precision references allow.
TEST(MLAAttention, TheTwoFormulationsAgreeOnTheSameStep) {
  uint32_t seed = 200;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int bs : {1, 16, 64}) {
      const StepCase c{"agreement", dtype, kAuto, bs, {{21, 1}, {40, 7}, {0, 12}, {9, 2}}, 16};
      const StepData s = draw_step(c, seed++);
      const ErrorStats absorbed = check_step(s, MLAFormulation::kAbsorbed);
      const ErrorStats prefill = check_step(s, MLAFormulation::kPrefill);
      const std::string backend = cpu_backends(dtype, kAuto).front();
      const int64_t t_a = actual_tokens(c);
      const Tensor a = run_step(s, MLAFormulation::kAbsorbed, backend, default_registry());
      const Tensor p = run_step(s, MLAFormulation::kPrefill, backend, default_registry());
      const ErrorStats diff = compare(a.view().slice(0, 0, t_a), p.view().slice(0, 0, t_a));
      const Tolerance tol = default_tolerance(dtype);
      EXPECT_LE(diff.max_abs, tol.multiple * (absorbed.max_abs + prefill.max_abs) + tol.atol)
          << backend << " " << dtype_name(dtype) << " block " << bs << ": " << diff.to_string();
      EXPECT_EQ(diff.mismatched_nonfinite, 0);
    }
  }
}

// The reference with a merge that keeps only the prefix side: the context chunks of a prefill
// go through the backend's merge_states, so the layer's result must fail the rule.
class PrefixOnlyMergeBackend final : public Backend {
 public:
  explicit PrefixOnlyMergeBackend(std::unique_ptr<Backend> ref) : ref_(std::move(ref)) {}
  std::string_view name() const override { return "prefix_only_merge"; }
  std::string_view description() const override { return "ref, merge_states keeps the prefix"; }
  std::vector<std::string> check(const BackendQuery& q) const override { return ref_->check(q); }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device d) const override {
    return ref_->make_impl(c, d);
  }
  std::unique_ptr<Plan> plan(const AttentionMetadata& md, const AttentionConfig& c) const override {
    return ref_->plan(md, c);
  }
  void merge_states(const MergeArgs& a) const override {
    MergeArgs wrong = a;
    wrong.suffix_output = a.prefix_output;
    wrong.suffix_lse = a.prefix_lse;
    ref_->merge_states(wrong);
  }

 private:
  std::unique_ptr<Backend> ref_;
};

TEST(MLAAttention, ThePrefillFormulationMergesThroughTheBackend) {
  const StepCase c{"bad merge", DType::kF32, kAuto, 16, {{40, 6}, {0, 5}}, 16};
  const StepData s = draw_step(c, 300);
  const Tensor want = step_reference(s, prefill_requests(s, MLAFormulation::kSplit));
  Registry registry;
  registry.add(
      std::make_unique<PrefixOnlyMergeBackend>(ref::make_backend(ref::Precision::kFloat64)));
  const int64_t t_a = actual_tokens(c);
  const Tensor got = run_step(s, MLAFormulation::kSplit, "prefix_only_merge", registry);
  EXPECT_GT(compare(got.view().slice(0, 0, t_a), want.view()).max_abs, 1e-2);
  // The absorbed formulation merges nothing: there the same backend is right.
  const Tensor fresh = run_step(s, MLAFormulation::kAbsorbed, "prefix_only_merge", registry);
  EXPECT_LT(compare(fresh.view().slice(0, 0, t_a), want.view()).max_abs, 1e-4);
}

// A backend that takes any device (its attention is the reference's, never run here), with or
// without MLA device operations that record what the layer asks of them.
class RecordingOps final : public MLADeviceOps {
 public:
  void build_latent(const TensorView&, const TensorView&, const TensorView&,
                    Stream) const override {
    calls.push_back("build_latent");
  }
  void absorb_query(const TensorView&, const float*, int, const TensorView&, const int64_t*,
                    Stream) const override {
    calls.push_back("absorb_query");
  }
  void up_project(const TensorView&, const float*, int, int, int64_t, const TensorView&,
                  const int64_t*, Stream) const override {
    calls.push_back("up_project");
  }
  void gather_latent(const TensorView&, const TensorView&, const int32_t*, float, const TensorView&,
                     Stream) const override {
    calls.push_back("gather_latent");
  }
  void expand_kv(const TensorView&, const float*, const float*, int, int, const TensorView&,
                 const TensorView&, Stream) const override {
    calls.push_back("expand_kv");
  }
  void copy_heads(const TensorView&, const TensorView&, Stream) const override {
    calls.push_back("copy_heads");
  }
  void zero_rows(const TensorView& out, Stream stream) const override {
    calls.push_back("zero_rows");
    zeroed = out;
    zero_stream = stream;
  }
  mutable std::vector<std::string> calls;
  mutable TensorView zeroed;
  mutable Stream zero_stream;
};

class AnyDeviceBackend final : public Backend {
 public:
  AnyDeviceBackend(std::string name, const MLADeviceOps* ops) : name_(std::move(name)), ops_(ops) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "ref on any device (tests)"; }
  std::vector<std::string> check(const BackendQuery&) const override { return {}; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device) const override {
    return ref_->make_impl(c, Device::cpu());
  }
  const MLADeviceOps* mla_device_ops() const override { return ops_; }

 private:
  std::string name_;
  const MLADeviceOps* ops_;
  std::unique_ptr<Backend> ref_ = ref::make_backend(ref::Precision::kFloat64);
};

// Device tensors reach the kernels around the attention only through the selected backend's
// MLADeviceOps: a profiling step (no metadata) is the ops' zero_rows on the layer's stream, and
// a backend without ops refuses the step naming itself. The views claim cuda:0 over host memory
// that nothing reads.
TEST(MLAAttention, DeviceTensorsGoThroughTheBackendsDeviceOps) {
  RecordingOps ops;
  Registry registry;
  registry.add(std::make_unique<AnyDeviceBackend>("with_ops", &ops));
  registry.add(std::make_unique<AnyDeviceBackend>("without_ops", nullptr));
  const Device dev = Device::cuda(0);
  std::vector<float> q(size_t(2) * kN * (kP + kR)), kv(size_t(2) * kL), pe(size_t(2) * kR);
  std::vector<float> out(size_t(2) * kN * kV);
  const TensorView qv = TensorView::contiguous(q.data(), DType::kF32, {2, kN, kP + kR}, dev);
  const TensorView kvv = TensorView::contiguous(kv.data(), DType::kF32, {2, kL}, dev);
  const TensorView pev = TensorView::contiguous(pe.data(), DType::kF32, {2, kR}, dev);
  const TensorView outv = TensorView::contiguous(out.data(), DType::kF32, {2, kN * kV}, dev);
  ForwardContext ctx;
  MLAOptions o = mla_options(DType::kF32, kAuto);
  o.device = dev;
  o.attn_backend = "with_ops";
  MLAAttention layer(ctx, o, registry);
  int stream_tag = 0;
  ctx.begin_profile_step();
  layer.forward(qv, kvv, pev, outv, Stream{&stream_tag});
  EXPECT_EQ(ops.calls, std::vector<std::string>{"zero_rows"});
  EXPECT_EQ(ops.zeroed.data, outv.data);
  EXPECT_EQ(ops.zero_stream.handle, &stream_tag);

  o.attn_backend = "without_ops";
  MLAAttention refused(ctx, o, registry);
  EXPECT_ERROR(refused.forward(qv, kvv, pev, outv), NotSupported,
               "backend 'without_ops' has no MLA device operations");
  ctx.end_step();
}

TEST(MLAAttention, ValidatesFormulationOptions) {
  EXPECT_EQ(parse_mla_formulation("prefill"), MLAFormulation::kPrefill);
  EXPECT_EQ(to_string(parse_mla_formulation("split")), "split");
  EXPECT_ERROR(parse_mla_formulation("expanded"), InvalidArgument,
               "MLA formulation 'expanded' is not one of split, absorbed, prefill");
  ForwardContext ctx;
  MLAOptions o = mla_options(DType::kF32, kAuto);
  o.decode_threshold = 0;
  EXPECT_ERROR(MLAAttention layer(ctx, o), InvalidArgument, "decode_threshold (0) must be >= 1");
  o.decode_threshold = 1;
  o.context_chunk_tokens = 0;
  EXPECT_ERROR(MLAAttention layer(ctx, o), InvalidArgument,
               "context_chunk_tokens (0) must be >= 1");
}

}  // namespace
}  // namespace pagedattn
