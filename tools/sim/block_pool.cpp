#include "sim/block_pool.h"

#include "pagedattn/error.h"

namespace pagedattn::sim {

using detail::require;

BlockPool::BlockPool(int64_t num_blocks) {
  require(num_blocks >= 2, "BlockPool: num_blocks (", num_blocks,
          ") must be >= 2 (block 0 is the null block)");
  blocks_.resize(size_t(num_blocks));
  for (int64_t b = 1; b < num_blocks; ++b) {
    blocks_[size_t(b)].where = free_queue_.insert(free_queue_.end(), int32_t(b));
  }
}

const BlockPool::Block& BlockPool::at(int32_t block) const {
  require(block > 0 && block < num_blocks(), "BlockPool: block ", block,
          " is outside the usable blocks [1, ", num_blocks(), ")");
  return blocks_[size_t(block)];
}

std::vector<int32_t> BlockPool::allocate(int64_t n) {
  require(n >= 0 && n <= num_free_blocks(), "BlockPool::allocate: ", n, " blocks asked, ",
          num_free_blocks(), " free");
  std::vector<int32_t> out;
  out.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = free_queue_.front();
    free_queue_.pop_front();
    Block& b = blocks_[size_t(id)];
    if (b.cached) {  // evict: the block will hold other tokens
      cached_.erase(b.key);
      b.cached = false;
      ++evictions_;
    }
    b.ref_count = 1;
    out.push_back(id);
  }
  return out;
}

void BlockPool::touch(int32_t block) {
  at(block);
  Block& b = blocks_[size_t(block)];
  if (b.ref_count == 0) free_queue_.erase(b.where);
  ++b.ref_count;
}

void BlockPool::free(std::span<const int32_t> blocks) {
  for (const int32_t id : blocks) {
    if (id == kNullBlock) continue;
    at(id);
    Block& b = blocks_[size_t(id)];
    require(b.ref_count > 0, "BlockPool::free: block ", id, " is already free");
    if (--b.ref_count == 0) b.where = free_queue_.insert(free_queue_.end(), id);
  }
}

std::optional<int32_t> BlockPool::lookup(int group, uint64_t hash) const {
  const auto it = cached_.find({group, hash});
  if (it == cached_.end()) return std::nullopt;
  return it->second;
}

bool BlockPool::cache(int group, uint64_t hash, int32_t block) {
  at(block);
  Block& b = blocks_[size_t(block)];
  require(b.ref_count > 0, "BlockPool::cache: block ", block, " is free; only blocks in use ",
          "can be registered");
  if (b.cached || cached_.count({group, hash}) != 0) return false;
  b.cached = true;
  b.key = {group, hash};
  cached_[b.key] = block;
  return true;
}

int BlockPool::ref_count(int32_t block) const {
  return at(block).ref_count;
}
bool BlockPool::is_cached(int32_t block) const {
  return at(block).cached;
}
bool BlockPool::is_free(int32_t block) const {
  return at(block).ref_count == 0;
}

}  // namespace pagedattn::sim
