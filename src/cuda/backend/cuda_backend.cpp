// The `cuda` backend: what it serves (check), the per-step plan, the layer impl, and the
// device merge_states / amax.
#include "cuda/backend/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

#include "cuda/amax/launch.h"
#include "cuda/attn_common/launch.h"
#include "cuda/backend/impl.h"
#include "cuda/backend/mla_route.h"
#include "cuda/backend/plan.h"
#include "cuda/cache_ops/launch.h"
#include "cuda/common/check.h"
#include "cuda/common/device_props.h"
#include "cuda/decode/launch.h"
#include "cuda/merge/config.h"
#include "cuda/merge/launch.h"
#include "cuda/mla/launch.h"
#include "cuda/mla/proj.h"
#include "cuda/prefill/launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

using detail::cat;
using detail::require;

namespace {

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s.empty() ? "none" : s;
}

bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options) : options_(options) {}

  std::string_view name() const override { return "cuda"; }
  std::string_view description() const override {
    return "NVIDIA Hopper (sm_90a): paged decode with split-KV, prefill, MLA latent decode "
           "(head size 576), write_kv, merge_states, merge_ranks, amax";
  }
  std::vector<BackendOptionInfo> options() const override { return describe_options(options_); }
  std::unique_ptr<Backend> configured(const std::vector<std::string>& settings) const override {
    return make_backend(apply_settings(options_, settings));
  }

  std::vector<std::string> check(const BackendQuery& q) const override {
    std::vector<std::string> reasons;
    const AttentionConfig& c = q.config;
    bool hopper = false;  // the device runs the Hopper code (hopper_route)
    if (!q.device.is_cuda()) {
      reasons.push_back(cat("runs on CUDA devices only; the tensors are on ", to_string(q.device)));
    } else if (const int n = visible_device_count(); n == 0) {
      reasons.push_back(
          "no CUDA device is visible (no driver or GPU, or CUDA_VISIBLE_DEVICES hides them)");
    } else if (q.device.index < 0 || q.device.index >= n) {
      reasons.push_back(cat(to_string(q.device), " is past the ", n, " visible CUDA device(s)"));
    } else {
      const DeviceProps& d = device_props(q.device.index);
      if (d.cc_major < kMinCcMajor) {
        reasons.push_back(cat("the kernels need compute capability 8.0 or later (Ampere on); ",
                              to_string(q.device), " (", d.name, ") is compute capability ",
                              d.cc_major, ".", d.cc_minor));
      }
      hopper = hopper_route(q.device.index, options_);
    }
    if (!is_activation_dtype(c.dtype)) {
      reasons.push_back(cat("dtype ", dtype_name(c.dtype), " is not float32, float16 or bfloat16"));
      return reasons;
    }
    const bool cached = uses_kv_cache(c.attn_type);
    const DType cache = cached ? c.cache_dtype() : c.dtype;
    if (cached && cache_ops::find_write_kv(c.dtype, cache) == nullptr) {
      reasons.push_back(cat("write_kv is not compiled for ", dtype_name(c.dtype),
                            " activations into a ", dtype_name(cache), " cache"));
    }
    // V narrower than K runs on K's instance, V's columns past v_head_size zero in shared
    // memory: its rows move in 16-byte chunks as K's do.
    if (c.head_size_v() != c.head_size && is_mla_shape(c)) {
      reasons.push_back(cat("v_head_size ", c.head_size_v(),
                            " with head_size 576: the MLA latent kernel reads V as the latent part "
                            "of the one 576-wide entry (leave v_head_size unset; the output is "
                            "[..., 512])"));
    } else if (c.head_size_v() != c.head_size && !options_.v_head) {
      reasons.push_back(
          cat("v_head_size ", c.head_size_v(), " differs from head_size ", c.head_size,
              ": the cuda kernels take it with the option v_head=on (off by default "
              "until that path has run on a GPU); the cpu and ref backends serve it"));
    } else if (c.head_size_v() != c.head_size &&
               !attn::serves_head_size(c.head_size_v(), int64_t(dtype_size(cache)))) {
      reasons.push_back(cat("v_head_size ", c.head_size_v(), " over a ", dtype_name(cache),
                            " cache: the cuda kernels take V head sizes from 8 to ",
                            attn::kMaxHeadSize, " in steps of ", dtype_size(cache) == 1 ? 16 : 8,
                            " (16-byte chunks of V rows); the cpu and ref backends serve every "
                            "size"));
    }
    if (is_mla_shape(c)) {
      if (!hopper && q.device.is_cuda() && q.device.index >= 0 &&
          q.device.index < visible_device_count()) {
        reasons.push_back(
            cat("head_size 576 runs on the MLA latent kernel, which is Hopper code "
                "(wgmma); ",
                device_family(q.device.index, options_)));
      }
      for (std::string& r : mla_reasons(c)) reasons.push_back(std::move(r));
      if (c.query_quant) {
        reasons.push_back(
            "query_quant is not implemented by the MLA latent kernel (head size 576)");
      }
      return reasons;
    }
    if (decode::find_decode(c.dtype, cache, c.head_size) == nullptr) {
      const attn::KVKind kind = attn::kv_kind_for(c.dtype, cache);
      const std::vector<int> sizes = decode::compiled_head_sizes(c.dtype, kind);
      if (!attn::serves_head_size(c.head_size, int64_t(dtype_size(cache)))) {
        reasons.push_back(cat("head_size ", c.head_size, " over a ", dtype_name(cache),
                              " cache: the cuda kernels take head sizes from 8 to ",
                              attn::kMaxHeadSize, " in steps of ", dtype_size(cache) == 1 ? 16 : 8,
                              " (16-byte chunks of Q, K and V rows); the cpu and ref backends "
                              "serve every size"));
      } else {
        reasons.push_back(
            cat("head_size ", c.head_size, " is above every head size compiled for ",
                dtype_name(c.dtype), " activations with a ",
                kind == attn::KVKind::kFp8 ? "fp8" : dtype_name(cache),
                " cache (compiled: ", sizes.empty() ? std::string("none") : join_ints(sizes),
                "; the CMake option PAGEDATTN_CUDA_HEAD_SIZES sets the list)"));
      }
    }
    if (attn::find_combine(c.dtype) == nullptr) {
      reasons.push_back(cat("the split combine is not compiled for ", dtype_name(c.dtype)));
    }
    return reasons;
  }

  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& config,
                                           Device device) const override {
    return std::make_unique<CudaImpl>(config, device, options_);
  }

  const MLADeviceOps* mla_device_ops() const override { return &mla::device_ops(); }

  std::string device_info(Device device) const override {
    if (!device.is_cuda() || device.index < 0 || device.index >= visible_device_count()) return {};
    return device_family(device.index, options_);
  }

  std::unique_ptr<Plan> plan(const AttentionMetadata& md,
                             const AttentionConfig& config) const override {
    const bool cached = uses_kv_cache(config.attn_type);
    const DType cache = cached ? config.cache_dtype() : config.dtype;
    const decode::DecodeKernel* kernel = decode::find_decode(config.dtype, cache, config.head_size);
    int device = 0;
    if (md.seq_lens.defined() && md.seq_lens.device.is_cuda()) device = md.seq_lens.device.index;
    std::unique_ptr<CudaPlan> plan;
    const mla::MlaKernel* mla_kernel =
        is_mla_shape(config) && mla_reasons(config).empty()
            ? mla::find_mla(config.dtype, cache, config.num_heads, options_.mla_consumer)
            : nullptr;
    if (mla_kernel != nullptr && options_.mla_consumer == mla::Consumer::kAuto) {
      // The forward's choice (impl.cpp), asked with the latent width (see mla_for_step).
      const mla::NarrowMla narrow = {
          mla::find_mla(config.dtype, cache, config.num_heads, mla::Consumer::kSwapAB),
          mla::find_mla(config.dtype, cache, config.num_heads, mla::Consumer::kSwapAB32)};
      mla_kernel = mla::mla_for_step(mla_kernel, nullptr, narrow, md.max_query_len,
                                     config.num_heads, mla::kLatent);
    }
    if (mla_kernel != nullptr && device < visible_device_count()) {
      // Every request's rows on CTAs of the kernel's block_m (route_rows 0: the "prefill" row
      // count).
      plan = make_plan(md, config, device_props(device).num_sms, ctas_per_sm(*mla_kernel, device),
                       0, mla_kernel->block_m);
    } else if (kernel == nullptr || device >= visible_device_count()) {
      plan = make_plan(md, config, 0, 0);  // nothing to run on: an unsplit plan
    } else {
      // The route the impl takes (impl.cpp): rows past kDecodeMaxRows on the prefill kernel.
      const prefill::PrefillKernel* pk =
          options_.prefill == PrefillRoute::kOff
              ? nullptr
              : prefill::find_prefill(config.dtype, cache, config.head_size,
                                      hopper_route(device, options_) ? 9 : 8,
                                      options_.portable_prefill, config.query_quant);
      const int route = pk == nullptr                            ? -1
                        : options_.prefill == PrefillRoute::kAll ? 0
                                                                 : prefill::kDecodeMaxRows;
      plan = make_plan(md, config, device_props(device).num_sms, ctas_per_sm(*kernel, device),
                       route, pk != nullptr ? pk->block_m : 128,
                       pk != nullptr ? ctas_per_sm(*pk, device) : 0);
    }
    if (options_.num_splits > 0 && md.num_actual_tokens > 0) {
      plan->num_splits = options_.num_splits;
      plan->workspace = split_workspace_bytes(plan->num_splits, md.num_actual_tokens,
                                              config.num_heads, config.head_size);
      reserve_query_quant(*plan, config);
    }
    return plan;
  }

  void merge_states(const MergeArgs& a) const override {
    check_merge_args(a);
    const Device device = a.output.device;
    require<NotSupported>(device.is_cuda(), "cuda backend: merge_states needs CUDA tensors; got ",
                          describe(a.output));
    const merge::MergeKernel* kernel = merge::find_merge(a.output.dtype);
    require<NotSupported>(kernel != nullptr, "cuda backend: merge_states is not compiled for ",
                          dtype_name(a.output.dtype), " (float32, float16, bfloat16 are)");
    const TensorView &po = a.prefix_output, &so = a.suffix_output, &o = a.output;
    merge::MergeParams p{};
    p.prefix_out = po.data;
    p.prefix_stride_token = po.stride(0);
    p.prefix_stride_head = po.stride(1);
    p.suffix_out = so.data;
    p.suffix_stride_token = so.stride(0);
    p.suffix_stride_head = so.stride(1);
    p.out = o.data;
    p.out_stride_token = o.stride(0);
    p.out_stride_head = o.stride(1);
    p.prefix_lse = a.prefix_lse.data;
    p.prefix_lse_stride_head = a.prefix_lse.stride(0);
    p.prefix_lse_stride_token = a.prefix_lse.stride(1);
    p.prefix_lse_f64 = a.prefix_lse.dtype == DType::kF64;
    p.suffix_lse = a.suffix_lse.data;
    p.suffix_lse_stride_head = a.suffix_lse.stride(0);
    p.suffix_lse_stride_token = a.suffix_lse.stride(1);
    p.suffix_lse_f64 = a.suffix_lse.dtype == DType::kF64;
    if (a.output_lse.defined()) {
      p.out_lse = a.output_lse.data;
      p.out_lse_stride_head = a.output_lse.stride(0);
      p.out_lse_stride_token = a.output_lse.stride(1);
      p.out_lse_f64 = a.output_lse.dtype == DType::kF64;
    }
    p.num_tokens = int(o.size(0));
    p.num_heads = int(o.size(1));
    p.head_size = int(o.size(2));
    auto vec_ok = [](const TensorView& v) {
      return v.stride(2) == 1 && is_aligned(v.data, 16) && v.stride(0) % 8 == 0 &&
             v.stride(1) % 8 == 0;
    };
    p.vectorized = p.head_size % merge::kVec == 0 && vec_ok(po) && vec_ok(so) && vec_ok(o);
    require(po.stride(2) == 1 && so.stride(2) == 1 && o.stride(2) == 1,
            "merge_states: outputs must be contiguous in head_size");
    ScopedDevice guard(device.index);
    kernel->launch(p, static_cast<cudaStream_t>(a.stream.handle));
  }

  void merge_ranks(const MergeRanksArgs& a) const override {
    if (a.output.device.is_cpu()) return Backend::merge_ranks(a);  // the host merge
    check_merge_ranks_args(a);
    const Device device = a.output.device;
    if (!device.is_cuda()) {
      detail::fail<NotSupported>("cuda backend: merge_ranks needs CUDA tensors; output is on ",
                                 to_string(device));
    }
    const TensorView &po = a.partial_outputs, &pl = a.partial_lses, &o = a.output;
    const merge::MergeRanksKernel* kernel = merge::find_merge_ranks(po.dtype, o.dtype);
    if (kernel == nullptr) {
      detail::fail<NotSupported>("cuda backend: merge_ranks is not compiled for ",
                                 dtype_name(po.dtype), " partials into ", dtype_name(o.dtype),
                                 " (float32, float16, bfloat16 each way are)");
    }
    merge::MergeRanksParams p{};
    p.partials = po.data;
    p.partial_stride_rank = po.stride(0);
    p.partial_stride_token = po.stride(1);
    p.partial_stride_head = po.stride(2);
    p.lses = static_cast<const float*>(pl.data);
    p.lse_stride_rank = pl.stride(0);
    p.lse_stride_head = pl.stride(1);
    p.lse_stride_token = pl.stride(2);
    p.out = o.data;
    p.out_stride_token = o.stride(0);
    p.out_stride_head = o.stride(1);
    if (a.output_lse.defined()) {
      p.out_lse = static_cast<float*>(a.output_lse.data);
      p.out_lse_stride_head = a.output_lse.stride(0);
      p.out_lse_stride_token = a.output_lse.stride(1);
    }
    p.num_ranks = int(po.size(0));
    p.num_tokens = int(o.size(0));
    p.num_heads = int(o.size(1));
    p.head_size = int(o.size(2));
    p.vectorized = p.head_size % merge::kVec == 0 && is_aligned(po.data, 16) &&
                   is_aligned(o.data, 16) && po.stride(0) % merge::kVec == 0 &&
                   po.stride(1) % merge::kVec == 0 && po.stride(2) % merge::kVec == 0 &&
                   o.stride(0) % merge::kVec == 0 && o.stride(1) % merge::kVec == 0;
    ScopedDevice guard(device.index);
    kernel->launch(p, static_cast<cudaStream_t>(a.stream.handle));
  }

  float amax(const TensorView& x) const override {
    require<NotSupported>(is_floating(x.dtype), "amax: ", describe(x), " is not a float tensor");
    if (x.device.is_cpu()) return host_amax(x);
    require<NotSupported>(x.device.is_cuda() && amax::supports(x.dtype), "amax: cannot read ",
                          describe(x));
    require(x.ndim <= amax::kMaxDims, "amax: rank ", x.ndim, " exceeds ", amax::kMaxDims);
    ScopedDevice guard(x.device.index);
    amax::AmaxParams p{};
    p.x = x.data;
    p.dtype = int(x.dtype);
    p.ndim = x.ndim;
    for (int d = 0; d < x.ndim; ++d) {
      p.shape[d] = x.size(d);
      p.strides[d] = x.stride(d);
    }
    p.numel = x.numel();
    // Calibration runs once per layer, outside graphs: a small allocation and a blocking copy
    // on the legacy default stream are fine here.
    unsigned int* result = nullptr;
    PAGEDATTN_CUDA_CHECK(cudaMalloc(&result, sizeof(unsigned int)));
    p.result = result;
    unsigned int bits = 0;
    try {
      amax::AmaxOps::launch(p, nullptr);
      PAGEDATTN_CUDA_CHECK(cudaMemcpy(&bits, result, sizeof(bits), cudaMemcpyDeviceToHost));
    } catch (...) {
      cudaFree(result);
      throw;
    }
    PAGEDATTN_CUDA_CHECK(cudaFree(result));
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }

 private:
  static float host_amax(const TensorView& x) {
    double m = 0.0;
    std::array<int64_t, kMaxDims> idx{};
    for (int64_t k = 0, n = x.numel(); k < n; ++k) {
      int64_t off = 0;
      for (int d = 0; d < x.ndim; ++d) off += idx[size_t(d)] * x.stride(d);
      const double v = std::fabs(load_element(x.data, x.dtype, off));
      if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
      m = std::max(m, v);
      for (int d = x.ndim - 1; d >= 0; --d) {
        if (++idx[size_t(d)] < x.size(d)) break;
        idx[size_t(d)] = 0;
      }
    }
    return float(m);
  }

  // Occupancy of a kernel (decode, prefill or MLA: its ctas_per_sm) on a device, queried once.
  template <class Kernel>
  int ctas_per_sm(const Kernel& kernel, int device) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, inserted] = occupancy_.try_emplace({static_cast<const void*>(&kernel), device}, 0);
    if (inserted) {
      ScopedDevice guard(device);
      it->second = kernel.ctas_per_sm(device);
    }
    return it->second;
  }

  BackendOptions options_;
  mutable std::mutex mutex_;
  mutable std::map<std::pair<const void*, int>, int> occupancy_;  // kernel, device
};

}  // namespace

std::unique_ptr<Backend> make_backend(const BackendOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

}  // namespace pagedattn::cuda
