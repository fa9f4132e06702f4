// Constants the paged attention kernels share (decode, both prefill kernels, the split
// combine), each with its reason. Host and device code both read these.
#pragma once

#include <cstdint>

#include "pagedattn/dtype.h"

namespace pagedattn::cuda::attn {

/// How a compiled instance reads the KV cache.
enum class KVKind : uint8_t {
  kSame,  ///< 16-bit cache of the activation dtype: tensor cores straight from the stage
  kFp8,   ///< e4m3 / e5m2 (chosen at run time), widened exactly: by decode to f16 in
          ///< registers (to the activation dtype in smem at head size 80), by the prefill
          ///< kernels in smem (portable: to the activation dtype; Hopper: to f16, except
          ///< the fp8 products, which read e4m3 as it is)
  kAny,   ///< any cache dtype and any head size (run time): float CUDA-core math, the slow path
};

/// Largest head size of the paged attention kernels (MLA's latent kernel aside).
inline constexpr int kMaxHeadSize = 256;
/// Whether the paged attention kernels take rows of `head_size` elements of `elem_bytes` bytes:
/// 8 to kMaxHeadSize in steps of 8 (Q and O move in 8-element chunks) whose cache rows are
/// whole 16-byte chunks (steps of 16 for fp8 caches). A size between the compiled ones runs
/// on the next larger instance (its bucket), whose extra columns stay zero in shared memory.
constexpr bool serves_head_size(int head_size, int64_t elem_bytes) {
  return head_size >= 8 && head_size <= kMaxHeadSize && head_size % 8 == 0 &&
         (int64_t(head_size) * elem_bytes) % 16 == 0;
}

/// Split-KV bounds: at most this many splits (the combine kernel reads one LSE per lane, two
/// lanes' worth), and at least this many KV tokens per split (below it the partial-output
/// traffic and the per-CTA prologue outweigh the parallelism gained).
inline constexpr int kMaxSplits = 64;
inline constexpr int kMinSplitTokens = 256;
/// Shared memory a CTA may take and still share the SM with another (228 KB per SM, 1 KB
/// reserved per CTA): two CTAs keep 8 warps of loads in flight.
inline constexpr int kTwoCtaSmemBudget = 113 * 1024;
/// Largest opt-in dynamic shared memory per CTA on sm_90.
inline constexpr int kMaxSmemPerCta = 227 * 1024;

}  // namespace pagedattn::cuda::attn
