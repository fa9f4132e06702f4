// One rank's share of a backend_ops case under tensor parallelism (its heads) or decode
// context parallelism (its tokens), and the references its gathered result is held to: shared
// by the MPI test (CPU ranks), the NCCL test (one process per GPU) and the single-GPU test of
// simulated ranks (tests/cuda/test_cuda_parallel.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend_ops/cases.h"
#include "backend_ops/harness.h"
#include "pagedattn/backend.h"
#include "pagedattn/parallel.h"

namespace pagedattn::test {

/// The references of one case: its inputs, the pre-step cache and the float64 and naive
/// low-precision results of the whole step (every rank computes them itself).
struct ParallelReference {
  backend_ops::CaseData data;
  Tensor cache0;                  ///< the pre-step cache (storage), host
  backend_ops::RunOutputs exact;  ///< float64
  backend_ops::RunOutputs naive;  ///< the same algorithm in low precision: sets the budget
  /// DCP's naive twin (add_dcp_naive): the ranks' shares by the low-precision reference, their
  /// partials in the exchanged dtype, merged in rank order and rounded once. Budget of DCP.
  backend_ops::RunOutputs dcp_naive;
  int64_t num_actual_tokens = 0;
};

ParallelReference make_parallel_reference(const backend_ops::OpCase& k);

/// The case's inputs and the cache after the step as the float64 reference writes it (its
/// write_kv alone, no attention): what a rank needs to run and check its share. exact.output,
/// naive and dcp_naive stay empty; make_parallel_reference is this plus the two reference runs.
ParallelReference make_parallel_inputs(const backend_ops::OpCase& k);

/// Fills ref.dcp_naive for `world` ranks whose partial outputs are `partial_dtype`: the naive
/// low-precision run of the DCP algorithm (each rank's share by the low-precision reference,
/// merged in float64 in rank order, rounded once to the activation dtype). A DCP result is held
/// to it, as docs/testing.md holds every result to "the same naive algorithm in the same low
/// precision": partials rounded to bfloat16 add a rounding that a single-rank run does not have
/// (docs/parallel.md, Precision). Nothing when the case is not DCP-able.
void add_dcp_naive(ParallelReference& ref, const backend_ops::OpCase& k, int world,
                   DType partial_dtype);

/// The accuracy rule (docs/testing.md) on rows [0, T_a) of a gathered output [T, H, D] and LSE
/// [H, T] (host tensors), against ref.naive (TP) or ref.dcp_naive (`dcp`): empty when both
/// pass, else why. `errors` (optional) gets the errors, their allowances and, for DCP, the
/// output error's share of the single-rank allowance (ref.naive's), in one line.
std::string check_parallel_rule(const ParallelReference& ref, DType dtype, const TensorView& out,
                                const TensorView& lse, bool dcp, std::string* errors = nullptr);

/// One rank's share of a case, ready to exchange, or why there is none.
struct RankShare {
  enum Status { kReady = 0, kRefused = 1, kError = 2 } status = kReady;
  std::string message;          ///< refusal reasons or the error
  backend_ops::RunOutputs run;  ///< host: output [T, H_rank, D] (TP) or [T, H, D] (DCP), LSE
  std::string cache_mismatch;   ///< non-empty: this rank's cache differs from the reference's
  int64_t owned_tokens = 0;     ///< DCP: the step's new tokens written on this rank
  TensorParallelShard shard;    ///< TP: the rank's heads
};

/// TP: the rank's query and KV heads of the case on `backend` at `device` (inputs, cache and
/// configuration sliced), its output and LSE in the activation dtype / float32, and its cache
/// after the write compared with the reference's bytes for its KV heads.
RankShare tp_rank_share(const Backend& backend, const backend_ops::OpCase& k,
                        const ParallelReference& ref, int rank, int world, Device device);

/// DCP: the rank's tokens of every request (the context copied from the reference's pre-step
/// cache into local blocks of a shuffled pool, everything else garbage), the step run with
/// dcp_step_metadata into a `partial_dtype` output, empty rows cleared; its cache after the
/// write must hold the reference's bytes for the new tokens it owns.
RankShare dcp_rank_share(const Backend& backend, const backend_ops::OpCase& k,
                         const ParallelReference& ref, int rank, int world, Device device,
                         DType partial_dtype);

std::string join_reasons(const std::vector<std::string>& parts);

}  // namespace pagedattn::test
