// Tensor parallelism and decode context parallelism across GPUs (issue 9, GPU ranks): one
// process per GPU, world = min(visible GPUs, --world), exchanging with NCCL through
// pagedattn_nccl (pagedattn/nccl.h). With one GPU it runs world 1 through the same NCCL calls.
//
//   pagedattn_nccl_tests [--world N] [--filter TEXT] [-v] [--timeout SECONDS]
//
// Every case of the backend_ops matrix (the same generator and inputs as backend_ops and the MPI
// test) is run sharded on the cuda backend, TP (each rank its heads) and DCP (each rank its
// share of the context, the new tokens written on their owners), exchanged by
// nccl::tp_exchange / nccl::dcp_exchange with the ranks' results placed in their workspace
// slots, in tensors of their own or in strided views (rotating per case), and each rank's
// exchanged result is held to the accuracy rule of docs/testing.md (DCP against its naive twin,
// tests/common/parallel_matrix.h). Every rank must hold the same bytes; every rank's cache holds
// the reference's bytes for its heads or new tokens; and the exchange captured in a CUDA graph
// and replayed must write the eager bytes again. The ranks are forked by this program (no MPI
// needed; tests/common/fork_ranks.h). Exit status: 0 all passed, 1 failures, 77 no GPU.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "backend_ops/cases.h"
#include "common/exchange_sim.h"
#include "common/fork_ranks.h"
#include "common/parallel_matrix.h"
#include "pagedattn/error.h"
#include "pagedattn/exchange.h"
#include "pagedattn/nccl.h"
#include "pagedattn/registry.h"

namespace {

using namespace pagedattn;
namespace bo = pagedattn::backend_ops;

#define NCCL_TEST_CHECK(call)                                                               \
  do {                                                                                      \
    const ncclResult_t r_ = (call);                                                         \
    if (r_ != ncclSuccess) detail::fail<Error>(#call, " failed: ", ncclGetErrorString(r_)); \
  } while (0)
#define CUDA_TEST_CHECK(call)                                                               \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) detail::fail<Error>(#call, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

struct Options {
  int world = 8;
  std::string filter;
  bool verbose = false;
  int timeout_s = 540;
};

// One rank: its communicator, stream and a device word for small reductions.
struct Rank {
  int rank = 0, world = 1;
  Device device;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int64_t* word = nullptr;

  int64_t all_reduce(int64_t v, ncclRedOp_t op) const {
    CUDA_TEST_CHECK(cudaMemcpyAsync(word, &v, sizeof v, cudaMemcpyHostToDevice, stream));
    NCCL_TEST_CHECK(ncclAllReduce(word, word, 1, ncclInt64, op, comm, stream));
    CUDA_TEST_CHECK(cudaMemcpyAsync(&v, word, sizeof v, cudaMemcpyDeviceToHost, stream));
    CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    return v;
  }
  bool all_equal(int64_t v) const { return all_reduce(v, ncclMax) == all_reduce(v, ncclMin); }
};

uint64_t fnv1a(const Tensor& t, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(t.data());
  for (size_t i = 0; i < t.view().nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.data(), b.data(), a.view().nbytes()) == 0;
}

// The exchange of one share: eagerly, then captured in a CUDA graph and replayed over garbage.
// Host copies of the exchanged output and LSE; `why` gets what went wrong on this rank.
void exchange(const Rank& rk, const Backend& cuda, const bo::OpCase& k, const test::RankShare& s,
              bool is_tp, test::Placement placement, Tensor& out, Tensor& lse, std::string& why) {
  test::DcpRank d;
  test::TpRank t;
  auto run = [&] {
    if (is_tp) {
      nccl::tp_exchange(rk.comm, t.args);
    } else {
      nccl::dcp_exchange(rk.comm, cuda, d.args);
    }
  };
  auto result = [&] {
    return is_tp ? std::pair{Tensor::copy_of(t.args.output, Device::cpu()),
                             Tensor::copy_of(t.args.lse, Device::cpu())}
                 : std::pair{Tensor::copy_of(d.args.output, Device::cpu()),
                             Tensor::copy_of(d.args.output_lse, Device::cpu())};
  };
  if (is_tp) {
    t = test::make_tp_rank(rk.rank, rk.world, s.run.output, s.run.lse, placement, rk.device);
    t.args.stream = {rk.stream};
  } else {
    d = test::make_dcp_rank(rk.rank, rk.world, s.run.output, s.run.lse, k.config.dtype, placement,
                            rk.device);
    d.args.stream = {rk.stream};
  }
  run();
  CUDA_TEST_CHECK(cudaStreamSynchronize(rk.stream));
  std::tie(out, lse) = result();
  if (is_tp) {
    test::reset_tp_rank(t, s.run.output, s.run.lse);
  } else {
    test::reset_dcp_rank(d, s.run.output, s.run.lse);
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_TEST_CHECK(cudaStreamBeginCapture(rk.stream, cudaStreamCaptureModeThreadLocal));
  try {
    run();
  } catch (...) {
    cudaStreamEndCapture(rk.stream, &graph);
    throw;
  }
  CUDA_TEST_CHECK(cudaStreamEndCapture(rk.stream, &graph));
  CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_TEST_CHECK(cudaGraphLaunch(exec, rk.stream));
  CUDA_TEST_CHECK(cudaStreamSynchronize(rk.stream));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  const auto [replay, replay_lse] = result();
  if (!same_bytes(replay, out) || !same_bytes(replay_lse, lse)) {
    why += "the exchange replayed from a CUDA graph differs from the eager one; ";
  }
}

struct Tally {
  int passed = 0, failed = 0;
  std::map<std::string, std::vector<std::string>> refused;  // reason -> cases
};

int matrix_checks(const Rank& rk, const Options& o) {
  const Backend& cuda = *default_registry().find("cuda");
  std::vector<bo::OpCase> cases;
  for (auto& k : bo::make_case_matrix(20261202)) {
    if (o.filter.empty() || k.name.find(o.filter) != std::string::npos) cases.push_back(k);
  }
  Tally tallies[2];  // TP, DCP
  int failures = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const bo::OpCase& k = cases[ci];
    test::ParallelReference ref = test::make_parallel_reference(k);
    test::add_dcp_naive(ref, k, rk.world, k.config.dtype);
    const auto placement = static_cast<test::Placement>((ci + size_t(rk.world)) % 3);
    for (const bool is_tp : {true, false}) {
      Tally& tally = tallies[is_tp ? 0 : 1];
      const char* label = is_tp ? "TP " : "DCP";
      test::RankShare s;
      try {
        s = is_tp
                ? test::tp_rank_share(cuda, k, ref, rk.rank, rk.world, rk.device)
                : test::dcp_rank_share(cuda, k, ref, rk.rank, rk.world, rk.device, k.config.dtype);
      } catch (const std::exception& e) {
        s.status = test::RankShare::kError;
        s.message = e.what();
      }
      // Every rank takes the same branch, so that the collectives below stay matched.
      const int64_t status = rk.all_reduce(int64_t(s.status), ncclMax);
      if (status == test::RankShare::kRefused) {
        if (rk.rank == 0) {
          tally.refused[s.status == test::RankShare::kRefused ? s.message : "(another rank)"]
              .push_back(k.name);
        }
        continue;
      }
      std::string why;
      if (status == test::RankShare::kError) {
        why = s.status == test::RankShare::kError ? "threw: " + s.message : "another rank threw";
      } else {
        Tensor out, lse;
        try {
          exchange(rk, cuda, k, s, is_tp, placement, out, lse, why);
        } catch (const std::exception& e) {
          why += detail::cat("the exchange threw: ", e.what(), "; ");
        }
        // A rank whose exchange threw has no result; the others' go on to the same reductions.
        const bool have = out.defined();
        if (!have) {
          out = Tensor::zeros({1}, DType::kF32);
          lse = Tensor::zeros({1}, DType::kF32);
        }
        if (!is_tp) {
          const int64_t written = rk.all_reduce(s.owned_tokens, ncclSum);
          if (written != ref.num_actual_tokens) {
            why += detail::cat(written, " new tokens written over the ranks; the step has ",
                               ref.num_actual_tokens, "; ");
          }
        }
        if (!rk.all_equal(int64_t(fnv1a(lse, fnv1a(out))))) {
          why += "the ranks' exchanged results differ; ";
        }
        std::string errors;
        if (have) {
          why += test::check_parallel_rule(ref, k.config.dtype, out.view(), lse.view(), !is_tp,
                                           &errors);
        }
        why += s.cache_mismatch;
        if (o.verbose && why.empty() && rk.rank == 0) {
          std::printf("  ok   %s %s (%s)\n    %s\n", label, k.name.c_str(),
                      test::placement_name(placement), errors.c_str());
        }
      }
      const bool ok = rk.all_reduce(why.empty() ? 0 : 1, ncclMax) == 0;
      (ok ? tally.passed : tally.failed) += 1;
      failures += ok ? 0 : 1;
      if (!why.empty()) {
        std::printf("[rank %d/%d] FAIL %s %s (%s): %s\n", rk.rank, rk.world, label, k.name.c_str(),
                    test::placement_name(placement), why.c_str());
      }
    }
  }
  if (rk.rank == 0) {
    for (int i = 0; i < 2; ++i) {
      const Tally& t = tallies[i];
      int refused = 0;
      for (const auto& [reason, names] : t.refused) refused += int(names.size());
      std::printf(
          "%s cuda over %zu backend_ops cases, %d GPUs (NCCL): %d passed, %d failed, %d "
          "refused\n",
          i == 0 ? "TP " : "DCP", cases.size(), rk.world, t.passed, t.failed, refused);
      for (const auto& [reason, names] : t.refused) {
        std::printf("  refused %zu (%s):", names.size(), reason.c_str());
        for (const auto& n : names) std::printf("\n    %s", n.c_str());
        std::printf("\n");
      }
    }
  }
  return failures;
}

int rank_main(int rank, int world, const std::string& id_bytes, const Options& o) {
  Rank rk;
  rk.rank = rank;
  rk.world = world;
  rk.device = Device::cuda(rank);
  CUDA_TEST_CHECK(cudaSetDevice(rank));
  ncclUniqueId id;
  static_assert(sizeof id == test::kRankIdBytes);
  std::memcpy(&id, id_bytes.data(), sizeof id);
  NCCL_TEST_CHECK(ncclCommInitRank(&rk.comm, world, id, rank));
  CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&rk.stream, cudaStreamNonBlocking));
  CUDA_TEST_CHECK(cudaMalloc(&rk.word, sizeof(int64_t)));
  if (rank == 0) {
    cudaDeviceProp prop{};
    CUDA_TEST_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("nccl_parallel: NCCL %d, %d rank(s), one per GPU (%s)\n", nccl::version(), world,
                prop.name);
  }
  const int failures = matrix_checks(rk, o);
  CUDA_TEST_CHECK(cudaFree(rk.word));
  CUDA_TEST_CHECK(cudaStreamDestroy(rk.stream));
  NCCL_TEST_CHECK(ncclCommDestroy(rk.comm));
  if (rank == 0) std::printf("nccl_parallel: %d GPUs, %d failures\n", world, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--world" && i + 1 < argc) {
      o.world = std::atoi(argv[++i]);
    } else if (a == "--filter" && i + 1 < argc) {
      o.filter = argv[++i];
    } else if (a == "--timeout" && i + 1 < argc) {
      o.timeout_s = std::atoi(argv[++i]);
    } else if (a == "-v") {
      o.verbose = true;
    } else {
      std::fprintf(stderr,
                   "usage: pagedattn_nccl_tests [--world N] [--filter TEXT] [-v] [--timeout S]\n");
      return 2;
    }
  }
  const int gpus = test::count_devices_in_child([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  if (gpus <= 0) {
    std::printf("nccl_parallel: skipped: no CUDA device is visible\n");
    return 77;
  }
  const int world = std::max(1, std::min(gpus, o.world));
  std::printf("nccl_parallel: %d visible GPU(s), world %d (asked %d)\n", gpus, world, o.world);
  return test::fork_ranks(
      world, o.timeout_s, 30,
      [] {
        ncclUniqueId id;
        NCCL_TEST_CHECK(ncclGetUniqueId(&id));
        return std::string(reinterpret_cast<const char*>(&id), sizeof id);
      },
      [&o](int rank, int world_size, const std::string& id) {
        return rank_main(rank, world_size, id, o);
      });
}
