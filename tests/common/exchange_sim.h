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

/// Each rank's merged (output [T, H, D] of `out_dtype`, LSE [H, T]) on the host, after a DCP
/// exchange of the ranks' host partials (`outs[r]` [T, H, D], `lses[r]` float32 [H, T]) on
/// `device`, placed as `placement` says, the all-gathers simulated.
inline std::vector<std::pair<Tensor, Tensor>> run_dcp_exchange_sim(
    const Backend& backend, const std::vector<Tensor>& outs, const std::vector<Tensor>& lses,
    DType out_dtype, Placement placement, Device device) {
  const int world = int(outs.size());
  const TensorView p0 = outs[0].view();
  const int64_t t = p0.size(0), h = p0.size(1), d = p0.size(2);
  const auto layout = DcpExchangeLayout::of(world, t, int(h), int(d), p0.dtype);
  struct Rank {
    Tensor ws, partial, lse, output, output_lse;
    DcpExchangeArgs args;
  };
  std::vector<Rank> ranks(outs.size());
  std::vector<ExchangeGathers> gathers;
  for (int r = 0; r < world; ++r) {
    Rank& k = ranks[size_t(r)];
    k.ws = Tensor::empty({int64_t(layout.bytes)}, DType::kU8, device);
    require_device(device).memset(k.ws.data(), 0xff, layout.bytes, device.index);  // NaN garbage
    DcpExchangeArgs& a = k.args;
    a.rank = r;
    a.world = world;
    if (placement == Placement::kInSlot) {
      a.partial_output = layout.output_slot(k.ws.data(), r, device);
      a.partial_lse = layout.lse_slot(k.ws.data(), r, device);
    } else if (placement == Placement::kContiguous) {
      k.partial = Tensor::empty({t, h, d}, p0.dtype, device);
      k.lse = Tensor::empty({h, t}, DType::kF32, device);
      a.partial_output = k.partial.view();
      a.partial_lse = k.lse.view();
    } else {
      k.partial = Tensor::empty({t, h * d + 24}, p0.dtype, device);
      k.lse = Tensor::empty({h, t + 5}, DType::kF32, device);
      a.partial_output = strided_rows(k.partial, h, d);
      a.partial_lse = k.lse.view().slice(1, 0, t);
    }
    copy_tensor(a.partial_output, outs[size_t(r)].view());
    copy_tensor(a.partial_lse, lses[size_t(r)].view());
    if (placement == Placement::kContiguous && out_dtype == p0.dtype) {
      a.output = a.partial_output;  // the merge reads the workspace only
    } else {
      k.output = Tensor::empty({t, h, d}, out_dtype, device);
      a.output = k.output.view();
    }
    k.output_lse = Tensor::empty({h, t}, DType::kF32, device);
    a.output_lse = k.output_lse.view();
    a.workspace = {k.ws.data(), layout.bytes};
    gathers.push_back(dcp_exchange_begin(a));
  }
  simulate_all_gathers(gathers, device);
  std::vector<std::pair<Tensor, Tensor>> result;
  for (Rank& k : ranks) {
    dcp_exchange_end(backend, k.args);
    require_device(device).synchronize(device.index);
    result.emplace_back(Tensor::copy_of(k.args.output, Device::cpu()),
                        Tensor::copy_of(k.args.output_lse, Device::cpu()));
  }
  return result;
}

/// Each rank's gathered (output [T, world * Hr, D], LSE [world * Hr, T]) on the host, after a
/// TP exchange of the ranks' host results (`outs[r]` [T, Hr, D], `lses[r]` float32 [Hr, T])
/// on `device`, placed as `placement` says (kStrided: the rank's columns of its output, its
/// LSE rows of its LSE), every other byte of the outputs garbage first.
inline std::vector<std::pair<Tensor, Tensor>> run_tp_exchange_sim(const std::vector<Tensor>& outs,
                                                                  const std::vector<Tensor>& lses,
                                                                  Placement placement,
                                                                  Device device) {
  const int world = int(outs.size());
  const TensorView p0 = outs[0].view();
  const int64_t t = p0.size(0), hr = p0.size(1), d = p0.size(2);
  const auto layout = TpExchangeLayout::of(world, t, int(hr), int(d), p0.dtype);
  struct Rank {
    Tensor ws, mine, mine_lse, output, lse;
    TpExchangeArgs args;
  };
  std::vector<Rank> ranks(outs.size());
  std::vector<ExchangeGathers> gathers;
  for (int r = 0; r < world; ++r) {
    Rank& k = ranks[size_t(r)];
    k.ws = Tensor::empty({std::max<int64_t>(int64_t(layout.bytes), 1)}, DType::kU8, device);
    k.output = Tensor::empty({t, hr * world, d}, p0.dtype, device);
    k.lse = Tensor::empty({hr * world, t}, DType::kF32, device);
    require_device(device).memset(k.output.data(), 0xff, k.output.view().nbytes(), device.index);
    require_device(device).memset(k.lse.data(), 0xff, k.lse.view().nbytes(), device.index);
    TpExchangeArgs& a = k.args;
    a.rank = r;
    a.world = world;
    a.output = k.output.view();
    a.lse = k.lse.view();
    const TensorView own_lse_rows = k.lse.view().slice(0, r * hr, (r + 1) * hr);
    if (placement == Placement::kInSlot) {
      a.rank_output = layout.output_slot(k.ws.data(), r, device);
      a.rank_lse = own_lse_rows;
    } else if (placement == Placement::kContiguous) {
      k.mine = Tensor::empty({t, hr, d}, p0.dtype, device);
      k.mine_lse = Tensor::empty({hr, t}, DType::kF32, device);
      a.rank_output = k.mine.view();
      a.rank_lse = k.mine_lse.view();
    } else {
      a.rank_output = k.output.view().slice(1, r * hr, (r + 1) * hr);
      a.rank_lse = own_lse_rows;
    }
    copy_tensor(a.rank_output, outs[size_t(r)].view());
    copy_tensor(a.rank_lse, lses[size_t(r)].view());
    a.workspace = {k.ws.data(), layout.bytes};
    gathers.push_back(tp_exchange_begin(a));
  }
  simulate_all_gathers(gathers, device);
  std::vector<std::pair<Tensor, Tensor>> result;
  for (Rank& k : ranks) {
    tp_exchange_end(k.args);
    require_device(device).synchronize(device.index);
    result.emplace_back(Tensor::copy_of(k.output.view(), Device::cpu()),
                        Tensor::copy_of(k.lse.view(), Device::cpu()));
  }
  return result;
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
