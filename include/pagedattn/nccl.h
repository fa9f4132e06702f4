// The GPU exchanges of tensor and decode context parallelism over an engine's NCCL
// communicator, one process per GPU: pagedattn/exchange.h with NCCL all-gathers as the
// transport. Built as the library pagedattn_nccl when CMake finds NCCL (docs/parallel.md,
// "Building with NCCL"); this header needs neither NCCL's nor CUDA's headers.
//
//   nccl::dcp_exchange(comm, *default_registry().find("cuda"), args);   // every rank
//
// Each call checks its arguments, enqueues the all-gathers as one NCCL group and the merge or
// column copies on args.stream, and returns without waiting: it allocates nothing and never
// synchronises the host, so a step's exchanges can be captured in a CUDA graph with its
// attention. Every rank of the communicator must make the same calls in the same order with
// the same T, H, D and dtypes (NCCL collectives).
#pragma once

#include "pagedattn/backend.h"
#include "pagedattn/exchange.h"

struct ncclComm;  // NCCL's communicator: ncclComm_t is ncclComm*

namespace pagedattn::nccl {

/// Throws InvalidArgument unless `comm` has `world` ranks, this process is its rank `rank` and
/// its GPU is `device` (ncclCommCount, ncclCommUserRank, ncclCommCuDevice).
void check_comm(ncclComm* comm, int rank, int world, Device device);

/// DCP: dcp_exchange_begin, the partial outputs' and LSEs' all-gathers over `comm` (one NCCL
/// group on args.stream), then dcp_exchange_end with backend.merge_ranks (the cuda backend's
/// kernel: float32 merge in rank order, rounded once). Every rank ends with the same bytes:
/// the single-rank output (and LSE when args.output_lse is given).
void dcp_exchange(ncclComm* comm, const Backend& backend, const DcpExchangeArgs& args);

/// TP: tp_exchange_begin, the ranks' output columns (and LSE rows) all-gathered over `comm`,
/// then tp_exchange_end: every rank ends with the whole [T, H, D] output (and [H, T] LSE).
void tp_exchange(ncclComm* comm, const TpExchangeArgs& args);

/// The version of the NCCL library this process loaded (ncclGetVersion; 23203 is 2.32.3).
int version();

}  // namespace pagedattn::nccl
