#include "broken_backends.h"

#include <cmath>

#include "ref/ref_backend.h"

namespace pagedattn::backend_ops {
namespace {

// Reverses dimension `dim` of a view (negative stride), so head i of the view is head H-1-i.
TensorView reversed(const TensorView& v, int dim) {
  if (!v.defined()) return v;
  TensorView r = v;
  const int64_t n = v.size(dim);
  r.data = static_cast<char*>(v.data) + (n - 1) * v.stride(dim) * int64_t(dtype_size(v.dtype));
  r.strides[size_t(dim)] = -v.stride(dim);
  return r;
}

AttentionConfig mutated(AttentionConfig c, Bug bug) {
  switch (bug) {
    case Bug::kIgnoresCausalMask:
      // Cross attention reads the same cache without a causal mask.
      if (c.attn_type == AttentionType::kDecoder) c.attn_type = AttentionType::kEncoderDecoder;
      break;
    case Bug::kWindowOffByOne:
      if (c.sliding_window) c.sliding_window = *c.sliding_window + 1;
      break;
    case Bug::kIgnoresSoftCap:
      c.logits_soft_cap.reset();
      break;
    case Bug::kAlibiSignFlipped:
      for (float& s : c.alibi_slopes) s = -s;
      break;
    case Bug::kIgnoresSinks:
      c.sinks.clear();
      break;
    case Bug::kScaleOffByTwoPercent:
      c.scale *= 1.02f;
      break;
    default:
      break;
  }
  return c;
}

// Scales as a backend that reads element 0 of each per-head vector would use them.
KVScales head_zero(KVScales s) {
  for (auto [v, whole] :
       {std::pair{&s.k_scales, &s.k_scale}, {&s.v_scales, &s.v_scale}, {&s.q_scales, &s.q_scale}}) {
    if (!v->empty()) *whole = v->front();
    v->clear();
  }
  return s;
}

class BrokenImpl final : public AttentionImpl {
 public:
  BrokenImpl(const AttentionConfig& config, Bug bug, const Backend& ref)
      : bug_(bug), inner_(ref.make_impl(mutated(config, bug), Device::cpu())) {}

  void write_kv(const WriteKVArgs& args) override {
    if (bug_ == Bug::kHeadZeroScales) {
      WriteKVArgs w = args;
      w.scales = head_zero(args.scales);
      return inner_->write_kv(w);
    }
    if (bug_ != Bug::kWritesNextSlot) return inner_->write_kv(args);
    const int64_t capacity = args.kv_cache.num_blocks() * args.kv_cache.block_size();
    std::vector<int64_t> shifted(size_t(args.slot_mapping.size(0)));
    for (size_t t = 0; t < shifted.size(); ++t) {
      const int64_t s = static_cast<const int64_t*>(args.slot_mapping.data)[t];
      shifted[t] = s >= 0 && s + 1 < capacity ? s + 1 : s;
    }
    WriteKVArgs w = args;
    w.slot_mapping = TensorView::contiguous(shifted.data(), DType::kI64, {int64_t(shifted.size())});
    inner_->write_kv(w);
  }

  void forward(const ForwardArgs& args) override {
    ForwardArgs f = args;
    if (bug_ == Bug::kIgnoresFp8Scales) f.scales = {};
    if (bug_ == Bug::kHeadZeroScales) f.scales = head_zero(f.scales);
    if (bug_ == Bug::kWrongGqaMapping) {
      f.query = reversed(f.query, 1);
      f.output = reversed(f.output, 1);
      f.lse = reversed(f.lse, 0);
    }
    inner_->forward(f);
    const int64_t t_a = args.metadata->num_actual_tokens;
    if (bug_ == Bug::kSkipsLastRow && t_a > 0) {
      const TensorView row = args.output.select(0, t_a - 1);
      for (int64_t h = 0; h < row.size(0); ++h) {
        for (int64_t d = 0; d < row.size(1); ++d) {
          store_element(row.data, row.dtype, h * row.stride(0) + d * row.stride(1), std::nan(""));
        }
      }
    }
    if (bug_ == Bug::kLseOffByOnePercent && args.lse.defined()) {
      for (int64_t h = 0; h < args.lse.size(0); ++h) {
        for (int64_t t = 0; t < t_a; ++t) {
          const int64_t o = h * args.lse.stride(0) + t * args.lse.stride(1);
          store_element(args.lse.data, args.lse.dtype, o,
                        load_element(args.lse.data, args.lse.dtype, o) * 1.01);
        }
      }
    }
  }

 private:
  Bug bug_;
  std::unique_ptr<AttentionImpl> inner_;
};

class BrokenBackend final : public Backend {
 public:
  explicit BrokenBackend(Bug bug) : bug_(bug), name_("broken_" + bug_name(bug)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "the reference with one bug (tests)"; }
  std::vector<std::string> check(const BackendQuery& q) const override { return ref_->check(q); }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& config, Device) const override {
    return std::make_unique<BrokenImpl>(config, bug_, *ref_);
  }

 private:
  Bug bug_;
  std::string name_;
  std::unique_ptr<Backend> ref_ = ref::make_backend();
};

}  // namespace

std::vector<Bug> all_bugs() {
  return {Bug::kIgnoresCausalMask, Bug::kWindowOffByOne,     Bug::kIgnoresSoftCap,
          Bug::kAlibiSignFlipped,  Bug::kIgnoresSinks,       Bug::kScaleOffByTwoPercent,
          Bug::kIgnoresFp8Scales,  Bug::kWrongGqaMapping,    Bug::kWritesNextSlot,
          Bug::kSkipsLastRow,      Bug::kLseOffByOnePercent, Bug::kHeadZeroScales};
}

std::string bug_name(Bug bug) {
  switch (bug) {
    case Bug::kIgnoresCausalMask:
      return "no_causal";
    case Bug::kWindowOffByOne:
      return "window_plus_one";
    case Bug::kIgnoresSoftCap:
      return "no_softcap";
    case Bug::kAlibiSignFlipped:
      return "alibi_sign";
    case Bug::kIgnoresSinks:
      return "no_sinks";
    case Bug::kScaleOffByTwoPercent:
      return "scale_2pct";
    case Bug::kIgnoresFp8Scales:
      return "no_fp8_scales";
    case Bug::kWrongGqaMapping:
      return "gqa_mapping";
    case Bug::kWritesNextSlot:
      return "next_slot";
    case Bug::kSkipsLastRow:
      return "skip_last_row";
    case Bug::kLseOffByOnePercent:
      return "lse_1pct";
    case Bug::kHeadZeroScales:
      return "head_zero_scales";
  }
  return "unknown";
}

std::unique_ptr<Backend> make_broken_backend(Bug bug) {
  return std::make_unique<BrokenBackend>(bug);
}

}  // namespace pagedattn::backend_ops
