// MLAAttention::forward on device tensors: the latent write, the absorbed query, the attention
// and the up-projection all enqueued on the device, with no host synchronisation
// (graph-capturable once the weights are uploaded and the context's workspace has grown: the
// first forward does both). The kernels around the attention are the selected backend's
// MLADeviceOps; a backend without them refuses device tensors.
#include "core/mla_device.h"

#include <memory>

#include "core/mla_prefill.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"
#include "pagedattn/mla_device_ops.h"

namespace pagedattn {

using detail::require;

namespace detail {

const MLADeviceOps& mla_device_ops_for(const Backend& backend, const TensorView& q) {
  const MLADeviceOps* ops = backend.mla_device_ops();
  if (ops == nullptr) {
    fail<NotSupported>("MLAAttention: q (", describe(q), ") is on a device, and backend '",
                       backend.name(), "' has no MLA device operations (mla_device_ops() is ",
                       "null); select a backend that runs MLA on ", to_string(q.device),
                       " or pass host tensors");
  }
  return *ops;
}

}  // namespace detail

namespace {

// Offsets of the workspace's parts: the attention kernels' scratch wants 256-byte alignment.
size_t aligned_up(size_t bytes) {
  constexpr size_t kAlign = 256;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

void MLAAttention::forward_on_device(const TensorView& q, const TensorView& kv_c,
                                     const TensorView& k_pe, const AttentionMetadata* md,
                                     const TensorView& output, Stream stream) {
  for (const TensorView* t : {&kv_c, &k_pe, &output}) {
    require(t->device == q.device, "MLAAttention: q, kv_c_normed, k_pe and output must be on one ",
            "device; q is on ", to_string(q.device), ", got ", describe(*t));
  }
  require<NotSupported>(q.device == options_.device, "MLAAttention: tensors on ",
                        to_string(q.device), " need a layer built for that device ",
                        "(MLAOptions::device is ", to_string(options_.device), ")");
  const MLADeviceOps& ops = detail::mla_device_ops_for(*backend_, q);
  if (md == nullptr) {  // profiling run
    ops.zero_rows(output, stream);
    return;
  }
  require(!w_uk_t_.empty(), "load_kv_b_proj() must be called before forward()");
  require(cache_.key.defined(), "bind_kv_cache() must be called before forward()");
  require(cache_.key.device == q.device, "the latent cache is on ", to_string(cache_.key.device),
          "; the step's tensors on ", to_string(q.device));
  const detail::MLARequestSplit split =
      detail::split_mla_requests(*md, options_.formulation, options_.decode_threshold);
  const int n = options_.num_heads, p = options_.qk_nope_head_dim;
  const int v = options_.v_head_dim, l = options_.kv_lora_rank, e = config_.head_size;
  if (!device_weights_) {
    // One upload, synchronous (outside any capture: the first forward must run eagerly).
    auto w = std::make_unique<detail::MLADeviceWeights>();
    const TensorView uk_t = TensorView::contiguous(w_uk_t_.data(), DType::kF32, {n, p, l});
    const TensorView uk = TensorView::contiguous(w_uk_.data(), DType::kF32, {n, l, p});
    const TensorView uv = TensorView::contiguous(w_uv_.data(), DType::kF32, {n, l, v});
    w->w_uk_t = Tensor::copy_of(uk_t, q.device);  // float32 [N, P, L]
    w->w_uk = Tensor::copy_of(uk, q.device);      // float32 [N, L, P]
    w->w_uv = Tensor::copy_of(uv, q.device);      // float32 [N, L, V]
    device_weights_ = std::move(w);
    // A pageable upload may still be in flight when copy_of returns, and a non-blocking stream
    // does not wait for the legacy one.
    require_device(q.device).synchronize(q.device.index);
  }
  const DType act = config_.dtype;
  const int64_t ta = md->num_actual_tokens;
  if (!split.prefills.empty()) {
    forward_split_on_device(q, kv_c, k_pe, *md, split.decodes, split.prefills, output, stream);
    return;
  }
  const Plan& plan = context_.plan(0, *backend_, config_);
  // One workspace: the attention's scratch, then latent [Ta, 1, E], q_lat [Ta, N, E] and o_lat
  // [Ta, N, L] (the backend writes P V's first L columns, the ones W_UV up-projects).
  const size_t plan_bytes = aligned_up(plan.workspace_bytes());
  const size_t latent_bytes = aligned_up(size_t(ta) * e * dtype_size(act));
  const size_t heads_bytes = aligned_up(size_t(ta) * n * e * dtype_size(act));
  const Workspace ws = context_.workspace(q.device, plan_bytes + latent_bytes + 2 * heads_bytes);
  auto* base = static_cast<uint8_t*>(ws.data);
  auto carve = [&](size_t offset, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(base + offset, act, shape, q.device);
  };
  const TensorView latent = carve(plan_bytes, {ta, 1, e});                // [Ta, 1, E]
  const TensorView q_lat = carve(plan_bytes + latent_bytes, {ta, n, e});  // [Ta, N, E]
  const TensorView o_lat = carve(plan_bytes + latent_bytes + heads_bytes, {ta, n, l});
  // 1. The step's latent entries [kv_c | k_pe] (rounded to the activation dtype, as the host
  // path does) into the cache, one entry as K and V.
  ops.build_latent(kv_c, k_pe, latent, stream);
  const KVScales scales{k_scale_, k_scale_};
  impl_->write_kv({latent, latent, md->slot_mapping, cache_, scales, stream});
  // 2. The absorbed query [q_nope W_UK^T | q_pe].
  ops.absorb_query(q, static_cast<const float*>(device_weights_->w_uk_t.data()), p, q_lat, nullptr,
                   stream);
  // 3. MQA over the latent cache.
  ForwardArgs f;
  f.query = q_lat;
  f.kv_cache = cache_;
  f.scales = scales;
  f.metadata = md;
  f.output = o_lat;
  f.plan = &plan;
  f.workspace = Workspace{ws.data, plan.workspace_bytes()};
  f.stream = stream;
  check_forward_args(config_, f, /*check_metadata=*/false);
  impl_->forward(f);
  // 4. The up-projection of o_lat by W_UV.
  ops.up_project(o_lat, static_cast<const float*>(device_weights_->w_uv.data()), l, v, ta, output,
                 nullptr, stream);
}

void MLAAttention::forward_split_on_device(const TensorView& q, const TensorView& kv_c,
                                           const TensorView& k_pe, const AttentionMetadata& md,
                                           const std::vector<int>& decodes,
                                           const std::vector<int>& prefills,
                                           const TensorView& output, Stream stream) {
  const MLADeviceOps& ops = detail::mla_device_ops_for(*backend_, q);
  const int n = options_.num_heads, p = options_.qk_nope_head_dim;
  const int v = options_.v_head_dim, l = options_.kv_lora_rank, e = config_.head_size;
  const DType act = config_.dtype;
  const Device dev = q.device;
  DeviceRuntime& runtime = require_device(dev);
  // 1. The step's latent entries into the cache, as the absorbed-only path does.
  const int64_t ta = md.num_actual_tokens;
  {
    Tensor latent = Tensor::empty({ta, 1, e}, act, dev);  // [Ta, 1, E]
    ops.build_latent(kv_c, k_pe, latent.view(), stream);
    const KVScales scales{k_scale_, k_scale_};
    impl_->write_kv({latent.view(), latent.view(), md.slot_mapping, cache_, scales, stream});
    runtime.synchronize_stream(dev.index, stream);  // before `latent` is freed
  }
  // 2. The decode requests absorbed, over metadata of their own: the host mirrors give the
  // rows and lengths, the block-table rows are copied on the device.
  if (!decodes.empty()) {
    const TensorView& bt = md.block_table;
    require<NotSupported>(bt.stride(1) == 1, "MLAAttention on ", to_string(dev),
                          ": a step mixing formulations needs block_table rows contiguous; got ",
                          describe(bt));
    const int m = int(bt.size(1));
    StepMetadata sub;
    sub.causal = md.causal;
    sub.max_blocks_per_seq = m;
    sub.query_start_loc.push_back(0);
    std::vector<int64_t> rows;
    auto i32 = [](const TensorView& t, int64_t i) {
      return static_cast<const int32_t*>(t.data)[i * t.stride(0)];
    };
    for (int r : decodes) {
      const int32_t begin = i32(md.query_start_loc_cpu, r);
      const int32_t q_len = i32(md.query_start_loc_cpu, r + 1) - begin;
      for (int32_t i = 0; i < q_len; ++i) rows.push_back(begin + i);
      sub.query_start_loc.push_back(sub.query_start_loc.back() + q_len);
      sub.seq_lens.push_back(i32(md.seq_lens_cpu, r));
      sub.max_query_len = std::max(sub.max_query_len, int(q_len));
      sub.max_seq_len = std::max(sub.max_seq_len, int(sub.seq_lens.back()));
    }
    sub.block_table.assign(decodes.size() * size_t(m), 0);
    sub.slot_mapping.assign(rows.size(), -1);  // written in step 1
    const AttentionMetadata dsub = sub.to_device(dev);
    const size_t row_bytes = size_t(m) * sizeof(int32_t);
    for (size_t i = 0; i < decodes.size(); ++i) {
      runtime.copy_2d_async(
          static_cast<int32_t*>(dsub.block_table.data) + i * size_t(m), row_bytes,
          static_cast<const int32_t*>(bt.data) + int64_t(decodes[i]) * bt.stride(0), row_bytes,
          row_bytes, 1, dev.index, stream);
    }
    const int64_t nr = int64_t(rows.size());
    const Tensor rows_dev =
        Tensor::copy_of(TensorView::contiguous(rows.data(), DType::kI64, {nr}), dev);  // [nr]
    const auto* row_ids = static_cast<const int64_t*>(rows_dev.data());
    Tensor q_lat = Tensor::empty({nr, n, e}, act, dev);  // [nr, N, E]
    Tensor o_lat = Tensor::empty({nr, n, l}, act, dev);  // [nr, N, L]: the latent columns
    ops.absorb_query(q, static_cast<const float*>(device_weights_->w_uk_t.data()), p, q_lat.view(),
                     row_ids, stream);
    const auto plan = backend_->plan(dsub, config_);
    const Workspace ws = context_.workspace(dev, plan->workspace_bytes());
    ForwardArgs f;
    f.query = q_lat.view();
    f.kv_cache = cache_;
    f.scales = KVScales{k_scale_, k_scale_};
    f.metadata = &dsub;
    f.output = o_lat.view();
    f.plan = plan.get();
    f.workspace = Workspace{ws.data, plan->workspace_bytes()};
    f.stream = stream;
    check_forward_args(config_, f, /*check_metadata=*/false);
    impl_->forward(f);
    ops.up_project(o_lat.view(), static_cast<const float*>(device_weights_->w_uv.data()), l, v, nr,
                   output, row_ids, stream);
    runtime.synchronize_stream(dev.index, stream);  // before the buffers above are freed
  }
  // 3. The prefill requests expanded (spec 5.4).
  if (!prefill_) prefill_ = std::make_unique<detail::MLAPrefill>(options_, *backend_);
  prefill_->forward_device(
      q, kv_c, k_pe, md, prefills, cache_, k_scale_,
      detail::MLADeviceWeightsView{static_cast<const float*>(device_weights_->w_uk.data()),
                                   static_cast<const float*>(device_weights_->w_uv.data())},
      context_, output, stream);
  runtime.synchronize_stream(dev.index, stream);  // the prefill's buffers are freed on return
}

}  // namespace pagedattn
