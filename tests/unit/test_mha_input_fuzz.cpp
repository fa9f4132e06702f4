// The input fuzz for MultiHeadAttention (no cache, no metadata: only the tensors): random valid
// shapes (3-D and 4-D, self and cross attention, GQA, cpu and ref), one damage to one tensor
// (tests/common/step_damage.h's, plus a batch or sequence one short). Every call either throws
// pagedattn::Error naming the caller's tensor or runs, writing every output element with a finite
// value that a rerun on dense copies of the inputs reproduces bit for bit; under the asan preset,
// in bounds.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/step_damage.h"
#include "pagedattn/error.h"
#include "pagedattn/mha.h"

namespace pagedattn {
namespace {

using namespace pagedattn::testing;  // NOLINT: the damage helpers

class MhaInputFuzz : public ::testing::TestWithParam<std::string> {};

TEST_P(MhaInputFuzz, EveryDamageIsRefusedOrHarmless) {
  const std::string backend = GetParam();
  constexpr int kCases = 300;
  Tally tally;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0x3a400000u + i));
    MultiHeadAttentionOptions o;
    o.num_kv_heads = pick(rng, {1, 2});
    o.num_heads = *o.num_kv_heads * pick(rng, {1, 2});
    o.head_size = pick(rng, {16, 32});
    o.scale = 0.25f;
    o.dtype = pick(rng, {DType::kF32, DType::kBF16});
    o.attn_backend = backend;
    MultiHeadAttention layer(o);
    const int64_t b = pick(rng, {1, 2, 3}), sq = pick(rng, {1, 4, 9});
    const int64_t skv = pick(rng, {0, 0, 1}) ? pick(rng, {1, 5}) : sq;
    const bool split_heads = pick(rng, {0, 1});  // [B, S, H, D] rather than [B, S, H * D]
    auto shape = [&](int64_t s, int heads) {
      return split_heads ? std::vector<int64_t>{b, s, heads, o.head_size}
                         : std::vector<int64_t>{b, s, int64_t(heads) * o.head_size};
    };
    const Rows q = random_rows(o.dtype, shape(sq, o.num_heads), rng);
    const Rows k = random_rows(o.dtype, shape(skv, *o.num_kv_heads), rng);
    const Rows v = random_rows(o.dtype, shape(skv, *o.num_kv_heads), rng);
    const Rows out = poisoned_rows(o.dtype, shape(sq, o.num_heads));
    std::vector<TensorView> views = {q.view, k.view, v.view, out.view};
    std::string what = "none";
    const char* names[] = {"query", "key", "value", "output"};
    const int which = pick(rng, {0, 1, 2, 3}), kind = pick(rng, {0, 1, 2});
    if (kind == 1) {
      what = damage_tensor({{names[which], &views[size_t(which)]}}, rng);
    } else if (kind == 2) {
      TensorView& t = views[size_t(which)];
      const int dim = pick(rng, {0, 1});
      t.shape[size_t(dim)] = t.shape[size_t(dim)] > 0 ? t.shape[size_t(dim)] - 1 : 0;
      what = std::string(names[which]) + (dim == 0 ? " batch" : " sequence") + " one short";
    }
    SCOPED_TRACE("case " + std::to_string(i) + " (" + backend + "): " + what);
    announce(i, what);
    try {
      layer.forward(views[0], views[1], views[2], views[3]);
    } catch (const Error& e) {
      const std::string msg = e.what();
      tally.count({false, msg});
      EXPECT_NE(what, "none") << "a valid call was refused: " << msg;
      // The layer has no cache: its errors name the caller's tensors, not the cross path's.
      EXPECT_EQ(msg.find("kv_cache"), std::string::npos) << msg;
      if (std::getenv("PAGEDATTN_FUZZ_VERBOSE")) std::fprintf(stderr, "  %s\n", msg.c_str());
      continue;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw a non-pagedattn exception: " << e.what();
      continue;
    }
    tally.count({true, {}});
    const int64_t rows = views[3].size(0);
    const std::vector<double> got = row_values(views[3], rows);
    EXPECT_TRUE(all_finite(got)) << "an accepted call left an element unwritten or non-finite";
    std::vector<Tensor> dense;
    for (int t = 0; t < 3; ++t) dense.push_back(Tensor::copy_of(views[size_t(t)], Device::cpu()));
    const Rows dense_out = poisoned_rows(views[3].dtype, views[3].shape_vector());
    layer.forward(dense[0].view(), dense[1].view(), dense[2].view(), dense_out.view);
    EXPECT_TRUE(got == row_values(dense_out.view, rows))
        << "the layer read a tensor differently from its strides";
  }
  tally.print("mha fuzz " + backend);
  EXPECT_GT(tally.ran, kCases / 5);
  EXPECT_GT(kCases - tally.ran, kCases / 5);
}

INSTANTIATE_TEST_SUITE_P(Backends, MhaInputFuzz, ::testing::Values("cpu", "ref"));

}  // namespace
}  // namespace pagedattn
