// The exchanges of pagedattn/exchange.h between ranks simulated in one process: each rank has
// its own tensors and workspace, and the transport is replaced by copies on the ranks' device
// (host memcpy, or device copies ordered on a stream). Everything else is the code an NCCL or
// MPI rank runs. Shared by the unit tests (host) and tests/cuda/test_cuda_parallel.cpp (GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/exchange.h"

namespace pagedattn::test {

/// Runs every rank's all-gathers: rank r's k-th gather receives rank q's k-th send at
/// recv + q * bytes (its own send stays where it is when it is already its slot). `gathers[r]`
/// is what rank r's *_exchange_begin returned; all ranks' data live on `device`.
inline void simulate_all_gathers(const std::vector<ExchangeGathers>& gathers, Device device,
                                 Stream stream = {}) {
  DeviceRuntime& rt = require_device(device);
  const size_t world = gathers.size();
  for (size_t r = 0; r < world; ++r) {
    detail::require(gathers[r].count == gathers[0].count, "rank ", r, " runs ", gathers[r].count,
                    " all-gathers; rank 0 runs ", gathers[0].count);
    for (int k = 0; k < gathers[r].count; ++k) {
      const GatherBuffer& mine = gathers[r].buffers[size_t(k)];
      for (size_t q = 0; q < world; ++q) {
        const GatherBuffer& theirs = gathers[q].buffers[size_t(k)];
        detail::require(theirs.bytes == mine.bytes, "all-gather ", k, ": rank ", q, " sends ",
                        theirs.bytes, " bytes, rank ", r, " expects ", mine.bytes);
        char* dst = static_cast<char*>(mine.recv) + q * mine.bytes;
        if (mine.bytes == 0 || dst == theirs.send) continue;
        rt.copy_2d_async(dst, mine.bytes, theirs.send, mine.bytes, mine.bytes, 1, device.index,
                         stream);
      }
    }
  }
}

/// Copies host or device `src` into `dst` whose rows (dimension 0) hold contiguous elements
/// with any row pitch: copy_tensor cannot write strided device views, so a device destination
/// gets its rows by one 2-D copy from a contiguous device copy of `src`.
inline void copy_rows(const TensorView& dst, const TensorView& src) {
  if (dst.device.is_cpu() || dst.is_contiguous() || dst.numel() == 0) {
    copy_tensor(dst, src);
    return;
  }
  const Tensor staged = Tensor::copy_of(src, dst.device);
  const size_t row = dst.nbytes() / size_t(dst.size(0));
  DeviceRuntime& rt = require_device(dst.device);
  rt.copy_2d_async(dst.data, size_t(dst.stride(0)) * dtype_size(dst.dtype), staged.data(), row, row,
                   size_t(dst.size(0)), dst.device.index, {});
  rt.synchronize(dst.device.index);
}

/// Where a rank's result sits when its exchange begins.
enum class Placement {
  kInSlot,      ///< already in its workspace slot (in-place all-gather)
  kContiguous,  ///< a contiguous tensor of its own (out-of-place all-gather); DCP: the output
                ///< is this same tensor (the merge overwrites the partial)
  kStrided,     ///< rows with gaps (staged into the slot first); TP: its columns of the output
};

inline const char* placement_name(Placement p) {
  return p == Placement::kInSlot       ? "in slot"
         : p == Placement::kContiguous ? "contiguous"
                                       : "strided";
}

/// A [rows, a, b] view of `buffer` ([rows, >= a * b]) whose rows are `buffer`'s rows.
inline TensorView strided_rows(const Tensor& buffer, int64_t a, int64_t b) {
  TensorView v = buffer.view();
  v.ndim = 3;
  v.shape = {v.shape[0], a, b, 0, 0, 0};
  v.strides = {buffer.view().stride(0), b, 1, 0, 0, 0};
  return v;
}

/// One rank's side of a DCP exchange with the tensors it owns: its host partial (`out`
/// [T, H, D], `lse` float32 [H, T]) copied to `device` as `placement` says, an output of
/// `out_dtype` (the partial itself for kContiguous when the dtypes agree), an output LSE, and a
/// workspace filled with NaN garbage (every byte the merge reads must come from a gather).
struct DcpRank {
  Tensor workspace, partial, lse, output, output_lse;
  DcpExchangeArgs args;
};

inline DcpRank make_dcp_rank(int rank, int world, const Tensor& out, const Tensor& lse,
                             DType out_dtype, Placement placement, Device device) {
  const TensorView p = out.view();
  const int64_t t = p.size(0), h = p.size(1), d = p.size(2);
  const auto layout = DcpExchangeLayout::of(world, t, int(h), int(d), p.dtype);
  DcpRank k;
  k.workspace = Tensor::empty({std::max<int64_t>(int64_t(layout.bytes), 1)}, DType::kU8, device);
  require_device(device).memset(k.workspace.data(), 0xff, layout.bytes, device.index);
  DcpExchangeArgs& a = k.args;
  a.rank = rank;
  a.world = world;
  if (placement == Placement::kInSlot) {
    a.partial_output = layout.output_slot(k.workspace.data(), rank, device);
    a.partial_lse = layout.lse_slot(k.workspace.data(), rank, device);
  } else if (placement == Placement::kContiguous) {
    k.partial = Tensor::empty({t, h, d}, p.dtype, device);
    k.lse = Tensor::empty({h, t}, DType::kF32, device);
    a.partial_output = k.partial.view();
    a.partial_lse = k.lse.view();
  } else {
    k.partial = Tensor::empty({t, h * d + 24}, p.dtype, device);
    k.lse = Tensor::empty({h, t + 5}, DType::kF32, device);
    a.partial_output = strided_rows(k.partial, h, d);
    a.partial_lse = k.lse.view().slice(1, 0, t);
  }
  copy_rows(a.partial_output, p);
  copy_rows(a.partial_lse, lse.view());
  if (placement == Placement::kContiguous && out_dtype == p.dtype) {
    a.output = a.partial_output;  // the merge reads the workspace only
  } else {
    k.output = Tensor::empty({t, h, d}, out_dtype, device);
    a.output = k.output.view();
  }
  k.output_lse = Tensor::empty({h, t}, DType::kF32, device);
  a.output_lse = k.output_lse.view();
  a.workspace = {k.workspace.data(), layout.bytes};
  return k;
}

/// Each rank's merged (output [T, H, D] of `out_dtype`, LSE [H, T]) on the host, after a DCP
/// exchange of the ranks' host partials (`outs[r]` [T, H, D], `lses[r]` float32 [H, T]) on
/// `device`, placed as `placement` says, the all-gathers simulated.
inline std::vector<std::pair<Tensor, Tensor>> run_dcp_exchange_sim(
    const Backend& backend, const std::vector<Tensor>& outs, const std::vector<Tensor>& lses,
    DType out_dtype, Placement placement, Device device) {
  const int world = int(outs.size());
  std::vector<DcpRank> ranks;
  std::vector<ExchangeGathers> gathers;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(
        make_dcp_rank(r, world, outs[size_t(r)], lses[size_t(r)], out_dtype, placement, device));
    gathers.push_back(dcp_exchange_begin(ranks.back().args));
  }
  simulate_all_gathers(gathers, device);
  std::vector<std::pair<Tensor, Tensor>> result;
  for (DcpRank& k : ranks) {
    dcp_exchange_end(backend, k.args);
    require_device(device).synchronize(device.index);
    result.emplace_back(Tensor::copy_of(k.args.output, Device::cpu()),
                        Tensor::copy_of(k.args.output_lse, Device::cpu()));
  }
  return result;
}

/// One rank's side of a TP exchange with the tensors it owns: its host result (`out`
/// [T, Hr, D], `lse` float32 [Hr, T]) copied to `device` as `placement` says (kStrided: its
/// columns of its output and its rows of its LSE), output and LSE garbage (NaN) elsewhere.
struct TpRank {
  Tensor workspace, mine, mine_lse, output, lse;
  TpExchangeArgs args;
};

inline TpRank make_tp_rank(int rank, int world, const Tensor& out, const Tensor& lse,
                           Placement placement, Device device) {
  const TensorView p = out.view();
  const int64_t t = p.size(0), hr = p.size(1), d = p.size(2);
  const auto layout = TpExchangeLayout::of(world, t, int(hr), int(d), p.dtype);
  TpRank k;
  k.workspace = Tensor::empty({std::max<int64_t>(int64_t(layout.bytes), 1)}, DType::kU8, device);
  k.output = Tensor::empty({t, hr * world, d}, p.dtype, device);
  k.lse = Tensor::empty({hr * world, t}, DType::kF32, device);
  require_device(device).memset(k.output.data(), 0xff, k.output.view().nbytes(), device.index);
  require_device(device).memset(k.lse.data(), 0xff, k.lse.view().nbytes(), device.index);
  TpExchangeArgs& a = k.args;
  a.rank = rank;
  a.world = world;
  a.output = k.output.view();
  a.lse = k.lse.view();
  const TensorView own_lse_rows = k.lse.view().slice(0, rank * hr, (rank + 1) * hr);
  if (placement == Placement::kInSlot) {
    a.rank_output = layout.output_slot(k.workspace.data(), rank, device);
    a.rank_lse = own_lse_rows;
  } else if (placement == Placement::kContiguous) {
    k.mine = Tensor::empty({t, hr, d}, p.dtype, device);
    k.mine_lse = Tensor::empty({hr, t}, DType::kF32, device);
    a.rank_output = k.mine.view();
    a.rank_lse = k.mine_lse.view();
  } else {
    a.rank_output = k.output.view().slice(1, rank * hr, (rank + 1) * hr);
    a.rank_lse = own_lse_rows;
  }
  copy_rows(a.rank_output, p);
  copy_rows(a.rank_lse, lse.view());
  a.workspace = {k.workspace.data(), layout.bytes};
  return k;
}

/// Each rank's gathered (output [T, world * Hr, D], LSE [world * Hr, T]) on the host, after a
/// TP exchange of the ranks' host results (`outs[r]` [T, Hr, D], `lses[r]` float32 [Hr, T])
/// on `device`, placed as `placement` says, the all-gathers simulated.
inline std::vector<std::pair<Tensor, Tensor>> run_tp_exchange_sim(const std::vector<Tensor>& outs,
                                                                  const std::vector<Tensor>& lses,
                                                                  Placement placement,
                                                                  Device device) {
  const int world = int(outs.size());
  std::vector<TpRank> ranks;
  std::vector<ExchangeGathers> gathers;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(make_tp_rank(r, world, outs[size_t(r)], lses[size_t(r)], placement, device));
    gathers.push_back(tp_exchange_begin(ranks.back().args));
  }
  simulate_all_gathers(gathers, device);
  std::vector<std::pair<Tensor, Tensor>> result;
  for (TpRank& k : ranks) {
    tp_exchange_end(k.args);
    require_device(device).synchronize(device.index);
    result.emplace_back(Tensor::copy_of(k.output.view(), Device::cpu()),
                        Tensor::copy_of(k.lse.view(), Device::cpu()));
  }
  return result;
}

/// Garbage (0xff bytes: NaN) in everything a DCP exchange writes (output, workspace), then the
/// rank's own partial (`out`, `lse`) put back where its placement keeps it: a replay of the
/// exchange must produce every byte again.
inline void reset_dcp_rank(DcpRank& k, const Tensor& out, const Tensor& lse) {
  const DcpExchangeArgs& a = k.args;
  DeviceRuntime& rt = require_device(a.output.device);
  rt.memset(a.output.data, 0xff, a.output.nbytes(), a.output.device.index);
  rt.memset(a.workspace.data, 0xff, a.workspace.bytes, a.output.device.index);
  copy_rows(a.partial_output, out.view());
  copy_rows(a.partial_lse, lse.view());
}

/// The same for a TP exchange (output, LSE and workspace garbage; the rank's own result back).
inline void reset_tp_rank(TpRank& k, const Tensor& out, const Tensor& lse) {
  const TpExchangeArgs& a = k.args;
  DeviceRuntime& rt = require_device(a.output.device);
  rt.memset(a.output.data, 0xff, a.output.nbytes(), a.output.device.index);
  rt.memset(a.lse.data, 0xff, a.lse.nbytes(), a.output.device.index);
  rt.memset(a.workspace.data, 0xff, a.workspace.bytes, a.output.device.index);
  copy_rows(a.rank_output, out.view());
  copy_rows(a.rank_lse, lse.view());
}

/// The oracle of a rank-order merge: float64 [T, H, D] and [H, T] from host partials
/// ([R, T, H, D] any float dtype) and LSEs (float32 [R, H, T]), by merge_states' formula in
/// float64 rank after rank from "no keys" (a row no rank has keys for: 0, -inf).
inline std::pair<Tensor, Tensor> reference_merge_ranks(const TensorView& partials,
                                                       const TensorView& lses) {
  const int64_t ranks = partials.size(0), t = partials.size(1), h = partials.size(2),
                d = partials.size(3);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  Tensor out = Tensor::zeros({t, h, d}, DType::kF64), out_lse = Tensor::empty({h, t}, DType::kF64);
  auto* o = out.data_as<double>();
  for (int64_t ti = 0; ti < t; ++ti) {
    for (int64_t hi = 0; hi < h; ++hi) {
      double lse = neg_inf;
      double* row = o + (ti * h + hi) * d;
      for (int64_t r = 0; r < ranks; ++r) {
        double l = load_element(lses.data, lses.dtype,
                                r * lses.stride(0) + hi * lses.stride(1) + ti * lses.stride(2));
        if (std::isinf(l)) l = neg_inf;
        const double m = std::max(lse, l);
        if (m == neg_inf) continue;
        const double wp = std::exp(lse - m), ws = std::exp(l - m), sum = wp + ws;
        lse = std::log(sum) + m;
        for (int64_t i = 0; i < d; ++i) {
          const double v = ws == 0.0
                               ? 0.0
                               : load_element(partials.data, partials.dtype,
                                              r * partials.stride(0) + ti * partials.stride(1) +
                                                  hi * partials.stride(2) + i);
          row[i] = (wp == 0.0 ? 0.0 : row[i] * wp / sum) + v * ws / sum;
        }
      }
      out_lse.data_as<double>()[hi * t + ti] = lse;
    }
  }
  return {std::move(out), std::move(out_lse)};
}

}  // namespace pagedattn::test
