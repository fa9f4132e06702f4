// Checked mode: the step's device metadata copied to the host and validated before a launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedattn/metadata.h"

namespace pagedattn::cuda {

/// Synchronises `stream`, copies query_start_loc, seq_lens, block_table and slot_mapping to
/// the host, requires the device arrays to equal the *_cpu mirrors (the plan read those), and
/// runs validate_metadata on the copies: what the kernels will read. Throws InvalidArgument.
void validate_device_metadata(const AttentionMetadata& metadata, AttentionType attn_type,
                              const CacheGeometry& cache, cudaStream_t stream);

/// Synchronises `stream`, copies `slot_mapping` to the host and requires every slot to be -1
/// or inside [0, capacity). Throws InvalidArgument naming the first bad slot.
void validate_device_slots(const TensorView& slot_mapping, int64_t capacity, cudaStream_t stream);

}  // namespace pagedattn::cuda
