// The exchanges of tensor- and decode-context-parallel results between ranks, apart from the
// transport: what each rank all-gathers (GatherBuffer), where it lands in a caller-provided
// workspace (the layouts), and the device work before and after the all-gathers (copying a
// strided result into its slot, the rank-order merge, the column assembly). Each exchange is
// two calls around the caller's all-gathers:
//
//   gathers = dcp_exchange_begin(args);          // checks; stages a strided partial
//   for (g : gathers) all_gather(g.send, g.recv, g.bytes);   // NCCL, MPI, device copies
//   dcp_exchange_end(backend, args);             // merge in rank order -> args.output
//
// pagedattn_nccl (pagedattn/nccl.h) runs them over an engine's NCCL communicator; the MPI test
// over MPI_Allgather; the single-GPU test over device copies. Everything is ordered on the
// caller's stream and allocates nothing, so a whole exchange can be captured in a CUDA graph.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "pagedattn/backend.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// One all-gather of an exchange: every rank's `bytes` at `send` into `recv`, rank r's at
/// recv + r * bytes (world * bytes in all). send == recv + rank * bytes when the rank's data
/// already sits in its slot: an in-place all-gather (NCCL takes it as such; MPI callers pass
/// MPI_IN_PLACE). Otherwise send does not overlap recv.
struct GatherBuffer {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;  ///< per rank; 0 when the step has no tokens (every rank alike)
  bool in_place(int rank) const {
    return send == static_cast<const char*>(recv) + size_t(rank) * bytes;
  }
};

/// The all-gathers of one exchange, in the order every rank must run them (a fixed array:
/// nothing is allocated).
struct ExchangeGathers {
  std::array<GatherBuffer, 2> buffers{};
  int count = 0;
  const GatherBuffer* begin() const { return buffers.data(); }
  const GatherBuffer* end() const { return buffers.data() + count; }
};

// ---- decode context parallelism: every rank's partial result, merged by LSE ----------------

/// Where a DCP exchange gathers the ranks' partial results in its workspace:
///   outputs  [world, num_tokens, num_heads, head_size] of partial_dtype, at byte 0
///   lses     float32 [world, num_heads, num_tokens], at lses_offset (a multiple of 256)
/// Rank r's slots are outputs[r] and lses[r]. A rank that runs its forward straight into its
/// slots (output_slot, lse_slot) exchanges in place, with no staging copy.
struct DcpExchangeLayout {
  int world = 1;
  int64_t num_tokens = 0;
  int num_heads = 0, head_size = 0;
  DType partial_dtype = DType::kF32;
  size_t lses_offset = 0;  ///< bytes from the workspace's start
  size_t bytes = 0;        ///< the workspace size the exchange needs
  /// Throws InvalidArgument naming the bound: world >= 1, num_tokens >= 0, num_heads >= 1,
  /// head_size >= 1, partial_dtype float32, float16 or bfloat16.
  static DcpExchangeLayout of(int world, int64_t num_tokens, int num_heads, int head_size,
                              DType partial_dtype);
  TensorView outputs(void* workspace, Device device) const;  ///< [world, T, H, D]
  TensorView lses(void* workspace, Device device) const;     ///< float32 [world, H, T]
  TensorView output_slot(void* workspace, int rank, Device device) const;  ///< [T, H, D]
  TensorView lse_slot(void* workspace, int rank, Device device) const;     ///< float32 [H, T]
};

/// One rank's side of a DCP exchange (docs/parallel.md): its partial result over its share of
/// the keys in; the rank-order merge of every rank's, which is the single-rank result, out.
/// Every tensor and the workspace are on output's device; the step's T is the same on all ranks.
struct DcpExchangeArgs {
  int rank = 0, world = 1;
  /// [T, H, D] float32/float16/bfloat16, each row's H * D elements contiguous (any row
  /// stride); empty rows already cleared (dcp_clear_empty_rows).
  TensorView partial_output;
  TensorView partial_lse;  ///< float32 [H, T], each head's T contiguous (any head stride)
  /// [T, H, D] float32/float16/bfloat16 (any of them: the merge is float32, rounded once),
  /// contiguous in head_size. May be partial_output itself: the merge reads the workspace only.
  TensorView output;
  TensorView output_lse;  ///< optional float32 [H, T]: the merged LSE
  /// DcpExchangeLayout::of(world, T, H, D, partial_output.dtype).bytes or more; must not
  /// overlap output or output_lse.
  Workspace workspace;
  Stream stream;
};

/// Step 1 of a DCP exchange, on every rank: checks the arguments (InvalidArgument naming the
/// argument and bound), copies a partial output or LSE whose rows are not contiguous into the
/// rank's slots (ordered on args.stream), and returns the two all-gathers to run on
/// args.stream, outputs then LSEs, into the layout's outputs and lses.
ExchangeGathers dcp_exchange_begin(const DcpExchangeArgs& args);

/// Step 3, after the all-gathers have been enqueued on args.stream: merges the gathered
/// results in rank order (backend.merge_ranks: float32, rounded once) into args.output and
/// args.output_lse on args.stream. Every rank computes the same bytes.
void dcp_exchange_end(const Backend& backend, const DcpExchangeArgs& args);

// ---- tensor parallelism: every rank's query-head columns, put side by side ------------------

/// Where a TP exchange gathers the ranks' outputs in its workspace: [world, num_tokens,
/// heads_per_rank, head_size] of dtype at byte 0 (rank r's slot is [r]). LSEs need no
/// workspace: rank-major [world, heads_per_rank, T] is the [H, T] LSE itself.
struct TpExchangeLayout {
  int world = 1;
  int64_t num_tokens = 0;
  int heads_per_rank = 0, head_size = 0;
  DType dtype = DType::kF32;
  size_t bytes = 0;
  /// Throws InvalidArgument naming the bound (as DcpExchangeLayout::of; any dtype).
  static TpExchangeLayout of(int world, int64_t num_tokens, int heads_per_rank, int head_size,
                             DType dtype);
  TensorView outputs(void* workspace, Device device) const;                ///< [world, T, Hr, D]
  TensorView output_slot(void* workspace, int rank, Device device) const;  ///< [T, Hr, D]
};

/// One rank's side of a TP exchange: its query heads' output in, every rank's columns out.
/// Query heads are rank-major (TensorParallelShard): rank r holds heads [r * Hr, (r + 1) * Hr).
struct TpExchangeArgs {
  int rank = 0, world = 1;
  /// [T, Hr, D], each row's Hr * D elements contiguous (any row stride): e.g. shard_query of
  /// the [T, H, D] output, which the exchange then fills around it.
  TensorView rank_output;
  TensorView rank_lse;  ///< optional float32 [Hr, T] contiguous (e.g. rows of `lse`)
  /// [T, H = world * Hr, D] of rank_output's dtype, each row's H * D elements contiguous.
  TensorView output;
  /// float32 [H, T] contiguous; required with rank_lse. Gathered into directly (in place when
  /// rank_lse is its rows of this rank).
  TensorView lse;
  Workspace workspace;  ///< TpExchangeLayout::of(world, T, Hr, D, dtype).bytes or more
  Stream stream;
};

/// Step 1 of a TP exchange: checks the arguments, copies a strided rank_output into the rank's
/// slot (ordered on args.stream), and returns the all-gathers: outputs into the layout's
/// outputs, then (with rank_lse) LSEs straight into args.lse.
ExchangeGathers tp_exchange_begin(const TpExchangeArgs& args);

/// Step 3, after the all-gathers: copies every rank's slot into its columns of args.output
/// (one 2-D copy per rank on args.stream; none for this rank when rank_output is already its
/// columns of output).
void tp_exchange_end(const TpExchangeArgs& args);

}  // namespace pagedattn
