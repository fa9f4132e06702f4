// AttentionConfig validation (one test per rule) and the name parsers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/expect_error.h"
#include "pagedattn/config.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

AttentionConfig valid_config() {
  AttentionConfig c;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_size = 64;
  c.scale = 0.125f;
  return c;
}

TEST(ConfigValidation, ValidConfigPasses) {
  EXPECT_NO_THROW(valid_config().validate());
}

#define EXPECT_FIELD_ERROR(mutation, substring)             \
  do {                                                      \
    AttentionConfig c = valid_config();                     \
    mutation;                                               \
    EXPECT_ERROR(c.validate(), InvalidArgument, substring); \
  } while (0)

TEST(ConfigValidation, NumHeadsPositive) {
  EXPECT_FIELD_ERROR(c.num_heads = 0, "num_heads (0) must be > 0");
}
TEST(ConfigValidation, NumKvHeadsPositive) {
  EXPECT_FIELD_ERROR(c.num_kv_heads = 0, "num_kv_heads (0) must be > 0");
}
TEST(ConfigValidation, NumHeadsDivisibleByNumKvHeads) {
  EXPECT_FIELD_ERROR(c.num_kv_heads = 3, "num_heads (8) is not divisible by num_kv_heads (3)");
}
TEST(ConfigValidation, HeadSizePositive) {
  EXPECT_FIELD_ERROR(c.head_size = -4, "head_size (-4) must be > 0");
}
TEST(ConfigValidation, ScaleFiniteAndPositive) {
  EXPECT_FIELD_ERROR(c.scale = 0.0f, "scale (0) must be finite and > 0");
  EXPECT_FIELD_ERROR(c.scale = -1.0f, "scale (-1) must be finite and > 0");
  EXPECT_FIELD_ERROR(c.scale = std::numeric_limits<float>::infinity(), "scale (inf)");
  EXPECT_FIELD_ERROR(c.scale = std::numeric_limits<float>::quiet_NaN(), "scale (nan)");
}
TEST(ConfigValidation, WindowAtLeastOne) {
  EXPECT_FIELD_ERROR(c.sliding_window = 0, "sliding_window (0) must be >= 1");
  AttentionConfig ok = valid_config();
  ok.sliding_window = 1;
  EXPECT_NO_THROW(ok.validate());
}
// The window's one form (FlashAttention's offsets): W - 1 on the left for every type, on the
// right only for encoder_only (symmetric); -1 = unbounded (docs/semantics.md, "Masks").
TEST(ConfigWindow, OffsetsPerAttentionType) {
  AttentionConfig c = valid_config();
  EXPECT_EQ(c.window_left(), -1);
  EXPECT_EQ(c.window_right(), -1);
  c.sliding_window = 4;
  for (AttentionType t :
       {AttentionType::kDecoder, AttentionType::kEncoder, AttentionType::kEncoderDecoder}) {
    c.attn_type = t;
    EXPECT_EQ(c.window_left(), 3) << to_string(t);
    EXPECT_EQ(c.window_right(), -1) << to_string(t);
  }
  c.attn_type = AttentionType::kEncoderOnly;
  EXPECT_EQ(c.window_left(), 3);
  EXPECT_EQ(c.window_right(), 3);
  c.sliding_window = 1;  // the current token alone
  EXPECT_EQ(c.window_left(), 0);
  EXPECT_EQ(c.window_right(), 0);
  c.sliding_window.reset();
  EXPECT_EQ(c.window_left(), -1);
  EXPECT_EQ(c.window_right(), -1);
}

TEST(ConfigValidation, SoftCapPositive) {
  EXPECT_FIELD_ERROR(c.logits_soft_cap = 0.0f, "logits_soft_cap (0) must be finite and > 0");
  EXPECT_FIELD_ERROR(c.logits_soft_cap = -30.0f, "logits_soft_cap (-30)");
  EXPECT_FIELD_ERROR(c.logits_soft_cap = std::numeric_limits<float>::infinity(),
                     "logits_soft_cap (inf)");
}
TEST(ConfigValidation, AlibiLengthIsNumHeads) {
  EXPECT_FIELD_ERROR(c.alibi_slopes = std::vector<float>(4, 0.5f),
                     "alibi_slopes has 4 entries; expected num_heads (8)");
}
TEST(ConfigValidation, AlibiFinite) {
  EXPECT_FIELD_ERROR(c.alibi_slopes = std::vector<float>(8, 0.5f);
                     c.alibi_slopes[3] = std::numeric_limits<float>::quiet_NaN(),
                     "alibi_slopes[3] (nan) must be finite");
}
TEST(ConfigValidation, SinksLengthIsNumHeads) {
  EXPECT_FIELD_ERROR(c.sinks = std::vector<float>(2, 0.0f),
                     "sinks has 2 entries; expected num_heads (8)");
}
TEST(ConfigValidation, SinksFinite) {
  EXPECT_FIELD_ERROR(c.sinks = std::vector<float>(8, 0.0f);
                     c.sinks[7] = -std::numeric_limits<float>::infinity(),
                     "sinks[7] (-inf) must be finite");
}
TEST(ConfigValidation, DtypeIsAnActivationType) {
  EXPECT_FIELD_ERROR(c.dtype = DType::kFp8E4M3,
                     "dtype (float8_e4m3fn) must be float32, float16 or bfloat16");
}
TEST(ConfigValidation, BlockSizePositive) {
  EXPECT_FIELD_ERROR(c.block_size = 0, "block_size (0) must be > 0");
}

TEST(ConfigValidation, QueryQuantNeedsAnE4M3Cache) {
  EXPECT_FIELD_ERROR(c.query_quant = true,
                     "query_quant quantises the query to fp8 e4m3 for an fp8 e4m3 cache; "
                     "kv_cache_dtype is auto");
  EXPECT_FIELD_ERROR((c.query_quant = true, c.kv_cache_dtype = KVCacheDType::kFp8E5M2),
                     "kv_cache_dtype is fp8_e5m2 (needs fp8 or fp8_e4m3)");
  AttentionConfig ok = valid_config();
  ok.query_quant = true;
  ok.kv_cache_dtype = KVCacheDType::kFp8;
  EXPECT_NO_THROW(ok.validate());
}

TEST(ConfigNames, CacheDtypes) {
  EXPECT_EQ(parse_kv_cache_dtype("auto"), KVCacheDType::kAuto);
  EXPECT_EQ(parse_kv_cache_dtype("bfloat16"), KVCacheDType::kBFloat16);
  EXPECT_EQ(parse_kv_cache_dtype("float16"), KVCacheDType::kFloat16);
  EXPECT_EQ(parse_kv_cache_dtype("float32"), KVCacheDType::kFloat32);
  EXPECT_EQ(parse_kv_cache_dtype("fp8"), KVCacheDType::kFp8);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e4m3"), KVCacheDType::kFp8E4M3);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e5m2"), KVCacheDType::kFp8E5M2);
  EXPECT_ERROR(parse_kv_cache_dtype("fp8_inc"), InvalidArgument,
               "kv_cache_dtype 'fp8_inc' is not one of: auto, bfloat16, float16, float32, fp8, "
               "fp8_e4m3, fp8_e5m2");
}

TEST(ConfigNames, StorageDtypes) {
  EXPECT_EQ(kv_cache_storage_dtype(KVCacheDType::kAuto, DType::kF16), DType::kF16);
  EXPECT_EQ(kv_cache_storage_dtype(KVCacheDType::kFp8, DType::kBF16), DType::kFp8E4M3);
  EXPECT_EQ(kv_cache_storage_dtype(KVCacheDType::kFp8E5M2, DType::kBF16), DType::kFp8E5M2);
  EXPECT_EQ(kv_cache_storage_dtype(KVCacheDType::kFloat32, DType::kBF16), DType::kF32);
}

TEST(ConfigNames, AttnTypesAndLayouts) {
  for (auto t : {AttentionType::kDecoder, AttentionType::kEncoder, AttentionType::kEncoderOnly,
                 AttentionType::kEncoderDecoder}) {
    EXPECT_EQ(parse_attn_type(to_string(t)), t);
  }
  EXPECT_ERROR(parse_attn_type("cross"), InvalidArgument, "attn_type 'cross' is not one of");
  EXPECT_EQ(parse_kv_cache_layout("HND"), KVCacheLayout::kHND);
  EXPECT_ERROR(parse_kv_cache_layout("nhd"), InvalidArgument, "kv_cache_layout 'nhd'");
}

TEST(Alibi, StandardSlopes) {
  const auto s8 = alibi_slopes(8);  // base 2^-1: 1/2, 1/4, ..., 1/256
  ASSERT_EQ(s8.size(), 8u);
  for (int k = 0; k < 8; ++k) EXPECT_FLOAT_EQ(s8[size_t(k)], std::ldexp(1.0f, -(k + 1)));
  const auto s12 = alibi_slopes(12);  // 8 as above, then (2^-0.5)^{1,3,5,7}
  ASSERT_EQ(s12.size(), 12u);
  EXPECT_FLOAT_EQ(s12[8], float(std::pow(2.0, -0.5)));
  EXPECT_FLOAT_EQ(s12[9], float(std::pow(2.0, -1.5)));
  EXPECT_FLOAT_EQ(s12[11], float(std::pow(2.0, -3.5)));
}

}  // namespace
}  // namespace pagedattn
