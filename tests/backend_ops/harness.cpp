#include "harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "ref/ref_backend.h"

namespace pagedattn::backend_ops {
namespace {

using detail::cat;

Tensor random_tensor(std::vector<int64_t> shape, DType dtype, float std_dev, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<float> dist(0.0f, std_dev);
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

Tensor poisoned(std::vector<int64_t> shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_host(t.view(), std::nan(""));
  return t;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

CaseData make_case_data(const OpCase& k) {
  const AttentionConfig& c = k.config;
  const int bs = c.block_size, hq = c.num_heads, hk = c.num_kv_heads, d = c.head_size;
  const int dv = c.head_size_v();
  std::mt19937 rng(k.seed);
  CaseData data;
  const bool cross = c.attn_type == AttentionType::kEncoderDecoder;
  const bool cached = uses_kv_cache(c.attn_type);

  // Physical blocks: a shuffled pool (block 0 stays the null block), so no request gets
  // contiguous or ordered blocks.
  int64_t needed = 1;
  for (const auto& r : k.requests) {
    needed += ceil_div(cross ? r.encoder_len : r.context_len + r.query_len, bs);
  }
  data.num_blocks = needed + 2;
  std::vector<int32_t> pool(size_t(data.num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;

  MetadataBuilder builder(bs);
  builder.causal(c.attn_type == AttentionType::kDecoder);
  std::vector<int32_t> previous_blocks;
  std::vector<int64_t> cross_slots;
  for (const auto& r : k.requests) {
    RequestSpec spec;
    spec.num_new_tokens = r.query_len;
    if (cross) {
      // seq_len = the encoder length, fixed below when the query is longer than it.
      spec.context_len = std::max(0, r.encoder_len - r.query_len);
    } else if (cached) {
      spec.context_len = r.context_len;
    }
    const int64_t seq_len = spec.context_len + spec.num_new_tokens;
    if (cached) {
      for (int64_t b = 0; b < ceil_div(cross ? r.encoder_len : seq_len, bs); ++b) {
        const bool shared = b < r.share_prefix_blocks && size_t(b) < previous_blocks.size();
        spec.block_ids.push_back(shared ? previous_blocks[size_t(b)] : pool[next++]);
      }
      // Earlier steps' tokens: the decoder context (minus a shared prefix, already written),
      // or the encoder output of a request whose encoder ran before.
      const int64_t ctx_begin = cross ? 0 : int64_t(r.share_prefix_blocks) * bs;
      const int64_t ctx_end = cross ? (r.encoder_runs ? 0 : r.encoder_len) : r.context_len;
      for (int64_t pos = ctx_begin; pos < ctx_end; ++pos) {
        data.context_slots.push_back(int64_t(spec.block_ids[size_t(pos / bs)]) * bs + pos % bs);
      }
      if (cross && r.encoder_runs) {
        for (int64_t pos = 0; pos < r.encoder_len; ++pos) {
          cross_slots.push_back(int64_t(spec.block_ids[size_t(pos / bs)]) * bs + pos % bs);
        }
      }
      previous_blocks = spec.block_ids;
      // A query longer than its encoder: the builder counts query_len keys; the extra table
      // columns point at the null block and are never read (seq_len is set back below).
      while (int64_t(spec.block_ids.size()) < ceil_div(seq_len, bs)) spec.block_ids.push_back(0);
    }
    builder.add(spec);
  }
  int64_t num_tokens = 0;
  for (const auto& r : k.requests) num_tokens += r.query_len;
  data.num_query_rows = num_tokens + k.pad_tokens;
  builder.pad_slots_to(int(data.num_query_rows));
  data.step = builder.build();
  if (!cross && cached) {
    // A query longer than its keys: its last seq_len rows are positions 0.. (written where the
    // builder put rows 0..), the rows before them sit at negative positions and write nothing.
    int64_t t0 = 0;
    for (size_t r = 0; r < k.requests.size(); ++r) {
      const RequestShape& rq = k.requests[r];
      if (rq.seq_len >= 0) {
        const int64_t shift = rq.query_len - rq.seq_len;
        for (int64_t i = rq.query_len - 1; i >= 0; --i) {
          data.step.slot_mapping[size_t(t0 + i)] =
              i < shift ? -1 : data.step.slot_mapping[size_t(t0 + i - shift)];
        }
        data.step.seq_lens[r] = rq.seq_len;
      }
      t0 += rq.query_len;
    }
  }
  if (cross) {
    data.step.slot_mapping = cross_slots;
    data.step.max_seq_len = 0;
    for (size_t r = 0; r < k.requests.size(); ++r) {
      data.step.seq_lens[r] = k.requests[r].encoder_len;
      data.step.max_seq_len = std::max(data.step.max_seq_len, k.requests[r].encoder_len);
    }
  }

  const float s = k.input_std;
  const float qs = k.query_std > 0 ? k.query_std : s, ks = k.key_std > 0 ? k.key_std : s;
  data.query = random_tensor({data.num_query_rows, hq, d}, c.dtype, qs, rng);
  const int64_t kv_rows = cross ? int64_t(cross_slots.size()) : data.num_query_rows;
  data.key = random_tensor({kv_rows, hk, d}, c.dtype, ks, rng);
  data.value = random_tensor({kv_rows, hk, dv}, c.dtype, s, rng);
  const auto nctx = int64_t(data.context_slots.size());
  data.context_key = random_tensor({nctx, hk, d}, c.dtype, ks, rng);
  data.context_value = random_tensor({nctx, hk, dv}, c.dtype, s, rng);
  if (k.latent) {
    data.value = Tensor::copy_of(data.key.view(), Device::cpu());
    data.context_value = Tensor::copy_of(data.context_key.view(), Device::cpu());
  }
  return data;
}

namespace {

TensorView slots_view(std::vector<int64_t>& slots) {
  return TensorView::contiguous(slots.data(), DType::kI64, {int64_t(slots.size())});
}

}  // namespace

KVCacheView cache_view_of(const Tensor& storage, KVCacheLayout layout, bool latent) {
  TensorView combined = storage.view();
  if (layout == KVCacheLayout::kHND) combined = combined.permute({0, 1, 3, 2, 4});
  KVCacheView v = KVCacheView::from_combined(combined);
  if (latent) v.value = v.key;
  return v;
}

KVCacheView cache_view_of(const Tensor& storage, const AttentionConfig& c, bool latent) {
  if (c.head_size_v() == c.head_size) return cache_view_of(storage, c.kv_cache_layout, latent);
  return split_cache_view(storage.view(), c.block_size, c.num_kv_heads, c.head_size,
                          c.head_size_v(), c.kv_cache_layout);
}

RunOutputs run_on(const Backend& backend, const OpCase& k, CaseData& data, const Tensor& cache0,
                  DType out_dtype, DType lse_dtype, Device device, int repeats) {
  const AttentionConfig& c = k.config;
  const KVScales scales = forward_scales(k);
  auto impl = backend.make_impl(c, device);
  StepMetadata& step = data.step;
  const AttentionMetadata md = step.to_device(device);
  const int64_t rows = data.num_query_rows;

  RunOutputs out;
  Tensor query = Tensor::copy_of(data.query.view(), device);
  Tensor key = Tensor::copy_of(data.key.view(), device);
  Tensor value = Tensor::copy_of(data.value.view(), device);
  const int out_cols = k.out_cols > 0 ? k.out_cols : c.head_size_v();
  Tensor output = Tensor::copy_of(poisoned({rows, c.num_heads, out_cols}, out_dtype), device);
  Tensor lse = Tensor::copy_of(poisoned({c.num_heads, rows}, lse_dtype), device);
  Tensor cache;
  KVCacheView cache_view;
  if (uses_kv_cache(c.attn_type)) {
    // Same bytes, same physical layout as the reference's pre-step cache.
    cache = Tensor::empty(cache0.view().shape_vector(), cache0.view().dtype, device);
    copy_tensor(cache.view(), cache0.view());
    cache_view = cache_view_of(cache, c, k.latent);
    if (md.num_slots() > 0) {
      WriteKVArgs w{key.view(), value.view(), md.slot_mapping, cache_view, write_scales(k), {}};
      check_write_kv_args(c, w);
      impl->write_kv(w);
    }
  }
  ForwardArgs f;
  f.query = query.view();
  if (!uses_kv_cache(c.attn_type)) {
    f.key = key.view();
    f.value = value.view();
  }
  f.kv_cache = cache_view;
  f.scales = scales;
  f.metadata = &md;
  f.output = output.view();
  f.lse = lse.view();
  auto plan = backend.plan(md, c);
  f.plan = plan.get();
  Tensor workspace;
  if (plan->workspace_bytes() > 0) {
    workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, device);
    f.workspace = {workspace.data(), plan->workspace_bytes()};
  }
  check_forward_args(c, f);
  impl->forward(f);
  if (repeats > 0) {
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      require_device(device).synchronize(device.index);
      const auto t0 = std::chrono::steady_clock::now();
      impl->forward(f);
      require_device(device).synchronize(device.index);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(times.begin(), times.begin() + long(times.size() / 2), times.end());
    out.seconds = times[times.size() / 2];
  }
  out.output = Tensor::copy_of(output.view(), Device::cpu());
  out.lse = Tensor::copy_of(lse.view(), Device::cpu());
  if (cache.defined()) out.cache = Tensor::copy_of(cache.view(), Device::cpu());
  return out;
}

Tensor make_initial_cache(const OpCase& k, CaseData& data) {
  const AttentionConfig& c = k.config;
  if (!uses_kv_cache(c.attn_type)) return {};
  KVCache cache = KVCache::allocate(c, data.num_blocks);
  auto ref = ref::make_backend();
  if (!data.context_slots.empty()) {
    KVCacheView view = cache.view();
    if (k.latent) view.value = view.key;
    WriteKVArgs w{data.context_key.view(),
                  data.context_value.view(),
                  slots_view(data.context_slots),
                  view,
                  write_scales(k),
                  {}};
    check_write_kv_args(c, w);
    ref->make_impl(c, Device::cpu())->write_kv(w);
  }
  return cache.storage();
}

namespace {

// First row < num_actual_tokens with a value still poisoned (NaN), or -1.
int64_t first_unwritten_row(const TensorView& out, int64_t num_actual_tokens) {
  for (int64_t t = 0; t < num_actual_tokens; ++t) {
    const TensorView row = out.select(0, t);
    for (int64_t i = 0; i < row.numel(); ++i) {
      if (std::isnan(load_element(row.data, row.dtype, i))) return t;
    }
  }
  return -1;
}

}  // namespace

CaseOracle make_oracle(const OpCase& k) {
  CaseOracle o;
  o.data = make_case_data(k);
  o.cache0 = make_initial_cache(k, o.data);
  const auto ref64 = ref::make_backend(ref::Precision::kFloat64);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  o.exact = run_on(*ref64, k, o.data, o.cache0, DType::kF64, DType::kF64, Device::cpu(), 0);
  o.naive = run_on(*lowp, k, o.data, o.cache0, k.config.dtype, DType::kF32, Device::cpu(), 0);
  return o;
}

CaseResult run_case(const Backend& backend, const OpCase& k, const RunOptions& options) {
  std::optional<CaseOracle> oracle;
  return run_case(backend, k, oracle, options);
}

CaseResult run_case(const Backend& backend, const OpCase& k, std::optional<CaseOracle>& oracle,
                    const RunOptions& options) {
  CaseResult res;
  const auto reasons = backend.check(BackendQuery{k.config, options.device});
  if (!reasons.empty()) {
    res.supported = false;
    for (const auto& r : reasons) res.message += (res.message.empty() ? "" : "; ") + r;
    return res;
  }
  if (!oracle) oracle = make_oracle(k);
  RunOutputs got;
  try {
    got = run_on(backend, k, oracle->data, oracle->cache0, k.config.dtype, DType::kF32,
                 options.device, options.perf_repeats);
  } catch (const NotSupported& e) {
    // An explicit refusal of what check() cannot see (the tensors' layout, e.g. a separate value
    // cache where a kernel reads one latent cache as K and V): reported, never compared.
    res.supported = false;
    res.message = cat("refused at run time: ", e.what());
    return res;
  }
  res = check_run(k, *oracle, got);
  res.seconds = got.seconds;
  return res;
}

CaseResult check_run(const OpCase& k, const CaseOracle& oracle, const RunOutputs& got) {
  CaseResult res;
  const RunOutputs& exact = oracle.exact;
  const RunOutputs& naive = oracle.naive;
  const int64_t t_a = oracle.data.step.view().num_actual_tokens;
  std::vector<std::string> failures;
  if (exact.cache.defined() &&
      std::memcmp(exact.cache.data(), got.cache.data(), exact.cache.view().nbytes()) != 0) {
    failures.push_back("the KV cache it wrote differs from the reference's bytes");
  }
  if (const int64_t row = first_unwritten_row(got.output.view(), t_a); row >= 0) {
    failures.push_back(cat("output row ", row, " (of ", t_a, " real tokens) was not written"));
  }
  const auto rows = [t_a](const Tensor& t) { return t.view().slice(0, 0, t_a); };
  const auto cols = [t_a](const Tensor& t) { return t.view().slice(1, 0, t_a); };
  res.output_error = compare(rows(got.output), rows(exact.output));
  res.output_budget = compare(rows(naive.output), rows(exact.output));
  res.lse_error = compare(cols(got.lse), cols(exact.lse));
  res.lse_budget = compare(cols(naive.lse), cols(exact.lse));
  const Tolerance tol = default_tolerance(k.config.dtype);
  if (!within_budget(res.output_error, res.output_budget, tol)) {
    failures.push_back(cat("output error ", res.output_error.to_string(), " exceeds ", tol.multiple,
                           " x ", res.output_budget.max_abs, " + ", tol.atol));
  }
  const Tolerance lse_tol = lse_tolerance(res.lse_budget.max_ref);
  if (!within_budget(res.lse_error, res.lse_budget, lse_tol)) {
    failures.push_back(cat("lse error ", res.lse_error.to_string(), " exceeds ", lse_tol.multiple,
                           " x ", res.lse_budget.max_abs, " + ", lse_tol.atol));
  }
  res.passed = failures.empty();
  for (const auto& f : failures) res.message += (res.message.empty() ? "" : "; ") + f;
  return res;
}

}  // namespace pagedattn::backend_ops
