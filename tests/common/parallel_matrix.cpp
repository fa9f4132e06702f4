#include "common/parallel_matrix.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>

#include "common/exchange_sim.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "ref/ref_backend.h"

namespace pagedattn::test {

namespace bo = backend_ops;

namespace {

// Byte equality of two views of the same shape and dtype (any strides).
bool same_bytes(const TensorView& a, const TensorView& b) {
  const Tensor ca = Tensor::copy_of(a, Device::cpu()), cb = Tensor::copy_of(b, Device::cpu());
  return std::memcmp(ca.data(), cb.data(), ca.view().nbytes()) == 0;
}

RankShare refused(std::string why) {
  RankShare s;
  s.status = RankShare::kRefused;
  s.message = std::move(why);
  return s;
}

}  // namespace

std::string join_reasons(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : "; ") + p;
  return s;
}

namespace {

// The case's inputs and pre-step cache, nothing computed on them yet.
ParallelReference drawn_inputs(const bo::OpCase& k) {
  ParallelReference r;
  r.data = bo::make_case_data(k);
  r.cache0 = bo::make_initial_cache(k, r.data);
  r.num_actual_tokens = r.data.step.view().num_actual_tokens;
  return r;
}

}  // namespace

ParallelReference make_parallel_inputs(const bo::OpCase& k) {
  ParallelReference r = drawn_inputs(k);
  if (!r.cache0.defined()) return r;
  const AttentionConfig& c = k.config;
  r.exact.cache = Tensor::copy_of(r.cache0.view(), Device::cpu());
  const AttentionMetadata md = r.data.step.to_device(Device::cpu());
  if (md.num_slots() == 0) return r;
  const auto ref64 = ref::make_backend(ref::Precision::kFloat64);
  WriteKVArgs w{r.data.key.view(),   r.data.value.view(),
                md.slot_mapping,     bo::cache_view_of(r.exact.cache, c, k.latent),
                bo::write_scales(k), {}};
  check_write_kv_args(c, w);
  ref64->make_impl(c, Device::cpu())->write_kv(w);
  return r;
}

ParallelReference make_parallel_reference(const bo::OpCase& k) {
  ParallelReference r = drawn_inputs(k);
  const auto ref64 = ref::make_backend(ref::Precision::kFloat64);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  r.exact = bo::run_on(*ref64, k, r.data, r.cache0, DType::kF64, DType::kF64, Device::cpu(), 0);
  r.naive = bo::run_on(*lowp, k, r.data, r.cache0, k.config.dtype, DType::kF32, Device::cpu(), 0);
  return r;
}

void add_dcp_naive(ParallelReference& ref, const bo::OpCase& k, int world, DType partial_dtype) {
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  std::vector<RankShare> shares;
  for (int r = 0; r < world; ++r) {
    shares.push_back(dcp_rank_share(*lowp, k, ref, r, world, Device::cpu(), partial_dtype));
    if (shares.back().status != RankShare::kReady) return;
  }
  const TensorView o0 = shares[0].run.output.view(), l0 = shares[0].run.lse.view();
  const int64_t t = o0.size(0), h = o0.size(1), d = o0.size(2);
  Tensor partials = Tensor::empty({world, t, h, d}, partial_dtype);
  Tensor lses = Tensor::empty({world, h, l0.size(1)}, DType::kF32);
  for (int r = 0; r < world; ++r) {
    copy_tensor(partials.view().select(0, r), shares[size_t(r)].run.output.view());
    copy_tensor(lses.view().select(0, r), shares[size_t(r)].run.lse.view());
  }
  const auto [merged, merged_lse] = reference_merge_ranks(partials.view(), lses.view());
  ref.dcp_naive.output = Tensor::empty({t, h, d}, k.config.dtype);
  ref.dcp_naive.lse = Tensor::empty({h, l0.size(1)}, DType::kF32);
  for (int64_t i = 0; i < t * h * d; ++i) {
    store_element(ref.dcp_naive.output.data(), k.config.dtype, i,
                  load_element(merged.data(), DType::kF64, i));
  }
  for (int64_t i = 0; i < h * l0.size(1); ++i) {
    store_element(ref.dcp_naive.lse.data(), DType::kF32, i,
                  load_element(merged_lse.data(), DType::kF64, i));
  }
}

std::string check_parallel_rule(const ParallelReference& ref, DType dtype, const TensorView& out,
                                const TensorView& lse, bool dcp, std::string* errors) {
  const int64_t t_a = ref.num_actual_tokens;
  const auto rows = [t_a](const TensorView& t) { return t.slice(0, 0, t_a); };
  const auto cols = [t_a](const TensorView& t) { return t.slice(1, 0, t_a); };
  if (dcp && !ref.dcp_naive.output.defined()) return "no DCP budget (add_dcp_naive) for this case";
  const bo::RunOutputs& naive = dcp ? ref.dcp_naive : ref.naive;
  const ErrorStats e = compare(rows(out), rows(ref.exact.output.view()));
  const ErrorStats eb = compare(rows(naive.output.view()), rows(ref.exact.output.view()));
  const ErrorStats l = compare(cols(lse), cols(ref.exact.lse.view()));
  const ErrorStats lb = compare(cols(naive.lse.view()), cols(ref.exact.lse.view()));
  const Tolerance tol = default_tolerance(dtype), lse_tol = lse_tolerance(lb.max_ref);
  std::string why;
  if (!within_budget(e, eb, tol)) {
    why += detail::cat("output ", e.to_string(), " exceeds ", tol.multiple, " x ", eb.max_abs,
                       " + ", tol.atol, "; ");
  }
  if (!within_budget(l, lb, lse_tol)) {
    why += detail::cat("lse ", l.to_string(), " exceeds ", lse_tol.multiple, " x ", lb.max_abs,
                       " + ", lse_tol.atol, "; ");
  }
  if (errors != nullptr) {
    *errors = detail::cat("out ", e.max_abs, " (allowed ", tol.multiple * eb.max_abs + tol.atol,
                          ")  lse ", l.max_abs, " (allowed ",
                          lse_tol.multiple * lb.max_abs + lse_tol.atol, ")");
    if (dcp) {
      const ErrorStats single =
          compare(rows(ref.naive.output.view()), rows(ref.exact.output.view()));
      *errors += detail::cat("  out / single-rank allowance ",
                             e.max_abs / (tol.multiple * single.max_abs + tol.atol));
    }
  }
  return why;
}

// ---- tensor parallelism: each rank its query heads and KV heads ----

RankShare tp_rank_share(const Backend& backend, const bo::OpCase& k, const ParallelReference& ref,
                        int rank, int world, Device device) {
  const AttentionConfig& c = k.config;
  RankShare s;
  try {
    s.shard = TensorParallelShard::of(c.num_heads, c.num_kv_heads, rank, world);
  } catch (const InvalidArgument& e) {
    return refused(e.what());
  }
  const TensorParallelShard& shard = s.shard;
  bo::OpCase kr = k;
  kr.config = shard_config(c, shard);
  if (const auto why = backend.check({kr.config, device}); !why.empty()) {
    return refused(join_reasons(why));
  }
  const int hb = shard.head_begin, kb = shard.kv_head_begin;
  // Per-head scales: the rank's KV heads ([num_kv_heads], or each row of [num_seqs, kv_heads]).
  for (std::vector<float>* v : {&kr.k_scales, &kr.v_scales, &kr.q_scales}) {
    if (v->empty()) continue;
    std::vector<float> mine;
    for (size_t row = 0; row < v->size(); row += size_t(c.num_kv_heads)) {
      const auto first = v->begin() + std::ptrdiff_t(row) + kb;
      mine.insert(mine.end(), first, first + shard.num_kv_heads);
    }
    *v = std::move(mine);
  }
  bo::CaseData data = ref.data;
  data.query = Tensor::copy_of(ref.data.query.view().slice(1, hb, hb + shard.num_heads), {});
  data.key = Tensor::copy_of(ref.data.key.view().slice(1, kb, kb + shard.num_kv_heads), {});
  data.value = Tensor::copy_of(ref.data.value.view().slice(1, kb, kb + shard.num_kv_heads), {});
  Tensor cache0;
  if (uses_kv_cache(c.attn_type)) {
    const KVCache mine = KVCache::allocate(kr.config, ref.data.num_blocks);
    const KVCacheView whole = bo::cache_view_of(ref.cache0, c, k.latent);
    copy_tensor(mine.view().key, whole.key.slice(2, kb, kb + shard.num_kv_heads));
    copy_tensor(mine.view().value, whole.value.slice(2, kb, kb + shard.num_kv_heads));
    cache0 = mine.storage();
  }
  s.run = bo::run_on(backend, kr, data, cache0, c.dtype, DType::kF32, device, 0);
  if (cache0.defined()) {
    const KVCacheView got = bo::cache_view_of(s.run.cache, kr.config, k.latent);
    const KVCacheView want = bo::cache_view_of(ref.exact.cache, c, k.latent);
    if (!same_bytes(got.key, want.key.slice(2, kb, kb + shard.num_kv_heads)) ||
        !same_bytes(got.value, want.value.slice(2, kb, kb + shard.num_kv_heads))) {
      s.cache_mismatch = "the rank's KV heads differ from the reference's cache bytes";
    }
  }
  return s;
}

// ---- decode context parallelism: each rank its tokens of every request ----

RankShare dcp_rank_share(const Backend& backend, const bo::OpCase& k, const ParallelReference& ref,
                         int rank, int world, Device device, DType partial_dtype) {
  const AttentionConfig& c = k.config;
  if (const auto why = DecodeContextParallel::unsupported(c); !why.empty()) {
    return refused(join_reasons(why));
  }
  for (const bo::RequestShape& r : k.requests) {
    if (r.seq_len >= 0) {  // DcpRequest has context + query keys: no way to say fewer
      return refused("a request with fewer keys (" + std::to_string(r.seq_len) +
                     ") than query tokens (" + std::to_string(r.query_len) +
                     "): decode context parallelism's requests hold context + query keys");
    }
  }
  const auto dcp = DecodeContextParallel::of(rank, world);
  bo::OpCase kr = k;
  kr.config = dcp_config(c, dcp);
  if (const auto why = backend.check({kr.config, device}); !why.empty()) {
    return refused(join_reasons(why));
  }
  RankShare s;
  const int bs = c.block_size;
  // Local blocks from a shuffled pool (block 0 stays the null block).
  int64_t num_blocks = 1;
  for (const auto& r : k.requests) {
    num_blocks += (dcp.local_len(r.context_len + r.query_len) + bs - 1) / bs;
  }
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(k.seed + uint32_t(rank)));
  // The context: each owned position's bytes copied from the reference's pre-step cache, read
  // through the request's block table there (shared prefixes included).
  KVCache mine = KVCache::allocate(kr.config, num_blocks);
  fill_host(mine.storage().view(), 9.0);  // garbage in every slot the rank never receives
  const KVCacheView whole = bo::cache_view_of(ref.cache0, c, k.latent);
  const StepMetadata& global = ref.data.step;
  std::vector<DcpRequest> requests;
  size_t next = 0;
  for (size_t i = 0; i < k.requests.size(); ++i) {
    const bo::RequestShape& r = k.requests[i];
    DcpRequest req{r.context_len, r.query_len, {}};
    for (int64_t b = 0; b < (dcp.local_len(r.context_len + r.query_len) + bs - 1) / bs; ++b) {
      req.local_block_ids.push_back(pool[next++]);
    }
    std::vector<int64_t> slots;
    dcp_prefill_slots(r.context_len, req.local_block_ids, bs, dcp, slots);
    for (int j = 0; j < r.context_len; ++j) {
      if (slots[size_t(j)] < 0) continue;
      const int64_t g =
          int64_t(global.block_table[i * size_t(global.max_blocks_per_seq) + size_t(j / bs)]) * bs +
          j % bs;
      const int64_t l = slots[size_t(j)];
      for (auto [dst, src] :
           {std::pair{mine.view().key, whole.key}, std::pair{mine.view().value, whole.value}}) {
        copy_tensor(dst.select(0, l / bs).select(0, l % bs),
                    src.select(0, g / bs).select(0, g % bs));
      }
    }
    requests.push_back(std::move(req));
  }
  const DcpStep step = dcp_step_metadata(requests, bs, dcp);
  // Per-request scales ([num_seqs * num_kv_heads]): the DCP step has one request per query
  // row, so request i's row repeats for each of its query rows.
  const size_t hk = size_t(c.num_kv_heads), seqs = k.requests.size();
  for (std::vector<float>* v : {&kr.k_scales, &kr.v_scales, &kr.q_scales}) {
    if (v->size() != seqs * hk || seqs == 1) continue;
    std::vector<float> rows;
    for (size_t i = 0; i < seqs; ++i) {
      for (int t = 0; t < k.requests[i].query_len; ++t) {
        rows.insert(rows.end(), v->begin() + std::ptrdiff_t(i * hk),
                    v->begin() + std::ptrdiff_t((i + 1) * hk));
      }
    }
    *v = std::move(rows);
  }
  bo::CaseData data = ref.data;
  data.step = step.metadata;
  s.run = bo::run_on(backend, kr, data, mine.storage(), partial_dtype, DType::kF32, device, 0);
  dcp_clear_empty_rows(step, s.run.output.view(), s.run.lse.view());
  // The step's new tokens this rank owns hold the reference's bytes at their local slots.
  const KVCacheView got = bo::cache_view_of(s.run.cache, kr.config, k.latent);
  const KVCacheView want = bo::cache_view_of(ref.exact.cache, c, k.latent);
  int64_t owned = 0;
  for (size_t t = 0; t < step.metadata.slot_mapping.size(); ++t) {
    const int64_t l = step.metadata.slot_mapping[t], g = global.slot_mapping[t];
    if (l < 0) continue;
    ++owned;
    for (auto [a, b] : {std::pair{got.key, want.key}, std::pair{got.value, want.value}}) {
      if (!same_bytes(a.select(0, l / bs).select(0, l % bs),
                      b.select(0, g / bs).select(0, g % bs))) {
        s.cache_mismatch = detail::cat("new token of row ", t, " at local slot ", l,
                                       " differs from the reference's slot ", g);
      }
    }
  }
  s.owned_tokens = owned;
  return s;
}

}  // namespace pagedattn::test
