// Tensor parallelism and decode context parallelism across processes (issue 9, CPU ranks):
// every rank computes its share on the cpu backend, the shares cross by MPI_Allgather, and
// every rank checks the gathered result against the single-process result it computes itself.
// Run by ctest under mpirun with 2 and 4 processes on loopback.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/parallel_scenarios.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/registry.h"

namespace {

using namespace pagedattn;

int rank_ = 0, world_ = 1;

bool report(bool ok, const std::string& what, const ErrorStats& e) {
  if (!ok || rank_ == 0) {
    std::printf("[rank %d/%d] %s %s: %s\n", rank_, world_, ok ? "ok  " : "FAIL", what.c_str(),
                e.to_string().c_str());
  }
  return ok;
}

// All ranks' float buffers of `count` each, in rank order.
std::vector<float> allgather(const float* mine, int64_t count) {
  std::vector<float> all(size_t(count) * size_t(world_));
  MPI_Allgather(mine, int(count), MPI_FLOAT, all.data(), int(count), MPI_FLOAT, MPI_COMM_WORLD);
  return all;
}

int tp_checks(const Backend& backend) {
  struct Shape {
    int hq, hk;
    bool alibi, sinks;
  };
  int failures = 0;
  uint32_t seed = 100;
  for (const Shape sh : {Shape{8, 8, false, false}, Shape{8, 2, true, false},
                         Shape{16, 1, false, true}, Shape{32, 8, false, false}}) {
    const test::TpScenario s = test::make_tp_scenario(sh.hq, sh.hk, sh.alibi, sh.sinks, seed++);
    if (sh.hq % world_ != 0 || (sh.hk % world_ != 0 && world_ % sh.hk != 0)) continue;
    std::vector<Tensor> want, mine;
    test::run_tp(s, std::string(backend.name()), nullptr, want);
    const auto shard = TensorParallelShard::of(sh.hq, sh.hk, rank_, world_);
    test::run_tp(s, std::string(backend.name()), &shard, mine);
    const int d = s.options.head_size;
    for (size_t i = 0; i < want.size(); ++i) {
      // This rank's columns, packed, then every rank's into place.
      const int64_t t = want[i].view().size(0), cols = int64_t(shard.num_heads) * d;
      std::vector<float> packed(size_t(t * cols));
      const float* src = static_cast<const float*>(mine[i].data());
      for (int64_t row = 0; row < t; ++row) {
        for (int64_t c = 0; c < cols; ++c) {
          packed[size_t(row * cols + c)] =
              src[row * int64_t(sh.hq) * d + int64_t(shard.head_begin) * d + c];
        }
      }
      const std::vector<float> all = allgather(packed.data(), t * cols);
      Tensor gathered = Tensor::empty(want[i].view().shape_vector(), DType::kF32);
      float* g = static_cast<float*>(gathered.data());
      for (int r = 0; r < world_; ++r) {
        for (int64_t row = 0; row < t; ++row) {
          for (int64_t c = 0; c < cols; ++c) {
            g[row * int64_t(sh.hq) * d + int64_t(r) * cols + c] =
                all[size_t(r) * size_t(t * cols) + size_t(row * cols + c)];
          }
        }
      }
      const ErrorStats e = compare(gathered.view(), want[i].view());
      const bool ok = e.mismatched_nonfinite == 0 && e.max_abs <= 1e-6 * std::max(1.0, e.max_ref);
      char what[128];
      std::snprintf(what, sizeof what, "TP hq %d hk %d step %zu", sh.hq, sh.hk, i);
      failures += report(ok, what, e) ? 0 : 1;
    }
  }
  return failures;
}

int dcp_checks(const Backend& backend) {
  int failures = 0;
  for (uint32_t seed : {31u, 32u}) {
    const test::DcpScenario s = test::make_dcp_scenario(seed);
    Tensor want, want_lse, out, lse;
    test::run_dcp(s, backend, nullptr, want, want_lse);
    const auto dcp = DecodeContextParallel::of(rank_, world_);
    test::run_dcp(s, backend, &dcp, out, lse);
    const int64_t n_out = out.view().numel(), n_lse = lse.view().numel();
    const std::vector<float> all_out = allgather(static_cast<const float*>(out.data()), n_out);
    const std::vector<float> all_lse = allgather(static_cast<const float*>(lse.data()), n_lse);
    std::vector<Tensor> outs, lses;
    for (int r = 0; r < world_; ++r) {
      outs.push_back(Tensor::empty(out.view().shape_vector(), DType::kF32));
      lses.push_back(Tensor::empty(lse.view().shape_vector(), DType::kF32));
      std::copy_n(all_out.data() + size_t(r) * size_t(n_out), n_out,
                  static_cast<float*>(outs.back().data()));
      std::copy_n(all_lse.data() + size_t(r) * size_t(n_lse), n_lse,
                  static_cast<float*>(lses.back().data()));
    }
    const Tensor merged = test::merge_ranks(backend, outs, lses);
    const ErrorStats e = compare(merged.view(), want.view());
    const bool ok = e.mismatched_nonfinite == 0 && e.max_abs <= 2e-6 * std::max(1.0, e.max_ref);
    failures += report(ok, "DCP decode seed " + std::to_string(seed), e) ? 0 : 1;
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  int failures = 0;
  try {
    const Backend* backend = default_registry().find("cpu");
    if (backend == nullptr) backend = default_registry().find("ref");
    failures += tp_checks(*backend);
    failures += dcp_checks(*backend);
  } catch (const std::exception& e) {
    std::printf("[rank %d/%d] error: %s\n", rank_, world_, e.what());
    failures += 1;
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank_ == 0) std::printf("mpi_parallel: %d ranks, %d failures\n", world_, total);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
