// The connector logic shared by the storage and Redis connectors: which full prompt blocks to
// load and save (scheduler side), and the worker threads that move them between the paged
// caches and a BlockStore (worker side). Only the store differs between the two.
//
// Worker side, per step:
//   start_load_kv      posts one job to the loader thread: open every entry and check its
//                      header; read each entry's data whole and check every layer's CRC (an
//                      entry that fails any check is dropped: nothing of it reaches a cache,
//                      and its blocks are reported as load errors); then copy the entries into
//                      the caches layer by layer (model order), publishing "layer i done".
//                      Entries are read in waves of at most max_load_staging_mb.
//   wait_for_layer_load waits for "layer i done": a layer's attention starts while later
//                      layers are still being copied in.
//   save_kv_layer      posts the layer's copies to the gather thread (overlapping the next
//                      layers' compute); an entry whose last layer is copied goes to the writer
//                      threads, which serialise it and put it in the store.
//   wait_for_save      waits for the step's copies (not the writes; at most max_inflight_mb of
//                      copied entries wait for their writes before it blocks).
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "connector/block_store.h"
#include "connector/work_queue.h"
#include "pagedattn/connector.h"
#include "pagedattn/tensor.h"

namespace pagedattn::connector {

/// One full prompt block of one request to load or save.
struct BlockTransfer {
  int request_id = 0;
  int block_index = 0;  ///< logical block j: tokens [j*block_size, (j+1)*block_size)
  uint64_t hash = 0, parent_hash = 0;
  std::vector<int32_t> token_ids;  ///< the block's tokens
  std::vector<int32_t> block_ids;  ///< [group] physical block; 0 = not held in that group
};

/// The per-step metadata of the built-in connectors.
class BlockTransferMetadata final : public KVConnectorMetadata {
 public:
  std::vector<BlockTransfer> loads;
  std::vector<BlockTransfer> saves;
};

class BlockStoreConnector : public KVConnector {
 public:
  /// `make_store` builds the store object of each thread that uses it. Options read here:
  /// io_threads (writer threads, default 2), max_inflight_mb (default 256) and
  /// max_load_staging_mb (default 256).
  BlockStoreConnector(const KVConnectorConfig& config, KVConnectorRole role, std::string name,
                      StoreFactory make_store);
  /// Flushes the writes, then stops the threads.
  ~BlockStoreConnector() override;

  std::string_view name() const override { return name_; }

  void bind_connector_metadata(std::shared_ptr<const KVConnectorMetadata> metadata) override;
  void clear_connector_metadata() override;
  void start_load_kv(ForwardContext& context) override;
  void wait_for_layer_load(std::string_view layer_name) override;
  void save_kv_layer(std::string_view layer_name, const KVCacheView& kv_layer,
                     const AttentionMetadata& metadata, KVScales scales) override;
  void wait_for_save() override;
  std::vector<int32_t> get_block_ids_with_load_errors() override;
  void flush() override;

  KVConnectorMatch get_num_new_matched_tokens(const KVConnectorRequest& request,
                                              int num_computed_tokens) override;
  void update_state_after_alloc(const KVConnectorRequest& request,
                                std::span<const std::vector<int32_t>> block_ids,
                                int num_external_tokens) override;
  std::shared_ptr<const KVConnectorMetadata> build_connector_meta(
      const KVConnectorSchedulerOutput& output) override;
  void update_connector_output(std::span<const int32_t> invalid_block_ids) override;
  bool request_finished(const KVConnectorRequest& request,
                        std::span<const std::vector<int32_t>> block_ids) override;

  KVConnectorStats stats() const override;

 private:
  struct SaveEntry;
  struct LoadJob;
  struct RequestState {
    std::vector<uint64_t> hashes;      // chain hashes of the prompt's full blocks
    int load_begin = 0, load_end = 0;  // blocks to load in the next step
    bool load_pending = false;
    bool save_checked = false;  // asked the store which leading blocks it holds
    int saved_upto = 0;         // blocks [0, saved_upto) are stored or scheduled
  };
  struct Lookup {
    int64_t asked = 0, found = 0;
    bool error = false;
  };

  void log(const std::string& message) const;
  BlockStore& scheduler_store();
  int layer_index(std::string_view name) const;
  const std::vector<uint64_t>& prompt_hashes(RequestState& st, const KVConnectorRequest& r) const;
  void run_load(LoadJob& job, BlockStore& store);
  void gather_layer(int layer, const KVCacheView& cache, KVScales scales);
  void write_entry(const std::shared_ptr<SaveEntry>& entry, BlockStore& store);
  void settle_step();

  std::string name_;
  StoreFactory make_store_;
  std::string namespace_;
  std::unordered_map<std::string, int> layer_index_;
  size_t layer_bytes_ = 0;
  int64_t max_inflight_bytes_ = 0;
  int64_t max_load_staging_bytes_ = 0;

  // Scheduler side (one thread).
  std::unique_ptr<BlockStore> scheduler_store_;
  std::map<int, RequestState> requests_;
  std::map<int, Lookup> last_lookup_;                  // request -> its latest lookup
  std::map<int32_t, std::pair<int, int>> step_loads_;  // block id -> (request, block index)

  // Worker side. mu_ guards everything below and the counters.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  mutable std::mutex log_mu_;
  mutable int logged_ = 0;
  std::shared_ptr<LoadJob> load_;                  // this step's loads (null: none)
  std::vector<std::shared_ptr<SaveEntry>> saves_;  // this step's saves
  std::vector<char> layer_saved_;                  // [layer] save_kv_layer seen this step
  int pending_gathers_ = 0;
  int pending_writes_ = 0;
  int64_t inflight_bytes_ = 0;  // copied entries waiting for their write
  std::vector<std::unique_ptr<BlockStore>> loader_stores_, writer_stores_;
  KVConnectorStats stats_;

  // Threads last: they stop (joining) before the state above is destroyed.
  std::unique_ptr<WorkQueue> loader_, gatherer_, writers_;
};

}  // namespace pagedattn::connector
