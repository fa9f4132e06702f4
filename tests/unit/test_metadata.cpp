// MetadataBuilder (spec 2.3-2.5) and validate_metadata, one test per rule.
#include <gtest/gtest.h>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

template <class T>
std::vector<T> values(const TensorView& v) {
  std::vector<T> out;
  for (int64_t i = 0; i < v.numel(); ++i) out.push_back(static_cast<const T*>(v.data)[i]);
  return out;
}

// Spec 2.4's worked example: a decode, a chunked-prefill chunk and a new prompt whose first
// two blocks are a prefix hit shared with the chunked request.
StepMetadata worked_example(int pad_to = 0) {
  return MetadataBuilder(16)
      .add({10, 1, {7}})
      .add({32, 16, {3, 9, 12}})
      .add({32, 8, {3, 9, 5}})
      .pad_slots_to(pad_to)
      .build();
}

TEST(MetadataBuilder, SpecWorkedExample) {
  const StepMetadata s = worked_example(32);
  const AttentionMetadata m = s.view();
  EXPECT_EQ(values<int32_t>(m.query_start_loc), (std::vector<int32_t>{0, 1, 17, 25}));
  EXPECT_EQ(values<int32_t>(m.seq_lens), (std::vector<int32_t>{11, 48, 40}));
  EXPECT_EQ(m.num_actual_tokens, 25);
  EXPECT_EQ(m.max_query_len, 16);
  EXPECT_EQ(m.max_seq_len, 48);
  const auto slots = values<int64_t>(m.slot_mapping);
  ASSERT_EQ(slots.size(), 32u);
  EXPECT_EQ(slots[0], 122);                                               // block 7, offset 10
  for (int i = 0; i < 16; ++i) EXPECT_EQ(slots[size_t(1 + i)], 192 + i);  // block 12
  for (int i = 0; i < 8; ++i) EXPECT_EQ(slots[size_t(17 + i)], 80 + i);   // block 5
  for (int i = 25; i < 32; ++i) EXPECT_EQ(slots[size_t(i)], -1);          // padding
  EXPECT_EQ(m.max_blocks_per_seq(), 3);
  EXPECT_EQ(values<int32_t>(m.block_table), (std::vector<int32_t>{7, 0, 0, 3, 9, 12, 3, 9, 5}));
  EXPECT_NO_THROW(validate_metadata(m, AttentionType::kDecoder, {13, 16}));
}

TEST(MetadataBuilder, PaddingRequestsRepeatTheLastOffset) {
  const StepMetadata s = MetadataBuilder(4).add({0, 3, {2}}).add_padding_requests(2).build();
  const AttentionMetadata m = s.view();
  EXPECT_EQ(values<int32_t>(m.query_start_loc), (std::vector<int32_t>{0, 3, 3, 3}));
  EXPECT_EQ(values<int32_t>(m.seq_lens), (std::vector<int32_t>{3, 0, 0}));
  EXPECT_NO_THROW(validate_metadata(m, AttentionType::kDecoder, {4, 4}));
}

TEST(MetadataBuilder, RejectsTooFewBlocks) {
  MetadataBuilder b(16);
  EXPECT_ERROR(b.add({16, 1, {4}}), InvalidArgument,
               "request 0: 1 block ids cannot hold seq_len 17 at block_size 16 (needs 2)");
}

TEST(MetadataBuilder, MaxSeqLenAtLeastForGraphCapture) {
  const StepMetadata s = MetadataBuilder(4).add({0, 1, {1}}).max_seq_len_at_least(4096).build();
  EXPECT_EQ(s.view().max_seq_len, 4096);
}

// Each rule: break one thing in an otherwise valid step and expect an error naming it.
class MetadataValidation : public ::testing::Test {
 protected:
  void SetUp() override { step_ = worked_example(27); }
  void expect_error(const char* substring, AttentionType type = AttentionType::kDecoder,
                    CacheGeometry cache = {13, 16}) {
    EXPECT_ERROR(validate_metadata(step_.view(), type, cache), InvalidArgument, substring);
  }
  StepMetadata step_;
};

TEST_F(MetadataValidation, QueryStartLocStartsAtZero) {
  step_.query_start_loc[0] = 1;
  expect_error("metadata.query_start_loc[0] (1) must be 0");
}
TEST_F(MetadataValidation, QueryStartLocNonDecreasing) {
  step_.query_start_loc[2] = 0;
  expect_error("metadata.query_start_loc must be non-decreasing: [2] = 0 < [1] = 1");
}
TEST_F(MetadataValidation, NumActualTokensMatchesLastOffset) {
  AttentionMetadata m = step_.view();
  m.num_actual_tokens = 24;
  EXPECT_ERROR(validate_metadata(m, AttentionType::kDecoder, {13, 16}), InvalidArgument,
               "metadata.num_actual_tokens (24) != query_start_loc[num_seqs] (25)");
}
// A query may outnumber its keys (FlashAttention's seqlen_q > seqlen_k), but its tokens' slots
// must still lie in the blocks its seq_len uses (here request 1's tokens sit at positions 32-47,
// in its third block, and seq_len 15 uses one).
TEST_F(MetadataValidation, ASeqLenBelowTheQueryStillBoundsTheSlots) {
  step_.seq_lens[1] = 15;
  expect_error("metadata.slot_mapping[1] (");
  expect_error("which is not one of request 1's 1 blocks");
}
TEST_F(MetadataValidation, MaxQueryLenIsAnUpperBound) {
  step_.max_query_len = 8;
  expect_error("metadata.max_query_len (8) is below the longest query (16)");
}
TEST_F(MetadataValidation, MaxSeqLenIsAnUpperBound) {
  step_.max_seq_len = 40;
  expect_error("metadata.max_seq_len (40) is below the longest sequence (48)");
}
TEST_F(MetadataValidation, BlockTableWideEnough) {
  expect_error("request 1 with seq_len 48 needs 6 blocks of 8", AttentionType::kDecoder, {13, 8});
}
TEST_F(MetadataValidation, BlockIdsInsideTheCache) {
  expect_error("metadata.block_table[1][2] (12) is outside the cache's blocks [0, 12)",
               AttentionType::kDecoder, {12, 16});
  step_.block_table[0] = -3;
  expect_error("metadata.block_table[0][0] (-3) is outside the cache's blocks [0, 13)");
}
TEST_F(MetadataValidation, StaleBlockTableColumnsAreNotRead) {
  step_.block_table[1] = 999;  // request 0 uses one block: column 1 is never read
  EXPECT_NO_THROW(validate_metadata(step_.view(), AttentionType::kDecoder, {13, 16}));
}
TEST_F(MetadataValidation, SlotsInsideTheCache) {
  step_.slot_mapping[3] = 13 * 16;
  expect_error("metadata.slot_mapping[3] (208) is outside the cache's slots [0, 208) and not -1");
  step_.slot_mapping[3] = -2;
  expect_error("metadata.slot_mapping[3] (-2) is outside");
}
TEST_F(MetadataValidation, NoTwoTokensWriteOneSlot) {
  step_.slot_mapping[2] = step_.slot_mapping[1];  // request 1's first two tokens, one slot
  const std::string want = "metadata.slot_mapping[2] (" + std::to_string(step_.slot_mapping[1]) +
                           ") repeats slot_mapping[1]: two tokens would write one slot";
  expect_error(want.c_str());
}
TEST_F(MetadataValidation, SlotsInsideTheirOwnRequestsBlocks) {
  step_.slot_mapping[0] = 80;  // request 0 (blocks {7}) writing into request 2's block 5
  expect_error(
      "metadata.slot_mapping[0] (80) lies in block 5, which is not one of request 0's 1 blocks");
}
TEST_F(MetadataValidation, SlotsPastTheRealTokensArePadding) {
  step_.slot_mapping[26] = 123;
  expect_error("metadata.slot_mapping[26] (123) is past num_actual_tokens (25) and must be -1");
}
TEST_F(MetadataValidation, DecoderWritesEveryRealToken) {
  step_.slot_mapping.resize(20);
  expect_error(
      "metadata.slot_mapping has 20 entries; a decoder step writes num_actual_tokens (25)");
}
TEST_F(MetadataValidation, PaddedTokenInsideARequestIsAllowed) {
  step_.slot_mapping[5] = -1;
  EXPECT_NO_THROW(validate_metadata(step_.view(), AttentionType::kDecoder, {13, 16}));
}
TEST_F(MetadataValidation, CausalMatchesTheAttentionType) {
  expect_error("metadata.causal must be false for encoder_decoder attention",
               AttentionType::kEncoderDecoder);
  step_.causal = false;
  expect_error("metadata.causal must be true for decoder attention");
}
TEST_F(MetadataValidation, EncoderSeqLensEqualQueryLens) {
  step_.causal = false;
  expect_error("metadata.seq_lens[0] (11) must equal the query length (1) for encoder_only",
               AttentionType::kEncoderOnly);
}
TEST_F(MetadataValidation, DtypesAndShapes) {
  StepMetadata s = worked_example();
  AttentionMetadata m = s.view();
  m.seq_lens_cpu.dtype = DType::kI64;
  EXPECT_ERROR(validate_metadata(m, AttentionType::kDecoder, {13, 16}), InvalidArgument,
               "metadata.seq_lens_cpu must be int32");
  m = s.view();
  m.query_start_loc_cpu.shape[0] = 3;
  EXPECT_ERROR(validate_metadata(m, AttentionType::kDecoder, {13, 16}), InvalidArgument,
               "metadata.query_start_loc_cpu has 3 entries; expected 4");
  m = s.view();
  m.slot_mapping.dtype = DType::kI32;
  EXPECT_ERROR(validate_metadata(m, AttentionType::kDecoder, {13, 16}), InvalidArgument,
               "metadata.slot_mapping must be int64");
}
TEST_F(MetadataValidation, CrossAttentionSlotsMustLieInSomeRequestsBlocks) {
  // Cross attention: slots are encoder tokens; they need not follow the query rows.
  StepMetadata s = MetadataBuilder(4).add({4, 1, {2, 6}}).causal(false).build();
  s.slot_mapping = {8, 9, 10, 11};  // the encoder's 4 tokens into block 2
  EXPECT_NO_THROW(validate_metadata(s.view(), AttentionType::kEncoderDecoder, {8, 4}));
  s.slot_mapping[2] = 4;  // block 1: nobody's
  EXPECT_ERROR(validate_metadata(s.view(), AttentionType::kEncoderDecoder, {8, 4}), InvalidArgument,
               "metadata.slot_mapping[2] (4) lies in block 1, which no request");
}
TEST_F(MetadataValidation, CrossAttentionQueriesMayOutnumberTheEncoderKeys) {
  // 6 decoder tokens against 3 encoder keys: cross attention only.
  StepMetadata s = MetadataBuilder(4).add({0, 3, {2}}).causal(false).build();
  s.query_start_loc = {0, 6};
  s.max_query_len = 6;
  s.slot_mapping.assign(6, -1);
  EXPECT_NO_THROW(validate_metadata(s.view(), AttentionType::kEncoderDecoder, {8, 4}));
  s.seq_lens[0] = -1;
  EXPECT_ERROR(validate_metadata(s.view(), AttentionType::kEncoderDecoder, {8, 4}), InvalidArgument,
               "metadata.seq_lens[0] (-1) must be >= 0");
  // A decoder too (bottom-right causal: the first 3 rows see no key), and zero keys in a cache
  // of zero blocks.
  s.seq_lens[0] = 3;
  s.causal = true;
  EXPECT_NO_THROW(validate_metadata(s.view(), AttentionType::kDecoder, {8, 4}));
  s.seq_lens[0] = 0;
  EXPECT_NO_THROW(validate_metadata(s.view(), AttentionType::kDecoder, {0, 4}));
  s.seq_lens[0] = 1;
  EXPECT_ERROR(validate_metadata(s.view(), AttentionType::kDecoder, {0, 4}), InvalidArgument,
               "metadata.block_table[0][0] (2) is outside the cache's blocks [0, 0)");
}

}  // namespace
}  // namespace pagedattn
