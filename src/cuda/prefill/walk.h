// The order in which the prefill kernels take their work tiles (DecodeParams::pair_group), as a
// host / device function: prefill_work runs it on the device, and a host test checks that it
// visits every (pair, q tile) once, group by group.
#pragma once

#if defined(__CUDACC__)
#define PAGEDATTN_HOST_DEVICE __host__ __device__
#else
#define PAGEDATTN_HOST_DEVICE
#endif

namespace pagedattn::cuda::prefill {

/// Work tile x's (request, KV head) pair and q tile rank (0: taken first; prefill_work reverses
/// it, so that the tiles with the most causal keys start first).
struct WalkIndex {
  int tile_rank, pair;
};

/// x in [0, pairs * num_q_tiles): groups of pair_group pairs slowest (pair_group <= 0 or >= pairs:
/// one group; the last group may be smaller), then the q tile rank, then the pair within the
/// group.
PAGEDATTN_HOST_DEVICE inline WalkIndex walk_index(int x, int pairs, int pair_group,
                                                  int num_q_tiles) {
  const int group_pairs = pair_group > 0 && pair_group < pairs ? pair_group : pairs;
  const int pair0 = x / (group_pairs * num_q_tiles) * group_pairs;
  const int size = pairs - pair0 < group_pairs ? pairs - pair0 : group_pairs;
  const int in = x - pair0 * num_q_tiles;
  const int tile_rank = in / size;
  return WalkIndex{tile_rank, pair0 + in - tile_rank * size};
}

}  // namespace pagedattn::cuda::prefill
