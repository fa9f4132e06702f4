// check_forward_args / check_write_kv_args / check_merge_args: one test per rule, each
// asserting that the error names the argument and the bound.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/backend.h"
#include "pagedattn/error.h"

namespace pagedattn {
namespace {

class ForwardArgsCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.num_heads = 4;
    config_.num_kv_heads = 2;
    config_.head_size = 8;
    config_.scale = 0.5f;
    config_.dtype = DType::kF32;
    config_.block_size = 4;
    step_ = MetadataBuilder(4).add({3, 2, {1, 2}}).build();
    md_ = step_.view();
    cache_ = KVCache::allocate(config_, 3);
    q_.assign(2 * 4 * 8, 0.5f);
    out_.assign(2 * 4 * 8, 0.0f);
    lse_.assign(4 * 2, 0.0f);
    args_.query = TensorView::contiguous(q_.data(), DType::kF32, {2, 4, 8});
    args_.output = TensorView::contiguous(out_.data(), DType::kF32, {2, 4, 8});
    args_.lse = TensorView::contiguous(lse_.data(), DType::kF32, {4, 2});
    args_.kv_cache = cache_.view();
    args_.metadata = &md_;
  }
  void expect_error(const char* substring) {
    EXPECT_ERROR(check_forward_args(config_, args_), InvalidArgument, substring);
  }
  AttentionConfig config_;
  StepMetadata step_;
  AttentionMetadata md_;
  KVCache cache_;
  std::vector<float> q_, out_, lse_;
  ForwardArgs args_;
};

TEST_F(ForwardArgsCheck, ValidArgsPass) {
  EXPECT_NO_THROW(check_forward_args(config_, args_));
}
TEST_F(ForwardArgsCheck, PerHeadScaleLengths) {
  // One request, 2 KV heads: [2] per head; [num_seqs * 2] = [2] too; nothing else.
  args_.scales.k_scales = {0.5f, 2.0f};
  EXPECT_NO_THROW(check_forward_args(config_, args_));
  args_.scales.v_scales = {1.0f, 2.0f, 3.0f};
  expect_error(
      "scales.v_scales has 3 values; expected none (per tensor), num_kv_heads (2) or "
      "num_seqs * num_kv_heads (1 * 2 = 2)");
  args_.scales.v_scales.clear();
  args_.scales.q_scales = {1.0f};
  expect_error("scales.q_scales has 1 values");
}
TEST_F(ForwardArgsCheck, PerHeadScalesPositiveForFp8) {
  config_.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  cache_ = KVCache::allocate(config_, 3);
  args_.kv_cache = cache_.view();
  args_.scales.k_scales = {0.5f, 2.0f};
  EXPECT_NO_THROW(check_forward_args(config_, args_));
  args_.scales.k_scales = {0.5f, -2.0f};
  expect_error("scales.k_scales[1] (-2) must be finite and > 0");
  args_.scales.k_scales.clear();
  args_.scales.v_scales = {std::nanf(""), 1.0f};
  expect_error("scales.v_scales[0] (nan) must be finite and > 0");
}
TEST_F(ForwardArgsCheck, PerSequenceScales) {
  step_ = MetadataBuilder(4).add({3, 2, {1, 2}}).add({0, 0, {}}).add({1, 0, {0}}).build();
  md_ = step_.view();
  args_.scales.k_scales = {1, 2, 3, 4, 5, 6};  // [3 seqs, 2 KV heads]
  EXPECT_NO_THROW(check_forward_args(config_, args_));
  args_.scales.k_scales.resize(4);
  expect_error("num_seqs * num_kv_heads (3 * 2 = 6)");
}
TEST_F(ForwardArgsCheck, MetadataRequired) {
  args_.metadata = nullptr;
  expect_error("metadata is required");
}
TEST_F(ForwardArgsCheck, QueryShape) {
  args_.query = TensorView::contiguous(q_.data(), DType::kF32, {2, 2, 16});
  expect_error("query must be [num_tokens, num_heads=4, head_size=8]; got float32[2, 2, 16]");
}
TEST_F(ForwardArgsCheck, QueryDtype) {
  args_.query.dtype = DType::kBF16;
  expect_error("query must be float32; got bfloat16[2, 4, 8]");
}
TEST_F(ForwardArgsCheck, QueryRowsCoverTheTokens) {
  args_.query = args_.query.slice(0, 0, 1);
  expect_error("metadata.num_actual_tokens (2) exceeds the query's 1 rows");
}
TEST_F(ForwardArgsCheck, QueryLastDimContiguous) {
  args_.query = args_.query.permute({0, 2, 1}).permute({0, 2, 1});
  args_.query.strides[2] = 2;
  expect_error("query must be contiguous in its last dimension");
}
TEST_F(ForwardArgsCheck, OutputShape) {
  args_.output = TensorView::contiguous(out_.data(), DType::kF32, {1, 4, 8});
  expect_error(
      "output must be [>= num_actual_tokens (2), num_heads=4, head_size=8 (or 1..head_size "
      "leading columns of P V)]; got float32[1, 4, 8]");
}
TEST_F(ForwardArgsCheck, OutputMayTakeTheLeadingColumns) {
  // 1..head_size columns: the first columns of P V (MLAAttention's latent output).
  args_.output = TensorView::contiguous(out_.data(), DType::kF32, {2, 4, 5});
  EXPECT_NO_THROW(check_forward_args(config_, args_));
  args_.output = TensorView::contiguous(out_.data(), DType::kF32, {2, 4, 1});
  EXPECT_NO_THROW(check_forward_args(config_, args_));
  args_.output = TensorView::contiguous(out_.data(), DType::kF32, {2, 4, 0});
  expect_error("head_size=8 (or 1..head_size leading columns of P V)]; got float32[2, 4, 0]");
  args_.output = TensorView::contiguous(out_.data(), DType::kF32, {2, 4, 9});  // not read
  expect_error("(or 1..head_size leading columns of P V)]; got float32[2, 4, 9]");
}
TEST_F(ForwardArgsCheck, OutputDtype) {
  args_.output.dtype = DType::kI32;
  expect_error("output must be a float type");
}
TEST_F(ForwardArgsCheck, OutputDevice) {
  args_.output.device = Device::cuda(0);
  expect_error("output is on cuda:0; expected cpu");
}
TEST_F(ForwardArgsCheck, LseShapeAndDtype) {
  args_.lse = TensorView::contiguous(lse_.data(), DType::kF32, {2, 4});
  expect_error("lse must be [num_heads=4, >= num_actual_tokens (2)]");
  args_.lse = TensorView::contiguous(lse_.data(), DType::kF16, {4, 2});
  expect_error("lse must be float32");
}
TEST_F(ForwardArgsCheck, CacheRequiredForDecoders) {
  args_.kv_cache = {};
  expect_error("kv_cache is required for decoder attention");
}
TEST_F(ForwardArgsCheck, CacheShape) {
  KVCache other = KVCache::allocate(3, 8, 2, 8, DType::kF32, KVCacheLayout::kNHD);
  args_.kv_cache = other.view();
  expect_error("kv_cache.key must be [num_blocks, block_size=4, num_kv_heads=2, head_size=8]");
}
TEST_F(ForwardArgsCheck, CacheDtype) {
  KVCache other = KVCache::allocate(3, 4, 2, 8, DType::kBF16, KVCacheLayout::kNHD);
  args_.kv_cache = other.view();
  expect_error("kv_cache.key must be float32; got bfloat16");
}
TEST_F(ForwardArgsCheck, MetadataCheckedAgainstTheCache) {
  KVCache small = KVCache::allocate(config_, 2);
  args_.kv_cache = small.view();
  expect_error("metadata.block_table[0][1] (2) is outside the cache's blocks [0, 2)");
  EXPECT_NO_THROW(check_forward_args(config_, args_, /*check_metadata=*/false));
}
TEST_F(ForwardArgsCheck, EncoderNeedsKeyAndValueRows) {
  config_.attn_type = AttentionType::kEncoderOnly;
  step_ = MetadataBuilder(4).add({0, 2, {}}).causal(false).build();
  md_ = step_.view();
  std::vector<float> kv(2 * 2 * 8, 1.0f);
  args_.kv_cache = {};
  args_.key = TensorView::contiguous(kv.data(), DType::kF32, {1, 2, 8});
  args_.value = TensorView::contiguous(kv.data(), DType::kF32, {1, 2, 8});
  expect_error("key and value need num_actual_tokens (2) rows for encoder_only attention");
  args_.key = {};
  expect_error("key is required");
}

class WriteArgsCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.num_heads = 2;
    config_.num_kv_heads = 2;
    config_.head_size = 4;
    config_.scale = 0.5f;
    config_.dtype = DType::kF32;
    config_.block_size = 2;
    config_.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    cache_ = KVCache::allocate(config_, 2);
    k_.assign(3 * 2 * 4, 1.0f);
    slots_ = {0, 3, -1};
    args_.key = TensorView::contiguous(k_.data(), DType::kF32, {3, 2, 4});
    args_.value = args_.key;
    args_.slot_mapping = TensorView::contiguous(slots_.data(), DType::kI64, {3});
    args_.kv_cache = cache_.view();
  }
  void expect_error(const char* substring) {
    EXPECT_ERROR(check_write_kv_args(config_, args_), InvalidArgument, substring);
  }
  AttentionConfig config_;
  KVCache cache_;
  std::vector<float> k_;
  std::vector<int64_t> slots_;
  WriteKVArgs args_;
};

TEST_F(WriteArgsCheck, ValidArgsPass) {
  EXPECT_NO_THROW(check_write_kv_args(config_, args_));
}
TEST_F(WriteArgsCheck, SlotsInsideTheCache) {
  slots_[1] = 4;
  expect_error("slot_mapping[1] (4) is outside the cache's slots [0, 4) and not -1");
  slots_[1] = -5;
  expect_error("slot_mapping[1] (-5) is outside");
}
TEST_F(WriteArgsCheck, RowsCoverTheSlots) {
  args_.key = args_.key.slice(0, 0, 2);
  expect_error("key and value have 2 and 3 rows; slot_mapping writes 3");
}
TEST_F(WriteArgsCheck, SlotMappingIsInt64) {
  args_.slot_mapping.dtype = DType::kI32;
  expect_error("slot_mapping must be int64");
}
TEST_F(WriteArgsCheck, Fp8ScalesPositive) {
  args_.scales.v_scale = 0.0f;
  expect_error("v_scale (0) must be finite and > 0");
  args_.scales.v_scale = 1.0f;
  args_.scales.k_scale = std::nanf("");
  expect_error("k_scale (nan) must be finite and > 0");
}
TEST_F(WriteArgsCheck, PerHeadScales) {
  args_.scales.k_scales = {0.5f, 3.0f};
  args_.scales.v_scales = {2.0f, 0.25f};
  EXPECT_NO_THROW(check_write_kv_args(config_, args_));
  args_.scales.k_scales = {0.5f, 3.0f, 1.0f, 1.0f};  // [num_seqs, kv_heads]: attention only
  expect_error(
      "scales.k_scales has 4 values; write_kv takes none (per tensor) or num_kv_heads (2)");
  args_.scales.k_scales = {0.5f, 0.0f};
  expect_error("scales.k_scales[1] (0) must be finite and > 0");
  args_.scales.k_scales.clear();
  args_.scales.q_scales = {1.0f, 1.0f};
  expect_error("scales.q_scales has 2 values; write_kv takes no query scales");
}
TEST_F(WriteArgsCheck, EncodersHaveNoCache) {
  config_.attn_type = AttentionType::kEncoder;
  expect_error("encoder attention has no KV cache to write");
}

TEST(MergeArgsCheck, ShapesAndLseLayout) {
  std::vector<float> a(2 * 3 * 4), b(2 * 3 * 4), o(2 * 3 * 4), la(3 * 2), lb(3 * 2);
  MergeArgs m;
  m.prefix_output = TensorView::contiguous(a.data(), DType::kF32, {2, 3, 4});
  m.suffix_output = TensorView::contiguous(b.data(), DType::kF32, {2, 3, 4});
  m.output = TensorView::contiguous(o.data(), DType::kF32, {2, 3, 4});
  m.prefix_lse = TensorView::contiguous(la.data(), DType::kF32, {3, 2});
  m.suffix_lse = TensorView::contiguous(lb.data(), DType::kF32, {3, 2});
  EXPECT_NO_THROW(check_merge_args(m));
  m.suffix_output = TensorView::contiguous(b.data(), DType::kF32, {2, 4, 3});
  EXPECT_ERROR(check_merge_args(m), InvalidArgument, "suffix_output must match output [2, 3, 4]");
  m.suffix_output = TensorView::contiguous(b.data(), DType::kF32, {2, 3, 4});
  m.prefix_lse = TensorView::contiguous(la.data(), DType::kF32, {2, 3});
  EXPECT_ERROR(check_merge_args(m), InvalidArgument,
               "prefix_lse must be float32 [num_heads=3, num_tokens=2]");
  m.prefix_lse = TensorView::contiguous(la.data(), DType::kF16, {3, 2});
  EXPECT_ERROR(check_merge_args(m), InvalidArgument, "prefix_lse must be float32; got float16");
}

}  // namespace
}  // namespace pagedattn
