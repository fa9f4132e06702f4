// The shape of the Hopper prefill kernel's TMA map over the query (AttnParams::q_map): host
// arithmetic only, so that its refusals are tested without a GPU.
#pragma once

#include <cstdint>

#include "pagedattn/tensor.h"

namespace pagedattn::cuda {

/// A 3-D map over a 16-bit query [tokens, heads, head_size]: dims {head_size, heads, tokens},
/// byte strides of heads and tokens, and the box {64 columns, group heads, block_m / group
/// tokens}: a work tile's block_m packed rows (token-major, the group's heads per token) in
/// order, one box per 64-column panel.
struct QMapShape {
  uint64_t dims[3] = {};
  uint64_t strides[2] = {};
  uint32_t box[3] = {};
};

/// The shape for `query` read `group` heads per KV head by a kernel of `block_m` packed rows,
/// or false with the reason in `*why` (the kernel then copies Q by cp.async): the group must
/// divide block_m, the tensor must hold at least one box of tokens, its rows must be contiguous
/// and its base and row strides multiples of 16 bytes.
bool q_map_shape(const TensorView& query, int head_size, int group, int block_m, QMapShape* shape,
                 const char** why);

}  // namespace pagedattn::cuda
