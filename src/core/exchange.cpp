#include "pagedattn/exchange.h"

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::fail;

namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

void check_sizes(int world, int64_t num_tokens, int num_heads, int head_size) {
  if (world < 1) fail("exchange: world (", world, ") must be >= 1");
  if (num_tokens < 0) fail("exchange: num_tokens (", num_tokens, ") must be >= 0");
  if (num_heads < 1) fail("exchange: num_heads (", num_heads, ") must be >= 1");
  if (head_size < 1) fail("exchange: head_size (", head_size, ") must be >= 1");
}

bool is_float_activation(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

void check_rank(int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    fail("exchange: rank (", rank, ") must be in [0, world) with world (", world, ") >= 1");
  }
}

// A [rows, cols...] view whose rows hold `row_elems` contiguous elements: true when each row's
// elements are contiguous (strides of the inner dimensions are row-major).
bool rows_contiguous(const TensorView& v) {
  int64_t expect = 1;
  for (int d = v.ndim - 1; d >= 1; --d) {
    if (v.size(d) > 1 && v.stride(d) != expect) return false;
    expect *= v.size(d);
  }
  return true;
}

// True when the rows also follow each other with no gap (one contiguous block).
bool all_contiguous(const TensorView& v) {
  int64_t row = 1;
  for (int d = 1; d < v.ndim; ++d) row *= v.size(d);
  return rows_contiguous(v) && (v.size(0) <= 1 || v.stride(0) == row);
}

size_t row_bytes(const TensorView& v) {
  return v.numel() == 0 ? 0 : v.nbytes() / size_t(v.size(0));
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto* pa = static_cast<const char*>(a);
  const auto* pb = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// Bytes from a view's first element to one past its last (any non-negative strides).
size_t span_bytes(const TensorView& v) {
  if (v.numel() == 0) return 0;
  int64_t last = 0;
  for (int d = 0; d < v.ndim; ++d) last += (v.size(d) - 1) * v.stride(d);
  return size_t(last + 1) * dtype_size(v.dtype);
}

// The workspace holds `need` bytes (what `layout_call` computes) and overlaps neither output.
template <class LayoutCall>
void check_workspace(const char* kind, const char* lse_name, const Workspace& ws, size_t need,
                     const TensorView& out, const TensorView& lse, LayoutCall layout_call) {
  if (ws.bytes < need || (need > 0 && ws.data == nullptr)) {
    fail(kind, " exchange: workspace has ", ws.bytes, " bytes; the exchange needs ", need, " (",
         layout_call(), ")");
  }
  if (overlaps(out.data, span_bytes(out), ws.data, need) ||
      (lse.defined() && overlaps(lse.data, span_bytes(lse), ws.data, need))) {
    fail(kind, " exchange: output and ", lse_name, " must not overlap the workspace");
  }
}

DeviceRuntime& runtime_of(Device device) {
  DeviceRuntime* rt = device_runtime(device.type);
  if (rt == nullptr) {
    fail<NotSupported>("exchange: this build has no runtime for ", to_string(device));
  }
  return *rt;
}

// The all-gather of `v` (one rank's `bytes`) into `recv` ([world][bytes]): in place when v is
// already its slot, from v itself when its rows follow each other, else from the slot after
// copying v's rows into it (ordered on the stream). Apart from its own slot, v must not
// overlap recv: the transports read send while they write recv.
GatherBuffer gather_of(const TensorView& v, void* recv, int rank, int world, size_t bytes,
                       Stream stream, const char* name, const char* dest) {
  char* slot = static_cast<char*>(recv) + size_t(rank) * bytes;
  if (bytes == 0) return GatherBuffer{slot, recv, 0};
  if (v.data == slot) {
    if (!all_contiguous(v)) {
      fail("exchange: ", name, " starts at its slot of ", dest, " but its rows are strided");
    }
    return GatherBuffer{slot, recv, bytes};
  }
  if (overlaps(v.data, span_bytes(v), recv, bytes * size_t(world))) {
    fail("exchange: ", name, " overlaps ", dest, " but is not this rank's slot of it (rank ", rank,
         ")");
  }
  if (all_contiguous(v)) return GatherBuffer{v.data, recv, bytes};
  const size_t rb = row_bytes(v);
  runtime_of(v.device).copy_2d_async(slot, rb, v.data, size_t(v.stride(0)) * dtype_size(v.dtype),
                                     rb, size_t(v.size(0)), v.device.index, stream);
  return GatherBuffer{slot, recv, bytes};
}

}  // namespace

// ---- decode context parallelism ---------------------------------------------------------------

DcpExchangeLayout DcpExchangeLayout::of(int world, int64_t num_tokens, int num_heads, int head_size,
                                        DType partial_dtype) {
  check_sizes(world, num_tokens, num_heads, head_size);
  if (!is_float_activation(partial_dtype)) {
    fail("DcpExchangeLayout: partial dtype ", dtype_name(partial_dtype),
         " must be float32, float16 or bfloat16");
  }
  DcpExchangeLayout l;
  l.world = world;
  l.num_tokens = num_tokens;
  l.num_heads = num_heads;
  l.head_size = head_size;
  l.partial_dtype = partial_dtype;
  const size_t outputs = size_t(world) * size_t(num_tokens) * size_t(num_heads) *
                         size_t(head_size) * dtype_size(partial_dtype);
  l.lses_offset = align_up(outputs);
  l.bytes = l.lses_offset + size_t(world) * size_t(num_heads) * size_t(num_tokens) * sizeof(float);
  return l;
}

TensorView DcpExchangeLayout::outputs(void* ws, Device device) const {
  return TensorView::contiguous(ws, partial_dtype, {world, num_tokens, num_heads, head_size},
                                device);
}

TensorView DcpExchangeLayout::lses(void* ws, Device device) const {
  return TensorView::contiguous(static_cast<char*>(ws) + lses_offset, DType::kF32,
                                {world, num_heads, num_tokens}, device);
}

TensorView DcpExchangeLayout::output_slot(void* ws, int rank, Device device) const {
  check_rank(rank, world);
  return outputs(ws, device).select(0, rank);
}

TensorView DcpExchangeLayout::lse_slot(void* ws, int rank, Device device) const {
  check_rank(rank, world);
  return lses(ws, device).select(0, rank);
}

namespace {

// The layout of a checked DCP exchange.
DcpExchangeLayout check_dcp(const DcpExchangeArgs& a) {
  check_rank(a.rank, a.world);
  const TensorView &po = a.partial_output, &pl = a.partial_lse, &o = a.output;
  if (!po.defined() || po.ndim != 3 || !is_float_activation(po.dtype)) {
    fail("dcp exchange: partial_output must be float32/float16/bfloat16 [T, H, D]; got ",
         describe(po));
  }
  const int64_t t = po.size(0), h = po.size(1), d = po.size(2);
  if (!rows_contiguous(po)) {
    fail("dcp exchange: partial_output rows must be contiguous (H * D elements each); got ",
         describe(po), " with strides ", po.stride(0), ", ", po.stride(1), ", ", po.stride(2));
  }
  if (!pl.defined() || pl.ndim != 2 || pl.dtype != DType::kF32 || pl.size(0) != h ||
      pl.size(1) != t || !rows_contiguous(pl)) {
    fail("dcp exchange: partial_lse must be float32 [H=", h, ", T=", t,
         "] with each head's tokens contiguous; got ", describe(pl));
  }
  if (!o.defined() || o.ndim != 3 || o.size(0) != t || o.size(1) != h || o.size(2) != d ||
      !is_float_activation(o.dtype)) {
    fail("dcp exchange: output must be float32/float16/bfloat16 [T=", t, ", H=", h, ", D=", d,
         "]; got ", describe(o));
  }
  const TensorView& ol = a.output_lse;
  if (ol.defined() &&
      (ol.ndim != 2 || ol.dtype != DType::kF32 || ol.size(0) != h || ol.size(1) != t)) {
    fail("dcp exchange: output_lse must be float32 [H=", h, ", T=", t, "]; got ", describe(ol));
  }
  for (const TensorView* v : {&po, &pl, &ol}) {
    if (v->defined() && v->device != o.device) {
      fail("dcp exchange: ",
           v == &po   ? "partial_output"
           : v == &pl ? "partial_lse"
                      : "output_lse",
           " is on ", to_string(v->device), "; output on ", to_string(o.device));
    }
  }
  const DcpExchangeLayout l = DcpExchangeLayout::of(a.world, t, int(h), int(d), po.dtype);
  check_workspace("dcp", "output_lse", a.workspace, l.bytes, o, ol, [&] {
    return cat("DcpExchangeLayout::of(world ", a.world, ", T ", t, ", H ", h, ", D ", d, ", ",
               dtype_name(po.dtype), ").bytes");
  });
  return l;
}

}  // namespace

ExchangeGathers dcp_exchange_begin(const DcpExchangeArgs& a) {
  const DcpExchangeLayout l = check_dcp(a);
  const size_t out_bytes = size_t(l.num_tokens) * size_t(l.num_heads) * size_t(l.head_size) *
                           dtype_size(l.partial_dtype);
  const size_t lse_bytes = size_t(l.num_heads) * size_t(l.num_tokens) * sizeof(float);
  char* ws = static_cast<char*>(a.workspace.data);
  ExchangeGathers g;
  g.count = 2;
  g.buffers[0] = gather_of(a.partial_output, ws, a.rank, a.world, out_bytes, a.stream,
                           "partial_output", "the workspace's outputs");
  g.buffers[1] = gather_of(a.partial_lse, ws + l.lses_offset, a.rank, a.world, lse_bytes, a.stream,
                           "partial_lse", "the workspace's lses");
  return g;
}

void dcp_exchange_end(const Backend& backend, const DcpExchangeArgs& a) {
  const DcpExchangeLayout l = check_dcp(a);
  const Device device = a.output.device;
  MergeRanksArgs m;
  m.partial_outputs = l.outputs(a.workspace.data, device);
  m.partial_lses = l.lses(a.workspace.data, device);
  m.output = a.output;
  m.output_lse = a.output_lse;
  m.stream = a.stream;
  backend.merge_ranks(m);
}

// ---- tensor parallelism ----------------------------------------------------------------------

TpExchangeLayout TpExchangeLayout::of(int world, int64_t num_tokens, int heads_per_rank,
                                      int head_size, DType dtype) {
  check_sizes(world, num_tokens, heads_per_rank, head_size);
  TpExchangeLayout l;
  l.world = world;
  l.num_tokens = num_tokens;
  l.heads_per_rank = heads_per_rank;
  l.head_size = head_size;
  l.dtype = dtype;
  l.bytes = size_t(world) * size_t(num_tokens) * size_t(heads_per_rank) * size_t(head_size) *
            dtype_size(dtype);
  return l;
}

TensorView TpExchangeLayout::outputs(void* ws, Device device) const {
  return TensorView::contiguous(ws, dtype, {world, num_tokens, heads_per_rank, head_size}, device);
}

TensorView TpExchangeLayout::output_slot(void* ws, int rank, Device device) const {
  check_rank(rank, world);
  return outputs(ws, device).select(0, rank);
}

namespace {

TpExchangeLayout check_tp(const TpExchangeArgs& a) {
  check_rank(a.rank, a.world);
  const TensorView &ro = a.rank_output, &o = a.output;
  if (!ro.defined() || ro.ndim != 3 || !rows_contiguous(ro)) {
    fail(
        "tp exchange: rank_output must be [T, Hr, D] with each row's Hr * D elements "
        "contiguous; got ",
        describe(ro));
  }
  const int64_t t = ro.size(0), hr = ro.size(1), d = ro.size(2);
  const int64_t h = hr * a.world;
  if (!o.defined() || o.ndim != 3 || o.size(0) != t || o.size(1) != h || o.size(2) != d ||
      o.dtype != ro.dtype || !rows_contiguous(o)) {
    fail("tp exchange: output must be ", dtype_name(ro.dtype), " [T=", t, ", H=world*Hr=", h,
         ", D=", d, "] with each row's H * D elements contiguous; got ", describe(o));
  }
  if (o.device != ro.device) {
    fail("tp exchange: rank_output is on ", to_string(ro.device), "; output on ",
         to_string(o.device));
  }
  const TensorView &rl = a.rank_lse, &l = a.lse;
  if (rl.defined()) {
    if (rl.ndim != 2 || rl.dtype != DType::kF32 || rl.size(0) != hr || rl.size(1) != t ||
        !all_contiguous(rl) || rl.device != o.device) {
      fail("tp exchange: rank_lse must be contiguous float32 [Hr=", hr, ", T=", t, "] on ",
           to_string(o.device), "; got ", describe(rl), " on ", to_string(rl.device));
    }
    if (!l.defined() || l.ndim != 2 || l.dtype != DType::kF32 || l.size(0) != h || l.size(1) != t ||
        !all_contiguous(l) || l.device != o.device) {
      fail("tp exchange: lse must be contiguous float32 [H=", h, ", T=", t, "] on ",
           to_string(o.device), " when rank_lse is given; got ",
           l.defined() ? describe(l) : std::string("none"));
    }
  } else if (l.defined()) {
    fail("tp exchange: lse is given without rank_lse");
  }
  const TpExchangeLayout lay = TpExchangeLayout::of(a.world, t, int(hr), int(d), ro.dtype);
  check_workspace("tp", "lse", a.workspace, lay.bytes, o, l, [&] {
    return cat("TpExchangeLayout::of(world ", a.world, ", T ", t, ", Hr ", hr, ", D ", d, ", ",
               dtype_name(ro.dtype), ").bytes");
  });
  return lay;
}

// rank_output is this rank's columns of output (the exchange fills around it).
bool is_own_columns(const TpExchangeArgs& a) {
  const TensorView &ro = a.rank_output, &o = a.output;
  const char* own = static_cast<const char*>(o.data) +
                    size_t(a.rank) * size_t(ro.size(1)) * size_t(o.stride(1)) * dtype_size(o.dtype);
  return ro.data == own && (ro.size(0) <= 1 || ro.stride(0) == o.stride(0)) &&
         (ro.size(1) <= 1 || ro.stride(1) == o.stride(1));
}

}  // namespace

ExchangeGathers tp_exchange_begin(const TpExchangeArgs& a) {
  const TpExchangeLayout lay = check_tp(a);
  const size_t out_bytes = lay.bytes / size_t(a.world);
  ExchangeGathers g;
  g.count = 1;
  g.buffers[0] = gather_of(a.rank_output, a.workspace.data, a.rank, a.world, out_bytes, a.stream,
                           "rank_output", "the workspace");
  if (a.rank_lse.defined()) {  // contiguous (checked): gathered as it is, never staged
    g.buffers[1] = gather_of(a.rank_lse, a.lse.data, a.rank, a.world, a.rank_lse.nbytes(), a.stream,
                             "rank_lse", "lse");
    g.count = 2;
  }
  return g;
}

void tp_exchange_end(const TpExchangeArgs& a) {
  const TpExchangeLayout lay = check_tp(a);
  const TensorView& o = a.output;
  const size_t slot_row = size_t(lay.heads_per_rank) * size_t(lay.head_size) * dtype_size(o.dtype);
  if (slot_row == 0 || lay.num_tokens == 0) return;
  const size_t out_pitch = size_t(o.stride(0)) * dtype_size(o.dtype);
  const bool skip_own = is_own_columns(a);
  DeviceRuntime& rt = runtime_of(o.device);
  for (int r = 0; r < a.world; ++r) {
    if (r == a.rank && skip_own) continue;
    rt.copy_2d_async(
        static_cast<char*>(o.data) + size_t(r) * slot_row, out_pitch,
        static_cast<const char*>(a.workspace.data) + size_t(r) * size_t(lay.num_tokens) * slot_row,
        slot_row, slot_row, size_t(lay.num_tokens), o.device.index, a.stream);
  }
}

}  // namespace pagedattn
