// Continuous batching over a paged KV cache: a token budget per step, decodes first, chunked
// prefill, prefix caching, preemption by recompute, and sliding-window groups that give back
// the blocks that fell out of their window.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <vector>

#include "pagedattn/connector.h"
#include "sim/block_pool.h"

namespace pagedattn::sim {

/// Scheduler limits and the KV-cache groups it fills.
struct SchedulerConfig {
  int block_size = 16;               ///< tokens per block
  int max_num_batched_tokens = 512;  ///< new tokens per step
  int max_num_seqs = 32;             ///< running requests at once
  int64_t max_model_len = 2048;      ///< prompt + output of any request
  bool enable_prefix_caching = true;
  /// One entry per KV-cache group: its sliding window (tokens visible, current included), or
  /// nullopt for full attention. Every group draws its blocks from the one pool.
  std::vector<std::optional<int>> group_windows{std::nullopt};

  /// Throws InvalidArgument naming the field, its value and the bound.
  void validate() const;
};

/// A request inside the engine.
struct Request {
  int id = 0;
  std::vector<int32_t> token_ids;  ///< prompt, then the generated tokens
  int prompt_len = 0;
  int max_output_len = 1;       ///< finished after generating this many tokens
  int num_computed_tokens = 0;  ///< tokens whose K/V are in the cache (computed or hit)
  /// [group][logical block] physical block ids; kNullBlock where a window released the block.
  std::vector<std::vector<int32_t>> block_ids;
  std::vector<int> num_registered_blocks;  ///< [group] leading blocks offered to the cache
  std::vector<uint64_t> block_hashes;      ///< chain hashes of the full blocks of token_ids
  int num_preemptions = 0;
  bool finished = false;

  int num_tokens() const { return int(token_ids.size()); }
  int num_output_tokens() const { return num_tokens() - prompt_len; }
};

/// One request of a step.
struct ScheduledRequest {
  int request_id = 0;
  int context_len = 0;        ///< tokens already cached (computed earlier or a prefix hit)
  int num_new_tokens = 0;     ///< query tokens this step
  bool is_decode = false;     ///< one new token after at least one generated token
  int prefix_hit_tokens = 0;  ///< tokens found in the prefix cache when admitted this step
  /// Tokens after the prefix hit that the KV connector loads during this step (counted in
  /// context_len: the step's attention reads them).
  int external_hit_tokens = 0;
  std::vector<std::vector<int32_t>> block_ids;  ///< [group] the request's block table rows
};

/// What one step runs.
struct SchedulerOutput {
  std::vector<ScheduledRequest> requests;  ///< decodes first, then prefill chunks
  int num_decode_tokens = 0;
  int num_prefill_tokens = 0;
  std::vector<int> preempted;  ///< requests sent back to the waiting queue by this step
  int num_scheduled_tokens() const { return num_decode_tokens + num_prefill_tokens; }
};

/// Counters over the whole run.
struct SchedulerStats {
  int64_t lookup_tokens = 0;      ///< tokens of admitted requests (prefix-cache queries)
  int64_t prefix_hit_tokens = 0;  ///< of which found in the cache
  int64_t admissions = 0;         ///< requests moved from waiting to running (resumes included)
  int64_t preemptions = 0;
  int64_t window_blocks_released = 0;  ///< blocks freed because they left a sliding window
  int64_t partial_prefill_chunks = 0;  ///< prefill chunks that left part of the prompt for later
  int64_t peak_blocks_used = 0;        ///< most blocks in use after any schedule()
  int64_t external_hit_tokens = 0;     ///< tokens of admitted requests the connector loaded
  int64_t load_error_requests = 0;     ///< request steps undone because a load failed
  int64_t load_error_tokens = 0;       ///< computed tokens those undone steps gave back
};

/// Continuous batching, one step at a time: schedule(), run the step, update().
///
/// schedule() fills a budget of max_num_batched_tokens new tokens: first one token for every
/// running request that is decoding, then prefill chunks of running requests, then (when no
/// request was preempted this step and fewer than max_num_seqs run) waiting requests in FIFO
/// order, each starting after the longest prefix of its full blocks found in the cache (at
/// least one prompt token is always computed). When a running request needs a block and none
/// is free, the lowest-priority running request not yet scheduled this step (the one admitted
/// last) is preempted: its blocks are freed and it goes back to the head of the waiting queue,
/// to be recomputed. Before allocating for a request, each sliding-window group frees the
/// blocks wholly before position num_computed_tokens - window + 1 and puts the null block in
/// their place.
class Scheduler {
 public:
  /// A scheduler over a pool of `num_blocks` blocks (block 0 is the null block).
  Scheduler(const SchedulerConfig& config, int64_t num_blocks);

  /// The scheduler-side KV connector (not owned; nullptr = none). When set, an admitted
  /// request asks it how many tokens past its prefix-cache hit the external store holds; those
  /// are allocated and counted as computed (the worker loads them in the step), and the
  /// connector hears of every allocation and finished request.
  void set_kv_connector(KVConnector* connector) { connector_ = connector; }
  /// The connector's view of a step's requests (spans into this scheduler's requests, valid
  /// until the next schedule() or update()).
  KVConnectorSchedulerOutput connector_output(const SchedulerOutput& output) const;

  /// A request arriving now (joins the waiting queue). Throws InvalidArgument for an empty
  /// prompt, max_output_len < 1, a length past max_model_len or a duplicate id.
  void add_request(int id, std::vector<int32_t> prompt, int max_output_len);
  /// Picks the next step's requests and allocates their blocks.
  SchedulerOutput schedule();
  /// After the step ran: advances each scheduled request, registers its newly full blocks in
  /// the prefix cache, appends `sample(request)` to every request that computed all its
  /// tokens, and finishes (frees) the ones that reached max_output_len. Returns their ids.
  /// A request holding one of `invalid_block_ids` (blocks the connector failed to load) is
  /// instead set back to the first such block: its step's results are discarded and the
  /// tokens from there on are computed again (it keeps its blocks).
  std::vector<int> update(const SchedulerOutput& output,
                          const std::function<int32_t(const Request&)>& sample,
                          std::span<const int32_t> invalid_block_ids = {});
  /// True when `request` holds one of `invalid_block_ids` (update() then undoes its step).
  static bool holds_any(const ScheduledRequest& request,
                        std::span<const int32_t> invalid_block_ids);

  const Request& request(int id) const;
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  int num_waiting() const { return int(waiting_.size()); }
  int num_running() const { return int(running_.size()); }
  const std::vector<int>& running() const { return running_; }
  const std::deque<int>& waiting() const { return waiting_; }
  const SchedulerStats& stats() const { return stats_; }
  const BlockPool& pool() const { return pool_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  struct PrefixHit {
    int num_blocks = 0;                           // hit length in blocks
    std::vector<std::vector<int32_t>> block_ids;  // [group] null before a window, then hits
  };
  Request& get(int id);
  void extend_hashes(Request& r) const;
  PrefixHit find_prefix_hit(Request& r) const;
  void release_out_of_window(Request& r);
  int64_t blocks_to_allocate(const Request& r, int end) const;
  bool allocate(Request& r, int num_new_tokens);
  void preempt(int id);
  void finish(Request& r);
  bool try_schedule_running(int id, int num_new_tokens, std::set<int>& scheduled,
                            SchedulerOutput& out);
  bool try_admit(int id, int& budget, SchedulerOutput& out);
  void record(const Request& r, int num_new_tokens, int prefix_hit_tokens, int external_tokens,
              SchedulerOutput& out);
  KVConnectorRequest connector_request(const Request& r) const;

  SchedulerConfig config_;
  BlockPool pool_;
  std::map<int, Request> requests_;
  std::deque<int> waiting_;   // FIFO; preempted requests go back to the front
  std::vector<int> running_;  // admission order = priority (last = preempted first)
  SchedulerStats stats_;
  KVConnector* connector_ = nullptr;
};

}  // namespace pagedattn::sim
