#include "ref/ref_backend.h"

#include <cmath>

#include "pagedattn/error.h"
#include "ref/ref_ops.h"

namespace pagedattn::ref {
namespace {

class RefImpl final : public AttentionImpl {
 public:
  RefImpl(const AttentionConfig& config, Precision precision)
      : config_(config), precision_(precision) {}
  void write_kv(const WriteKVArgs& args) override { ref::write_kv(config_, args); }
  void forward(const ForwardArgs& args) override { ref::attention(config_, args, precision_); }

 private:
  AttentionConfig config_;
  Precision precision_;
};

class RefBackend final : public Backend {
 public:
  explicit RefBackend(Precision precision) : precision_(precision) {}
  std::string_view name() const override {
    return precision_ == Precision::kFloat64 ? "ref" : "ref_lowp";
  }
  std::string_view description() const override {
    return precision_ == Precision::kFloat64
               ? "float64 reference (naive, every feature, CPU): the oracle"
               : "the reference algorithm in float32 with low-precision probabilities (tests)";
  }
  std::vector<std::string> check(const BackendQuery& query) const override {
    std::vector<std::string> reasons;
    if (!query.device.is_cpu()) {
      reasons.push_back(
          detail::cat("runs on the CPU only; the tensors are on ", to_string(query.device)));
    }
    return reasons;
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& config, Device) const override {
    return std::make_unique<RefImpl>(config, precision_);
  }
  void merge_states(const MergeArgs& args) const override {
    check_merge_args(args);
    ref::merge_states(args);
  }
  float amax(const TensorView& x) const override { return ref::amax(x); }

 private:
  Precision precision_;
};

}  // namespace

std::unique_ptr<Backend> make_backend(Precision precision) {
  return std::make_unique<RefBackend>(precision);
}

}  // namespace pagedattn::ref
