#include "connector/block_store_connector.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "connector/block_copy.h"
#include "connector/crc32c.h"
#include "connector/kv_entry.h"
#include "pagedattn/error.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/layer.h"

namespace pagedattn::connector {

using detail::cat;
using detail::require;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string crc_text(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

EntryIdentity identity_of(const BlockTransfer& t) {
  return {t.hash, t.parent_hash, t.token_ids};
}

}  // namespace

/// One block being saved: its layers are copied one by one (as their attention finishes),
/// then the entry is written.
struct BlockStoreConnector::SaveEntry {
  BlockTransfer transfer;
  std::vector<Tensor> layers;  // [layer] host [2, block_size, num_kv_heads, head_size]
  std::vector<uint32_t> crcs;  // [layer]
  std::vector<KVScales> scales;
  int remaining = 0;      // layers not copied yet (only the gather thread touches it)
  bool not_held = false;  // some layer's group no longer holds the block
};

/// One step's loads.
struct BlockStoreConnector::LoadJob {
  std::vector<BlockTransfer> entries;
  std::vector<KVCacheView> caches;  // [layer]; undefined = the layer is not in the context
  std::vector<KVScales> scales;     // [layer] the layers' current scales (checked for fp8)
  std::vector<char> failed;         // [entry], set when done
  int layers_done = 0;              // layers [0, layers_done) are in their caches
  bool done = false;
};

BlockStoreConnector::BlockStoreConnector(const KVConnectorConfig& config, KVConnectorRole role,
                                         std::string name, StoreFactory make_store)
    : KVConnector(config, role), name_(std::move(name)), make_store_(std::move(make_store)) {
  const KVConnectorConfig& c = this->config();
  namespace_ = c.namespace_name();
  for (size_t i = 0; i < c.layers.size(); ++i) layer_index_[c.layers[i].name] = int(i);
  layer_bytes_ = entry_layer_bytes(c);
  const int io_threads = int(c.int_option("io_threads", 2, 1, 64));
  max_inflight_bytes_ = c.int_option("max_inflight_mb", 256, 1, int64_t(1) << 20) << 20;
  max_load_staging_bytes_ = c.int_option("max_load_staging_mb", 256, 1, int64_t(1) << 20) << 20;
  if (role == KVConnectorRole::kWorker) {
    loader_stores_.resize(1);
    writer_stores_.resize(size_t(io_threads));
    loader_ = std::make_unique<WorkQueue>(1);
    gatherer_ = std::make_unique<WorkQueue>(1);
    writers_ = std::make_unique<WorkQueue>(io_threads);
  }
}

BlockStoreConnector::~BlockStoreConnector() {
  if (role() == KVConnectorRole::kWorker) {
    settle_step();
    flush();
  }
  // Join the threads while the state they use is alive.
  writers_.reset();
  gatherer_.reset();
  loader_.reset();
}

void BlockStoreConnector::log(const std::string& message) const {
  if (!config().log) return;
  std::lock_guard<std::mutex> lock(log_mu_);
  constexpr int kMaxMessages = 50;
  if (logged_ < kMaxMessages) {
    config().log(cat(name_, " connector: ", message));
  } else if (logged_ == kMaxMessages) {
    config().log(cat(name_, " connector: further messages suppressed"));
  }
  ++logged_;
}

int BlockStoreConnector::layer_index(std::string_view name) const {
  const auto it = layer_index_.find(std::string(name));
  return it == layer_index_.end() ? -1 : it->second;
}

// ---------------------------------------------------------------------------------------------
// Scheduler side.

BlockStore& BlockStoreConnector::scheduler_store() {
  if (!scheduler_store_) scheduler_store_ = make_store_();
  return *scheduler_store_;
}

const std::vector<uint64_t>& BlockStoreConnector::prompt_hashes(RequestState& st,
                                                                const KVConnectorRequest& r) const {
  const int bs = config().block_size;
  const size_t prompt_blocks = size_t(r.num_prompt_tokens / bs);
  if (st.hashes.size() < prompt_blocks) {
    const size_t known = std::min(prompt_blocks, r.block_hashes.size());
    if (known > st.hashes.size())
      st.hashes.assign(r.block_hashes.begin(), r.block_hashes.begin() + ptrdiff_t(known));
    extend_block_hashes(st.hashes, r.token_ids.first(size_t(r.num_prompt_tokens)), bs);
  }
  return st.hashes;
}

KVConnectorMatch BlockStoreConnector::get_num_new_matched_tokens(const KVConnectorRequest& r,
                                                                 int num_computed_tokens) {
  require(role() == KVConnectorRole::kScheduler, "get_num_new_matched_tokens: ", name_,
          " connector was built for the ", to_string(role()), " role");
  require(r.num_prompt_tokens >= 0 && size_t(r.num_prompt_tokens) <= r.token_ids.size(),
          "get_num_new_matched_tokens: request ", r.request_id, " has num_prompt_tokens ",
          r.num_prompt_tokens, " of ", r.token_ids.size(), " tokens");
  last_lookup_.erase(r.request_id);
  if (config().kv_role == KVTransferRole::kProducer) return {0, false};
  const int bs = config().block_size;
  // At least one token is computed, as with a local prefix hit; only prompt blocks are stored.
  const int limit = std::min(r.num_prompt_tokens / bs, (int(r.token_ids.size()) - 1) / bs);
  if (num_computed_tokens % bs != 0) return {0, false};
  const int start = num_computed_tokens / bs;
  if (start >= limit) return {0, false};
  const std::vector<uint64_t>& hashes = prompt_hashes(requests_[r.request_id], r);
  const std::optional<size_t> found = scheduler_store().count_present(
      std::span<const uint64_t>(hashes).subspan(size_t(start), size_t(limit - start)));
  Lookup& lk = last_lookup_[r.request_id];
  lk.asked = limit - start;
  lk.found = int64_t(found.value_or(0));
  lk.error = !found;
  return {int(lk.found) * bs, false};
}

void BlockStoreConnector::update_state_after_alloc(const KVConnectorRequest& r,
                                                   std::span<const std::vector<int32_t>>,
                                                   int num_external_tokens) {
  require(role() == KVConnectorRole::kScheduler, "update_state_after_alloc: ", name_,
          " connector was built for the ", to_string(role()), " role");
  const int bs = config().block_size;
  require(num_external_tokens >= 0 && num_external_tokens % bs == 0,
          "update_state_after_alloc: request ", r.request_id, ": num_external_tokens (",
          num_external_tokens, ") must be a non-negative multiple of block_size (", bs, ")");
  if (const auto it = last_lookup_.find(r.request_id); it != last_lookup_.end()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.lookups;
    stats_.lookup_blocks += it->second.asked;
    stats_.hit_blocks += it->second.found;
    stats_.miss_blocks += it->second.asked - it->second.found;
    stats_.lookup_errors += it->second.error ? 1 : 0;
    last_lookup_.erase(it);
  }
  if (num_external_tokens == 0) return;
  require(r.num_computed_tokens % bs == 0, "update_state_after_alloc: request ", r.request_id,
          ": num_computed_tokens (", r.num_computed_tokens, ") is not block-aligned");
  RequestState& st = requests_[r.request_id];
  st.load_begin = r.num_computed_tokens / bs;
  st.load_end = st.load_begin + num_external_tokens / bs;
  st.load_pending = true;
}

std::shared_ptr<const KVConnectorMetadata> BlockStoreConnector::build_connector_meta(
    const KVConnectorSchedulerOutput& output) {
  require(role() == KVConnectorRole::kScheduler, "build_connector_meta: ", name_,
          " connector was built for the ", to_string(role()), " role");
  auto meta = std::make_shared<BlockTransferMetadata>();
  const int bs = config().block_size;
  const bool saves = config().kv_role != KVTransferRole::kConsumer;
  step_loads_.clear();
  int64_t scheduled = 0, not_held = 0;
  for (const KVConnectorScheduledRequest& s : output.requests) {
    const KVConnectorRequest& r = s.request;
    RequestState& st = requests_[r.request_id];
    const std::vector<uint64_t>& hashes = prompt_hashes(st, r);
    auto make = [&](int j) {
      BlockTransfer t;
      t.request_id = r.request_id;
      t.block_index = j;
      t.hash = hashes[size_t(j)];
      t.parent_hash = j == 0 ? kNoParentHash : hashes[size_t(j - 1)];
      const auto tokens = r.token_ids.subspan(size_t(j) * size_t(bs), size_t(bs));
      t.token_ids.assign(tokens.begin(), tokens.end());
      for (const std::vector<int32_t>& row : s.block_ids) {
        t.block_ids.push_back(size_t(j) < row.size() ? row[size_t(j)] : 0);
      }
      return t;
    };
    if (st.load_pending) {
      st.load_pending = false;
      for (int j = st.load_begin; j < st.load_end && size_t(j) < hashes.size(); ++j) {
        BlockTransfer t = make(j);
        for (const int32_t b : t.block_ids) {
          if (b != 0) step_loads_[b] = {r.request_id, j};
        }
        meta->loads.push_back(std::move(t));
      }
      st.saved_upto = std::max(st.saved_upto, st.load_end);  // already in the store
    }
    if (!saves) continue;
    if (!st.save_checked) {
      // Leading blocks the store already holds (another instance saved them) are not saved.
      st.save_checked = true;
      if (!hashes.empty()) {
        st.saved_upto =
            std::max(st.saved_upto, int(scheduler_store().count_present(hashes).value_or(0)));
      }
    }
    const int end = std::min(s.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) / bs;
    for (int j = st.saved_upto; j < end; ++j) {
      BlockTransfer t = make(j);
      if (std::count(t.block_ids.begin(), t.block_ids.end(), 0) > 0) {
        ++not_held;  // a sliding-window group released it: the entry would be incomplete
        continue;
      }
      meta->saves.push_back(std::move(t));
      ++scheduled;
    }
    st.saved_upto = std::max(st.saved_upto, end);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.save_scheduled += scheduled;
  stats_.save_not_held += not_held;
  return meta;
}

void BlockStoreConnector::update_connector_output(std::span<const int32_t> invalid_block_ids) {
  // A block that failed to load is recomputed; save it again so the store is repaired.
  for (const int32_t b : invalid_block_ids) {
    const auto it = step_loads_.find(b);
    if (it == step_loads_.end()) continue;
    const auto st = requests_.find(it->second.first);
    if (st != requests_.end()) {
      st->second.saved_upto = std::min(st->second.saved_upto, it->second.second);
    }
  }
}

bool BlockStoreConnector::request_finished(const KVConnectorRequest& r,
                                           std::span<const std::vector<int32_t>>) {
  requests_.erase(r.request_id);
  last_lookup_.erase(r.request_id);
  return false;
}

// ---------------------------------------------------------------------------------------------
// Worker side.

void BlockStoreConnector::bind_connector_metadata(
    std::shared_ptr<const KVConnectorMetadata> metadata) {
  require(role() == KVConnectorRole::kWorker, "bind_connector_metadata: ", name_,
          " connector was built for the ", to_string(role()), " role");
  const auto* m = dynamic_cast<const BlockTransferMetadata*>(metadata.get());
  require(metadata != nullptr && m != nullptr, "bind_connector_metadata: ", name_,
          " connector got metadata of another connector type");
  settle_step();  // a step that was not cleared
  KVConnector::bind_connector_metadata(std::move(metadata));
  const size_t n = config().layers.size();
  std::lock_guard<std::mutex> lock(mu_);
  saves_.clear();
  for (const BlockTransfer& t : m->saves) {
    auto e = std::make_shared<SaveEntry>();
    e->transfer = t;
    e->layers.resize(n);
    e->crcs.assign(n, 0);
    e->scales.assign(n, KVScales{});
    e->remaining = int(n);
    saves_.push_back(std::move(e));
  }
  layer_saved_.assign(n, 0);
}

void BlockStoreConnector::clear_connector_metadata() {
  settle_step();
  KVConnector::clear_connector_metadata();
}

void BlockStoreConnector::settle_step() {
  if (role() != KVConnectorRole::kWorker) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (load_) cv_.wait(lock, [this] { return load_->done; });
  load_.reset();
  cv_.wait(lock, [this] { return pending_gathers_ == 0; });
  for (const auto& e : saves_) {
    if (e->remaining > 0 || e->not_held) ++stats_.save_dropped;  // never written half
  }
  saves_.clear();
  layer_saved_.clear();
}

void BlockStoreConnector::start_load_kv(ForwardContext& context) {
  const auto* m = static_cast<const BlockTransferMetadata*>(connector_metadata());
  require(m != nullptr, "start_load_kv: ", name_, " connector has no metadata bound");
  if (m->loads.empty()) return;
  const KVConnectorConfig& c = config();
  auto job = std::make_shared<LoadJob>();
  job->entries = m->loads;
  job->caches.resize(c.layers.size());
  job->scales.resize(c.layers.size());
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const Attention* layer = context.layer(c.layers[i].name);
    if (layer == nullptr) continue;
    const KVCacheView cache = layer->kv_cache();
    require<NotSupported>(cache.head_size_v() == cache.head_size(), "start_load_kv: layer ",
                          c.layers[i].name, " has V of head size ", cache.head_size_v(),
                          " and K of ", cache.head_size(),
                          "; the KV connectors store K and V of one head size");
    require(cache.block_size() == c.block_size && cache.num_kv_heads() == c.num_kv_heads &&
                cache.head_size() == c.head_size && cache.dtype() == c.cache_dtype,
            "start_load_kv: layer ", c.layers[i].name, " has a cache of block size ",
            cache.block_size(), ", ", cache.num_kv_heads(), " KV heads, head size ",
            cache.head_size(), ", ", dtype_name(cache.dtype()), "; the ", name_,
            " connector was configured for ", c.block_size, ", ", c.num_kv_heads, ", ", c.head_size,
            ", ", dtype_name(c.cache_dtype));
    job->caches[i] = cache;
    job->scales[i] = layer->kv_scales();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    load_ = job;
  }
  loader_->post([this, job](int t) {
    if (!loader_stores_[size_t(t)]) loader_stores_[size_t(t)] = make_store_();
    run_load(*job, *loader_stores_[size_t(t)]);
  });
}

void BlockStoreConnector::run_load(LoadJob& job, BlockStore& store) {
  const auto t0 = Clock::now();
  const KVConnectorConfig& c = config();
  const size_t n = job.entries.size(), num_layers = c.layers.size();
  std::vector<char> failed(n, 0);
  std::vector<std::unique_ptr<EntryReader>> readers(n);
  std::vector<EntryLayout> layouts(n);
  int64_t missing = 0, unavailable = 0, rejected = 0;
  auto reject = [&](size_t e, const std::string& why) {
    failed[e] = 1;
    ++rejected;
    log(cat("rejected entry ", hex64(job.entries[e].hash), " (request ", job.entries[e].request_id,
            ", block ", job.entries[e].block_index, "): ", why, "; the block is recomputed"));
  };
  try {
    // 1. Open every entry and check its header: nothing is copied from an entry whose header
    //    is not exactly what this engine would write.
    for (size_t e = 0; e < n; ++e) {
      const OpenStatus status = store.open(job.entries[e].hash, readers[e]);
      if (status != OpenStatus::kOk) {
        failed[e] = 1;
        ++(status == OpenStatus::kMissing ? missing : unavailable);
        continue;
      }
      EntryReader& rd = *readers[e];
      uint8_t prefix[8];
      if (rd.size() < 8 || !rd.read(0, prefix, 8)) {
        reject(e, cat("only ", rd.size(), " bytes"));
        continue;
      }
      const uint64_t header_len = entry_header_length(prefix);
      if (header_len > kMaxEntryHeaderBytes || header_len > rd.size() - 8) {
        reject(e, cat("header length ", header_len, " does not fit the entry's ", rd.size(),
                      " bytes"));
        continue;
      }
      std::string header(size_t(header_len), '\0');
      if (!rd.read(8, header.data(), header.size())) {
        reject(e, "the header cannot be read");
        continue;
      }
      EntryCheck check = check_entry_header(header, rd.size(), c, namespace_,
                                            identity_of(job.entries[e]), job.scales);
      if (!check.ok) {
        reject(e, check.reason);
        continue;
      }
      layouts[e] = std::move(check.layout);
    }
    // 2. In waves of at most max_load_staging_mb: read every entry's data whole and check
    //    each layer's CRC, so that only whole, verified entries reach a cache; then copy
    //    layer by layer. The last wave publishes "layer i done" as it goes, so the first
    //    layers' attention runs while the later layers are copied.
    size_t next = 0;
    while (next < n) {
      std::vector<size_t> wave;
      std::vector<std::vector<uint8_t>> data;
      int64_t staged = 0;
      for (; next < n && (wave.empty() || staged < max_load_staging_bytes_); ++next) {
        if (failed[next]) continue;
        const uint64_t begin = layouts[next].data_begin;
        std::vector<uint8_t> bytes(size_t(readers[next]->size() - begin));
        if (!readers[next]->read(begin, bytes.data(), bytes.size())) {
          reject(next, "the data cannot be read");
          continue;
        }
        readers[next].reset();
        bool ok = true;
        for (size_t i = 0; i < num_layers && ok; ++i) {
          const uint8_t* layer = bytes.data() + (layouts[next].layer_offset[i] - begin);
          const uint32_t crc = crc32c(layer, layer_bytes_);
          if (crc != layouts[next].layer_crc[i]) {
            reject(next, cat("layer ", c.layers[i].name, " CRC-32C is ", crc_text(crc),
                             ", the header says ", crc_text(layouts[next].layer_crc[i])));
            ok = false;
          }
        }
        if (!ok) continue;
        staged += int64_t(bytes.size());
        wave.push_back(next);
        data.push_back(std::move(bytes));
      }
      const bool last = next >= n;
      for (size_t i = 0; i < num_layers; ++i) {
        const KVCacheView& cache = job.caches[i];
        const size_t group = size_t(c.layers[i].kv_cache_group);
        for (size_t w = 0; w < wave.size() && cache.defined(); ++w) {
          const size_t e = wave[w];
          const std::vector<int32_t>& ids = job.entries[e].block_ids;
          const int32_t block = group < ids.size() ? ids[group] : 0;
          const uint8_t* layer =
              data[w].data() + (layouts[e].layer_offset[i] - layouts[e].data_begin);
          if (block != 0) scatter_block(cache, block, layer);
        }
        if (last) {
          std::lock_guard<std::mutex> lock(mu_);
          job.layers_done = int(i + 1);
          cv_.notify_all();
        }
      }
    }
  } catch (const std::exception& ex) {
    // Not a store failure (those never throw): fail the rest of the step's loads loudly.
    log(cat("loading failed: ", ex.what()));
    for (size_t e = 0; e < n; ++e) {
      if (!failed[e]) {
        failed[e] = 1;
        ++unavailable;
      }
    }
  }
  const int64_t ok = int64_t(n) - std::count(failed.begin(), failed.end(), 1);
  std::lock_guard<std::mutex> lock(mu_);
  job.failed = std::move(failed);
  job.layers_done = int(num_layers);
  job.done = true;
  stats_.loaded_blocks += ok;
  stats_.loaded_bytes += ok * int64_t(layer_bytes_ * num_layers);
  stats_.missing_blocks += missing;
  stats_.unavailable_blocks += unavailable;
  stats_.rejected_blocks += rejected;
  stats_.load_seconds += seconds_since(t0);
  cv_.notify_all();
}

void BlockStoreConnector::wait_for_layer_load(std::string_view layer_name) {
  const int i = layer_index(layer_name);
  if (i < 0) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (!load_) return;
  cv_.wait(lock, [this, i] { return load_->done || load_->layers_done > i; });
}

std::vector<int32_t> BlockStoreConnector::get_block_ids_with_load_errors() {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  if (!load_) return out;
  cv_.wait(lock, [this] { return load_->done; });
  for (size_t e = 0; e < load_->entries.size(); ++e) {
    if (!load_->failed[e]) continue;
    for (const int32_t b : load_->entries[e].block_ids) {
      if (b != 0) out.push_back(b);
    }
  }
  return out;
}

void BlockStoreConnector::save_kv_layer(std::string_view layer_name, const KVCacheView& kv_layer,
                                        const AttentionMetadata&, KVScales scales) {
  const int i = layer_index(layer_name);
  if (i < 0) return;
  const KVConnectorConfig& c = config();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (saves_.empty() || layer_saved_[size_t(i)]) return;
    require<NotSupported>(kv_layer.head_size_v() == kv_layer.head_size(), "save_kv_layer: layer ",
                          layer_name, " has V of head size ", kv_layer.head_size_v(), " and K of ",
                          kv_layer.head_size(),
                          "; the KV connectors store K and V of one head size");
    require(kv_layer.block_size() == c.block_size && kv_layer.num_kv_heads() == c.num_kv_heads &&
                kv_layer.head_size() == c.head_size && kv_layer.dtype() == c.cache_dtype,
            "save_kv_layer: layer ", layer_name, " has a cache of block size ",
            kv_layer.block_size(), ", ", kv_layer.num_kv_heads(), " KV heads, head size ",
            kv_layer.head_size(), ", ", dtype_name(kv_layer.dtype()), "; the ", name_,
            " connector was configured for ", c.block_size, ", ", c.num_kv_heads, ", ", c.head_size,
            ", ", dtype_name(c.cache_dtype));
    layer_saved_[size_t(i)] = 1;
    ++pending_gathers_;
  }
  gatherer_->post([this, i, kv_layer, scales](int) { gather_layer(i, kv_layer, scales); });
}

void BlockStoreConnector::gather_layer(int layer, const KVCacheView& cache, KVScales scales) {
  const auto t0 = Clock::now();
  const KVConnectorConfig& c = config();
  std::vector<std::shared_ptr<SaveEntry>> entries, ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries = saves_;
  }
  const size_t group = size_t(c.layers[size_t(layer)].kv_cache_group);
  for (const auto& e : entries) {
    const std::vector<int32_t>& ids = e->transfer.block_ids;
    const int32_t block = group < ids.size() ? ids[group] : 0;
    if (block == 0) {
      e->not_held = true;
    } else {
      try {
        Tensor t = Tensor::empty({2, c.block_size, c.num_kv_heads, c.head_size}, c.cache_dtype);
        gather_block(cache, block, t.data());
        e->crcs[size_t(layer)] = crc32c(t.data(), layer_bytes_);
        e->layers[size_t(layer)] = std::move(t);
      } catch (const std::exception& ex) {
        log(cat("cannot copy block ", block, " of layer ", c.layers[size_t(layer)].name, ": ",
                ex.what()));
        e->not_held = true;
      }
    }
    e->scales[size_t(layer)] = scales;
    if (--e->remaining == 0 && !e->not_held) ready.push_back(e);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : ready) {
    inflight_bytes_ += int64_t(layer_bytes_ * c.layers.size());
    ++pending_writes_;
    writers_->post([this, e](int t) {
      if (!writer_stores_[size_t(t)]) writer_stores_[size_t(t)] = make_store_();
      write_entry(e, *writer_stores_[size_t(t)]);
    });
  }
  --pending_gathers_;
  stats_.save_seconds += seconds_since(t0);
  cv_.notify_all();
}

void BlockStoreConnector::write_entry(const std::shared_ptr<SaveEntry>& entry, BlockStore& store) {
  const auto t0 = Clock::now();
  const KVConnectorConfig& c = config();
  bool ok = false;
  std::string error;
  try {
    const std::vector<uint8_t> bytes = serialize_entry(c, namespace_, identity_of(entry->transfer),
                                                       entry->layers, entry->crcs, entry->scales);
    entry->layers.clear();  // the serialised copy is all the write needs
    ok = store.put(entry->transfer.hash, bytes, error);
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  if (!ok) {
    log(cat("cannot save entry ", hex64(entry->transfer.hash), " (request ",
            entry->transfer.request_id, ", block ", entry->transfer.block_index, "): ", error));
  }
  const int64_t bytes = int64_t(layer_bytes_ * c.layers.size());
  std::lock_guard<std::mutex> lock(mu_);
  inflight_bytes_ -= bytes;
  --pending_writes_;
  if (ok) {
    ++stats_.saved_blocks;
    stats_.saved_bytes += bytes;
  } else {
    ++stats_.save_errors;
  }
  stats_.save_seconds += seconds_since(t0);
  cv_.notify_all();
}

void BlockStoreConnector::wait_for_save() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_gathers_ == 0; });
  // Bounded memory: copied entries past the limit wait for their writes.
  cv_.wait(lock, [this] { return inflight_bytes_ <= max_inflight_bytes_; });
}

void BlockStoreConnector::flush() {
  if (role() != KVConnectorRole::kWorker) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_writes_ == 0 && pending_gathers_ == 0; });
}

KVConnectorStats BlockStoreConnector::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace pagedattn::connector
