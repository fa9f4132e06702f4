#include "cpu/cpu_plan.h"

#include <omp.h>

#include <algorithm>

namespace pagedattn::cpu {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Keys are processed in chunks of 64 (kChunk in cpu_kernels.cpp); splits start on a chunk.
constexpr int64_t kChunkAlign = 64;

}  // namespace

PlanOptions plan_options(int threads) {
  PlanOptions o;
  o.num_threads = threads > 0 ? threads : omp_get_max_threads();
  return o;
}

void visible_key_range(const AttentionConfig& c, int64_t context, int64_t seq_len, int q_begin,
                       int q_end, int64_t* first, int64_t* end) {
  int64_t lo = 0, hi = seq_len;
  const int64_t first_pos = context + q_begin, last_pos = context + q_end - 1;
  if (c.causal()) hi = std::min(hi, last_pos + 1);
  if (const int left = c.window_left(); left >= 0) lo = std::max<int64_t>(0, first_pos - left);
  if (const int right = c.window_right(); right >= 0) hi = std::min(hi, last_pos + right + 1);
  *first = std::min(lo, hi);
  *end = hi;
}

std::unique_ptr<CpuPlan> make_plan(const AttentionMetadata& md, const AttentionConfig& c,
                                   const PlanOptions& o) {
  auto plan = std::make_unique<CpuPlan>();
  plan->head_size = c.head_size;
  const int group = c.num_queries_per_kv();
  // A tile of ~128 rows reuses each converted K/V chunk across enough rows to amortise the
  // conversion and packing, while its float scratch (Q, O: rows x head_size) stays in L2.
  const int tile_tokens = std::max(1, o.tile_rows / group);
  const auto* qsl = static_cast<const int32_t*>(md.query_start_loc_cpu.data);
  const auto* seq = static_cast<const int32_t*>(md.seq_lens_cpu.data);
  const bool cached = uses_kv_cache(c.attn_type);
  std::vector<WorkItem> base;
  for (int r = 0; r < md.num_seqs; ++r) {
    const int q_len = qsl[r + 1] - qsl[r];
    if (q_len == 0) continue;
    const int64_t seq_len = cached ? seq[r] : q_len;
    const int64_t context = seq_len - q_len;
    for (int q0 = 0; q0 < q_len; q0 += tile_tokens) {
      const int q1 = std::min(q_len, q0 + tile_tokens);
      WorkItem w;
      w.request = r;
      w.q_begin = q0;
      w.q_end = q1;
      visible_key_range(c, context, seq_len, q0, q1, &w.k_begin, &w.k_end);
      w.cost = (w.k_end - w.k_begin + 1) * (q1 - q0) * group;
      // Few rows per KV head (decode) and heads interleaved in memory (NHD, or the inputs of
      // an encoder): one item takes every KV head, so it reads whole token rows in address
      // order. Otherwise (HND, where each head's block is contiguous; prefill tiles) one item
      // per KV head.
      const bool interleaved = !cached || c.kv_cache_layout == KVCacheLayout::kNHD;
      const int heads_per_item =
          interleaved && (q1 - q0) * group <= o.few_rows ? c.num_kv_heads : 1;
      w.num_kv_heads = heads_per_item;
      w.cost *= heads_per_item;
      for (int h = 0; h < c.num_kv_heads; h += heads_per_item) {
        w.kv_head = h;
        base.push_back(w);
      }
    }
  }
  // Too few items to keep every thread busy (small batches of long decodes): split the key
  // ranges, so that each thread gets several pieces; partials are merged by LSE afterwards.
  const int64_t target = int64_t(o.num_threads) * o.items_per_thread;
  const int64_t want = base.empty() ? 1 : ceil_div(target, int64_t(base.size()));
  for (const WorkItem& w : base) {
    const int64_t keys = w.k_end - w.k_begin;
    const int64_t splits =
        o.num_threads > 1 ? std::clamp<int64_t>(keys / o.min_split_keys, 1, want) : 1;
    if (splits <= 1) {
      plan->items.push_back(w);
      continue;
    }
    const int64_t step = ceil_div(ceil_div(keys, splits), kChunkAlign) * kChunkAlign;
    SplitGroup g{w, plan->num_partials, 0};
    for (int64_t k = w.k_begin; k < w.k_end; k += step) {
      WorkItem part = w;
      part.k_begin = k;
      part.k_end = std::min(w.k_end, k + step);
      part.split = plan->num_partials++;
      part.include_sink = g.num_splits == 0;
      part.cost = (part.k_end - part.k_begin + 1) * (w.q_end - w.q_begin) * group;
      plan->items.push_back(part);
      ++g.num_splits;
    }
    plan->rows_stride =
        std::max<int64_t>(plan->rows_stride, int64_t(w.q_end - w.q_begin) * group * w.num_kv_heads);
    plan->split_groups.push_back(g);
  }
  // Largest first: with dynamic scheduling the tail is made of small items.
  std::stable_sort(plan->items.begin(), plan->items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

}  // namespace pagedattn::cpu
