// Head-size padding for layers whose backend takes a padded head size but not the caller's
// (the cuda kernels take multiples of 8): rows [rows, heads, d] copied into scratch rows
// [rows, heads, d_pad] whose columns past d are zeros, and the first d columns of padded output
// rows copied back. Zero columns add nothing to q.k, and the output columns they give are
// dropped, so attention at d_pad with the scale of d is attention at d.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "pagedattn/config.h"
#include "pagedattn/device.h"
#include "pagedattn/registry.h"
#include "pagedattn/tensor.h"

namespace pagedattn::detail {

class HeadPad {
 public:
  /// Slots of scratch, one per tensor of a call.
  enum Slot { kQuery, kKey, kValue, kOutput, kSlots };

  HeadPad() = default;
  HeadPad(int head_size, int padded_head_size, DType dtype, Device device);

  bool active() const { return padded_ > head_size_; }
  int padded_head_size() const { return padded_; }

  /// `rows` [n, heads, head_size] (last dimension contiguous) copied into slot `slot`'s scratch,
  /// returned as its [n, heads, padded_head_size] view. Ordered on `stream`; the first call of a
  /// larger size allocates and zeroes the scratch (not capturable).
  TensorView pad(Slot slot, const TensorView& rows, Stream stream);
  /// Slot `slot`'s scratch as the [n, heads, padded_head_size] rows an output goes to.
  TensorView scratch(Slot slot, int64_t n, int64_t heads, Stream stream);
  /// The first head_size columns of `padded` [n, heads, padded_head_size] into `out`
  /// [n, heads, head_size] (last dimension contiguous), on `stream`.
  void unpad(const TensorView& padded, const TensorView& out, Stream stream) const;

 private:
  int head_size_ = 0, padded_ = 0;
  DType dtype_ = DType::kF32;
  Device device_;
  std::array<Tensor, kSlots> scratch_;
};

/// The next multiple of 8 (the cuda kernels' step) at or above `head_size`.
constexpr int head_size_step_8(int head_size) {
  return (head_size + 7) / 8 * 8;
}

/// A layer's backend and what it runs: `config` as it is where a backend takes it (pad null);
/// else, where one takes its head size padded to the next multiple of 8, or failing that of 16
/// (an fp8 cache's rows on cuda are whole 16-byte chunks), with V's equal to it,
/// that backend, the padded config (the scale stays the caller's) and the HeadPad. Else the
/// refusal for `config` stands (NotSupported, every backend's reasons).
struct PaddedSelection {
  const Backend* backend = nullptr;
  AttentionConfig run_config;
  std::unique_ptr<HeadPad> pad;
};
PaddedSelection select_padded(const Registry& registry, const AttentionConfig& config,
                              Device device, const std::optional<std::string>& override_name);

}  // namespace pagedattn::detail
