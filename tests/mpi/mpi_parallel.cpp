// Tensor parallelism and decode context parallelism across processes (issue 9, CPU ranks), run
// by ctest under mpirun with 2 and 4 processes on loopback.
//
// 1. The backend_ops case matrix (tests/backend_ops/cases.cpp, the same generator and inputs):
//    every case is run sharded on each CPU backend, TP (each rank its heads, outputs gathered)
//    and DCP (each rank its share of the context, the step's new tokens written on their
//    owners, (output, LSE) merged in rank order), and the gathered result is held to the
//    project's accuracy rule against the float64 reference of the whole step
//    (docs/testing.md); each rank's cache after the write must hold the reference's bytes for
//    its heads (TP) or its tokens (DCP). Cases the sharding refuses are counted and listed with
//    the reason.
// 2. Several steps of prefill chunks and decodes through the Attention layer under DCP (the
//    cache carried from step to step), against the single-process layer.
// Each case is checked by one rank (case i by rank i % world), which alone computes its
// float64 and low-precision references, all of them before the first share runs so that the
// ranks compute references side by side; every rank writes its own copy of the reference's
// cache (write_kv alone) to check its share's bytes. Shares cross by
// MPI_Allgather inside the transport-independent exchange of pagedattn/exchange.h (the same
// layout, staging and rank-order merge the NCCL path runs on GPUs).
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backend_ops/cases.h"
#include "backend_ops/harness.h"
#include "common/parallel_matrix.h"
#include "common/parallel_scenarios.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/exchange.h"
#include "pagedattn/registry.h"

namespace {

using namespace pagedattn;
namespace bo = pagedattn::backend_ops;

int rank_ = 0, world_ = 1;
bool verbose_ = false;
// DCP partial outputs in the activation dtype (the layer's and the cuda backend's only choice)
// instead of float32 (which the CPU backends can write): --activation-partials, a measurement.
bool activation_partials_ = false;

// The exchange's all-gathers over MPI (in place where the rank's data already is its slot).
void mpi_all_gathers(const ExchangeGathers& gathers) {
  for (const GatherBuffer& g : gathers) {
    MPI_Allgather(g.in_place(rank_) ? MPI_IN_PLACE : g.send, int(g.bytes), MPI_BYTE, g.recv,
                  int(g.bytes), MPI_BYTE, MPI_COMM_WORLD);
  }
}

int all_max(int v) {
  int out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

using test::RankShare;

// Every rank's head columns put back in place: output [T, H, D], LSE [H, T].
void tp_gather(const bo::OpCase& k, const RankShare& s, Tensor& out, Tensor& lse) {
  const AttentionConfig& c = k.config;
  const TensorView mine = s.run.output.view();
  const int64_t t = mine.size(0);
  const int d = int(mine.size(2));  // head_size, or the case's narrower output
  out = Tensor::empty({t, c.num_heads, d}, c.dtype);
  lse = Tensor::empty({c.num_heads, t}, DType::kF32);
  const auto layout = TpExchangeLayout::of(world_, t, s.shard.num_heads, d, c.dtype);
  std::vector<uint8_t> ws(layout.bytes);
  const TpExchangeArgs args{
      rank_, world_, mine, s.run.lse.view(), out.view(), lse.view(), {ws.data(), ws.size()}, {}};
  mpi_all_gathers(tp_exchange_begin(args));
  tp_exchange_end(args);
}

// Every rank's (output, LSE) merged in rank order in float32 (Backend::merge_ranks), the result
// rounded once to `dtype` (as an engine hands it on). The ranks write float32 partial outputs
// unless --activation-partials: each partial rounded to bfloat16 adds about one rounding, up to
// 1.00 of the single-rank allowance at 2 ranks, hence the DCP budget of add_dcp_naive
// (docs/parallel.md, Precision).
void dcp_merge(const Backend& backend, const Tensor& partial, const Tensor& partial_lse,
               DType dtype, Tensor& out, Tensor& lse) {
  const TensorView mine = partial.view();
  out = Tensor::empty(mine.shape_vector(), dtype);
  lse = Tensor::empty(partial_lse.view().shape_vector(), DType::kF32);
  const auto layout =
      DcpExchangeLayout::of(world_, mine.size(0), int(mine.size(1)), int(mine.size(2)), mine.dtype);
  std::vector<uint8_t> ws(layout.bytes);
  const DcpExchangeArgs args{
      rank_, world_, mine, partial_lse.view(), out.view(), lse.view(), {ws.data(), ws.size()}, {}};
  mpi_all_gathers(dcp_exchange_begin(args));
  dcp_exchange_end(backend, args);
}

struct Tally {
  int passed = 0, failed = 0;
  std::map<std::string, std::vector<std::string>> refused;  // reason -> cases
};

// The reference runs of the cases this rank checks (case i by rank i % world): exact, naive and
// DCP's naive twin, their inputs dropped (make_parallel_inputs draws them again).
std::map<size_t, test::ParallelReference> own_references(const std::vector<bo::OpCase>& cases) {
  std::map<size_t, test::ParallelReference> refs;
  for (size_t i = size_t(rank_); i < cases.size(); i += size_t(world_)) {
    const bo::OpCase& k = cases[i];
    test::ParallelReference ref = test::make_parallel_reference(k);
    test::add_dcp_naive(ref, k, world_, activation_partials_ ? k.config.dtype : DType::kF32);
    ref.data = {};
    ref.cache0 = {};
    refs.emplace(i, std::move(ref));
  }
  return refs;
}

// Every case once (its references computed once, by its checker), then TP and DCP on each
// backend.
int matrix_checks(const std::vector<const Backend*>& backends,
                  const std::vector<bo::OpCase>& cases) {
  std::vector<std::pair<std::string, Tally>> tallies;  // "TP  cpu", "DCP cpu", ... in order
  for (const Backend* backend : backends) {
    for (const char* mode : {"TP ", "DCP"}) {
      tallies.push_back({std::string(mode) + " " + std::string(backend->name()), {}});
    }
  }
  int failures = 0;
  std::map<size_t, test::ParallelReference> references = own_references(cases);
  for (size_t case_index = 0; case_index < cases.size(); ++case_index) {
    const bo::OpCase& k = cases[case_index];
    const int checker = int(case_index % size_t(world_));
    test::ParallelReference ref = test::make_parallel_inputs(k);
    if (rank_ == checker) {
      test::ParallelReference& mine = references.at(case_index);
      ref.exact.output = std::move(mine.exact.output);
      ref.exact.lse = std::move(mine.exact.lse);
      ref.naive = std::move(mine.naive);
      ref.dcp_naive = std::move(mine.dcp_naive);
      references.erase(case_index);
    }
    const DType partial = activation_partials_ ? k.config.dtype : DType::kF32;
    size_t next_tally = 0;
    for (const Backend* backend : backends) {
      for (const bool is_tp : {true, false}) {
        auto& [label, tally] = tallies[next_tally++];
        RankShare s;
        try {
          s = is_tp ? test::tp_rank_share(*backend, k, ref, rank_, world_, Device::cpu())
                    : test::dcp_rank_share(*backend, k, ref, rank_, world_, Device::cpu(), partial);
        } catch (const std::exception& e) {
          s.status = RankShare::kError;
          s.message = e.what();
        }
        // Every rank takes the same branch, so that the collectives below stay matched.
        const int status = all_max(int(s.status));
        if (status == RankShare::kRefused) {
          if (rank_ == 0) {
            tally.refused[s.status == RankShare::kRefused ? s.message : "(another rank)"].push_back(
                k.name);
          }
          continue;
        }
        std::string why;
        if (status == RankShare::kError) {
          why = s.status == RankShare::kError ? "threw: " + s.message : "another rank threw";
        } else {
          Tensor out, lse;
          if (is_tp) {
            tp_gather(k, s, out, lse);
          } else {
            dcp_merge(*backend, s.run.output, s.run.lse, k.config.dtype, out, lse);
            // Every new token is written on exactly one rank (its owner).
            int64_t written = 0;
            MPI_Allreduce(&s.owned_tokens, &written, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
            if (written != ref.num_actual_tokens) {
              why += detail::cat(written, " new tokens written over the ranks; the step has ",
                                 ref.num_actual_tokens, "; ");
            }
          }
          std::string errors;
          if (rank_ == checker) {
            why += test::check_parallel_rule(ref, k.config.dtype, out.view(), lse.view(), !is_tp,
                                             &errors);
          }
          why += s.cache_mismatch;
          if (verbose_ && why.empty() && rank_ == checker) std::printf("    %s\n", errors.c_str());
        }
        const bool ok = all_max(why.empty() ? 0 : 1) == 0;
        (ok ? tally.passed : tally.failed) += 1;
        failures += !ok && rank_ == 0 ? 1 : 0;  // one count per case
        // The checker reports the gathered result; a rank reports its own cache or error.
        const bool own = s.status == RankShare::kError || !s.cache_mismatch.empty();
        if (!why.empty() && (rank_ == checker || own)) {
          std::printf("[rank %d/%d] FAIL %s %s: %s\n", rank_, world_, label.c_str(), k.name.c_str(),
                      why.c_str());
        } else if (ok && verbose_ && rank_ == 0) {
          std::printf("  ok   %s %s\n", label.c_str(), k.name.c_str());
        }
      }
    }
  }
  if (rank_ == 0) {
    for (const auto& [label, t] : tallies) {
      int refused = 0;
      for (const auto& [reason, names] : t.refused) refused += int(names.size());
      std::printf("%s over %zu backend_ops cases, %d ranks: %d passed, %d failed, %d refused\n",
                  label.c_str(), cases.size(), world_, t.passed, t.failed, refused);
      for (const auto& [reason, names] : t.refused) {
        std::printf("  refused %zu (%s):", names.size(), reason.c_str());
        for (const auto& n : names) std::printf("\n    %s", n.c_str());
        std::printf("\n");
      }
    }
  }
  return failures;
}

// ---- several steps of chunks and decodes through the layer ----

int layer_chunk_checks(const Backend& backend) {
  int failures = 0;
  for (const bool sinks : {false, true}) {
    const test::DcpChunkScenario s = test::make_dcp_chunk_scenario(sinks, sinks ? 52 : 51);
    const std::string name(backend.name());
    std::vector<Tensor> want, want_lse, mine, mine_lse;
    std::string error;
    try {
      test::run_dcp_chunks(s, name, nullptr, want, want_lse);
      const auto dcp = DecodeContextParallel::of(rank_, world_);
      test::run_dcp_chunks(s, name, &dcp, mine, mine_lse);
    } catch (const std::exception& e) {
      error = e.what();
      std::printf("[rank %d/%d] FAIL DCP layer %s sinks %d threw: %s\n", rank_, world_,
                  name.c_str(), int(sinks), e.what());
    }
    if (all_max(error.empty() ? 0 : 1) != 0) {  // no exchange unless every rank has its share
      failures += rank_ == 0 ? 1 : 0;
      continue;
    }
    for (size_t i = 0; i < want.size(); ++i) {
      Tensor merged, merged_lse;
      dcp_merge(backend, mine[i], mine_lse[i], DType::kF32, merged, merged_lse);
      const ErrorStats e = compare(merged.view(), want[i].view());
      const ErrorStats l = compare(merged_lse.view(), want_lse[i].view());
      // The same backend on the same inputs either way: only the summation order differs.
      const bool ok = e.mismatched_nonfinite == 0 && l.mismatched_nonfinite == 0 &&
                      e.max_abs <= 2e-6 * std::max(1.0, e.max_ref) &&
                      l.max_abs <= 2e-6 * std::max(1.0, l.max_ref);
      if (rank_ == 0 && (!ok || verbose_)) {  // every rank sees the same gathered result
        std::printf("[rank %d/%d] %s DCP layer %s sinks %d step %zu: out %s; lse %s\n", rank_,
                    world_, ok ? "ok  " : "FAIL", name.c_str(), int(sinks), i,
                    e.to_string().c_str(), l.to_string().c_str());
      }
      failures += !ok && rank_ == 0 ? 1 : 0;
    }
  }
  if (rank_ == 0) {
    std::printf("DCP layer %s: 2 scenarios x 4 steps of chunks and decodes, %d ranks\n",
                std::string(backend.name()).c_str(), world_);
  }
  return failures;
}

// FNV-1a: a split of the case names that does not follow the matrix's loop order.
uint32_t name_hash(const std::string& name) {
  uint32_t h = 2166136261u;
  for (const char c : name) h = (h ^ uint8_t(c)) * 16777619u;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  int share = 0, shares = 1;  // --share K/N: the cases whose name hashes to K modulo N
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    verbose_ = verbose_ || arg == "-v";
    activation_partials_ = activation_partials_ || arg == "--activation-partials";
    if (arg == "--share" && i + 1 < argc && std::sscanf(argv[++i], "%d/%d", &share, &shares) != 2) {
      shares = 0;
    }
  }
  if (shares < 1 || share < 0 || share >= shares) {
    if (rank_ == 0) std::printf("mpi_parallel: --share takes K/N with 0 <= K < N\n");
    MPI_Finalize();
    return 2;
  }
  int failures = 0;
  // The two ctest runs (2 and 4 ranks) split the matrix by a hash of each case's name, so that
  // together they run every case once and each sees every feature of the matrix in a random
  // half of its cases, at half the time of running it all twice.
  std::vector<bo::OpCase> cases;
  for (bo::OpCase& k : bo::make_case_matrix(20261202)) {
    if (name_hash(k.name) % uint32_t(shares) == uint32_t(share)) cases.push_back(std::move(k));
  }
  std::vector<const Backend*> backends;
  for (const Backend* backend : default_registry().backends()) {
    // The CPU backends: those that run the matrix's first (plain) case on the CPU.
    if (backend->check({cases.front().config, Device::cpu()}).empty()) backends.push_back(backend);
  }
  for (const Backend* backend : backends) failures += layer_chunk_checks(*backend);
  failures += matrix_checks(backends, cases);
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank_ == 0) std::printf("mpi_parallel: %d ranks, %d failures\n", world_, total);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
