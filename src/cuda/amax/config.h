// Sizes of the amax reduction, each with its reason.
#pragma once

namespace pagedattn::cuda::amax {

/// Threads per CTA; each warp folds its maximum into one atomicMax.
inline constexpr int kThreads = 256;
/// CTA cap: enough to fill 132 SMs a few times; a grid-stride loop covers larger tensors.
inline constexpr int kMaxCtas = 1024;

}  // namespace pagedattn::cuda::amax
