// Tensor and decode context parallelism on one GPU, everything but the transport: the cuda
// backend's merge_ranks kernel against a float64 chain, and 2, 3 and 4 ranks simulated on one
// device (each rank its own shard or share of the KV cache, its own tensors and workspace),
// their exchanges run by pagedattn/exchange.h with the all-gathers replaced by device copies,
// over the backend_ops case matrix. tests/nccl runs the same with NCCL, one process per GPU.
// Skips without a GPU (bench/gpu/run.sh runs it on a GPU machine).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>

#include "backend_ops/cases.h"
#include "common/exchange_sim.h"
#include "common/parallel_matrix.h"
#include "cuda/backend/cuda_backend.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/exchange.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::string gpu_unavailable() {
  DeviceRuntime* rt = device_runtime(DeviceType::kCUDA);
  if (rt == nullptr || rt->device_count() == 0) return "no CUDA device is visible";
  AttentionConfig c;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_size = 128;
  c.scale = 0.1f;
  c.dtype = DType::kBF16;
  std::string why;
  for (const auto& r : default_registry().find("cuda")->check({c, Device::cuda(0)})) why += r;
  return why;
}

#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (const std::string why = gpu_unavailable(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

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

// ---- the merge_ranks kernel ----------------------------------------------------------------

// Partials [R, T, H, D] with empty ranks (LSE +-inf, NaN garbage in their rows), a row no rank
// has keys for (head 1, token 2) and a dominating rank.
void merge_inputs(int ranks, int64_t t, int64_t h, int64_t d, DType dtype, std::mt19937& rng,
                  Tensor& partials, Tensor& lses) {
  partials = random_host({ranks, t, h, d}, dtype, rng);
  lses = random_host({ranks, h, t}, DType::kF32, rng, 3.0f);
  auto* l = lses.data_as<float>();
  for (int64_t i = 3; i < ranks * h * t; i += 7) l[i] = (i % 2) ? kInf : -kInf;
  for (int r = 0; r < ranks; ++r) l[(r * h + 1) * t + 2] = -kInf;
  if (ranks > 1) l[(1 * h + 0) * t + 0] = 40.0f;
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

TEST(CudaMergeRanks, MatchesAFloat64ChainAndTheHostMerge) {
  REQUIRE_GPU();
  const Backend& cuda = *default_registry().find("cuda");
  const Backend& host = *default_registry().find("ref");  // Backend::merge_ranks' host default
  std::mt19937 rng(31);
  const Device dev = Device::cuda(0);
  for (int ranks : {1, 2, 3, 5, 8}) {
    for (DType in : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (DType out : {DType::kF32, DType::kF16, DType::kBF16}) {
        for (int64_t d : {128, 40, 37}) {  // vectorised; 40: vectorised, 5 chunks; 37: scalar
          const int64_t t = 9, h = 5;
          Tensor partials, lses;
          merge_inputs(ranks, t, h, d, in, rng, partials, lses);
          const auto [want, want_lse] = test::reference_merge_ranks(partials.view(), lses.view());
          const Tensor gp = Tensor::copy_of(partials.view(), dev), gl = Tensor::copy_of(lses, dev);
          Tensor go = Tensor::empty({t, h, d}, out, dev),
                 gol = Tensor::empty({h, t}, DType::kF32, dev);
          cuda.merge_ranks({gp.view(), gl.view(), go.view(), gol.view(), {}});
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const Tensor got = Tensor::copy_of(go.view(), Device::cpu());
          const Tensor got_lse = Tensor::copy_of(gol.view(), Device::cpu());
          const std::string what =
              detail::cat(ranks, " ranks ", dtype_name(in), " -> ", dtype_name(out), " d", d);
          const ErrorStats e = compare(got.view(), want.view());
          const double tol = out == DType::kF32 ? 2e-6 : out == DType::kF16 ? 1e-3 : 8e-3;
          EXPECT_EQ(e.mismatched_nonfinite, 0) << what << " " << e.to_string();
          EXPECT_LE(e.max_abs, tol * std::max(1.0, e.max_ref)) << what << " " << e.to_string();
          const ErrorStats el = compare(got_lse.view(), want_lse.view());
          EXPECT_EQ(el.mismatched_nonfinite, 0) << what << " " << el.to_string();
          EXPECT_LE(el.max_abs, 2e-6 * std::max(1.0, el.max_ref)) << what << " " << el.to_string();
          EXPECT_EQ(load_element(got.data(), out, (2 * h + 1) * d), 0.0) << what;
          EXPECT_EQ(got_lse.data_as<float>()[1 * t + 2], -kInf) << what;
          // The host merge does the same float math in the same order.
          Tensor ho = Tensor::empty({t, h, d}, out), hol = Tensor::empty({h, t}, DType::kF32);
          host.merge_ranks({partials.view(), lses.view(), ho.view(), hol.view(), {}});
          const ErrorStats eh = compare(got.view(), ho.view());
          EXPECT_LE(eh.max_abs, (out == DType::kF32 ? 1e-6 : tol) * std::max(1.0, eh.max_ref))
              << what << " vs host " << eh.to_string();
        }
      }
    }
  }
  // Strided views: partials as a slice of a wider buffer, the output a slice too (the buffers
  // built and read back whole: copy_tensor writes no strided device view).
  Tensor partials, lses;
  merge_inputs(3, 6, 4, 64, DType::kBF16, rng, partials, lses);
  const auto [want, want_lse] = test::reference_merge_ranks(partials.view(), lses.view());
  Tensor host_wide = Tensor::zeros({3, 6, 6, 64}, DType::kBF16);
  copy_tensor(host_wide.view().slice(2, 1, 5), partials.view());
  const Tensor wide = Tensor::copy_of(host_wide.view(), dev);
  Tensor out_wide = Tensor::zeros({6, 4, 72}, DType::kBF16, dev);
  const Tensor gl = Tensor::copy_of(lses.view(), dev);
  cuda.merge_ranks(
      {wide.view().slice(2, 1, 5), gl.view(), out_wide.view().slice(2, 8, 72), {}, {}});
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got_wide = Tensor::copy_of(out_wide.view(), Device::cpu());
  const ErrorStats e = compare(got_wide.view().slice(2, 8, 72), want.view());
  EXPECT_LE(e.max_abs, 8e-3 * std::max(1.0, e.max_ref)) << e.to_string();
}

// A whole DCP exchange end (the merge) and a TP exchange end (the column copies) captured in a
// CUDA graph and replayed give the eager bytes.
TEST(CudaMergeRanks, ExchangesReplayFromACudaGraph) {
  REQUIRE_GPU();
  const Backend& cuda = *default_registry().find("cuda");
  std::mt19937 rng(41);
  const Device dev = Device::cuda(0);
  const int world = 3;
  std::vector<Tensor> outs, lses;
  for (int r = 0; r < world; ++r) {
    outs.push_back(random_host({7, 4, 128}, DType::kBF16, rng));
    lses.push_back(random_host({4, 7}, DType::kF32, rng, 2.0f));
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto placement : {test::Placement::kInSlot, test::Placement::kStrided}) {
    std::vector<test::DcpRank> ranks;
    std::vector<test::TpRank> tp;
    std::vector<ExchangeGathers> gathers, tp_gathers;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(test::make_dcp_rank(r, world, outs[size_t(r)], lses[size_t(r)], DType::kBF16,
                                          placement, dev));
      ranks.back().args.stream = {stream};
      gathers.push_back(dcp_exchange_begin(ranks.back().args));
      tp.push_back(test::make_tp_rank(r, world, outs[size_t(r)], lses[size_t(r)], placement, dev));
      tp.back().args.stream = {stream};
      tp_gathers.push_back(tp_exchange_begin(tp.back().args));
    }
    test::simulate_all_gathers(gathers, dev, {stream});
    test::simulate_all_gathers(tp_gathers, dev, {stream});
    for (int r = 0; r < world; ++r) {
      dcp_exchange_end(cuda, ranks[size_t(r)].args);
      tp_exchange_end(tp[size_t(r)].args);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<Tensor> eager, eager_tp;
    // Garbage in every byte the replay must write, the ranks' own results put back.
    for (int r = 0; r < world; ++r) {
      eager.push_back(Tensor::copy_of(ranks[size_t(r)].args.output, Device::cpu()));
      eager_tp.push_back(Tensor::copy_of(tp[size_t(r)].args.output, Device::cpu()));
      test::reset_dcp_rank(ranks[size_t(r)], outs[size_t(r)], lses[size_t(r)]);
      test::reset_tp_rank(tp[size_t(r)], outs[size_t(r)], lses[size_t(r)]);
    }
    // The same all-gathers and ends, captured (in strided placement the begin's staging copies
    // too) and replayed.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int r = 0; r < world; ++r) {
      gathers[size_t(r)] = dcp_exchange_begin(ranks[size_t(r)].args);
      tp_gathers[size_t(r)] = tp_exchange_begin(tp[size_t(r)].args);
    }
    test::simulate_all_gathers(gathers, dev, {stream});
    test::simulate_all_gathers(tp_gathers, dev, {stream});
    for (int r = 0; r < world; ++r) {
      dcp_exchange_end(cuda, ranks[size_t(r)].args);
      tp_exchange_end(tp[size_t(r)].args);
    }
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(same_bytes(Tensor::copy_of(ranks[size_t(r)].args.output, Device::cpu()),
                             eager[size_t(r)]))
          << test::placement_name(placement) << " DCP rank " << r;
      EXPECT_TRUE(same_bytes(Tensor::copy_of(tp[size_t(r)].args.output, Device::cpu()),
                             eager_tp[size_t(r)]))
          << test::placement_name(placement) << " TP rank " << r;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

// ---- 2, 3 and 4 simulated ranks over the backend_ops matrix ---------------------------------

// Every case of the matrix (the same generator and inputs as backend_ops and the MPI test), TP
// and DCP on 2, 3 and 4 ranks of the cuda backend on one GPU: each rank its shard (TP) or
// share (DCP) of the step and cache, the exchange's begin and end on the device, the
// all-gathers by device copies, placements rotating over in-slot / contiguous / strided. Every
// rank's result must be the same bytes and pass the accuracy rule (DCP against its naive twin,
// tests/common/parallel_matrix.h); every rank's cache holds the reference's bytes for its part.
TEST(CudaParallel, SimulatedRanksOverTheMatrixMatchOneRank) {
  REQUIRE_GPU();
  const Backend& cuda = *default_registry().find("cuda");
  const Device dev = Device::cuda(0);
  const std::vector<backend_ops::OpCase> cases = backend_ops::make_case_matrix(20261202);
  int passed[2] = {0, 0}, refused[2] = {0, 0};
  std::map<std::string, int> refusals;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const backend_ops::OpCase& k = cases[ci];
    test::ParallelReference ref = test::make_parallel_reference(k);
    for (int world : {2, 3, 4}) {
      const auto placement = static_cast<test::Placement>((ci + size_t(world)) % 3);
      for (const bool is_tp : {true, false}) {
        if (!is_tp) test::add_dcp_naive(ref, k, world, k.config.dtype);
        const std::string what = detail::cat(is_tp ? "TP " : "DCP ", world, " ranks ",
                                             test::placement_name(placement), ": ", k.name);
        std::vector<test::RankShare> shares;
        for (int r = 0; r < world; ++r) {
          try {
            shares.push_back(
                is_tp ? test::tp_rank_share(cuda, k, ref, r, world, dev)
                      : test::dcp_rank_share(cuda, k, ref, r, world, dev, k.config.dtype));
          } catch (const NotSupported& e) {
            // A refusal raised by the forward's own checks (e.g. the latent kernel given a
            // separate value cache), as backend_ops counts it: unsupported, not a failure.
            shares.push_back({test::RankShare::kRefused, e.what(), {}, {}, 0, {}});
          } catch (const std::exception& e) {
            shares.push_back({test::RankShare::kError, e.what(), {}, {}, 0, {}});
          }
        }
        if (shares[0].status == test::RankShare::kRefused) {
          ++refused[is_tp ? 0 : 1];
          ++refusals[(is_tp ? "TP: " : "DCP: ") + shares[0].message];
          continue;
        }
        std::vector<Tensor> outs, lses;
        int64_t owned = 0;
        bool ready = true;
        for (const test::RankShare& s : shares) {
          EXPECT_EQ(s.status, test::RankShare::kReady) << what << ": " << s.message;
          EXPECT_EQ(s.cache_mismatch, "") << what;
          ready = ready && s.status == test::RankShare::kReady;
          outs.push_back(s.run.output);
          lses.push_back(s.run.lse);
          owned += s.owned_tokens;
        }
        if (!ready) continue;
        std::vector<std::pair<Tensor, Tensor>> got;
        try {
          got = is_tp
                    ? test::run_tp_exchange_sim(outs, lses, placement, dev)
                    : test::run_dcp_exchange_sim(cuda, outs, lses, k.config.dtype, placement, dev);
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << ": the exchange threw: " << e.what();
          continue;
        }
        if (!is_tp) {
          EXPECT_EQ(owned, ref.num_actual_tokens) << what << ": new tokens written";
        }
        std::string errors;
        const std::string why = test::check_parallel_rule(ref, k.config.dtype, got[0].first.view(),
                                                          got[0].second.view(), !is_tp, &errors);
        EXPECT_EQ(why, "") << what;
        for (int r = 1; r < world; ++r) {
          EXPECT_TRUE(same_bytes(got[size_t(r)].first, got[0].first) &&
                      same_bytes(got[size_t(r)].second, got[0].second))
              << what << ": rank " << r << " differs from rank 0";
        }
        passed[is_tp ? 0 : 1] += why.empty() ? 1 : 0;
      }
    }
  }
  std::printf(
      "simulated ranks over %zu cases x 3 world sizes: TP %d passed, %d refused; DCP %d "
      "passed, %d refused\n",
      cases.size(), passed[0], refused[0], passed[1], refused[1]);
  for (const auto& [why, n] : refusals) std::printf("  refused %d: %s\n", n, why.c_str());
  EXPECT_GT(passed[0], 0);
  EXPECT_GT(passed[1], 0);
}

}  // namespace
}  // namespace pagedattn
