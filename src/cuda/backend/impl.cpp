#include "cuda/backend/impl.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/backend/checked.h"
#include "cuda/backend/mla_route.h"
#include "cuda/backend/plan.h"
#include "cuda/backend/q_map.h"
#include "cuda/common/device_props.h"
#include "cuda/common/tensor_map.h"
#include "cuda/decode/config.h"
#include "cuda/prefill/walk.h"
#include "cuda/quant/launch.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

using detail::cat;
using detail::fail;
using detail::require;

namespace {

constexpr float kLog2e = 1.4426950408889634f;

cudaStream_t stream_of(const Stream& s) {
  return static_cast<cudaStream_t>(s.handle);
}

bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether 8-element chunks of the rows of a [rows, heads, head_size] view can move as 16-byte
// vectors (two for float32).
bool vec8(const TensorView& v) {
  return aligned(v.data, 16) && v.stride(0) % 8 == 0 && v.stride(1) % 8 == 0 && v.size(2) % 8 == 0;
}

// The attention kernel copies K/V rows with 16-byte cp.async: bases and strides must allow it.
void require_16b_rows(const TensorView& v, std::string_view name, int dims) {
  const int64_t e = int64_t(dtype_size(v.dtype));
  bool ok = aligned(v.data, 16) && (v.size(v.ndim - 1) * e) % 16 == 0;
  for (int d = 0; d < dims; ++d) ok = ok && (v.stride(d) * e) % 16 == 0;
  if (!ok) {
    fail<NotSupported>("cuda backend: ", name, " (", describe(v),
                       ") needs a 16-byte aligned base and strides that are multiples of 16 "
                       "bytes");
  }
}

void require_on(const TensorView& v, Device device, std::string_view name) {
  require(v.defined(), name, " is required");
  require(v.device == device, name, " is on ", to_string(v.device), "; the cuda backend runs on ",
          to_string(device), " and reads it there");
}

// Bulk copies are Hopper code (compiled out of the portable targets); auto takes them for rows
// long enough to gain (kBulkMinRowBytes).
bool use_bulk_copy(const AttentionConfig& config, DecodeCopy copy, bool hopper) {
  if (!hopper || copy == DecodeCopy::kCpAsync) return false;
  const DType rows = uses_kv_cache(config.attn_type) ? config.cache_dtype() : config.dtype;
  return copy == DecodeCopy::kBulk ||
         int64_t(config.head_size) * int64_t(dtype_size(rows)) >= kBulkMinRowBytes;
}

}  // namespace

CudaImpl::CudaImpl(const AttentionConfig& config, Device device, const BackendOptions& options)
    : config_(config),
      device_(device),
      checked_(options.checked),
      head_scales_(options.head_scales),
      route_(options.prefill),
      bulk_copy_(use_bulk_copy(config, options.decode_copy,
                               device.is_cuda() && hopper_route(device.index, options))),
      prefill_tma_(options.prefill_tma),
      prefill_persistent_(options.prefill_persistent),
      prefill_pair_group_(options.prefill_pair_group) {
  require<NotSupported>(device.is_cuda(), "cuda backend: device ", to_string(device),
                        " is not a CUDA device");
  const bool cached = uses_kv_cache(config.attn_type);
  cache_dtype_ = cached ? config.cache_dtype() : config.dtype;
  if (is_mla_shape(config)) {
    require<NotSupported>(hopper_route(device.index, options),
                          "cuda backend: head_size 576 runs on the MLA latent kernel, which is "
                          "Hopper code (wgmma); ",
                          device_family(device.index, options));
    const std::vector<std::string> reasons = mla_reasons(config);
    if (!reasons.empty()) {
      std::string all;
      for (const std::string& r : reasons) all += (all.empty() ? "" : "; ") + r;
      fail<NotSupported>("cuda backend: ", all);
    }
    mla_ = mla::find_mla(config.dtype, cache_dtype_, config.num_heads, options.mla_consumer);
    require<NotSupported>(
        mla_ != nullptr,
        "cuda backend: the MLA kernel (mla_consumer=", mla::consumer_name(options.mla_consumer),
        ") is not compiled for ", dtype_name(config.dtype), " over ", dtype_name(cache_dtype_),
        options.mla_consumer == mla::Consumer::kSeesaw ? " (the seesaw needs a 16-bit cache)" : "");
    mla_tma_ = options.mla_copy != MlaCopy::kCpAsync;  // the Hopper route (required above)
    // The seesaw, swap AB and split-S's first instance write the 512 latent columns only; a
    // wider output (the generic contract's 576) takes split-S's 576-column instance under auto
    // or split-s (none under the seesaw or swap AB: refused).
    if (mla_->max_out_cols < mla::kEntry) {
      const mla::Consumer c = options.mla_consumer == mla::Consumer::kAuto ? mla::Consumer::kSplitS
                                                                           : options.mla_consumer;
      mla_wide_ = mla::find_mla(config.dtype, cache_dtype_, config.num_heads, c, mla::kEntry);
    }
    // Steps whose requests have at most 16 packed rows (16 heads x 1 token) take swap AB under
    // auto: no padded rows (fp8 cache +23-26%, 16-bit +1.5-3%, where it is memory-bound);
    // at most 32 (16 heads x 2, 32 heads x 1) its 32-row CTAs.
    if (options.mla_consumer == mla::Consumer::kAuto) {
      for (int i = 0; i < 2; ++i) {
        mla_narrow_[i] = mla::find_mla(config.dtype, cache_dtype_, config.num_heads,
                                       i == 0 ? mla::Consumer::kSwapAB : mla::Consumer::kSwapAB32);
      }
    }
    mla_combine_ = mla::find_mla_combine(config.dtype);
    write_ = cache_ops::find_write_kv(config.dtype, cache_dtype_);
    require<NotSupported>(write_ != nullptr, "cuda backend: write_kv is not compiled for ",
                          dtype_name(config.dtype), " into ", dtype_name(cache_dtype_));
    ScopedDevice guard(device.index);
    mla_->ctas_per_sm(device.index);  // the shared-memory limit, outside any graph capture
    if (mla_wide_ != nullptr) mla_wide_->ctas_per_sm(device.index);
    for (const mla::MlaKernel* k : mla_narrow_) {
      if (k != nullptr) k->ctas_per_sm(device.index);
    }
    return;
  }
  decode_ = decode::find_decode(config.dtype, cache_dtype_, config.head_size);
  combine_ = attn::find_combine(config.dtype);
  if (route_ != PrefillRoute::kOff) {
    // A quantised query over an e4m3 cache takes the fp8-product Hopper kernel where one is
    // compiled; otherwise the 16-bit kernels read the quantised query.
    prefill_ = prefill::find_prefill(config.dtype, cache_dtype_, config.head_size,
                                     hopper_route(device.index, options) ? 9 : 8,
                                     options.portable_prefill, config.query_quant);
  }
  require<NotSupported>(decode_ != nullptr && combine_ != nullptr,
                        "cuda backend: no attention kernel compiled for ", dtype_name(config.dtype),
                        " activations, a ", dtype_name(cache_dtype_), " cache and head_size ",
                        config.head_size, " (see check())");
  if (cached) {
    write_ = cache_ops::find_write_kv(config.dtype, cache_dtype_);
    require<NotSupported>(write_ != nullptr, "cuda backend: write_kv is not compiled for ",
                          dtype_name(config.dtype), " into ", dtype_name(cache_dtype_));
  }
  ScopedDevice guard(device.index);
  // Raises the kernel's shared-memory limit now, so that no attribute call happens later
  // inside a graph capture.
  decode_->ctas_per_sm(device.index);
  if (prefill_ != nullptr) {
    prefill_resident_ = device_props(device.index).num_sms * prefill_->ctas_per_sm(device.index);
    l2_bytes_ = device_props(device.index).l2_bytes;
  }
  auto upload = [&](const std::vector<float>& v) {
    if (v.empty()) return Tensor{};
    const TensorView host =
        TensorView::contiguous(const_cast<float*>(v.data()), DType::kF32, {int64_t(v.size())});
    return Tensor::copy_of(host, device);
  };
  if (prefill_ != nullptr && options.prefill_dynamic) {
    tile_counter_ = Tensor::zeros({1}, DType::kI32, device);
  }
  alibi_slopes_ = upload(config.alibi_slopes);
  sinks_ = upload(config.sinks);
}

void CudaImpl::write_kv(const WriteKVArgs& a) {
  const int64_t num_slots = a.slot_mapping.defined() ? a.slot_mapping.size(0) : 0;
  if (num_slots == 0) return;
  require<NotSupported>(write_ != nullptr, "cuda backend: ", to_string(config_.attn_type),
                        " attention has no KV cache to write");
  const KVCacheView& c = a.kv_cache;
  require_on(c.key, device_, "kv_cache.key");
  require_on(a.key, device_, "key");
  require_on(a.slot_mapping, device_, "slot_mapping");
  ScopedDevice guard(device_.index);
  const cudaStream_t stream = stream_of(a.stream);
  if (checked_) validate_device_slots(a.slot_mapping, c.num_blocks() * c.block_size(), stream);

  cache_ops::WriteKVParams p{};
  p.key = a.key.data;
  p.key_stride_token = a.key.stride(0);
  p.key_stride_head = a.key.stride(1);
  p.value = a.value.data;
  p.value_stride_token = a.value.stride(0);
  p.value_stride_head = a.value.stride(1);
  p.slot_mapping = static_cast<const int64_t*>(a.slot_mapping.data);
  p.slot_stride = a.slot_mapping.stride(0);
  p.k_cache = c.key.data;
  p.k_stride_block = c.key.stride(0);
  p.k_stride_page = c.key.stride(1);
  p.k_stride_head = c.key.stride(2);
  p.v_cache = c.value.data;
  p.v_stride_block = c.value.stride(0);
  p.v_stride_page = c.value.stride(1);
  p.v_stride_head = c.value.stride(2);
  p.num_slots = int(num_slots);
  p.num_kv_heads = config_.num_kv_heads;
  p.head_size = config_.head_size;
  p.v_head_size = config_.head_size_v();
  p.block_size = c.block_size();
  p.k_scale = a.scales.k_scale;
  p.v_scale = a.scales.v_scale;
  if (a.scales.per_head() && is_fp8(config_.kv_cache_dtype)) {  // others ignore scales
    const int heads = config_.num_kv_heads;
    require<NotSupported>(heads <= cache_ops::kMaxHeadScales, "cuda backend: per-head k/v scales ",
                          "serve up to ", cache_ops::kMaxHeadScales, " KV heads; num_kv_heads is ",
                          heads);
    p.per_head_scales = 1;
    for (int h = 0; h < heads; ++h) {
      p.k_scales[h] = a.scales.k_scale_of(0, h, heads);
      p.v_scales[h] = a.scales.v_scale_of(0, h, heads);
    }
  }
  // 8-element chunks: 16 bytes of 16-bit activations; 8 bytes of fp8, 16 of 16-bit, 32 of f32.
  const size_t cache_align = std::min<size_t>(16, 8 * dtype_size(cache_dtype_));
  auto cache_ok = [&](const TensorView& v) {
    return aligned(v.data, cache_align) && v.stride(0) % 8 == 0 && v.stride(1) % 8 == 0 &&
           v.stride(2) % 8 == 0;
  };
  p.vectorized = config_.head_size % 8 == 0 && config_.head_size_v() % 8 == 0 && vec8(a.key) &&
                 vec8(a.value) && cache_ok(c.key) && cache_ok(c.value);
  write_->launch(p, stream);
}

namespace {

// forward's checks of the caller's query, output and LSE views.
void check_forward_views(const ForwardArgs& a, const AttentionConfig& cfg, Device device) {
  require_on(a.query, device, "query");
  require_on(a.output, device, "output");
  require<NotSupported>(a.output.dtype == cfg.dtype, "cuda backend: output must be ",
                        dtype_name(cfg.dtype), " (the activation dtype); got ", describe(a.output));
  if (a.lse.defined()) {
    require_on(a.lse, device, "lse");
    require<NotSupported>(a.lse.dtype == DType::kF32 || a.lse.dtype == DType::kF64,
                          "cuda backend: lse must be float32 or float64; got ", describe(a.lse));
  }
}

// The query the kernels read: the caller's, or under query_quant its e4m3 copy in the plan's
// workspace, written by the quantisation kernel launched here.
void set_query(attn::AttnParams& p, const ForwardArgs& a, const AttentionConfig& cfg,
               const CudaPlan* plan, cudaStream_t stream) {
  const AttentionMetadata& md = *a.metadata;
  p.q = a.query.data;
  p.q_stride_token = a.query.stride(0);
  p.q_stride_head = a.query.stride(1);
  p.vec_q = vec8(a.query);
  if (cfg.query_quant) {
    // q8 into the plan's workspace; every kernel then reads it as the query, with q_scale in
    // the softmax scale.
    require(plan != nullptr && plan->q_bytes > 0 && plan->num_actual_tokens == md.num_actual_tokens,
            "query_quant needs the backend's plan for this step (the quantised query lives in "
            "its workspace)");
    require(a.workspace.data != nullptr && a.workspace.bytes >= plan->workspace_bytes(),
            "workspace has ", a.workspace.bytes, " bytes; the plan needs ", plan->workspace_bytes(),
            " (query_quant)");
    require(aligned(a.workspace.data, 256), "workspace must be 256-byte aligned");
    quant::QueryQuantParams qq{};
    qq.q = a.query.data;
    qq.q_stride_token = a.query.stride(0);
    qq.q_stride_head = a.query.stride(1);
    qq.out = static_cast<char*>(a.workspace.data) + plan->q_offset;
    qq.num_tokens = md.num_actual_tokens;
    qq.num_heads = cfg.num_heads;
    qq.head_size = cfg.head_size;
    qq.dtype = int(cfg.dtype);
    qq.inv_scale = 1.0f / a.scales.q_scale;
    quant::launch_query_quant(qq, stream);
    p.q = qq.out;
    p.q_stride_token = int64_t(cfg.num_heads) * cfg.head_size;
    p.q_stride_head = cfg.head_size;
    p.vec_q = cfg.head_size % 8 == 0;
  }
}

// The output and the optional LSE.
void set_outputs(attn::AttnParams& p, const ForwardArgs& a) {
  p.out = a.output.data;
  p.out_stride_token = a.output.stride(0);
  p.out_stride_head = a.output.stride(1);
  p.vec_out = vec8(a.output);
  if (a.lse.defined()) {
    p.lse = a.lse.data;
    p.lse_stride_head = a.lse.stride(0);
    p.lse_stride_token = a.lse.stride(1);
    p.lse_is_f64 = a.lse.dtype == DType::kF64;
  }
}

// K and V: the paged cache (through the block table), or for encoder types the step's own key
// and value rows; and the dtype the kernels read them as.
void set_kv(attn::AttnParams& p, const ForwardArgs& a, const TensorView& k, const TensorView& v,
            bool cached, Device device, DType cache_dtype) {
  const AttentionMetadata& md = *a.metadata;
  require_on(k, device, cached ? "kv_cache.key" : "key");
  require_on(v, device, cached ? "kv_cache.value" : "value");
  require_16b_rows(k, cached ? "kv_cache.key" : "key", cached ? 3 : 2);
  require_16b_rows(v, cached ? "kv_cache.value" : "value", cached ? 3 : 2);
  p.k = k.data;
  p.v = v.data;
  if (cached) {
    p.k_stride_block = k.stride(0);
    p.k_stride_page = k.stride(1);
    p.k_stride_head = k.stride(2);
    p.v_stride_block = v.stride(0);
    p.v_stride_page = v.stride(1);
    p.v_stride_head = v.stride(2);
    require_on(md.seq_lens, device, "metadata.seq_lens");
    require_on(md.block_table, device, "metadata.block_table");
    p.block_table = static_cast<const int32_t*>(md.block_table.data);
    p.block_table_stride_seq = md.block_table.stride(0);
    p.block_table_stride_block = md.block_table.stride(1);
    p.block_size = a.kv_cache.block_size();
  } else {
    // Encoder types: key j of request r is row query_start_loc[r] + j ("block" = token row).
    p.kv_direct = 1;
    p.k_stride_block = k.stride(0);
    p.k_stride_head = k.stride(1);
    p.v_stride_block = v.stride(0);
    p.v_stride_head = v.stride(1);
    p.block_size = 1;
  }
  p.kv_dtype = int(cache_dtype);
}

// The step's requests and the layer's sizes.
void set_rows(attn::AttnParams& p, const AttentionMetadata& md, const AttentionConfig& cfg) {
  p.query_start_loc = static_cast<const int32_t*>(md.query_start_loc.data);
  p.seq_lens = md.seq_lens.defined() ? static_cast<const int32_t*>(md.seq_lens.data) : nullptr;
  p.num_seqs = md.num_seqs;
  p.num_heads = cfg.num_heads;
  p.num_kv_heads = cfg.num_kv_heads;
  p.group = cfg.num_queries_per_kv();
  p.head_size = cfg.head_size;
  p.v_head_size = cfg.head_size_v();
  p.num_q_tiles = int((int64_t(md.max_query_len) * p.group + decode::kRows - 1) / decode::kRows);
  p.num_actual_tokens = md.num_actual_tokens;
}

// The model's features: the softmax scale in log2 units (k_scale and q_scale folded in), soft
// cap, ALiBi, sinks, v scale, causal and sliding-window masks.
void set_features(attn::AttnParams& p, const ForwardArgs& a, const AttentionConfig& cfg,
                  bool cached, const Tensor& alibi_slopes, const Tensor& sinks) {
  const bool fp8 = cached && is_fp8(cfg.kv_cache_dtype);
  // Scales per KV head (kernel_scales left [num_kv_heads] vectors): k_scale leaves the common
  // logit scale for the per-head factors, v_scale the output for its per-head values.
  const bool head_scales = fp8 && (!a.scales.k_scales.empty() || !a.scales.v_scales.empty());
  p.head_scales = head_scales ? 1 : 0;
  if (head_scales) {
    for (int h = 0; h < cfg.num_kv_heads; ++h) {
      p.k_factor[h] = a.scales.k_scale_of(0, h, cfg.num_kv_heads);
      p.v_factor[h] = a.scales.v_scale_of(0, h, cfg.num_kv_heads);
    }
  }
  const float scale = cfg.scale * (fp8 && !head_scales ? a.scales.k_scale : 1.0f) *
                      (cfg.query_quant ? a.scales.q_scale : 1.0f);
  p.scale_log2 = scale * kLog2e;
  if (cfg.logits_soft_cap && *cfg.logits_soft_cap > 0.0f) {
    p.softcap = *cfg.logits_soft_cap;
    p.softcap_arg_scale = scale / p.softcap;
    p.softcap_log2 = p.softcap * kLog2e;
  }
  p.alibi_slopes = alibi_slopes.defined() ? alibi_slopes.data_as<const float>() : nullptr;
  p.sinks = sinks.defined() ? sinks.data_as<const float>() : nullptr;
  p.v_scale = fp8 ? a.scales.v_scale : 1.0f;
  p.causal = cfg.causal();
  p.window_left = cfg.window_left();
  p.window_right = cfg.window_right();
}

// Split-KV partials into the workspace when the plan splits (the plan checked against this
// call); unsplit without one.
void set_splits(attn::AttnParams& p, const ForwardArgs& a, const AttentionConfig& cfg,
                const CudaPlan* plan) {
  const AttentionMetadata& md = *a.metadata;
  // Splits come from the plan; without one (or without a workspace) the launch is unsplit.
  p.num_splits = 1;
  if (plan != nullptr && plan->num_splits > 1) {
    require(plan->num_actual_tokens == md.num_actual_tokens && plan->num_heads == cfg.num_heads &&
                plan->head_size == cfg.head_size,
            "plan was built for ", plan->num_actual_tokens, " tokens x ", plan->num_heads,
            " heads x head_size ", plan->head_size, "; this call has ", md.num_actual_tokens, " x ",
            cfg.num_heads, " x ", cfg.head_size);
    require(a.workspace.data != nullptr && a.workspace.bytes >= plan->workspace_bytes(),
            "workspace has ", a.workspace.bytes, " bytes; the plan needs ",
            plan->workspace_bytes());
    require(a.workspace.data == nullptr || aligned(a.workspace.data, 256),
            "workspace must be 256-byte aligned");
    p.num_splits = plan->num_splits;
    p.partial_o = static_cast<float*>(a.workspace.data);
    p.partial_lse = reinterpret_cast<float*>(
        static_cast<char*>(a.workspace.data) +
        split_lse_offset(p.num_splits, md.num_actual_tokens, cfg.num_heads, cfg.head_size));
  }
}

}  // namespace

namespace {

// The attention kernels take k and v scales per tensor or per KV head (AttnParams::head_scales,
// up to kMaxHeadScales heads) and one q scale (the query's quantisation takes one). Vectors come
// out empty (one value: per tensor, exactly) or [num_kv_heads] (a per-request vector whose
// requests agree head by head; only with the option head_scales); anything else is refused.
// Vectors the call does not read (k/v without an fp8 cache, q without query_quant) are dropped.
KVScales kernel_scales(const KVScales& s, const AttentionConfig& cfg, bool head_scales) {
  KVScales out{s.k_scale, s.v_scale, s.q_scale, {}, {}, {}};
  const bool fp8 = uses_kv_cache(cfg.attn_type) && is_fp8(cfg.kv_cache_dtype);
  const int heads = cfg.num_kv_heads;
  auto all_equal = [](const std::vector<float>& v) {
    for (const float x : v) {
      if (x != v.front()) return false;
    }
    return true;
  };
  auto per_head = [&](const std::vector<float>& v, float* whole, std::vector<float>* dst,
                      const char* name) {
    if (v.empty()) return;
    if (all_equal(v)) {
      *whole = v.front();
      return;
    }
    require<NotSupported>(head_scales, "cuda backend: scales.", name, " hold different values (",
                          v.front(),
                          " and more); the cuda attention kernels take them per KV "
                          "head only with the option head_scales=on (off by default until that "
                          "path has run on a GPU; the ref and cpu backends serve per-head scales)");
    std::vector<float> h(v.begin(), v.begin() + heads);
    for (size_t i = 0; i < v.size(); ++i) {
      require<NotSupported>(v[i] == h[i % size_t(heads)], "cuda backend: scales.", name,
                            " differ between requests (", h[i % size_t(heads)], " and ", v[i],
                            " for KV head ", i % size_t(heads), "); the cuda attention kernels ",
                            "take one scale per KV head (the ref and cpu backends serve scales "
                            "per request and head)");
    }
    require<NotSupported>(heads <= attn::kMaxHeadScales, "cuda backend: scales.", name,
                          " per KV head serve up to ", attn::kMaxHeadScales,
                          " KV heads; num_kv_heads is ", heads);
    *dst = std::move(h);
  };
  if (fp8) {
    per_head(s.k_scales, &out.k_scale, &out.k_scales, "k_scales");
    per_head(s.v_scales, &out.v_scale, &out.v_scales, "v_scales");
  }
  if (cfg.query_quant && !s.q_scales.empty()) {
    require<NotSupported>(all_equal(s.q_scales), "cuda backend: scales.q_scales hold different ",
                          "values; the query's quantisation takes one scale per call (the ref and ",
                          "cpu backends serve per-head query scales)");
    out.q_scale = s.q_scales.front();
  }
  return out;
}

}  // namespace

void CudaImpl::forward(const ForwardArgs& args) {
  const AttentionConfig& cfg = config_;
  ForwardArgs uniform;
  if (args.scales.per_head()) {
    uniform = args;
    uniform.scales = kernel_scales(args.scales, cfg, head_scales_);
  }
  const ForwardArgs& a = args.scales.per_head() ? uniform : args;
  require(a.metadata != nullptr, "metadata is required");
  const AttentionMetadata& md = *a.metadata;
  const bool cached = uses_kv_cache(cfg.attn_type);
  check_forward_views(a, cfg, device_);
  ScopedDevice guard(device_.index);
  const cudaStream_t stream = stream_of(a.stream);
  if (checked_) {
    const CacheGeometry geometry =
        cached ? CacheGeometry{a.kv_cache.num_blocks(), a.kv_cache.block_size()} : CacheGeometry{};
    validate_device_metadata(md, cfg.attn_type, geometry, stream);
  }
  if (md.num_seqs <= 0 || md.num_actual_tokens <= 0 || md.max_query_len <= 0) return;
  require_on(md.query_start_loc, device_, "metadata.query_start_loc");
  // The backend's plan made this check for its step; without one it is made here.
  if (dynamic_cast<const CudaPlan*>(a.plan) == nullptr) refuse_rows_without_keys(md, cfg);
  if (mla_ != nullptr) {
    forward_mla(a, stream);
    return;
  }
  require<NotSupported>(a.output.size(2) == cfg.head_size_v(),
                        "cuda backend: an output of another width than v_head_size ",
                        cfg.head_size_v(), " (", describe(a.output),
                        ") is served by the MLA latent kernel only (head size 576)");

  const auto* plan = dynamic_cast<const CudaPlan*>(a.plan);
  attn::AttnParams p{};
  set_query(p, a, cfg, plan, stream);
  set_outputs(p, a);
  const TensorView& k = cached ? a.kv_cache.key : a.key;
  const TensorView& v = cached ? a.kv_cache.value : a.value;
  set_kv(p, a, k, v, cached, device_, cache_dtype_);
  set_rows(p, md, cfg);
  set_features(p, a, cfg, cached, alibi_slopes_, sinks_);
  set_splits(p, a, cfg, plan);
  launch_attention(p, a, k, v, cached, stream);
}

void CudaImpl::launch_attention(attn::AttnParams& p, const ForwardArgs& a, const TensorView& k,
                                const TensorView& v, bool cached, cudaStream_t stream) const {
  const AttentionMetadata& md = *a.metadata;
  // Rows: requests with more than kDecodeMaxRows packed rows go to the prefill kernel (all of
  // them under the option prefill=all), the rest to the decode kernel; each kernel skips
  // the other's requests on the device, so the grids need only the longest query. The prefill
  // kernel goes first and the decode kernel behind it without overlap (launch_with_pdl).
  p.bulk_copy = bulk_copy_ ? 1 : 0;
  const int64_t max_rows = int64_t(md.max_query_len) * p.group;
  const bool all = route_ == PrefillRoute::kAll;
  if (prefill_ != nullptr && (all || max_rows > prefill::kDecodeMaxRows)) {
    p.route_rows = all ? 0 : prefill::kDecodeMaxRows;
    attn::AttnParams pp = p;
    pp.num_q_tiles = int((max_rows + prefill_->block_m - 1) / prefill_->block_m);
    set_prefill_tma(pp, k, v, cached);
    set_prefill_q_tma(pp, a.query);
    pp.persistent = std::min(prefill_persistent_, prefill_resident_);
    // The dynamic walk where most work tiles have rows and K/V come by TMA: where the producer
    // copies them by cp.async it is the busiest role, and the draw on its path cost ViT d80 3%
    // against the static snake, the fp8 caches within 1% either way (docs/kernels/prefill.md,
    // "Tried and did not pay").
    const bool dynamic = tile_counter_.defined() && pp.kv_tma != 0 &&
                         prefill::dynamic_walk_pays(md.num_actual_tokens, md.num_seqs, p.group,
                                                    prefill_->block_m, pp.num_q_tiles);
    pp.tile_counter = dynamic ? tile_counter_.data_as<int32_t>() : nullptr;
    pp.pair_group = prefill_pair_group(md, dynamic);
    prefill_->launch(pp, stream);
    if (!all) {
      p.num_q_tiles = prefill::kDecodeMaxRows / decode::kRows;
      decode_->launch(p, stream, /*pdl=*/false);
    }
  } else {
    decode_->launch(p, stream, /*pdl=*/true);
  }
  if (p.num_splits > 1) combine_->launch(p, stream);
}

int CudaImpl::prefill_pair_group(const AttentionMetadata& md, bool dynamic) const {
  if (prefill_pair_group_ != 0) return prefill_pair_group_;
  // A pair's K and V at the longest sequence's keys, as the kernel reads them.
  const int64_t keys = std::max({md.max_seq_len, md.max_query_len, 1});
  const int64_t pair_bytes =
      keys * (config_.head_size + config_.head_size_v()) * int64_t(dtype_size(cache_dtype_));
  const double share = dynamic ? kPrefillL2ShareDynamic : kPrefillL2Share;
  const int floor = dynamic ? kPrefillMinPairGroupDynamic : kPrefillMinPairGroup;
  const int64_t budget = int64_t(double(l2_bytes_) * share);
  return int(std::clamp<int64_t>(budget / pair_bytes, floor, INT_MAX));
}

void CudaImpl::set_prefill_tma(attn::AttnParams& p, const TensorView& k, const TensorView& v,
                               bool cached) const {
  p.kv_tma = 0;
  const int tile = prefill_->tma_tile;
  if (!prefill_tma_ || tile <= 0 || dtype_size(k.dtype) != 2 || v.dtype != k.dtype) return;
  // Element strides of a key row's {head, row} and of a "block" ({block, token} rows of a paged
  // cache; kv_direct: the tensor's token rows as one block).
  struct Axes {
    int64_t head, row, block, rows, blocks;
  };
  auto axes = [&](const TensorView& t) -> Axes {
    if (cached) return {t.stride(2), t.stride(1), t.stride(0), t.size(1), t.size(0)};
    const int64_t extent = std::max(t.stride(0) * t.size(0), t.stride(1) * t.size(1));
    return {t.stride(1), t.stride(0), extent, t.size(0), 1};
  };
  const Axes ka = axes(k), va = axes(v);
  const int bs = p.block_size;
  int box = tile;
  if (cached) {
    // A box of min(block_size, tile) rows stays inside one block when tiles start at multiples
    // of it, which powers of two >= 8 (the swizzle repeats every 8 rows of 128 bytes) give.
    if (bs < 8 || (bs & (bs - 1)) != 0) return;
    box = std::min(bs, tile);
  } else if (ka.rows < tile) {
    return;  // no full tile anywhere
  }
  const int mode = ka.head <= ka.row ? 1 : 2;
  if ((va.head <= va.row ? 1 : 2) != mode) return;
  // K's map is head_size columns wide, V's v_head_size: a box's columns past them (a bucket's,
  // or whole panels past a narrower V) arrive as zeros.
  auto encode = [&](CUtensorMap* map, const TensorView& t, const Axes& a, int cols) {
    const uint64_t head_size = uint64_t(cols);
    const uint64_t heads = uint64_t(cached ? t.size(2) : t.size(1));
    if (!aligned(t.data, 16) || (a.head * 2) % 16 != 0 || (a.row * 2) % 16 != 0 ||
        (a.block * 2) % 16 != 0) {
      return false;
    }
    const uint64_t dims[4] = {head_size, mode == 1 ? heads : uint64_t(a.rows),
                              mode == 1 ? uint64_t(a.rows) : heads, uint64_t(a.blocks)};
    const uint64_t strides[3] = {uint64_t((mode == 1 ? a.head : a.row) * 2),
                                 uint64_t((mode == 1 ? a.row : a.head) * 2), uint64_t(a.block * 2)};
    const uint32_t boxes[4] = {64, mode == 1 ? 1u : uint32_t(box), mode == 1 ? uint32_t(box) : 1u,
                               1};
    const char* why = nullptr;
    return encode_tiled_sw128(map, t.data, t.dtype == DType::kBF16, 4, dims, strides, boxes, &why);
  };
  if (encode(&p.k_map, k, ka, config_.head_size) &&
      encode(&p.v_map, v, va, config_.head_size_v())) {
    p.kv_tma = mode;
    p.kv_tma_rows = box;
  }
}

void CudaImpl::set_prefill_q_tma(attn::AttnParams& p, const TensorView& query) const {
  p.q_tma = 0;
  // Only the Hopper kernel over a 16-bit cache takes it (prefill::kQTma); p.q is still the
  // caller's query (query_quant replaces it with its fp8 copy).
  if (!prefill_tma_ || prefill_->sm != 90 || prefill_->kv != attn::KVKind::kSame ||
      prefill_->fp8_math || p.q != query.data) {
    return;
  }
  QMapShape q;
  const char* why = nullptr;
  if (!q_map_shape(query, config_.head_size, p.group, prefill_->block_m, &q, &why)) return;
  p.q_tma = encode_tiled_sw128(&p.q_map, query.data, query.dtype == DType::kBF16, 3, q.dims,
                               q.strides, q.box, &why)
                ? 1
                : 0;
}

void CudaImpl::forward_mla(const ForwardArgs& a, cudaStream_t stream) {
  const AttentionConfig& cfg = config_;
  // One latent KV head: kernel_scales leaves no per-head vector for it.
  require<NotSupported>(a.scales.k_scales.empty() && a.scales.v_scales.empty(),
                        "cuda backend: the MLA kernel takes one k / v scale per call");
  const AttentionMetadata& md = *a.metadata;
  const TensorView& k = a.kv_cache.key;
  const TensorView& v = a.kv_cache.value;
  require_on(k, device_, "kv_cache.key");
  require_on(v, device_, "kv_cache.value");
  // The kernel reads each latent entry once, as key and value: a separate value cache would be
  // silently ignored, so refuse it.
  bool same = k.data == v.data && k.ndim == v.ndim;
  for (int d = 0; same && d < k.ndim; ++d) same = k.stride(d) == v.stride(d);
  if (!same) {
    fail<NotSupported>(
        "cuda backend: head_size 576 runs on the MLA latent kernel, which reads one "
        "cache as both K and V (MLAAttention's binding); kv_cache.value (",
        describe(v), ") is not the same view as kv_cache.key (", describe(k), ")");
  }
  require_16b_rows(k, "kv_cache.key", 3);
  require<NotSupported>(k.stride(3) == 1,
                        "cuda backend: latent cache rows must be contiguous; got ", describe(k));
  const TensorView& q = a.query;
  const int64_t e = 2;  // 16-bit activations
  require<NotSupported>(aligned(q.data, 16) && q.stride(2) == 1 && (q.stride(0) * e) % 16 == 0 &&
                            (q.stride(1) * e) % 16 == 0,
                        "cuda backend: the MLA kernel copies query rows in 16-byte pieces: ",
                        describe(q), " needs a 16-byte aligned base and row strides");
  require<NotSupported>(a.output.stride(2) == 1,
                        "cuda backend: output rows must be contiguous; got ", describe(a.output));
  const int out_cols = int(a.output.size(2));
  const mla::MlaKernel* const kernel =
      mla::mla_for_step(mla_, mla_wide_, mla_narrow_, md.max_query_len, cfg.num_heads, out_cols);
  require<NotSupported>(kernel != nullptr, "cuda backend: the MLA kernel mla_consumer=",
                        mla::consumer_name(mla_->consumer), " writes at most ", mla_->max_out_cols,
                        " latent columns; output is ", describe(a.output),
                        " (auto or split-s serve ", mla::kEntry, ")");
  require_on(md.seq_lens, device_, "metadata.seq_lens");
  require_on(md.block_table, device_, "metadata.block_table");

  mla::MlaParams p{};
  p.q = q.data;
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out = a.output.data;
  p.out_stride_token = a.output.stride(0);
  p.out_stride_head = a.output.stride(1);
  p.out_cols = out_cols;
  p.vec_out =
      aligned(a.output.data, 4) && a.output.stride(0) % 2 == 0 && a.output.stride(1) % 2 == 0;
  if (a.lse.defined()) {
    p.lse = a.lse.data;
    p.lse_stride_head = a.lse.stride(0);
    p.lse_stride_token = a.lse.stride(1);
    p.lse_is_f64 = a.lse.dtype == DType::kF64;
  }
  p.kv = k.data;
  p.kv_stride_block = k.stride(0);
  p.kv_stride_page = k.stride(1);
  // TMA for full tiles when the rows are 16-bit and the block size is a multiple of 64 (a box
  // of 64 rows per panel stays inside a block; mla_copy=cp.async: never); the map is encoded
  // per call (a few microseconds; it travels by value in the kernel's parameters, so a captured
  // graph replays it).
  const int64_t es = int64_t(dtype_size(k.dtype));
  if (mla_tma_ && es == 2 && a.kv_cache.block_size() % mla::kBlockN == 0 && aligned(k.data, 16) &&
      (k.stride(0) * es) % 16 == 0 && (k.stride(1) * es) % 16 == 0) {
    const uint64_t dims[3] = {uint64_t(mla::kEntry), uint64_t(k.size(1)), uint64_t(k.size(0))};
    const uint64_t strides[2] = {uint64_t(k.stride(1) * es), uint64_t(k.stride(0) * es)};
    const uint32_t box[3] = {64, uint32_t(mla::kBlockN), 1};
    const char* why = nullptr;
    p.kv_tma =
        encode_tiled_sw128(&p.kv_map, k.data, k.dtype == DType::kBF16, 3, dims, strides, box, &why)
            ? 1
            : 0;
  }
  p.query_start_loc = static_cast<const int32_t*>(md.query_start_loc.data);
  p.seq_lens = static_cast<const int32_t*>(md.seq_lens.data);
  p.block_table = static_cast<const int32_t*>(md.block_table.data);
  p.block_table_stride_seq = md.block_table.stride(0);
  p.block_table_stride_block = md.block_table.stride(1);
  p.num_seqs = md.num_seqs;
  p.num_heads = cfg.num_heads;
  p.block_size = a.kv_cache.block_size();
  p.num_m_tiles =
      int((int64_t(md.max_query_len) * cfg.num_heads + kernel->block_m - 1) / kernel->block_m);
  p.num_actual_tokens = md.num_actual_tokens;
  const bool fp8 = is_fp8(cfg.kv_cache_dtype);
  p.scale_log2 = cfg.scale * (fp8 ? a.scales.k_scale : 1.0f) * kLog2e;
  p.v_scale = fp8 ? a.scales.v_scale : 1.0f;

  const auto* plan = dynamic_cast<const CudaPlan*>(a.plan);
  p.num_splits = 1;
  if (plan != nullptr && plan->num_splits > 1) {
    require(plan->num_actual_tokens == md.num_actual_tokens && plan->num_heads == cfg.num_heads &&
                plan->head_size == cfg.head_size,
            "plan was built for ", plan->num_actual_tokens, " tokens x ", plan->num_heads,
            " heads x head_size ", plan->head_size, "; this call has ", md.num_actual_tokens, " x ",
            cfg.num_heads, " x ", cfg.head_size);
    require(a.workspace.data != nullptr && a.workspace.bytes >= plan->workspace_bytes(),
            "workspace has ", a.workspace.bytes, " bytes; the plan needs ",
            plan->workspace_bytes());
    require(aligned(a.workspace.data, 256), "workspace must be 256-byte aligned");
    p.num_splits = std::min(plan->num_splits, mla::kMaxSplits);
    p.partial_o = static_cast<float*>(a.workspace.data);
    p.partial_lse = reinterpret_cast<float*>(
        static_cast<char*>(a.workspace.data) +
        split_lse_offset(plan->num_splits, md.num_actual_tokens, cfg.num_heads, cfg.head_size));
  }
  // Up to kMaxClusterSplits splits merge inside one cluster where the kernel can (swap AB,
  // split-S's 512 columns: no partials, no combine; cluster_merge.cuh says why), else combine.
  p.split_cluster =
      p.num_splits > 1 && p.num_splits <= mla::kMaxClusterSplits && kernel->cluster_merge
          ? p.num_splits
          : 1;
  kernel->launch(p, stream);
  if (p.num_splits > 1 && p.split_cluster <= 1) mla_combine_->launch(p, stream);
}

}  // namespace pagedattn::cuda
