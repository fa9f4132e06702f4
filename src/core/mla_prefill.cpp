#include "core/mla_prefill.h"

#include <algorithm>
#include <limits>

#include "pagedattn/error.h"

namespace pagedattn::detail {

namespace {

int32_t i32_at(const TensorView& v, int64_t i) {
  return static_cast<const int32_t*>(v.data)[i * v.stride(0)];
}

int32_t block_at(const AttentionMetadata& md, int r, int64_t j) {
  const TensorView& bt = md.block_table;
  return static_cast<const int32_t*>(bt.data)[r * bt.stride(0) + j * bt.stride(1)];
}

// Rounds through the activation dtype, as a value stored in a tensor of it would be.
float rounded(float x, DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_float(float_to_bf16(x));
    case DType::kF16:
      return f16_to_float(float_to_f16(x));
    default:
      return x;
  }
}

// Stores n floats at element `index` of a contiguous activation-dtype array.
void store_row(void* base, DType dtype, int64_t index, const float* src, int n) {
  switch (dtype) {
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(base) + index;
      for (int i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(base) + index;
      for (int i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
      return;
    }
    case DType::kF32:
      std::copy(src, src + n, static_cast<float*>(base) + index);
      return;
    default:
      for (int i = 0; i < n; ++i) store_element(base, dtype, index + i, src[i]);
  }
}

// [rows, H, D] contiguous -> the [num_blocks = rows, block_size = 1, H, D] cache view of them.
TensorView as_one_token_blocks(const TensorView& rows) {
  TensorView v = rows;
  v.ndim = 4;
  v.shape = {rows.size(0), 1, rows.size(1), rows.size(2), 0, 0};
  v.strides = {rows.stride(0), rows.stride(0), rows.stride(1), rows.stride(2), 0, 0};
  return v;
}

// K [T, N, P + R] and V [T, N, v_width] in the activation dtype from latent rows [T, L + R]
// (kv_c | k_pe, float, already rounded to the activation dtype): K = [kv_c W_UK | k_pe], V =
// kv_c W_UV, followed by zero columns up to v_width = P + R for a backend that needs one head
// size for Q/K and V (spec 5.4's padding; the layer drops them).
void expand(const std::vector<float>& latent, int64_t num_tokens, const MLAOptions& o,
            const MLAWeights& w, const TensorView& k, const TensorView& v, int v_width) {
  const int n = o.num_heads, p = o.qk_nope_head_dim, r = o.qk_rope_head_dim;
  const int vd = o.v_head_dim, l = o.kv_lora_rank, e = l + r, d = p + r;
  std::vector<float> krow(static_cast<size_t>(d)), vrow(static_cast<size_t>(v_width), 0.0f);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* lat = &latent[size_t(t) * size_t(e)];
    for (int h = 0; h < n; ++h) {
      std::fill(krow.begin(), krow.begin() + p, 0.0f);
      std::fill(vrow.begin(), vrow.begin() + vd, 0.0f);
      for (int li = 0; li < l; ++li) {
        const float x = lat[li];
        const float* wk = &w.w_uk[(size_t(h) * l + size_t(li)) * size_t(p)];
        const float* wv = &w.w_uv[(size_t(h) * l + size_t(li)) * size_t(vd)];
        for (int pi = 0; pi < p; ++pi) krow[size_t(pi)] += x * wk[pi];
        for (int vi = 0; vi < vd; ++vi) vrow[size_t(vi)] += x * wv[vi];
      }
      std::copy(lat + l, lat + e, krow.begin() + p);
      store_row(k.data, k.dtype, (t * n + h) * d, krow.data(), d);
      store_row(v.data, v.dtype, (t * n + h) * v_width, vrow.data(), v_width);
    }
  }
}

// Latent entries of context positions [begin[i], begin[i] + len[i]) of each request, in that
// order, from the paged cache ([num_blocks, block_size, 1, L + R]) into `latent` [keys, L + R]:
// in the activation dtype, as vLLM gathers them into its workspace, fp8 read as
// stored * k_scale.
void gather_context(const AttentionMetadata& md, const std::vector<PrefillRequest>& reqs,
                    const std::vector<int64_t>& begin, const std::vector<int64_t>& len,
                    const KVCacheView& cache, float k_scale, DType act,
                    std::vector<float>& latent) {
  const TensorView& cv = cache.key;
  const int bs = cache.block_size(), e = cache.head_size();
  const double scale = is_fp8(cache.dtype()) ? double(k_scale) : 1.0;
  int64_t keys = 0;
  for (int64_t x : len) keys += x;
  latent.assign(size_t(keys) * size_t(e), 0.0f);
  float* lat = latent.data();
  for (size_t i = 0; i < reqs.size(); ++i) {
    for (int64_t pos = begin[i]; pos < begin[i] + len[i]; ++pos, lat += e) {
      const int64_t off =
          block_at(md, reqs[i].index, pos / bs) * cv.stride(0) + (pos % bs) * cv.stride(1);
      for (int c = 0; c < e; ++c) {
        lat[c] =
            rounded(float(load_element(cv.data, cv.dtype, off + c * cv.stride(3)) * scale), act);
      }
    }
  }
}

}  // namespace

MLARequestSplit split_mla_requests(const AttentionMetadata& md, MLAFormulation formulation,
                                   int decode_threshold) {
  MLARequestSplit s;
  for (int r = 0; r < md.num_seqs; ++r) {
    const int q_len = i32_at(md.query_start_loc_cpu, r + 1) - i32_at(md.query_start_loc_cpu, r);
    if (q_len == 0) continue;
    const bool decode = formulation == MLAFormulation::kAbsorbed ||
                        (formulation == MLAFormulation::kSplit && q_len <= decode_threshold);
    (decode ? s.decodes : s.prefills).push_back(r);
  }
  return s;
}

StepMetadata subset_metadata(const AttentionMetadata& md, const std::vector<int>& requests,
                             std::vector<int64_t>& rows) {
  StepMetadata s;
  s.causal = md.causal;
  s.max_blocks_per_seq = md.max_blocks_per_seq();
  s.query_start_loc.push_back(0);
  rows.clear();
  for (int r : requests) {
    const int32_t begin = i32_at(md.query_start_loc_cpu, r);
    const int32_t q_len = i32_at(md.query_start_loc_cpu, r + 1) - begin;
    const int32_t seq_len = i32_at(md.seq_lens_cpu, r);
    for (int32_t i = 0; i < q_len; ++i) rows.push_back(begin + i);
    s.query_start_loc.push_back(s.query_start_loc.back() + q_len);
    s.seq_lens.push_back(seq_len);
    s.max_query_len = std::max(s.max_query_len, int(q_len));
    s.max_seq_len = std::max(s.max_seq_len, int(seq_len));
    for (int j = 0; j < s.max_blocks_per_seq; ++j) s.block_table.push_back(block_at(md, r, j));
  }
  s.slot_mapping.assign(rows.size(), -1);
  return s;
}

StepMetadata one_token_block_step(const std::vector<PrefillRequest>& reqs,
                                  const std::vector<int64_t>& key_begin,
                                  const std::vector<int64_t>& key_len, bool causal) {
  StepMetadata s;
  s.causal = causal;
  s.query_start_loc.push_back(0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    s.max_query_len = std::max(s.max_query_len, int(reqs[i].q_len));
    s.max_seq_len = std::max(s.max_seq_len, int(key_len[i]));
  }
  s.max_blocks_per_seq = std::max(1, s.max_seq_len);
  for (size_t i = 0; i < reqs.size(); ++i) {
    s.query_start_loc.push_back(int32_t(reqs[i].row_begin + reqs[i].q_len));
    s.seq_lens.push_back(int32_t(key_len[i]));
    for (int j = 0; j < s.max_blocks_per_seq; ++j) {
      s.block_table.push_back(j < key_len[i] ? int32_t(key_begin[i] + j) : 0);
    }
  }
  s.slot_mapping.assign(size_t(s.query_start_loc.back()), -1);  // nothing is written
  return s;
}

PrefillPlan plan_prefill(const AttentionMetadata& md, const std::vector<int>& requests) {
  PrefillPlan plan;
  for (int ri : requests) {
    const int64_t begin = i32_at(md.query_start_loc_cpu, ri);
    const int64_t q_len = i32_at(md.query_start_loc_cpu, ri + 1) - begin;
    const int64_t cached = i32_at(md.seq_lens_cpu, ri) - q_len;
    plan.reqs.push_back({ri, begin, q_len, cached, plan.num_rows});
    plan.num_rows += q_len;
    plan.max_context = std::max(plan.max_context, cached);
    plan.with_context += cached > 0 ? 1 : 0;
  }
  return plan;
}

int64_t PrefillPlan::context_share(int64_t chunk_tokens, int block_size) const {
  int64_t share = std::max<int64_t>(1, chunk_tokens / std::max(1, with_context));
  if (share >= block_size) share -= share % block_size;
  return share;
}

int64_t PrefillPlan::chunk(int64_t c, int64_t share, std::vector<int64_t>& begin,
                           std::vector<int64_t>& key_begin, std::vector<int64_t>& key_len) const {
  begin.assign(reqs.size(), 0);
  key_begin.assign(reqs.size(), 0);
  key_len.assign(reqs.size(), 0);
  int64_t num_keys = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    begin[i] = std::min(reqs[i].context, c * share);
    key_len[i] = std::min(reqs[i].context, begin[i] + share) - begin[i];
    key_begin[i] = num_keys;
    num_keys += key_len[i];
  }
  return num_keys;
}

MLAPrefill::MLAPrefill(const MLAOptions& o, const Backend& backend)
    : options_(o), backend_(&backend) {
  AttentionConfig c;
  c.num_heads = o.num_heads;
  c.num_kv_heads = o.num_heads;
  c.head_size = o.qk_nope_head_dim + o.qk_rope_head_dim;
  c.scale = o.scale;
  c.dtype = o.dtype;
  c.kv_cache_dtype = KVCacheDType::kAuto;  // expanded K/V are activations
  c.block_size = 1;
  c.attn_type = AttentionType::kDecoder;
  causal_config_ = c;
  c.attn_type = AttentionType::kEncoderDecoder;
  context_config_ = c;
  // V at its own head size where the backend serves it (no zero columns to compute and drop).
  v_width_ = c.head_size;
  if (o.v_head_dim > 0 && o.v_head_dim < c.head_size) {
    AttentionConfig causal = causal_config_, ctx = context_config_;
    causal.v_head_size = ctx.v_head_size = o.v_head_dim;
    if (backend.check(BackendQuery{causal, o.device}).empty() &&
        backend.check(BackendQuery{ctx, o.device}).empty()) {
      causal_config_ = causal;
      context_config_ = ctx;
      v_width_ = o.v_head_dim;
    }
  }
  for (const AttentionConfig* cfg : {&causal_config_, &context_config_}) {
    cfg->validate();
    const std::vector<std::string> reasons = backend.check(BackendQuery{*cfg, o.device});
    if (!reasons.empty()) {
      std::string all;
      for (const std::string& r : reasons) all += (all.empty() ? "" : "; ") + r;
      fail<NotSupported>("MLAAttention's prefill formulation runs MHA of num_heads=", o.num_heads,
                         ", head_size=qk_nope_head_dim+qk_rope_head_dim=", cfg->head_size, " (",
                         to_string(cfg->attn_type), ", block_size 1), which backend '",
                         backend.name(), "' refuses: ", all,
                         ". Use formulation 'absorbed' or another backend");
    }
  }
  causal_impl_ = backend.make_impl(causal_config_, o.device);
  context_impl_ = backend.make_impl(context_config_, o.device);
}

MLAPrefill::~MLAPrefill() = default;

void MLAPrefill::attend(const AttentionConfig& config, AttentionImpl& impl, StepMetadata& md,
                        const TensorView& query, const TensorView& key, const TensorView& value,
                        ForwardContext& context, const TensorView& output, const TensorView& lse,
                        Stream stream) {
  validate_metadata(md.view(), config.attn_type, CacheGeometry{key.size(0), 1});
  const AttentionMetadata view = md.to_device(query.device);  // the host view on the CPU
  const auto plan = backend_->plan(view, config);
  ForwardArgs f;
  f.query = query;
  f.kv_cache = KVCacheView{as_one_token_blocks(key), as_one_token_blocks(value)};
  f.metadata = &view;
  f.output = output;
  f.lse = lse;
  f.plan = plan.get();
  f.workspace = context.workspace(query.device, plan->workspace_bytes());
  f.stream = stream;
  check_forward_args(config, f, /*check_metadata=*/false);
  impl.forward(f);
}

void MLAPrefill::forward(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe,
                         const AttentionMetadata& md, const std::vector<int>& requests,
                         const KVCacheView& cache, float k_scale, const MLAWeights& w,
                         ForwardContext& context, const TensorView& output, Stream stream) {
  const MLAOptions& o = options_;
  const int n = o.num_heads, p = o.qk_nope_head_dim, r = o.qk_rope_head_dim;
  const int vd = o.v_head_dim, l = o.kv_lora_rank, e = l + r, d = p + r;
  const DType act = o.dtype;
  const PrefillPlan plan = plan_prefill(md, requests);
  const std::vector<PrefillRequest>& reqs = plan.reqs;
  const int64_t tp = plan.num_rows;
  if (tp == 0) return;

  // The prefill queries [Tp, N, P + R] and the new tokens' K/V, from the inputs.
  Tensor query = Tensor::empty({tp, n, d}, act);
  std::vector<float> latent(size_t(tp) * size_t(e));
  for (const PrefillRequest& pr : reqs) {
    for (int64_t i = 0; i < pr.q_len; ++i) {
      const int64_t src = pr.q_begin + i, dst = pr.row_begin + i;
      for (int h = 0; h < n; ++h) {
        for (int c = 0; c < d; ++c) {
          store_element(
              query.data(), act, (dst * n + h) * d + c,
              load_element(q.data, q.dtype, src * q.stride(0) + h * q.stride(1) + c * q.stride(2)));
        }
      }
      float* lat = &latent[size_t(dst) * size_t(e)];
      for (int c = 0; c < l; ++c) {
        lat[c] = rounded(
            float(load_element(kv_c.data, kv_c.dtype, src * kv_c.stride(0) + c * kv_c.stride(1))),
            act);
      }
      for (int c = 0; c < r; ++c) {
        lat[l + c] = rounded(
            float(load_element(k_pe.data, k_pe.dtype, src * k_pe.stride(0) + c * k_pe.stride(1))),
            act);
      }
    }
  }
  const int dv = v_width_;
  Tensor k_new = Tensor::empty({tp, n, d}, act), v_new = Tensor::empty({tp, n, dv}, act);
  expand(latent, tp, o, w, k_new.view(), v_new.view(), dv);

  // Causal attention among each request's new tokens.
  std::vector<int64_t> key_begin, key_len;
  for (const PrefillRequest& pr : reqs) {
    key_begin.push_back(pr.row_begin);
    key_len.push_back(pr.q_len);
  }
  Tensor result = Tensor::empty({tp, n, dv}, act);
  Tensor result_lse = Tensor::empty({n, tp}, DType::kF32);
  StepMetadata causal_md = one_token_block_step(reqs, key_begin, key_len, true);
  attend(causal_config_, *causal_impl_, causal_md, query.view(), k_new.view(), v_new.view(),
         context, result.view(), result_lse.view(), stream);

  if (plan.with_context > 0) {
    // The cached context in chunks of at most context_chunk_tokens latent entries (the
    // workspace cap), an equal share per request with context (whole blocks when a block
    // fits, as vLLM rounds it), each chunk non-causal; a request whose context is used up has
    // no keys in a chunk (output 0, LSE -inf, which the merges skip).
    const int64_t share = plan.context_share(o.context_chunk_tokens, cache.block_size());
    const int64_t num_chunks = (plan.max_context + share - 1) / share;
    Tensor acc = Tensor::empty({tp, n, dv}, act), acc_lse = Tensor::empty({n, tp}, DType::kF32);
    Tensor part = Tensor::empty({tp, n, dv}, act), part_lse = Tensor::empty({n, tp}, DType::kF32);
    Tensor merged = Tensor::empty({tp, n, dv}, act);
    Tensor merged_lse = Tensor::empty({n, tp}, DType::kF32);
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      std::vector<int64_t> begin;
      const int64_t num_keys = plan.chunk(chunk, share, begin, key_begin, key_len);
      gather_context(md, reqs, begin, key_len, cache, k_scale, act, latent);
      Tensor k_ctx = Tensor::empty({num_keys, n, d}, act);
      Tensor v_ctx = Tensor::empty({num_keys, n, dv}, act);
      expand(latent, num_keys, o, w, k_ctx.view(), v_ctx.view(), dv);
      const bool first = chunk == 0;
      StepMetadata chunk_md = one_token_block_step(reqs, key_begin, key_len, false);
      attend(context_config_, *context_impl_, chunk_md, query.view(), k_ctx.view(), v_ctx.view(),
             context, first ? acc.view() : part.view(), first ? acc_lse.view() : part_lse.view(),
             stream);
      if (!first) {  // left to right, as vLLM merges its chunks
        backend_->merge_states({acc.view(), acc_lse.view(), part.view(), part_lse.view(),
                                merged.view(), merged_lse.view(), stream});
        std::swap(acc, merged);
        std::swap(acc_lse, merged_lse);
      }
    }
    backend_->merge_states(
        {acc.view(), acc_lse.view(), result.view(), result_lse.view(), merged.view(), {}, stream});
    std::swap(result, merged);
  }

  // Output rows: the first V columns of each head.
  for (const PrefillRequest& pr : reqs) {
    for (int64_t i = 0; i < pr.q_len; ++i) {
      const int64_t src = pr.row_begin + i, dst = pr.q_begin + i;
      for (int h = 0; h < n; ++h) {
        for (int c = 0; c < vd; ++c) {
          store_element(output.data, output.dtype,
                        dst * output.stride(0) + (int64_t(h) * vd + c) * output.stride(1),
                        load_element(result.data(), act, (src * n + h) * dv + c));
        }
      }
    }
  }
}

}  // namespace pagedattn::detail
