// Tile sizes of write_kv, each with its reason.
#pragma once

namespace pagedattn::cuda::cache_ops {

/// Elements per thread and access: 8 16-bit activations are one 16-byte load, and 8 fp8
/// outputs one 8-byte store (the narrowest store worth vectorising). fp32 moves 2 x 16 bytes.
inline constexpr int kVec = 8;
/// Threads per CTA (one CTA per token): a token is num_kv_heads * head_size / kVec chunks,
/// 128 for the common 8 x 128; more threads than chunks would idle.
inline constexpr int kMaxThreads = 256;

}  // namespace pagedattn::cuda::cache_ops
