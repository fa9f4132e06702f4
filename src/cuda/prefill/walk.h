// The order in which the prefill kernels take their work tiles (AttnParams::pair_group) and
// how a persistent Hopper grid hands them out (AttnParams::tile_counter), as host / device
// functions: the kernels run them on the device, and host tests check that every work tile is
// taken once (group by group; by any interleaving of the CTAs' draws).
#pragma once

#include <cstdint>

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

/// The dynamic walk of a persistent grid of `ctas` < `total` CTAs (AttnParams::tile_counter),
/// run by thread 0 of a CTA's producer: the number of the CTA's next work tile, or -1 when none
/// is left (the CTA then stops drawing). `first` starts as the CTA's index, its first work
/// tile, taken without a draw (then -1); every later one is ctas + draw(), draw() being the
/// counter's atomicAdd of 1, so the CTAs take the numbering in order, each as soon as it is
/// free (longest causal work first, as prefill_work orders it; a number without rows is
/// dropped and the next drawn). Every number past the first ones is drawn once and each CTA
/// draws one >= total, so the grid's draws are 0 .. total - 1: the one that draws total - 1,
/// the launch's last, stores 0 by reset() for the next launch (a graph replay included).
template <class Draw, class Reset>
PAGEDATTN_HOST_DEVICE int draw_tile(int& first, int ctas, int total, Draw&& draw, Reset&& reset) {
  if (first >= 0) {
    const int t = first;
    first = -1;
    return t;
  }
  const int v = draw();
  if (v == total - 1) reset();
  return ctas + v < total ? ctas + v : -1;
}

/// Whether the dynamic walk pays for a launch of num_seqs requests' tokens: only where at least
/// half of the num_q_tiles x num_seqs q tiles of a KV head can have rows (at most
/// ceil(tokens x group / block_m) + num_seqs do), since each number without rows costs the CTA
/// that draws it an atomic round trip and a barrier, where the static snake skips it with a few
/// loads. A mixed step's grid, sized by its longest query, is mostly empty: its decode requests'
/// rows go to the decode kernel.
inline bool dynamic_walk_pays(int64_t tokens, int num_seqs, int group, int block_m,
                              int num_q_tiles) {
  const int64_t with_rows = (tokens * group + block_m - 1) / block_m + num_seqs;
  return 2 * with_rows >= int64_t(num_q_tiles) * num_seqs;
}

}  // namespace pagedattn::cuda::prefill
