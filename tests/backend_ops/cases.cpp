#include "cases.h"

#include <cmath>
#include <sstream>

namespace pagedattn::backend_ops {
namespace {

AttentionConfig base_config() {
  AttentionConfig c;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_size = 64;
  c.scale = 1.0f / std::sqrt(64.0f);
  c.dtype = DType::kBF16;
  c.block_size = 16;
  return c;
}

// A mixed step: fresh prefill, decode, chunked prefill over context, a zero-length padding
// request, and a 3-token speculative-decode verification.
std::vector<RequestShape> mixed_batch() {
  return {{0, 37}, {45, 1}, {64, 16}, {0, 0}, {20, 3}};
}

std::string describe(const OpCase& k) {
  const AttentionConfig& c = k.config;
  std::ostringstream os;
  os << to_string(c.attn_type) << " d=" << c.head_size;
  if (c.head_size_v() != c.head_size) os << " dv=" << c.head_size_v();
  os << " h=" << c.num_heads << "/" << c.num_kv_heads << " " << dtype_name(c.dtype)
     << " kv=" << to_string(c.kv_cache_dtype) << " " << to_string(c.kv_cache_layout)
     << " bs=" << c.block_size;
  if (c.sliding_window) os << " window=" << *c.sliding_window;
  if (c.logits_soft_cap) os << " softcap=" << *c.logits_soft_cap;
  if (c.has_alibi()) os << " alibi";
  if (c.has_sinks()) os << " sinks";
  if (c.query_quant) os << " query_quant";
  return os.str();
}

class Matrix {
 public:
  explicit Matrix(uint32_t seed_base) : seed_base_(seed_base) {}
  void add(std::string tag, AttentionConfig c, std::vector<RequestShape> requests,
           int pad_tokens = 0, float input_std = 1.0f) {
    OpCase k;
    k.config = c;
    k.config.scale = c.scale > 0 ? c.scale : 1.0f / std::sqrt(float(c.head_size));
    k.requests = std::move(requests);
    k.pad_tokens = pad_tokens;
    k.input_std = input_std;
    if (is_fp8(c.kv_cache_dtype)) {
      // Non-trivial scales so that a backend ignoring them fails.
      k.k_scale = 0.75f;
      k.v_scale = 1.5f;
    }
    // An fp8 query: q / q_scale spans e4m3's range (|q| up to ~5 sigma -> ~250 of 448), the
    // rare largest saturate.
    if (c.query_quant) k.q_scale = 0.02f * input_std;
    k.seed = seed_base_ + uint32_t(cases_.size());
    k.name = tag + ": " + describe(k);
    cases_.push_back(std::move(k));
  }
  // An MLA-shaped case whose cache binds one latent entry as K and V and whose output takes the
  // first out_cols columns (MLAAttention's binding: 512; 576 is the generic contract).
  void add_latent(std::string tag, AttentionConfig c, std::vector<RequestShape> requests,
                  int pad_tokens = 0, int out_cols = 512) {
    add(std::move(tag), c, std::move(requests), pad_tokens);
    OpCase& k = cases_.back();
    k.latent = true;
    k.v_scale = k.k_scale;  // the latent has one scale
    k.out_cols = out_cols;
    k.name += " latent out=" + std::to_string(out_cols);
  }
  OpCase& last() { return cases_.back(); }
  std::vector<OpCase> take() { return std::move(cases_); }

 private:
  uint32_t seed_base_;
  std::vector<OpCase> cases_;
};

// Per-head scales whose values differ strongly from head to head (and sequence to sequence):
// a backend that reads one value for all (element 0, say) fails.
std::vector<float> spread_scales(int n, float lo, float hi) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    // Geometric from lo to hi, alternating ends so that neighbours differ most.
    const int j = i % 2 == 0 ? i / 2 : n - 1 - i / 2;
    v[size_t(i)] = n == 1 ? lo : lo * std::pow(hi / lo, float(j) / float(n - 1));
  }
  return v;
}

}  // namespace

KVScales write_scales(const OpCase& k) {
  KVScales s{k.k_scale, k.v_scale, k.q_scale, {}, {}, {}};
  const size_t heads = size_t(k.config.num_kv_heads);
  if (k.k_scales.size() == heads) s.k_scales = k.k_scales;
  if (k.v_scales.size() == heads) s.v_scales = k.v_scales;
  return s;
}

KVScales forward_scales(const OpCase& k) {
  return {k.k_scale, k.v_scale, k.q_scale, k.k_scales, k.v_scales, k.q_scales};
}

std::vector<OpCase> make_case_matrix(uint32_t seed_base) {
  Matrix m(seed_base);
  const AttentionConfig base = base_config();

  // Head sizes x GQA ratios (1 = MHA, 4, 8 = MQA with 8 query heads).
  for (int d : {64, 80, 96, 112, 128, 192, 256}) {
    for (int kv : {8, 2, 1}) {
      AttentionConfig c = base;
      c.head_size = d;
      c.num_kv_heads = kv;
      c.scale = 0;
      m.add("heads", c, mixed_batch(), 2);
    }
  }
  // Block sizes, including 1 and sizes larger than any request.
  for (int bs : {1, 2, 16, 32, 64, 128, 256}) {
    AttentionConfig c = base;
    c.block_size = bs;
    m.add("block_size", c, mixed_batch(), 1);
  }
  // Activation dtype x cache dtype.
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kBFloat16, KVCacheDType::kFloat16,
                            KVCacheDType::kFloat32, KVCacheDType::kFp8, KVCacheDType::kFp8E4M3,
                            KVCacheDType::kFp8E5M2}) {
      AttentionConfig c = base;
      c.dtype = dt;
      c.kv_cache_dtype = kv;
      m.add("dtypes", c, mixed_batch(), 1);
    }
  }
  // HND layout.
  for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
    for (int bs : {1, 16}) {
      AttentionConfig c = base;
      c.kv_cache_layout = KVCacheLayout::kHND;
      c.kv_cache_dtype = kv;
      c.block_size = bs;
      m.add("layout", c, mixed_batch(), 1);
    }
  }
  // Masks and features, alone and in the combinations models use.
  auto feature = [&](const char* tag, auto&& mutate, int head_size = 64) {
    AttentionConfig c = base;
    c.head_size = head_size;
    c.scale = 0;
    mutate(c);
    m.add(tag, c, mixed_batch(), 1);
  };
  for (int w : {1, 7, 32, 100})
    feature("window", [w](AttentionConfig& c) { c.sliding_window = w; });
  for (float cap : {5.0f, 30.0f}) {
    feature("softcap", [cap](AttentionConfig& c) {
      c.logits_soft_cap = cap;
      c.scale = 0.5f;  // large logits, so the cap bites
    });
  }
  feature("alibi", [](AttentionConfig& c) { c.alibi_slopes = alibi_slopes(c.num_heads); });
  feature("sinks",
          [](AttentionConfig& c) { c.sinks = {-2.0f, -1.0f, 0.0f, 0.5f, 1.0f, 2.0f, 3.0f, 6.0f}; });
  feature(
      "gemma2",
      [](AttentionConfig& c) {  // soft cap + window, head size 256
        c.logits_soft_cap = 50.0f;
        c.sliding_window = 24;
      },
      256);
  feature("gpt-oss", [](AttentionConfig& c) {  // sinks + window, MQA-ish
    c.sinks = {0.5f, -0.5f, 1.0f, 2.0f, -3.0f, 0.0f, 1.5f, 0.25f};
    c.sliding_window = 16;
    c.num_kv_heads = 1;
  });
  feature("alibi+window", [](AttentionConfig& c) {
    c.alibi_slopes = alibi_slopes(c.num_heads);
    c.sliding_window = 20;
  });
  feature(
      "everything",
      [](AttentionConfig& c) {
        c.alibi_slopes = alibi_slopes(c.num_heads);
        c.sliding_window = 33;
        c.logits_soft_cap = 20.0f;
        c.sinks = {0, 1, 2, 3, -1, -2, -3, 0.5f};
        c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
        c.kv_cache_layout = KVCacheLayout::kHND;
      },
      128);
  // Attention types without a paged cache, and cross attention.
  for (AttentionType t : {AttentionType::kEncoder, AttentionType::kEncoderOnly}) {
    for (std::optional<int> w : {std::optional<int>{}, std::optional<int>{5}}) {
      AttentionConfig c = base;
      c.attn_type = t;
      c.sliding_window = w;
      m.add("encoder", c, {{0, 19}, {0, 0}, {0, 1}, {0, 40}});
    }
  }
  {
    AttentionConfig c = base;
    c.attn_type = AttentionType::kEncoderOnly;
    c.alibi_slopes = alibi_slopes(c.num_heads);
    m.add("encoder", c, {{0, 25}, {0, 7}});
  }
  {
    AttentionConfig c = base;
    c.attn_type = AttentionType::kEncoderDecoder;
    // Encoder K/V written this step for requests 0 and 2, cached from before for request 1;
    // decoder queries of 1..4 tokens.
    m.add("cross", c, {{0, 4, 0, 30, true}, {0, 1, 0, 30, false}, {0, 2, 0, 30, true}});
    m.add("cross", c, {{0, 1, 0, 50, false}, {0, 1, 0, 50, false}});  // pure decode steps
    c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    m.add("cross", c, {{0, 3, 0, 17, true}, {0, 0, 0, 17, false}});
    // MultiHeadAttention with a key length other than the query's: decoder queries longer and
    // shorter than the encoder output, over one-token blocks; long enough for prefill kernels.
    c.kv_cache_dtype = KVCacheDType::kAuto;
    c.block_size = 1;
    m.add("cross", c, {{0, 150, 0, 37, true}, {0, 9, 0, 200, false}, {0, 1, 0, 1, true}});
  }
  // MLA's absorbed decode: every query head against one latent KV head of kv_lora_rank +
  // qk_rope_head_dim = 576 (DeepSeek-V3), block size 64, bf16 and fp8 latent caches.
  for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
    AttentionConfig c = base;
    c.head_size = 576;
    c.num_heads = 16;
    c.num_kv_heads = 1;
    c.block_size = 64;
    c.scale = 1.0f / std::sqrt(192.0f);  // (qk_nope + qk_rope)^-0.5
    c.kv_cache_dtype = kv;
    m.add("mla-latent", c, {{300, 1}, {70, 4}, {0, 9}});
  }
  // The same shapes bound as MLAAttention binds them (one cache as K and V, the output the 512
  // latent columns): the layout the CUDA MLA kernel serves. Block sizes 64 / 16 / 1, 16 and 128
  // heads, 1-4 query tokens with the causal offset, a 9-token prefill, zero-length and padded
  // requests, long contexts (split), steps of one or two tokens a request (swap AB's 16- and
  // 32-row CTAs), 32 heads. Two sets again with all 576 columns (the generic contract: on cuda
  // the kernel that computes P k_pe), one with an odd width (a 1-column tail).
  for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
    for (DType act : {DType::kBF16, DType::kF16}) {
      AttentionConfig c = base;
      c.head_size = 576;
      c.num_heads = 16;
      c.num_kv_heads = 1;
      c.block_size = 64;
      c.scale = 1.0f / std::sqrt(192.0f);
      c.dtype = act;
      c.kv_cache_dtype = kv;
      m.add_latent("mla", c, {{300, 1}, {70, 4}, {0, 9}, {0, 0}, {129, 2}, {1, 3}}, 3);
      m.add_latent("mla", c, {{300, 1}, {70, 4}, {0, 9}, {0, 0}, {129, 2}, {1, 3}}, 3, 576);
      m.add_latent("mla", c, {{2000, 1}, {1500, 4}});
      // Steps auto gives swap AB: one token a request (16-row CTAs), at most two (32-row CTAs),
      // short and split.
      m.add_latent("mla", c, {{300, 1}, {0, 0}, {129, 1}, {1, 1}}, 3);
      m.add_latent("mla", c, {{300, 2}, {70, 1}, {0, 0}, {129, 2}, {0, 2}}, 2);
      m.add_latent("mla", c, {{1100, 2}, {900, 1}});
      // 8 requests of ~600 keys: the planner takes 2 splits (at most one per 256 keys), which
      // swap AB merges in a cluster (cluster_merge.cuh); the 576-column cases (and more than 8
      // splits) run the combine kernel.
      m.add_latent("mla", c, std::vector<RequestShape>(8, RequestShape{600, 1}));
      std::vector<RequestShape> mtp(8, RequestShape{560, 2});
      mtp[3] = {600, 1};
      m.add_latent("mla", c, mtp);
      c.block_size = 16;
      m.add_latent("mla", c, {{100, 1}, {33, 2}, {0, 0}, {64, 3}}, 1);
      c.block_size = 1;
      m.add_latent("mla", c, {{77, 1}, {20, 4}});
      c.block_size = 64;
      c.num_heads = 128;
      m.add_latent("mla", c, {{200, 1}, {65, 2}});
      m.add_latent("mla", c, {{200, 1}, {65, 2}}, 0, 576);
      m.add_latent("mla", c, {{130, 1}, {64, 2}}, 0, 301);
      m.add_latent("mla", c, {{3000, 1}});
      // 32 heads x 1 token (DeepSeek-V3 at TP 4): auto's 32-row swap AB, short and split.
      c.num_heads = 32;
      m.add_latent("mla", c, {{200, 1}, {65, 1}, {0, 1}, {0, 0}}, 1);
      m.add_latent("mla", c, {{1100, 1}, {700, 1}});
    }
  }
  // Batch shapes.
  m.add("batch", base, {{130, 1}, {7, 1}, {255, 1}, {16, 1}, {0, 1}, {61, 1}, {300, 1}, {1, 1}});
  m.add("batch", base, {{0, 200}});
  m.add("batch", base, {{0, 333}, {17, 90}, {0, 1}, {250, 40}});  // many q tiles, mixed routes
  m.add("batch", base, {{128, 64}});  // chunked prefill, context a multiple of the block size
  m.add("batch", base, {{0, 0}, {0, 0}});
  m.add("batch", base, {{0, 0}, {33, 5}, {0, 0}}, 7);
  m.add("batch", base, {{48, 4}, {48, 9, 3}, {32, 1, 2}});  // prefix sharing
  // Long contexts with few (request, KV head) pairs: backends split the keys across threads
  // (or CTAs) and merge by LSE; sinks must then count once, windows cut some splits empty.
  {
    AttentionConfig c = base;
    c.num_kv_heads = 1;
    m.add("split", c, {{2500, 1}});
    m.add("split", c, {{1800, 4}});
    m.add("split", c, {{1500, 70}});  // chunked prefill over a long context: split prefill
    c.sinks = {1, 2, 3, 4, 0, -1, -2, 5};
    m.add("split", c, {{2100, 1}});
    c.sliding_window = 700;
    m.add("split", c, {{3000, 2}});
    c.sinks.clear();
    c.kv_cache_dtype = KVCacheDType::kFp8E5M2;
    c.head_size = 128;
    c.scale = 0;
    m.add("split", c, {{1500, 1}, {40, 1}});
  }
  {
    AttentionConfig c = base;
    c.scale = 0.6f;  // peaky softmax: large logit differences
    m.add("scale", c, mixed_batch(), 0, 2.0f);
    c.dtype = DType::kF32;
    c.scale = 0.01f;  // nearly flat
    m.add("scale", c, mixed_batch());
  }
  // A bf16 query far outside f16's range (either way) against an fp8 cache whose k_scale keeps
  // the scores near 1: kernels that multiply fp8 K in f16 scale Q's rows into f16 first and
  // undo it in the score factor (and in ALiBi's pre-scale: the last two cases).
  auto query_range = [&](float q_std, KVCacheDType kv, int d, bool alibi) {
    AttentionConfig c = base;
    c.dtype = DType::kBF16;
    c.kv_cache_dtype = kv;
    c.head_size = d;
    c.scale = 0;
    if (alibi) c.alibi_slopes = alibi_slopes(c.num_heads);
    m.add(q_std > 1 ? "query_large" : "query_small", c, {{0, 300}, {700, 150}, {45, 1}, {20, 3}},
          1);
    OpCase& k = m.last();
    k.query_std = q_std;
    k.key_std = 1.0f / q_std;
    k.k_scale = 1.0f / q_std;
  };
  for (float q_std : {0x1p20f, 0x1p-20f}) {
    for (KVCacheDType kv : {KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
      for (int d : {80, 128}) query_range(q_std, kv, d, false);
    }
  }
  query_range(0x1p20f, KVCacheDType::kFp8E4M3, 96, true);
  query_range(0x1p-20f, KVCacheDType::kFp8E5M2, 192, true);
  // A query row scaled up by the most the rule allows (2^126: its largest |q| is about 2^-118,
  // bf16 subnormals included) under a k_scale of 2^-25: the score factor 2^-126 * k_scale *
  // scale underflows, and the scores (below 2^-100) must still give near-uniform weights.
  for (KVCacheDType kv : {KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
    AttentionConfig c = base;
    c.dtype = DType::kBF16;
    c.kv_cache_dtype = kv;
    c.head_size = kv == KVCacheDType::kFp8E4M3 ? 128 : 80;
    c.scale = 0;
    m.add("query_tiny", c, {{0, 300}, {700, 150}, {45, 1}, {20, 3}}, 1);
    OpCase& k = m.last();
    k.query_std = 0x1p-120f;
    k.key_std = 0x1p-22f;
    k.k_scale = 0x1p-25f;
  }
  // query_quant: the query quantised to fp8 e4m3 (and, on the Hopper prefill kernel, QK^T and
  // P V as fp8 products). Head sizes with and without an fp8 product kernel, both 16-bit
  // activations, long rows (prefill kernels) beside decode rows, several KV tiles and splits,
  // the features and block sizes of the tensor-map and gather paths.
  {
    AttentionConfig c = base;
    c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    c.query_quant = true;
    const std::vector<RequestShape> long_batch = {{0, 300}, {700, 150}, {45, 1}, {0, 0}, {20, 3}};
    for (int d : {64, 80, 96, 128, 256}) {
      for (DType dt : {DType::kBF16, DType::kF16}) {
        c.head_size = d;
        c.dtype = dt;
        c.scale = 0;
        m.add("qquant", c, long_batch, 1);
      }
    }
    c.dtype = DType::kBF16;
    c.head_size = 128;
    c.scale = 0;
    m.add("qquant", c, mixed_batch(), 2);
    c.kv_cache_dtype = KVCacheDType::kFp8;  // "fp8" is e4m3
    c.block_size = 64;
    c.num_kv_heads = 1;
    m.add("qquant", c, {{1500, 300}, {0, 129}});
    c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    c.block_size = 16;
    c.num_kv_heads = 2;
    c.sliding_window = 100;
    c.sinks = {1, 2, 3, 4, 0, -1, -2, 5};
    m.add("qquant", c, long_batch);
    c.sliding_window.reset();
    c.sinks.clear();
    c.logits_soft_cap = 20.0f;
    c.alibi_slopes = alibi_slopes(c.num_heads);
    m.add("qquant", c, long_batch);
  }
  // Full K/V tiles by TMA in the Hopper prefill kernel (16-bit caches, head sizes that are
  // multiples of 64; the tile is 128 keys up to head size 128, 64 above): block sizes below,
  // at and above the tile, both layouts, an encoder's own key tensor, a window (tiles off the
  // box grid: cp.async), the soft cap / ALiBi instance; long rows beside decode rows, each
  // request's partial last tile by cp.async.
  {
    const std::vector<RequestShape> long_batch = {{0, 300}, {700, 150}, {45, 1}, {0, 0}, {20, 3}};
    AttentionConfig c = base;
    c.scale = 0;
    c.head_size = 128;
    for (int bs : {8, 16, 64, 256}) {
      c.block_size = bs;
      m.add("tma", c, long_batch, 1);
    }
    c.block_size = 16;
    c.kv_cache_layout = KVCacheLayout::kHND;
    m.add("tma", c, long_batch, 1);
    c.kv_cache_layout = KVCacheLayout::kNHD;
    c.dtype = DType::kF16;
    c.head_size = 256;
    m.add("tma", c, long_batch);
    c.dtype = DType::kBF16;
    c.head_size = 192;
    c.block_size = 32;
    m.add("tma", c, long_batch);
    c.head_size = 128;
    c.block_size = 16;
    c.logits_soft_cap = 30.0f;
    c.alibi_slopes = alibi_slopes(c.num_heads);
    m.add("tma", c, long_batch);
    c.logits_soft_cap.reset();
    c.alibi_slopes.clear();
    c.sliding_window = 100;
    c.sinks = {1, 2, 3, 4, 0, -1, -2, 5};
    m.add("tma", c, long_batch);
    c.sliding_window.reset();
    c.sinks.clear();
    for (AttentionType t : {AttentionType::kEncoder, AttentionType::kEncoderOnly}) {
      c.attn_type = t;
      m.add("tma", c, {{0, 300}, {0, 1}, {0, 0}, {0, 150}});
    }
  }
  // A group that does not divide the prefill kernels' 128 packed rows (Qwen2's 28 / 4): packed
  // rows straddle tokens at tile edges, and the Hopper kernel copies Q by cp.async, not TMA.
  // Last, so that the cases before it keep their seeds.
  {
    AttentionConfig c = base;
    c.head_size = 128;
    c.num_heads = 28;
    c.num_kv_heads = 4;
    c.scale = 0;
    m.add("heads", c, mixed_batch(), 1);
  }
  // FlashAttention's edge cases: requests with no keys (output 0, LSE -inf), a decoder query
  // longer than its keys under the bottom-right causal mask (its first rows see no key), with a
  // window, sinks, the soft cap, ALiBi and an fp8 cache composed on it, and empty batches.
  {
    auto keys = [](int query_len, int seq_len) {
      RequestShape r{0, query_len};
      r.seq_len = seq_len;
      return r;
    };
    AttentionConfig c = base;
    m.add("no_keys", c, {{20, 2}, keys(3, 0), {0, 5}}, 1);
    m.add("q_longer", c, {{0, 37}, keys(9, 4), {45, 1}, keys(40, 17)});
    c.sliding_window = 3;
    m.add("q_longer", c, {keys(9, 4), keys(2, 0), {30, 2}});
    c.sliding_window.reset();
    c.sinks = {-2.0f, -1.0f, 0.0f, 0.5f, 1.0f, 2.0f, 3.0f, 6.0f};
    m.add("q_longer", c, {keys(9, 4), keys(2, 0), {30, 2}});
    c.sinks.clear();
    c.logits_soft_cap = 30.0f;
    c.alibi_slopes = alibi_slopes(c.num_heads);
    m.add("q_longer", c, {keys(9, 4), keys(2, 0), {30, 2}});
    c = base;
    c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    m.add("q_longer", c, {keys(9, 4), keys(2, 0), {30, 2}});
    m.add("empty", base, {});
    AttentionConfig cross = base;
    cross.attn_type = AttentionType::kEncoderDecoder;
    m.add("no_keys", cross, {{0, 2, 0, 0, false}, {0, 3, 0, 20, false}});
    m.add("empty", cross, {});
    AttentionConfig enc = base;
    enc.attn_type = AttentionType::kEncoder;
    m.add("empty", enc, {});
  }
  // Per-head fp8 scales (vLLM's per-head cache quantisation, FlashAttention 3's [batch, kv_heads]
  // descales), differing by 8x and more between heads: GQA with [num_kv_heads] scales through
  // write_kv and forward, MQA with [num_seqs * num_kv_heads] descales (one head: only sequences
  // can differ), decode, prefill and mixed steps, both fp8 formats. Last, as above.
  {
    const std::vector<std::pair<std::string, std::vector<RequestShape>>> steps = {
        {"decode", {{45, 1}, {700, 1}, {20, 1}}},
        {"prefill", {{0, 150}, {30, 60}}},
        {"mixed", mixed_batch()}};
    for (KVCacheDType kv : {KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
      for (int kv_heads : {4, 1}) {
        for (const auto& [step_name, step] : steps) {
          AttentionConfig c = base;
          c.kv_cache_dtype = kv;
          c.num_kv_heads = kv_heads;
          c.head_size = 128;
          c.scale = 0;
          m.add("head_scales", c, step, 1);
          OpCase& k = m.last();
          const int seqs = int(step.size());
          const int n = kv_heads == 1 ? seqs : kv_heads;
          k.k_scales = spread_scales(n, 0.25f, 3.0f);
          k.v_scales = spread_scales(n, 4.0f, 0.3f);
          k.name += (kv_heads == 1 ? " scales=[seq,kv_head] " : " scales=[kv_head] ") + step_name;
        }
      }
    }
    // query_quant with a q scale per KV head (and k/v per head).
    AttentionConfig c = base;
    c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    c.query_quant = true;
    c.num_kv_heads = 4;
    c.head_size = 128;
    c.scale = 0;
    m.add("head_scales", c, mixed_batch(), 1);
    OpCase& k = m.last();
    k.k_scales = spread_scales(4, 0.25f, 3.0f);
    k.v_scales = spread_scales(4, 4.0f, 0.3f);
    k.q_scales = spread_scales(4, 0.01f, 0.04f);
    k.name += " scales=[kv_head]";
  }
  // Head sizes off the multiples of 16 (SigLIP's 72, FlashAttention's any size up to 256) and
  // small ones: vector loops with a tail. Decode, prefill and mixed steps, bf16 and fp8 caches,
  // GQA 4; few tokens, so that they stay cheap.
  for (int d : {8, 32, 40, 59, 72, 80, 111, 160, 224, 256}) {
    for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
      AttentionConfig c = base;
      c.head_size = d;
      c.kv_cache_dtype = kv;
      c.scale = 0;
      m.add("any_head", c, {{40, 1}, {0, 1}, {70, 1}});             // decode
      m.add("any_head", c, {{0, 21}, {0, 70}});                     // prefill (many-row tiles)
      m.add("any_head", c, {{0, 9}, {33, 1}, {20, 3}, {0, 0}}, 1);  // mixed
    }
  }
  // float32 activations (the cuda generic kernel, its rows laid out at the next multiple of 16)
  // at sizes off the multiples of 16.
  for (int d : {40, 72}) {
    AttentionConfig c = base;
    c.head_size = d;
    c.dtype = DType::kF32;
    c.scale = 0;
    m.add("any_head", c, {{40, 1}, {0, 1}, {70, 1}});
    m.add("any_head", c, {{0, 9}, {33, 1}, {20, 3}, {0, 0}}, 1);
  }
  // The merge of split keys, and the encoder (no cache: MultiHeadAttention) path, at 72 and 59.
  for (int d : {72, 59}) {
    AttentionConfig c = base;
    c.head_size = d;
    c.num_kv_heads = 1;
    c.scale = 0;
    m.add("any_head", c, {{1500, 1}, {900, 2}});
    c.num_kv_heads = 2;
    c.attn_type = AttentionType::kEncoderOnly;
    m.add("any_head", c, {{0, 19}, {0, 1}, {0, 40}});
  }
  // V of a head size of its own (FlashAttention's dv < d; vLLM's MLA prefill: Q/K 192, V 128):
  // decode and prefill, bf16 and fp8 caches; an HND cache, split keys and the encoder path.
  for (auto [d, dv] : {std::pair{192, 128}, {128, 64}, {64, 32}, {72, 40}}) {
    for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
      AttentionConfig c = base;
      c.head_size = d;
      c.v_head_size = dv;
      c.kv_cache_dtype = kv;
      c.scale = 0;
      m.add("v_head", c, {{40, 1}, {0, 1}, {70, 2}});  // decode
      m.add("v_head", c, {{0, 21}, {30, 70}}, 1);      // prefill
    }
  }
  {
    // float32 (the cuda generic kernel) with V at half K's width.
    AttentionConfig c = base;
    c.head_size = 80;
    c.v_head_size = 40;
    c.dtype = DType::kF32;
    c.scale = 0;
    m.add("v_head", c, {{40, 1}, {0, 9}, {33, 1}}, 1);
  }
  {
    AttentionConfig c = base;
    c.head_size = 192;
    c.v_head_size = 128;
    c.scale = 0;
    c.kv_cache_layout = KVCacheLayout::kHND;
    m.add("v_head", c, {{0, 9}, {33, 1}, {20, 3}, {0, 0}}, 1);
    c.kv_cache_layout = KVCacheLayout::kNHD;
    c.num_kv_heads = 1;
    m.add("v_head", c, {{1500, 1}, {900, 2}});
    c.num_kv_heads = 2;
    c.attn_type = AttentionType::kEncoderOnly;
    m.add("v_head", c, {{0, 19}, {0, 1}, {0, 40}});
  }
  return m.take();
}

}  // namespace pagedattn::backend_ops
