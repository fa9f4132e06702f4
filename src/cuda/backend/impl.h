// One layer's CUDA implementation: its kernels resolved once, ALiBi slopes and sinks on the
// device, and the parameter building of write_kv and forward.
#pragma once

#include "cuda/attn_common/launch.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/cache_ops/launch.h"
#include "cuda/decode/launch.h"
#include "cuda/mla/launch.h"
#include "cuda/prefill/launch.h"
#include "pagedattn/backend.h"

namespace pagedattn::cuda {

class CudaImpl final : public AttentionImpl {
 public:
  /// Resolves the compiled kernels for `config` (throws NotSupported naming what is missing)
  /// and uploads ALiBi slopes and sinks to `device`.
  CudaImpl(const AttentionConfig& config, Device device, const BackendOptions& options);

  /// Launches on args.stream; allocates nothing; in checked mode validates every slot first.
  void write_kv(const WriteKVArgs& args) override;
  /// Launches the attention kernels on args.stream: the prefill kernel for requests with long
  /// queries (when one is compiled for the configuration), the decode kernel for the rest, and
  /// the split combine when the plan splits; each kernel picks its requests on the device.
  /// Allocates nothing and never synchronises (checked mode aside), so a step can be captured in a
  /// CUDA graph; every per-step array is read from device memory.
  void forward(const ForwardArgs& args) override;

 private:
  // forward's launches once `p` is built: the prefill kernel for the requests with more than
  // prefill::kDecodeMaxRows packed rows (all of them under PrefillRoute::kAll), the decode
  // kernel for the rest, then the split combine.
  void launch_attention(attn::AttnParams& p, const ForwardArgs& args, const TensorView& k,
                        const TensorView& v, bool cached, cudaStream_t stream) const;
  // Head size 576: the latent kernel (cuda/mla) and, when split, its combine.
  void forward_mla(const ForwardArgs& args, cudaStream_t stream);
  // The Hopper prefill kernel's TMA maps over K and V (attn::AttnParams::kv_tma), when
  // its instance, the cache's block size and the strides allow them.
  void set_prefill_tma(attn::AttnParams& p, const TensorView& k, const TensorView& v,
                       bool cached) const;
  // ... and over Q (attn::AttnParams::q_tma), when the group divides the kernel's rows and
  // the query's strides allow.
  void set_prefill_q_tma(attn::AttnParams& p, const TensorView& query) const;
  // The prefill kernels' pairs per group of their work-tile walk (attn::AttnParams::
  // pair_group): the option's, or as many (request, KV head) pairs as fit kPrefillL2Share of
  // the L2 at md.max_seq_len keys, at least kPrefillMinPairGroup (under the dynamic walk,
  // kPrefillL2ShareDynamic and kPrefillMinPairGroupDynamic).
  int prefill_pair_group(const AttentionMetadata& md, bool dynamic) const;

  AttentionConfig config_;
  Device device_;
  bool checked_;
  bool head_scales_;  // BackendOptions::head_scales
  PrefillRoute route_;
  bool bulk_copy_;
  bool prefill_tma_;          // BackendOptions::prefill_tma
  int prefill_persistent_;    // BackendOptions::prefill_persistent
  int prefill_pair_group_;    // BackendOptions::prefill_pair_group
  int prefill_resident_ = 0;  // prefill CTAs resident on the device at once
  int64_t l2_bytes_ = 0;      // the device's L2
  bool mla_tma_ = false;      // TMA for MLA tiles (at block sizes that are multiples of kBlockN)
  DType cache_dtype_;  // what the kernels read K/V as (the activation dtype for encoder types)
  const decode::DecodeKernel* decode_ = nullptr;
  const attn::CombineKernel* combine_ = nullptr;
  const prefill::PrefillKernel* prefill_ = nullptr;  // nullptr: the decode kernel takes all
  const cache_ops::WriteKVKernel* write_ = nullptr;
  const mla::MlaKernel* mla_ = nullptr;       // set: every forward runs the MLA kernel
  const mla::MlaKernel* mla_wide_ = nullptr;  // auto's kernel for outputs wider than mla_'s
  mla::NarrowMla mla_narrow_{};  // auto's kernels for steps of <= 16 / 32 rows a request
  const mla::MlaCombineKernel* mla_combine_ = nullptr;
  Tensor alibi_slopes_;  // float32 [num_heads] on the device, or undefined
  Tensor sinks_;         // float32 [num_heads] on the device, or undefined
  // int32 [1] on the device: the Hopper prefill's dynamic walk counter (AttnParams::
  // tile_counter; every launch leaves it 0), or undefined (BackendOptions::prefill_dynamic off).
  // The layer's forwards must run in stream order, as they do in an engine's step.
  Tensor tile_counter_;
};

}  // namespace pagedattn::cuda
