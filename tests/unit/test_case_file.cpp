// Case files: every feature round-trips through safetensors and passes --check on `ref`; the
// cache is written exactly by the slot mapping; what the format tolerates is accepted; every
// missing or inconsistent field is an error that names it; check_case catches bad results.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace {

const Backend& ref_backend() {
  return *default_registry().find("ref");
}

CaseResult run_ref(const Case& c, bool lse = true) {
  RunCaseOptions options;
  options.lse = lse;
  return run_case(c, ref_backend(), options);
}

SafeTensors to_file(const Case& c) {
  return parse_safetensors(serialize_safetensors(case_to_safetensors(c)));
}

bool same_tensor(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  const TensorView &x = a.view(), &y = b.view();
  return x.dtype == y.dtype && x.shape_vector() == y.shape_vector() &&
         std::memcmp(x.data, y.data, x.nbytes()) == 0;
}

void expect_same_case(const Case& a, const Case& b) {
  const AttentionConfig &x = a.config, &y = b.config;
  EXPECT_EQ(x.num_heads, y.num_heads);
  EXPECT_EQ(x.num_kv_heads, y.num_kv_heads);
  EXPECT_EQ(x.head_size, y.head_size);
  EXPECT_EQ(x.scale, y.scale);
  EXPECT_EQ(x.sliding_window, y.sliding_window);
  EXPECT_EQ(x.logits_soft_cap, y.logits_soft_cap);
  EXPECT_EQ(x.alibi_slopes, y.alibi_slopes);
  EXPECT_EQ(x.sinks, y.sinks);
  EXPECT_EQ(x.attn_type, y.attn_type);
  EXPECT_EQ(x.dtype, y.dtype);
  EXPECT_EQ(x.kv_cache_dtype, y.kv_cache_dtype);
  EXPECT_EQ(x.block_size, y.block_size);
  EXPECT_EQ(a.scales.k_scale, b.scales.k_scale);
  EXPECT_EQ(a.scales.v_scale, b.scales.v_scale);
  EXPECT_EQ(a.scales.k_scales, b.scales.k_scales);
  EXPECT_EQ(a.scales.v_scales, b.scales.v_scales);
  EXPECT_EQ(a.scales.q_scales, b.scales.q_scales);
  EXPECT_EQ(x.query_quant, y.query_quant);
  if (x.query_quant) {
    EXPECT_EQ(a.scales.q_scale, b.scales.q_scale);
  }
  EXPECT_TRUE(same_tensor(a.query, b.query));
  EXPECT_TRUE(same_tensor(a.key, b.key));
  EXPECT_TRUE(same_tensor(a.value, b.value));
  EXPECT_TRUE(same_tensor(a.kv_cache, b.kv_cache));
  EXPECT_TRUE(same_tensor(a.block_table, b.block_table));
  EXPECT_TRUE(same_tensor(a.seq_lens, b.seq_lens));
  EXPECT_TRUE(same_tensor(a.query_start_loc, b.query_start_loc));
  EXPECT_TRUE(same_tensor(a.slot_mapping, b.slot_mapping));
}

// The cache after the step: the input cache with key/value row t stored at slot_mapping[t]
// (skipping -1), fp8 as saturate(x / scale); nothing else changes.
void expect_cache_written(const Case& c, const CaseResult& r) {
  if (!c.kv_cache.defined()) {
    EXPECT_FALSE(r.kv_cache.defined());
    return;
  }
  Tensor want = Tensor::copy_of(c.kv_cache.view(), Device::cpu());
  if (c.writes_kv() && uses_kv_cache(c.config.attn_type)) {
    const TensorView& kv = want.view();  // [num_blocks, 2, block_size, num_kv_heads, head_size]
    const bool fp8 = is_fp8(c.config.kv_cache_dtype);
    const int bs = c.config.block_size, hk = c.config.num_kv_heads, d = c.config.head_size;
    const TensorView& slots = c.slot_mapping.view();
    for (int64_t t = 0; t < slots.size(0); ++t) {
      const int64_t slot = slots.data_as<int64_t>()[t];
      if (slot < 0) continue;
      for (int half = 0; half < 2; ++half) {
        const TensorView& src = half == 0 ? c.key.view() : c.value.view();
        const std::vector<float>& heads = half == 0 ? c.scales.k_scales : c.scales.v_scales;
        for (int64_t e = 0; e < int64_t(hk) * d; ++e) {
          float scale = !fp8 ? 1.0f : half == 0 ? c.scales.k_scale : c.scales.v_scale;
          if (fp8 && !heads.empty()) scale = heads[size_t(e / d)];  // per KV head
          const float x = float(load_element(src.data, src.dtype, t * hk * d + e)) / scale;
          const int64_t at =
              (slot / bs) * kv.stride(0) + half * kv.stride(1) + (slot % bs) * kv.stride(2) + e;
          store_element(kv.data, kv.dtype, at, x);
        }
      }
    }
  }
  EXPECT_TRUE(same_tensor(want, r.kv_cache)) << "the cache after the step is not the input cache "
                                                "with exactly the slot-mapped rows written";
}

void expect_padding_zero(const Case& c, const CaseResult& r) {
  const int64_t ta = c.num_actual_tokens(), t = c.num_tokens();
  const TensorView& out = r.output.view();
  for (int64_t i = ta * out.size(1); i < t * out.size(1); ++i) {
    ASSERT_EQ(load_element(out.data, out.dtype, i), 0.0) << "output element " << i;
  }
  if (!r.lse.defined()) return;
  for (int64_t h = 0; h < r.lse.view().size(0); ++h) {
    for (int64_t i = ta; i < t; ++i) ASSERT_EQ(r.lse.data_as<float>()[h * t + i], 0.0f);
  }
}

struct Feature {
  const char* name;
  CaseSpec spec;
};

CaseSpec spec_with(std::vector<CaseRequest> requests) {
  CaseSpec s;
  s.requests = std::move(requests);
  return s;
}

std::vector<Feature> features() {
  std::vector<Feature> f;
  auto add = [&f](const char* name, CaseSpec s) {
    s.seed = f.size() + 1;
    f.push_back({name, std::move(s)});
  };
  add("decoder_with_context", spec_with({{13, 1}, {40, 1}, {16, 1}}));
  add("chunked_prefill", spec_with({{32, 16}, {7, 9}}));
  add("mixed_batch", spec_with({{10, 1}, {32, 16}, {0, 8}, {3, 1}}));
  CaseSpec s = spec_with({{5, 3}, {0, 4}});
  s.pad_tokens = 6;
  add("padded_slots", s);
  add("zero_length_request", spec_with({{0, 0}, {5, 3}, {0, 0}, {0, 2}}));
  s = spec_with({{9, 4}, {0, 3}});
  s.num_kv_heads = 1;
  s.dtype = DType::kF32;
  add("mqa_float32", s);
  s = spec_with({{9, 4}, {2, 1}});
  s.num_heads = s.num_kv_heads = 3;
  s.dtype = DType::kF16;
  s.block_size = 5;
  add("mha_float16_block_size_5", s);
  s = spec_with({{0, 5}, {0, 9}, {0, 1}});
  s.attn_type = AttentionType::kEncoder;
  s.pad_tokens = 2;
  add("encoder", s);
  s = spec_with({{0, 11}, {0, 4}});
  s.attn_type = AttentionType::kEncoderOnly;
  s.sliding_window = 3;
  add("encoder_only_window", s);
  s = spec_with({{20, 1}, {9, 2}});
  s.attn_type = AttentionType::kEncoderDecoder;
  add("encoder_decoder_with_kv", s);
  s.cross_kv = false;
  add("encoder_decoder_without_kv", s);
  s = spec_with({{13, 1}, {30, 7}});
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  s.scales = {0.005f, 3.0f};  // K saturates past |x| = 2.24
  add("fp8_e4m3_scaled", s);
  s.kv_cache_dtype = KVCacheDType::kFp8;
  s.scales = {0.5f, 1.0f};
  add("fp8_alias", s);
  s.kv_cache_dtype = KVCacheDType::kFp8E5M2;
  s.scales = {1.0f, 0.25f};
  s.dtype = DType::kF16;
  add("fp8_e5m2_scaled", s);
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  s.scales = {0.5f, 0.25f, 0.015f};
  s.query_quant = true;
  add("fp8_query_quant", s);
  s.query_quant = false;
  s = spec_with({{20, 1}, {30, 9}, {0, 12}});
  s.sliding_window = 5;
  add("sliding_window", s);
  s = spec_with({{20, 1}, {0, 12}});
  s.logits_soft_cap = 2.0f;
  s.scale = 1.0f;
  add("soft_cap", s);
  s = spec_with({{20, 1}, {6, 12}});
  s.alibi = true;
  add("alibi", s);
  s.alibi = false;
  s.sinks = true;
  add("sinks", s);
  s = spec_with({{0, 0}, {20, 1}, {6, 12}, {0, 5}});
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  s.scales = {0.5f, 0.75f};
  s.sliding_window = 7;
  s.logits_soft_cap = 10.0f;
  s.alibi = s.sinks = true;
  s.pad_tokens = 3;
  s.block_size = 4;
  add("everything_at_once", s);
  // Per-KV-head scales (2 KV heads) differing by 40x and more, both fp8 formats, a query_quant
  // case with a q scale per KV head.
  s = spec_with({{13, 1}, {30, 7}});
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  s.scales = {1.0f, 1.0f, 1.0f, {0.05f, 2.0f}, {4.0f, 0.1f}, {}};
  add("fp8_e4m3_head_scales", s);
  s.kv_cache_dtype = KVCacheDType::kFp8E5M2;
  add("fp8_e5m2_head_scales", s);
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  s.scales.q_scales = {0.004f, 0.03f};
  s.query_quant = true;
  add("fp8_query_quant_head_scales", s);
  return f;
}

class CaseFeature : public ::testing::TestWithParam<Feature> {};

TEST_P(CaseFeature, RoundTripsAndPassesCheckOnRef) {
  const Case c = make_random_case(GetParam().spec);
  const Case back = case_from_safetensors(to_file(c));
  expect_same_case(c, back);
  const CaseResult r = run_ref(back);
  expect_cache_written(back, r);
  expect_padding_zero(back, r);
  const CaseCheck check = check_case(back, r);
  EXPECT_TRUE(check.pass()) << check.to_string();
  EXPECT_TRUE(check.lse.has_value());
  EXPECT_EQ(check.output.got.count,
            int64_t(back.num_actual_tokens()) * back.config.num_heads * back.config.head_size);
}

INSTANTIATE_TEST_SUITE_P(Features, CaseFeature, ::testing::ValuesIn(features()),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// One new token and no context: softmax over one key is 1, so the output is that token's value
// read back from the cache (dequantised for fp8), whichever head group reads it.
TEST(CaseFile, FirstTokenAttendsToItsOwnValueReadFromTheCache) {
  for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3}) {
    CaseSpec s = spec_with({{0, 1}});
    s.kv_cache_dtype = kv;
    s.scales = {1.0f, 0.5f};
    s.dtype = DType::kF32;
    const Case c = make_random_case(s);
    const CaseResult r = run_ref(c, false);
    const int g = s.num_heads / s.num_kv_heads, d = s.head_size;
    for (int h = 0; h < s.num_heads; ++h) {
      for (int i = 0; i < d; ++i) {
        float v = c.value.data_as<float>()[(h / g) * d + i];
        if (is_fp8(kv)) v = fp8_e4m3_to_float(float_to_fp8_e4m3(v / 0.5f)) * 0.5f;
        EXPECT_NEAR(r.output.data_as<float>()[h * d + i], v, 1e-6f) << "head " << h;
      }
    }
  }
}

TEST(CaseFile, SaveAndLoad) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("pagedattn_case_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Case c = make_random_case(features()[2].spec);
  save_case((dir / "case.safetensors").string(), c);
  const Case back = load_case((dir / "case.safetensors").string());
  expect_same_case(c, back);

  const CaseResult r = run_ref(back);
  save_case_result((dir / "out.safetensors").string(), back, r, "ref");
  const SafeTensors out = load_safetensors((dir / "out.safetensors").string());
  EXPECT_TRUE(same_tensor(*out.find("output"), r.output));
  EXPECT_TRUE(same_tensor(*out.find("kv_cache"), r.kv_cache));
  EXPECT_TRUE(same_tensor(*out.find("lse"), r.lse));
  EXPECT_EQ(*out.find_metadata("backend"), "ref");
  EXPECT_EQ(out.find("output")->view().shape_vector(),
            (std::vector<int64_t>{c.num_tokens(), c.config.num_heads * c.config.head_size}));

  EXPECT_ERROR(load_case((dir / "missing.safetensors").string()), Error, "missing.safetensors");
  SafeTensors f = to_file(c);
  f.tensors.erase("query");
  save_safetensors((dir / "bad.safetensors").string(), f);
  EXPECT_ERROR(load_case((dir / "bad.safetensors").string()), FormatError,
               "bad.safetensors: case file: tensor 'query' is missing");
  std::filesystem::remove_all(dir);
}

// ---- What the format tolerates -------------------------------------------------------------

Tensor flatten_heads(const Tensor& t) {
  Tensor out = t;
  const TensorView& v = t.view();
  out.view() = v.reshape({v.size(0), v.size(1) * v.size(2)});
  return out;
}

Tensor to_int64(const Tensor& t) {
  Tensor out = Tensor::empty(t.view().shape_vector(), DType::kI64);
  for (int64_t i = 0; i < t.view().numel(); ++i) {
    out.data_as<int64_t>()[i] = t.data_as<int32_t>()[i];
  }
  return out;
}

TEST(CaseFile, AcceptsFlatActivationsAndInt64Metadata) {
  const Case c = make_random_case(features()[2].spec);
  SafeTensors f = to_file(c);
  f.tensors["query"] = flatten_heads(c.query);
  f.tensors["key"] = flatten_heads(c.key);
  f.tensors["value"] = flatten_heads(c.value);
  for (const char* name : {"block_table", "seq_lens", "query_start_loc"}) {
    f.tensors[name] = to_int64(*f.find(name));
  }
  Tensor slots32 = Tensor::empty(c.slot_mapping.view().shape_vector(), DType::kI32);
  for (int64_t i = 0; i < slots32.view().numel(); ++i) {
    slots32.data_as<int32_t>()[i] = int32_t(c.slot_mapping.data_as<int64_t>()[i]);
  }
  f.tensors["slot_mapping"] = slots32;
  f.tensors["unrelated_tensor"] = Tensor::zeros({3}, DType::kU8);
  f.metadata["unrelated_field"] = "ignored";
  expect_same_case(c, case_from_safetensors(f));
}

TEST(CaseFile, AcceptsMetadataSpellings) {
  const Case c = make_random_case(features()[0].spec);
  SafeTensors f = to_file(c);
  f.metadata["num_heads"] = " 4.0 ";
  f.metadata["scale"] = "+0.25";
  f.metadata.erase("attn_type");       // decoder
  f.metadata.erase("kv_cache_dtype");  // auto
  f.metadata.erase("k_scale");         // 1
  Case back = case_from_safetensors(f);
  EXPECT_EQ(back.config.num_heads, 4);
  EXPECT_EQ(back.config.scale, 0.25f);
  EXPECT_EQ(back.config.attn_type, AttentionType::kDecoder);
  EXPECT_EQ(back.scales.k_scale, 1.0f);
  for (const char* unset : {"None", "none", "null", "", "NULL", "-1"}) {
    f.metadata["sliding_window"] = unset;
    EXPECT_FALSE(case_from_safetensors(f).config.sliding_window) << "'" << unset << "'";
  }
  f.metadata["sliding_window"] = "12";
  EXPECT_EQ(case_from_safetensors(f).config.sliding_window, 12);
  for (const char* unset : {"None", "null", "", "0", "0.0"}) {
    f.metadata["logits_soft_cap"] = unset;
    EXPECT_FALSE(case_from_safetensors(f).config.logits_soft_cap) << "'" << unset << "'";
  }
  f.metadata["logits_soft_cap"] = "30";
  EXPECT_EQ(case_from_safetensors(f).config.logits_soft_cap, 30.0f);
}

TEST(CaseFile, Fp8CacheStoredAsBytesIsReadAndWrittenAsBytes) {
  CaseSpec s = spec_with({{7, 2}});
  s.kv_cache_dtype = KVCacheDType::kFp8E5M2;
  const Case c = make_random_case(s);
  SafeTensors f = to_file(c);
  f.tensors["kv_cache"].view().dtype = DType::kU8;
  const Case back = case_from_safetensors(f);
  EXPECT_TRUE(back.kv_cache_as_bytes);
  EXPECT_EQ(back.kv_cache.view().dtype, DType::kFp8E5M2);
  EXPECT_EQ(case_to_safetensors(back).find("kv_cache")->view().dtype, DType::kU8);
  const CaseResult r = run_ref(back);
  EXPECT_TRUE(check_case(back, r).pass());
  const auto path = std::filesystem::temp_directory_path() /
                    ("pagedattn_case_bytes_" + std::to_string(::getpid()) + ".safetensors");
  save_case_result(path.string(), back, r);
  EXPECT_EQ(load_safetensors(path.string()).find("kv_cache")->view().dtype, DType::kU8);
  std::filesystem::remove(path);
}

TEST(CaseFile, EncoderNeedsNoCacheTensorsAndPassesACacheThrough) {
  CaseSpec s = spec_with({{0, 6}, {0, 3}});
  s.attn_type = AttentionType::kEncoder;
  const Case c = make_random_case(s);
  SafeTensors f = to_file(c);
  for (const char* name : {"block_table", "seq_lens", "slot_mapping"}) f.tensors.erase(name);
  const Case bare = case_from_safetensors(f);
  EXPECT_TRUE(same_tensor(bare.seq_lens, c.seq_lens));
  const CaseResult r = run_ref(bare);
  EXPECT_TRUE(check_case(bare, r).pass());
  EXPECT_FALSE(r.kv_cache.defined());

  Tensor cache = Tensor::empty({2, 2, 16, 2, 32}, DType::kBF16);
  fill_host(cache.view(), 1.5);
  f.tensors["kv_cache"] = cache;
  const Case with_cache = case_from_safetensors(f);
  const CaseResult r2 = run_ref(with_cache);
  EXPECT_TRUE(same_tensor(r2.kv_cache, cache)) << "an encoder passes the cache through";
  EXPECT_TRUE(same_tensor(r2.output, r.output));
}

TEST(CaseFile, CrossAttentionDecodeStepWritesNothing) {
  CaseSpec s = spec_with({{12, 1}, {30, 1}});
  s.attn_type = AttentionType::kEncoderDecoder;
  s.cross_kv = false;
  const Case c = make_random_case(s);
  EXPECT_FALSE(c.writes_kv());
  SafeTensors f = to_file(c);
  f.tensors.erase("slot_mapping");
  const Case back = case_from_safetensors(f);
  const CaseResult r = run_ref(back);
  EXPECT_TRUE(same_tensor(r.kv_cache, c.kv_cache));
  EXPECT_TRUE(check_case(back, r).pass());
}

// ---- Errors name the field -----------------------------------------------------------------

struct Broken {
  const char* what;
  std::function<void(SafeTensors&)> edit;
  const char* message;
};

TEST(CaseFile, ErrorsNameTheField) {
  const Case decoder = make_random_case(features()[2].spec);
  const std::vector<Broken> cases = {
      {"no query", [](SafeTensors& f) { f.tensors.erase("query"); }, "tensor 'query' is missing"},
      {"no key",
       [](SafeTensors& f) {
         f.tensors.erase("key");
         f.tensors.erase("value");
       },
       "tensor 'key' is missing; decoder cases need key and value"},
      {"no value", [](SafeTensors& f) { f.tensors.erase("value"); },
       "tensor 'value' is missing while 'key' is present"},
      {"no cache", [](SafeTensors& f) { f.tensors.erase("kv_cache"); },
       "tensor 'kv_cache' is missing"},
      {"no slots", [](SafeTensors& f) { f.tensors.erase("slot_mapping"); },
       "tensor 'slot_mapping' is missing"},
      {"no query_start_loc", [](SafeTensors& f) { f.tensors.erase("query_start_loc"); },
       "tensor 'query_start_loc' is missing"},
      {"no seq_lens", [](SafeTensors& f) { f.tensors.erase("seq_lens"); },
       "tensor 'seq_lens' is missing"},
      {"no block_table", [](SafeTensors& f) { f.tensors.erase("block_table"); },
       "tensor 'block_table' is missing"},
      {"no num_heads", [](SafeTensors& f) { f.metadata.erase("num_heads"); },
       "metadata field 'num_heads' is missing"},
      {"no scale", [](SafeTensors& f) { f.metadata.erase("scale"); },
       "metadata field 'scale' is missing"},
      {"bad head_size", [](SafeTensors& f) { f.metadata["head_size"] = "abc"; },
       "metadata head_size ('abc') is not a number"},
      {"fractional head_size", [](SafeTensors& f) { f.metadata["head_size"] = "32.5"; },
       "metadata head_size ('32.5') is not an integer"},
      {"num_heads not matching query", [](SafeTensors& f) { f.metadata["num_heads"] = "8"; },
       "tensor 'query' must be [num_tokens, num_heads=8, head_size=32]"},
      {"num_kv_heads not matching key", [](SafeTensors& f) { f.metadata["num_kv_heads"] = "4"; },
       "tensor 'key' must be [num_tokens, num_kv_heads=4"},
      {"bad attn_type", [](SafeTensors& f) { f.metadata["attn_type"] = "causal"; },
       "attn_type 'causal' is not one of"},
      {"bad kv_cache_dtype", [](SafeTensors& f) { f.metadata["kv_cache_dtype"] = "int8"; },
       "kv_cache_dtype 'int8' is not one of"},
      {"cache dtype not what kv_cache_dtype stores",
       [](SafeTensors& f) { f.metadata["kv_cache_dtype"] = "float16"; },
       "but kv_cache_dtype 'float16' with query dtype bfloat16 stores F16 (float16)"},
      {"cache misshaped",
       [](SafeTensors& f) {
         f.tensors["kv_cache"] = Tensor::zeros({8, 2, 16, 2, 16}, DType::kBF16);
       },
       "tensor 'kv_cache' must be [num_blocks, 2, block_size, num_kv_heads=2, head_size=32]"},
      {"key dtype",
       [](SafeTensors& f) {
         f.tensors["key"] = Tensor::zeros({22, 2, 32}, DType::kF32);
       },
       "tensor 'key' is float32[22, 2, 32]; it must have the query's dtype bfloat16"},
      {"key rows",
       [](SafeTensors& f) {
         f.tensors["key"] = Tensor::zeros({2, 2, 32}, DType::kBF16);
         f.tensors["value"] = Tensor::zeros({2, 2, 32}, DType::kBF16);
       },
       "tensor 'key' has 2 rows but slot_mapping writes 26"},
      {"query dtype",
       [](SafeTensors& f) {
         f.tensors["query"] = Tensor::zeros({26, 4, 32}, DType::kF64);
       },
       "tensor 'query' must be F32, F16 or BF16"},
      {"seq_lens length",
       [](SafeTensors& f) { f.tensors["seq_lens"] = Tensor::zeros({2}, DType::kI32); },
       "tensor 'seq_lens' int32[2] must have num_seqs = 4 entries"},
      {"seq_lens dtype",
       [](SafeTensors& f) { f.tensors["seq_lens"] = Tensor::zeros({4}, DType::kF32); },
       "tensor 'seq_lens' must be int32 [num_seqs]"},
      {"block_table narrow",
       [](SafeTensors& f) {
         f.tensors["block_table"] = Tensor::zeros({4, 1}, DType::kI32);
       },
       "metadata.block_table has 1 columns"},
      {"slot outside the cache",
       [](SafeTensors& f) { f.tensors["slot_mapping"].data_as<int64_t>()[0] = 9999; },
       "metadata.slot_mapping[0] (9999) is outside the cache's slots"},
      {"query_start_loc past the query",
       [](SafeTensors& f) { f.tensors["query_start_loc"].data_as<int32_t>()[4] = 30; },
       "query_start_loc[num_seqs] (30) exceeds the query's 26 rows"},
      {"int64 value too big",
       [](SafeTensors& f) {
         Tensor t = to_int64(*f.find("seq_lens"));
         t.data_as<int64_t>()[1] = int64_t(1) << 40;
         f.tensors["seq_lens"] = t;
       },
       "tensor 'seq_lens' element 1 (1099511627776) does not fit int32"},
      {"alibi length",
       [](SafeTensors& f) { f.tensors["alibi_slopes"] = Tensor::zeros({3}, DType::kF32); },
       "tensor 'alibi_slopes' must be float32 [num_heads=4]"},
      {"sinks dtype", [](SafeTensors& f) { f.tensors["sinks"] = Tensor::zeros({4}, DType::kI32); },
       "tensor 'sinks' must be float32 [num_heads=4]"},
      {"sliding_window 0", [](SafeTensors& f) { f.metadata["sliding_window"] = "0"; },
       "metadata sliding_window (0) must be >= 1"},
      {"sliding_window -2", [](SafeTensors& f) { f.metadata["sliding_window"] = "-2"; },
       "metadata sliding_window (-2) must be >= 1"},
      {"negative soft cap", [](SafeTensors& f) { f.metadata["logits_soft_cap"] = "-5"; },
       "metadata logits_soft_cap (-5) must be finite and > 0"},
      {"zero scale", [](SafeTensors& f) { f.metadata["scale"] = "0"; },
       "scale (0) must be finite and > 0"},
      {"GQA not divisible",
       [](SafeTensors& f) {
         f.metadata["num_kv_heads"] = "3";
         f.tensors["key"] = Tensor::zeros({26, 3, 32}, DType::kBF16);
         f.tensors["value"] = Tensor::zeros({26, 3, 32}, DType::kBF16);
         f.tensors["kv_cache"] = Tensor::zeros({8, 2, 16, 3, 32}, DType::kBF16);
       },
       "num_heads (4) is not divisible by num_kv_heads (3)"},
      {"fp8 scale",
       [](SafeTensors& f) {
         f.metadata["kv_cache_dtype"] = "fp8";
         f.metadata["k_scale"] = "0";
         f.tensors["kv_cache"] = Tensor::zeros({8, 2, 16, 2, 32}, DType::kFp8E4M3);
       },
       "metadata k_scale (0) must be finite and > 0 for an fp8 cache"},
      {"k_scales length",
       [](SafeTensors& f) { f.tensors["k_scales"] = Tensor::zeros({3}, DType::kF32); },
       "tensor 'k_scales' must be float32 [num_kv_heads=2]"},
      {"v_scales shape",
       [](SafeTensors& f) {
         f.tensors["v_scales"] = Tensor::zeros({1, 2}, DType::kF32);
       },
       "tensor 'v_scales' must be float32 [num_kv_heads=2]"},
      {"fp8 k_scales value",
       [](SafeTensors& f) {
         f.metadata["kv_cache_dtype"] = "fp8";
         f.tensors["kv_cache"] = Tensor::zeros({8, 2, 16, 2, 32}, DType::kFp8E4M3);
         Tensor t = Tensor::zeros({2}, DType::kF32);
         t.data_as<float>()[0] = 0.5f;
         f.tensors["k_scales"] = t;
       },
       "tensor 'k_scales' element 1 (0) must be finite and > 0"},
      {"fp8 encoder",
       [](SafeTensors& f) {
         f.metadata["attn_type"] = "encoder";
         f.metadata["kv_cache_dtype"] = "fp8";
       },
       "quantization is not supported for encoder attention"},
  };
  // The base case: requests {{10,1},{32,16},{0,8},{3,1}}: 26 tokens, 1 + 6 + 2 blocks.
  ASSERT_EQ(decoder.num_tokens(), 26);
  ASSERT_EQ(decoder.kv_cache.view().size(0), 9);
  for (const Broken& b : cases) {
    SCOPED_TRACE(b.what);
    SafeTensors f = to_file(decoder);
    CaseSpec extras = features()[2].spec;
    extras.alibi = extras.sinks = true;
    const Case with_extras = make_random_case(extras);
    f.tensors["alibi_slopes"] = *to_file(with_extras).find("alibi_slopes");
    f.tensors["sinks"] = *to_file(with_extras).find("sinks");
    ASSERT_NO_THROW(case_from_safetensors(f));
    b.edit(f);
    EXPECT_ERROR(case_from_safetensors(f), FormatError, b.message);
  }
}

TEST(CaseFile, EncoderErrorsNameTheField) {
  CaseSpec s = spec_with({{0, 6}, {0, 3}});
  s.attn_type = AttentionType::kEncoder;
  SafeTensors f = to_file(make_random_case(s));
  f.tensors["seq_lens"].data_as<int32_t>()[0] = 8;
  EXPECT_ERROR(case_from_safetensors(f), FormatError,
               "metadata.seq_lens[0] (8) must equal the query length (6)");
  f = to_file(make_random_case(s));
  f.tensors.erase("key");
  f.tensors.erase("value");
  EXPECT_ERROR(case_from_safetensors(f), FormatError,
               "tensor 'key' is missing; encoder cases need key and value");
}

// ---- check_case catches bad results ----------------------------------------------------------

TEST(CaseFile, CheckCatchesWrongOutputsLseAndCache) {
  CaseSpec s = spec_with({{10, 1}, {5, 6}});
  s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  const Case c = make_random_case(s);
  const CaseResult good = run_ref(c);
  ASSERT_TRUE(check_case(c, good).pass());

  CaseResult bad = good;
  bad.output = Tensor::copy_of(good.output.view(), Device::cpu());
  store_element(bad.output.data(), bad.output.view().dtype, 5,
                0.5 + load_element(bad.output.data(), bad.output.view().dtype, 5));
  CaseCheck check = check_case(c, bad);
  EXPECT_FALSE(check.output.pass);
  EXPECT_FALSE(check.pass());
  EXPECT_NE(check.to_string().find("elements: FAIL"), std::string::npos) << check.to_string();

  bad = good;
  bad.lse = Tensor::copy_of(good.lse.view(), Device::cpu());
  bad.lse.data_as<float>()[1] += 1e-3f;
  check = check_case(c, bad);
  EXPECT_TRUE(check.output.pass);
  EXPECT_FALSE(check.lse->pass);

  bad = good;
  bad.kv_cache = Tensor::copy_of(good.kv_cache.view(), Device::cpu());
  static_cast<uint8_t*>(bad.kv_cache.data())[100] ^= 1;
  check = check_case(c, bad);
  EXPECT_EQ(check.kv_cache_mismatches, 1);
  EXPECT_FALSE(check.pass());
  EXPECT_NE(check.to_string().find("1 of "), std::string::npos);

  bad = good;
  bad.kv_cache = Tensor();
  check = check_case(c, bad);
  EXPECT_EQ(check.kv_cache_problem, "the result has no kv_cache");
  EXPECT_FALSE(check.pass());

  bad = good;
  bad.output = Tensor::zeros({c.num_tokens(), 7}, DType::kBF16);
  EXPECT_ERROR(check_case(c, bad), InvalidArgument, "result.output must be");
}

// ---- The generator -------------------------------------------------------------------------

TEST(CaseRandom, DeterministicPerSeedWithShuffledUniqueBlocks) {
  CaseSpec s = spec_with({{40, 8}, {33, 1}, {0, 20}});
  const Case a = make_random_case(s), b = make_random_case(s);
  expect_same_case(a, b);
  s.seed = 99;
  EXPECT_FALSE(same_tensor(a.query, make_random_case(s).query));

  const AttentionMetadata md = a.metadata();
  std::vector<int> seen(size_t(a.kv_cache.view().size(0)), 0);
  bool any_gap = false;
  for (int r = 0; r < md.num_seqs; ++r) {
    const int used = (md.seq_lens.data_as<int32_t>()[r] + 15) / 16;
    for (int j = 0; j < used; ++j) {
      const int block = md.block_table.data_as<int32_t>()[r * md.max_blocks_per_seq() + j];
      EXPECT_NE(block, 0) << "block 0 is the null block";
      EXPECT_EQ(seen[size_t(block)]++, 0) << "block " << block << " used twice";
      if (j > 0) {
        any_gap |=
            block != md.block_table.data_as<int32_t>()[r * md.max_blocks_per_seq() + j - 1] + 1;
      }
    }
  }
  EXPECT_TRUE(any_gap) << "blocks should not be laid out contiguously";
  // Q/K/V are never all zero.
  for (const Tensor* t : {&a.query, &a.key, &a.value}) {
    int zeros = 0;
    for (int64_t i = 0; i < t->view().numel(); ++i)
      zeros += load_element(t->data(), t->view().dtype, i) == 0.0;
    EXPECT_EQ(zeros, 0);
  }
}

TEST(CaseRandom, RejectsSpecsWithoutAValidStep) {
  CaseSpec s = spec_with({{0, 3}, {4, 2}});
  s.attn_type = AttentionType::kEncoderOnly;
  EXPECT_ERROR(make_random_case(s), InvalidArgument,
               "request 1: encoder_only attention has no cache, so context_len (4) must be 0");
  s = spec_with({{0, 3}});
  s.attn_type = AttentionType::kEncoder;
  s.kv_cache_dtype = KVCacheDType::kFp8;
  EXPECT_ERROR(make_random_case(s), InvalidArgument, "kv_cache_dtype fp8");
  s = spec_with({{0, 3}});
  s.num_kv_heads = 3;
  EXPECT_ERROR(make_random_case(s), InvalidArgument, "num_heads (4) is not divisible");
  s = spec_with({{0, 3}});
  s.pad_tokens = -1;
  EXPECT_ERROR(make_random_case(s), InvalidArgument, "pad_tokens (-1)");
}

TEST(CaseRandom, ParsesRequestLists) {
  const auto r = parse_case_requests("0:7,21:1,0:0");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[1].context_len, 21);
  EXPECT_EQ(r[1].num_new_tokens, 1);
  EXPECT_TRUE(parse_case_requests("").empty());
  for (const char* bad : {"1:", ":2", "a:b", "1:2,", "-1:2", "1:2:3", "1-2", "1: 2"}) {
    SCOPED_TRACE(bad);
    EXPECT_ERROR(parse_case_requests(bad), InvalidArgument, "requests: entry");
  }
  EXPECT_ERROR(parse_case_requests("1:2,x"), InvalidArgument, "entry 1 ('x')");
}

}  // namespace
}  // namespace pagedattn
