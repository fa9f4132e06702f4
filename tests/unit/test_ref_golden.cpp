// Hand-computed cases for each rule of the reference backend. The expected numbers are
// derived in the comments; each is small enough to check on paper.
#include <gtest/gtest.h>

#include <cmath>

#include "common/step_runner.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

using testing::run_step;
using testing::StepInputs;

const double kInf = std::numeric_limits<double>::infinity();

AttentionConfig tiny_config(int num_heads = 1, int num_kv_heads = 1, int head_size = 1) {
  AttentionConfig c;
  c.num_heads = num_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_size = head_size;
  c.scale = 1.0f;
  c.dtype = DType::kF32;
  c.block_size = 2;
  return c;
}

class RefGolden : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> ref_ = ref::make_backend();
};

// One request: context 2 (keys 0, 1 cached), 2 new tokens at positions 2 and 3. All keys are 0,
// so every visible key gets logit 0 and the output is the mean of the visible values 1, 2, 3, 4.
TEST_F(RefGolden, CausalMaskIsBottomRightAligned) {
  StepInputs in;
  in.context_key = {0, 0};
  in.context_value = {1, 2};
  in.key = {0, 0};
  in.value = {3, 4};
  in.query = {1, 1};
  const auto out = run_step(*ref_, tiny_config(), {{2, 2, {3, 1}}}, in, 4);
  EXPECT_NEAR(out.output[0], (1 + 2 + 3) / 3.0, 1e-6);      // position 2 sees keys 0..2
  EXPECT_NEAR(out.output[1], (1 + 2 + 3 + 4) / 4.0, 1e-6);  // position 3 sees keys 0..3
  EXPECT_NEAR(out.lse[0], std::log(3.0), 1e-6);
  EXPECT_NEAR(out.lse[1], std::log(4.0), 1e-6);
}

// Window W = 2 counts the current token: position 2 sees {1, 2}, position 3 sees {2, 3}.
TEST_F(RefGolden, SlidingWindowCountsTheCurrentToken) {
  AttentionConfig c = tiny_config();
  c.sliding_window = 2;
  StepInputs in;
  in.context_key = {0, 0};
  in.context_value = {1, 2};
  in.key = {0, 0};
  in.value = {3, 4};
  in.query = {1, 1};
  const auto out = run_step(*ref_, c, {{2, 2, {0, 1}}}, in, 2);
  EXPECT_NEAR(out.output[0], (2 + 3) / 2.0, 1e-6);
  EXPECT_NEAR(out.output[1], (3 + 4) / 2.0, 1e-6);
  // W = 1: only the diagonal.
  c.sliding_window = 1;
  const auto diag = run_step(*ref_, c, {{2, 2, {0, 1}}}, in, 2);
  EXPECT_NEAR(diag.output[0], 3.0, 1e-6);
  EXPECT_NEAR(diag.output[1], 4.0, 1e-6);
}

// encoder_only: bidirectional, and the window is symmetric: |i - j| <= W - 1.
TEST_F(RefGolden, EncoderOnlyWindowIsSymmetric) {
  AttentionConfig c = tiny_config();
  c.attn_type = AttentionType::kEncoderOnly;
  c.sliding_window = 2;
  StepInputs in;
  in.query = {1, 1, 1, 1};
  in.key = {0, 0, 0, 0};
  in.value = {1, 2, 3, 4};
  const auto out = run_step(*ref_, c, {{0, 4, {}}}, in, 0);
  EXPECT_NEAR(out.output[0], (1 + 2) / 2.0, 1e-6);
  EXPECT_NEAR(out.output[1], (1 + 2 + 3) / 3.0, 1e-6);
  EXPECT_NEAR(out.output[2], (2 + 3 + 4) / 3.0, 1e-6);
  EXPECT_NEAR(out.output[3], (3 + 4) / 2.0, 1e-6);
  // Without a window every token sees all four (not causal).
  c.sliding_window.reset();
  const auto full = run_step(*ref_, c, {{0, 4, {}}}, in, 0);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(full.output[size_t(i)], 2.5, 1e-6);
}

// encoder (of an encoder-decoder): not causal, keys are the request's own tokens only.
TEST_F(RefGolden, EncoderAttendsWithinEachRequest) {
  AttentionConfig c = tiny_config();
  c.attn_type = AttentionType::kEncoder;
  StepInputs in;
  in.query = {1, 1, 1};
  in.key = {0, 0, 0};
  in.value = {2, 4, 10};
  const auto out = run_step(*ref_, c, {{0, 2, {}}, {0, 1, {}}}, in, 0);
  EXPECT_NEAR(out.output[0], 3.0, 1e-6);
  EXPECT_NEAR(out.output[1], 3.0, 1e-6);
  EXPECT_NEAR(out.output[2], 10.0, 1e-6);
}

// Cross attention: decoder queries see every cached encoder key (no causal mask).
TEST_F(RefGolden, CrossAttentionIsNotCausal) {
  AttentionConfig c = tiny_config();
  c.attn_type = AttentionType::kEncoderDecoder;
  StepInputs in;
  // Three encoder tokens cached as "context"; the step has 1 query token and writes nothing.
  in.context_key = {0, 0, 0};
  in.context_value = {1, 2, 6};
  in.query = {5};
  const auto out = run_step(*ref_, c, {{3, 1, {1, 0}}}, in, 2);
  // seq_len = 4 (3 context + 1 query position): the 4th key slot was never written (zeros).
  EXPECT_NEAR(out.output[0], (1 + 2 + 6 + 0) / 4.0, 1e-6);
}

// Soft cap: logit = cap * tanh(scale * q.k / cap). q = 1, k = [10, 0], cap 5, V = [1, 3].
TEST_F(RefGolden, SoftCapAppliesAfterScale) {
  AttentionConfig c = tiny_config();
  c.logits_soft_cap = 5.0f;
  c.scale = 0.5f;
  StepInputs in;
  in.context_key = {10};
  in.context_value = {1};
  in.key = {0};
  in.value = {3};
  in.query = {1};
  const auto out = run_step(*ref_, c, {{1, 1, {0}}}, in, 1);
  const double l0 = 5.0 * std::tanh(0.5 * 10 / 5.0);  // 3.808
  const double expected = (1 * std::exp(l0) + 3 * 1.0) / (std::exp(l0) + 1.0);
  EXPECT_NEAR(out.output[0], expected, 1e-5);
  EXPECT_NEAR(out.lse[0], std::log(std::exp(l0) + 1.0), 1e-5);
}

// ALiBi adds slope * (j - position): past keys are pushed down, the diagonal is untouched.
TEST_F(RefGolden, AlibiBiasIsNegativeForPastKeys) {
  AttentionConfig c = tiny_config();
  c.alibi_slopes = {1.0f};
  StepInputs in;
  in.context_key = {0, 0};
  in.context_value = {1, 2};
  in.key = {0};
  in.value = {3};
  in.query = {1};
  const auto out = run_step(*ref_, c, {{2, 1, {0, 1}}}, in, 2);
  const double w0 = std::exp(-2.0), w1 = std::exp(-1.0), w2 = 1.0;
  EXPECT_NEAR(out.output[0], (1 * w0 + 2 * w1 + 3 * w2) / (w0 + w1 + w2), 1e-6);
}

// Sinks join the denominator only and are not multiplied by scale. Two visible keys with
// logit 0 and sink ln 2: den = 1 + 1 + 2 = 4, out = (1 + 3) / 4, lse = ln 4.
TEST_F(RefGolden, SinkJoinsOnlyTheDenominatorUnscaled) {
  AttentionConfig c = tiny_config();
  c.scale = 0.25f;  // would change the sink's weight if it were (wrongly) scaled
  c.sinks = {float(std::log(2.0))};
  StepInputs in;
  in.context_key = {0};
  in.context_value = {1};
  in.key = {0};
  in.value = {3};
  in.query = {7};
  const auto out = run_step(*ref_, c, {{1, 1, {0}}}, in, 1);
  EXPECT_NEAR(out.output[0], 1.0, 1e-6);
  EXPECT_NEAR(out.lse[0], std::log(4.0), 1e-6);
}

// GQA: query head h reads KV head h / (num_heads / num_kv_heads).
TEST_F(RefGolden, GqaMapsConsecutiveHeadsToOneKvHead) {
  AttentionConfig c = tiny_config(4, 2, 1);
  StepInputs in;
  in.key = {0, 0};  // one token, 2 KV heads
  in.value = {10, 20};
  in.query = {1, 1, 1, 1};
  const auto out = run_step(*ref_, c, {{0, 1, {0}}}, in, 1);
  EXPECT_NEAR(out.output[0], 10, 1e-6);
  EXPECT_NEAR(out.output[1], 10, 1e-6);
  EXPECT_NEAR(out.output[2], 20, 1e-6);
  EXPECT_NEAR(out.output[3], 20, 1e-6);
}

// fp8 e4m3 with k_scale 2: 3.0 is stored as e4m3(1.5) = 0x3c and read back as 3.0;
// 1000 is stored as 500 -> saturated to 448 (0x7e) and read back as 896.
TEST_F(RefGolden, Fp8CacheStoresScaledSaturatedValues) {
  AttentionConfig c = tiny_config();
  c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  c.block_size = 1;
  auto impl = ref_->make_impl(c, Device::cpu());
  KVCache cache = KVCache::allocate(c, 2);
  std::vector<float> k = {3.0f, 1000.0f}, v = {-3.0f, 0.1f};
  std::vector<int64_t> slots = {1, 0};
  WriteKVArgs w;
  w.key = TensorView::contiguous(k.data(), DType::kF32, {2, 1, 1});
  w.value = TensorView::contiguous(v.data(), DType::kF32, {2, 1, 1});
  w.slot_mapping = TensorView::contiguous(slots.data(), DType::kI64, {2});
  w.kv_cache = cache.view();
  w.scales = {2.0f, 0.5f};
  impl->write_kv(w);
  const auto* kb = static_cast<const uint8_t*>(cache.view().key.data);
  const auto* vb = static_cast<const uint8_t*>(cache.view().value.data);
  const int64_t bstride = cache.view().key.stride(0);
  EXPECT_EQ(kb[1 * bstride], 0x3c);  // slot 1 <- 3.0 / 2
  EXPECT_EQ(kb[0], 0x7e);            // slot 0 <- saturate(1000 / 2)
  EXPECT_EQ(vb[1 * bstride], float_to_fp8_e4m3(-6.0f));
  EXPECT_EQ(vb[0], float_to_fp8_e4m3(0.2f));
  EXPECT_FLOAT_EQ(fp8_e4m3_to_float(kb[0]) * 2.0f, 896.0f);
}

// query_quant: q8 = e4m3(q / q_scale) and attention uses q8 * q_scale. With q_scale 0.01,
// q = 1.03 -> 103 -> e4m3 104 (steps of 8 in [64, 128)) -> 1.04, and q = 5 -> 500 -> saturated
// 448 -> 4.48. Keys {0, 1}, values {0, 1}: out = e^q' / (1 + e^q').
TEST_F(RefGolden, QueryQuantUsesTheSaturatedE4M3Query) {
  AttentionConfig c = tiny_config();
  c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  c.query_quant = true;
  StepInputs in;
  in.context_key = {0};
  in.context_value = {0};
  in.key = {1};
  in.value = {1};
  const KVScales scales{1.0f, 1.0f, 0.01f};
  auto expect_out = [](double q) { return std::exp(q) / (1 + std::exp(q)); };
  for (const auto& [q, q_used] : {std::pair{1.03f, 1.04}, {5.0f, 4.48}, {-5.0f, -4.48}}) {
    in.query = {q};
    const auto out = run_step(*ref_, c, {{1, 1, {0}}}, in, 1, scales);
    EXPECT_NEAR(out.output[0], expect_out(q_used), 1e-6) << "q = " << q;
  }
  // The low-precision twin models the fp8 products: q.k keeps 13 significant bits (1.04 =
  // 0.52 * 2: trunc(0.52 * 2^13) = 4259 -> 4259 / 2^12 = 1.039794921875), and P is rounded to
  // e4m3 (not its sum): with values {1, 0}, P = {e^-1.0398, 1} relative to the max, and
  // e^-1.0398 = 0.3535 -> e4m3 0.34375 (steps of 1/32 in [0.25, 0.5)).
  in.query = {1.03f};
  in.context_value = {1};
  in.value = {0};
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  const auto low = run_step(*lowp, c, {{1, 1, {0}}}, in, 1, scales);
  EXPECT_NEAR(low.output[0], 0.34375 / (1.0 + std::exp(-1.039794921875)), 1e-6);
  in.context_value = {0};
  in.value = {1};
  c.query_quant = false;
  const auto plain = run_step(*ref_, c, {{1, 1, {0}}}, in, 1, scales);
  EXPECT_NEAR(plain.output[0], expect_out(1.03), 1e-6);
}

// A padded token (slot -1) writes nothing; a zero-length request produces no rows.
TEST_F(RefGolden, PaddedSlotAndZeroLengthRequestTouchNothing) {
  AttentionConfig c = tiny_config();
  auto impl = ref_->make_impl(c, Device::cpu());
  KVCache cache = KVCache::allocate(c, 1);
  std::vector<float> k = {5.0f}, v = {6.0f};
  std::vector<int64_t> slots = {-1};
  WriteKVArgs w{TensorView::contiguous(k.data(), DType::kF32, {1, 1, 1}),
                TensorView::contiguous(v.data(), DType::kF32, {1, 1, 1}),
                TensorView::contiguous(slots.data(), DType::kI64, {1}),
                cache.view(),
                {},
                {}};
  impl->write_kv(w);
  const auto* p = static_cast<const float*>(cache.storage().data());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(p[i], 0.0f);

  StepInputs in;
  in.key = {0};
  in.value = {9};
  in.query = {1};
  const auto out = run_step(*ref_, c, {{0, 0, {}}, {0, 1, {0}}, {0, 0, {}}}, in, 1);
  ASSERT_EQ(out.output.size(), 1u);
  EXPECT_NEAR(out.output[0], 9.0, 1e-6);
}

// Merge (spec 4.12): equal LSEs average; -inf (or +inf) on one side takes the other side;
// -inf on both keeps the prefix output and gives lse = -inf.
TEST_F(RefGolden, MergeHandlesInfiniteLse) {
  const int n = 4;
  std::vector<float> po = {1, 1, 1, 1}, so = {3, 3, 3, 3}, out(n), out_lse(n);
  std::vector<float> pl = {0.0f, float(-kInf), float(-kInf), float(kInf)};
  std::vector<float> sl = {0.0f, 2.0f, float(-kInf), 1.0f};
  MergeArgs m;
  m.prefix_output = TensorView::contiguous(po.data(), DType::kF32, {n, 1, 1});
  m.suffix_output = TensorView::contiguous(so.data(), DType::kF32, {n, 1, 1});
  m.prefix_lse = TensorView::contiguous(pl.data(), DType::kF32, {1, n});
  m.suffix_lse = TensorView::contiguous(sl.data(), DType::kF32, {1, n});
  m.output = TensorView::contiguous(out.data(), DType::kF32, {n, 1, 1});
  m.output_lse = TensorView::contiguous(out_lse.data(), DType::kF32, {1, n});
  check_merge_args(m);
  ref_->merge_states(m);
  EXPECT_NEAR(out[0], 2.0, 1e-6);  // equal weights
  EXPECT_NEAR(out_lse[0], std::log(2.0), 1e-6);
  EXPECT_NEAR(out[1], 3.0, 1e-6);  // prefix empty: suffix wins
  EXPECT_NEAR(out_lse[1], 2.0, 1e-6);
  EXPECT_NEAR(out[2], 1.0, 1e-6);  // both empty: prefix kept
  EXPECT_EQ(out_lse[2], float(-kInf));
  EXPECT_NEAR(out[3], 3.0, 1e-6);  // +inf means empty too (FA2)
  EXPECT_NEAR(out_lse[3], 1.0, 1e-6);
}

// A chunked prefill split in two and merged by LSE equals attention over all keys at once.
TEST_F(RefGolden, MergeOfTwoKeyRangesEqualsOnePass) {
  // Row attends keys {a, b} = logits {0, ln 3} with values {1, 5}: out = (1 + 15) / 4 = 4.
  // Prefix = key a alone: out 1, lse 0. Suffix = key b alone: out 5, lse ln 3.
  std::vector<float> po = {1}, so = {5}, out(1), pl = {0.0f}, sl = {float(std::log(3.0))};
  MergeArgs m;
  m.prefix_output = TensorView::contiguous(po.data(), DType::kF32, {1, 1, 1});
  m.suffix_output = TensorView::contiguous(so.data(), DType::kF32, {1, 1, 1});
  m.prefix_lse = TensorView::contiguous(pl.data(), DType::kF32, {1, 1});
  m.suffix_lse = TensorView::contiguous(sl.data(), DType::kF32, {1, 1});
  m.output = TensorView::contiguous(out.data(), DType::kF32, {1, 1, 1});
  ref_->merge_states(m);
  EXPECT_NEAR(out[0], 4.0, 1e-6);
}

}  // namespace
}  // namespace pagedattn
