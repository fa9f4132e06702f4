// The block allocator of `pagedattn run`: null block, reference counts, chain hashes, prefix
// cache lookups and LRU eviction of cached free blocks.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "sim/block_pool.h"

namespace pagedattn::sim {
namespace {

TEST(SimBlockPool, NullBlockIsNeverHandedOut) {
  BlockPool pool(5);  // blocks 1..4 usable
  EXPECT_EQ(pool.num_usable_blocks(), 4);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  std::vector<int32_t> got = pool.allocate(4);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), (std::set<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_ERROR(pool.allocate(1), InvalidArgument, "1 blocks asked, 0 free");
  pool.free(got);
  for (int round = 0; round < 3; ++round) {
    got = pool.allocate(4);
    for (const int32_t b : got) EXPECT_NE(b, kNullBlock);
    pool.free(got);
  }
  EXPECT_ERROR(BlockPool(1), InvalidArgument, "num_blocks (1) must be >= 2");
  EXPECT_ERROR(pool.ref_count(0), InvalidArgument, "block 0 is outside the usable blocks");
}

TEST(SimBlockPool, ReferenceCountsDecideWhenABlockIsFree) {
  BlockPool pool(4);
  const std::vector<int32_t> a = pool.allocate(2);
  EXPECT_EQ(pool.ref_count(a[0]), 1);
  EXPECT_EQ(pool.num_used_blocks(), 2);
  pool.touch(a[0]);  // a second request shares it
  EXPECT_EQ(pool.ref_count(a[0]), 2);
  pool.free(std::vector<int32_t>{a[0]});
  EXPECT_EQ(pool.ref_count(a[0]), 1);
  EXPECT_FALSE(pool.is_free(a[0]));
  EXPECT_EQ(pool.num_free_blocks(), 1);
  pool.free(std::vector<int32_t>{a[0], kNullBlock, a[1]});  // the null block is skipped
  EXPECT_TRUE(pool.is_free(a[0]));
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_ERROR(pool.free(std::vector<int32_t>{a[1]}), InvalidArgument, "is already free");
}

TEST(SimBlockPool, ChainHashNamesTheWholePrefix) {
  const std::vector<int32_t> x = {1, 2, 3, 4}, y = {1, 2, 3, 5};
  const uint64_t hx = hash_block_tokens(kNoParentHash, x);
  EXPECT_EQ(hx, hash_block_tokens(kNoParentHash, x));
  EXPECT_NE(hx, hash_block_tokens(kNoParentHash, y));
  // Same tokens under a different parent: a different block.
  EXPECT_NE(hash_block_tokens(hx, x), hash_block_tokens(hash_block_tokens(kNoParentHash, y), x));
}

TEST(SimBlockPool, CachedBlocksAreFoundPerGroupAndSurviveBeingFreed) {
  BlockPool pool(4);
  const std::vector<int32_t> a = pool.allocate(1);
  const uint64_t h = hash_block_tokens(kNoParentHash, std::vector<int32_t>{7, 7});
  EXPECT_FALSE(pool.lookup(0, h));
  EXPECT_TRUE(pool.cache(0, h, a[0]));
  EXPECT_EQ(pool.lookup(0, h), a[0]);
  EXPECT_FALSE(pool.lookup(1, h)) << "another KV-cache group has its own blocks";
  const std::vector<int32_t> b = pool.allocate(1);
  EXPECT_FALSE(pool.cache(0, h, b[0])) << "the hash is already held by another block";
  EXPECT_FALSE(pool.is_cached(b[0]));
  pool.free(a);
  EXPECT_TRUE(pool.is_free(a[0]));
  EXPECT_EQ(pool.lookup(0, h), a[0]) << "a freed cached block stays reusable";
  pool.touch(a[0]);  // a prefix hit revives it
  EXPECT_EQ(pool.ref_count(a[0]), 1);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_ERROR(pool.cache(0, 99, 3), InvalidArgument, "block 3 is free");
}

TEST(SimBlockPool, EvictsTheLeastRecentlyFreedCachedBlockFirst) {
  BlockPool pool(4);  // usable: 1, 2, 3
  const std::vector<int32_t> a = pool.allocate(3);
  const uint64_t h[3] = {11, 22, 33};
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.cache(0, h[i], a[size_t(i)]));
  EXPECT_EQ(pool.num_cached_blocks(), 3);
  pool.free(std::vector<int32_t>{a[1], a[0], a[2]});  // free order: a1, a0, a2
  EXPECT_EQ(pool.num_cached_blocks(), 3);
  EXPECT_EQ(pool.allocate(1), std::vector<int32_t>{a[1]});
  EXPECT_FALSE(pool.lookup(0, h[1])) << "evicted";
  EXPECT_EQ(pool.lookup(0, h[0]), a[0]);
  EXPECT_EQ(pool.num_evictions(), 1);
  pool.touch(a[0]);  // revived: no longer next in line
  EXPECT_EQ(pool.allocate(1), std::vector<int32_t>{a[2]});
  EXPECT_EQ(pool.lookup(0, h[0]), a[0]);
  EXPECT_EQ(pool.num_evictions(), 2);
  EXPECT_EQ(pool.num_free_blocks(), 0);
}

}  // namespace
}  // namespace pagedattn::sim
