#include "cpu/cpu_backend.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "core/option_table.h"
#include "cpu/cpu_bf16_dot.h"
#include "cpu/cpu_kernels.h"
#include "cpu/cpu_plan.h"
#include "cpu/thread_pool.h"
#include "pagedattn/error.h"

namespace pagedattn::cpu {

namespace bf16 {
namespace {
std::atomic<bool> g_enabled{true};
}  // namespace
bool enabled() {
  return g_enabled.load(std::memory_order_relaxed) && available();
}
void set_enabled(bool on) {
  g_enabled.store(on);
}
}  // namespace bf16

namespace {

// Largest head size served (any size up to it: the kernels pad their float scratch rows to
// whole vectors and read each cache row's tail separately). The per-thread scratch grows with
// rows x head_size floats; 576 is MLA's latent entry, kv_lora_rank + qk_rope_head_dim = 512 + 64
// for DeepSeek-V3.
constexpr int kMaxHeadSize = 576;

int64_t elem_offset(const TensorView& v, int64_t i0, int64_t i1) {
  return i0 * v.stride(0) + i1 * v.stride(1);
}

AttentionParams make_params(const AttentionConfig& c, const ForwardArgs& a) {
  const AttentionMetadata& md = *a.metadata;
  AttentionParams p;
  p.q = a.query.data;
  p.q_stride_token = a.query.stride(0);
  p.q_stride_head = a.query.stride(1);
  p.q_dtype = a.query.dtype;
  p.out = a.output.data;
  p.out_stride_token = a.output.stride(0);
  p.out_stride_head = a.output.stride(1);
  p.out_dtype = a.output.dtype;
  p.out_cols = int(a.output.size(2));
  if (a.lse.defined()) {
    p.lse = a.lse.data;
    p.lse_stride_head = a.lse.stride(0);
    p.lse_stride_token = a.lse.stride(1);
    p.lse_dtype = a.lse.dtype;
  }
  if (uses_kv_cache(c.attn_type)) {
    const KVCacheView& kv = a.kv_cache;
    p.k = kv.key.data;
    p.v = kv.value.data;
    p.kv_dtype = kv.key.dtype;
    p.k_stride_block = kv.key.stride(0);
    p.k_stride_token = kv.key.stride(1);
    p.k_stride_head = kv.key.stride(2);
    p.v_stride_block = kv.value.stride(0);
    p.v_stride_token = kv.value.stride(1);
    p.v_stride_head = kv.value.stride(2);
    p.paged = true;
    p.block_table = static_cast<const int32_t*>(md.block_table.data);
    p.block_table_stride = md.block_table.stride(0);
    p.block_table_stride_block = md.block_table.stride(1);
    p.block_size = kv.block_size();
    if (is_fp8(c.kv_cache_dtype)) {
      p.k_scale = a.scales.k_scale;
      p.v_scale = a.scales.v_scale;
      if (!a.scales.k_scales.empty() || !a.scales.v_scales.empty()) {
        p.k_scale = p.v_scale = 1.0f;  // head_scales carries both, per-tensor ones included
        p.head_scales = &a.scales;
      }
    }
  } else {
    p.k = a.key.data;
    p.v = a.value.data;
    p.kv_dtype = a.key.dtype;
    p.k_stride_token = a.key.stride(0);
    p.k_stride_head = a.key.stride(1);
    p.v_stride_token = a.value.stride(0);
    p.v_stride_head = a.value.stride(1);
    p.paged = false;
  }
  p.query_start_loc = static_cast<const int32_t*>(md.query_start_loc_cpu.data);
  p.seq_lens = static_cast<const int32_t*>(md.seq_lens_cpu.data);
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_size = c.head_size;
  p.v_head_size = c.head_size_v();
  p.scale = c.scale;
  p.soft_cap = c.logits_soft_cap.value_or(0.0f);
  p.alibi = c.has_alibi() ? c.alibi_slopes.data() : nullptr;
  p.sinks = c.has_sinks() ? c.sinks.data() : nullptr;
  p.causal = c.causal();
  p.window_left = c.window_left();
  p.window_right = c.window_right();
  return p;
}

// How this backend's loops run: its thread count, at most OpenMP's (the CPUs this process may
// use, or OMP_NUM_THREADS: tests plan for 8 threads and run one), and the pool's spin.
Parallelism parallelism(const BackendOptions& o) {
  const int cap = default_threads();
  return Parallelism{o.threads > 0 ? std::min(o.threads, cap) : cap, o.spin_us};
}

class CpuImpl final : public AttentionImpl {
 public:
  CpuImpl(const AttentionConfig& config, const BackendOptions& options)
      : config_(config), options_(options) {}

  void write_kv(const WriteKVArgs& a) override {
    const KVCacheView& c = a.kv_cache;
    const bool fp8 = is_fp8(config_.kv_cache_dtype);
    const int64_t num_slots = a.slot_mapping.size(0);
    const int bs = c.block_size(), heads = c.num_kv_heads(), d = c.head_size();
    const int dv = c.head_size_v();
    const auto* slots = static_cast<const int64_t*>(a.slot_mapping.data);
    const size_t in_elem = dtype_size(a.key.dtype), cache_elem = dtype_size(c.key.dtype);
    const bool big = num_slots * heads * d > (1 << 16);
    parallel_for(num_slots, big ? parallelism(options_) : Parallelism{}, [&](int64_t t) {
      const int64_t slot = slots[t * a.slot_mapping.stride(0)];
      if (slot < 0) return;  // padded token
      const int64_t block = slot / bs, offset = slot % bs;
      for (int h = 0; h < heads; ++h) {
        const auto* ks =
            static_cast<const char*>(a.key.data) + in_elem * size_t(elem_offset(a.key, t, h));
        const auto* vs =
            static_cast<const char*>(a.value.data) + in_elem * size_t(elem_offset(a.value, t, h));
        char* kd = static_cast<char*>(c.key.data) +
                   cache_elem * size_t(block * c.key.stride(0) + offset * c.key.stride(1) +
                                       h * c.key.stride(2));
        char* vd = static_cast<char*>(c.value.data) +
                   cache_elem * size_t(block * c.value.stride(0) + offset * c.value.stride(1) +
                                       h * c.value.stride(2));
        convert_row(ks, a.key.dtype, kd, c.key.dtype, d,
                    fp8 ? a.scales.k_scale_of(0, h, heads) : 1.0f);
        convert_row(vs, a.value.dtype, vd, c.value.dtype, dv,
                    fp8 ? a.scales.v_scale_of(0, h, heads) : 1.0f);
      }
    });
  }

  void forward(const ForwardArgs& a) override {
    const AttentionParams p = make_params(config_, a);
    const CpuPlan* plan = dynamic_cast<const CpuPlan*>(a.plan);
    std::unique_ptr<CpuPlan> own;
    if (!plan) {
      own = make_plan(*a.metadata, config_, plan_options(options_.threads));
      plan = own.get();
    }
    // Partial results of split items live in the caller's workspace (or, when the caller gave
    // too little, in a buffer of our own).
    std::vector<float> local;
    float* scratch = static_cast<float*>(a.workspace.data);
    if (plan->workspace_bytes() > a.workspace.bytes) {
      local.resize(plan->workspace_bytes() / sizeof(float));
      scratch = local.data();
    }
    const int64_t slots = int64_t(plan->num_partials) * plan->rows_stride;
    const PartialBuffers partials{scratch, scratch + slots * config_.head_size, plan->rows_stride};
    const int64_t n = int64_t(plan->items.size());
    const Parallelism how = parallelism(options_);
    parallel_for(n, how, [&](int64_t i) { attend_item(p, plan->items[size_t(i)], partials); });
    const int64_t groups = int64_t(plan->split_groups.size());
    parallel_for(groups, how, [&](int64_t g) {
      const SplitGroup& sg = plan->split_groups[size_t(g)];
      merge_splits(p, sg.whole, sg.first_split, sg.num_splits, partials);
    });
  }

 private:
  AttentionConfig config_;
  BackendOptions options_;
};

using OptionTable = std::vector<detail::OptionField<BackendOptions>>;
constexpr std::string_view kSource = "cpu backend";

const OptionTable& option_table() {
  static const OptionTable table = {
      {{"threads",
        "threads the plan spreads work and KV splits over, and a step runs on up to "
        "OMP_NUM_THREADS, else the CPUs this process may use (auto: that many; "
        "$PAGEDATTN_CPU_THREADS)",
        {{"auto", 0}},
        1,
        4096},
       [](const BackendOptions& o) { return o.threads; },
       [](BackendOptions& o, int v) { o.threads = v; }},
      {{"spin_us",
        "microseconds an idle thread spins for the next loop (or a loop's end) before it sleeps: "
        "short, so that a busy machine's other processes get the cores (0: sleep at once)",
        {},
        0,
        1000000},
       [](const BackendOptions& o) { return o.spin_us; },
       [](BackendOptions& o, int v) { o.spin_us = v; }},
  };
  return table;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options) : options_(options) {}
  std::string_view name() const override { return "cpu"; }
  std::string_view description() const override {
    return "SIMD (run-time dispatch) + OpenMP paged attention on the host";
  }
  std::vector<BackendOptionInfo> options() const override {
    return detail::describe_options(option_table(), options_);
  }
  std::unique_ptr<Backend> configured(const std::vector<std::string>& settings) const override {
    return make_backend(detail::with_settings(option_table(), options_, settings, kSource));
  }
  std::vector<std::string> check(const BackendQuery& q) const override {
    std::vector<std::string> reasons;
    if (!q.device.is_cpu()) {
      reasons.push_back(
          detail::cat("runs on the CPU only; the tensors are on ", to_string(q.device)));
    }
    const int d = q.config.head_size;
    if (d < 1 || d > kMaxHeadSize) {
      reasons.push_back(detail::cat("head_size ", d, " is outside 1..", kMaxHeadSize));
    }
    if (q.config.query_quant) {
      reasons.push_back(
          "query_quant (an fp8 query) is computed by the cuda and ref backends; the cpu backend "
          "reads 16-bit queries only");
    }
    return reasons;
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& config, Device) const override {
    return std::make_unique<CpuImpl>(config, options_);
  }
  std::unique_ptr<Plan> plan(const AttentionMetadata& md, const AttentionConfig& c) const override {
    return make_plan(md, c, plan_options(options_.threads));
  }
  void merge_states(const MergeArgs& a) const override;
  float amax(const TensorView& x) const override;

 private:
  BackendOptions options_;
};

void CpuBackend::merge_states(const MergeArgs& a) const {
  check_merge_args(a);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t n = a.output.size(0), heads = a.output.size(1), d = a.output.size(2);
  auto lse_at = [](const TensorView& v, int64_t h, int64_t t) {
    return float(load_element(v.data, v.dtype, h * v.stride(0) + t * v.stride(1)));
  };
  auto row = [](const TensorView& v, int64_t t, int64_t h) {
    return static_cast<char*>(v.data) +
           dtype_size(v.dtype) * size_t(t * v.stride(0) + h * v.stride(1));
  };
  const bool big = n * heads * d > (1 << 16);
  parallel_for(n, big ? parallelism(options_) : Parallelism{}, [&](int64_t t) {
    std::vector<float> pv(static_cast<size_t>(d)), sv(static_cast<size_t>(d));
    for (int64_t h = 0; h < heads; ++h) {
      float p = lse_at(a.prefix_lse, h, t), s = lse_at(a.suffix_lse, h, t);
      if (std::isinf(p)) p = kNegInf;
      if (std::isinf(s)) s = kNegInf;
      const float m = std::max(p, s);
      float wp = 1.0f, ws = 0.0f, out_lse = kNegInf;
      if (m != kNegInf) {
        wp = std::exp(p - m);
        ws = std::exp(s - m);
        out_lse = std::log(wp + ws) + m;
        const float total = wp + ws;
        wp /= total;
        ws /= total;
      }
      convert_row(row(a.prefix_output, t, h), a.prefix_output.dtype, pv.data(), DType::kF32, d,
                  1.0f);
      convert_row(row(a.suffix_output, t, h), a.suffix_output.dtype, sv.data(), DType::kF32, d,
                  1.0f);
      for (int64_t i = 0; i < d; ++i) {
        // A side with weight 0 is not read (its row may be garbage for an empty range).
        pv[size_t(i)] =
            (wp == 0.0f ? 0.0f : wp * pv[size_t(i)]) + (ws == 0.0f ? 0.0f : ws * sv[size_t(i)]);
      }
      convert_row(pv.data(), DType::kF32, row(a.output, t, h), a.output.dtype, d, 1.0f);
      if (a.output_lse.defined()) {
        store_element(a.output_lse.data, a.output_lse.dtype,
                      h * a.output_lse.stride(0) + t * a.output_lse.stride(1), out_lse);
      }
    }
  });
}

float CpuBackend::amax(const TensorView& x) const {
  detail::require(x.device.is_cpu(), "amax: ", describe(x), " is not on the CPU");
  if (x.numel() == 0) return 0.0f;
  if (x.is_contiguous()) return amax_row(x.data, x.dtype, x.numel());
  // Strided: one contiguous-innermost row at a time.
  float m = 0.0f;
  std::array<int64_t, kMaxDims> idx{};
  const int last = x.ndim - 1;
  const int64_t rows = x.numel() / x.size(last);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int d = 0; d < last; ++d) off += idx[size_t(d)] * x.stride(d);
    float rm;
    if (x.stride(last) == 1) {
      rm = amax_row(static_cast<const char*>(x.data) + dtype_size(x.dtype) * size_t(off), x.dtype,
                    x.size(last));
    } else {
      rm = 0.0f;
      for (int64_t i = 0; i < x.size(last); ++i) {
        const float v = std::fabs(float(load_element(x.data, x.dtype, off + i * x.stride(last))));
        rm = std::isnan(v) ? v : std::max(rm, v);
      }
    }
    if (std::isnan(rm)) return rm;
    m = std::max(m, rm);
    for (int d = last - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < x.size(d)) break;
      idx[size_t(d)] = 0;
    }
  }
  return m;
}

}  // namespace

BackendOptions backend_options_from_env() {
  BackendOptions o;
  if (const char* s = std::getenv(kThreadsEnvVar); s && *s) {
    detail::set_option(option_table(), o, "threads", s,
                       std::string(kThreadsEnvVar) + ": " + std::string(kSource));
  }
  return o;
}

std::unique_ptr<Backend> make_backend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace pagedattn::cpu
