// Damage to one argument of a valid attention step, for the input fuzz tests: editable copies
// of a step's metadata arrays with views over them, the damages (a metadata scalar or element
// set to a bad value, a view dropped, retyped, resized or strided, an input shortened, retyped
// or strided; some valid re-layouts) and a dense copy of what a validator reads.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn::testing {

// One of `values`, uniformly.
template <class T>
T pick(std::mt19937& rng, std::initializer_list<T> values) {
  return *(values.begin() + std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
}

// The requests of a random valid step over a cache of num_blocks blocks: each request's blocks
// (sometimes one spare) drawn from a shuffled order, so no request owns a contiguous range, and
// one to three blocks no request uses.
struct RandomRequests {
  std::vector<RequestSpec> requests;
  int num_blocks = 0;
};
inline RandomRequests random_requests(std::mt19937& rng, int block_size,
                                      std::initializer_list<int> num_requests,
                                      std::initializer_list<int> context_lens,
                                      std::initializer_list<int> new_tokens) {
  RandomRequests out;
  int used = 0;
  for (int r = pick(rng, num_requests); r > 0; --r) {
    RequestSpec req;
    req.context_len = pick(rng, context_lens);
    req.num_new_tokens = pick(rng, new_tokens);
    const int seq_len = req.context_len + req.num_new_tokens;
    const int blocks = (seq_len + block_size - 1) / block_size + pick(rng, {0, 1});
    for (int b = 0; b < blocks; ++b) req.block_ids.push_back(used++);
    out.requests.push_back(std::move(req));
  }
  out.num_blocks = used + pick(rng, {1, 2, 3});
  std::vector<int32_t> perm(size_t(out.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (auto& req : out.requests) {
    for (auto& b : req.block_ids) b = perm[size_t(b)];
  }
  return out;
}

// A [rows, ...] tensor inside an allocation of 2 * rows + 1 rows, so that a damaged view (every
// stride doubled) still lies in owned memory: only a rule may stop it, not the heap's end.
struct Rows {
  Tensor storage;
  TensorView view;
};

// Rows of N(0, 1) in `dtype`.
inline Rows random_rows(DType dtype, std::vector<int64_t> shape, std::mt19937& rng) {
  const int64_t rows = shape[0];
  shape[0] = 2 * rows + 1;
  Rows r{Tensor::empty(shape, dtype), {}};
  std::normal_distribution<double> dist;
  for (int64_t i = 0; i < r.storage.view().numel(); ++i) {
    store_element(r.storage.data(), dtype, i, dist(rng));
  }
  r.view = r.storage.view().slice(0, 0, rows);
  return r;
}

// Rows whose every bit is 1: NaN in float32, float16 and bfloat16, so an unwritten element
// cannot pass as written.
inline Rows poisoned_rows(DType dtype, std::vector<int64_t> shape) {
  const int64_t rows = shape[0];
  shape[0] = 2 * rows + 1;
  Rows r{Tensor::empty(shape, dtype), {}};
  std::memset(r.storage.data(), 0xff, r.storage.view().nbytes());
  r.view = r.storage.view().slice(0, 0, rows);
  return r;
}

// A view's first `rows` rows as doubles in row-major order, read through its strides.
inline std::vector<double> row_values(const TensorView& v, int64_t rows) {
  const Tensor dense = Tensor::copy_of(v.slice(0, 0, rows), Device::cpu());
  std::vector<double> out(size_t(dense.view().numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_element(dense.data(), v.dtype, int64_t(i));
  return out;
}

// Editable copies of a step's metadata arrays with views over them: one damage edits the
// arrays or the views, then the layer gets the AttentionMetadata.
struct Metadata {
  // Spare room past every array, so a view made longer or strided stays inside host memory:
  // the damage must be caught by a rule, not by where the buffer happens to end.
  static constexpr size_t kSpare = 64;
  std::vector<int32_t> qsl, seq_lens, block_table, relaid_table;
  std::vector<int64_t> slots, relaid_slots;
  AttentionMetadata md;

  // Valid strided layouts of the same values, junk in between: a view of a larger table.
  void relay_block_table(bool transposed) {
    const int64_t rows = md.block_table.size(0), cols = md.block_table.size(1);
    relaid_table.assign(size_t(2 * rows * cols + 1), -7);
    const int64_t s0 = transposed ? 1 : 2 * cols, s1 = transposed ? 2 * rows : 2;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j)
        relaid_table[size_t(i * s0 + j * s1)] = block_table[size_t(i * cols + j)];
    }
    md.block_table.data = relaid_table.data();
    md.block_table.strides[0] = s0;
    md.block_table.strides[1] = s1;
  }
  void relay_slots() {
    const int64_t n = md.slot_mapping.size(0);
    relaid_slots.assign(size_t(2 * n + 1), -7);
    for (int64_t t = 0; t < n; ++t) relaid_slots[size_t(2 * t)] = slots[size_t(t)];
    md.slot_mapping.data = relaid_slots.data();
    md.slot_mapping.strides[0] = 2;
  }

  explicit Metadata(const StepMetadata& step) {
    md = step.view();
    qsl = padded(step.query_start_loc);
    seq_lens = padded(step.seq_lens);
    block_table = padded(step.block_table);
    slots = padded(step.slot_mapping);
    md.query_start_loc.data = qsl.data();
    md.query_start_loc_cpu.data = qsl.data();
    md.seq_lens.data = seq_lens.data();
    md.seq_lens_cpu.data = seq_lens.data();
    md.block_table.data = block_table.data();
    md.slot_mapping.data = slots.data();
  }
  template <class T>
  static std::vector<T> padded(const std::vector<T>& v) {
    std::vector<T> out(v);
    out.resize(2 * v.size() + kSpare, T(7));  // room for a view retyped to twice the width
    return out;
  }
};

// What the validator read: every metadata view copied element by element through its strides
// into dense arrays. An accepted step rerun on these must give the same bits, so a backend that
// reads a view differently from the validator (ignores a stride) is caught.
struct DenseCopy {
  std::vector<int32_t> qsl, seq_lens, block_table;
  std::vector<int64_t> slots;
  AttentionMetadata md;

  template <class T>
  static std::vector<T> dense(const TensorView& v) {
    std::vector<T> out;
    const int64_t rows = v.size(0), cols = v.ndim == 2 ? v.size(1) : 1;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t at = i * v.stride(0) + (v.ndim == 2 ? j * v.stride(1) : 0);
        out.push_back(static_cast<const T*>(v.data)[at]);
      }
    }
    return out;
  }
  explicit DenseCopy(const AttentionMetadata& from) : md(from) {
    qsl = dense<int32_t>(from.query_start_loc_cpu);
    seq_lens = dense<int32_t>(from.seq_lens_cpu);
    block_table = dense<int32_t>(from.block_table);
    slots = dense<int64_t>(from.slot_mapping);
    md.query_start_loc = md.query_start_loc_cpu =
        TensorView::contiguous(qsl.data(), DType::kI32, {int64_t(qsl.size())});
    md.seq_lens = md.seq_lens_cpu =
        TensorView::contiguous(seq_lens.data(), DType::kI32, {int64_t(seq_lens.size())});
    md.block_table = TensorView::contiguous(block_table.data(), DType::kI32,
                                            {from.block_table.size(0), from.block_table.size(1)});
    md.slot_mapping = TensorView::contiguous(slots.data(), DType::kI64, {int64_t(slots.size())});
  }
};

// A layer input the damages may shorten, retype or stride: its name and view.
struct NamedView {
  const char* name;
  TensorView* view;
};

inline int bad_int(std::mt19937& rng, int64_t near) {
  const int64_t choices[] = {-1, -2, INT_MIN, INT_MAX, near - 1, near + 1, near + 1000, 0};
  std::uniform_int_distribution<size_t> d(0, std::size(choices) - 1);
  const int64_t v = choices[d(rng)];
  return int(std::clamp<int64_t>(v, INT_MIN, INT_MAX));
}

template <class T>
inline std::string damage_element(std::vector<T>& data, int64_t size, const char* name,
                                  std::mt19937& rng) {
  if (size <= 0) return std::string(name) + ": empty, untouched";
  std::uniform_int_distribution<int64_t> at(0, size - 1);
  const int64_t i = at(rng);
  const T before = data[size_t(i)];
  data[size_t(i)] = T(bad_int(rng, int64_t(before)));
  return std::string(name) + "[" + std::to_string(i) + "]: " + std::to_string(before) + " -> " +
         std::to_string(data[size_t(i)]);
}

inline TensorView* metadata_view(AttentionMetadata& md, int which, const char** name) {
  static const char* names[] = {"query_start_loc_cpu", "seq_lens_cpu", "block_table",
                                "slot_mapping"};
  *name = names[which];
  switch (which) {
    case 0:
      return &md.query_start_loc_cpu;
    case 1:
      return &md.seq_lens_cpu;
    case 2:
      return &md.block_table;
    default:
      return &md.slot_mapping;
  }
}

inline std::string damage_tensor(const std::vector<NamedView>& inputs, std::mt19937& rng) {
  const NamedView& in = inputs[std::uniform_int_distribution<size_t>(0, inputs.size() - 1)(rng)];
  TensorView& t = *in.view;
  switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
    case 0:
      t.shape[0] = t.shape[0] > 0 ? t.shape[0] - 1 : 0;
      return std::string(in.name) + " rows -> " + std::to_string(t.shape[0]);
    case 1:
      t.shape[size_t(t.ndim - 1)] += 1;
      return std::string(in.name) + " one column more";
    case 2:
      t.dtype = t.dtype == DType::kF32 ? DType::kF16 : DType::kF32;
      return std::string(in.name) + " retyped";
    default:  // every stride doubled: a view of every other element, rows not overlapping
      for (int d = 0; d < t.ndim; ++d) t.strides[size_t(d)] *= 2;
      return std::string(in.name) + " every stride doubled";
  }
}

// One damage to a step: a metadata field or view, or one of the layer's inputs.
inline std::string damage(Metadata& m, const std::vector<NamedView>& inputs, std::mt19937& rng) {
  AttentionMetadata& md = m.md;
  std::uniform_int_distribution<int> kind(0, 20);
  std::uniform_int_distribution<int> which(0, 3);
  const char* name = nullptr;
  switch (kind(rng)) {
    case 0:
      return "none";
    case 1:
      md.num_seqs = bad_int(rng, md.num_seqs);
      return "num_seqs -> " + std::to_string(md.num_seqs);
    case 2:
      md.num_actual_tokens = bad_int(rng, md.num_actual_tokens);
      return "num_actual_tokens -> " + std::to_string(md.num_actual_tokens);
    case 3:
      md.max_query_len = bad_int(rng, md.max_query_len);
      return "max_query_len -> " + std::to_string(md.max_query_len);
    case 4:
      md.max_seq_len = bad_int(rng, md.max_seq_len);
      return "max_seq_len -> " + std::to_string(md.max_seq_len);
    case 5:
      return damage_element(m.qsl, md.num_seqs + 1, "query_start_loc", rng);
    case 6:
      return damage_element(m.seq_lens, md.num_seqs, "seq_lens", rng);
    case 7:
      return damage_element(m.block_table, md.block_table.numel(), "block_table", rng);
    case 8:
      return damage_element(m.slots, md.slot_mapping.numel(), "slot_mapping", rng);
    case 9: {
      TensorView* t = metadata_view(md, which(rng), &name);
      *t = TensorView{};
      return std::string(name) + " undefined";
    }
    case 10: {
      TensorView* t = metadata_view(md, which(rng), &name);
      t->dtype = t->dtype == DType::kI32 ? DType::kI64 : DType::kI32;
      return std::string(name) + " dtype changed";
    }
    case 11: {
      TensorView* t = metadata_view(md, which(rng), &name);
      t->shape[0] += std::uniform_int_distribution<int>(0, 1)(rng) ? 1 : -1;
      if (t->shape[0] < 0) t->shape[0] = 0;
      return std::string(name) + " size(0) -> " + std::to_string(t->shape[0]);
    }
    case 12: {
      TensorView* t = metadata_view(md, which(rng), &name);
      const int dim = t->ndim - 1;
      t->strides[size_t(dim)] *= 2;
      return std::string(name) + " stride(" + std::to_string(dim) + ") doubled";
    }
    case 13:
      md.causal = !md.causal;
      return "causal flipped";
    case 14:
      md.query_start_loc_cpu = TensorView{};
      md.seq_lens_cpu = TensorView{};
      return "host mirrors undefined";
    case 15:
    case 16:
    case 17:
      return damage_tensor(inputs, rng);
    case 18:
      m.relay_block_table(false);
      return "block_table re-laid with column stride 2 (valid)";
    case 19:
      m.relay_block_table(true);
      return "block_table re-laid column-major (valid)";
    default:
      m.relay_slots();
      return "slot_mapping re-laid with stride 2";  // write_kv wants it dense
  }
}

inline bool all_finite(const std::vector<double>& values) {
  return std::all_of(values.begin(), values.end(), [](double x) { return std::isfinite(x); });
}

// What one damaged call did: ran, or refused with this message.
struct Outcome {
  bool ran = false;
  std::string refusal;
};

// A fuzz test's calls: how many ran, and the refusals by the first word of their message.
struct Tally {
  int ran = 0, cases = 0;
  std::map<std::string, int> refusals;

  void count(const Outcome& o) {
    ++cases;
    if (o.ran) ++ran;
    if (!o.refusal.empty()) refusals[o.refusal.substr(0, o.refusal.find_first_of(" ([:"))]++;
  }
  // "[label] 137 of 600 cases ran; refusals by first word: key:33 ..." on stdout.
  void print(const std::string& label) const {
    std::string s;
    for (const auto& [head, n] : refusals) s += " " + head + ":" + std::to_string(n);
    std::printf("[%s] %d of %d cases ran; refusals by first word:%s\n", label.c_str(), ran, cases,
                s.c_str());
  }
};

// Names case i on stderr when PAGEDATTN_FUZZ_VERBOSE is set: a sanitizer stops the process
// without gtest's trace.
inline void announce(int i, const std::string& what) {
  if (std::getenv("PAGEDATTN_FUZZ_VERBOSE")) std::fprintf(stderr, "case %d: %s\n", i, what.c_str());
}

// Runs forward(inputs, output) on the damaged step `m` (`what` names the damage) and checks the
// rule of the input fuzz tests: it throws pagedattn::Error (never for a damage named "none" or
// "... (valid)") or it runs, writing rows [0, rows) of `output` with finite values that a rerun
// on dense copies of the metadata (as the validator read it) and of the inputs (as their
// strides say) reproduces bit for bit. Forward is void(const std::vector<TensorView>& inputs,
// const TensorView& output).
// Bytes from a view's first element to just past its last (strides >= 0; 0 when empty).
inline size_t span_bytes(const TensorView& v) {
  if (!v.defined() || v.numel() == 0) return 0;
  int64_t last = 0;
  for (int d = 0; d < v.ndim; ++d) last += (v.size(d) - 1) * v.stride(d);
  return size_t(last + 1) * dtype_size(v.dtype);
}

// Host views put on a device with the same shapes, strides and dtypes: the bytes each view
// spans are copied into a buffer of its own (kept here), so a damaged view stays as damaged.
struct OnDevice {
  Device device;
  std::vector<Tensor> buffers;

  TensorView put(const TensorView& host) {
    if (!host.defined() || device.is_cpu()) return host;
    TensorView v = host;
    v.device = device;
    const size_t bytes = span_bytes(host);
    if (bytes == 0) return v;
    buffers.push_back(Tensor::empty({int64_t(bytes)}, DType::kU8, device));
    require_device(device).copy(buffers.back().data(), device, host.data, Device::cpu(), bytes);
    v.data = buffers.back().data();
    return v;
  }
  // A step's metadata with the arrays the kernels read on the device (mirrors stay host).
  AttentionMetadata put(const AttentionMetadata& host) {
    AttentionMetadata md = host;
    md.query_start_loc = put(host.query_start_loc);
    md.seq_lens = put(host.seq_lens);
    md.block_table = put(host.block_table);
    md.slot_mapping = put(host.slot_mapping);
    return md;
  }
  // Runs forward(inputs, output) on device copies and copies the output's span back.
  template <class Forward>
  void run(const std::vector<TensorView>& inputs, const TensorView& output, Forward&& forward) {
    std::vector<TensorView> in;
    for (const TensorView& x : inputs) in.push_back(put(x));
    const TensorView out = put(output);  // the host output is poisoned: so is the copy
    forward(in, out);
    if (!device.is_cpu() && span_bytes(output) > 0) {
      require_device(device).copy(output.data, Device::cpu(), out.data, device, span_bytes(output));
    }
  }
};

// One damaged step of an Attention layer configured as `c`: the requests' metadata, query /
// key / value rows of N(0, 1), a poisoned output, then one damage() to any of them. Neither
// copyable nor movable (the views point into its own members).
struct DamagedLayerStep {
  Metadata m;
  int64_t tokens;
  Rows q, k, v, out;
  std::vector<TensorView> inputs;
  TensorView output;
  std::string what;

  DamagedLayerStep(const AttentionConfig& c, const std::vector<RequestSpec>& requests,
                   std::mt19937& rng)
      : m(build(c, requests)),
        tokens(m.md.num_actual_tokens),
        q(random_rows(c.dtype, {tokens, int64_t(c.num_heads) * c.head_size}, rng)),
        k(random_rows(c.dtype, {tokens, int64_t(c.num_kv_heads) * c.head_size}, rng)),
        v(random_rows(c.dtype, {tokens, int64_t(c.num_kv_heads) * c.head_size}, rng)),
        out(poisoned_rows(c.dtype, {tokens, int64_t(c.num_heads) * c.head_size})),
        inputs{q.view, k.view, v.view},
        output(out.view) {
    what = damage(
        m, {{"query", &inputs[0]}, {"key", &inputs[1]}, {"value", &inputs[2]}, {"output", &output}},
        rng);
  }
  DamagedLayerStep(const DamagedLayerStep&) = delete;
  DamagedLayerStep& operator=(const DamagedLayerStep&) = delete;

 private:
  static StepMetadata build(const AttentionConfig& c, const std::vector<RequestSpec>& requests) {
    MetadataBuilder builder(c.block_size);
    builder.causal(c.causal());
    for (const RequestSpec& r : requests) builder.add(r);
    return builder.build();
  }
};

// Writes finite K/V into every slot of the layer's cache (on `device`): one request owning
// every block.
inline void fill_layer_cache(ForwardContext& ctx, Attention& layer, int num_blocks,
                             std::mt19937& rng, Device device = Device::cpu()) {
  const AttentionConfig& c = layer.config();
  RequestSpec all;
  all.num_new_tokens = num_blocks * c.block_size;
  for (int b = 0; b < num_blocks; ++b) all.block_ids.push_back(b);
  StepMetadata step = MetadataBuilder(c.block_size).add(all).build();
  const AttentionMetadata md = step.to_device(device);
  const int64_t t = all.num_new_tokens;
  const Tensor q = Tensor::copy_of(
      random_rows(c.dtype, {t, int64_t(c.num_heads) * c.head_size}, rng).view, device);
  const Tensor k = Tensor::copy_of(
      random_rows(c.dtype, {t, int64_t(c.num_kv_heads) * c.head_size}, rng).view, device);
  const Tensor v = Tensor::copy_of(
      random_rows(c.dtype, {t, int64_t(c.num_kv_heads) * c.head_size}, rng).view, device);
  ctx.begin_step({&md});
  layer.forward(q.view(), k.view(), v.view());
  ctx.end_step();
}

// Inputs, output and metadata are host views; on another `device` the step runs on copies of
// them there (OnDevice), the values compared on the host.
template <class Forward>
Outcome run_damaged(ForwardContext& ctx, const Metadata& m, const std::vector<TensorView>& inputs,
                    const TensorView& output, int64_t rows, const std::string& what,
                    Forward&& forward, Device device = Device::cpu()) {
  Outcome outcome;
  OnDevice first{device, {}};
  const AttentionMetadata md = first.put(m.md);
  ctx.begin_step({&md});
  try {
    first.run(inputs, output, forward);
    ctx.end_step();
    outcome.ran = true;
  } catch (const Error& e) {
    ctx.end_step();
    outcome.refusal = e.what();
    EXPECT_FALSE(outcome.refusal.empty());
    const bool valid = what == "none" || what.find("(valid)") != std::string::npos;
    EXPECT_FALSE(valid) << "a valid step was refused: " << outcome.refusal;
    return outcome;
  } catch (const std::exception& e) {
    ctx.end_step();
    ADD_FAILURE() << "threw a non-pagedattn exception: " << e.what();
    return outcome;
  }
  const std::vector<double> got = row_values(output, rows);
  EXPECT_TRUE(all_finite(got)) << "an accepted step left an element unwritten or non-finite";
  DenseCopy dense(m.md);
  std::vector<Tensor> dense_inputs;
  std::vector<TensorView> dense_views;
  for (const TensorView& in : inputs) {
    dense_inputs.push_back(in.defined() ? Tensor::copy_of(in, Device::cpu()) : Tensor{});
    dense_views.push_back(in.defined() ? dense_inputs.back().view() : TensorView{});
  }
  Rows dense_out = poisoned_rows(output.dtype, output.shape_vector());
  OnDevice second{device, {}};
  const AttentionMetadata dense_md = second.put(dense.md);
  ctx.begin_step({&dense_md});
  second.run(dense_views, dense_out.view, forward);
  ctx.end_step();
  EXPECT_TRUE(got == row_values(dense_out.view, rows))
      << "the step read its arguments differently from the validator or their strides";
  return outcome;
}

}  // namespace pagedattn::testing
