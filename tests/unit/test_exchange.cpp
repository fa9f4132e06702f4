// The transport-independent exchanges of tensor- and decode-context-parallel results
// (pagedattn/exchange.h) and Backend::merge_ranks on the host: layouts, the rank-order merge
// against a float64 chain, N simulated ranks exchanging in place, out of place and from strided
// tensors equal one rank, and the errors. The same code runs on GPUs in
// tests/cuda/test_cuda_parallel.cpp and across processes in tests/mpi and tests/nccl.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/exchange_sim.h"
#include "common/expect_error.h"
#include "common/parallel_scenarios.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/exchange.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

Tensor random_host(const std::vector<int64_t>& shape, DType dtype, std::mt19937& rng,
                   float std_dev = 1.0f) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<float> dist(0.0f, std_dev);
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.data(), b.data(), a.view().nbytes()) == 0;
}

TEST(Exchange, LayoutsPutEachRankInItsSlot) {
  const auto l = DcpExchangeLayout::of(3, 5, 4, 8, DType::kBF16);
  EXPECT_EQ(l.lses_offset, 1024u);  // 3 * 5 * 4 * 8 * 2 = 960 bytes of outputs, 256-aligned
  EXPECT_EQ(l.bytes, 1024u + 3 * 4 * 5 * 4);
  std::vector<uint8_t> ws(l.bytes);
  const TensorView slot = l.output_slot(ws.data(), 2, Device::cpu());
  EXPECT_EQ(slot.data, ws.data() + 2 * 5 * 4 * 8 * 2);
  EXPECT_EQ(slot.shape_vector(), (std::vector<int64_t>{5, 4, 8}));
  const TensorView lse = l.lse_slot(ws.data(), 1, Device::cpu());
  EXPECT_EQ(lse.data, ws.data() + 1024 + 4 * 5 * 4);
  EXPECT_EQ(lse.shape_vector(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(l.outputs(ws.data(), Device::cpu()).shape_vector(), (std::vector<int64_t>{3, 5, 4, 8}));
  EXPECT_EQ(TpExchangeLayout::of(4, 7, 2, 16, DType::kF16).bytes, size_t(4 * 7 * 2 * 16 * 2));
  EXPECT_ERROR(DcpExchangeLayout::of(0, 5, 4, 8, DType::kBF16), InvalidArgument,
               "world (0) must be >= 1");
  EXPECT_ERROR(DcpExchangeLayout::of(2, 5, 4, 8, DType::kFp8E4M3), InvalidArgument,
               "partial dtype float8_e4m3fn must be float32, float16 or bfloat16");
  EXPECT_ERROR(l.output_slot(ws.data(), 3, Device::cpu()), InvalidArgument,
               "rank (3) must be in [0, world) with world (3)");
}

// Random partials with empty ranks (LSE -inf or +inf, rows of NaN garbage), a row no rank has
// keys for, and a rank whose LSE dominates, merged on the host against the float64 chain.
void make_merge_inputs(int ranks, int64_t t, int64_t h, int64_t d, DType dtype, uint32_t seed,
                       Tensor& partials, Tensor& lses) {
  std::mt19937 rng(seed);
  partials = random_host({ranks, t, h, d}, dtype, rng);
  lses = random_host({ranks, h, t}, DType::kF32, rng, 3.0f);
  auto* l = lses.data_as<float>();
  for (int64_t i = 0; i < ranks * h * t; i += 7) l[i] = (i % 2) ? kInf : -kInf;
  for (int r = 0; r < ranks; ++r) l[(r * h + 1) * t + 2] = -kInf;  // head 1, token 2: no keys
  if (ranks > 1) l[(1 * h + 0) * t + 0] = 40.0f;                   // rank 1 dominates
  for (int r = 0; r < ranks; ++r) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t tt = 0; tt < t; ++tt) {
        if (std::isinf(l[(r * h + hh) * t + tt])) {
          fill_host(partials.view().select(0, r).select(0, tt).select(0, hh), std::nan(""));
        }
      }
    }
  }
}

TEST(Exchange, HostMergeRanksEqualsAFloat64Chain) {
  const Backend& backend = *default_registry().find("ref");
  for (int ranks : {1, 2, 3, 5}) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      for (DType out : {DType::kF32, DType::kF16}) {
        const int64_t t = 6, h = 3, d = 10;
        Tensor partials, lses;
        make_merge_inputs(ranks, t, h, d, in, 100 + uint32_t(ranks), partials, lses);
        const auto [want, want_lse] = test::reference_merge_ranks(partials.view(), lses.view());
        Tensor got = Tensor::empty({t, h, d}, out), got_lse = Tensor::empty({h, t}, DType::kF32);
        backend.merge_ranks({partials.view(), lses.view(), got.view(), got_lse.view(), {}});
        const ErrorStats e = compare(got.view(), want.view());
        const ErrorStats el = compare(got_lse.view(), want_lse.view());
        const double tol = out == DType::kF32 ? 2e-6 : 1e-3;  // float math, one rounding
        EXPECT_EQ(e.mismatched_nonfinite, 0) << ranks << " " << e.to_string();
        EXPECT_LE(e.max_abs, tol * std::max(1.0, e.max_ref)) << ranks << " " << e.to_string();
        EXPECT_EQ(el.mismatched_nonfinite, 0) << el.to_string();
        EXPECT_LE(el.max_abs, 2e-6 * std::max(1.0, el.max_ref)) << el.to_string();
        // The row no rank has keys for: output 0, LSE -inf.
        EXPECT_EQ(load_element(got.data(), out, (2 * h + 1) * d), 0.0);
        EXPECT_EQ(got_lse.data_as<float>()[1 * t + 2], -kInf);
      }
    }
  }
  Tensor partials, lses;
  make_merge_inputs(2, 4, 3, 8, DType::kF32, 1, partials, lses);
  Tensor out = Tensor::empty({4, 3, 8}, DType::kF32);
  EXPECT_ERROR(
      backend.merge_ranks({partials.view(), lses.view().slice(0, 0, 1), out.view(), {}, {}}),
      InvalidArgument, "partial_lses must be float32 [num_ranks=2, num_heads=3, num_tokens >= 4]");
  EXPECT_ERROR(
      backend.merge_ranks({partials.view().slice(2, 0, 2), lses.view(), out.view(), {}, {}}),
      InvalidArgument,
      "partial_outputs must be float32/float16/bfloat16 [num_ranks >= 1, 4, 3, 8]");
}

// A DCP decode step over a cache spread on 2, 3 and 4 ranks, each rank's partial exchanged by
// dcp_exchange_begin / simulated all-gathers / dcp_exchange_end, against one rank: every rank
// ends with the same bytes, the single-rank output and its LSE.
TEST(Exchange, DcpRanksExchangedEqualOneRank) {
  const test::DcpScenario s = test::make_dcp_scenario(23);
  for (const Backend* backend : default_registry().backends()) {
    if (!backend->check({s.config, Device::cpu()}).empty()) continue;
    Tensor want, want_lse;
    test::run_dcp(s, *backend, nullptr, want, want_lse);
    for (int world : {1, 2, 3, 4}) {
      std::vector<Tensor> outs(static_cast<size_t>(world)), lses(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        const auto dcp = DecodeContextParallel::of(r, world);
        test::run_dcp(s, *backend, &dcp, outs[size_t(r)], lses[size_t(r)]);
      }
      for (auto placement :
           {test::Placement::kInSlot, test::Placement::kContiguous, test::Placement::kStrided}) {
        const auto got =
            test::run_dcp_exchange_sim(*backend, outs, lses, DType::kF32, placement, Device::cpu());
        for (int r = 0; r < world; ++r) {
          const auto& [out, lse] = got[size_t(r)];
          const ErrorStats e = compare(out.view(), want.view());
          const ErrorStats el = compare(lse.view(), want_lse.view());
          EXPECT_LE(e.max_abs, 2e-6 * std::max(1.0, e.max_ref))
              << backend->name() << " world " << world << " " << placement_name(placement)
              << " rank " << r << ": " << e.to_string();
          EXPECT_LE(el.max_abs, 2e-6 * std::max(1.0, el.max_ref)) << el.to_string();
          EXPECT_TRUE(same_bytes(out, got[0].first) && same_bytes(lse, got[0].second))
              << "rank " << r << " differs from rank 0";
        }
      }
    }
  }
}

// N ranks' head columns gathered by tp_exchange_begin / simulated all-gathers / tp_exchange_end
// equal the whole output and LSE byte for byte on every rank, wherever the ranks' results sit.
TEST(Exchange, TpRanksExchangedEqualTheWhole) {
  std::mt19937 rng(5);
  for (int world : {1, 2, 3, 4}) {
    const int64_t t = 7, hr = 2, d = 24;
    const Tensor whole = random_host({t, hr * world, d}, DType::kBF16, rng);
    const Tensor whole_lse = random_host({hr * world, t}, DType::kF32, rng);
    std::vector<Tensor> outs, lses;
    for (int r = 0; r < world; ++r) {
      outs.push_back(Tensor::copy_of(whole.view().slice(1, r * hr, (r + 1) * hr), Device::cpu()));
      lses.push_back(
          Tensor::copy_of(whole_lse.view().slice(0, r * hr, (r + 1) * hr), Device::cpu()));
    }
    for (auto placement :
         {test::Placement::kInSlot, test::Placement::kContiguous, test::Placement::kStrided}) {
      const auto got = test::run_tp_exchange_sim(outs, lses, placement, Device::cpu());
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(same_bytes(got[size_t(r)].first, whole))
            << "world " << world << " " << placement_name(placement) << " rank " << r;
        EXPECT_TRUE(same_bytes(got[size_t(r)].second, whole_lse))
            << "world " << world << " " << placement_name(placement) << " rank " << r;
      }
    }
  }
}

TEST(Exchange, ErrorsNameTheArgumentAndTheBound) {
  const auto l = DcpExchangeLayout::of(2, 5, 4, 8, DType::kF32);
  std::vector<uint8_t> ws(l.bytes);
  Tensor partial = Tensor::zeros({5, 4, 8}, DType::kF32), lse = Tensor::zeros({4, 5}, DType::kF32);
  Tensor out = Tensor::zeros({5, 4, 8}, DType::kBF16);
  DcpExchangeArgs a{1, 2, partial.view(), lse.view(), out.view(), {}, {ws.data(), 10}, {}};
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument,
               "workspace has 10 bytes; the exchange needs 1440");
  a.workspace.bytes = ws.size();
  a.rank = 2;
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument, "rank (2) must be in [0, world)");
  a.rank = 1;
  a.partial_output = l.output_slot(ws.data(), 0, Device::cpu());  // rank 0's slot
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument,
               "partial_output overlaps the workspace's outputs but is not this rank's slot of it "
               "(rank 1)");
  a.partial_output = partial.view();
  a.output = l.outputs(ws.data(), Device::cpu()).select(0, 1);
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument,
               "output and output_lse must not overlap the workspace");
  const Tensor narrow = Tensor::zeros({5, 4, 4}, DType::kF32),
               bad_lse = Tensor::zeros({5, 4}, DType::kF32);
  a.output = narrow.view();
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument,
               "output must be float32/float16/bfloat16 "
               "[T=5, H=4, D=8]");
  a.output = out.view();
  a.partial_lse = bad_lse.view();
  EXPECT_ERROR(dcp_exchange_begin(a), InvalidArgument, "partial_lse must be float32 [H=4, T=5]");
  // A strided partial is staged into the rank's slot: its gather is in place.
  a.partial_lse = lse.view();
  Tensor wide = Tensor::zeros({5, 40}, DType::kF32);
  a.partial_output = test::strided_rows(wide, 4, 8);
  const ExchangeGathers g = dcp_exchange_begin(a);
  ASSERT_EQ(g.count, 2);
  EXPECT_TRUE(g.buffers[0].in_place(1));
  EXPECT_FALSE(g.buffers[1].in_place(1));  // the LSE is contiguous: sent from where it is
  EXPECT_EQ(g.buffers[1].send, lse.data());

  Tensor rank_out = Tensor::zeros({5, 2, 8}, DType::kF16),
         full = Tensor::zeros({5, 4, 8}, DType::kF16);
  Tensor rank_lse = Tensor::zeros({2, 5}, DType::kF32);
  std::vector<uint8_t> tws(TpExchangeLayout::of(2, 5, 2, 8, DType::kF16).bytes);
  TpExchangeArgs tp{0,           2,          rank_out.view(),          {},
                    full.view(), lse.view(), {tws.data(), tws.size()}, {}};
  EXPECT_ERROR(tp_exchange_begin(tp), InvalidArgument, "lse is given without rank_lse");
  tp.rank_lse = rank_lse.view();
  const Tensor lse3 = Tensor::zeros({3, 5}, DType::kF32), lse4 = Tensor::zeros({4, 5}, DType::kF32);
  const Tensor wrong = Tensor::zeros({5, 6, 8}, DType::kF16);
  tp.lse = lse3.view();
  EXPECT_ERROR(tp_exchange_begin(tp), InvalidArgument,
               "lse must be contiguous float32 [H=4, T=5] on cpu when rank_lse is given");
  tp.lse = lse4.view();
  tp.output = wrong.view();
  EXPECT_ERROR(tp_exchange_begin(tp), InvalidArgument,
               "output must be float16 [T=5, H=world*Hr=4, D=8]");
}

}  // namespace
}  // namespace pagedattn
