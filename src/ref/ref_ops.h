// The reference computations, written for reading: one loop per formula of the spec.
#pragma once

#include "pagedattn/backend.h"
#include "ref/ref_backend.h"

namespace pagedattn::ref {

/// vLLM's reshape_and_cache_flash on the host.
void write_kv(const AttentionConfig& config, const WriteKVArgs& args);
/// Paged (or, for encoder types, direct) attention, spec section 4.
void attention(const AttentionConfig& config, const ForwardArgs& args, Precision precision);
/// merge_attn_states, spec 4.12.
void merge_states(const MergeArgs& args);
/// max |x| over a host tensor (NaN propagates).
float amax(const TensorView& x);

}  // namespace pagedattn::ref
