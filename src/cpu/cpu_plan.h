// The CPU backend's per-step schedule: work items, longest first, and the KV splits that keep
// every core busy when a batch has fewer items than cores.
#pragma once

#include <memory>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "pagedattn/backend.h"

namespace pagedattn::cpu {

/// Items whose key range is split share one row group; merge_splits combines their partials.
struct SplitGroup {
  WorkItem whole;  ///< the unsplit item (its query range and KV head)
  int first_split = 0;
  int num_splits = 0;
};

class CpuPlan final : public Plan {
 public:
  std::vector<WorkItem> items;  ///< largest first
  std::vector<SplitGroup> split_groups;
  int num_partials = 0;
  int64_t rows_stride = 0;  ///< rows per partial slot
  int head_size = 0;
  size_t workspace_bytes() const override {
    return size_t(num_partials) * size_t(rows_stride) * size_t(head_size + 1) * sizeof(float);
  }
};

/// Tuning knobs, each with its reason in cpu_plan.cpp.
struct PlanOptions {
  int num_threads = 1;
  int tile_rows = 128;       ///< query rows (tokens x heads of a group) per item
  int min_split_keys = 256;  ///< never split a key range below this
  int items_per_thread = 4;  ///< split until there are this many items per thread
  int few_rows = 8;          ///< rows per KV head up to which the decode kernel is used
};

/// The plan's knobs for `threads` threads (0: OpenMP's thread count).
PlanOptions plan_options(int threads);

/// The schedule for one step of layers shaped like `config` (reads the metadata's host mirrors).
std::unique_ptr<CpuPlan> make_plan(const AttentionMetadata& metadata, const AttentionConfig& config,
                                   const PlanOptions& options);

/// The keys a query range can see: [first, end) for query tokens [q_begin, q_end) of a request
/// with `context` cached tokens and `seq_len` keys.
void visible_key_range(const AttentionConfig& config, int64_t context, int64_t seq_len, int q_begin,
                       int q_end, int64_t* first, int64_t* end);

}  // namespace pagedattn::cpu
