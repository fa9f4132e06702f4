// Tile sizes of merge_states, each with its reason.
#pragma once

namespace pagedattn::cuda::merge {

/// Elements per thread and access: 16 bytes of a 16-bit output (fp32 moves 2 x 16 bytes).
/// Any head size works; sizes that are not a multiple of kVec take the scalar path.
inline constexpr int kVec = 8;
/// Threads per CTA of the grid-stride loop over (row, chunk) items.
inline constexpr int kThreads = 256;

}  // namespace pagedattn::cuda::merge
