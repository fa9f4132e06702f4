// The KV-cache block allocator: reference counts, block 0 reserved as the null block, and
// prefix caching (full blocks found by a chain hash, kept after they are freed until an
// allocation evicts them, least recently freed first).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "pagedattn/connector.h"

namespace pagedattn::sim {

/// Hash of one full block: (parent block's hash, the block's token ids). A block's hash thus
/// names its whole prefix, as in vLLM's prefix caching. The first block's parent is
/// kNoParentHash. The library's function, so that the KV connectors key their stores with the
/// same hashes.
using pagedattn::hash_block_tokens;
using pagedattn::kNoParentHash;

/// The physical block id that marks "no data here" in a block table (spec 3.7).
inline constexpr int32_t kNullBlock = 0;

/// Blocks [1, num_blocks) of one pool. A block is in use (ref count > 0) or free; a free block
/// may still be cached (it keeps its hash and can be revived by a prefix hit). Free blocks
/// form one queue: blocks are freed to its tail and allocated (evicting any cached hash) from
/// its head, so cached blocks survive in LRU order. Several KV-cache groups can share one pool:
/// hashes are looked up per group.
class BlockPool {
 public:
  /// A pool of `num_blocks` blocks, block 0 included (>= 2); every usable block starts free.
  explicit BlockPool(int64_t num_blocks);

  int64_t num_blocks() const { return int64_t(blocks_.size()); }
  /// Blocks that can hold data: num_blocks - 1.
  int64_t num_usable_blocks() const { return num_blocks() - 1; }
  /// Free blocks, cached or not (all of them can be allocated).
  int64_t num_free_blocks() const { return int64_t(free_queue_.size()); }
  int64_t num_used_blocks() const { return num_usable_blocks() - num_free_blocks(); }
  /// Blocks registered under a hash (in use or free).
  int64_t num_cached_blocks() const { return int64_t(cached_.size()); }
  /// Cached blocks that an allocation reused for other data.
  int64_t num_evictions() const { return evictions_; }

  /// Takes `n` free blocks from the head of the free queue (ref count 1 each), dropping their
  /// cached hashes. Throws InvalidArgument when fewer than `n` are free.
  std::vector<int32_t> allocate(int64_t n);
  /// Adds a reference to a cached block found by lookup() (reviving it when it was free).
  void touch(int32_t block);
  /// Drops one reference from each block, in order; a block whose count reaches 0 goes to the
  /// tail of the free queue. The null block is skipped.
  void free(std::span<const int32_t> blocks);

  /// The cached block holding (group, hash), if any.
  std::optional<int32_t> lookup(int group, uint64_t hash) const;
  /// Registers a full block in use under (group, hash). Returns false (and registers nothing)
  /// when another block already holds that hash or this block is already cached.
  bool cache(int group, uint64_t hash, int32_t block);

  int ref_count(int32_t block) const;
  bool is_cached(int32_t block) const;
  bool is_free(int32_t block) const;

 private:
  struct Block {
    int ref_count = 0;
    bool cached = false;
    std::pair<int, uint64_t> key{};      // (group, hash) when cached
    std::list<int32_t>::iterator where;  // position in free_queue_ when free
  };
  const Block& at(int32_t block) const;

  std::vector<Block> blocks_;      // [num_blocks]; blocks_[0] is the null block
  std::list<int32_t> free_queue_;  // head = next to allocate (least recently freed)
  std::map<std::pair<int, uint64_t>, int32_t> cached_;
  int64_t evictions_ = 0;
};

}  // namespace pagedattn::sim
