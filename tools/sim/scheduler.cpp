#include "sim/scheduler.h"

#include <algorithm>
#include <climits>

#include "pagedattn/error.h"

namespace pagedattn::sim {

using detail::require;

namespace {
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

void SchedulerConfig::validate() const {
  require(block_size >= 1, "block_size (", block_size, ") must be >= 1");
  require(max_num_batched_tokens >= 1, "max_num_batched_tokens (", max_num_batched_tokens,
          ") must be >= 1");
  require(max_num_seqs >= 1, "max_num_seqs (", max_num_seqs, ") must be >= 1");
  require(max_model_len >= 2, "max_model_len (", max_model_len, ") must be >= 2");
  require(!group_windows.empty(), "group_windows must name at least one KV-cache group");
  for (size_t g = 0; g < group_windows.size(); ++g) {
    require(!group_windows[g] || *group_windows[g] >= 1, "group_windows[", g, "] (",
            group_windows[g].value_or(0), ") must be >= 1");
  }
}

Scheduler::Scheduler(const SchedulerConfig& config, int64_t num_blocks)
    : config_(config), pool_(num_blocks) {
  config_.validate();
}

Request& Scheduler::get(int id) {
  const auto it = requests_.find(id);
  require(it != requests_.end(), "Scheduler: no request ", id);
  return it->second;
}

const Request& Scheduler::request(int id) const {
  const auto it = requests_.find(id);
  require(it != requests_.end(), "Scheduler: no request ", id);
  return it->second;
}

void Scheduler::add_request(int id, std::vector<int32_t> prompt, int max_output_len) {
  require(!prompt.empty(), "request ", id, ": the prompt is empty");
  require(max_output_len >= 1, "request ", id, ": max_output_len (", max_output_len,
          ") must be >= 1");
  require(int64_t(prompt.size()) + max_output_len <= config_.max_model_len, "request ", id,
          ": prompt (", prompt.size(), ") + max_output_len (", max_output_len,
          ") exceeds max_model_len (", config_.max_model_len, ")");
  require(requests_.count(id) == 0, "request ", id, " was already added");
  Request r;
  r.id = id;
  r.prompt_len = int(prompt.size());
  r.token_ids = std::move(prompt);
  r.max_output_len = max_output_len;
  r.block_ids.resize(config_.group_windows.size());
  r.num_registered_blocks.assign(config_.group_windows.size(), 0);
  requests_.emplace(id, std::move(r));
  waiting_.push_back(id);
}

void Scheduler::extend_hashes(Request& r) const {
  extend_block_hashes(r.block_hashes, r.token_ids, config_.block_size);
}

Scheduler::PrefixHit Scheduler::find_prefix_hit(Request& r) const {
  const int bs = config_.block_size;
  const size_t num_groups = config_.group_windows.size();
  PrefixHit hit;
  hit.block_ids.resize(num_groups);
  if (!config_.enable_prefix_caching) return hit;
  extend_hashes(r);
  // At least one token is computed: the hit covers at most num_tokens - 1 tokens.
  int k = (r.num_tokens() - 1) / bs;
  // Full-attention groups need every block of the prefix.
  for (size_t g = 0; g < num_groups; ++g) {
    if (config_.group_windows[g]) continue;
    int j = 0;
    while (j < k && pool_.lookup(int(g), r.block_hashes[size_t(j)])) ++j;
    k = j;
  }
  // Sliding-window groups need only the blocks the first new token's window reaches. A miss
  // at block j rules out every hit length in (j, k], whose windows all contain j.
  auto first_needed = [&](int len_blocks, int window) {
    return std::max(0, len_blocks * bs - window + 1) / bs;
  };
  for (bool changed = true; changed && k > 0;) {
    changed = false;
    for (size_t g = 0; g < num_groups && !changed; ++g) {
      if (!config_.group_windows[g]) continue;
      for (int j = k - 1; j >= first_needed(k, *config_.group_windows[g]); --j) {
        if (!pool_.lookup(int(g), r.block_hashes[size_t(j)])) {
          k = j;
          changed = true;
          break;
        }
      }
    }
  }
  hit.num_blocks = k;
  for (size_t g = 0; g < num_groups; ++g) {
    const int first = config_.group_windows[g] ? first_needed(k, *config_.group_windows[g]) : 0;
    for (int j = 0; j < k; ++j) {
      hit.block_ids[g].push_back(j < first ? kNullBlock
                                           : *pool_.lookup(int(g), r.block_hashes[size_t(j)]));
    }
  }
  return hit;
}

void Scheduler::release_out_of_window(Request& r) {
  for (size_t g = 0; g < config_.group_windows.size(); ++g) {
    if (!config_.group_windows[g]) continue;
    // The next token, at position num_computed_tokens, sees keys from this position on.
    const int first_pos = r.num_computed_tokens - *config_.group_windows[g] + 1;
    if (first_pos <= 0) continue;
    std::vector<int32_t>& ids = r.block_ids[g];
    const size_t skipped = std::min(ids.size(), size_t(first_pos / config_.block_size));
    for (size_t j = 0; j < skipped; ++j) {
      if (ids[j] == kNullBlock) continue;
      pool_.free(std::span<const int32_t>(&ids[j], 1));
      ids[j] = kNullBlock;
      ++stats_.window_blocks_released;
    }
  }
}

int64_t Scheduler::blocks_to_allocate(const Request& r, int end) const {
  int64_t n = 0;
  for (const std::vector<int32_t>& ids : r.block_ids) {
    n += std::max<int64_t>(0, ceil_div(end, config_.block_size) - int64_t(ids.size()));
  }
  return n;
}

bool Scheduler::allocate(Request& r, int num_new_tokens) {
  release_out_of_window(r);
  const int end = r.num_computed_tokens + num_new_tokens;
  if (blocks_to_allocate(r, end) > pool_.num_free_blocks()) return false;
  for (std::vector<int32_t>& ids : r.block_ids) {
    const int64_t n = ceil_div(end, config_.block_size) - int64_t(ids.size());
    if (n <= 0) continue;
    const std::vector<int32_t> fresh = pool_.allocate(n);
    ids.insert(ids.end(), fresh.begin(), fresh.end());
  }
  return true;
}

void Scheduler::finish(Request& r) {
  // Free the tail first: it then leaves the cache before the (more shareable) head.
  for (std::vector<int32_t>& ids : r.block_ids) {
    std::vector<int32_t> reversed(ids.rbegin(), ids.rend());
    pool_.free(reversed);
    ids.clear();
  }
  std::fill(r.num_registered_blocks.begin(), r.num_registered_blocks.end(), 0);
  running_.erase(std::find(running_.begin(), running_.end(), r.id));
}

void Scheduler::preempt(int id) {
  Request& r = get(id);
  finish(r);
  r.num_computed_tokens = 0;
  ++r.num_preemptions;
  ++stats_.preemptions;
  waiting_.push_front(id);
}

KVConnectorRequest Scheduler::connector_request(const Request& r) const {
  KVConnectorRequest v;
  v.request_id = r.id;
  v.token_ids = r.token_ids;
  v.num_prompt_tokens = r.prompt_len;
  v.num_computed_tokens = r.num_computed_tokens;
  v.block_hashes = r.block_hashes;
  return v;
}

KVConnectorSchedulerOutput Scheduler::connector_output(const SchedulerOutput& output) const {
  KVConnectorSchedulerOutput c;
  for (const ScheduledRequest& s : output.requests) {
    KVConnectorScheduledRequest k;
    k.request = connector_request(request(s.request_id));
    k.block_ids = s.block_ids;
    k.num_computed_tokens = s.context_len;
    k.num_new_tokens = s.num_new_tokens;
    c.requests.push_back(k);
  }
  return c;
}

bool Scheduler::holds_any(const ScheduledRequest& request,
                          std::span<const int32_t> invalid_block_ids) {
  for (const std::vector<int32_t>& ids : request.block_ids) {
    for (const int32_t b : ids) {
      if (b != kNullBlock && std::find(invalid_block_ids.begin(), invalid_block_ids.end(), b) !=
                                 invalid_block_ids.end()) {
        return true;
      }
    }
  }
  return false;
}

void Scheduler::record(const Request& r, int num_new_tokens, int prefix_hit_tokens,
                       int external_tokens, SchedulerOutput& out) {
  ScheduledRequest s;
  s.request_id = r.id;
  s.context_len = r.num_computed_tokens;
  s.num_new_tokens = num_new_tokens;
  s.is_decode = num_new_tokens == 1 && r.num_output_tokens() >= 1 &&
                r.num_computed_tokens + 1 == r.num_tokens();
  s.prefix_hit_tokens = prefix_hit_tokens;
  s.external_hit_tokens = external_tokens;
  s.block_ids = r.block_ids;
  (s.is_decode ? out.num_decode_tokens : out.num_prefill_tokens) += num_new_tokens;
  if (!s.is_decode && r.num_computed_tokens + num_new_tokens < r.prompt_len) {
    ++stats_.partial_prefill_chunks;
  }
  out.requests.push_back(std::move(s));
}

bool Scheduler::try_schedule_running(int id, int num_new_tokens, std::set<int>& scheduled,
                                     SchedulerOutput& out) {
  Request& r = get(id);
  while (!allocate(r, num_new_tokens)) {
    // Preempt the lowest-priority running request that is not in this step yet.
    int victim = id;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if (scheduled.count(*it) == 0) {
        victim = *it;
        break;
      }
    }
    preempt(victim);
    out.preempted.push_back(victim);
    if (victim == id) return false;
  }
  scheduled.insert(id);
  record(r, num_new_tokens, 0, 0, out);
  return true;
}

bool Scheduler::try_admit(int id, int& budget, SchedulerOutput& out) {
  Request& r = get(id);
  const PrefixHit hit = find_prefix_hit(r);
  const int hit_tokens = hit.num_blocks * config_.block_size;
  // Tokens past the local hit that the KV connector's store holds: loaded during the step.
  KVConnectorRequest view = connector_request(r);
  view.num_computed_tokens = hit_tokens;
  int external = 0;
  if (connector_) {
    external = connector_->get_num_new_matched_tokens(view, hit_tokens).num_tokens.value_or(0);
    require(external >= 0 && external % config_.block_size == 0 &&
                hit_tokens + external <= r.num_tokens() - 1,
            "Scheduler: the KV connector offers ", external, " tokens to request ", id,
            " after a hit of ", hit_tokens, " of ", r.num_tokens(),
            "; expected whole blocks leaving one token to compute");
  }
  const int num_new = std::min(r.num_tokens() - hit_tokens - external, budget);
  // Blocks the request takes from the free queue: revived cached blocks and fresh ones.
  std::set<int32_t> revived;
  for (const std::vector<int32_t>& ids : hit.block_ids) {
    for (const int32_t b : ids) {
      if (b != kNullBlock && pool_.is_free(b)) revived.insert(b);
    }
  }
  int64_t fresh = 0;
  for (const std::vector<int32_t>& ids : hit.block_ids) {
    fresh += std::max<int64_t>(
        0, ceil_div(hit_tokens + external + num_new, config_.block_size) - int64_t(ids.size()));
  }
  if (int64_t(revived.size()) + fresh > pool_.num_free_blocks()) return false;
  for (size_t g = 0; g < hit.block_ids.size(); ++g) {
    for (const int32_t b : hit.block_ids[g]) {
      if (b != kNullBlock) pool_.touch(b);
    }
    r.block_ids[g] = hit.block_ids[g];
    r.num_registered_blocks[g] = hit.num_blocks;
  }
  r.num_computed_tokens = hit_tokens + external;
  const bool ok = allocate(r, num_new);
  require(ok, "Scheduler: request ", id, " could not allocate the blocks it was admitted with");
  if (connector_) connector_->update_state_after_alloc(view, r.block_ids, external);
  waiting_.pop_front();
  running_.push_back(id);
  ++stats_.admissions;
  stats_.lookup_tokens += r.num_tokens();
  stats_.prefix_hit_tokens += hit_tokens;
  stats_.external_hit_tokens += external;
  record(r, num_new, hit_tokens, external, out);
  budget -= num_new;
  return true;
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int budget = config_.max_num_batched_tokens;
  std::set<int> scheduled;
  // 1. Decodes: one token each.
  for (const int id : std::vector<int>(running_)) {
    if (budget == 0) break;
    const Request& r = get(id);
    if (r.finished || std::find(running_.begin(), running_.end(), id) == running_.end()) continue;
    const bool decoding = r.num_output_tokens() >= 1 && r.num_computed_tokens + 1 == r.num_tokens();
    if (decoding && try_schedule_running(id, 1, scheduled, out)) --budget;
  }
  // 2. Prefill chunks of running requests.
  for (const int id : std::vector<int>(running_)) {
    if (budget == 0) break;
    if (scheduled.count(id) != 0) continue;
    if (std::find(running_.begin(), running_.end(), id) == running_.end()) continue;  // preempted
    const Request& r = get(id);
    const int num_new = std::min(r.num_tokens() - r.num_computed_tokens, budget);
    if (try_schedule_running(id, num_new, scheduled, out)) budget -= num_new;
  }
  // 3. Waiting requests, unless memory was short this step.
  while (out.preempted.empty() && budget > 0 && !waiting_.empty() &&
         int(running_.size()) < config_.max_num_seqs) {
    if (!try_admit(waiting_.front(), budget, out)) break;
  }
  // Decodes first: the admitted requests may include resumed one-token steps.
  std::stable_partition(out.requests.begin(), out.requests.end(),
                        [](const ScheduledRequest& s) { return s.is_decode; });
  stats_.peak_blocks_used = std::max(stats_.peak_blocks_used, pool_.num_used_blocks());
  return out;
}

std::vector<int> Scheduler::update(const SchedulerOutput& output,
                                   const std::function<int32_t(const Request&)>& sample,
                                   std::span<const int32_t> invalid_block_ids) {
  std::vector<int> finished;
  const int bs = config_.block_size;
  for (const ScheduledRequest& s : output.requests) {
    Request& r = get(s.request_id);
    require(r.num_computed_tokens == s.context_len, "Scheduler::update: request ", r.id, " has ",
            r.num_computed_tokens, " computed tokens; the step assumed ", s.context_len);
    if (!invalid_block_ids.empty() && holds_any(s, invalid_block_ids)) {
      // A block the connector was to load holds no valid data: recompute from the first one.
      int first = INT_MAX;
      for (const std::vector<int32_t>& ids : s.block_ids) {
        for (size_t j = 0; j < ids.size(); ++j) {
          if (ids[j] != kNullBlock && std::find(invalid_block_ids.begin(), invalid_block_ids.end(),
                                                ids[j]) != invalid_block_ids.end()) {
            first = std::min(first, int(j));
          }
        }
      }
      const int back_to = std::min(r.num_computed_tokens, first * bs);
      ++stats_.load_error_requests;
      stats_.load_error_tokens += s.context_len + s.num_new_tokens - back_to;
      r.num_computed_tokens = back_to;
      continue;
    }
    r.num_computed_tokens += s.num_new_tokens;
    if (config_.enable_prefix_caching) {
      extend_hashes(r);
      const int full = r.num_computed_tokens / bs;
      for (size_t g = 0; g < r.block_ids.size(); ++g) {
        for (int j = r.num_registered_blocks[g]; j < full; ++j) {
          const int32_t b = r.block_ids[g][size_t(j)];
          if (b != kNullBlock) pool_.cache(int(g), r.block_hashes[size_t(j)], b);
        }
        r.num_registered_blocks[g] = std::max(r.num_registered_blocks[g], full);
      }
    }
    if (r.num_computed_tokens == r.num_tokens()) {
      r.token_ids.push_back(sample(r));
      if (r.num_output_tokens() >= r.max_output_len) {
        if (connector_) connector_->request_finished(connector_request(r), r.block_ids);
        finish(r);
        r.finished = true;
        finished.push_back(r.id);
      }
    }
  }
  return finished;
}

}  // namespace pagedattn::sim
