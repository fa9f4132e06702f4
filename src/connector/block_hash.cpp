// The chain hash of full blocks, shared by prefix caching (tools/sim) and the connectors' keys.
#include "pagedattn/connector.h"
#include "pagedattn/error.h"

namespace pagedattn {

uint64_t hash_block_tokens(uint64_t parent_hash, std::span<const int32_t> token_ids) {
  // FNV-1a over the parent hash and the token ids, then a final avalanche (splitmix64).
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t word) {
    for (int i = 0; i < 8; ++i) {
      h ^= (word >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  };
  mix(parent_hash);
  mix(token_ids.size());
  for (const int32_t t : token_ids) mix(uint64_t(uint32_t(t)));
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

void extend_block_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> token_ids,
                         int block_size) {
  detail::require(block_size >= 1, "extend_block_hashes: block_size (", block_size,
                  ") must be >= 1");
  const size_t full = token_ids.size() / size_t(block_size);
  while (hashes.size() < full) {
    const size_t j = hashes.size();
    const uint64_t parent = j == 0 ? kNoParentHash : hashes[j - 1];
    hashes.push_back(
        hash_block_tokens(parent, token_ids.subspan(j * size_t(block_size), size_t(block_size))));
  }
}

}  // namespace pagedattn
