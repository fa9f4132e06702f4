// MLAPrefill::forward_device: the prefill formulation (mla_prefill.cpp's forward) on device
// tensors. The same passes and merges in the same order; the host loops become the backend's
// MLADeviceOps and its attention and merge_states, all on the layer's stream.
#include "core/mla_device.h"
#include "core/mla_prefill.h"
#include "pagedattn/error.h"
#include "pagedattn/mla_device_ops.h"

namespace pagedattn::detail {

namespace {

// Rows [begin, begin + len) of a [T, N, C] or [T, C] view.
TensorView rows_of(const TensorView& t, int64_t begin, int64_t len) {
  return t.slice(0, begin, begin + len);
}

// output [T, N * V] seen as [T, N, V].
TensorView as_heads(const TensorView& out, int n, int v) {
  TensorView h = out;
  h.ndim = 3;
  h.shape = {out.size(0), n, v, 0, 0, 0};
  h.strides = {out.stride(0), int64_t(v) * out.stride(1), out.stride(1), 0, 0, 0};
  return h;
}

}  // namespace

void MLAPrefill::forward_device(const TensorView& q, const TensorView& kv_c, const TensorView& k_pe,
                                const AttentionMetadata& md, const std::vector<int>& requests,
                                const KVCacheView& cache, float k_scale,
                                const MLADeviceWeightsView& w, ForwardContext& context,
                                const TensorView& output, Stream stream) {
  const MLAOptions& o = options_;
  const int n = o.num_heads, p = o.qk_nope_head_dim, r = o.qk_rope_head_dim;
  // MLADeviceOps::expand_kv pads V up to the Q/K size: device backends run that formulation.
  require(v_width_ == p + r, "MLA prefill on the device needs V padded to the Q/K head size; ",
          "backend '", backend_->name(), "' serves a V head size of its own on the host only");
  const int vd = o.v_head_dim, l = o.kv_lora_rank, e = l + r, d = p + r;
  const DType act = o.dtype;
  const Device dev = q.device;
  const MLADeviceOps& ops = mla_device_ops_for(*backend_, q);
  const PrefillPlan plan = plan_prefill(md, requests);
  const std::vector<PrefillRequest>& reqs = plan.reqs;
  const int64_t tp = plan.num_rows;
  if (tp == 0) return;

  // The prefill queries [Tp, N, P + R] and the new tokens' latent rows [Tp, L + R], request by
  // request (each one's rows are contiguous in the step).
  Tensor query = Tensor::empty({tp, n, d}, act, dev);
  Tensor latent = Tensor::empty({tp, e}, act, dev);
  for (const PrefillRequest& pr : reqs) {
    ops.copy_heads(rows_of(q, pr.q_begin, pr.q_len), rows_of(query.view(), pr.row_begin, pr.q_len),
                   stream);
    ops.build_latent(rows_of(kv_c, pr.q_begin, pr.q_len), rows_of(k_pe, pr.q_begin, pr.q_len),
                     rows_of(latent.view(), pr.row_begin, pr.q_len), stream);
  }
  Tensor k_new = Tensor::empty({tp, n, d}, act, dev), v_new = Tensor::empty({tp, n, d}, act, dev);
  ops.expand_kv(latent.view(), w.w_uk, w.w_uv, p, vd, k_new.view(), v_new.view(), stream);

  // Causal attention among each request's new tokens.
  std::vector<int64_t> key_begin, key_len;
  for (const PrefillRequest& pr : reqs) {
    key_begin.push_back(pr.row_begin);
    key_len.push_back(pr.q_len);
  }
  Tensor result = Tensor::empty({tp, n, d}, act, dev);
  Tensor result_lse = Tensor::empty({n, tp}, DType::kF32, dev);
  StepMetadata causal_md = one_token_block_step(reqs, key_begin, key_len, true);
  attend(causal_config_, *causal_impl_, causal_md, query.view(), k_new.view(), v_new.view(),
         context, result.view(), result_lse.view(), stream);

  if (plan.with_context > 0) {
    const int64_t share = plan.context_share(o.context_chunk_tokens, cache.block_size());
    const int64_t num_chunks = (plan.max_context + share - 1) / share;
    const float scale = is_fp8(cache.dtype()) ? k_scale : 1.0f;
    Tensor acc = Tensor::empty({tp, n, d}, act, dev);
    Tensor acc_lse = Tensor::empty({n, tp}, DType::kF32, dev);
    Tensor part = Tensor::empty({tp, n, d}, act, dev);
    Tensor part_lse = Tensor::empty({n, tp}, DType::kF32, dev);
    Tensor merged = Tensor::empty({tp, n, d}, act, dev);
    Tensor merged_lse = Tensor::empty({n, tp}, DType::kF32, dev);
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      std::vector<int64_t> begin;
      const int64_t num_keys = plan.chunk(chunk, share, begin, key_begin, key_len);
      // {request, position} of every key of the chunk, for the gather through the block table.
      Tensor keys_host = Tensor::empty({std::max<int64_t>(1, num_keys), 2}, DType::kI32);
      auto* kp = static_cast<int32_t*>(keys_host.data());
      for (size_t i = 0; i < reqs.size(); ++i) {
        for (int64_t j = 0; j < key_len[i]; ++j, kp += 2) {
          kp[0] = reqs[i].index;
          kp[1] = int32_t(begin[i] + j);
        }
      }
      const Tensor keys = Tensor::copy_of(keys_host.view(), dev);
      Tensor ctx_latent = Tensor::empty({num_keys, e}, act, dev);
      ops.gather_latent(cache.key, md.block_table, static_cast<const int32_t*>(keys.data()), scale,
                        ctx_latent.view(), stream);
      Tensor k_ctx = Tensor::empty({num_keys, n, d}, act, dev);
      Tensor v_ctx = Tensor::empty({num_keys, n, d}, act, dev);
      ops.expand_kv(ctx_latent.view(), w.w_uk, w.w_uv, p, vd, k_ctx.view(), v_ctx.view(), stream);
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
  const TensorView heads = result.view().slice(2, 0, vd);  // [Tp, N, V]
  const TensorView out = as_heads(output, n, vd);          // [T, N, V]
  for (const PrefillRequest& pr : reqs) {
    ops.copy_heads(rows_of(heads, pr.row_begin, pr.q_len), rows_of(out, pr.q_begin, pr.q_len),
                   stream);
  }
  // The buffers above are freed on return (the CUDA runtime's deallocate, cudaFree, waits for
  // the device), after their last use.
}

}  // namespace pagedattn::detail
