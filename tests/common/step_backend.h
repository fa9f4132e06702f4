// A backend for layer tests: ref, refusing head sizes that are not multiples of `step` (8: as
// the cuda kernels do), so that a layer's padding (src/core/head_pad.h) runs on the CPU.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/error.h"

namespace pagedattn::test {

class StepBackend final : public Backend {
 public:
  StepBackend(const Backend& ref, int step) : ref_(ref), step_(step) {}
  std::string_view name() const override { return "test-step"; }
  std::string_view description() const override { return "ref at multiples of a step only"; }
  std::vector<std::string> check(const BackendQuery& q) const override {
    if (q.config.head_size % step_ != 0) return {detail::cat("head sizes in steps of ", step_)};
    return ref_.check(q);
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& c, Device d) const override {
    return ref_.make_impl(c, d);
  }
  std::unique_ptr<Plan> plan(const AttentionMetadata& md, const AttentionConfig& c) const override {
    return ref_.plan(md, c);
  }

 private:
  const Backend& ref_;
  int step_;
};

}  // namespace pagedattn::test
