// MLAAttention::forward on CUDA tensors: the latent write, the absorbed query, the attention and
// the up-projection all enqueued on the device, with no host synchronisation (graph-capturable
// once the weights are uploaded and the context's workspace has grown: the first forward does
// both). Without CUDA in the build, device tensors are refused.
#include "core/mla_device.h"

#include <memory>

#include "core/mla_prefill.h"
#include "pagedattn/error.h"
#include "pagedattn/mla.h"

#ifdef PAGEDATTN_WITH_CUDA
#include "cuda/common/check.h"
#include "cuda/mla/proj.h"
#endif

namespace pagedattn {

using detail::require;

#ifdef PAGEDATTN_WITH_CUDA
namespace {

// Offsets of the workspace's parts: the attention kernels' scratch wants 256-byte alignment.
size_t aligned_up(size_t bytes) {
  constexpr size_t kAlign = 256;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

}  // namespace
#endif

void MLAAttention::forward_on_device(const TensorView& q, const TensorView& kv_c,
                                     const TensorView& k_pe, const AttentionMetadata* md,
                                     const TensorView& output) {
  for (const TensorView* t : {&kv_c, &k_pe, &output}) {
    require(t->device == q.device, "MLAAttention: q, kv_c_normed, k_pe and output must be on one ",
            "device; q is on ", to_string(q.device), ", got ", describe(*t));
  }
#ifndef PAGEDATTN_WITH_CUDA
  (void)md;
  detail::fail<NotSupported>("MLAAttention: ", describe(q),
                             " is on a device, and this build of pagedattn has no CUDA");
#else
  require<NotSupported>(q.device.is_cuda() && q.device == options_.device,
                        "MLAAttention: tensors on ", to_string(q.device),
                        " need a layer built for that device (MLAOptions::device is ",
                        to_string(options_.device), ")");
  if (md == nullptr) {  // profiling run
    cuda::mla::zero_rows(output, stream_.handle);
    return;
  }
  require(!w_uk_t_.empty(), "load_kv_b_proj() must be called before forward()");
  require(cache_.key.defined(), "bind_kv_cache() must be called before forward()");
  require(cache_.key.device == q.device, "the latent cache is on ", to_string(cache_.key.device),
          "; the step's tensors on ", to_string(q.device));
  // The device path runs every request absorbed: the prefill formulation's gathers and merges
  // are host code in this version.
  const detail::MLARequestSplit split =
      detail::split_mla_requests(*md, options_.formulation, options_.decode_threshold);
  require<NotSupported>(split.prefills.empty(), "MLAAttention on ", to_string(q.device),
                        " runs the absorbed formulation only; this step has ",
                        split.prefills.size(), " request(s) for the prefill formulation (use ",
                        "MLAFormulation::kAbsorbed, or a decode_threshold of at least the ",
                        "longest query)");
  const int n = options_.num_heads, p = options_.qk_nope_head_dim;
  const int v = options_.v_head_dim, l = options_.kv_lora_rank, e = config_.head_size;
  if (!device_weights_) {
    // One upload, synchronous (outside any capture: the first forward must run eagerly).
    auto w = std::make_unique<detail::MLADeviceWeights>();
    const TensorView uk = TensorView::contiguous(w_uk_t_.data(), DType::kF32, {n, p, l});
    const TensorView uv = TensorView::contiguous(w_uv_.data(), DType::kF32, {n, l, v});
    w->w_uk_t = Tensor::copy_of(uk, q.device);  // float32 [N, P, L]
    w->w_uv = Tensor::copy_of(uv, q.device);    // float32 [N, L, V]
    device_weights_ = std::move(w);
    // A pageable upload may still be in flight when copy_of returns, and a non-blocking stream
    // does not wait for the legacy one.
    PAGEDATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const DType act = config_.dtype;
  const int64_t ta = md->num_actual_tokens;
  const Plan& plan = context_.plan(0, *backend_, config_);
  // One workspace: the attention's scratch, then latent [Ta, 1, E], q_lat and o_lat [Ta, N, E].
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
  const TensorView o_lat = carve(plan_bytes + latent_bytes + heads_bytes, {ta, n, e});  // same
  // 1. The step's latent entries [kv_c | k_pe] (rounded to the activation dtype, as the host
  // path does) into the cache, one entry as K and V.
  cuda::mla::build_latent(kv_c, k_pe, latent, stream_.handle);
  const KVScales scales{k_scale_, k_scale_};
  impl_->write_kv({latent, latent, md->slot_mapping, cache_, scales, stream_});
  // 2. The absorbed query [q_nope W_UK^T | q_pe].
  cuda::mla::absorb_query(q, static_cast<const float*>(device_weights_->w_uk_t.data()), p, q_lat,
                          stream_.handle);
  // 3. MQA over the latent cache.
  ForwardArgs f;
  f.query = q_lat;
  f.kv_cache = cache_;
  f.scales = scales;
  f.metadata = md;
  f.output = o_lat;
  f.plan = &plan;
  f.workspace = Workspace{ws.data, plan.workspace_bytes()};
  f.stream = stream_;
  check_forward_args(config_, f, /*check_metadata=*/false);
  impl_->forward(f);
  // 4. The up-projection of o_lat's first L columns by W_UV.
  cuda::mla::up_project(o_lat, static_cast<const float*>(device_weights_->w_uv.data()), l, v, ta,
                        output, stream_.handle);
#endif
}

}  // namespace pagedattn
