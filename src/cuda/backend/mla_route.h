// The cuda backend's MLA route: head size 576 (kv_lora_rank 512 + qk_rope_head_dim 64) with one
// KV head goes to the latent decode kernel (cuda/mla), which reads one cache as K and V.
#pragma once

#include <string>
#include <vector>

#include "pagedattn/config.h"

namespace pagedattn::cuda {

/// Whether `config` takes the MLA route (head size 576: no other CUDA kernel serves it).
bool is_mla_shape(const AttentionConfig& config);

/// Why the MLA kernel cannot serve `config` (an MLA shape): one reason per missing feature
/// (ALiBi, soft cap, sliding window, sinks, more than one KV head, encoder types, dtypes not
/// compiled). Empty: it can.
std::vector<std::string> mla_reasons(const AttentionConfig& config);

}  // namespace pagedattn::cuda
