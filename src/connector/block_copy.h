// Copies one block of one layer's paged cache to and from the stored form: K then V, each
// [block_size, num_kv_heads, head_size] in NHD order, contiguous (the entry's tensor
// [2, block_size, num_kv_heads, head_size]), whatever the cache's layout and device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedattn/kv_cache.h"

namespace pagedattn::connector {

/// Bytes of one block of one layer in the stored form: 2 * block_size * num_kv_heads *
/// head_size * element size.
size_t block_bytes(const KVCacheView& cache);

/// Copies block `block` of `cache` into `dst` (host memory of block_bytes(cache)).
void gather_block(const KVCacheView& cache, int64_t block, void* dst);
/// Copies `src` (host memory of block_bytes(cache)) into block `block` of `cache`.
void scatter_block(const KVCacheView& cache, int64_t block, const void* src);

}  // namespace pagedattn::connector
